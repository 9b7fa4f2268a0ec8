"""Framework monitors: TensorFlow's for real on its CPU BFC (in a subprocess, so that
``TF_CPU_ALLOCATOR_USE_BFC`` is read when TensorFlow starts), and the refusals of frameworks
that are missing or have no GPU, with the frameworks installed here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

import gpudash
from gpudash import ConfigError

HAVE_TF = importlib.util.find_spec("tensorflow") is not None
needs_tf = pytest.mark.skipif(not HAVE_TF, reason="tensorflow is not installed "
                              "(pip install -e '.[tf]' for tensorflow-cpu)")

TF_SCRIPT = textwrap.dedent("""
    import json, threading, time
    import tensorflow as tf
    import gpudash
    from gpudash.monitors import watch

    mon = watch("tensorflow", devices=["CPU:0"], interval=0.05)
    feed = mon.feeds[0]
    woke = threading.Event()
    feed.start(woke.set)
    thread_names = [t.name for t in threading.enumerate()]
    deadline = time.time() + 10
    while mon.polls < 3 and time.time() < deadline:
        time.sleep(0.02)
    first = feed.sample()
    sizes = [25, 25, 25, 25, 1000000, 1000000, 25]    # float32 counts
    keep, seen = [], []
    for n in sizes:
        keep.append(tf.zeros((n,), dtype=tf.float32))
        mon.poll()
        seen.append(feed.latest.stats.bytes_in_use)
    merged = feed.sample()   # several polls since the last sample: one merged sample
    again = feed.sample()    # nothing new yet
    peak = feed.latest.stats.peak_bytes_in_use
    del keep
    mon.poll()
    after_free = feed.latest.stats.bytes_in_use
    missing = list(feed.missing)
    lines = mon.restart_lines(fraction=0.5, allow_growth=True)
    feed.stop()   # the live model over the feeds closed: the monitor stops with it
    time.sleep(0.2)
    out = {"polls_before": first is not None, "woke": woke.is_set(),
           "thread": "gpudash-tensorflow-monitor" in thread_names,
           "seen": seen, "sizes": sizes, "peak": peak, "after_free": after_free,
           "merged_time": merged.time_ms if merged else None, "again": again is None,
           "running_after_stop": mon.running, "controls": feed.controls, "kind": feed.kind,
           "missing": missing, "lines": lines, "history": len(feed.history),
           "name": feed.name, "errors": list(mon.errors)}
    print("RESULT " + json.dumps(out))
""")


def _run_tf(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
    env.update({"TF_CPP_MIN_LOG_LEVEL": "3", **env_extra})
    proc = subprocess.run([sys.executable, "-c", TF_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=240)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[-1][len("RESULT "):])


def _bfc_prediction(sizes: list[int]) -> list[int]:
    """gpudash's BFC fed the same requests, with TensorFlow's CPU BFC settings
    (TF_CPU_BFC_MEM_LIMIT_IN_MB default 64 GiB, allow_growth=True)."""
    alloc = gpudash.BFCAllocator(gpudash.SimulatedDevice("128GiB"), 64 << 30, allow_growth=True)
    out = []
    for n in sizes:
        alloc.allocate(4 * n)
        out.append(alloc.bytes_in_use)
    return out


@needs_tf
@pytest.mark.slow
def test_tensorflow_monitor_on_the_cpu_bfc():
    r = _run_tf({"TF_CPU_ALLOCATOR_USE_BFC": "true"})
    # polled in a thread of its own, waking the feed's listener
    assert r["thread"] and r["woke"] and r["polls_before"] and r["history"] >= 3
    assert r["errors"] == []
    # real figures, and those of a BFC: the same bytes in use as gpudash's port of it,
    # request by request (100-byte tensors take 256 bytes; a 4 MB tensor first takes a whole
    # 4 MiB region, the next one a split of an 8 MiB region)
    assert r["seen"] == _bfc_prediction(r["sizes"])
    assert r["seen"][:4] == [256, 512, 768, 1024]
    assert r["peak"] >= r["seen"][-1]  # TensorFlow may hold a scratch tensor meanwhile
    assert r["after_free"] == 0
    assert r["again"] and r["merged_time"] is not None
    assert not r["running_after_stop"]
    assert r["kind"] == "tensorflow" and r["name"] == "tensorflow CPU:0"
    assert "restart" in r["controls"]
    assert "pool_bytes" in r["missing"]  # TensorFlow reports in use and peak only
    assert r["lines"][:2] == ["config.gpu_options.per_process_gpu_memory_fraction = 0.5",
                              "config.gpu_options.allow_growth = True"]


@needs_tf
@pytest.mark.slow
def test_tensorflow_cpu_without_bfc_is_not_a_bfc():
    """The check above can fail: TensorFlow's default CPU allocator gives other figures."""
    r = _run_tf({})
    assert r["seen"] != _bfc_prediction(r["sizes"])
    assert r["seen"][:4] == [0, 0, 0, 0]


@needs_tf
@pytest.mark.slow
def test_watch_tensorflow_without_gpu_and_the_magic():
    code = textwrap.dedent("""
        from IPython.core.error import UsageError
        from IPython.testing import globalipapp
        import gpudash
        try:
            gpudash.watch("tensorflow")
        except gpudash.ConfigError as exc:
            print("WATCH", exc)
        globalipapp.start_ipython()
        ip = globalipapp.get_ipython()
        ip.run_line_magic("load_ext", "gpudash")
        try:
            ip.run_line_magic("gpudash", "--watch tensorflow")
        except UsageError as exc:
            print("MAGIC", exc)
        # the CPU allocator, in the dashboard: read-only controls that say why
        dash = ip.run_line_magic("gpudash", "--watch tensorflow --device CPU:0")
        info = dash._controls_info(0)
        print("DASH", type(dash).__name__, dash.setup["devices"], info["has_layout"],
              info["restart"], "|", info["disabled"])
        drv = info["driver"]
        print("DRIVER", drv["available"], bool(drv["reason"]))
        mon = ip.magics_manager.registry["GpudashMagics"].monitor
        dash.close()
        print("STOPPED", not mon.running)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=240)
    out = proc.stdout
    assert "WATCH cannot watch tensorflow: TensorFlow sees no GPU here (its devices: CPU:0)" \
        in out, proc.stderr[-2000:]
    assert "MAGIC cannot watch tensorflow: TensorFlow sees no GPU here" in out
    assert "DASH Dashboard ['tensorflow CPU:0'] False True | TensorFlow fixes its " \
        "allocator's settings" in out, proc.stderr[-2000:]
    assert "STOPPED True" in out  # closing the dashboard stops the monitor
    # who else is on the GPU: here no driver, and the dashboard says why (NVML's reason)
    from gpudash.nvml import nvml_available

    ok, _ = nvml_available()
    assert f"DRIVER {ok} True" in out


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_watch_jax_without_gpu():
    import jax

    if any(d.platform != "cpu" for d in jax.devices()):
        pytest.skip("JAX has a GPU here")
    assert jax.devices()[0].memory_stats() is None  # what JAX gives on a CPU
    with pytest.raises(ConfigError, match=r"cannot watch jax: JAX has no GPU here "
                                          r"\(its devices: cpu:0"):
        gpudash.watch("jax")


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_watch_torch_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("PyTorch has CUDA here")
    assert torch.cuda.memory_stats() == {}  # what PyTorch gives without CUDA
    with pytest.raises(ConfigError, match="cannot watch torch: PyTorch has no CUDA device"):
        gpudash.watch("torch")
    with pytest.raises(ConfigError, match="cannot capture_oom: PyTorch has no CUDA device"):
        gpudash.torch.capture_oom("oom.pickle")


def test_watch_refuses_unknown_and_missing_frameworks(monkeypatch):
    with pytest.raises(ConfigError, match="watch accepts torch, jax or tensorflow; got 'mxnet'"):
        gpudash.watch("mxnet")
    from gpudash.monitors import _base

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax" else real(name, *a))
    with pytest.raises(ConfigError, match=r"cannot watch jax: it is not installed here "
                                          r"\(no module 'jax'\); watch accepts"):
        _base.require_installed("jax")


def test_magic_watch_refusals():
    from IPython.core.error import UsageError
    from IPython.testing import globalipapp

    globalipapp.start_ipython()  # once per process; later calls return None
    ip = globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "gpudash")
    try:
        with pytest.raises(UsageError, match="watch accepts torch, jax or tensorflow"):
            ip.run_line_magic("gpudash", "--watch mxnet")
    finally:
        ip.run_line_magic("unload_ext", "gpudash")


def test_importing_gpudash_and_its_monitors_imports_no_framework():
    code = ("import sys, gpudash, gpudash.monitors, gpudash.torch; gpudash.watch; "
            "print([m for m in ('tensorflow', 'jax', 'jaxlib', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout.strip()
    assert out == "[]"


def test_monitor_interval_is_checked():
    from gpudash.monitors._base import Monitor

    with pytest.raises(ConfigError, match=r"interval must be a number of seconds in \[0.01, 60\]"):
        Monitor(interval=0)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_oom_dispatch_never_raises_into_pytorch(tmp_path):
    """gpudash's one observer dispatches to each live capture; a snapshot that cannot be
    written (here: a CPU build of PyTorch, which has no CUDA snapshot) is recorded, not
    raised into PyTorch's allocator. The observer itself needs CUDA (test_monitors_gpu.py)."""
    from gpudash import _torch_hooks as hooks
    from gpudash import torch as gtorch

    cap = gtorch.OomCapture(str(tmp_path / "oom-{n}-{device}.pickle"), callback=None)
    seen = []
    cap._callback = seen.append
    hooks._listeners.append(__import__("weakref").ref(cap))
    try:
        hooks.dispatch(0, 1 << 30, 2 << 30, 3 << 20)
        hooks.dispatch(0, 1 << 20, 2 << 30, 3 << 20)
    finally:
        hooks._listeners[:] = [r for r in hooks._listeners if r() is not cap]
    assert [e["alloc"] for e in cap.events] == [1 << 30, 1 << 20]
    assert len(seen) == 2 and cap.paths == []
    assert len(cap.errors) == 2 and "oom-1-0.pickle" in cap.errors[0]
    cap.disable()
    hooks._listeners.append(__import__("weakref").ref(cap))
    hooks.dispatch(0, 1, 1, 1)
    assert len(cap.events) == 2  # disabled: nothing more
    hooks._listeners.clear()


def test_capture_oom_checks_the_directory(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        gpudash.torch.capture_oom(tmp_path / "missing" / "oom.pickle")
