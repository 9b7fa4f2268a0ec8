"""PyTorch's out-of-memory observer and allocator history, as gpudash attaches them.

PyTorch cannot detach an out-of-memory observer, so gpudash attaches one, once per process,
and :func:`dispatch` calls whoever listens (:func:`listen`: weak references to objects with an
``_on_oom`` method). :func:`gpudash.torch.capture_oom`, shadow mode
(:mod:`gpudash.torch_shadow`) and the PyTorch monitor (:mod:`gpudash.monitors`) all listen
through it, and turn on the allocator's history with :func:`set_history`. PyTorch is imported
only when these functions are called.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from ._errors import ConfigError
from .options import require_installed

__all__ = ["DEFAULT_HISTORY_ENTRIES", "require_cuda", "listen", "dispatch", "set_history"]

#: Ring size of the allocator history gpudash turns on (entries, each a few hundred bytes
#: plus its stack).
DEFAULT_HISTORY_ENTRIES = 100_000

_lock = threading.Lock()
_attached: list[Any] = []  # the torch modules gpudash's observer is attached to
_listeners: list[weakref.ref] = []


def require_cuda(what: str = "capture_oom", torch: Any = None) -> Any:
    """``torch`` (imported unless given: a stand-in with its API for tests), checked."""
    if torch is None:
        require_installed("torch")
        import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"cannot {what}: PyTorch has no CUDA device here (torch {torch.__version__}, CUDA "
            f"build {torch.version.cuda or 'none'}); it needs a CUDA build of PyTorch on a GPU")
    if not hasattr(torch._C, "_cuda_attach_out_of_memory_observer"):
        raise ConfigError(f"torch {torch.__version__} has no out-of-memory observer "
                          "(torch._C._cuda_attach_out_of_memory_observer); PyTorch >= 2.1 has")
    return torch


def dispatch(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    with _lock:
        pairs = [(r, r()) for r in _listeners]
        _listeners[:] = [r for r, obj in pairs if obj is not None]
    for _, obj in pairs:
        if obj is not None:
            try:
                obj._on_oom(device, alloc, device_allocated, device_free)
            except Exception:  # noqa: BLE001 - never raise into PyTorch's allocator
                pass


def listen(obj: Any, what: str = "capture_oom", torch: Any = None) -> None:
    """Call ``obj._on_oom(device, alloc, device_allocated, device_free)`` at each OOM."""
    torch = require_cuda(what, torch)
    with _lock:
        _listeners.append(weakref.ref(obj))
        if not any(m is torch for m in _attached):
            torch._C._cuda_attach_out_of_memory_observer(dispatch)
            _attached.append(torch)


def set_history(torch: Any, max_entries: int, stacks: str = "python") -> None:
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
        raise ConfigError(f"max_entries must be an integer >= 0 (0 = off); got {max_entries!r}")
    if max_entries == 0:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks)
