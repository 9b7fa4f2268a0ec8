"""Sample traces that ship with gpudash (so notebooks and docs work from a wheel install).

- ``training.gdtrace``: a training loop (10 steps, 12 layers);
- ``inference.gdtrace``: an inference server (120 requests);
- ``fragmentation.gdtrace``: a fragmentation stress (700 rounds).

>>> from gpudash import samples
>>> samples.names()
['fragmentation.gdtrace', 'inference.gdtrace', 'training.gdtrace']
>>> samples.path("training.gdtrace").name
'training.gdtrace'

``benchmarks/make_samples.py`` writes them (deterministically).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .._errors import ConfigError

__all__ = ["names", "path", "load"]


def _folder() -> Path:
    return Path(str(resources.files(__name__)))


def names() -> list[str]:
    """The sample traces' file names."""
    return sorted(p.name for p in _folder().glob("*.gdtrace"))


def path(name: str) -> Path:
    """The file of one sample trace (``"training.gdtrace"``; ``"training"`` works too)."""
    if isinstance(name, str) and not name.endswith(".gdtrace"):
        name = f"{name}.gdtrace"
    if name not in names():
        raise ConfigError(f"no sample trace {name!r}; the samples are: {', '.join(names())}")
    return _folder() / name


def load(name: str):
    """Load one sample trace (:func:`gpudash.trace.load_trace`)."""
    from ..trace.io import load_trace

    return load_trace(path(name))
