"""The JAX and PyTorch monitors on a real GPU (marked ``gpu``: they skip without a CUDA device,
and without a CUDA build of the framework)."""

from __future__ import annotations

import importlib.util
import time

import pytest

import gpudash

pytestmark = pytest.mark.gpu


def _torch_cuda():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA device")
    return torch


def _jax_gpu():
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed")
    import jax

    if not any(d.platform in ("gpu", "cuda", "rocm") for d in jax.local_devices()):
        pytest.skip("this JAX has no GPU (pip install 'jax[cuda12]')")
    return jax


def _wait(pred, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_torch_monitor_layout_and_stats():
    torch = _torch_cuda()
    mon = gpudash.watch("torch", interval=60, snapshot_interval=0.1, history=1000)
    try:
        feed = mon.feeds[0]
        assert _wait(lambda: mon.polls >= 1)  # the thread's first poll
        xs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 3 << 20, 25 << 20)]
        torch.cuda.synchronize()
        mon._last_snapshot = 0.0  # the next poll reads the layout
        mon.poll()
        assert feed.latest.table is not None
        s = feed.latest.stats
        assert s.bytes_in_use == torch.cuda.memory_allocated(0)
        assert s.pool_bytes == torch.cuda.memory_reserved(0)
        t = feed.latest.table
        assert int(t["size"][t["in_use"]].sum()) == torch.cuda.memory_allocated(0)
        assert feed.has_layout and feed.controls
        del xs
    finally:
        mon.stop()


def test_torch_monitor_thread_follows_a_running_program():
    """As users run it: the thread polls, a layout every 0.5 s with the history of 100,000
    entries on, while the program allocates; latest is the newest poll, nothing is stuck,
    the pool is counted, and stop() returns at once."""
    torch = _torch_cuda()
    mon = gpudash.watch("torch", interval=0.05, snapshot_interval=0.5)
    feed = mon.feeds[0]
    xs = []
    try:
        end = time.time() + 6
        while time.time() < end:
            xs.append(torch.empty(4 << 20, dtype=torch.uint8, device="cuda"))
            if len(xs) > 64:
                del xs[:32]
            time.sleep(0.01)
        torch.cuda.synchronize()
        polls = mon.polls
        assert _wait(lambda: mon.polls >= polls + 5), "the thread stopped polling"
        assert feed.error is None, feed.error
        assert _wait(lambda: (feed.latest.stats.bytes_in_use, feed.latest.stats.pool_bytes)
                     == (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)))
        assert mon._layout_wall is not None and time.time() - mon._layout_wall < 2
        view = mon.driver_view()
        if view["available"]:
            assert view["devices"][0]["pool"] > 0
    finally:
        t0 = time.monotonic()
        mon.stop()
        stopped = time.monotonic() - t0
    s = feed.latest.stats
    assert (feed.latest.time_ms, s.bytes_in_use, s.pool_bytes, s.bytes_limit) == \
        feed.history[-1]
    assert stopped < 3, f"stop() took {stopped:.1f} s"
    del xs


def test_torch_capture_oom(tmp_path):
    torch = _torch_cuda()
    from gpudash.formats.torch_snapshot import load_torch_snapshot_dict

    cap = gpudash.torch.capture_oom(tmp_path / "oom-{n}.pickle", history=1000)
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(4 * total, dtype=torch.uint8, device="cuda")
    cap.disable()
    assert cap.events and cap.events[0]["alloc"] >= 4 * total
    snap = load_torch_snapshot_dict(cap.paths[0])
    assert "segments" in snap
    assert any(e.get("action") == "oom" for trace in snap.get("device_traces", []) for e in trace)


def test_jax_monitor_figures_and_limit():
    jax = _jax_gpu()
    import jax.numpy as jnp

    mon = gpudash.watch("jax", interval=60)
    try:
        feed = mon.feeds[0]
        x = jnp.ones((1 << 20,), dtype=jnp.float32).block_until_ready()
        mon.poll()
        s = feed.latest.stats
        raw = jax.local_devices()[0].memory_stats()
        assert s.bytes_in_use >= x.nbytes and s.bytes_limit == raw["bytes_limit"]
        settings = mon.jax_settings
        if settings is not None and settings.uses_bfc:
            import cupy

            with cupy.cuda.Device(0):
                total = cupy.cuda.runtime.memGetInfo()[1]
            # XLA's limit, as gpudash computes it (total x float32(fraction))
            assert raw["bytes_limit"] == settings.memory_limit(total)
        assert mon.restart_lines()[0].startswith("XLA_PYTHON_CLIENT_MEM_FRACTION=")
    finally:
        mon.stop()


def test_driver_view_marks_this_process():
    torch = _torch_cuda()
    mon = gpudash.watch("torch", interval=60, snapshot_interval=0, history=0)
    try:
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        mon.poll()
        view = mon.driver_view()
        assert view["available"]
        row = view["devices"][0]
        mine = [p for p in row["processes"] if p.is_self]
        if mine:  # NVML reports host PIDs: in a container without --pid=host nothing matches
            assert mine[0].framework == "torch"
            if row["driver"] is not gpudash.nvml.NA:
                assert row["driver"] >= row["pool"] >= x.numel()
        del x
    finally:
        mon.stop()
