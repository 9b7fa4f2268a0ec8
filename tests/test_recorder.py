"""The Recorder: columns equal to the per-event stream, bounded buffer, streaming to disk."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

import gpudash
from gpudash import BFCAllocator, Recorder
from gpudash.devices import SimulatedDevice
from gpudash.events import COLUMNS, EventKind
from gpudash.trace import read_trace

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

MiB = 1 << 20


def _churn(alloc, n, seed=1, max_size=1 << 26):
    rng = random.Random(seed)
    live = []
    for _ in range(n):
        if live and rng.random() < 0.5:
            alloc.deallocate(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(alloc.allocate(int(2 ** rng.uniform(0, np.log2(max_size)))))
            except gpudash.OutOfMemoryError:
                pass
    return live


def test_columns_equal_the_events_given_to_callbacks():
    """The Recorder's vectorised expansion of the journal and the per-event callbacks
    must agree on every field of every event, OOMs, releases and setting changes included."""
    a = BFCAllocator(SimulatedDevice(1 << 32), 1 << 30, garbage_collection=True)
    got = []
    a.subscribe(got.append)
    rec = Recorder(a)
    rng = random.Random(5)
    kept = []
    for i in range(6):
        live = _churn(a, 3000, seed=i)
        a.set_memory_limit(rng.choice([1 << 29, 1 << 30]))
        for p in live[: len(live) // 2]:
            a.deallocate(p)
        kept += live[len(live) // 2:]
        a.release_free_regions()
    for p in kept:
        a.deallocate(p)
    assert a.release_free_regions() > 0
    cols = rec.columns()
    assert len(cols["seq"]) == len(got) > 10_000
    kinds = {EventKind(int(k)) for k in cols["kind"]}
    assert {EventKind.OOM, EventKind.RELEASE, EventKind.LIMIT, EventKind.MERGE} <= kinds
    for name in COLUMNS:
        np.testing.assert_array_equal(cols[name], [getattr(e, name) for e in got], err_msg=name)
    assert [s["setting"] for s in rec.settings()] == ["memory_limit"] * 6


def test_seq_is_gapless_across_batches():
    a = BFCAllocator(SimulatedDevice(1 << 32), 1 << 31)
    rec = Recorder(a)
    _churn(a, 30_000, max_size=1 << 20)  # several journal flushes
    seq = rec.columns()["seq"]
    np.testing.assert_array_equal(seq, np.arange(len(seq)))
    assert a.seq == len(seq)


def test_bounded_buffer_keeps_the_newest_events():
    a = BFCAllocator(SimulatedDevice(1 << 32), 1 << 31)
    rec = Recorder(a, capacity=1000)
    _churn(a, 5000, max_size=1 << 16)
    cols = rec.columns()
    assert len(rec) == 1000 == len(cols["seq"])
    assert rec.dropped == rec.total - 1000 > 0
    np.testing.assert_array_equal(cols["seq"], np.arange(rec.total - 1000, rec.total))


def test_records_every_device_of_a_session_in_time_order():
    with gpudash.Session(simulate="2x1GiB", poll=False) as sess:
        rec = Recorder(sess)
        for i in range(50):
            p = sess.allocate(MiB, device=i % 2)
            sess.free_now(p)
        cols = rec.columns()
        assert set(cols["device"].tolist()) == {0, 1}
        assert np.all(np.diff(cols["time_ns"]) >= 0)
        trace = rec.to_trace()
        assert [d["name"] for d in trace.meta["devices"]] == ["GPU_0_bfc", "GPU_1_bfc"]
        rec.detach()
        assert all(not alloc._sinks and not alloc._batch_sinks for alloc in sess.allocators)


def test_a_detached_recording_of_two_allocators_stays_in_time_order():
    """Each allocator's events reach the Recorder in its own batches (at detach, one
    allocator after the other); the columns are in time order all the same."""
    a = BFCAllocator(SimulatedDevice(1 << 30, index=0), 1 << 30)
    b = BFCAllocator(SimulatedDevice(1 << 30, index=1), 1 << 30)
    b.device_index = 1
    rec = Recorder([a, b])
    for _ in range(20):
        for x in (a, b):
            x.deallocate(x.allocate(MiB))
    rec.detach()
    cols = rec.columns()
    assert np.all(np.diff(cols["time_ns"]) >= 0)
    assert sorted(set(cols["device"].tolist())) == [0, 1]


def test_the_newest_events_are_kept_across_reads_and_batches():
    """A bounded recorder read now and then (the batches it has read are kept expanded,
    the rest as the allocator wrote them) keeps exactly the newest ``capacity`` events:
    the tail of an unbounded recording of the same operations."""
    a = BFCAllocator(SimulatedDevice(1 << 32), 1 << 31)
    full = Recorder(a, capacity=1 << 20)
    rec = Recorder(a, capacity=10_000)
    for i in range(6):
        _churn(a, 7000, seed=i, max_size=1 << 20)
        cols = rec.columns()
        assert len(cols["seq"]) == len(rec) == min(rec.total, 10_000)
    whole = full.columns()
    assert rec.total == len(whole["seq"]) > 30_000
    assert rec.dropped == rec.total - 10_000
    for name in COLUMNS:
        np.testing.assert_array_equal(cols[name], whole[name][-10_000:], err_msg=name)
    rec.clear()
    assert len(rec) == 0 and rec.columns()["seq"].size == 0


def test_a_recorder_flushed_after_every_operation_holds_only_its_events():
    """A flush of one operation is kept as its own few ints, not in the buffer the
    allocator had made ready for a whole batch (half a megabyte)."""
    import tracemalloc

    a = BFCAllocator(SimulatedDevice(1 << 30), 1 << 30)
    rec = Recorder(a)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(300):
            a.deallocate(a.allocate(1000))
            rec.flush()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert rec.total >= 600
    assert held < 8 << 20, held   # 300 batch buffers would be 150 MB


def test_detach_stops_recording_and_the_journal():
    a = BFCAllocator(SimulatedDevice(1 << 30), 1 << 30)
    with Recorder(a) as rec:
        a.deallocate(a.allocate(100))
    n = len(rec)
    a.deallocate(a.allocate(100))
    assert len(rec) == n == 5  # extend, split, alloc, free, merge
    assert a._journal is None  # nobody listens: the hot path does no event work


def test_stream_file_round_trips(tmp_path):
    path = tmp_path / "run.gdtrace"
    a = BFCAllocator(SimulatedDevice(1 << 32), 1 << 31)
    with Recorder(a, path=path, flush_interval=0.05) as rec:
        _churn(a, 2000, max_size=1 << 22)
        a.set_memory_limit(1 << 30)
    trace = read_trace(path)
    cols = rec.columns()
    for name in COLUMNS:
        np.testing.assert_array_equal(trace.columns[name], cols[name], err_msg=name)
    assert trace.settings[0]["setting"] == "memory_limit"


def test_stream_refuses_to_overwrite(tmp_path):
    path = tmp_path / "run.gdtrace"
    path.write_bytes(b"precious")
    a = BFCAllocator(SimulatedDevice(1 << 30), 1 << 30)
    with pytest.raises(gpudash.TraceFormatError, match="overwrite"):
        Recorder(a, path=path)
    assert path.read_bytes() == b"precious"


def test_a_killed_process_loses_at_most_its_last_second(tmp_path):
    path = tmp_path / "killed.gdtrace"
    script = textwrap.dedent(f"""
        import time, gpudash
        from gpudash.devices import SimulatedDevice
        a = gpudash.BFCAllocator(SimulatedDevice(1 << 32), 1 << 31)
        rec = gpudash.Recorder(a, path={str(path)!r}, flush_interval=1.0)
        t0 = time.time_ns()
        print(t0, flush=True)
        i = 0
        while True:
            a.deallocate(a.allocate(1024 + (i % 100) * 256))
            i += 1
            if i % 500 == 0:
                time.sleep(0.002)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        t0 = int(proc.stdout.readline())
        time.sleep(3.5)
        killed_at = time.time_ns()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gpudash.GpudashWarning)  # no end record: expected
        trace = read_trace(path)
    assert len(trace) > 1000
    last = int(trace.columns["time_ns"].max())
    assert last >= t0
    # at most the last second (plus scheduling slack) is missing
    assert killed_at - last < 1.6e9, (killed_at - last) / 1e9


def test_a_recorder_attached_later_gets_no_earlier_events():
    a = BFCAllocator(SimulatedDevice(1 << 30), 1 << 30)
    first = Recorder(a)
    for _ in range(10):
        a.allocate(MiB)
    second = Recorder(a)
    a.allocate(MiB)
    kinds = [EventKind(int(k)) for k in second.columns()["kind"]]
    assert kinds.count(EventKind.ALLOC) == 1
    assert [EventKind(int(k)) for k in first.columns()["kind"]].count(EventKind.ALLOC) == 11


def test_try_allocate_is_quiet_and_allocate_reports(caplog):
    a = BFCAllocator(SimulatedDevice(1 << 30), 4 * MiB, allow_growth=False, name="quiet")
    rec = Recorder(a)
    with caplog.at_level("WARNING", logger="gpudash"):
        assert a.try_allocate(8 * MiB) == 0
        assert "ran out of memory" not in caplog.text
        with pytest.raises(gpudash.OutOfMemoryError):
            a.allocate(8 * MiB)
        assert caplog.text.count("ran out of memory") == 1
    kinds = [EventKind(int(k)) for k in rec.columns()["kind"]]
    assert kinds.count(EventKind.OOM) == 1
    assert a.try_allocate(MiB) != 0


def test_raw_sinks_get_one_record_per_operation_without_conversion():
    a = BFCAllocator(SimulatedDevice(1 << 30), 1 << 30)
    batches = []
    remove = a._add_sink(lambda records, extra: batches.append(list(records)), raw=True)
    ptrs = [a.allocate(1000) for _ in range(3)]
    for p in ptrs:
        a.deallocate(p)
    a.flush_events()
    records = [r for b in batches for r in b]
    codes = records[1::8]
    assert len(records) % 8 == 0
    assert codes == [int(EventKind.EXTEND)] + [int(EventKind.ALLOC)] * 3 + [int(EventKind.FREE)] * 3
    remove()
    assert a._journal is None
