"""Analysis (gpudash.analysis): fragmentation series, heatmaps, allocator state at any event."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from gpudash import BFCAllocator, OutOfMemoryError, Recorder, SimulatedDevice
from gpudash.analysis import (
    Heatmap,
    HeatmapBuilder,
    StateScrubber,
    bin_occupancy,
    chunk_map_at_peak,
    fragmentation_series,
    heatmap,
    state_at,
)
from gpudash.events import COLUMN_DTYPES, COLUMNS, EventKind
from gpudash.trace import Trace
from gpudash.trace.replay import replay
from gpudash.workloads import fragmentation_stress, inference_server, training_loop

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
A, F, E, R = (int(EventKind.ALLOC), int(EventKind.FREE), int(EventKind.EXTEND),
              int(EventKind.RELEASE))
BASE = 0x10000


def rows_trace(rows, times=None):
    """rows: (kind, ptr, size, requested, alloc_id)."""
    n = len(rows)
    cols = {name: np.zeros(n, dtype=COLUMN_DTYPES[name]) for name in COLUMNS}
    for i, (kind, ptr, size, req, aid) in enumerate(rows):
        cols["seq"][i] = i
        cols["time_ns"][i] = i if times is None else times[i]
        cols["kind"][i] = kind
        cols["ptr"][i] = ptr
        cols["size"][i] = size
        cols["requested"][i] = req
        cols["alloc_id"][i] = aid
        cols["bin"][i] = -1
    return Trace(cols, {"source": "test"})


def record_session(capacity=2 * GIB, limit=GIB, *, allow_growth=True, ops=1500, seed=5,
                   close=False):
    dev = SimulatedDevice(capacity)
    a = BFCAllocator(dev, limit, allow_growth=allow_growth, name="GPU_0_bfc")
    rng = random.Random(seed)
    live = []
    with Recorder(a) as rec:
        for _ in range(ops):
            if live and rng.random() < 0.45:
                a.deallocate(live.pop(rng.randrange(len(live))))
            else:
                try:
                    live.append(a.allocate(int(2 ** rng.uniform(0, 25))))
                except MemoryError:
                    pass
        if close:
            a.close()
        trace = rec.to_trace()
    return a, trace


@pytest.fixture(scope="module")
def session():
    return record_session()


# ============================================================================ fragmentation
def test_fragmentation_series_by_hand():
    t = rows_trace([(E, BASE, 4096, 4096, -1),
                    (A, BASE, 1024, 1000, 1), (A, BASE + 1024, 1024, 1024, 2),
                    (A, BASE + 2048, 1024, 900, 3),
                    (F, BASE + 1024, 1024, 1024, 2), (F, BASE + 2048, 1024, 900, 3)])
    fs = fragmentation_series(t)
    assert fs["pool"].tolist() == [4096] * 6
    assert fs["in_use"].tolist() == [0, 1024, 2048, 3072, 2048, 1024]
    assert fs["requested_in_use"].tolist() == [0, 1000, 2024, 2924, 1900, 1000]
    assert fs["internal"].tolist() == [0, 24, 24, 148, 148, 24]
    assert fs["largest_free"].tolist() == [4096, 3072, 2048, 1024, 1024, 3072]
    assert fs["pool_minus_in_use"].tolist() == [4096, 3072, 2048, 1024, 2048, 3072]
    assert fs["external"].tolist() == [0.0, 0.0, 0.0, 0.0, 0.5, 0.0]
    assert fs["row"].tolist() == list(range(6))
    # a trace with no extend rows: one region spanning its allocations, from the start
    no_ext = fragmentation_series(t[1:].columns)
    assert no_ext["pool"].tolist() == [3072] * 5
    assert no_ext["largest_free"].tolist() == [2048, 1024, 0, 1024, 2048]
    assert no_ext["external"].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]


def test_fragmentation_series_equals_the_allocator_after_every_call(session):
    a, t = session
    fs = fragmentation_series(t)
    r = replay(t, options="trace")
    rows = t.calls().row
    for key in ("in_use", "pool", "largest_free"):
        assert np.array_equal(fs[key][rows], r.per_call[key]), key
    np.testing.assert_allclose(fs["external"][rows], r.per_call["fragmentation"], atol=1e-12)
    st = a.stats()
    assert fs["in_use"].max() == st.peak_bytes_in_use
    assert fs["pool"].max() == st.peak_pool_bytes
    assert fs["largest_free"][-1] == st.largest_free_block_bytes
    # requested bytes are tracked too
    assert fs["requested_in_use"][-1] == sum(c.requested_size for c in a.snapshot().chunks)


def test_fragmentation_series_after_close_and_with_ooms():
    a, t = record_session(limit=200 * MIB, close=True, ops=800)
    assert int((t.columns["kind"] == int(EventKind.OOM)).sum()) > 0
    fs = fragmentation_series(t)
    assert fs["in_use"][-1] == 0 and fs["pool"][-1] == 0 and fs["largest_free"][-1] == 0
    r = replay(t, options="trace")
    rows = t.calls().row
    assert np.array_equal(fs["largest_free"][rows], r.per_call["largest_free"])


# ============================================================================ heatmap
def tiny():
    return rows_trace([(E, BASE, 4096, 4096, -1), (A, BASE, 1536, 1500, 1),
                       (A, BASE + 3072, 256, 200, 2), (F, BASE, 1536, 1500, 1)],
                      times=[0, 10, 25, 40])


def test_heatmap_by_event_by_hand():
    h = heatmap(tiny(), rows=4, cols=4, by="event")
    assert isinstance(h, Heatmap) and h.shape == (4, 4)
    assert h.values.tolist() == [[0, 1, 1, 0], [0, 0.5, 0.5, 0], [0, 0, 0, 0],
                                 [0, 0, 0.25, 0.25]]
    assert h.row_edges.tolist() == [0, 1024, 2048, 3072, 4096]
    assert h.col_edges.tolist() == [0, 1, 2, 3, 4]
    assert h.regions == [(BASE, 4096, 0)]
    assert h.address(3072) == BASE + 3072
    assert h.used_bytes().tolist() == [0, 1536, 1792, 256]


def test_heatmap_by_time_averages_over_each_column():
    h = heatmap(tiny(), rows=4, cols=4, by="time")
    # A lives [10, 40), B [25, 40) (to the end); columns are 10 ns wide
    assert h.values.tolist() == [[0, 1, 1, 1], [0, 0.5, 0.5, 0.5], [0, 0, 0, 0],
                                 [0, 0, 0.125, 0.25]]
    assert h.col_edges.tolist() == [0, 10, 20, 30, 40]


def test_partial_row_coverage_is_exact():
    t = rows_trace([(E, BASE, 2 * MIB, 2 * MIB, -1), (A, BASE + 4096 + 256, KIB, KIB, 1)])
    h = heatmap(t, rows=1, cols=2)  # a 1 KiB block in a 2 MiB row
    assert h.values[0, 1] == 1 / 2048 and h.values[0, 0] == 0.0
    h = heatmap(t, rows=2048, cols=2)  # 1 KiB rows: the block straddles rows 4 and 5
    assert h.values[4, 1] == 0.75 and h.values[5, 1] == 0.25 and h.values.sum() == 1.0


def brute_heatmap(t, rows, cols, by, regions):
    """Per cell, per block: the overlap area, in plain Python."""
    c = t.columns
    n = len(t)
    offsets, total = {}, 0
    for p, s in regions:
        offsets[p] = total
        total += s
    H = total / rows
    times = (c["time_ns"] - c["time_ns"][0]).tolist()  # relative ints: exact as floats
    lo, hi = (0.0, float(n)) if by == "event" else (0.0, float(times[-1]))
    W = (hi - lo) / cols
    out = np.zeros((rows, cols))
    live = {}
    blocks = []
    for i, (k, p, s) in enumerate(zip(c["kind"].tolist(), c["ptr"].tolist(),
                                      c["size"].tolist())):
        now = i if by == "event" else times[i]
        if k == A:
            live[p] = (s, now)
        elif k == F and p in live:
            s0, t0 = live.pop(p)
            blocks.append((p, s0, t0, now))
    end = n if by == "event" else times[-1]
    blocks += [(p, s, t0, end) for p, (s, t0) in live.items()]
    for p, s, t0, t1 in blocks:
        base = max(q for q in offsets if q <= p)
        x0 = offsets[base] + p - base
        x1 = x0 + s
        for r in range(rows):
            ov = min(x1, (r + 1) * H) - max(x0, r * H)
            if ov <= 0:
                continue
            for j in range(cols):
                ot = min(t1, lo + (j + 1) * W) - max(t0, lo + j * W)
                if ot > 0:
                    out[r, j] += ov * ot / (H * W)
    return out, blocks, H, W, lo


@pytest.mark.parametrize("by", ["event", "time"])
def test_heatmap_matches_brute_force_and_conserves_bytes(by):
    _, t = record_session(ops=300, seed=11)
    h = heatmap(t, rows=12, cols=15, by=by)
    regions = [(p, s) for p, s, _ in h.regions]
    expect, blocks, H, W, lo = brute_heatmap(t, 12, 15, by, regions)
    np.testing.assert_allclose(h.values, expect, rtol=0, atol=1e-9)
    # conservation: the grid's byte-time equals the blocks' byte-time
    area = (h.values * H * W).sum()
    assert area == pytest.approx(sum(s * (t1 - t0) for _, s, t0, t1 in blocks), rel=1e-9)
    assert h.values.max() <= 1.0 and h.values.min() >= 0.0


def test_heatmap_address_space_options():
    t = fragmentation_stress(rounds=60, high="40MiB", low="10MiB")
    inferred = heatmap(t, rows=8, cols=5)
    lo = int(t.columns["ptr"].min())
    hi = int((t.columns["ptr"] + t.columns["size"]).max())
    assert inferred.regions == [(lo, hi - lo, 0)]  # no extend rows: the allocations' span
    pair = heatmap(t, rows=8, cols=5, address_space=(lo, hi - lo))
    assert np.array_equal(pair.values, inferred.values)
    dev = SimulatedDevice("2GiB")  # the synthetic trace's addresses start at its base
    whole = heatmap(t, rows=8, cols=5, address_space=dev)
    assert whole.row_edges[-1] == 2 * GIB and whole.outside == 0
    assert whole.used_bytes().sum() == pytest.approx(inferred.used_bytes().sum())
    outside = heatmap(t, rows=8, cols=5, address_space=[(1 << 50, 4096)])
    assert outside.values.sum() == 0 and outside.outside > 0
    with pytest.raises(ValueError, match="by must be"):
        heatmap(t, by="bytes")


def test_heatmap_of_recorded_trace_shows_regions_end_to_end(session):
    _, t = session
    h = heatmap(t, rows=64, cols=50)
    ext = t.columns["kind"] == E
    assert [r[:2] for r in h.regions] == sorted(set(zip(t.columns["ptr"][ext].tolist(),
                                                        t.columns["size"][ext].tolist())))
    assert h.row_edges[-1] == sum(s for _, s, _ in h.regions)
    # last column, last event: bytes in use match the allocator (time-averaged over a column
    # whose events differ, so compare the final state with a one-event column)
    h1 = heatmap(t, rows=64, cols=len(t))
    assert h1.used_bytes()[-1] == pytest.approx(fragmentation_series(t)["in_use"][-1])


# ---------------------------------------------------------------------------- builder
def test_builder_in_batches_equals_heatmap_by_event():
    t = inference_server(requests=60, seed=2)
    W = 40
    cols = len(t) // W
    space = [(p, s) for p, s, _ in heatmap(t, rows=2, cols=1).regions]
    whole = heatmap(t[:cols * W], rows=32, cols=cols, address_space=space)
    b = HeatmapBuilder(32, space, events_per_col=W)
    rng = np.random.default_rng(0)
    got = []
    i = 0
    while i < len(t):
        k = int(rng.integers(1, 200))
        got.append(b.add_events(t[i:i + k]))
        i += k
    assert sum(g.shape[1] for g in got) == cols == b.n_cols
    np.testing.assert_allclose(np.hstack(got), whole.values, atol=1e-12)
    np.testing.assert_allclose(b.values, whole.values, atol=1e-12)
    assert b.col_edges.tolist() == whole.col_edges.tolist()
    assert b.heatmap().values.shape == (32, cols)


def test_builder_by_time_equals_heatmap_by_time(session):
    _, t = session
    times = t.columns["time_ns"]
    cols = 25
    width = (int(times[-1]) - int(times[0])) / cols
    space = [(p, s) for p, s, _ in heatmap(t, rows=2, cols=1).regions]
    whole = heatmap(t, rows=16, cols=cols, by="time", address_space=space)
    b = HeatmapBuilder(16, space, by="time", ns_per_col=width)
    for i in range(0, len(t), 333):
        b.add_events(t[i:i + 333].columns)
    b.flush(now_ns=int(times[-1]) + 1)
    assert b.n_cols == cols
    np.testing.assert_allclose(b.values, whole.values, atol=1e-9)


def test_builder_keeps_only_recent_columns_and_needs_an_address_space():
    t = training_loop(steps=2, layers=2, hidden=512)
    space = [(p, s) for p, s, _ in heatmap(t, rows=2, cols=1).regions]
    b = HeatmapBuilder(8, space, events_per_col=5, keep_cols=4)
    b.add_events(t)
    assert b.values.shape == (8, 4) and b.n_cols == len(t) // 5
    assert b.col_edges.tolist() == [5.0 * c for c in range(b.n_cols - 4, b.n_cols + 1)]
    full = HeatmapBuilder(8, space, events_per_col=5)
    full.add_events(t)
    np.testing.assert_allclose(b.values, full.values[:, -4:])
    with pytest.raises(ValueError, match="address_space"):
        HeatmapBuilder(8)
    with pytest.raises(ValueError, match="ns_per_col"):
        HeatmapBuilder(8, space, by="time")


# ============================================================================ state
def direct_snapshot(trace, index, capacity, limit, allow_growth=True):
    """Replay by hand, without gpudash.trace.replay: the calls at or before row ``index``."""
    a = BFCAllocator(SimulatedDevice(capacity), limit, allow_growth=allow_growth,
                     name="GPU_0_bfc")
    calls = trace.calls()
    ptrs = {}
    for op, key, n, row in zip(calls.op.tolist(), calls.key.tolist(), calls.nbytes.tolist(),
                               calls.row.tolist()):
        if row > index:
            break
        if op == 2:
            if key in ptrs:
                a.deallocate(ptrs.pop(key))
            continue
        try:
            p = a.allocate(n)
        except OutOfMemoryError:
            continue
        if op == 1:
            ptrs[key] = p
        else:
            a.deallocate(p)
    return a.snapshot()


def test_state_at_equals_a_direct_replay_at_random_indices():
    _, t = record_session(limit=300 * MIB, ops=1200, seed=8)  # with OOMs
    rng = random.Random(0)
    for index in [0, len(t) - 1] + [rng.randrange(len(t)) for _ in range(8)]:
        got = state_at(t, index)
        assert got.seq == int(t.columns["seq"][index]) + 1
        assert dataclasses.replace(got, seq=0) == direct_snapshot(t, index, 2 * GIB,
                                                                  300 * MIB), index
    assert state_at(t, -1) == state_at(t, len(t) - 1)
    with pytest.raises(IndexError):
        state_at(t, len(t))


def test_state_at_end_is_the_recorded_allocators_state(session):
    a, t = session
    d = state_at(t, len(t) - 1)
    assert d == a.snapshot()  # seq included: the next event's seq
    other = state_at(t, len(t) - 1, options={"allow_growth": False})
    assert len(other.regions) == 1 and other.regions[0].size == GIB


def test_scrubber_back_and_forth_equals_state_at():
    _, t = record_session(ops=1500, seed=12)
    sc = StateScrubber(t, checkpoint_every=100)
    rng = random.Random(1)
    order = [len(t) - 1, 3, 1000, 999, 2, len(t) // 2] + [rng.randrange(len(t))
                                                            for _ in range(12)]
    for index in order:
        assert sc.state_at(index) == state_at(t, index), index
        sc._engine.alloc.check()  # copies from checkpoints keep every invariant
    assert sc.stats_at(len(t) - 1) == state_at(t, len(t) - 1).stats
    assert sc[5] == state_at(t, 5)
    assert len(sc) == len(t) and sc.calls == len(t.calls())
    assert "checkpoints=" in repr(sc)


def test_checkpoint_copy_is_independent():
    _, t = record_session(ops=600, seed=13)
    sc = StateScrubber(t, checkpoint_every=50)
    sc.goto_call(sc.calls)
    cp = sc._checkpoints[100]
    before = cp.alloc.snapshot()
    sc.goto_call(120)     # restarts from a copy of the checkpoint at 100 and moves on
    sc.goto_call(sc.calls)
    assert cp.alloc.snapshot() == before
    assert cp.sub.dev.blocks() == [(r.ptr, r.size) for r in before.regions]


def test_chunk_map_at_peak_and_bin_occupancy(session):
    a, t = session
    peak = chunk_map_at_peak(t)
    st = a.stats()
    assert peak.stats.bytes_in_use == st.peak_bytes_in_use
    occ = bin_occupancy(peak)
    assert len(occ["bin"]) == 21 and occ["bin_size"][0] == 256
    assert occ["in_use_bytes"].sum() == peak.stats.bytes_in_use
    assert occ["free_bytes"].sum() == peak.stats.pool_bytes - peak.stats.bytes_in_use
    assert occ["free_chunks"].sum() == sum(1 for c in peak.chunks if not c.in_use)
    assert occ["total_bytes"].sum() == peak.stats.pool_bytes
    assert occ["requested_bytes"].sum() == sum(c.requested_size for c in peak.chunks)
