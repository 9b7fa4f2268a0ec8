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


def test_trace_package_names_stay():
    """``gpudash.trace`` still exports the loaders and the questions, now that the trace's
    format and importers live in ``gpudash.formats``: the same objects under both names."""
    import gpudash.formats as gf
    import gpudash.trace as gt

    assert set(gf.__all__) < set(gt.__all__)
    for name in gt.__all__:
        assert getattr(gt, name) is not None, name
    for name in gf.__all__:
        assert getattr(gt, name) is getattr(gf, name), name
    assert gpudash.Trace is gf.Trace and gpudash.load_trace is gf.load_trace


def test_module_paths_that_docs_named_still_import():
    """Code written from earlier docs (``from gpudash.trace.workloads import ...``) runs: the
    old paths are the moved modules themselves, in a fresh interpreter."""
    code = (
        "import importlib\n"
        "from gpudash.trace.torch_snapshot import load_torch_snapshot, load_torch_snapshot_dict\n"
        "from gpudash.trace.workloads import caching_snapshot, finetune_calls\n"
        "from gpudash.trace.perfetto import to_chrome_trace, write_chrome_trace\n"
        "import gpudash.trace.stacks as st, gpudash.trace.torch_profile as tp\n"
        "for old, new in [('trace.torch_snapshot', 'formats.torch_snapshot'),\n"
        "                 ('trace.workloads', 'workloads'), ('trace.perfetto', 'formats.perfetto'),\n"
        "                 ('trace.stacks', 'formats.stacks'),\n"
        "                 ('trace.torch_profile', 'formats.torch_profile')]:\n"
        "    assert importlib.import_module('gpudash.' + old) is \\\n"
        "        importlib.import_module('gpudash.' + new), old\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_live_layer_and_monitors_load_no_view():
    """Monitors and the live layer import no view (nor ipywidgets, anywidget or plotly):
    a monitor's dashboard is the view the package registered."""
    code = ("import sys, gpudash.monitors._base, gpudash.monitors._torch, gpudash.live.views, "
            "gpudash.torch\n"
            "print(sorted(m for m in sys.modules if m.startswith(('gpudash.widgets', "
            "'ipywidgets', 'anywidget', 'plotly'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
