"""Sub-allocators: the simulated device, host memory and CUDA through CuPy."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import gpudash
from gpudash import BackendUnavailableError, ConfigError, InvalidPointerError, devices
from gpudash.devices import (
    CudaMemory,
    HostMemory,
    SimulatedDevice,
    SubAllocator,
    cuda_device_count,
)

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

MiB = 1 << 20
GiB = 1 << 30
BASE = 0x7F0000000000

HAVE_CUDA, CUDA_REASON = CudaMemory.available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason=f"needs CUDA: {CUDA_REASON}")


def test_public_names_resolve_lazily():
    assert gpudash.SimulatedDevice is SimulatedDevice
    assert gpudash.HostMemory is HostMemory
    assert gpudash.CudaMemory is CudaMemory


# -- SimulatedDevice -------------------------------------------------------------------------


def test_simulated_defaults():
    dev = SimulatedDevice(16 * GiB)
    assert dev.name == "sim0" and dev.index == 0 and dev.kind == "simulated"
    assert dev.compute_capability == (8, 0)
    assert dev.total == 16 * GiB and dev.used == 0 and dev.available == 16 * GiB
    assert dev.memory_info() == (16 * GiB, 16 * GiB)
    assert dev.blocks() == []
    assert isinstance(dev, SubAllocator)
    assert repr(dev) == "SimulatedDevice('sim0', 16.00 GiB, used=0 B, blocks=0)"
    assert SimulatedDevice("16GiB").total == 16 * GiB
    assert SimulatedDevice(GiB, index=2).name == "sim2"


def test_simulated_addresses_are_aligned_first_fit_and_exact_bytes_count():
    dev = SimulatedDevice(GiB)
    a = dev.alloc(1000)
    b = dev.alloc(3 * MiB)
    c = dev.alloc(256)
    assert (a, b, c) == (BASE, BASE + 2 * MiB, BASE + 6 * MiB)
    assert dev.used == 1000 + 3 * MiB + 256
    assert dev.available == GiB - dev.used
    assert dev.blocks() == [(a, 1000), (b, 3 * MiB), (c, 256)]
    dev.check()
    # freed ranges are reused, lowest address first
    dev.free(b, 3 * MiB)
    assert dev.alloc(MiB) == b  # fits in the hole
    assert dev.alloc(MiB) == BASE + 4 * MiB  # the rest of the hole, next aligned address
    assert dev.alloc(5 * MiB) == BASE + 8 * MiB  # too big for any hole: after the last block
    dev.check()


def test_simulated_free_and_realloc_same_size_gives_same_address():
    dev = SimulatedDevice(4 * GiB)
    ptrs = [dev.alloc(256 * MiB) for _ in range(4)]
    dev.free(ptrs[1], 256 * MiB)
    assert dev.alloc(256 * MiB) == ptrs[1]
    dev.free(ptrs[0], 256 * MiB)
    dev.free(ptrs[3], 256 * MiB)
    assert dev.alloc(256 * MiB) == ptrs[0]
    assert dev.alloc(256 * MiB) == ptrs[3]


def test_simulated_is_deterministic():
    def run():
        dev = SimulatedDevice(8 * GiB, index=1)
        out = []
        live = []
        for i in range(50):
            size = (i * 7919 % 97 + 1) * MiB
            p = dev.alloc(size)
            out.append(p)
            live.append((p, size))
            if i % 3 == 2:
                dev.free(*live.pop(0))
        dev.check()
        return out

    first = run()
    assert first == run()
    assert min(first) == BASE + (1 << 40)  # index 1 starts 1 TiB higher


def test_simulated_capacity_is_enforced():
    dev = SimulatedDevice(10 * MiB, name="gpu_a")
    dev.alloc(6 * MiB)
    with pytest.raises(MemoryError) as info:
        dev.alloc(5 * MiB)
    assert str(info.value) == (
        "gpu_a: cannot allocate 5.00 MiB (5242880 bytes): 6291456 bytes used of "
        "10485760 bytes capacity, 4194304 bytes left"
    )
    assert dev.used == 6 * MiB
    assert dev.alloc(4 * MiB)  # exactly the rest fits
    assert dev.available == 0
    with pytest.raises(MemoryError):
        dev.alloc(1)


def test_simulated_addresses_stop_at_the_end_of_the_address_space():
    end = devices.ADDRESS_END
    dev = SimulatedDevice(GiB, base=end - 4 * MiB)
    assert [dev.alloc(MiB), dev.alloc(2 * MiB)] == [end - 4 * MiB, end - 2 * MiB]
    with pytest.raises(MemoryError, match=r"past the end of its address space \(0x4000"):
        dev.alloc(1)
    assert dev.used == 3 * MiB
    dev.free(end - 4 * MiB, MiB)
    assert dev.alloc(2 * MiB) == end - 4 * MiB  # a gap before the end still fits
    dev.check()


def test_simulated_unified_allows_twice_the_capacity():
    dev = SimulatedDevice(8 * MiB, unified=True)
    dev.alloc(8 * MiB)
    dev.alloc(8 * MiB)
    assert dev.used == 16 * MiB and dev.available == 0
    assert dev.memory_info() == (0, 8 * MiB)
    with pytest.raises(MemoryError, match="unified memory: up to 2x capacity"):
        dev.alloc(1)
    dev.check()


def test_simulated_free_errors():
    dev = SimulatedDevice(GiB)
    p = dev.alloc(MiB)
    with pytest.raises(InvalidPointerError, match="not a live block"):
        dev.free(p + 256, MiB)
    with pytest.raises(ValueError, match=r"nbytes=1024, but the block was allocated with 1048576"):
        dev.free(p, 1024)
    dev.free(p, MiB)
    with pytest.raises(ValueError, match="already freed"):
        dev.free(p, MiB)
    assert dev.used == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1MiB"])
def test_simulated_alloc_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="nbytes must be a positive integer"):
        SimulatedDevice(GiB).alloc(bad)


def test_simulated_reset_and_custom_base_alignment():
    dev = SimulatedDevice(GiB, "custom", base=0x1001, alignment=4096)
    assert dev.alloc(10) == 0x2000  # first aligned address at or above base
    assert dev.alloc(10) == 0x3000
    dev.reset()
    assert dev.used == 0 and dev.blocks() == []
    assert dev.alloc(10) == 0x2000
    # addresses are never 0, even with a tiny base
    assert SimulatedDevice(GiB, base=1, alignment=256).alloc(1) == 256


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"capacity": 0}, "capacity must be > 0"),
     ({"capacity": -1}, "SimulatedDevice capacity must be"),
     ({"capacity": "lots"}, "SimulatedDevice capacity must be"),
     ({"capacity": GiB, "alignment": 3000}, "alignment must be a power of two"),
     ({"capacity": GiB, "alignment": 0}, "alignment must be a power of two"),
     ({"capacity": GiB, "base": 0}, "base must be an integer > 0"),
     ({"capacity": GiB, "index": -1}, "index must be an integer >= 0")],
)
def test_simulated_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SimulatedDevice(**kwargs)


def test_simulated_is_thread_safe():
    dev = SimulatedDevice(64 * GiB)
    errors = []

    def worker():
        try:
            for _ in range(200):
                p = dev.alloc(MiB)
                dev.free(p, MiB)
                dev.alloc(MiB)
        except (MemoryError, ValueError) as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert dev.used == 8 * 200 * MiB
    assert len({p for p, _ in dev.blocks()}) == 1600
    dev.check()


# -- HostMemory ------------------------------------------------------------------------------


def test_host_alloc_is_real_aligned_zeroed_memory():
    host = HostMemory()
    p = host.alloc(4096)
    assert p % 256 == 0
    assert host.used == 4096 and host.blocks() == [(p, 4096)]
    view = host.view(p, 4096)
    assert view.dtype == np.uint8 and view.shape == (4096,) and not view.any()
    view[:] = 7
    assert int(host.view(p, 4096).sum()) == 7 * 4096  # same memory
    assert isinstance(host, SubAllocator) and host.kind == "host"
    host.free(p, 4096)
    assert host.used == 0 and host.blocks() == []


def test_host_view_inside_a_block_and_array():
    host = HostMemory()
    region = host.alloc(MiB)
    chunk = region + 512 * 1024  # a BFC chunk lying inside the region
    a = host.array(chunk, (4, 8), np.float32)
    assert a.shape == (4, 8) and a.dtype == np.float32
    a[:] = np.arange(32, dtype=np.float32).reshape(4, 8)
    b = host.view(region, 128, np.float32, offset=512 * 1024)
    np.testing.assert_array_equal(b, np.arange(32, dtype=np.float32))
    assert host.array(chunk, 3, np.int64).shape == (3,)
    # the last bytes of the block are reachable, one more is not
    assert host.view(region + MiB - 8, 8).shape == (8,)
    with pytest.raises(ValueError, match="not inside a live block"):
        host.view(region + MiB - 8, 9)


def test_host_view_errors():
    host = HostMemory()
    p = host.alloc(1024)
    q = host.alloc(1024)
    with pytest.raises(ValueError, match="not inside a live block"):
        host.view(p - 1, 1)
    with pytest.raises(ValueError, match="not inside a live block"):
        host.view(min(p, q) + 1000, 1024)  # would run past the end of the block
    with pytest.raises(ValueError, match="multiple of float32 item size 4"):
        host.view(p, 6, np.float32)
    host.free(p, 1024)
    with pytest.raises(ValueError, match="not inside a live block"):
        host.view(p, 16)


def test_host_capacity_and_free_errors():
    host = HostMemory(capacity="8KiB", name="pinned")
    p = host.alloc(6000)
    with pytest.raises(MemoryError, match=r"pinned: cannot allocate 3.91 KiB \(4000 bytes\): "
                                          r"6000 bytes used of 8192 bytes capacity"):
        host.alloc(4000)
    assert host.total == 8192 and host.available == 8192 - 6000
    assert host.memory_info() == (2192, 8192)
    with pytest.raises(InvalidPointerError):
        host.free(p + 1, 6000)
    with pytest.raises(ValueError, match="allocated with 6000 bytes"):
        host.free(p, 5000)
    host.reset()
    assert host.used == 0
    assert repr(host) == "HostMemory('pinned', 8.00 KiB, used=0 B, blocks=0)"


def test_host_unlimited_reports_machine_memory():
    host = HostMemory()
    free, total = host.memory_info()
    assert total > 0 and 0 <= free <= total
    assert "unlimited" in repr(host)


def test_host_view_outlives_free():
    host = HostMemory()
    p = host.alloc(64)
    v = host.view(p, 64)
    v[:] = 3
    host.free(p, 64)
    assert int(v.sum()) == 3 * 64  # still valid memory, no crash


# -- CUDA ------------------------------------------------------------------------------------


def test_cuda_available_never_raises_and_is_cached():
    first = CudaMemory.available()
    assert isinstance(first, tuple) and len(first) == 2
    ok, reason = first
    assert isinstance(ok, bool) and isinstance(reason, str)
    assert (reason == "") is ok
    assert CudaMemory.available() == first
    assert cuda_device_count() >= (1 if ok else 0)


@pytest.mark.skipif(HAVE_CUDA, reason="this machine has CUDA")
def test_cuda_unavailable_for_real():
    assert cuda_device_count() == 0
    assert CUDA_REASON.startswith(("no CUDA driver", "no CUDA device", "CuPy is not installed",
                                   "CUDA is not usable"))
    with pytest.raises(BackendUnavailableError) as info:
        CudaMemory()
    msg = str(info.value)
    assert CUDA_REASON in msg and "SimulatedDevice" in msg
    assert isinstance(info.value, RuntimeError)


@pytest.mark.skipif(HAVE_CUDA, reason="this machine has CUDA")
def test_cuda_reason_on_this_machine_without_driver():
    pytest.importorskip("cupy")
    assert CUDA_REASON == "no CUDA driver: cudaErrorInsufficientDriver"


def test_cuda_probe_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    devices._reset_probe()
    try:
        ok, reason = CudaMemory.available()
        assert ok is False and reason.startswith("CuPy is not installed")
        assert cuda_device_count() == 0
        with pytest.raises(BackendUnavailableError, match="CuPy is not installed"):
            CudaMemory()
    finally:
        monkeypatch.undo()
        devices._reset_probe()
    assert CudaMemory.available() == (HAVE_CUDA, CUDA_REASON)


@gpu
@needs_cuda
def test_cuda_alloc_free_round_trip():
    import cupy

    mem = CudaMemory(0)
    free0, total = mem.memory_info()
    assert total == mem.total > 0 and 0 < free0 <= total
    major, minor = mem.compute_capability
    assert major >= 3 and minor >= 0
    p = mem.alloc(64 * MiB)
    assert p != 0 and mem.used == 64 * MiB and mem.blocks() == [(p, 64 * MiB)]
    # the pointer is real device memory: write through CuPy and read back
    um = cupy.cuda.UnownedMemory(p, 64 * MiB, mem)
    arr = cupy.ndarray((16 * MiB,), cupy.float32, cupy.cuda.MemoryPointer(um, 0))
    arr.fill(2.0)
    assert float(arr.sum()) == 2.0 * 16 * MiB
    with pytest.raises(ValueError):
        mem.free(p, 1)
    mem.free(p, 64 * MiB)
    assert mem.used == 0
    with pytest.raises(InvalidPointerError):
        mem.free(p, 64 * MiB)


@gpu
@needs_cuda
def test_cuda_oom_is_memory_error_and_managed_pinned_work():
    mem = CudaMemory(0)
    _, total = mem.memory_info()
    with pytest.raises(MemoryError, match="CUDA out of memory"):
        mem.alloc(total * 4)
    for kwargs in ({"managed": True}, {"pinned_host": True}):
        m = CudaMemory(0, **kwargs)
        p = m.alloc(MiB)
        assert p != 0
        m.free(p, MiB)
    with pytest.raises(ConfigError):
        CudaMemory(0, managed=True, pinned_host=True)
    with pytest.raises(ConfigError, match="device_id"):
        CudaMemory(cuda_device_count())
