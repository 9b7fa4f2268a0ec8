"""The limit floor: under every limit from a replay's ``limit_floor`` up to its own limit,
the allocator makes the same decisions, call for call (``BFCAllocator.limit_floor``,
``CachingAllocator.limit_floor``, ``ReplayResult.limit_floor``), and ``min_fraction``
answers the fractions that fall in such a span without replaying them.

Each claim is checked by replaying again at the floor (and between): the events, the
per-call samples and the refusals must be the ones of the first replay.
"""

from __future__ import annotations

import math
import random

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from gpudash import SimulatedDevice
from gpudash.bfc import BFCAllocator, PyBFCAllocator
from gpudash.caching import CachingAllocator, PyCachingAllocator
from gpudash.trace.replay import _model_calls, limit_for, replay
from gpudash.trace.tasks import Probe, bisect, probe
from gpudash.trace.whatif import _base_settings, min_fraction
from gpudash.workloads import fragmentation_stress, trace_from_calls, training_loop

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

MIB, GIB = 1 << 20, 1 << 30
DEVICE = 16 * GIB


def fingerprint(r) -> dict:
    """What a replay did, call for call: its events (times aside), per-call samples and
    refusals."""
    cols = r.recording.columns
    out = {k: np.asarray(v).tolist() for k, v in cols.items() if "time" not in k}
    out.update({k: v.tolist() for k, v in r.per_call.items()})
    out.update(ooms=r.ooms.tolist(), peaks=(r.peak_pool_bytes, r.peak_bytes_in_use),
               extensions=r.extensions, releases=r.releases)
    return out


def fraction_for(limit: int, total: int = DEVICE) -> float:
    """A fraction whose ``int(fraction * total)`` is ``limit`` (PyTorch's rule)."""
    f = limit / total
    while int(f * total) < limit:
        f = math.nextafter(f, 2.0)
    while int(f * total) > limit:
        f = math.nextafter(f, 0.0)
    return f


def at_limit(trace, limit: int, **kw):
    """Replay at exactly ``limit`` bytes, recording."""
    if kw.get("allocator") == "torch":
        f = fraction_for(limit)
        assert int(f * DEVICE) == limit
        return replay(trace, device_bytes=DEVICE, fraction=f, **kw)
    return replay(trace, device_bytes=DEVICE, memory_limit=limit, **kw)


GC_TRACE = trace_from_calls([("alloc", 1, GIB), ("free", 1), ("alloc", 2, 2 * GIB),
                             ("free", 2)])

CASES = [
    # (name, trace, replay settings, the limit replayed, whether the floor is below it)
    ("bfc-growth-fragmentation", lambda: fragmentation_stress(rounds=600), {}, 8 * GIB, True),
    ("bfc-growth-training", lambda: training_loop(steps=3, layers=4, hidden=2048), {},
     6 * GIB, True),
    ("bfc-growth-deferred", lambda: training_loop(steps=3, layers=4, hidden=2048),
     {"deferred_deletion_bytes": 64 * MIB}, 6 * GIB, True),
    # a 1 GiB region, wholly free when 2 GiB is asked: garbage collection returns it
    ("bfc-garbage-collection", lambda: GC_TRACE, {"garbage_collection": True},
     GIB * 5 // 2, True),
    # the whole limit as one region, or a split rule scaled by it: the limit itself
    ("bfc-no-growth", lambda: fragmentation_stress(rounds=600), {"allow_growth": False},
     8 * GIB, False),
    ("bfc-fragmentation-fraction", lambda: fragmentation_stress(rounds=600),
     {"fragmentation_fraction": 0.01}, 8 * GIB, False),
    ("torch-default", lambda: training_loop(steps=3, layers=4, hidden=2048),
     {"allocator": "torch"}, 6 * GIB, True),
    ("torch-expandable", lambda: training_loop(steps=3, layers=4, hidden=2048),
     {"allocator": "torch", "expandable_segments": True}, 6 * GIB, True),
    ("torch-max-split", lambda: fragmentation_stress(rounds=600),
     {"allocator": "torch", "max_split_size_mb": 64}, 8 * GIB, True),
    ("torch-gc-threshold", lambda: training_loop(steps=3, layers=4, hidden=2048),
     {"allocator": "torch", "garbage_collection_threshold": 0.6}, 6 * GIB, False),
]


@pytest.mark.parametrize("name,make,kw,limit,below", CASES, ids=[c[0] for c in CASES])
def test_a_replay_is_the_same_at_every_limit_from_its_floor(name, make, kw, limit, below):
    trace = make()
    first = at_limit(trace, limit, **kw)
    assert first.fits and first.memory_limit == limit
    floor = first.limit_floor
    assert 0 < floor <= limit
    assert (floor < limit) == below
    want = fingerprint(first)
    rng = random.Random(name)
    between = [floor, (floor + limit) // 2, rng.randrange(floor, limit + 1)]
    for lim in between:
        again = at_limit(trace, lim, **kw)
        assert again.memory_limit == lim
        assert fingerprint(again) == want, f"{name}: differs at {lim} (floor {floor})"
        assert again.limit_floor == floor


def test_the_floor_is_the_least_such_limit_where_a_region_decides_it():
    """Growth's last region, and garbage collection's room to extend again, need exactly
    the floor: one allocation unit less and the replay differs."""
    t = fragmentation_stress(rounds=600)
    r = at_limit(t, 8 * GIB)
    assert r.limit_floor == r.peak_pool_bytes   # the regions, uncut, end at the floor
    below = at_limit(t, r.limit_floor - 256)
    assert fingerprint(below) != fingerprint(r)  # the last region is cut by 256 bytes
    gc = at_limit(GC_TRACE, GIB * 5 // 2, garbage_collection=True)
    assert gc.releases == 1 and gc.limit_floor == 2 * GIB
    assert not at_limit(GC_TRACE, 2 * GIB - 256, garbage_collection=True).fits


def test_a_failing_replay_fails_the_same_from_its_floor():
    t = training_loop(steps=3, layers=4, hidden=2048)
    first = replay(t, device_bytes=DEVICE, memory_limit=200 * MIB, max_ooms=1)
    assert not first.fits and first.stopped_early
    again = replay(t, device_bytes=DEVICE, memory_limit=first.limit_floor, max_ooms=1)
    assert again.ooms.tolist() == first.ooms.tolist() and again.calls == first.calls


# ------------------------------------------------------------------ the models themselves
CALLS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 96 * MIB)),
    st.tuples(st.just("free"), st.integers(0, 1 << 16))), min_size=1, max_size=120)


def _drive(alloc, calls) -> list:
    """Make ``calls``; the pointers returned (0: refused) and those freed (negated)."""
    live: list[int] = []
    out = []
    for op, n in calls:
        if op == "alloc":
            p = alloc.try_allocate(n)
            out.append(p)
            if p:
                live.append(p)
        elif live:
            p = live.pop(n % len(live))
            alloc.deallocate(p)
            out.append(-p)
    return out


@pytest.mark.parametrize("cls", [PyBFCAllocator, BFCAllocator], ids=["python", "compiled"])
@pytest.mark.parametrize("gc", [False, True], ids=["", "gc"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=CALLS, limit=st.integers(64 * MIB, 1 * GIB), pick=st.floats(0, 1))
def test_bfc_makes_the_same_calls_anywhere_from_its_floor(cls, gc, calls, limit, pick):
    a = cls(SimulatedDevice(2 * GIB), limit, garbage_collection=gc)
    want = _drive(a, calls)
    floor = a.limit_floor
    assert 0 <= floor <= limit
    other = floor + int(pick * (limit - floor))
    b = cls(SimulatedDevice(2 * GIB), other, garbage_collection=gc)
    assert _drive(b, calls) == want
    assert b.stats().peak_pool_bytes == a.stats().peak_pool_bytes


@pytest.mark.parametrize("cls", [PyCachingAllocator, CachingAllocator],
                         ids=["python", "compiled"])
@pytest.mark.parametrize("conf", [None, "expandable_segments:True",
                                  "max_split_size_mb:40"], ids=["", "expandable", "mss"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=CALLS, frac=st.floats(0.03, 0.5), pick=st.floats(0, 1))
def test_torch_makes_the_same_calls_anywhere_from_its_floor(cls, conf, calls, frac, pick):
    total = 2 * GIB
    a = cls(SimulatedDevice(total), conf, fraction=frac)
    want = _drive(a, calls)
    limit, floor = a.memory_limit, a.limit_floor
    assert 0 <= floor <= limit
    other = fraction_for(floor + int(pick * (limit - floor)), total)
    b = cls(SimulatedDevice(total), conf, fraction=other)
    assert floor <= b.memory_limit <= limit
    assert _drive(b, calls) == want


def test_a_live_change_leaves_no_floor_but_the_limit():
    a = BFCAllocator(SimulatedDevice(2 * GIB), GIB)
    a.deallocate(a.allocate(MIB))
    assert a.limit_floor == 2 * MIB
    a.set_memory_limit(GIB // 2)
    assert a.limit_floor > a.memory_limit   # nothing follows from one limit any more
    c = CachingAllocator(SimulatedDevice(2 * GIB), fraction=0.5)
    c.deallocate(c.allocate(MIB))
    assert c.limit_floor == 2 * MIB
    c.set_memory_fraction(0.25)
    assert c.limit_floor > c.memory_limit
    assert CachingAllocator(SimulatedDevice(GIB)).limit_floor == GIB   # no fraction


# ------------------------------------------------------------------ min_fraction
@pytest.mark.parametrize("kw", [{}, {"allocator": "torch"}], ids=["bfc", "torch"])
def test_min_fraction_tries_the_fractions_a_plain_bisection_tries(kw):
    """Knowing fractions from the floors changes nothing but the replays run: the same
    fractions, verdicts and answer as a bisection that replays every one."""
    t = training_loop(steps=3, layers=4, hidden=2048, seed=3)
    r = min_fraction(t, DEVICE, tolerance=0.002, **kw)
    base = _base_settings(t, None, DEVICE, dict(kw))
    calls = _model_calls(t, base)
    history: list = []

    def run(fracs):
        return {f: probe(dict(base, fraction=f, memory_limit=limit_for(base, f)), calls, 1)
                for f in fracs}

    plain, known = bisect(run, 0.0, 1.0, 0.002, history)
    assert known == 0
    assert (r.fraction, r.history) == (plain, history)
    assert r.known >= 2 and r.replays == len(history) - r.known


@pytest.mark.parametrize("width", [2, 3, 5])
def test_a_wider_bisection_knows_the_same_fractions(width):
    """Rounds of several replays (a cluster's) follow the same path and count the same
    fractions known as one replay at a time."""
    t = fragmentation_stress(rounds=400, seed=2)
    base = _base_settings(t, None, DEVICE, {})
    calls = _model_calls(t, base)
    ran: list = []

    def run(fracs):
        ran.extend(fracs)
        return {f: probe(dict(base, fraction=f, memory_limit=limit_for(base, f)), calls, 1)
                for f in fracs}

    def limit_of(f):
        return limit_for(base, f)

    one: list = []
    good1, known1 = bisect(run, 0.0, 1.0, 0.001, one, limit_of=limit_of)
    wide: list = []
    ran.clear()
    good, known = bisect(run, 0.0, 1.0, 0.001, wide, width=width, limit_of=limit_of)
    assert (good, wide, known) == (good1, one, known1)
    assert known1 >= 1
    # nothing a replay on the path answered was replayed again
    assert len(ran) == len(set(ran))


def test_a_replay_that_fails_beside_the_path_changes_nothing():
    """Replays run ahead of the path may raise (PyTorch's model refuses some settings under
    memory pressure); the error counts only where the path reaches that fraction."""
    asked: list = []

    def make_run(broken):
        def run(fracs):
            asked.extend(fracs)
            out = {}
            for f in fracs:
                limit = int(f * GIB)
                out[f] = (ValueError(f"no replay at {f}") if f in broken
                          else Probe(0 if f >= 0.3 else 1, limit, limit))
            return out
        return run

    one: list = []
    good, _ = bisect(make_run(set()), 0.0, 1.0, 0.01, one, width=1)
    path = {f for f, _ in one}
    beside = {0.75, 0.4375}   # asked for at width 3 (ahead of the path), never on it
    assert not beside & path
    asked.clear()
    wide: list = []
    assert bisect(make_run(beside), 0.0, 1.0, 0.01, wide, width=3)[0] == good
    assert wide == one and beside <= set(asked)
    with pytest.raises(ValueError, match="no replay at 0.25"):
        bisect(make_run({0.25}), 0.0, 1.0, 0.01, [], width=3)


def _probe_refusing_an_eighth(settings, max_ooms):
    """A worker's replay (whatif._probe_one) that fails at fraction 0.125."""
    from gpudash.trace import whatif

    if settings["fraction"] == 0.125:
        raise ValueError("no replay at 0.125")
    return probe(settings, whatif._WORKER["calls"], max_ooms)


def test_workers_going_ahead_of_the_path_survive_a_failing_replay(monkeypatch):
    """min_fraction(jobs=3) replays 0.125 beside its path (0.5 is known, 0.25 fails, so the
    path goes up); that replay failing changes nothing. Forked workers see the patched
    replay; others would not."""
    from gpudash.trace import whatif

    if whatif._pool_context().get_start_method() != "fork":
        pytest.skip("needs forked workers (Linux, no other thread)")
    t = fragmentation_stress(rounds=600)
    one = min_fraction(t, "4GiB", tolerance=0.01)
    assert one.history[:3] == [(1.0, 0), (0.5, 0), (0.25, 1)]
    assert 0.125 not in dict(one.history)
    monkeypatch.setattr(whatif, "_probe_one", _probe_refusing_an_eighth)
    three = min_fraction(t, "4GiB", tolerance=0.01, jobs=3)
    assert (three.fraction, three.history, three.known) == (one.fraction, one.history,
                                                            one.known)
