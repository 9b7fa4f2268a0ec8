"""The public names of ``gpudash`` are exactly the intended ones, and each one resolves."""

from __future__ import annotations

import subprocess
import sys

import gpudash

EXPECTED = {
    "__version__",
    # errors and warnings
    "GpudashError", "OutOfMemoryError", "InvalidPointerError", "ConfigError",
    "BackendUnavailableError", "TraceFormatError", "GpudashWarning",
    # allocators: TensorFlow's and JAX's BFC, PyTorch's caching allocator
    "BFCAllocator", "AllocatorStats", "MemoryDump", "MemChunk", "BinSummary", "RegionInfo",
    "CachingAllocator", "CachingAllocatorConfig",
    "Event", "EventKind", "Recorder",
    # backends
    "SimulatedDevice", "HostMemory", "CudaMemory",
    # sessions
    "GPUOptions", "ConfigProto", "Session", "Device", "default_session",
    # notebook
    "Dashboard", "LiveModel", "WhatIfView", "run_in_background", "BackgroundTask",
    # traces
    "Trace", "load_trace", "replay", "min_fraction", "sweep",
    # post-mortems and holders
    "explain", "top_holders", "diff_holders",
    # framework monitors
    "watch",
}


def test_all_is_exactly_the_intended_names():
    assert set(gpudash.__all__) == EXPECTED
    assert len(gpudash.__all__) == len(set(gpudash.__all__))


def test_every_public_name_resolves():
    for name in gpudash.__all__:
        assert getattr(gpudash, name) is not None, name


def test_import_is_cheap():
    """``import gpudash`` loads neither plotly, ipywidgets, CuPy nor NVML."""
    code = ("import sys, gpudash; heavy = [m for m in ('plotly', 'ipywidgets', 'cupy', 'pynvml') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout.strip()
    assert out == "[]"


def test_extension_entry_points_exist():
    assert callable(gpudash.load_ipython_extension)
    assert callable(gpudash.unload_ipython_extension)
