"""Sample files that ship with gpudash (so notebooks and docs work from a wheel install).

Sample traces, made by ``benchmarks/make_samples.py`` (deterministically):

- ``training.gdtrace``: a training loop (10 steps, 12 layers);
- ``inference.gdtrace``: an inference server (120 requests);
- ``fragmentation.gdtrace``: a fragmentation stress (700 rounds).

Files TensorFlow 2.21 wrote (copies of ``tests/data/real/``, whose README says how they
were made), for :func:`gpudash.explain` and :func:`gpudash.trace.load_trace`:

- ``tf_oom_mixed.log``: an out-of-memory error with the allocator's dump (limit reached);
- ``tf_oom_fragment.log``: a fragmentation out-of-memory error (two dumps);
- ``tf_mlp_training.xplane.pb``: a profile of two epochs of a Keras MLP.

Files from PyTorch 2.13 (copies of ``tests/data/real/``), for who holds the memory:

- ``torch_mlp.profile.json.gz``: the profiler trace (memory events and Python stacks) of four
  training steps of an MLP on the CPU, with a leak;
- ``torch_mlp.replayed_snapshot.pickle``: that trace's calls replayed by gpudash's model of
  PyTorch's CUDA caching allocator, as the snapshot PyTorch writes (with the stacks).

>>> from gpudash import samples
>>> samples.names()
['fragmentation.gdtrace', 'inference.gdtrace', 'training.gdtrace']
>>> samples.path("training.gdtrace").name
'training.gdtrace'
>>> samples.path("tf_oom_mixed.log").name
'tf_oom_mixed.log'
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .._errors import ConfigError
from ..formats.io import load_trace

__all__ = ["names", "files", "path", "load"]

#: The files TensorFlow wrote (the rest of the samples are ``.gdtrace`` traces).
TENSORFLOW_FILES = ("tf_mlp_training.xplane.pb", "tf_oom_fragment.log", "tf_oom_mixed.log")
#: The files from PyTorch: its profiler's trace, and a replay of it as PyTorch's snapshot.
TORCH_FILES = ("torch_mlp.profile.json.gz", "torch_mlp.replayed_snapshot.pickle")


def _folder() -> Path:
    return Path(str(resources.files(__name__)))


def names() -> list[str]:
    """The sample traces' file names."""
    return sorted(p.name for p in _folder().glob("*.gdtrace"))


def files() -> list[str]:
    """Every sample file's name: the sample traces and the files TensorFlow wrote."""
    folder = _folder()
    return sorted(names() + [n for n in TENSORFLOW_FILES + TORCH_FILES
                             if (folder / n).is_file()])


def path(name: str) -> Path:
    """The path of one sample file (``"training.gdtrace"``, or ``"training"`` for a trace;
    ``"tf_oom_mixed.log"``)."""
    if isinstance(name, str) and "." not in name:
        name = f"{name}.gdtrace"
    if name not in files():
        kind = "trace" if isinstance(name, str) and name.endswith(".gdtrace") else "file"
        raise ConfigError(f"no sample {kind} {name!r}; the samples are: {', '.join(files())}")
    return _folder() / name


def load(name: str):
    """Load one sample as a trace (:func:`gpudash.trace.load_trace`)."""
    return load_trace(path(name))
