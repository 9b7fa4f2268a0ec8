"""Stateful property tests: random allocate / deallocate / set_memory_limit /
release_free_regions / clear_stats against a model of TensorFlow's BFC allocator.

The model predicts, from the snapshot before each allocation, the exact chunk chosen (best
fit by (size, address)), whether it is split (§5), the exact region requested on extension
(§6: doubling, limit clamp) and garbage collection (§8). After ``set_memory_limit`` (not a
TensorFlow call) region sizes are only checked to be within the limit, and while the pool is
above a lowered limit the model follows gpudash's live-limit rules: refuse past the limit,
split to the rounded size, return each region as it empties.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import gpudash
from bfc_helpers import (
    KIB,
    MIB,
    BumpSubAllocator,
    check_snapshot,
    fingerprint,
    rounded_bytes,
    split_threshold,
)

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

SIZES = st.one_of(
    st.integers(0, 2048),
    st.integers(0, 256 * KIB),
    st.integers(0, 4 * MIB),
    st.integers(0, 64 * MIB),
)


def _wholly_free_regions(dump):
    used = {c.region for c in dump.chunks if c.in_use}
    return {(r.ptr, r.size) for r in dump.regions if r.ptr not in used}


class BFCMachine(RuleBasedStateMachine):
    GROWTH = True
    GC = False
    FRAC = 0.0

    def __init__(self):
        super().__init__()
        self.a = None

    # ------------------------------------------------------------------ setup
    @initialize(limit=st.sampled_from([3 * MIB + 100, 16 * MIB, 64 * MIB, 200 * MIB + 1000]))
    def setup(self, limit):
        self.sub = BumpSubAllocator()
        self.a = gpudash.BFCAllocator(self.sub, limit, allow_growth=self.GROWTH,
                                      garbage_collection=self.GC,
                                      fragmentation_fraction=self.FRAC, name="prop")
        self.limit = limit
        self.limits_seen = {limit}
        self.live: dict[int, tuple[int, int, int]] = {}  # ptr -> (requested, size, alloc_id)
        self.num_allocs = 0
        self.peak = 0
        self.largest = 0
        self.peak_pool = 0
        self.next_id = 1
        self.curr = rounded_bytes(min(limit, 2 * MIB)) if self.GROWTH else rounded_bytes(limit)
        self.exact_growth = True

    # ------------------------------------------------------------------ helpers
    def _pool(self):
        return sum(self.sub.outstanding.values())

    def _split_sizes(self, chunk_size, rounded):
        """Possible allocated sizes for a chunk (two thresholds if the limit changed)."""
        out = set()
        for lim in self.limits_seen if self.FRAC > 0 else {self.limit}:
            thr = split_threshold(self.FRAC, lim)
            split = chunk_size >= 2 * rounded or chunk_size - rounded >= thr
            out.add(rounded if split else chunk_size)
        return out

    def _plan_extend(self, rounded, pool):
        """TensorFlow's Extend with a sub-allocator that never refuses: region size or None."""
        available = (self.limit - pool) // 256 * 256
        if rounded > available:
            return None
        c, grew = self.curr, False
        while rounded > c:
            c *= 2
            grew = True
        return min(c, available), (c if grew else c * 2)

    # ------------------------------------------------------------------ rules
    @rule(n=SIZES)
    def allocate(self, n):
        a, sub = self.a, self.sub
        before = fingerprint(a)
        dump = a.snapshot()
        ncalls = len(sub.calls)
        if n == 0:
            assert a.allocate(0) == 0
            assert fingerprint(a) == before and len(sub.calls) == ncalls
            return
        rounded = rounded_bytes(n)
        pool = self._pool()
        capped = pool > self.limit
        assert a.pool_over_limit is capped
        in_use = sum(s for _, s, _ in self.live.values())
        free = [c for c in dump.chunks if not c.in_use and c.size >= rounded]
        if capped and in_use + rounded > self.limit:
            free = []  # refused: it would take bytes in use past the lowered limit
        gc_regions = set()
        new_region = None  # (ptr, size)
        if free:
            best = min(free, key=lambda c: (c.size, c.address))
            expect_ptr, expect_sizes = best.address, self._split_sizes(best.size, rounded)
            if capped:
                expect_sizes = {rounded}
        else:
            plan = self._plan_extend(rounded, pool)
            if plan is None and self.GC:
                wf = _wholly_free_regions(dump)
                total_free = sum(s for _, s in wf)
                if total_free > 0 and rounded <= self.limit - pool + total_free:
                    gc_regions = wf
                    pool -= total_free
                    plan = self._plan_extend(rounded, pool)
                    assert plan is not None
            if plan is None:
                expect_ptr = None
            else:
                size, next_curr = plan
                expect_ptr = (sub.next + 255) // 256 * 256
                new_region = (expect_ptr, size)
                expect_sizes = self._split_sizes(size, rounded)
        try:
            ptr = a.allocate(n)
        except gpudash.OutOfMemoryError as e:
            assert expect_ptr is None, (
                f"allocate({n}) raised OutOfMemoryError; the model expected {expect_ptr:#x} "
                f"(free fit: {bool(free)}, pool {pool}, limit {self.limit}): {e}")
            assert fingerprint(a) == before, "a failed allocation changed the state"
            assert len(sub.calls) == ncalls, "a failed allocation called the sub-allocator"
            return
        assert expect_ptr is not None, (
            f"allocate({n}) succeeded at {ptr:#x}; the model expected OutOfMemoryError "
            f"(pool {pool}, limit {self.limit})")
        new_calls = sub.calls[ncalls:]
        if free:
            assert new_calls == [], f"extended although a free chunk fitted: {new_calls}"
            assert ptr == expect_ptr, f"best fit: got {ptr:#x}, expected {expect_ptr:#x}"
        else:
            freed = {(p, s) for op, p, s in new_calls if op == "free"}
            assert freed == gc_regions, f"GC freed {freed}, expected {gc_regions}"
            grants = [(p, s) for op, p, s in new_calls if op == "alloc"]
            assert len(grants) == 1, new_calls
            gptr, gsize = grants[0]
            assert ptr == gptr
            if self.exact_growth:
                assert (gptr, gsize) == new_region, (
                    f"region {gsize} requested, expected {new_region[1]}")
                self.curr = next_curr
            else:
                assert rounded <= gsize <= (self.limit - pool) // 256 * 256
                assert gsize % 256 == 0
                expect_sizes = self._split_sizes(gsize, rounded)
            assert self._pool() <= self.limit
        size = a.allocated_size(ptr)
        assert size in expect_sizes, f"allocated {size}, expected one of {expect_sizes}"
        assert a.requested_size(ptr) == n
        for p, (_, s, _) in self.live.items():
            assert ptr + size <= p or p + s <= ptr, f"{ptr:#x}+{size} overlaps {p:#x}+{s}"
        (chunk,) = [c for c in a.snapshot().chunks if c.address == ptr]
        assert chunk.in_use and chunk.allocation_id == self.next_id
        self.live[ptr] = (n, size, self.next_id)
        self.next_id += 1
        self.num_allocs += 1
        self.largest = max(self.largest, size)

    @precondition(lambda self: self.a is not None)
    @rule(frac=st.floats(0.05, 1.0))
    def allocate_near_limit(self, frac):
        # large requests relative to the limit: extensions clamped by the limit, refusals,
        # garbage collection
        self.allocate(max(1, int(frac * self.limit)))

    @precondition(lambda self: self.a is not None and self.live)
    @rule(data=st.data())
    def deallocate(self, data):
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        ncalls = len(self.sub.calls)
        regions = [(r.ptr, r.size) for r in self.a.snapshot().regions]
        capped = self._pool() > self.limit
        (region,) = [r for r in regions if r[0] <= ptr < r[0] + r[1]]
        self.a.deallocate(ptr)
        del self.live[ptr]
        empty = not any(region[0] <= p < region[0] + region[1] for p in self.live)
        dump = self.a.snapshot()
        if capped and empty:  # a lowered limit: the region goes back as it empties
            assert self.sub.calls[ncalls:] == [("free", *region)]
            assert [(r.ptr, r.size) for r in dump.regions] == [r for r in regions
                                                                if r != region]
            return
        assert len(self.sub.calls) == ncalls, "deallocate called the sub-allocator"
        assert [(r.ptr, r.size) for r in dump.regions] == regions
        (holder,) = [c for c in dump.chunks if c.address <= ptr < c.address + c.size]
        assert not holder.in_use

    @precondition(lambda self: self.a is not None and len(self.live) > 1)
    @rule(data=st.data())
    def deallocate_many(self, data):
        # frees a batch, which leaves wholly free regions behind (for GC and releases)
        ptrs = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True,
                                  min_size=1, max_size=len(self.live)))
        for p in ptrs:
            self.a.deallocate(p)
            del self.live[p]
        check_snapshot(self.a.snapshot())

    @precondition(lambda self: self.a is not None)
    @rule(n=st.one_of(st.integers(256 * KIB, 256 * MIB), st.integers(1 * MIB, 16 * MIB)))
    def set_memory_limit(self, n):
        a = self.a
        dump = a.snapshot()
        wf = _wholly_free_regions(dump)
        pool_before = self._pool()
        ncalls = len(self.sub.calls)
        a.set_memory_limit(n)
        self.limit = n
        self.limits_seen.add(n)
        self.exact_growth = False
        assert a.memory_limit == n
        assert a.stats().bytes_limit == n
        new_calls = self.sub.calls[ncalls:]
        assert all(op == "free" for op, _, _ in new_calls), new_calls
        released = {(p, s) for _, p, s in new_calls}
        assert released <= wf, "released a region with memory in use"
        if pool_before <= n:
            assert not released, "raising the limit released regions"
        else:
            assert self._pool() <= n or released == wf, (
                "pool still above the limit while wholly free regions remain")

    @precondition(lambda self: self.a is not None)
    @rule()
    def release_free_regions(self):
        wf = _wholly_free_regions(self.a.snapshot())
        ncalls = len(self.sub.calls)
        got = self.a.release_free_regions()
        released = {(p, s) for op, p, s in self.sub.calls[ncalls:] if op == "free"}
        assert len(self.sub.calls) - ncalls == len(released)
        assert got == sum(s for _, s in released)
        if self.GC:
            assert released == wf
        else:
            assert released in (wf, set())

    @precondition(lambda self: self.a is not None)
    @rule()
    def clear_stats(self):
        self.a.clear_stats()
        self.num_allocs = 0
        self.largest = 0
        self.peak = sum(s for _, s, _ in self.live.values())
        self.peak_pool = self._pool()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        a = self.a
        if a is None:
            return
        a.check()
        dump = a.snapshot()
        check_snapshot(dump)
        # regions == what the sub-allocator has outstanding
        regions = {(r.ptr, r.size) for r in dump.regions}
        assert regions == set(self.sub.outstanding.items())
        assert not self.sub.errors, self.sub.errors
        pool = self._pool()
        assert a.pool_bytes == pool == sum(s for _, s in regions)
        # live pointers: in a region, in use, with the model's sizes
        chunks = {c.address: c for c in dump.chunks}
        for p, (req, size, aid) in self.live.items():
            c = chunks.get(p)
            assert c is not None and c.in_use, f"live {p:#x} not an in-use chunk"
            assert (c.size, c.requested_size, c.allocation_id) == (size, req, aid)
            assert any(rp <= p and p + size <= rp + rs for rp, rs in regions)
        assert sum(1 for c in dump.chunks if c.in_use) == len(self.live)
        in_use = sum(s for _, s, _ in self.live.values())
        self.peak = max(self.peak, in_use)
        self.peak_pool = max(self.peak_pool, pool)
        s = a.stats()
        assert s.bytes_in_use == in_use == sum(a.allocated_size(p) for p in self.live)
        assert s.num_allocs == self.num_allocs
        assert s.peak_bytes_in_use == self.peak
        assert s.largest_alloc_size == self.largest
        assert s.pool_bytes == pool
        assert s.peak_pool_bytes == self.peak_pool
        assert s.bytes_limit == self.limit
        # above a lowered limit no region stays wholly free (each goes back as it empties)
        assert a.pool_over_limit is (pool > self.limit)
        if pool > self.limit:
            assert not _wholly_free_regions(dump)
        free_sizes = [c.size for c in dump.chunks if not c.in_use]
        largest_free = max(free_sizes, default=0)
        assert s.largest_free_block_bytes == largest_free
        total_free = pool - in_use
        assert total_free == sum(free_sizes)
        frag = 0.0 if total_free == 0 else 1.0 - largest_free / total_free
        assert math.isclose(s.fragmentation, frag, abs_tol=1e-9)


def _make(growth, gc, frac):
    name = f"BFC_growth{int(growth)}_gc{int(gc)}_frac{str(frac).replace('.', '')}"
    machine = type(name, (BFCMachine,), {"GROWTH": growth, "GC": gc, "FRAC": frac})
    case = machine.TestCase
    case.settings = settings(max_examples=60, stateful_step_count=50, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    return case


for _growth in (True, False):
    for _gc in (False, True):
        for _frac in (0.0, 0.01):
            globals()[f"TestBFC_growth{int(_growth)}_gc{int(_gc)}_frac{int(_frac * 100)}"] = (
                _make(_growth, _gc, _frac))


# --------------------------------------------------------------------------------------------
# set_memory_limit / release_free_regions, deterministic cases (gpudash extensions)
# --------------------------------------------------------------------------------------------


def test_lowering_limit_below_in_use_refuses_extensions_only():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 64 * MIB, allow_growth=True, name="lim")
    p = a.allocate(1 * MIB)  # region 2 MiB
    q = a.allocate(4 * MIB)  # region 4 MiB
    before = {x: (a.allocated_size(x), a.requested_size(x)) for x in (p, q)}
    a.set_memory_limit(1 * MIB)
    assert a.memory_limit == 1 * MIB and a.stats().bytes_limit == 1 * MIB
    # memory in use is neither moved nor freed
    assert {x: (a.allocated_size(x), a.requested_size(x)) for x in (p, q)} == before
    assert a.pool_bytes == 6 * MIB and sub.freed == []
    assert a.pool_over_limit and a.over_limit
    assert a.pending_release() == (5 * MIB, 2)
    # 5 MiB in use against 1 MiB: even what fits in the first region's free rest is refused
    n = len(sub.calls)
    with pytest.raises(gpudash.OutOfMemoryError, match="lowered live to 1.00MiB"):
        a.allocate(256 * KIB)
    assert len(sub.calls) == n
    a.check()
    # raising it again lets allocations extend further
    a.set_memory_limit(64 * MIB)
    assert not a.pool_over_limit and a.pending_release() == (0, 0)
    s = a.allocate(2 * MIB)
    assert len(sub.granted) == 3 and a.pool_bytes > 6 * MIB
    for x in (p, q, s):
        a.deallocate(x)
    a.check()


def test_lowered_limit_serves_up_to_the_limit_and_returns_regions_as_they_empty():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 64 * MIB, allow_growth=True, name="lim")
    p = a.allocate(1 * MIB)  # region 2 MiB, 1 MiB of it free
    q = a.allocate(4 * MIB)  # region 4 MiB, full
    a.set_memory_limit(5 * MIB + 512 * KIB)  # 5 MiB in use, pool 6 MiB: capped
    assert a.pool_over_limit and sub.freed == []
    # fits under the limit: served from the free rest of the first region, split to the
    # rounded size even though TensorFlow's rule would hand over the whole 1 MiB chunk
    r = a.allocate(300 * KIB)
    assert p < r < p + 2 * MIB
    assert a.allocated_size(r) == 300 * KIB
    assert a.bytes_in_use == 5 * MIB + 300 * KIB
    # past the limit: refused, nothing changes
    before = a.stats()
    with pytest.raises(gpudash.OutOfMemoryError) as err:
        a.allocate(256 * KIB)
    assert "lowered live" in str(err.value)
    assert a.stats() == before
    # freeing q empties its region: it goes back at once, and the pool fits again
    a.deallocate(q)
    assert sub.freed == [(q, 4 * MIB)]  # q started its own region
    assert a.pool_bytes == 2 * MIB and not a.pool_over_limit
    # then the allocator is TensorFlow's again: free regions stay in the pool
    a.deallocate(r)
    a.deallocate(p)
    assert a.pool_bytes == 2 * MIB
    a.check()


def test_lowering_limit_releases_free_regions_until_pool_fits():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 64 * MIB, allow_growth=True, name="lim")
    ptrs = [a.allocate(n) for n in (2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB)]  # 4 full regions
    assert sub.granted == [2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB]
    for x in ptrs[:3]:
        a.deallocate(x)
    a.set_memory_limit(20 * MIB)  # pool 30 MiB: at least 10 MiB of free regions must go
    assert a.pool_bytes <= 20 * MIB
    released = sub.freed
    assert released and all(n in (2 * MIB, 4 * MIB, 8 * MIB) for _, n in released)
    assert a.pool_bytes == 30 * MIB - sum(n for _, n in released)
    assert a.allocated_size(ptrs[3]) == 16 * MIB
    a.check()
    check_snapshot(a.snapshot())
    # lowering below what is in use releases every free region and keeps the rest
    a.set_memory_limit(1 * MIB)
    assert a.pool_bytes == 16 * MIB
    assert sub.outstanding == {ptrs[3]: 16 * MIB}
    a.check()


def test_raising_limit_releases_nothing():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 8 * MIB, allow_growth=True)
    p = a.allocate(1 * MIB)
    a.deallocate(p)
    a.set_memory_limit(16 * MIB)
    assert sub.freed == [] and a.pool_bytes == 2 * MIB


def test_release_free_regions_returns_bytes():
    sub = BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, 64 * MIB, allow_growth=True, garbage_collection=True)
    p = a.allocate(1 * MIB)
    q = a.allocate(3 * MIB)
    a.deallocate(p)
    assert a.release_free_regions() == 2 * MIB
    assert a.release_free_regions() == 0
    assert a.pool_bytes == 4 * MIB
    a.deallocate(q)
    assert a.release_free_regions() == 4 * MIB
    assert a.pool_bytes == 0 and sub.outstanding == {}
    assert a.render_occupancy() == "<allocator contains no memory>"
    # and the allocator still works afterwards
    r = a.allocate(100)
    assert a.allocated_size(r) == 256
    a.check()


def test_properties_read_only_values():
    a = gpudash.BFCAllocator(BumpSubAllocator(), 5 * MIB, allow_growth=False, name="props")
    assert (a.memory_limit, a.allow_growth, a.name, a.pool_bytes) == (5 * MIB, False, "props", 0)
    d = a.snapshot()
    assert d.allocator_name == "props"
    assert list(d.chunks) == []
    assert list(d.regions) == [] and len(d.bins) == 21
    s = a.stats()
    assert (s.num_allocs, s.bytes_in_use, s.peak_bytes_in_use, s.largest_alloc_size,
            s.bytes_limit, s.pool_bytes, s.peak_pool_bytes, s.largest_free_block_bytes) == (
        0, 0, 0, 0, 5 * MIB, 0, 0, 0)
    assert s.fragmentation == 0.0
    p = a.allocate(1000)
    d = a.snapshot()
    assert d.stats.bytes_in_use == 1024 and d.stats.num_allocs == 1
    assert a.stats().fragmentation == 0.0  # one free chunk: 1 - largest/total = 0
    a.deallocate(p)
