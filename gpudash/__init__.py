"""gpudash: see and tune GPU memory from a Jupyter notebook.

Faithful models of two allocators, each with event hooks and a compiled twin: TensorFlow's
(and JAX's) BFC allocator (:class:`BFCAllocator`) and PyTorch's caching allocator
(:class:`CachingAllocator`). Around them: backends (simulated device, host memory, CUDA
through CuPy), sessions that take either allocator's settings in its framework's words
(``ConfigProto``/``GPUOptions``, ``PYTORCH_CUDA_ALLOC_CONF``) and can be reconfigured while
they run, traces imported from both frameworks with replay and what-if, monitors of a running
TensorFlow, JAX or PyTorch, and a live dashboard.

Public names are loaded on first use, so ``import gpudash`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._errors import (
    BackendUnavailableError,
    ConfigError,
    GpudashError,
    GpudashWarning,
    InvalidPointerError,
    OutOfMemoryError,
    TraceFormatError,
)
from ._version import __version__
from .live.views import register_view

# name -> module that defines it (imported on first attribute access)
_LAZY = {
    "BFCAllocator": "gpudash.bfc",
    "CachingAllocator": "gpudash.caching",
    "CachingAllocatorConfig": "gpudash.caching",
    "AllocatorStats": "gpudash.bfc",
    "MemoryDump": "gpudash.bfc",
    "MemChunk": "gpudash.bfc",
    "BinSummary": "gpudash.bfc",
    "RegionInfo": "gpudash.bfc",
    "Event": "gpudash.events",
    "EventKind": "gpudash.events",
    "Recorder": "gpudash.recorder",
    "SimulatedDevice": "gpudash.devices",
    "HostMemory": "gpudash.devices",
    "CudaMemory": "gpudash.devices",
    "GPUOptions": "gpudash.options",
    "Session": "gpudash.session",
    "Device": "gpudash.session",
    "default_session": "gpudash.session",
    "Dashboard": "gpudash.widgets.dashboard",
    "LiveModel": "gpudash.live.model",
    "WhatIfView": "gpudash.widgets.whatif",
    "BackgroundTask": "gpudash.background",
    "run_in_background": "gpudash.background",
    "Trace": "gpudash.trace",
    "load_trace": "gpudash.trace",
    "replay": "gpudash.trace.replay",
    "min_fraction": "gpudash.trace.whatif",
    "sweep": "gpudash.trace.whatif",
    "explain": "gpudash.postmortem",
    "top_holders": "gpudash.trace.holders",
    "diff_holders": "gpudash.trace.diff",
    "ConfigProto": "gpudash.options",
    "watch": "gpudash.monitors",
}

# Submodules reachable as attributes without an import of their own (``gpudash.torch``).
_SUBMODULES = ("torch", "monitors", "samples")

__all__ = [
    "__version__",
    "GpudashError",
    "OutOfMemoryError",
    "InvalidPointerError",
    "ConfigError",
    "BackendUnavailableError",
    "TraceFormatError",
    "GpudashWarning",
    *_LAZY,
]


def _dashboard(source: Any, **options: Any) -> Any:
    """``Dashboard(source, **options)``: the view a monitor's ``dashboard()`` opens."""
    from .widgets.dashboard import Dashboard  # late: anywidget, loaded when one opens

    return Dashboard(source, **options)


register_view("dashboard", _dashboard)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext gpudash``: register gpudash's magics (imported only now)."""
    from .magics import load_ipython_extension as _load  # late: IPython

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext gpudash``: remove the magics and restore CuPy's allocator."""
    from .magics import unload_ipython_extension as _unload  # late: IPython

    _unload(ipython)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"gpudash.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpudash' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
