"""Bad input and refusals: exception types, messages and attributes; state left unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import gpudash
from bfc_helpers import MIB, BumpSubAllocator, fingerprint, human_readable, rounded_bytes

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)


@pytest.fixture
def alloc():
    return gpudash.BFCAllocator(BumpSubAllocator(), 1 * MIB, allow_growth=False, name="GPU_7_bfc")


# ------------------------------------------------------------------------ sizes


def test_negative_size_is_value_error(alloc):
    p = alloc.allocate(1000)
    before = fingerprint(alloc)
    with pytest.raises(ValueError):
        alloc.allocate(-1)
    with pytest.raises(ValueError):
        alloc.allocate(-(1 << 70))
    assert fingerprint(alloc) == before
    alloc.deallocate(p)


def test_negative_size_is_not_an_oom(alloc):
    with pytest.raises(ValueError) as ei:
        alloc.allocate(-256)
    assert not isinstance(ei.value, MemoryError)


@pytest.mark.parametrize("bad", [1.0, 256.0, 1.5, "256", b"256", None, True, False, [256],
                                 np.float64(256.0)])
def test_non_integer_size_is_type_error(alloc, bad):
    before = fingerprint(alloc)
    with pytest.raises(TypeError):
        alloc.allocate(bad)
    assert fingerprint(alloc) == before


@pytest.mark.parametrize("make", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                  np.uint32, np.uint64, np.intp])
def test_numpy_integers_accepted(alloc, make):
    p = alloc.allocate(make(100))
    assert isinstance(p, int) and not isinstance(p, bool) and p != 0
    assert alloc.requested_size(p) == 100
    assert type(alloc.requested_size(p)) is int
    assert alloc.allocated_size(p) == 256
    alloc.deallocate(p)
    assert alloc.allocate(make(0)) == 0
    alloc.check()


def test_numpy_negative_is_value_error(alloc):
    with pytest.raises(ValueError):
        alloc.allocate(np.int64(-5))


def test_zero_size_returns_null(alloc):
    assert alloc.allocate(0) == 0
    assert alloc.stats().num_allocs == 0
    alloc.deallocate(0)  # no-op


def test_deallocate_zero_is_noop_before_anything(alloc):
    alloc.deallocate(0)
    alloc.check()


# ------------------------------------------------------------------------ pointers


def test_deallocate_never_allocated(alloc):
    p = alloc.allocate(1000)
    before = fingerprint(alloc)
    for bad in (12345, p + (1 << 30), 1 << 60, p - 256):
        with pytest.raises(gpudash.InvalidPointerError):
            alloc.deallocate(bad)
    assert fingerprint(alloc) == before
    alloc.deallocate(p)


def test_deallocate_before_any_allocation(alloc):
    with pytest.raises(gpudash.InvalidPointerError):
        alloc.deallocate(1 << 40)


def test_invalid_pointer_error_is_value_error(alloc):
    with pytest.raises(ValueError):
        alloc.deallocate(999)
    assert issubclass(gpudash.InvalidPointerError, ValueError)
    assert issubclass(gpudash.InvalidPointerError, gpudash.GpudashError)


def test_interior_pointer(alloc):
    p = alloc.allocate(4096)
    before = fingerprint(alloc)
    for off in (1, 255, 256, 1024, 4095):
        with pytest.raises(gpudash.InvalidPointerError):
            alloc.deallocate(p + off)
    assert fingerprint(alloc) == before
    alloc.deallocate(p)
    alloc.check()


def test_double_free(alloc):
    p = alloc.allocate(1000)
    q = alloc.allocate(1000)  # keeps p's chunk from merging away
    alloc.deallocate(p)
    before = fingerprint(alloc)
    with pytest.raises(gpudash.InvalidPointerError):
        alloc.deallocate(p)
    assert fingerprint(alloc) == before
    alloc.deallocate(q)
    with pytest.raises(gpudash.InvalidPointerError):
        alloc.deallocate(q)
    alloc.check()


def test_free_chunk_start_never_handed_out(alloc):
    # the free remainder after a split starts a chunk, but was never allocated
    p = alloc.allocate(256)
    (free,) = [c for c in alloc.snapshot().chunks if not c.in_use]
    assert free.address == p + 256
    with pytest.raises(gpudash.InvalidPointerError):
        alloc.deallocate(free.address)
    alloc.deallocate(p)
    alloc.check()


def test_sizes_of_unknown_pointers(alloc):
    p = alloc.allocate(1000)
    for fn in (alloc.requested_size, alloc.allocated_size):
        with pytest.raises(gpudash.InvalidPointerError):
            fn(p + 256)
        with pytest.raises(gpudash.InvalidPointerError):
            fn(42)
    alloc.deallocate(p)
    for fn in (alloc.requested_size, alloc.allocated_size):
        with pytest.raises(gpudash.InvalidPointerError):
            fn(p)


def test_allocator_usable_after_errors(alloc):
    for bad in (-1, 1.5, None):
        with pytest.raises((ValueError, TypeError)):
            alloc.allocate(bad)
    with pytest.raises(gpudash.InvalidPointerError):
        alloc.deallocate(7)
    with pytest.raises(gpudash.OutOfMemoryError):
        alloc.allocate(2 * MIB)
    p = alloc.allocate(1000)
    assert alloc.allocated_size(p) == 1024
    alloc.deallocate(p)
    alloc.check()


# ------------------------------------------------------------------------ out of memory


def test_oom_error_attributes(alloc):
    p = alloc.allocate(1000)
    before = fingerprint(alloc)
    n = 1 * MIB + 1
    with pytest.raises(gpudash.OutOfMemoryError) as ei:
        alloc.allocate(n)
    e = ei.value
    assert isinstance(e, MemoryError) and isinstance(e, gpudash.GpudashError)
    assert e.requested == n
    assert e.rounded == rounded_bytes(n) == 1 * MIB + 256
    assert e.allocator == "GPU_7_bfc"
    assert str(e).startswith(
        f"Allocator (GPU_7_bfc) ran out of memory trying to allocate {human_readable(n)} "
        f"(rounded to {rounded_bytes(n)})")
    assert human_readable(n) == "1.00MiB"
    assert "BFCAllocator dump for GPU_7_bfc" in e.memory_log
    assert e.memory_log.startswith("BFCAllocator dump for GPU_7_bfc")
    # the dump is TensorFlow's DumpMemoryLog(rounded): the bin line of the rounded size
    assert f"Bin for {human_readable(rounded_bytes(n))} was " in e.memory_log
    assert "Sum Total of in-use chunks: 1.0KiB" in e.memory_log
    assert fingerprint(alloc) == before
    alloc.deallocate(p)


def test_oom_memory_log_matches_dump(alloc):
    p = alloc.allocate(5000)
    n = 2 * MIB
    with pytest.raises(gpudash.OutOfMemoryError) as ei:
        alloc.allocate(n)
    assert ei.value.memory_log == alloc.dump_memory_log(rounded_bytes(n))
    alloc.deallocate(p)


def test_oom_is_exactly_gpudash_error_when_sub_allocator_refuses():
    sub = BumpSubAllocator(fail_always=True)
    a = gpudash.BFCAllocator(sub, 1 * MIB, allow_growth=True, name="refused")
    n = 512 * 1024 + 1
    with pytest.raises(gpudash.OutOfMemoryError) as ei:
        a.allocate(n)
    assert type(ei.value) is gpudash.OutOfMemoryError
    assert ei.value.allocator == "refused"
    assert ei.value.requested == n and ei.value.rounded == 512 * 1024 + 256
    assert a.pool_bytes == 0
    assert a.stats().num_allocs == 0
    a.check()


def test_oom_state_unchanged_with_growth():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 6 * MIB, allow_growth=True, name="g")
    ptrs = [a.allocate(1 * MIB) for _ in range(3)]
    before = fingerprint(a)
    n = len(sub.calls)
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(5 * MIB)
    assert fingerprint(a) == before
    assert len(sub.calls) == n
    for p in ptrs:
        a.deallocate(p)
    a.check()


def test_oom_message_names_allocator_default_name():
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1024)
    assert a.name == "bfc"
    with pytest.raises(gpudash.OutOfMemoryError) as ei:
        a.allocate(4096)
    assert str(ei.value).startswith(
        "Allocator (bfc) ran out of memory trying to allocate 4.0KiB (rounded to 4096)")
    assert "BFCAllocator dump for bfc" in ei.value.memory_log
