"""Routing CuPy's allocations through a gpudash Session (``install``/``uninstall``/``as_default``).

Without a GPU only the routing function and the wiring can be checked (a simulated device has
no memory behind its addresses, so CuPy must never be handed them for real kernels). The
``gpu`` tests run CuPy through the session on a real device.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import gpudash  # noqa: E402
from gpudash import BackendUnavailableError, Session  # noqa: E402
from gpudash.devices import CudaMemory  # noqa: E402

MiB = 1 << 20

HAVE_CUDA, CUDA_REASON = CudaMemory.available()
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason=f"needs CUDA: {CUDA_REASON}")


@pytest.fixture
def restore_cupy_allocator():
    """Whatever a test does, CuPy's allocators are as they were afterwards."""
    prev = cupy.cuda.get_allocator()
    yield prev
    cupy.cuda.set_allocator(prev)
    cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)


@pytest.fixture
def sim_session():
    sess = Session(simulate="1GiB", environ={}, poll=False)
    yield sess
    sess.close()


def _is_routed_to(allocator, sess) -> bool:
    return getattr(allocator, "__self__", None) is sess and getattr(
        allocator, "__func__", None) is Session._cupy_malloc


# ----------------------------------------------------------------------- simulated sessions


def test_install_on_simulated_session_refuses(sim_session, restore_cupy_allocator):
    before = cupy.cuda.get_allocator()
    with pytest.raises(BackendUnavailableError, match="simulated"):
        sim_session.install()
    assert cupy.cuda.get_allocator() == before
    assert sim_session.installed is False
    with pytest.raises(BackendUnavailableError):
        with sim_session.as_default():
            pass  # pragma: no cover
    assert cupy.cuda.get_allocator() == before
    sim_session.uninstall()  # nothing installed: a no-op
    assert cupy.cuda.get_allocator() == before


def test_cupy_malloc_allocates_from_the_session(sim_session, monkeypatch):
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    alloc = sim_session.allocator(0)
    dev = sim_session.devices[0]
    mp = sim_session._cupy_malloc(4096)
    assert isinstance(mp, cupy.cuda.MemoryPointer)
    assert alloc.name == "GPU_0_bfc"
    assert alloc.owns(mp.ptr)
    assert alloc.allocated_size(mp.ptr) == 4096
    assert alloc.requested_size(mp.ptr) == 4096
    assert mp.mem.size == 4096 and mp.device_id == 0
    assert alloc.bytes_in_use == 4096
    ptr = mp.ptr
    del mp
    gc.collect()
    # CuPy dropped it: the free went through deferred deletion.
    assert dev.deferred_bytes == 4096
    assert alloc.bytes_in_use == 4096
    sim_session.flush()
    assert alloc.bytes_in_use == 0 and dev.deferred_bytes == 0
    assert not alloc.owns(ptr)


def test_cupy_malloc_views_share_the_owner(sim_session, monkeypatch):
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    dev = sim_session.devices[0]
    mp = sim_session._cupy_malloc(MiB)
    view = mp + 1024  # a MemoryPointer into the same memory keeps it alive
    del mp
    gc.collect()
    assert dev.deferred_bytes == 0
    assert dev.allocator.bytes_in_use == MiB
    del view
    gc.collect()
    assert dev.deferred_bytes == MiB
    sim_session.flush()
    assert dev.allocator.bytes_in_use == 0


def test_cupy_malloc_maps_cuda_ids_through_visible_device_list(monkeypatch):
    sess = Session({"visible_device_list": "1,0"}, simulate="2x1GiB", environ={}, poll=False)
    try:
        cuda_id = {"id": 1}
        monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: cuda_id["id"])
        mp = sess._cupy_malloc(8192)
        assert sess.allocator(0).owns(mp.ptr)  # CUDA id 1 is gpudash's GPU:0
        assert mp.device_id == 1
        cuda_id["id"] = 0
        mp2 = sess._cupy_malloc(8192)
        assert sess.allocator(1).owns(mp2.ptr)
        cuda_id["id"] = 5
        with pytest.raises(BackendUnavailableError, match="5"):
            sess._cupy_malloc(8192)
        del mp, mp2
        gc.collect()
        sess.flush()
        assert [a.bytes_in_use for a in sess.allocators] == [0, 0]
    finally:
        sess.close()


def test_cupy_malloc_after_close_does_not_free_twice(monkeypatch):
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    sess = Session(simulate="1GiB", environ={}, poll=False)
    mp = sess._cupy_malloc(4096)
    sess.close()  # returns everything, mp's block included
    del mp
    gc.collect()  # the finalizer sees a closed session and does nothing
    assert sess.devices[0].backend.used == 0


def test_install_uninstall_wiring(sim_session, monkeypatch, restore_cupy_allocator):
    """Checks only the wiring (which allocator CuPy is given and gets back): the simulated
    session pretends to be a real one, and no CuPy array is created."""
    monkeypatch.setattr(Session, "simulated", property(lambda self: False))
    prev = cupy.cuda.get_allocator()
    assert sim_session.install() is sim_session
    try:
        assert sim_session.installed
        assert _is_routed_to(cupy.cuda.get_allocator(), sim_session)
        sim_session.install()  # idempotent: keeps the allocator it saved
        assert _is_routed_to(cupy.cuda.get_allocator(), sim_session)
    finally:
        sim_session.uninstall()
    assert not sim_session.installed
    assert cupy.cuda.get_allocator() == prev
    sim_session.uninstall()
    assert cupy.cuda.get_allocator() == prev


def test_as_default_wiring(sim_session, monkeypatch, restore_cupy_allocator):
    """Wiring only: as_default installs inside the block and restores after, also on error,
    and leaves an outer install alone."""
    monkeypatch.setattr(Session, "simulated", property(lambda self: False))
    prev = cupy.cuda.get_allocator()
    with sim_session.as_default() as s:
        assert s is sim_session
        assert _is_routed_to(cupy.cuda.get_allocator(), sim_session)
    assert cupy.cuda.get_allocator() == prev
    with pytest.raises(RuntimeError, match="boom"):
        with sim_session.as_default():
            raise RuntimeError("boom")
    assert cupy.cuda.get_allocator() == prev
    sim_session.install()
    with sim_session.as_default():
        pass
    assert _is_routed_to(cupy.cuda.get_allocator(), sim_session)  # still installed
    sim_session.uninstall()
    assert cupy.cuda.get_allocator() == prev


def test_close_uninstalls_wiring(monkeypatch, restore_cupy_allocator):
    monkeypatch.setattr(Session, "simulated", property(lambda self: False))
    prev = cupy.cuda.get_allocator()
    sess = Session(simulate="1GiB", environ={}, poll=False)
    sess.install()
    sess.close()
    assert cupy.cuda.get_allocator() == prev
    with pytest.raises(gpudash.ConfigError, match="closed"):
        sess.install()


def test_pinned_memory_wiring(monkeypatch, restore_cupy_allocator):
    """force_gpu_compatible: pinned host memory comes from the session's host BFC (wiring
    and the routing function; the simulated session's host BFC uses ordinary host memory)."""
    monkeypatch.setattr(Session, "simulated", property(lambda self: False))
    calls = []
    real = cupy.cuda.set_pinned_memory_allocator
    monkeypatch.setattr(cupy.cuda, "set_pinned_memory_allocator",
                        lambda f: (calls.append(f), real(f))[1])
    sess = Session({"force_gpu_compatible": True}, simulate="1GiB", environ={}, poll=False)
    try:
        host = sess.host_allocator
        assert host is not None and host.name == "gpu_host_bfc"
        sess.install()
        assert len(calls) == 1
        assert getattr(calls[0], "__self__", None) is sess
        assert calls[0].__func__ is Session._cupy_pinned_malloc
        mp = sess._cupy_pinned_malloc(4096)
        assert isinstance(mp, cupy.cuda.PinnedMemoryPointer)
        assert host.owns(mp.ptr) and host.bytes_in_use == 4096
        del mp
        gc.collect()
        assert host.bytes_in_use == 0
        sess.uninstall()
        assert len(calls) == 2
        assert calls[1] == cupy.get_default_pinned_memory_pool().malloc
    finally:
        sess.close()


def test_no_pinned_wiring_without_force_gpu_compatible(sim_session, monkeypatch,
                                                       restore_cupy_allocator):
    monkeypatch.setattr(Session, "simulated", property(lambda self: False))
    calls = []
    monkeypatch.setattr(cupy.cuda, "set_pinned_memory_allocator", calls.append)
    assert sim_session.host_allocator is None
    sim_session.install()
    sim_session.uninstall()
    assert calls == []


# ----------------------------------------------------------------------- a real GPU


@pytest.fixture
def gpu_session(restore_cupy_allocator):
    sess = Session({"allow_growth": True, "per_process_gpu_memory_fraction": 0.25},
                   environ={}, poll=True)
    yield sess
    sess.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_as_default_routes_cupy(gpu_session):
    sess = gpu_session
    assert not sess.simulated and sess.devices[0].kind == "cuda"
    prev = cupy.cuda.get_allocator()
    alloc = sess.allocator(0)
    with cupy.cuda.Device(sess.devices[0].visible_id):
        with sess.as_default():
            assert _is_routed_to(cupy.cuda.get_allocator(), sess)
            x = cupy.ones((1024, 1024), dtype=cupy.float32)
            assert alloc.owns(x.data.ptr)
            assert alloc.allocated_size(x.data.ptr) >= 4 * MiB
            assert alloc.bytes_in_use >= 4 * MiB
            y = (x * 3 + 1) @ cupy.ones((1024, 8), dtype=cupy.float32)
            assert alloc.owns(y.data.ptr)
            np.testing.assert_allclose(cupy.asnumpy(y), np.full((1024, 8), 4096.0))
            assert float(x.sum()) == 1024 * 1024
        assert cupy.cuda.get_allocator() == prev
        del x, y
        gc.collect()
        cupy.cuda.Device().synchronize()
        sess.flush()
        assert alloc.bytes_in_use == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_install_uninstall_restores(gpu_session):
    sess = gpu_session
    prev = cupy.cuda.get_allocator()
    sess.install()
    try:
        with cupy.cuda.Device(sess.devices[0].visible_id):
            a = cupy.arange(1 << 20, dtype=cupy.int64)
            assert sess.allocator(0).owns(a.data.ptr)
            assert int(a[-1]) == (1 << 20) - 1
    finally:
        sess.uninstall()
    assert cupy.cuda.get_allocator() == prev
    with cupy.cuda.Device(sess.devices[0].visible_id):
        b = cupy.zeros(1 << 20, dtype=cupy.int64)  # CuPy's own pool again
        assert not sess.allocator(0).owns(b.data.ptr)
    del a, b
    gc.collect()
    sess.close()
    assert sess.devices[0].backend.used == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_lowered_fraction_refuses_then_raised_allows(gpu_session):
    sess = gpu_session
    dev = sess.devices[0]
    sess.configure(per_process_gpu_memory_fraction=0.01)
    limit = dev.memory_limit
    assert limit == int(dev.total * 0.01)
    with pytest.raises(gpudash.OutOfMemoryError):
        sess.allocate(limit + 64 * MiB)
    sess.configure(per_process_gpu_memory_fraction=0.25)
    p = sess.allocate(limit + 64 * MiB)
    assert dev.allocator.owns(p)
    sess.free_now(p)
