"""Replay of traces through a fresh BFC allocator (gpudash.trace.replay)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpudash import (BFCAllocator, ConfigError, GPUOptions, GpudashWarning, Recorder,
                     SimulatedDevice)
from gpudash.events import COLUMN_DTYPES, COLUMNS, EventKind
from gpudash.options import memory_limit as tf_memory_limit
from gpudash.trace import Trace
from gpudash.trace.replay import (ReplayResult, replay, replay_devices, resolve_settings,
                                  trace_settings)
from gpudash.workloads import trace_from_calls, training_loop

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
A, F, O = int(EventKind.ALLOC), int(EventKind.FREE), int(EventKind.OOM)


def record_session(capacity=4 * GIB, limit=3 * GIB, *, allow_growth=True, gc=False, ops=2500,
                   seed=1, max_log2=26, index=0):
    """A seeded random session on a simulated device, recorded; returns (allocator, trace)."""
    dev = SimulatedDevice(capacity, index=index)
    a = BFCAllocator(dev, limit, allow_growth=allow_growth, garbage_collection=gc,
                     name=f"GPU_{index}_bfc")
    a.device_index = index
    rng = random.Random(seed)
    live = []
    with Recorder(a) as rec:
        for _ in range(ops):
            if live and rng.random() < 0.45:
                a.deallocate(live.pop(rng.randrange(len(live))))
            else:
                try:
                    live.append(a.allocate(int(2 ** rng.uniform(0, max_log2))))
                except MemoryError:
                    pass
        trace = rec.to_trace()
    return a, trace


def rows_trace(rows):
    """rows: (kind, ptr, size, requested, alloc_id); time = row number."""
    n = len(rows)
    cols = {name: np.zeros(n, dtype=COLUMN_DTYPES[name]) for name in COLUMNS}
    for i, (kind, ptr, size, req, aid) in enumerate(rows):
        cols["seq"][i] = i
        cols["time_ns"][i] = i
        cols["kind"][i] = kind
        cols["ptr"][i] = ptr
        cols["size"][i] = size
        cols["requested"][i] = req
        cols["alloc_id"][i] = aid
        cols["bin"][i] = -1
    return Trace(cols, {"source": "test"})


# ------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("allow_growth,gc,limit", [
    (True, False, 3 * GIB),
    (False, False, 3 * GIB),
    (True, True, 600 * MIB),     # OOMs and garbage collection
    (False, False, 400 * MIB),   # OOMs without growth
])
def test_replay_of_a_recorded_session_reproduces_it_exactly(allow_growth, gc, limit):
    a, trace = record_session(limit=limit, allow_growth=allow_growth, gc=gc)
    st = a.stats()
    r = replay(trace, device_bytes=4 * GIB, memory_limit=limit, allow_growth=allow_growth,
               garbage_collection=gc)
    assert r.peak_bytes_in_use == st.peak_bytes_in_use
    assert r.peak_pool_bytes == st.peak_pool_bytes
    assert r.memory_limit == limit
    final = a.snapshot()
    assert r.final_snapshot.chunks == final.chunks
    assert r.final_snapshot.regions == final.regions
    assert r.final_snapshot.stats == final.stats
    n_oom_rows = int((trace.columns["kind"] == O).sum())
    assert r.oom_count == n_oom_rows
    # the replay's own recording has the very same events
    for name in ("kind", "ptr", "size", "requested", "bin", "region", "alloc_id"):
        assert np.array_equal(r.recording.columns[name], trace.columns[name]), name
    assert r.extensions == int((trace.columns["kind"] == int(EventKind.EXTEND)).sum())
    assert r.releases == int((trace.columns["kind"] == int(EventKind.RELEASE)).sum())


def test_options_trace_takes_the_recorded_settings():
    a, trace = record_session(capacity=2 * GIB, limit=1536 * MIB, allow_growth=False)
    s = trace_settings(trace)
    assert s["device_bytes"] == 2 * GIB and s["memory_limit"] == 1536 * MIB
    assert s["allow_growth"] is False and s["garbage_collection"] is False
    r = replay(trace, options="trace")
    assert r.final_snapshot.chunks == a.snapshot().chunks
    assert r.peak_pool_bytes == a.stats().peak_pool_bytes


def test_explicit_fraction_overrides_the_recorded_limit():
    _, trace = record_session(capacity=2 * GIB, limit=1536 * MIB, ops=200)
    r = replay(trace, options="trace", fraction=0.25, record=False)
    assert r.memory_limit == 512 * MIB and r.options["device_bytes"] == 2 * GIB
    r = replay(trace, options="trace", fraction=0.25, memory_limit=GIB, record=False)
    assert r.memory_limit == GIB


def test_empty_trace_replays_to_nothing():
    r = replay(Trace.empty())
    assert r.fits and r.calls == 0 and r.peak_pool_bytes == 0
    assert r.per_call["in_use"].shape == (0,) and len(r.recording) == 0


def test_replay_picks_one_device_of_a_two_device_trace():
    a0, t0 = record_session(index=0, seed=3, ops=800)
    a1, t1 = record_session(index=1, seed=4, ops=800, limit=2 * GIB)
    both = Trace.concat([t0, t1])
    r1 = replay(both, device=1, options="trace")
    assert r1.options["device"] == 1
    assert r1.memory_limit == 2 * GIB
    assert r1.final_snapshot.chunks == a1.snapshot().chunks  # same addresses: device index 1
    with pytest.warns(GpudashWarning, match=r"2 devices; using device 0 .*pass device="):
        r0 = replay(both, options="trace")       # says which device, and how to choose
    assert r0.final_snapshot.chunks == a0.snapshot().chunks
    both_results = replay_devices(both, options="trace", record=False)
    assert sorted(both_results) == [0, 1]
    assert both_results[1].memory_limit == 2 * GIB
    assert both_results[0].peak_bytes_in_use == r0.peak_bytes_in_use
    assert r0.events == len(t0) and r1.events == len(t1)
    with pytest.raises(ValueError, match="no events of device 5"):
        replay(both, device=5)


# ------------------------------------------------------------------------- limits and options
def test_default_limit_is_tensorflows_rule_and_fraction_scales_the_total():
    t = trace_from_calls([("alloc", 1, 1000), ("free", 1)])
    assert replay(t).memory_limit == tf_memory_limit(16 * GIB, 16 * GIB, 0.0, 8, environ={})
    assert replay(t).memory_limit == 15569256448
    assert replay(t, fraction=0.5).memory_limit == 8 * GIB
    assert replay(t, device_bytes="1GiB", fraction=0.25).memory_limit == 256 * MIB
    assert replay(t, device_bytes="1GiB", memory_limit="100MiB", fraction=0.9).memory_limit \
        == 100 * MIB
    assert replay(t, fraction=1.5, device_bytes="1GiB").fits  # unified memory
    assert replay(t, fraction=1.5, device_bytes="1GiB").memory_limit == 1536 * MIB


def test_options_gpuoptions_dict_and_explicit_precedence():
    t = trace_from_calls([("alloc", 1, 1000), ("free", 1)])
    opts = GPUOptions(per_process_gpu_memory_fraction=0.25, allow_growth=False)
    r = replay(t, options=opts)
    assert r.memory_limit == 4 * GIB and r.options["allow_growth"] is False
    r = replay(t, options=opts, allow_growth=True, fraction=0.5)
    assert r.memory_limit == 8 * GIB and r.options["allow_growth"] is True
    r = replay(t, options={"per_process_gpu_memory_fraction": 0.125, "device_bytes": "8GiB",
                           "visible_device_list": "0"})
    assert r.memory_limit == GIB and r.options["device_bytes"] == 8 * GIB
    with pytest.raises(ConfigError, match="unknown replay setting 'bogus'"):
        replay(t, options={"bogus": 1})
    with pytest.raises(ConfigError):
        replay(t, fraction=-0.5)
    s = resolve_settings(None, None, fraction=0.5)
    assert s["memory_limit"] == 8 * GIB and s["device"] == 0


# ------------------------------------------------------------------------- OOM handling
def test_refused_allocation_is_counted_and_its_free_skipped():
    t = trace_from_calls([("alloc", 1, 600 * MIB), ("alloc", 2, 600 * MIB), ("free", 2),
                          ("alloc", 3, 100 * MIB), ("free", 1), ("free", 3)])
    r = replay(t, device_bytes=GIB, memory_limit=GIB, allow_growth=False)
    assert r.oom_count == 1
    assert r.first_oom == (1, 600 * MIB)
    assert r.ooms.tolist() == [1]
    assert r.skipped_frees == 1
    assert not r.fits
    assert r.calls == 6
    assert r.per_call["in_use"].tolist() == [600 * MIB, 600 * MIB, 600 * MIB, 700 * MIB,
                                             100 * MIB, 0]
    assert r.final_snapshot.stats.bytes_in_use == 0
    # the recording shows the refusal as an oom event
    assert int((r.recording.columns["kind"] == O).sum()) == 1


def test_oom_rows_of_the_source_are_attempted_and_freed_when_they_fit():
    t = rows_trace([(A, 0x1000, 1024, 1000, 1), (O, 0, 100 * MIB, 100 * MIB, -1),
                    (F, 0x1000, 1024, 1000, 1)])
    r = replay(t, device_bytes=GIB, fraction=0.5)
    assert r.fits and r.calls == 3
    assert r.per_call["in_use"].tolist() == [1024, 1024, 0]
    kinds = r.recording.columns["kind"]
    assert int((kinds == A).sum()) == 2 and int((kinds == F).sum()) == 2
    small = replay(t, device_bytes=GIB, memory_limit=64 * MIB)
    assert small.oom_count == 1 and small.first_oom == (1, 100 * MIB)
    assert small.per_call["in_use"].tolist() == [1024, 1024, 0]


def test_max_ooms_stops_early():
    t = trace_from_calls([("alloc", i, 64 * MIB) for i in range(40)])
    r = replay(t, device_bytes=GIB, memory_limit=256 * MIB, max_ooms=1, record=False)
    assert r.oom_count == 1 and r.stopped_early and r.calls < 40
    full = replay(t, device_bytes=GIB, memory_limit=256 * MIB, record=False)
    assert full.oom_count == 40 - 4 and not full.stopped_early


# ------------------------------------------------------------------------- deferred deletion
def test_deferred_frees_are_held_until_their_bytes_reach_the_threshold():
    t = trace_from_calls([("alloc", 1, 512 * KIB), ("free", 1), ("alloc", 2, 512 * KIB),
                          ("free", 2), ("alloc", 3, 256), ("free", 3)])
    r = replay(t, device_bytes=GIB, deferred_deletion_bytes=MIB)
    assert r.per_call["in_use"].tolist() == [512 * KIB, 512 * KIB, MIB, 0, 256, 256]
    # the last free is still held at the end and applied before the final snapshot
    assert r.final_snapshot.stats.bytes_in_use == 0
    plain = replay(t, device_bytes=GIB)
    assert plain.per_call["in_use"].tolist() == [512 * KIB, 0, 512 * KIB, 0, 256, 0]


def test_deferred_frees_are_applied_before_an_oom_counts():
    t = trace_from_calls([("alloc", 1, 3 * MIB), ("free", 1), ("alloc", 2, 3 * MIB),
                          ("free", 2)])
    r = replay(t, device_bytes=GIB, memory_limit=4 * MIB, allow_growth=False,
               deferred_deletion_bytes=8 * MIB)
    assert r.fits and r.retried == 1
    # 3 MiB takes the whole 4 MiB region (a remainder under half is not split)
    assert r.per_call["in_use"].tolist() == [4 * MIB] * 4
    # a GPUOptions' deferred_deletion_bytes is taken as given
    r2 = replay(t, device_bytes=GIB, memory_limit=4 * MIB, allow_growth=False,
                options=GPUOptions(deferred_deletion_bytes=8 * MIB))
    assert r2.retried == 1 and r2.options["deferred_deletion_bytes"] == 8 * MIB
    # the quiet first attempt leaves no oom event: the recording shows no refusal
    assert not np.any(r.recording.columns["kind"] == EventKind.OOM)


def test_every_refusal_is_one_oom_event_in_the_recording():
    t = trace_from_calls([("alloc", i, 3 * MIB) for i in range(5)])
    r = replay(t, device_bytes=GIB, memory_limit=8 * MIB, allow_growth=False)
    assert r.oom_count == 3
    oom_rows = r.recording.columns["kind"] == EventKind.OOM
    assert int(oom_rows.sum()) == 3
    assert r.recording.columns["requested"][oom_rows].tolist() == [3 * MIB] * 3


# ------------------------------------------------------------------------- per-call samples
def test_per_call_samples_match_the_allocator():
    a, trace = record_session(ops=600, seed=9)
    r = replay(trace, options="trace")
    pc = r.per_call
    n = r.calls
    assert all(len(v) == n for v in pc.values())
    assert pc["pool"][-1] == r.final_snapshot.stats.pool_bytes
    assert pc["in_use"][-1] == r.final_snapshot.stats.bytes_in_use
    assert pc["largest_free"][-1] == r.final_snapshot.stats.largest_free_block_bytes
    assert pc["in_use"].max() == r.peak_bytes_in_use
    free = pc["pool"] - pc["in_use"]
    expect = np.where(free > 0, 1 - pc["largest_free"] / np.maximum(free, 1), 0.0)
    np.testing.assert_allclose(pc["fragmentation"], expect, rtol=0, atol=1e-15)
    assert pc["fragmentation"][-1] == pytest.approx(r.final_snapshot.stats.fragmentation)
    assert r.worst_fragmentation == pc["fragmentation"].max()
    lean = replay(trace, options="trace", per_call=False, record=False)
    assert lean.per_call == {} and lean.recording is None
    assert lean.peak_pool_bytes == r.peak_pool_bytes


def test_result_repr_is_one_line_and_rates_are_set():
    r = replay(training_loop(steps=2, layers=2, hidden=512), device_bytes="1GiB")
    text = repr(r)
    assert "\n" not in text and text.startswith("ReplayResult(fits")
    assert isinstance(r, ReplayResult)
    assert r.elapsed_s > 0 and r.events_per_second > 0 and r.events == r.calls
    bad = replay(trace_from_calls([("alloc", 1, 2 * GIB)]), device_bytes="1GiB")
    assert "1 OOMs (first at call 0)" in repr(bad)


def test_progress_callable_and_text():
    seen = []
    t = training_loop(steps=1, layers=2, hidden=256)
    replay(t, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (len(t), len(t))


def test_progress_true_writes_to_stderr(capsys):
    t = training_loop(steps=1, layers=2, hidden=256)
    replay(t, progress=True)
    err = capsys.readouterr().err
    assert "replay:" in err and f"{len(t):,}/{len(t):,}" in err
    with pytest.raises(TypeError, match="progress"):
        replay(t, progress=3)


def test_calls_stay_numpy_columns_and_replay_the_same_as_lists(monkeypatch):
    import sys

    import numpy as np

    monkeypatch.setattr(sys.modules["gpudash.trace.replay"], "_CHUNK", 97)  # many chunks

    from gpudash.trace.replay import _calls_lists, _replay_lists, resolve_settings
    from gpudash.workloads import fragmentation_stress

    t = fragmentation_stress(rounds=400)
    ops, keys, nbytes, n = _calls_lists(t, 0)
    assert all(isinstance(a, np.ndarray) for a in (ops, keys, nbytes))  # 17 B a call
    for ddb in (0, 1 << 20):
        s = resolve_settings(t, None, device_bytes="2GiB", deferred_deletion_bytes=ddb,
                             allow_growth=True)
        a = _replay_lists(s, ops, keys, nbytes, n, record=False, per_call=True,
                          max_ooms=None, progress=None)
        b = _replay_lists(s, ops.tolist(), keys.tolist(), nbytes.tolist(), n, record=False,
                          per_call=True, max_ooms=None, progress=None)
        assert a.peak_pool_bytes == b.peak_pool_bytes and a.oom_count == b.oom_count
        for k in ("in_use", "pool", "largest_free"):
            assert a.per_call[k].dtype == np.int64 and len(a.per_call[k]) == len(ops)
            assert np.array_equal(a.per_call[k], b.per_call[k])
