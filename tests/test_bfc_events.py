"""Allocator events: order, fields (gpudash/events.py table), seq numbering, isolation of
failing subscribers, unsubscribe."""

from __future__ import annotations

import threading
import warnings

import pytest

import gpudash
from bfc_helpers import KIB, MIB, BumpSubAllocator, bin_for_size, rounded_bytes

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

K = gpudash.EventKind


def make(limit=1 * MIB, growth=False, gc=False, name="ev", sub=None):
    sub = sub if sub is not None else BumpSubAllocator()
    a = gpudash.BFCAllocator(sub, limit, allow_growth=growth, garbage_collection=gc, name=name)
    events = []
    unsub = a.subscribe(events.append)
    return a, sub, events, unsub


def kinds(events):
    return [e.kind for e in events]


def fields(e):
    return (e.kind, e.ptr, e.size, e.requested, e.bin, e.region, e.alloc_id)


def test_first_allocation_extend_split_alloc():
    a, sub, ev, _ = make(limit=1 * MIB)
    base = sub.base
    p = a.allocate(1000)
    assert p == base
    assert kinds(ev) == [K.EXTEND, K.SPLIT, K.ALLOC]
    extend, split, alloc = ev
    assert fields(extend) == (K.EXTEND, base, 1 * MIB, 1024, -1, base, -1)
    rest = 1 * MIB - 1024
    assert fields(split) == (K.SPLIT, base + 1024, rest, 1024, bin_for_size(rest), base, -1)
    assert fields(alloc) == (K.ALLOC, base, 1024, 1000, bin_for_size(1024), base, 1)
    for e in ev:
        assert isinstance(e, gpudash.Event)
        assert e.allocator == "ev"


def test_allocation_from_free_chunk_without_split():
    a, sub, ev, _ = make(limit=1024)
    p = a.allocate(513)  # chunk 1024 < 2 * 768: no split
    assert kinds(ev) == [K.EXTEND, K.ALLOC]
    assert fields(ev[1]) == (K.ALLOC, p, 1024, 513, bin_for_size(1024), sub.base, 1)


def test_free_then_merges_next_first_then_prev():
    a, sub, ev, _ = make(limit=1 * MIB)
    base = sub.base
    pa = a.allocate(256)
    pb = a.allocate(256)
    pc = a.allocate(256)
    assert (pa, pb, pc) == (base, base + 256, base + 512)
    rest = 1 * MIB - 768
    ev.clear()
    a.deallocate(pb)  # neighbours in use: no merge
    assert kinds(ev) == [K.FREE]
    assert fields(ev[0]) == (K.FREE, pb, 256, 256, 0, base, 2)
    ev.clear()
    a.deallocate(pc)  # next (the free remainder) first, then prev (pb)
    assert kinds(ev) == [K.FREE, K.MERGE, K.MERGE]
    assert fields(ev[0]) == (K.FREE, pc, 256, 256, 0, base, 3)
    assert fields(ev[1]) == (K.MERGE, pc, 256 + rest, rest, -1, base, -1)
    assert fields(ev[2]) == (K.MERGE, pb, 512 + rest, 256 + rest, -1, base, -1)
    ev.clear()
    a.deallocate(pa)  # only next
    assert kinds(ev) == [K.FREE, K.MERGE]
    assert fields(ev[1]) == (K.MERGE, pa, 1 * MIB, 1 * MIB - 256, -1, base, -1)


def test_free_merges_prev_only():
    a, sub, ev, _ = make(limit=1024)
    p = [a.allocate(256) for _ in range(4)]
    a.deallocate(p[1])
    ev.clear()
    a.deallocate(p[2])
    assert kinds(ev) == [K.FREE, K.MERGE]
    assert fields(ev[1]) == (K.MERGE, p[1], 512, 256, -1, sub.base, -1)


def test_free_event_requested_and_alloc_id():
    a, sub, ev, _ = make(limit=1 * MIB)
    p1 = a.allocate(10)
    p2 = a.allocate(3000)
    allocs = [e for e in ev if e.kind == K.ALLOC]
    assert [e.alloc_id for e in allocs] == [1, 2]
    ev.clear()
    a.deallocate(p2)
    assert ev[0].kind == K.FREE
    assert (ev[0].ptr, ev[0].size, ev[0].requested, ev[0].alloc_id) == (p2, 3072, 3000, 2)
    assert ev[0].bin == bin_for_size(3072)
    a.deallocate(p1)


def test_seq_gapless_and_time_monotone():
    a, sub, ev, _ = make(limit=8 * MIB, growth=True, gc=True)
    ptrs = [a.allocate(n) for n in (100, 3000, 1 * MIB, 2 * MIB, 10, 500 * KIB)]
    for p in ptrs[::2]:
        a.deallocate(p)
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(64 * MIB)
    a.set_memory_limit(16 * MIB)
    for p in ptrs[1::2]:
        a.deallocate(p)
    a.release_free_regions()
    assert len(ev) > 15
    assert [e.seq for e in ev] == list(range(len(ev)))
    times = [e.time_ns for e in ev]
    assert all(isinstance(t, int) for t in times)
    assert times == sorted(times)


def test_zero_and_null_emit_nothing():
    a, sub, ev, _ = make()
    assert a.allocate(0) == 0
    a.deallocate(0)
    assert ev == []


def test_oom_event():
    a, sub, ev, _ = make(limit=1 * MIB)
    p = a.allocate(1000)
    ev.clear()
    n = 2 * MIB + 5
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(n)
    assert kinds(ev) == [K.OOM]
    r = rounded_bytes(n)
    assert fields(ev[0]) == (K.OOM, 0, r, n, bin_for_size(r), 0, -1)
    a.deallocate(p)


def test_limit_event():
    a, sub, ev, _ = make(limit=1 * MIB)
    a.set_memory_limit(3 * MIB)
    assert kinds(ev) == [K.LIMIT]
    e = ev[0]
    assert (e.ptr, e.size, e.requested, e.bin, e.region) == (0, 3 * MIB, 1 * MIB, -1, 0)
    assert (e.setting, e.old, e.new) == ("memory_limit", 1 * MIB, 3 * MIB)
    assert e.seq == 0


def test_release_events_on_release_free_regions():
    a, sub, ev, _ = make(limit=64 * MIB, growth=True, gc=True)
    p1 = a.allocate(2 * MIB)  # region 2 MiB
    p2 = a.allocate(4 * MIB)  # region 4 MiB
    p3 = a.allocate(1)  # region 8 MiB
    regions = [(p, n) for op, p, n in sub.calls if op == "alloc"]
    a.deallocate(p1)
    a.deallocate(p2)
    ev.clear()
    got = a.release_free_regions()
    assert got == 6 * MIB
    assert kinds(ev) == [K.RELEASE, K.RELEASE]
    assert {(e.ptr, e.size, e.requested, e.bin, e.region) for e in ev} == {
        (p, n, 0, -1, p) for p, n in regions[:2]}
    a.deallocate(p3)


def test_release_events_on_lowering_limit():
    a, sub, ev, _ = make(limit=64 * MIB, growth=True)
    p1 = a.allocate(2 * MIB)
    p2 = a.allocate(4 * MIB)
    a.deallocate(p1)
    ev.clear()
    a.set_memory_limit(4 * MIB)  # pool 6 MiB > 4 MiB: the free 2 MiB region goes
    rel = [e for e in ev if e.kind == K.RELEASE]
    assert [(e.ptr, e.size) for e in rel] == [(p1, 2 * MIB)]
    lim = [e for e in ev if e.kind == K.LIMIT]
    assert len(lim) == 1 and (lim[0].old, lim[0].new) == (64 * MIB, 4 * MIB)
    assert a.pool_bytes == 4 * MIB
    a.deallocate(p2)


def test_gc_emits_release_then_extend():
    a, sub, ev, _ = make(limit=8 * MIB, growth=True, gc=True)
    p = a.allocate(1 * MIB)
    q = a.allocate(1536 * KIB)
    a.deallocate(p)
    a.deallocate(q)
    ev.clear()
    r = a.allocate(5 * MIB)
    ks = kinds(ev)
    assert ks[:2] == [K.RELEASE, K.RELEASE]
    # 8 MiB region for 5 MiB: 8 < 2*5 and 3 MiB < 128 MiB, so no split
    assert ks[2:] == [K.EXTEND, K.ALLOC]
    assert ev[2].size == 8 * MIB and ev[2].ptr == r


def test_raising_subscriber_warns_and_others_still_receive():
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1 * MIB, name="ev")
    good_before, good_after = [], []
    a.subscribe(good_before.append)

    def bad(event):
        raise RuntimeError("subscriber bug")

    a.subscribe(bad)
    a.subscribe(good_after.append)
    with pytest.warns(gpudash.GpudashWarning):
        p = a.allocate(1000)
    assert p != 0
    assert a.allocated_size(p) == 1024
    assert kinds(good_before) == kinds(good_after) == [K.EXTEND, K.SPLIT, K.ALLOC]
    with pytest.warns(gpudash.GpudashWarning):
        a.deallocate(p)
    assert kinds(good_after)[-2:] == [K.FREE, K.MERGE]
    assert a.stats().bytes_in_use == 0
    a.check()


def test_raising_subscriber_during_oom_still_raises_oom():
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1024, name="ev")

    def bad(event):
        raise ValueError("boom")

    a.subscribe(bad)
    with pytest.warns(gpudash.GpudashWarning):
        with pytest.raises(gpudash.OutOfMemoryError):
            a.allocate(4096)


def test_unsubscribe_stops_delivery():
    a, sub, ev, unsub = make()
    other = []
    a.subscribe(other.append)
    p = a.allocate(100)
    n = len(ev)
    unsub()
    a.deallocate(p)
    a.allocate(200)
    assert len(ev) == n
    assert len(other) > n
    # seq keeps counting for the remaining subscriber
    assert [e.seq for e in other] == list(range(len(other)))


def test_no_warning_without_failures():
    a, sub, ev, _ = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a.deallocate(a.allocate(100))


def test_late_subscriber_sees_consecutive_seq():
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1 * MIB, name="ev")
    a.allocate(100)
    late = []
    a.subscribe(late.append)
    a.allocate(100)
    a.allocate(100)
    seqs = [e.seq for e in late]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


# ----------------------------------------------------------------------------- threads
def _run_with_timeout(fn, timeout=20.0):
    """Run ``fn`` in a daemon thread; True if it returned within ``timeout`` (a deadlock
    leaves the thread behind instead of hanging the test run)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def test_a_callback_may_join_a_thread_that_allocates():
    """The callback waits for a thread that allocates on the same allocator: that thread
    goes on (its events wait), and every event still arrives once, in seq order."""
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1 * MIB, name="ev")
    seen, joined = [], []

    def other():
        a.deallocate(a.allocate(300))

    def callback(event):
        seen.append(event)
        if event.kind == K.ALLOC and not joined:
            t = threading.Thread(target=other)
            t.start()
            t.join(timeout=3)
            joined.append(not t.is_alive())

    a.subscribe(callback)
    assert _run_with_timeout(lambda: a.allocate(100))
    assert joined == [True]
    assert [e.seq for e in seen] == list(range(len(seen)))
    # the first call's events, then the joined thread's, delivered after the callback
    assert kinds(seen) == [K.EXTEND, K.SPLIT, K.ALLOC, K.SPLIT, K.ALLOC, K.FREE, K.MERGE]
    a.check()


def test_a_slow_callback_holds_up_no_other_thread():
    """While a callback runs in one thread, another thread allocates, frees and reads the
    statistics without waiting for it; its events follow once the callback returns."""
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1 * MIB, name="ev")
    inside, gate = threading.Event(), threading.Event()
    seen, waited = [], []
    first = []

    def callback(event):
        seen.append((threading.current_thread().name, event))
        if not first:
            first.append(event)
            inside.set()
            waited.append(gate.wait(timeout=5))  # True only if the main thread went on

    t = threading.Thread(target=lambda: a.allocate(100), name="slow", daemon=True)
    a.subscribe(callback)
    t.start()
    assert inside.wait(5)
    done = _run_with_timeout(lambda: (a.deallocate(a.allocate(5000)), a.stats()), timeout=3)
    gate.set()
    t.join(5)
    assert done and waited == [True]
    assert [e.seq for _, e in seen] == list(range(len(seen)))
    assert {name for name, _ in seen} == {"slow"}  # the delivering thread delivered all
    assert kinds([e for _, e in seen])[-2:] == [K.FREE, K.MERGE]


def test_threads_racing_with_a_callback_get_every_event_in_order():
    """Four threads allocate and free while callbacks run: every event is delivered once,
    in seq order, and the allocator's state matches what the events say."""
    a = gpudash.BFCAllocator(BumpSubAllocator(), 64 * MIB, name="ev")
    seen = []
    a.subscribe(lambda e: seen.append(e.seq))
    a.subscribe(lambda e: None)

    def work(seed):
        for i in range(300):
            a.deallocate(a.allocate(256 * (1 + (seed * 7 + i) % 50)))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert seen == list(range(a.seq))
    assert not a._outbox.batches and a._outbox.thread is None
    a.check()


def test_a_thread_waits_when_too_many_operations_wait_for_delivery(monkeypatch):
    """Past OUTBOX_MAX queued operations, a thread waits for the callbacks to catch up
    (memory stays bounded); the delivering thread then hands the rest over to it."""
    from gpudash import _eventsource

    monkeypatch.setattr(_eventsource, "OUTBOX_MAX", 3)
    a = gpudash.BFCAllocator(BumpSubAllocator(), 1 * MIB, name="ev")
    inside, gate = threading.Event(), threading.Event()
    delivered_by = []

    def callback(event):
        delivered_by.append((threading.current_thread().name, event.seq))
        if not inside.is_set():
            inside.set()
            gate.wait(5)

    a.subscribe(callback)
    slow = threading.Thread(target=lambda: a.allocate(100), name="slow", daemon=True)
    slow.start()
    assert inside.wait(5)
    queued = []

    def busy():
        for _ in range(6):
            a.allocate(1000)
            queued.append(len(a._outbox.batches))

    busy_thread = threading.Thread(target=busy, name="busy", daemon=True)
    busy_thread.start()
    busy_thread.join(1)
    assert busy_thread.is_alive() and max(queued) <= 4  # held back, not queueing on
    gate.set()
    slow.join(5)
    busy_thread.join(5)
    assert not slow.is_alive() and not busy_thread.is_alive()
    assert [s for _, s in delivered_by] == list(range(a.seq))
    assert {name for name, _ in delivered_by} == {"slow", "busy"}  # handed over
