"""The live model (:mod:`gpudash.live.model`): coalescing, consistent states, bins, heatmap
columns, bounds, lifecycle.

Also home of the recording comm the widget tests share (``comms`` fixture): real widgets
(the dashboard, the what-if view) whose every message is kept (and byte-counted as the
kernel would send it: JSON plus binary buffers), with no kernel and no browser.
"""

from __future__ import annotations

import gc
import json
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import traitlets

import gpudash
from gpudash import BFCAllocator, SimulatedDevice
from gpudash.live.model import (
    NUM_BINS,
    LiveModel,
    bin_labels,
    bin_of_sizes,
    heatmap_column,
)

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


# --------------------------------------------------------------------------------------
# Recording comm (shared with the other widget test files)
# --------------------------------------------------------------------------------------


@dataclass
class Message:
    comm_id: str
    msg_type: str
    data: dict
    nbytes: int  # JSON of ``data`` + binary buffers, what the kernel would send
    buffers: list = field(default_factory=list)  # the binary buffers, as bytes


class MessageLog(list):
    """Every comm message, in order; appends are atomic, so threads may add."""

    def of(self, widget) -> list[Message]:
        return [m for m in self if m.comm_id == widget.model_id]

    def nbytes(self, widget=None) -> int:
        msgs = self if widget is None else self.of(widget)
        return sum(m.nbytes for m in msgs)

    def updates(self, widget, key: str) -> list[dict]:
        """The ``state[key]`` values of update messages sent for ``widget``."""
        out = []
        for m in self.of(widget):
            state = (m.data or {}).get("state", {})
            if m.msg_type == "comm_msg" and key in state:
                out.append(state[key])
        return out


def _make_recording_comm_class():
    from comm.base_comm import BaseComm

    class RecordingComm(BaseComm):
        """A comm that keeps its messages instead of publishing them (no comm manager)."""

        def __init__(self, log: MessageLog, **kwargs):
            self.log = log
            super().__init__(**kwargs)

        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            size = len(json.dumps(data)) + sum(memoryview(b).nbytes for b in buffers or ())
            self.log.append(Message(self.comm_id, msg_type, data or {}, size,
                                    [bytes(memoryview(b)) for b in buffers or ()]))

        def open(self, data=None, metadata=None, buffers=None):
            self._closed = False
            self.publish_msg("comm_open", data=data, metadata=metadata, buffers=buffers)

        def close(self, data=None, metadata=None, buffers=None, deleting=False):
            if self._closed:
                return
            self._closed = True
            self.publish_msg("comm_close", data=data, metadata=metadata, buffers=buffers)

    return RecordingComm


@pytest.fixture
def comms(monkeypatch):
    """Route every new widget's comm to a recording comm; yields the message log."""
    import comm

    log = MessageLog()
    cls = _make_recording_comm_class()
    monkeypatch.setattr(comm, "create_comm", lambda *a, **k: cls(log, **k))
    yield log


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def fill(sess_or_alloc, n: int, seed: int = 3, max_bytes: int = 1 << 20) -> list[int]:
    """Allocate ``n`` blocks and free every other one (a fragmented pool)."""
    rng = random.Random(seed)
    alloc = sess_or_alloc.allocate
    ptrs = [alloc(rng.randint(1, max_bytes)) for _ in range(n)]
    free = getattr(sess_or_alloc, "free_now", None) or sess_or_alloc.deallocate
    for p in ptrs[::2]:
        free(p)
    return ptrs[1::2]


@pytest.fixture
def sess():
    s = gpudash.Session(simulate="16GiB", poll=False)
    yield s
    s.close()


# --------------------------------------------------------------------------------------
# numpy helpers
# --------------------------------------------------------------------------------------


def test_bin_of_sizes_matches_tensorflow_rule():
    from gpudash.bfc import bin_num_for_size

    sizes = np.array([0, 1, 255, 256, 511, 512, 1023, 1024, (1 << 20) + 1, 256 << 20,
                      (256 << 20) - 1, 1 << 40], dtype=np.int64)
    assert bin_of_sizes(sizes).tolist() == [bin_num_for_size(int(s)) for s in sizes]
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 1 << 34, 5000)
    assert bin_of_sizes(sizes).tolist() == [bin_num_for_size(int(s)) for s in sizes]


def test_bin_labels():
    labels = bin_labels()
    assert len(labels) == NUM_BINS
    assert labels[:3] == ["256B", "512B", "1KiB"]
    assert labels[-1] == "256MiB+"


def test_typed_array_round_trip():
    from gpudash.widgets.plot import decode_array, typed_array

    z = np.arange(12, dtype=np.uint8).reshape(3, 4)
    spec = typed_array(z, np.uint8)
    np.testing.assert_array_equal(decode_array(spec), z)
    x = np.linspace(0, 1, 7)
    np.testing.assert_array_equal(decode_array(typed_array(x, np.float64)), x)


# --------------------------------------------------------------------------------------
# Heatmap column
# --------------------------------------------------------------------------------------


def brute_force_column(alloc, rows: int, row_bytes: int) -> np.ndarray:
    """Per row, per chunk: the overlap of each in-use chunk with the row, in Python."""
    snap = alloc.snapshot()
    start_of = {}
    offset = 0
    for r in snap.regions:  # regions laid end to end, in address order
        start_of[r.ptr] = offset
        offset += r.size
    out = [0] * rows
    for c in snap.chunks:
        if not c.in_use:
            continue
        s = start_of[c.region] + (c.address - c.region)
        e = s + c.size
        for row in range(rows):
            lo, hi = row * row_bytes, (row + 1) * row_bytes
            out[row] += max(0, min(e, hi) - max(s, lo))
    return np.array(out, dtype=np.float64) / row_bytes


def test_heatmap_column_matches_brute_force_over_several_regions():
    alloc = BFCAllocator(SimulatedDevice(256 * MIB), 256 * MIB, allow_growth=True)
    rng = random.Random(5)
    live = []
    for _ in range(400):
        live.append(alloc.allocate(rng.randint(1, 600 * KIB)))
        if rng.random() < 0.4:
            alloc.deallocate(live.pop(rng.randrange(len(live))))
    assert len(alloc.chunk_table()["regions"]) > 2  # growth made several regions
    table = alloc.chunk_table()
    for rows, row_bytes in [(64, 4 * MIB), (37, 7 * MIB + 256), (256, MIB), (5, 3 * MIB)]:
        got = heatmap_column(table, rows, row_bytes)
        want = brute_force_column(alloc, rows, row_bytes)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # The whole pool's in-use bytes are accounted for when the rows cover it.
    got = heatmap_column(table, 64, 4 * MIB)
    assert round(got.sum() * 4 * MIB) == alloc.stats().bytes_in_use


def test_heatmap_column_empty_and_full():
    alloc = BFCAllocator(SimulatedDevice(64 * MIB), 64 * MIB, allow_growth=False)
    assert heatmap_column(alloc.chunk_table(), 8, 8 * MIB).tolist() == [0.0] * 8
    p = alloc.allocate(64 * MIB)
    assert heatmap_column(alloc.chunk_table(), 8, 8 * MIB).tolist() == [1.0] * 8
    alloc.deallocate(p)


def test_model_heatmap_columns_match_brute_force(sess):
    fill(sess, 3000)
    with LiveModel(sess, start=False, heatmap_rows=128) as model:
        st = model.refresh_now(force=True)[0]
        want = brute_force_column(sess.devices[0].allocator, 128, st.heatmap_row_bytes)
        np.testing.assert_allclose(st.heatmap[:, -1], want, atol=1e-6)  # float32 storage
        assert st.heatmap_row_bytes * 128 >= sess.devices[0].total


# --------------------------------------------------------------------------------------
# States
# --------------------------------------------------------------------------------------


def test_refresh_with_10k_chunks_gives_snapshot_bins(sess):
    fill(sess, 20_000)
    with LiveModel(sess, start=False) as model:
        st = model.refresh_now(force=True)[0]
        assert st.num_chunks >= 10_000
        snap = sess.devices[0].allocator.snapshot()
        for b in snap.bins:
            assert st.bins.free_chunks[b.bin] == b.free_chunks
            assert st.bins.free_bytes[b.bin] == b.free_bytes
            assert st.bins.in_use_chunks[b.bin] == b.total_chunks_in_use
            assert st.bins.in_use_bytes[b.bin] == b.total_bytes_in_use
            assert st.bins.requested_bytes[b.bin] == b.total_requested_bytes_in_use
        s = snap.stats
        assert st.stats.bytes_in_use == s.bytes_in_use
        assert st.stats.pool_bytes == s.pool_bytes
        assert st.stats.largest_free_block_bytes == s.largest_free_block_bytes
        assert st.stats.fragmentation == pytest.approx(s.fragmentation)
        assert st.stats.num_allocs == s.num_allocs
        requested = sum(c.requested_size for c in snap.chunks if c.in_use)
        assert st.internal_fragmentation == s.bytes_in_use - requested
        assert st.reserved_unused == s.pool_bytes - s.bytes_in_use
        # the table is the allocator's
        table = sess.devices[0].allocator.chunk_table()
        for key in ("ptr", "size", "requested", "alloc_id"):
            np.testing.assert_array_equal(st.table[key], table[key])


def test_counters_ooms_and_settings(sess):
    with LiveModel(sess, start=False) as model:
        p = sess.allocate(1000)
        sess.free_now(p)
        with pytest.raises(gpudash.OutOfMemoryError):
            sess.allocate(64 * GIB)
        sess.configure(per_process_gpu_memory_fraction=0.5)
        st = model.refresh_now()[0]
        assert st.counters["allocs"] == 1
        assert st.counters["frees"] == 1
        assert st.counters["ooms"] >= 1
        assert st.ooms and st.ooms[-1].requested == 64 * GIB
        names = [m.setting for m in st.settings]
        assert "per_process_gpu_memory_fraction" in names and "memory_limit" in names
        frac = [m for m in st.settings if m.setting == "per_process_gpu_memory_fraction"][-1]
        assert frac.new == 0.5
        assert st.limit == int(0.5 * sess.devices[0].total)


def test_states_only_for_devices_that_changed():
    with gpudash.Session(simulate="2x1GiB", poll=False) as sess, \
            LiveModel(sess, start=False) as model:
        seen = []
        model.add_listener(lambda changed: seen.append(sorted(changed)))
        assert model.refresh_now() and seen == []  # nothing happened: no notification
        sess.allocate(1000, device=1)
        model.refresh_now()
        assert seen == [[1]]
        assert model.state(1).version == 2 and model.state(0).version == 1


def test_model_over_one_allocator():
    alloc = BFCAllocator(SimulatedDevice(GIB), GIB, name="GPU_0_bfc")
    with LiveModel(alloc, start=False) as model:
        alloc.allocate(5000)
        st = model.refresh_now()[0]
        assert st.name == "GPU_0_bfc" and st.stats.bytes_in_use == 5120
        assert model.session is None
        with pytest.raises(gpudash.ConfigError):
            model.configure(per_process_gpu_memory_fraction=0.5)


def test_model_rejects_other_sources():
    with pytest.raises(TypeError):
        LiveModel(object())


def test_timeline_history_is_bounded_and_keeps_peaks(sess):
    with LiveModel(sess, start=False, history=16) as model:
        ptrs = []
        for i in range(100):
            ptrs.append(sess.allocate(MIB))
            if i == 40:  # the peak
                ptrs.append(sess.allocate(512 * MIB))
            if i == 41:
                sess.free_now(ptrs.pop(-2))
            model.refresh_now()
        tl = model.state(0).timeline
        assert 8 <= len(tl["time_ms"]) <= 16
        assert np.all(np.diff(tl["time_ms"]) >= 0)
        assert tl["in_use"].max() >= 512 * MIB  # the peak survived decimation
        assert tl["in_use"][-1] == sess.devices[0].stats().bytes_in_use


def test_heatmap_keeps_at_most_heatmap_columns(sess):
    with LiveModel(sess, start=False, heatmap_columns=5, heatmap_rows=16) as model:
        for _ in range(12):
            sess.allocate(MIB)
            model.refresh_now()
        st = model.state(0)
        assert st.heatmap.shape == (16, 5)
        assert np.all(np.diff(st.heatmap_time_ms) > 0)
        assert st.heatmap_time_ms[-1] == st.time_ms


def test_heatmap_rows_grow_when_the_pool_outgrows_them():
    """Unified memory lets the pool pass the device's size: the rows double (merging row
    pairs of the kept columns, which keeps every column's bytes in use)."""
    dev = SimulatedDevice(64 * MIB, unified=True)
    alloc = BFCAllocator(dev, 64 * MIB, allow_growth=False)
    with LiveModel(alloc, start=False, heatmap_rows=16) as model:
        alloc.allocate(48 * MIB)
        st = model.refresh_now()[0]
        assert st.heatmap_row_bytes == 4 * MIB
        before = st.heatmap[:, -1].sum() * st.heatmap_row_bytes
        alloc.set_memory_limit(128 * MIB)
        alloc.allocate(60 * MIB)  # a second region past 64 MiB
        st = model.refresh_now()[0]
        assert st.stats.pool_bytes > 64 * MIB
        assert st.heatmap_row_bytes == 8 * MIB
        assert st.heatmap[:, -2].sum() * 8 * MIB == pytest.approx(before)
        want = brute_force_column(alloc, 16, 8 * MIB)
        np.testing.assert_allclose(st.heatmap[:, -1], want, atol=1e-6)


def test_seconds_since_start(sess):
    with LiveModel(sess, start=False) as model:
        assert model.seconds(model.start_ms + 1500.0) == 1.5
        assert model.seconds([model.start_ms]) == [0.0]
        np.testing.assert_allclose(model.seconds(np.array([model.start_ms + 2000.0])), [2.0])
        assert len(model.start_label) == 8 and model.start_label.count(":") == 2


def test_bad_parameters():
    with gpudash.Session(simulate="1GiB", poll=False) as sess:
        with pytest.raises(gpudash.ConfigError):
            LiveModel(sess, history=0)
        with LiveModel(sess, start=False) as model:
            with pytest.raises(traitlets.TraitError):
                model.rate_hz = 0
            with pytest.raises(gpudash.ConfigError):
                model.state(3)


# --------------------------------------------------------------------------------------
# The refresher thread
# --------------------------------------------------------------------------------------


def _workload(alloc, n: int, done: threading.Event) -> None:
    ptrs = []
    allocate, deallocate = alloc.allocate, alloc.deallocate
    for i in range(n):
        ptrs.append(allocate(4096 + (i % 64) * 256))
        if len(ptrs) > 200:
            deallocate(ptrs.pop(0))
    for p in ptrs:
        deallocate(p)
    done.set()


def test_coalesces_100k_allocations_into_a_few_refreshes(sess):
    alloc = sess.devices[0].allocator
    with LiveModel(sess, rate_hz=4.0) as model:
        calls = []
        model.add_listener(lambda changed: calls.append(time.monotonic()))
        done = threading.Event()
        t0 = time.monotonic()
        worker = threading.Thread(target=_workload, args=(alloc, 100_000, done))
        worker.start()
        worker.join(60)
        elapsed = time.monotonic() - t0
        assert done.is_set()
        n_calls = len(calls)
        # 4 Hz: at most ~4 notifications a second however many events (+2 for edges).
        assert n_calls <= 4 * elapsed + 2, (n_calls, elapsed)
        st = model.refresh_now()[0]
        assert st.counters["allocs"] == 100_000
        assert st.counters["frees"] == 100_000
        assert not model.errors


def test_refreshes_go_on_while_the_main_thread_allocates_flat_out(sess):
    """The refresher takes the allocator's lock to take in events; a thread that allocates
    without pause must not keep it out. (A batch sink that released the GIL while the lock
    was held woke the waiting refresher just then, every time: no refresh for as long as
    the loop ran.)"""
    alloc = sess.devices[0].allocator
    fill(sess, 2000)
    allocate, deallocate = alloc.allocate, alloc.deallocate
    slots = [0] * 300
    rng = random.Random(9)
    steps = [(rng.randrange(300), rng.randrange(1, 1 << 22)) for _ in range(10_000)]
    with LiveModel(sess, rate_hz=20.0) as model:
        model.refresh_now()
        before = model.refreshes
        deadline = time.monotonic() + 10
        while model.refreshes < before + 3 and time.monotonic() < deadline:
            for slot, nbytes in steps:   # the loop never waits or sleeps
                deallocate(slots[slot])
                slots[slot] = allocate(nbytes)
        assert model.refreshes >= before + 3
    for p in slots:
        deallocate(p)


def test_pause_stops_updates_and_resume_restarts(sess):
    alloc = sess.devices[0].allocator
    with LiveModel(sess, rate_hz=20.0) as model:
        calls = []
        model.add_listener(lambda changed: calls.append(1))
        model.paused = True
        time.sleep(0.1)  # let a refresh in progress finish
        calls.clear()
        for _ in range(20):
            alloc.deallocate(alloc.allocate(1000))
            time.sleep(0.01)
        assert calls == []
        model.paused = False
        assert wait_for(lambda: len(calls) > 0, timeout=10)


def test_rate_hz_can_change_while_running(sess):
    with LiveModel(sess, rate_hz=0.1) as model:
        calls = []
        model.add_listener(lambda changed: calls.append(1))
        sess.allocate(1000)
        model.rate_hz = 50.0  # wakes the thread: no 10 s wait
        assert wait_for(lambda: len(calls) > 0, timeout=5)


def test_request_refresh_wakes_the_thread(sess):
    with LiveModel(sess, rate_hz=0.1) as model:
        calls = []
        model.add_listener(lambda changed: calls.append(1))
        time.sleep(0.05)
        sess.allocate(1000)
        model.request_refresh()
        assert wait_for(lambda: len(calls) > 0, timeout=5)


def test_failing_listener_is_isolated(sess):
    with LiveModel(sess, start=False) as model:
        got = []

        def bad(changed):
            raise RuntimeError("boom")

        model.add_listener(bad)
        model.add_listener(lambda changed: got.append(changed))
        sess.allocate(1000)
        model.refresh_now()
        assert len(got) == 1
        assert len(model.errors) == 1 and "boom" in model.errors[0]


def test_tick_listeners_hear_every_refresh(sess):
    """Ticks come after every refresh, also those in which nothing changed (the timeline
    draws the latest state up to the latest refresh)."""
    with LiveModel(sess, start=False) as model:
        ticks = []
        remove = model.add_tick_listener(lambda now, changed: ticks.append((now, changed)))
        model.refresh_now()  # nothing changed: no states, still a tick
        assert ticks == [(model.last_refresh_ms, set())]
        assert model.last_refresh_ms >= model.start_ms
        sess.allocate(MIB)
        st = model.refresh_now()[0]
        assert ticks[-1] == (st.time_ms, {0}) and st.time_ms == model.last_refresh_ms
        assert ticks[0][0] <= ticks[1][0]

        def bad(now, changed):
            raise RuntimeError("tick failed")

        model.add_tick_listener(bad)
        model.refresh_now()
        assert len(ticks) == 3 and any("tick failed" in e for e in model.errors)
        remove()
        model.refresh_now()
        assert len(ticks) == 3
        with pytest.raises(TypeError):
            model.add_tick_listener(42)
    assert model._tick_listeners == []


def test_close_stops_thread_and_detaches_sinks(sess):
    alloc = sess.devices[0].allocator
    model = LiveModel(sess, rate_hz=20)
    assert model.running and len(alloc._raw_sinks) == 1  # a raw (counting) sink
    model.close()
    assert not model.running
    assert alloc._raw_sinks == [] and alloc._sinks == []
    assert alloc._journal is None  # nobody listens any more
    assert model.closed
    model.close()  # idempotent
    assert "closed" in repr(model)
    # allocations after close reach no model
    sess.allocate(1000)


def test_dropped_model_is_collected_and_detaches(sess):
    alloc = sess.devices[0].allocator
    model = LiveModel(sess, rate_hz=20)
    thread = model._thread
    del model
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
    assert alloc._sinks == [] and alloc._raw_sinks == []


def test_repr_is_cheap_and_informative(sess):
    with LiveModel(sess, start=False) as model:
        text = repr(model)
        assert text.startswith("LiveModel(1 device(s), live")
        assert "DeviceState(device=0" in repr(model.state(0))
