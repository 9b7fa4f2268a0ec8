"""PyTorch helpers: save a memory snapshot when CUDA runs out of memory.

``capture_oom(path)`` registers PyTorch's out-of-memory observer
(``torch._C._cuda_attach_out_of_memory_observer``, called with ``(device, alloc,
device_allocated, device_free)`` just before PyTorch raises ``OutOfMemoryError``) and
writes ``torch.cuda.memory._dump_snapshot(path)`` at the failure. With the allocator's
history recorded (``torch.cuda.memory._record_memory_history(max_entries=...)``, a bounded
ring, on by default here) the snapshot holds the events that led to the failure; read it
with ``gpudash replay`` or ``gpudash.trace.load_trace``.

PyTorch cannot detach an observer, so gpudash attaches one, once per process, and
dispatches to the captures and monitors that are active; :meth:`OomCapture.disable` stops
one. PyTorch is imported only when these functions are called.

``attach()`` (shadow mode, :mod:`gpudash.torch_shadow`) follows a running job live: its
allocator's history through gpudash's exact model, controls that act on it.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._errors import ConfigError

__all__ = ["capture_oom", "OomCapture", "record_history", "DEFAULT_HISTORY_ENTRIES", "attach",
           "Shadow", "install", "InstalledAllocator"]

#: Ring size of the allocator history gpudash turns on (entries, each a few hundred bytes
#: plus its stack).
DEFAULT_HISTORY_ENTRIES = 100_000

_lock = threading.Lock()
_attached: list[Any] = []  # the torch modules gpudash's observer is attached to
_listeners: list[weakref.ref] = []


def _require_cuda(what: str = "capture_oom", torch: Any = None) -> Any:
    """``torch`` (imported unless given: a stand-in with its API for tests), checked."""
    if torch is None:
        from .monitors._base import require_installed

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


def _dispatch(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    with _lock:
        pairs = [(r, r()) for r in _listeners]
        _listeners[:] = [r for r, obj in pairs if obj is not None]
    for _, obj in pairs:
        if obj is not None:
            try:
                obj._on_oom(device, alloc, device_allocated, device_free)
            except Exception:  # noqa: BLE001 - never raise into PyTorch's allocator
                pass


def _listen(obj: Any, what: str = "capture_oom", torch: Any = None) -> None:
    """Call ``obj._on_oom(device, alloc, device_allocated, device_free)`` at each OOM."""
    torch = _require_cuda(what, torch)
    with _lock:
        _listeners.append(weakref.ref(obj))
        if not any(m is torch for m in _attached):
            torch._C._cuda_attach_out_of_memory_observer(_dispatch)
            _attached.append(torch)


def record_history(max_entries: int = DEFAULT_HISTORY_ENTRIES, stacks: str = "python") -> None:
    """Turn on recording of the CUDA allocator's history, bounded to ``max_entries`` (a ring:
    older entries are overwritten). ``max_entries=0`` turns it off."""
    _record_history(_require_cuda("record the allocator's history"), max_entries, stacks)


def _record_history(torch: Any, max_entries: int, stacks: str = "python") -> None:
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
        raise ConfigError(f"max_entries must be an integer >= 0 (0 = off); got {max_entries!r}")
    if max_entries == 0:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks)


class OomCapture:
    """An active :func:`capture_oom`.

    Attributes
    ----------
    path : str
        Where snapshots go (``{n}`` in it is replaced by the OOM count, ``{device}`` by the
        device).
    paths : list of str
        The snapshots written.
    events : list of dict
        Each OOM: ``time``, ``device``, ``alloc``, ``device_allocated``, ``device_free``.
    errors : list of str
        Snapshots that could not be written (the OOM itself is still raised by PyTorch).
    """

    def __init__(self, path: str, callback: Callable[[dict], Any] | None) -> None:
        self.path = path
        self.paths: list[str] = []
        self.events: list[dict] = []
        self.errors: list[str] = []
        self.enabled = True
        self._callback = callback

    def _on_oom(self, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        if not self.enabled:
            return
        import torch

        event = {"time": time.time(), "device": int(device), "alloc": int(alloc),
                 "device_allocated": int(device_allocated), "device_free": int(device_free)}
        self.events.append(event)
        path = self.path.format(n=len(self.events), device=device)
        try:
            torch.cuda.memory._dump_snapshot(path)
            self.paths.append(path)
        except Exception as exc:  # noqa: BLE001
            self.errors.append(f"{path}: {exc!r}")
        if self._callback is not None:
            self._callback(event)

    def disable(self) -> None:
        """Stop capturing (PyTorch keeps the observer; it no longer writes)."""
        self.enabled = False

    def __repr__(self) -> str:
        return (f"OomCapture({self.path!r}, {len(self.events)} OOM(s), "
                f"{'on' if self.enabled else 'off'})")


def capture_oom(path: str | os.PathLike = "oom_snapshot.pickle", *,
                history: int = DEFAULT_HISTORY_ENTRIES,
                callback: Callable[[dict], Any] | None = None) -> OomCapture:
    """Save a PyTorch memory snapshot whenever CUDA runs out of memory.

    Parameters
    ----------
    path : str or path
        The snapshot file (a pickle, as ``torch.cuda.memory._dump_snapshot`` writes);
        ``{n}`` and ``{device}`` are replaced by the OOM's number and device. Without them,
        each OOM overwrites the previous snapshot (PyTorch may call the observer more than
        once for one failure: convolutions retry with less workspace).
    history : int
        Turn on the allocator's history with this bounded ring (entries); 0 leaves the
        recording as it is.
    callback : callable, optional
        Called with the OOM's dict after the snapshot is written.

    Returns
    -------
    OomCapture

    Raises
    ------
    ConfigError
        PyTorch not installed, no CUDA device, a directory that does not exist.
    """
    path = os.fspath(path)
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"capture_oom: the directory of {path!r} does not exist ({parent})")
    _require_cuda()
    if history:
        record_history(history)
    cap = OomCapture(str(Path(path).expanduser()), callback)
    _listen(cap)
    _keep.append(cap)  # the observer list holds weak references
    return cap


_keep: list[OomCapture] = []


# shadow mode and install mode live in their own modules
from .torch_install import InstalledAllocator, install  # noqa: E402
from .torch_shadow import Shadow, attach  # noqa: E402
