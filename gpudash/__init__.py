"""gpudash: see and tune GPU memory from a Jupyter notebook.

A faithful Python port of TensorFlow's BFC allocator with event hooks, backends (simulated
device, host memory, CUDA through CuPy), sessions that mirror ``ConfigProto``/``GPUOptions``
and can be reconfigured while they run, trace replay, and notebook views.

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

# name -> module that defines it (imported on first attribute access)
_LAZY = {
    "BFCAllocator": "gpudash.bfc",
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
    "ConfigProto": "gpudash.options",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpudash' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
