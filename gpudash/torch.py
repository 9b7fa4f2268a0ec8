"""PyTorch helpers: save a memory snapshot when CUDA runs out of memory.

``capture_oom(path)`` registers PyTorch's out-of-memory observer
(``torch._C._cuda_attach_out_of_memory_observer``, called with ``(device, alloc,
device_allocated, device_free)`` just before PyTorch raises ``OutOfMemoryError``) and
writes ``torch.cuda.memory._dump_snapshot(path)`` at the failure. With the allocator's
history recorded (``torch.cuda.memory._record_memory_history(max_entries=...)``, a bounded
ring, on by default here) the snapshot holds the events that led to the failure; read it
with ``gpudash replay`` or ``gpudash.trace.load_trace``.

PyTorch cannot detach an observer, so gpudash attaches one, once per process
(:mod:`gpudash._torch_hooks`), and dispatches to the captures and monitors that are active;
:meth:`OomCapture.disable` stops one. PyTorch is imported only when these functions are called.

``attach()`` (shadow mode, :mod:`gpudash.torch_shadow`) follows a running job live: its
allocator's history through gpudash's exact model, controls that act on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._errors import ConfigError
from ._torch_hooks import DEFAULT_HISTORY_ENTRIES, listen, require_cuda, set_history

__all__ = ["capture_oom", "OomCapture", "record_history", "DEFAULT_HISTORY_ENTRIES", "attach",
           "Shadow", "install", "installed", "InstalledAllocator"]

def record_history(max_entries: int = DEFAULT_HISTORY_ENTRIES, stacks: str = "python") -> None:
    """Turn on recording of the CUDA allocator's history, bounded to ``max_entries`` (a ring:
    older entries are overwritten). ``max_entries=0`` turns it off."""
    set_history(require_cuda("record the allocator's history"), max_entries, stacks)


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
    require_cuda()
    if history:
        record_history(history)
    cap = OomCapture(str(Path(path).expanduser()), callback)
    listen(cap)
    _keep.append(cap)  # the observer list holds weak references
    return cap


_keep: list[OomCapture] = []


# shadow mode and install mode live in their own modules
from .torch_install import InstalledAllocator, install, installed  # noqa: E402
from .torch_shadow import Shadow, attach  # noqa: E402
