"""TensorFlow's own BFC allocator tests, ported (BFC.md §11.1-§11.4), plus the Extend example
of §6 and the DumpMemoryLog / RenderOccupancy formats of §9.2-§9.3.

``GPUBFCAllocator(sub, limit, "GPU_0_bfc")`` is ``BFCAllocator(sub, limit,
allow_growth=False, garbage_collection=True, name="GPU_0_bfc")`` (growth off; GC on, the
``TF_ENABLE_GPU_GARBAGE_COLLECTION`` default). ``Allocate<float>(n)`` is ``n * 4`` bytes.
"""

from __future__ import annotations

import random
import re

import pytest

import gpudash
from bfc_helpers import (
    GIB,
    INVALID_HANDLE,
    KIB,
    MIB,
    BumpSubAllocator,
    backpedal,
    bin_for_size,
    check_snapshot,
    expected_occupancy,
    fingerprint,
    human_readable,
    log2_floor_nonzero_slow,
    rounded_bytes,
)

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

FLOAT, INT64, DOUBLE = 4, 8, 8


def gpu_bfc(limit, sub=None, **kw):
    sub = sub if sub is not None else BumpSubAllocator()
    return gpudash.BFCAllocator(sub, limit, allow_growth=False, garbage_collection=True,
                                name="GPU_0_bfc", **kw), sub


def check_stats(a, num_allocs, bytes_in_use, peak_bytes_in_use, largest_alloc_size):
    s = a.stats()
    assert (s.num_allocs, s.bytes_in_use, s.peak_bytes_in_use, s.largest_alloc_size) == (
        num_allocs, bytes_in_use, peak_bytes_in_use, largest_alloc_size)


def check_no_dups_no_overlap(a, ptrs):
    ptrs = sorted(ptrs)
    for prev, cur in zip(ptrs, ptrs[1:]):
        assert cur != prev, "duplicate pointer"
        req = a.requested_size(prev)
        assert req > 0
        assert cur - prev >= req, f"{prev:#x} (+{req}) overlaps {cur:#x}"


# --------------------------------------------------------------------------------------------
# §11.1 GPUBFCAllocatorTest
# --------------------------------------------------------------------------------------------


def test_no_dups():
    a, sub = gpu_bfc(1 << 30)
    check_stats(a, 0, 0, 0, 0)
    ptrs = [a.allocate(s) for s in range(1, 1024)]
    # 654336 = 256*256 + 256*512 + 256*768 + 255*1024
    check_stats(a, 1023, 654336, 654336, 1024)
    check_no_dups_no_overlap(a, ptrs)
    a.check()
    for p in ptrs:
        a.deallocate(p)
    check_stats(a, 1023, 0, 654336, 1024)
    a.check()
    # growth off: a single region of RoundedBytes(limit)
    assert sub.granted == [1 << 30]


def _philox_substitute_sizes(rng, n, max_mem):
    # TensorFlow draws these from Philox(123, 17), which we cannot reproduce here; Python's
    # random.Random(123) gives sizes of the same distribution.
    return [min(max(rng.getrandbits(32) % max_mem, 100), max_mem) for _ in range(n)]


def test_allocations_and_deallocations():
    a, _ = gpu_bfc(1 << 30)
    rng = random.Random(123)
    initial = [a.allocate(s) for s in _philox_substitute_sizes(rng, 255, 1048576)]
    existing = []
    for i, p in enumerate(initial):
        if i % 2 == 1:
            a.deallocate(p)
        else:
            existing.append(p)
    a.check()
    # out-of-memory errors work and do not prevent future allocations
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate((1 << 30) + 1)
    a.check()
    existing += [a.allocate(s) for s in _philox_substitute_sizes(rng, 255, 1048576)]
    assert len(set(existing)) == len(existing)
    check_no_dups_no_overlap(a, existing)
    a.check()
    for p in existing:
        a.deallocate(p)
    assert a.stats().bytes_in_use == 0
    a.check()


def test_exercise_coalescing():
    a, sub = gpu_bfc(1 << 30)
    check_stats(a, 0, 0, 0, 0)
    first_ptr = a.allocate(1024 * FLOAT)
    a.deallocate(first_ptr)
    check_stats(a, 1, 0, 4096, 4096)
    for _ in range(1024):
        t1 = a.allocate(1024 * FLOAT)
        t2 = a.allocate(1048576 * INT64)
        t3 = a.allocate(2048 * DOUBLE)
        t4 = a.allocate(10485760 * FLOAT)
        a.deallocate(t1)
        a.deallocate(t2)
        a.deallocate(t3)
        a.deallocate(t4)
    check_stats(a, 4097, 0, 1024 * FLOAT + 1048576 * INT64 + 2048 * DOUBLE + 10485760 * FLOAT,
                10485760 * FLOAT)
    assert a.stats().peak_bytes_in_use == 50352128
    # everything coalesced back into one chunk: the next allocation starts at the beginning
    first_ptr_after = a.allocate(1024 * FLOAT)
    assert first_ptr_after == first_ptr
    a.deallocate(first_ptr_after)
    a.check()
    assert len(sub.granted) == 1
    dump = a.snapshot()
    assert len(dump.chunks) == 1 and not dump.chunks[0].in_use


def test_allocate_zero_buf_size():
    a, sub = gpu_bfc(1 << 30)
    assert a.allocate(0 * FLOAT) == 0
    # takes nothing: no region, no stats
    assert sub.calls == []
    check_stats(a, 0, 0, 0, 0)
    assert a.pool_bytes == 0


def test_allocated_vs_requested():
    # TracksSizes: TracksAllocationSizes() is true; here RequestedSize/AllocatedSize exist.
    a, _ = gpu_bfc(1 << 30)
    t1 = a.allocate(1 * FLOAT)
    assert a.requested_size(t1) == 4
    assert a.allocated_size(t1) == 256
    a.deallocate(t1)


def test_custom_memory_limit():
    # 2 MiB limit (the 2015 version used 1 MiB)
    a, _ = gpu_bfc(2 << 20)
    first_ptr = a.allocate((1 << 6) * FLOAT)
    assert first_ptr != 0
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate((2 << 20) * FLOAT)
    a.deallocate(first_ptr)
    a.check()


def test_allocations_and_deallocations_with_growth():
    # TensorFlow builds a growth GPUOptions here but never passes it: growth stays off.
    a, sub = gpu_bfc(1 << 31)
    rng = random.Random(123)
    initial = [a.allocate(s) for s in _philox_substitute_sizes(rng, 9, 1 << 27)]
    existing = []
    for i, p in enumerate(initial):
        if i % 2 == 1:
            a.deallocate(p)
        else:
            existing.append(p)
    existing += [a.allocate(s) for s in _philox_substitute_sizes(rng, 9, 1 << 26)]
    check_no_dups_no_overlap(a, existing)
    a.check()
    for p in existing:
        a.deallocate(p)
    assert a.stats().bytes_in_use == 0
    assert sub.granted == [1 << 31]
    a.check()


# --------------------------------------------------------------------------------------------
# §11.2 GPUBFCAllocatorPrivateMethodsTest
# --------------------------------------------------------------------------------------------


def test_bin_debug_info():
    a, _ = gpu_bfc(1 << 30)
    num_sizes, per_size = 5, 2
    ptrs, allocated = [], []
    for i in range(num_sizes):
        for _ in range(per_size):
            p = a.allocate(256 << i)
            assert p != 0
            ptrs.append(p)
            allocated.append(a.allocated_size(p))
    md = a.snapshot()
    assert md.allocator_name == "GPU_0_bfc"
    assert len(md.chunks) == 1 + num_sizes * per_size
    assert len(md.bins) == 21
    for b in md.bins:
        i = b.bin
        if i < num_sizes:
            requested = a.requested_size(ptrs[2 * i]) + a.requested_size(ptrs[2 * i + 1])
            assert requested == 2 * (256 << i)
            alloc_size = allocated[2 * i] + allocated[2 * i + 1]
            assert b.total_bytes_in_use == alloc_size
            assert b.total_bytes_in_bin == alloc_size
            assert b.total_requested_bytes_in_use == 2 * (256 << i)
            assert b.total_chunks_in_use == per_size
            assert b.total_chunks_in_bin == per_size
        else:
            assert b.total_bytes_in_use == 0
            assert b.total_requested_bytes_in_use == 0
            assert b.total_chunks_in_use == 0
            if i == 20:
                assert b.total_bytes_in_bin > 0
                assert b.total_chunks_in_bin == 1
            else:
                assert b.total_bytes_in_bin == 0
                assert b.total_chunks_in_bin == 0
    check_snapshot(md)

    for i in range(1, len(ptrs), 2):
        a.deallocate(ptrs[i])
        ptrs[i] = 0
    md = a.snapshot()
    for b in md.bins:
        i = b.bin
        if i < 5:
            assert a.requested_size(ptrs[2 * i]) == 256 << i
            assert b.total_bytes_in_use == allocated[2 * i]
            assert b.total_bytes_in_bin >= allocated[2 * i]
            assert b.total_requested_bytes_in_use == 256 << i
            assert b.total_chunks_in_use == 1
            assert b.total_chunks_in_bin >= 1
        else:
            assert b.total_bytes_in_use == 0
            assert b.total_requested_bytes_in_use == 0
            assert b.total_chunks_in_use == 0
    check_snapshot(md)
    a.check()


def test_log2_floor_non_zero_slow_reference():
    # The values TensorFlow's test expects; the allocator's use of them is checked through
    # bin numbers below.
    for n, want in [(0, -1), (1, 0), (2, 1), (3, 1), (1023, 9), (1024, 10), (1025, 10)]:
        assert log2_floor_nonzero_slow(n) == want


_BIN_CHECK_SIZES = sorted({s for b in range(21) for s in (256 << b, (256 << b) + 256,
                                                          (512 << b) - 256)} | {1 << 30, 3 << 30})


@pytest.mark.parametrize("free_size", _BIN_CHECK_SIZES)
def test_free_chunk_bin_numbers(free_size):
    """BinNumForSize, checked on the bin of a free remainder of exactly ``free_size`` bytes
    (the constructor self-check of §2.2: s, s+255, 2s-1 in bin b; bin 20 open-ended)."""
    a, _ = gpu_bfc(free_size + 256)
    p = a.allocate(1)
    (free,) = [c for c in a.snapshot().chunks if not c.in_use]
    assert free.size == free_size
    assert free.bin == bin_for_size(free_size) == min(20, log2_floor_nonzero_slow(free_size >> 8))
    a.deallocate(p)


@pytest.mark.skip(reason="TF_FORCE_GPU_ALLOW_GROWTH is applied by the session layer, not by "
                         "BFCAllocator; tested with the sessions")
def test_force_allow_growth():
    pass


# --------------------------------------------------------------------------------------------
# §11.3 sub-allocator tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gc", [True, False])
def test_physical_allocator_ooms_fragmentation(gc):
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 512 * MIB, allow_growth=True, garbage_collection=gc,
                             name="GPU_0_bfc")
    size = 4 * MIB
    ptrs = [a.allocate(size) for _ in range(128)]
    assert [n // MIB for n in sub.granted] == [4, 4, 8, 16, 32, 64, 128, 256]
    # free all but the last, so the last (256 MiB) region cannot be collected
    for p in ptrs[:127]:
        a.deallocate(p)
    before = fingerprint(a)
    ncalls = len(sub.calls)
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(512 * MIB - size)
    assert fingerprint(a) == before
    assert len(sub.calls) == ncalls  # neither a region request nor a GC free
    a.check()


def test_region_deallocation():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 1 << 31, allow_growth=True, garbage_collection=True,
                             name="GPU_0_bfc")
    size = 4 * MIB
    ptrs = [a.allocate(size) for _ in range(128)]
    assert len(a.snapshot().regions) > 1
    for p in ptrs[:-1]:
        a.deallocate(p)
    released = a.release_free_regions()
    assert released == 256 * MIB  # 4+4+8+16+32+64+128 MiB
    dump = a.snapshot()
    assert len(dump.regions) == 1
    assert dump.regions[0].size == 256 * MIB
    free_chunks = [c for c in dump.chunks if not c.in_use]
    assert len(free_chunks) == 1
    assert sum(b.total_chunks_in_bin - b.total_chunks_in_use for b in dump.bins) == 1
    assert a.pool_bytes == 256 * MIB
    assert sub.outstanding == {dump.regions[0].ptr: 256 * MIB}
    assert sorted(n for _, n in sub.freed) == [4 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB,
                                               64 * MIB, 128 * MIB]
    check_snapshot(dump)
    a.check()
    a.deallocate(ptrs[-1])


# --------------------------------------------------------------------------------------------
# §11.4 XLA bfc_allocator_test.cc
# --------------------------------------------------------------------------------------------


def test_allocate_and_free():
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1 << 20, name="test")
    p = a.allocate(512)
    assert p != 0
    a.deallocate(p)
    a.check()


def test_get_and_clear_memory_stats():
    a = gpudash.BFCAllocator(BumpSubAllocator(), 256 << 20, name="test_stats")
    s = a.stats()
    assert (s.bytes_in_use, s.peak_bytes_in_use) == (0, 0)
    p1 = a.allocate(1024)
    s = a.stats()
    assert (s.bytes_in_use, s.peak_bytes_in_use) == (1024, 1024)
    p2 = a.allocate(2048)
    s = a.stats()
    assert (s.bytes_in_use, s.peak_bytes_in_use) == (3072, 3072)
    a.deallocate(p2)
    s = a.stats()
    assert (s.bytes_in_use, s.peak_bytes_in_use) == (1024, 3072)
    assert (s.num_allocs, s.largest_alloc_size) == (2, 2048)
    a.clear_stats()
    s = a.stats()
    assert (s.bytes_in_use, s.peak_bytes_in_use) == (1024, 1024)
    assert (s.num_allocs, s.largest_alloc_size) == (0, 0)
    assert s.peak_pool_bytes == s.pool_bytes == 2 * MIB
    a.deallocate(p1)


class _AlwaysFailingSubAllocator:
    """XLA's AlwaysFailingSubAllocator: refuses, with a 1000-call fuse after which it succeeds
    (so a backpedal loop that makes no progress ends and the test fails instead of hanging)."""

    FUSE = 1000

    def __init__(self):
        self.calls = 0
        self.next = 1 << 40

    def alloc(self, nbytes):
        self.calls += 1
        if self.calls > self.FUSE:
            p = self.next
            self.next += rounded_bytes(nbytes)
            return p
        raise MemoryError("always failing")

    def free(self, ptr, nbytes):
        pass


def test_extend_terminates_when_sub_allocator_always_fails():
    # pool of 2048 bytes: RoundedBytes(0.9 * 2048) == 2048, the formerly stalling zone
    sub = _AlwaysFailingSubAllocator()
    a = gpudash.BFCAllocator(sub, 8 * 256, allow_growth=False, name="backpedal")
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(100)
    assert sub.calls <= _AlwaysFailingSubAllocator.FUSE


def test_backpedal_terminates_for_small_requests():
    # the same stall with growth on: 1 MiB backs off down to 2304, where
    # RoundedBytes(0.9 * 2304) == 2304 >= 1024 (TSL would spin forever; XLA forces progress)
    sub = _AlwaysFailingSubAllocator()
    a = gpudash.BFCAllocator(sub, 1 * MIB, allow_growth=True, name="backpedal")
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(1000)
    assert sub.calls <= _AlwaysFailingSubAllocator.FUSE


# --------------------------------------------------------------------------------------------
# §3, §6 Extend and growth
# --------------------------------------------------------------------------------------------


def test_extend_example_512mib_growth():
    """§6: 512 MiB limit, growth on, 4 MiB requests -> regions 4,4,8,16,32,64,128,256 MiB.
    The first is 4 MiB: rounded 4 MiB > curr 2 MiB doubles curr before the first region."""
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 512 * MIB, allow_growth=True, name="bfc")
    assert sub.calls == []  # nothing in the constructor
    ptrs = []
    for _ in range(128):
        ptrs.append(a.allocate(4 * MIB))
    assert sub.asked == [4 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, 64 * MIB, 128 * MIB,
                         256 * MIB]
    assert a.pool_bytes == 512 * MIB
    assert [(r.ptr, r.size) for r in a.snapshot().regions] == [
        (p, n) for op, p, n in sub.calls if op == "alloc"]
    # the limit is reached: the next request fails without asking the sub-allocator
    n = len(sub.calls)
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(4 * MIB)
    assert len(sub.calls) == n
    a.check()


def test_growth_first_region_is_2mib_then_doubles():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 1 * GIB, allow_growth=True)
    assert sub.calls == []
    p = a.allocate(1)
    assert sub.asked == [2 * MIB]
    assert p == sub.base
    # fill the first region; the next region is twice as large
    q = a.allocate(2 * MIB - 256)
    assert sub.asked == [2 * MIB]
    r = a.allocate(1)
    assert sub.asked == [2 * MIB, 4 * MIB]
    assert r == sub.base + 2 * MIB
    s = a.allocate(8 * MIB)  # curr 8 MiB >= 8 MiB: no doubling first, so curr doubles after
    assert sub.asked == [2 * MIB, 4 * MIB, 8 * MIB]
    t = a.allocate(8 * MIB)  # curr is now 16 MiB
    assert sub.asked == [2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB]
    for x in (p, q, r, s, t):
        a.deallocate(x)
    a.check()


def test_growth_small_limit_first_region():
    # growth: curr = RoundedBytes(min(limit, 2 MiB))
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 1 * MIB, allow_growth=True)
    a.allocate(1)
    assert sub.asked == [1 * MIB]


def test_no_growth_region_at_first_allocation():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 64 * MIB, allow_growth=False)
    assert sub.calls == [] and a.pool_bytes == 0
    a.allocate(1)
    assert sub.asked == [64 * MIB]
    a.allocate(63 * MIB)
    assert sub.asked == [64 * MIB]
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(1 * MIB)
    assert sub.asked == [64 * MIB]


def test_no_growth_limit_not_multiple_of_256():
    # curr = RoundedBytes(1000) = 1024, but Extend clamps to available = 1000 rounded down
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 1000, allow_growth=False)
    a.allocate(1)
    assert sub.asked == [768]
    assert a.pool_bytes == 768


def test_growth_clamped_to_what_the_limit_leaves():
    # limit 5 MiB + 100: regions 2 MiB, then min(4 MiB, available rounded down to 256)
    limit = 5 * MIB + 100
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, limit, allow_growth=True)
    a.allocate(2 * MIB)
    a.allocate(1)
    assert sub.asked == [2 * MIB, (limit - 2 * MIB) // 256 * 256]
    # nothing left: a request larger than what is available fails without a sub call
    n = len(sub.calls)
    rest = (limit - 2 * MIB) // 256 * 256 - 256
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(rest + 1)
    assert len(sub.calls) == n
    assert a.allocate(rest) != 0


def test_backpedal_once_per_lifetime():
    """§6 step 4: on refusal, back off by 0.9 until it fits or drops below the request;
    only once per allocator lifetime."""
    cap = 1536 * KIB
    sub = BumpSubAllocator(capacity=cap)
    a = gpudash.BFCAllocator(sub, 1 * GIB, allow_growth=True)
    p = a.allocate(256)
    want = [2 * MIB]
    while want[-1] > cap:
        want.append(backpedal(want[-1]))
    assert sub.asked == want
    region = want[-1]
    assert sub.granted == [region]
    assert a.pool_bytes == region
    # fill the region; the next extension (curr doubled to 4 MiB) is refused with no backpedal
    q = a.allocate(region - 256)
    n = len(sub.asked)
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(256)
    # no second backpedal: only the full 4 MiB is asked (how many times is checked in
    # test_failed_allocation_asks_sub_allocator_once)
    assert sub.asked[n:] and set(sub.asked[n:]) == {4 * MIB}
    a.deallocate(p)
    a.deallocate(q)
    a.check()


def test_backpedal_stops_below_request():
    # every request refused: back off while bytes >= rounded, then give up
    sub = BumpSubAllocator(fail_always=True)
    a = gpudash.BFCAllocator(sub, 1 * GIB, allow_growth=True)
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(1 * MIB)
    want = [2 * MIB]
    while True:
        nxt = backpedal(want[-1])
        if nxt < 1 * MIB:
            break
        want.append(nxt)
    assert sub.asked[:len(want)] == want
    # any further attempt within the same call must not backpedal again
    assert set(sub.asked[len(want):]) <= {2 * MIB}


def test_failed_allocation_asks_sub_allocator_once():
    """With retry_timeout=0 (TensorFlow's no-retry path, §4.1) a failed allocation is one
    AllocateRawInternal: one Extend, so one request to a refusing sub-allocator (after the
    one-time backpedal is spent)."""
    sub = BumpSubAllocator(fail_always=True)
    a = gpudash.BFCAllocator(sub, 1 * GIB, allow_growth=True)
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(1 * MIB)  # spends the backpedal
    n = len(sub.asked)
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(1 * MIB)
    assert sub.asked[n:] == [2 * MIB]


@pytest.mark.parametrize("size", [16 * GIB, 40231108608, 3 * GIB + 12345 * 256])
def test_backpedal_single_precision_factor(size):
    """kBackpedalFactor is a C++ float: bytes * 0.9f is computed in single precision. For
    large regions this differs from double precision (e.g. 16 GiB: 15461881856, not
    15461882368)."""
    sub = BumpSubAllocator(fail_sizes={size})
    a = gpudash.BFCAllocator(sub, size, allow_growth=False)
    a.allocate(1)
    assert sub.asked == [size, backpedal(size)]


def test_garbage_collection_frees_free_regions_then_extends():
    for gc in (True, False):
        sub = BumpSubAllocator()
        a = gpudash.BFCAllocator(sub, 8 * MIB, allow_growth=True, garbage_collection=gc)
        p = a.allocate(1 * MIB)
        q = a.allocate(1536 * KIB)
        assert sub.granted == [2 * MIB, 4 * MIB]
        a.deallocate(p)
        a.deallocate(q)
        if not gc:
            with pytest.raises(gpudash.OutOfMemoryError):
                a.allocate(5 * MIB)
            assert sub.freed == []
            continue
        r = a.allocate(5 * MIB)
        # both wholly free regions returned, then one new region; curr was not reset (8 MiB)
        assert sorted(n for _, n in sub.freed) == [2 * MIB, 4 * MIB]
        assert sub.granted == [2 * MIB, 4 * MIB, 8 * MIB]
        assert r == sub.calls[-1][1]
        assert a.pool_bytes == 8 * MIB
        a.check()


def test_gc_frees_all_wholly_free_regions_not_just_enough():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 16 * MIB, allow_growth=True, garbage_collection=True)
    p1 = a.allocate(2 * MIB)  # region 2 MiB (full)
    p2 = a.allocate(4 * MIB)  # region 4 MiB (full)
    p3 = a.allocate(8 * MIB)  # region 8 MiB (full); pool 14 MiB
    a.deallocate(p1)
    a.deallocate(p2)
    # 5 MiB: no free chunk fits (2, 4 MiB); available 2 MiB < 5 MiB. Freeing the 4 MiB region
    # alone would do, but GC frees every wholly free region (2 and 4 MiB)
    r = a.allocate(5 * MIB)
    assert sorted(n for _, n in sub.freed) == [2 * MIB, 4 * MIB]
    # then Extend: curr 16 MiB clamped to available 16 - 8 = 8 MiB
    assert sub.granted == [2 * MIB, 4 * MIB, 8 * MIB, 8 * MIB]
    assert a.pool_bytes == 16 * MIB
    a.deallocate(r)
    a.deallocate(p3)
    a.check()


def test_split_rule():
    # split when chunk >= 2*rounded, or chunk - rounded >= 128 MiB; else the whole chunk
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1024, allow_growth=False)
    p = a.allocate(513)  # rounded 768; chunk 1024 < 1536 -> no split
    assert a.allocated_size(p) == 1024
    assert a.requested_size(p) == 513
    assert a.stats().bytes_in_use == 1024
    a.deallocate(p)
    p = a.allocate(512)  # 1024 >= 2*512 -> split
    assert a.allocated_size(p) == 512
    a.deallocate(p)
    a.check()


def test_split_rule_128mib_threshold():
    limit = 1 * GIB
    a = gpudash.BFCAllocator(BumpSubAllocator(), limit, allow_growth=False)
    # chunk 1 GiB, rounded 600 MiB: 1 GiB < 1200 MiB, but 424 MiB of waste >= 128 MiB
    p = a.allocate(600 * MIB)
    assert a.allocated_size(p) == 600 * MIB
    q = a.allocate(300 * MIB)  # 424 MiB free chunk: < 600 MiB, waste 124 MiB < 128 MiB
    assert a.allocated_size(q) == 424 * MIB
    a.check()


def test_split_rule_fragmentation_fraction():
    limit = 1 * GIB
    a = gpudash.BFCAllocator(BumpSubAllocator(), limit, allow_growth=False,
                             fragmentation_fraction=0.01)
    # threshold int(0.01 * 1 GiB) = 10737418; waste 424 MiB - 300 MiB >= threshold -> split
    p = a.allocate(600 * MIB)
    q = a.allocate(300 * MIB)
    assert a.allocated_size(q) == 300 * MIB
    # a 124 MiB free chunk now; asking 120 MiB leaves 4 MiB < 10.24 MiB -> no split
    r = a.allocate(120 * MIB)
    assert a.allocated_size(r) == 124 * MIB
    for x in (p, q, r):
        a.deallocate(x)
    a.check()


def test_best_fit_smallest_then_lowest_address():
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1 * MIB, allow_growth=False)
    sizes = [1024, 256, 2048, 256, 1024, 256, 1024, 256]
    ptrs = [a.allocate(s) for s in sizes]
    # free the 1024s (separated by in-use 256s) and the 2048
    for i in (0, 2, 4, 6):
        a.deallocate(ptrs[i])
    # 1000 -> rounded 1024: three 1024 holes, the lowest address wins
    assert a.allocate(1000) == ptrs[0]
    assert a.allocate(1024) == ptrs[4]
    # 600 -> 768: smallest fitting is the remaining 1024 hole (not the 2048 one)
    x = a.allocate(600)
    assert x == ptrs[6]
    assert a.allocated_size(x) == 1024  # 1024 < 2*768 -> not split
    # 1500 -> 1536: the 2048 hole
    y = a.allocate(1500)
    assert y == ptrs[2] and a.allocated_size(y) == 2048
    a.check()


def test_coalescing_with_neighbours():
    a = gpudash.BFCAllocator(BumpSubAllocator(), 4096, allow_growth=False)
    p = [a.allocate(1024) for _ in range(4)]
    a.deallocate(p[1])
    a.deallocate(p[2])  # merges with p[1]
    d = a.snapshot()
    assert [(c.size, c.in_use) for c in d.chunks] == [(1024, True), (2048, False), (1024, True)]
    a.deallocate(p[0])
    a.deallocate(p[3])
    d = a.snapshot()
    assert [(c.size, c.in_use) for c in d.chunks] == [(4096, False)]
    a.check()


def test_regions_never_coalesce():
    # adjacent regions from the sub-allocator stay separate: chunks never merge across them
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 64 * MIB, allow_growth=True)
    p = a.allocate(2 * MIB)
    q = a.allocate(4 * MIB)
    assert q == p + 2 * MIB  # adjacent
    a.deallocate(p)
    a.deallocate(q)
    d = a.snapshot()
    assert [(r.ptr, r.size) for r in d.regions] == [(p, 2 * MIB), (q, 4 * MIB)]
    assert [(c.address, c.size) for c in d.chunks] == [(p, 2 * MIB), (q, 4 * MIB)]
    check_snapshot(d)


# --------------------------------------------------------------------------------------------
# §9.2 DumpMemoryLog, §9.3 RenderOccupancy, §9.4 HumanReadableNumBytes
# --------------------------------------------------------------------------------------------


def _dump_state():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 1 * MIB, allow_growth=False, name="dumpme")
    p1 = a.allocate(4)
    p2 = a.allocate(4)
    p3 = a.allocate(1000)
    return a, sub.base, (p1, p2, p3)


def test_dump_memory_log_structure():
    a, base, (p1, p2, p3) = _dump_state()
    assert (p1, p2, p3) == (base, base + 256, base + 512)
    lines = a.dump_memory_log().split("\n")
    assert lines[0] == "BFCAllocator dump for dumpme"
    bin_lines = lines[1:22]
    assert [ln.split(")")[0] for ln in bin_lines] == [f"Bin ({256 << b}" for b in range(21)]
    assert bin_lines[0] == ("Bin (256): \tTotal Chunks: 2, Chunks in use: 2. 512B allocated for "
                            "chunks. 512B in use in bin. 8B client-requested in use in bin.")
    assert bin_lines[1] == ("Bin (512): \tTotal Chunks: 0, Chunks in use: 0. 0B allocated for "
                            "chunks. 0B in use in bin. 0B client-requested in use in bin.")
    assert bin_lines[2] == ("Bin (1024): \tTotal Chunks: 1, Chunks in use: 1. 1.0KiB allocated "
                            "for chunks. 1.0KiB in use in bin. 1000B client-requested in use in "
                            "bin.")
    # free remainder 1 MiB - 1536 = 1047040 bytes -> bin 11 (524288)
    assert bin_lines[11] == ("Bin (524288): \tTotal Chunks: 1, Chunks in use: 0. 1022.5KiB "
                             "allocated for chunks. 0B in use in bin. 0B client-requested in use "
                             "in bin.")
    assert lines[22] == "Bin for 0B was 256B, Chunk State: "
    assert lines[23] == "Next region of size 1048576"
    chunk_re = re.compile(r"^(InUse|Free ) at ([0-9a-f]+) of size (\d+) next (\d+)$")
    got = [chunk_re.match(ln) for ln in lines[24:28]]
    assert all(got), lines[24:28]
    assert [(m.group(1), int(m.group(2), 16), int(m.group(3))) for m in got] == [
        ("InUse", base, 256), ("InUse", base + 256, 256), ("InUse", base + 512, 1024),
        ("Free ", base + 1536, 1047040)]
    assert lines[24].startswith(f"InUse at {base:x} of size 256 next ")
    assert lines[28] == "     Summary of in-use Chunks by size: "
    assert lines[29] == "2 Chunks of size 256 totalling 512B"
    assert lines[30] == "1 Chunks of size 1024 totalling 1.0KiB"
    assert lines[31] == "Sum Total of in-use chunks: 1.5KiB"
    assert re.match(r"^(total_region_allocated_bytes_|Total bytes in pool): 1048576 "
                    r"memory_limit_: 1048576 available bytes: 0 "
                    r"curr_region_allocation_bytes_: 2097152$", lines[32]), lines[32]
    assert lines[33] == "Stats: "
    stats = {}
    for ln in lines[34:42]:
        m = re.match(r"^([A-Za-z]+:) +(-?\d+)$", ln)
        assert m, ln
        label = m.group(1)
        assert ln == f"{label:<18}{int(m.group(2)):>20}"
        stats[label] = int(m.group(2))
    assert list(stats) == ["Limit:", "InUse:", "MaxInUse:", "NumAllocs:", "MaxAllocSize:",
                           "Reserved:", "PeakReserved:", "LargestFreeBlock:"]
    assert lines[34] == "Limit:            %20d" % 1048576
    assert (stats["Limit:"], stats["InUse:"], stats["MaxInUse:"], stats["NumAllocs:"],
            stats["MaxAllocSize:"], stats["Reserved:"], stats["PeakReserved:"]) == (
        1048576, 1536, 1536, 3, 1024, 0, 0)
    assert all(ln == "" for ln in lines[42:])


def test_dump_memory_log_chunk_handles():
    # next = TensorFlow's chunk handle: h0 (the region), each split appends the next handle;
    # the last chunk's next is kInvalidChunkHandle (SIZE_MAX)
    a, base, _ = _dump_state()
    lines = a.dump_memory_log().split("\n")
    assert lines[24:28] == [
        f"InUse at {base:x} of size 256 next 1",
        f"InUse at {base + 256:x} of size 256 next 2",
        f"InUse at {base + 512:x} of size 1024 next 3",
        f"Free  at {base + 1536:x} of size 1047040 next {INVALID_HANDLE}",
    ]


def test_dump_memory_log_bin_for_request():
    a, _, _ = _dump_state()
    lines = a.dump_memory_log(600064).split("\n")
    # 600064 -> bin 11 (512.0KiB), holding the free remainder
    i = lines.index("Bin for 586.0KiB was 512.0KiB, Chunk State: ")
    assert lines[i + 1] == ("  Size: 1022.5KiB | Requested Size: 0B | in_use: 0 | bin_num: 11, "
                            "prev:   Size: 1.0KiB | Requested Size: 1000B | in_use: 1 | "
                            "bin_num: -1")
    assert lines[i + 2] == "Next region of size 1048576"


def test_dump_memory_log_empty_allocator():
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1 * MIB, name="empty")
    lines = a.dump_memory_log().split("\n")
    assert lines[0] == "BFCAllocator dump for empty"
    assert "Sum Total of in-use chunks: 0B" in lines
    assert not any(ln.startswith("Next region") for ln in lines)


def test_render_occupancy_empty():
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1 * MIB)
    assert a.render_occupancy() == "<allocator contains no memory>"


def test_render_occupancy_one_byte_in_2mib_region():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 1 * GIB, allow_growth=True)
    p = a.allocate(1)
    d = a.snapshot()
    want = expected_occupancy([(r.ptr, r.size) for r in d.regions], d.chunks)
    assert want == "*" + "_" * 99
    assert a.render_occupancy() == want
    a.deallocate(p)
    assert a.render_occupancy() == "_" * 100


def test_render_occupancy_waste_shows_x():
    # 100 slots of 256 B; 12801 B -> rounded 13056, chunk 25600 < 2*13056: whole chunk given
    a = gpudash.BFCAllocator(BumpSubAllocator(), 25600, allow_growth=False)
    p = a.allocate(12801)
    assert a.allocated_size(p) == 25600
    assert a.render_occupancy() == "*" * 51 + "x" * 49


def test_render_occupancy_several_regions():
    sub = BumpSubAllocator(gap=4096)
    a = gpudash.BFCAllocator(sub, 64 * MIB, allow_growth=True)
    ptrs = [a.allocate(n) for n in (300 * KIB, 1, 1500 * KIB, 3 * MIB + 5, 700 * KIB, 6 * MIB)]
    a.deallocate(ptrs[1])
    a.deallocate(ptrs[4])
    d = a.snapshot()
    assert len(d.regions) >= 3
    want = expected_occupancy(sorted((r.ptr, r.size) for r in d.regions), d.chunks)
    assert len(want) == 100 and set(want) <= {"*", "x", "_"}
    assert a.render_occupancy() == want


@pytest.mark.parametrize("n, text", [
    (0, "0B"), (1000, "1000B"), (1023, "1023B"), (1024, "1.0KiB"), (4096, "4.0KiB"),
    (1048575, "1024.0KiB"), (1048576, "1.00MiB"), (18874368, "18.00MiB"),
    (1054719, "1.00MiB"),  # integer division between units: 1029/1024, not 1.0059
    (3 * GIB - 1, "3.00GiB"), (1 << 40, "1.00TiB"),
])
def test_human_readable_reference(n, text):
    assert human_readable(n) == text


@pytest.mark.parametrize("n", [1000, 1054719, 1048575, 3 * GIB, 18874368])
def test_oom_message_human_readable(n):
    a = gpudash.BFCAllocator(BumpSubAllocator(), 512, allow_growth=False, name="GPU_0_bfc")
    with pytest.raises(gpudash.OutOfMemoryError) as ei:
        a.allocate(n)
    assert str(ei.value).startswith(
        f"Allocator (GPU_0_bfc) ran out of memory trying to allocate {human_readable(n)} "
        f"(rounded to {rounded_bytes(n)})")
