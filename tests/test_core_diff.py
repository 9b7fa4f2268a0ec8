"""The compiled allocator core against the pure-Python models: the same results, always.

``benchmarks/fuzz_core.py`` drives both with the same random operations (10**6 per model
and setting when run by hand); here it runs smaller. Replays, what-if answers and the
state scrubber's checkpoints are compared whole. Skipped where the core is not built
(``GPUDASH_REQUIRE_COMPILED=1``, as CI sets it, makes that a failure instead).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import gpudash
from gpudash import _accel
from gpudash.bfc import PyBFCAllocator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fuzz_core  # noqa: E402

REQUIRE = os.environ.get("GPUDASH_REQUIRE_COMPILED", "") not in ("", "0")

if not _accel.COMPILED:
    if REQUIRE and not _accel.REASON.startswith(_accel.ENV):  # not built, or stale
        pytest.fail(f"the compiled core must run here: {_accel.REASON}", pytrace=False)
    pytest.skip(f"the compiled core does not run here ({_accel.REASON})",
                allow_module_level=True)

OPS = int(os.environ.get("GPUDASH_FUZZ_OPS", "25000"))


def test_the_public_classes_are_the_compiled_ones():
    from gpudash.caching import PyCachingAllocator

    assert gpudash.BFCAllocator.compiled and gpudash.CachingAllocator.compiled
    assert issubclass(gpudash.BFCAllocator, PyBFCAllocator)
    assert issubclass(gpudash.CachingAllocator, PyCachingAllocator)
    assert gpudash.BFCAllocator.__module__ == "gpudash.bfc"
    assert gpudash.CachingAllocator.__module__ == "gpudash.caching"
    assert "compiled" in _accel.describe()


@pytest.mark.parametrize("setting", fuzz_core.BFC_SETTINGS, ids=lambda s: s[0])
def test_bfc_fuzz(setting):
    assert fuzz_core.fuzz_bfc(OPS, 11, setting, check_every=1000) >= OPS


@pytest.mark.parametrize("setting", fuzz_core.TORCH_SETTINGS, ids=lambda s: s[0])
def test_torch_fuzz(setting):
    assert fuzz_core.fuzz_torch(OPS // 2, 13, setting, check_every=1000) >= OPS // 2


# ------------------------------------------------------------------------------ replays
@pytest.fixture
def pure_models(monkeypatch):
    """Run a block with the pure-Python classes as gpudash's (replays build through
    gpudash.models, which looks the class up when it builds)."""
    import gpudash.bfc

    import gpudash.caching

    def use() -> None:
        monkeypatch.setattr(gpudash.bfc, "BFCAllocator", PyBFCAllocator)
        monkeypatch.setattr(gpudash.caching, "CachingAllocator",
                            gpudash.caching.PyCachingAllocator)

    return use


def _result_fields(r) -> dict:
    out = {k: getattr(r, k) for k in ("oom_count", "first_oom", "peak_pool_bytes",
                                      "peak_bytes_in_use", "extensions", "releases",
                                      "memory_limit", "calls", "events", "skipped_frees",
                                      "retried", "stopped_early", "allocator")}
    out["ooms"] = r.ooms.tolist()
    out["per_call"] = {k: v.tolist() for k, v in r.per_call.items()}
    out["final_snapshot"] = r.final_snapshot
    if r.snapshot is not None:
        out["snapshot"] = fuzz_core._without_times(r.snapshot)
    if r.recording is not None:
        out["recording"] = {k: v.tolist() for k, v in r.recording.columns.items()
                            if k != "time_ns"}
    return out


def _traces():
    from gpudash.trace.workloads import fragmentation_stress, training_loop

    return {"training": training_loop(steps=3, layers=4, hidden=1024),
            "fragmentation": fragmentation_stress(rounds=1500)}


REPLAYS = [
    {},
    {"fraction": 0.02, "device_bytes": "2GiB"},
    {"fraction": 0.05, "device_bytes": "1GiB", "allow_growth": False},
    {"fraction": 0.03, "device_bytes": "2GiB", "garbage_collection": True},
    {"fraction": 0.05, "device_bytes": "1GiB", "deferred_deletion_bytes": 8 << 20},
    {"fraction": 0.01, "device_bytes": "2GiB", "max_ooms": 3},
    {"fraction": 0.04, "device_bytes": "1GiB", "fragmentation_fraction": 0.05},
]


@pytest.mark.parametrize("kwargs", REPLAYS, ids=lambda k: ",".join(f"{a}={b}" for a, b in
                                                                    k.items()) or "default")
@pytest.mark.parametrize("name", ["training", "fragmentation"])
def test_replays_are_the_same(name, kwargs, pure_models):
    from gpudash.trace.replay import replay

    trace = _traces()[name]
    fast = replay(trace, **kwargs)
    pure_models()
    ref = replay(trace, **kwargs)
    assert _result_fields(fast) == _result_fields(ref)


@pytest.fixture(scope="module")
def torch_traces():
    from gpudash.trace.torch_snapshot import load_torch_snapshot
    from gpudash.trace.workloads import caching_snapshot, finetune_calls

    calls = finetune_calls(steps=12)
    return {"finetune24": load_torch_snapshot(caching_snapshot(calls, device_bytes="24GiB")),
            "finetune80": load_torch_snapshot(caching_snapshot(calls, device_bytes="80GiB"))}


TORCH_REPLAYS = [  # what-ifs: the compiled loop runs them (exact replays use the reference)
    {"device_bytes": "24GiB", "exact": False},
    {"device_bytes": "20GiB", "exact": False},
    {"device_bytes": "24GiB", "expandable_segments": True},
    {"device_bytes": "40GiB", "fraction": 0.4, "garbage_collection_threshold": 0.6,
     "max_split_size_mb": 256},
    {"device_bytes": "24GiB", "roundup_power2_divisions": 4, "max_ooms": 2},
    {"device_bytes": "24GiB", "exact": False, "record": False, "per_call": False},
]


@pytest.mark.parametrize("kwargs", TORCH_REPLAYS, ids=lambda k: ",".join(
    f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("name", ["finetune24", "finetune80"])
def test_torch_replays_are_the_same(name, kwargs, torch_traces, pure_models):
    from gpudash.trace.replay import replay

    trace = torch_traces[name]
    fast = replay(trace, **kwargs)
    pure_models()
    ref = replay(trace, **kwargs)
    assert _result_fields(fast) == _result_fields(ref)


def test_a_bfc_trace_through_pytorchs_model_is_the_same(pure_models):
    from gpudash.trace.replay import replay

    trace = _traces()["fragmentation"]
    fast = replay(trace, allocator="torch", device_bytes="1GiB", fraction=0.05)
    pure_models()
    ref = replay(trace, allocator="torch", device_bytes="1GiB", fraction=0.05)
    assert _result_fields(fast) == _result_fields(ref)


def test_what_if_answers_are_the_same(pure_models):
    from gpudash.trace.whatif import min_fraction, sweep

    trace = _traces()["fragmentation"]
    fast = (min_fraction(trace, "1GiB"), sweep(trace, [0.02, 0.05, None], device_bytes="1GiB"))
    pure_models()
    ref = (min_fraction(trace, "1GiB"), sweep(trace, [0.02, 0.05, None], device_bytes="1GiB"))
    assert fast[0] == ref[0]
    assert fast[1] == ref[1]


def test_scrubbing_checkpoints_are_the_same(pure_models):
    from gpudash.analysis import StateScrubber

    trace = _traces()["fragmentation"]
    fast = StateScrubber(trace, checkpoint_every=500)
    points = [len(trace) - 1, 10, len(trace) // 2, 3000, 2999, 5]
    got = [fast.state_at(i) for i in points]
    assert len(fast._checkpoints) > 2
    pure_models()
    ref = StateScrubber(trace, checkpoint_every=500)
    assert [ref.state_at(i) for i in points] == got


# ------------------------------------------------------------------------------ pieces
def test_the_lock_is_a_lock():
    a = gpudash.BFCAllocator(gpudash.SimulatedDevice("1GiB"), 1 << 30)
    lock = a._lock
    assert not lock.locked()
    with lock:
        assert lock.locked()
        assert not lock.acquire(False)
        assert not lock.acquire(True, 0.01)
    assert lock.acquire(timeout=0.5)
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()
    cond = threading.Condition(lock)
    with cond:
        assert not cond.wait(0.01)
    # another thread's allocation waits for a holder of the lock, then goes on
    done = []
    with lock:
        t = threading.Thread(target=lambda: done.append(a.allocate(1000)))
        t.start()
        t.join(0.2)
        assert not done
    t.join(5)
    assert done and a.owns(done[0])


def test_the_journal_reads_as_a_list():
    from gpudash._core import Journal

    j = Journal([1, 2, 3])
    j.extend((4, 5, 6, 7, 8))
    assert len(j) == 8 and bool(j) and not Journal()
    assert j[0] == 1 and j[-1] == 8 and j[1::8] == [2] and j[2:4] == [3, 4]
    assert list(j) == j.tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and j == list(range(1, 9))
    assert j.count(3) == 1
    assert np.frombuffer(j, dtype=np.int64).tolist() == j.tolist()
    with pytest.raises(IndexError):
        j[8]


STAMPS = r"""
import json, sys, time
import gpudash
from gpudash import _core

def bounds(model):
    # each operation between two time.time_ns() readings, with pauses, read in two parts:
    # every record's time lies between the readings around its operation, never before
    # the record ahead of it, and a second read leaves the first read's times as they were
    dev = gpudash.SimulatedDevice("8GiB")
    a = gpudash.BFCAllocator(dev, 1 << 32) if model == "bfc" else gpudash.CachingAllocator(dev)
    a._add_sink(lambda records, extra: None, raw=True)
    spans, first = [], None
    for i in range(400):
        before = time.time_ns()
        p = a.allocate(1000 + 4096 * (i % 7))
        a.deallocate(p)
        spans.append((before, time.time_ns()))
        if i % 50 == 0:
            time.sleep(0.002)
        if i == 199:
            first = a._journal.tolist()
    ints = a._journal.tolist()
    assert ints[:len(first)] == first
    times, codes = ints[0::8], ints[1::8]
    assert times == sorted(times)
    ops = [t for t, c in zip(times, codes) if c in (1, 2)]   # alloc, free
    assert len(ops) == 800
    worst = 0
    for k, (lo, hi) in enumerate(spans):
        for t in ops[2 * k:2 * k + 2]:
            worst = max(worst, lo - t, t - hi)
    return worst

print(json.dumps({"clock": _core.JOURNAL_CLOCK,
                  "worst": max(bounds("bfc"), bounds("torch"))}))
"""


@pytest.mark.parametrize("clock", ["", "realtime"])
def test_the_journals_times_are_the_wall_clock(clock):
    """The journal stamps records with the time-stamp counter where the kernel keeps time
    by it, and reads them as time.time_ns() values; GPUDASH_JOURNAL_CLOCK=realtime (or a
    machine without a trustworthy counter) stamps time.time_ns() directly. Either way a
    record's time lies within the time.time_ns() readings around its operation (50 µs of
    slack: the wall clock may be slewed while a run lasts)."""
    import json
    import subprocess

    env = dict(os.environ, GPUDASH_JOURNAL_CLOCK=clock)
    proc = subprocess.run([sys.executable, "-c", STAMPS], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    if clock == "realtime":
        assert got["clock"] == "realtime"
    assert got["worst"] <= 50_000, got


@pytest.mark.parametrize("model", ["bfc", "torch"])
def test_the_journal_counts_its_events_as_the_python_count_does(model):
    """The compiled journal counts the events its records expand into as they are written
    (push from C, extend from Python, records completed across two extends); every count
    a flush or a seq asks for equals ``count_events`` over the same ints."""
    import random

    from gpudash._core import Journal, count_journal_events
    from gpudash._eventsource import count_events

    dev = gpudash.SimulatedDevice("8GiB")
    a = gpudash.BFCAllocator(dev, 1 << 32, garbage_collection=True) if model == "bfc" \
        else gpudash.CachingAllocator(dev)
    a._add_sink(lambda records, extra: None, raw=True)
    rng = random.Random(3)
    live = []
    for i in range(3000):
        if live and rng.random() < 0.5:
            a.deallocate(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.allocate(rng.randrange(1, 1 << 22)))
        if i % 700 == 0:
            a.note_setting("fraction", 0.5, 0.6)   # a record extended from Python
    j = a._journal
    ints = j.tolist()
    assert count_journal_events(j) == count_events(ints, 0) > len(ints) // 8
    assert j.code_counts() == [ints[1::8].count(k) for k in range(9)]
    for start in range(0, len(ints), 8 * 97):
        for end in (None, min(start + 8 * 13, len(ints)), min(start + 8 * 13 + 3, len(ints))):
            assert count_journal_events(j, start, end) == count_events(ints, start, end)
    # records written by Python, one split over two extends
    alloc_split = [5, 1, 4096, 256, 100, 512, 0, 0]
    free_merged = [6, 2, 4096, 256, 100, 7, 512, 256]
    k = Journal()
    k.extend(alloc_split[:3])
    assert count_journal_events(k) == 0
    k.extend(alloc_split[3:] + free_merged)
    assert count_journal_events(k) == count_events(alloc_split + free_merged, 0) == 5
    with pytest.raises(ValueError):
        count_journal_events(k, 3)


def test_copies_of_the_compiled_allocator_are_independent():
    from gpudash.bfc import clone

    dev = gpudash.SimulatedDevice("1GiB")
    a = gpudash.BFCAllocator(dev, 1 << 30)
    ptrs = [a.allocate(n) for n in (1000, 5000, 1 << 20)]
    a.deallocate(ptrs[1])
    b = clone(a, gpudash.SimulatedDevice("1GiB"))
    assert b.snapshot() == a.snapshot() and b.stats() == a.stats()
    b.deallocate(ptrs[0])
    assert a.owns(ptrs[0]) and not b.owns(ptrs[0])
    a.check()
    b.check()


# ------------------------------------------------------------------------------ placement
def _placement_ops(seed: int, n: int):
    """A random run of place / remove / add / clear calls on a simulated device's table,
    sizes from a byte to a few alignments, with gaps that a first fit can reuse."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        r = rng.random()
        if r < 0.55:
            yield ("place", int(rng.choice([1, 511, 4096, 1 << 20, (2 << 20) + 1, 5 << 20,
                                            int(rng.integers(1, 12 << 20))])))
        elif r < 0.97:
            yield ("remove", int(rng.integers(0, 1 << 30)))
        elif r < 0.999:
            yield ("extra", int(rng.integers(0, 64 << 20)))
        else:
            yield ("clear", 0)


@pytest.mark.parametrize("alignment,limit", [(2 << 20, 256 << 20), (512, 48 << 20),
                                             (1 << 30, 1 << 40)])
def test_the_compiled_placement_table_places_as_the_python_one(alignment, limit):
    from gpudash import _core
    from gpudash.devices import _FirstFitTable

    first = (0x7F0000000000 + alignment - 1) & -alignment
    py, c = _FirstFitTable(first, alignment, limit), _core.FirstFit(first, alignment, limit)
    live: list[tuple[int, int]] = []
    most = refused = 0
    for op, arg in _placement_ops(alignment ^ limit, 20_000):
        if op == "place":
            got = (py.place(arg), c.place(arg))
            assert got[0] == got[1], (op, arg, got)
            if got[0]:
                live.append((got[0], arg))
            refused += not got[0]
        elif op == "remove" and live:
            ptr, size = live.pop(arg % len(live))
            py.remove("sim0", ptr, size)
            c.remove("sim0", ptr, size)
        elif op == "extra":
            py.extra = c.extra = arg
        elif op == "clear":
            py.clear()
            c.clear()
            live.clear()
        assert (c.used, c.version, c.placed, c.removed, len(c)) == \
            (py.used, py.version, py.placed, py.removed, len(py))
        most = max(most, len(py))
    assert c.items() == py.items()
    assert most > 10 and py.placed > 5_000
    assert refused > 0 or limit > 1 << 32
    # a copy made block by block places the next block where the original would
    py2, c2 = _FirstFitTable(first, alignment, limit), _core.FirstFit(first, alignment, limit)
    for ptr, size in py.items():
        py2.add(ptr, size)
        c2.add(ptr, size)
    assert c2.place(3 << 20) == py2.place(3 << 20) and c2.items() == py2.items()


@pytest.mark.parametrize("args", [(1, 100), (0x7F0000000000, 999), (0x7F0000000000, 100.0),
                                  ("x", 100), (-1, 100), (1 << 70, 100)],
                         ids=["unknown", "wrong-size", "float-size", "str", "negative",
                              "huge"])
def test_the_compiled_placement_table_refuses_frees_as_the_python_one(args):
    from gpudash import _core
    from gpudash.devices import _FirstFitTable

    tables = [t(0x7F0000000000, 512, 1 << 30) for t in (_FirstFitTable, _core.FirstFit)]
    errors = []
    for t in tables:
        assert t.place(1000) == 0x7F0000000000
        try:
            t.remove("sim0", *args)
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append((type(exc), str(exc)))
    assert errors[0] == errors[1]
    assert [t.items() for t in tables] == [tables[0].items()] * 2


def test_the_compiled_pytorch_model_places_segments_on_the_devices_table():
    dev = gpudash.SimulatedDevice("1GiB")
    assert type(dev._placement).__name__ == "FirstFit"
    calls = []   # a Python-level alloc on the instance: the model does not call it
    dev.alloc = lambda n: calls.append(n) or gpudash.SimulatedDevice.alloc(dev, n)
    a = gpudash.CachingAllocator(dev)
    ptrs = [a.allocate(30 << 20) for _ in range(3)]
    assert dev._blocks.placed == 3 and [p for p, _ in dev.blocks()] == ptrs
    assert calls == []
    for p in ptrs:
        a.deallocate(p)
    a.empty_cache()
    assert dev._blocks.removed == 3 and dev.used == 0
    a.check()

    class Refusing(gpudash.SimulatedDevice):
        """A device of its own rules: the model must call it, not the table."""

        def alloc(self, nbytes):
            raise MemoryError("refused")

    ref = Refusing("1GiB")
    assert ref._placement is None
    with pytest.raises(gpudash.OutOfMemoryError):
        gpudash.CachingAllocator(ref).allocate(1 << 20)
    assert ref.used == 0


def test_a_replays_device_counts_the_segments_placed_without_python():
    from gpudash.trace.replay import _CountingSub

    sub = _CountingSub(gpudash.SimulatedDevice("1GiB"), extensions=5, releases=1)
    a = gpudash.CachingAllocator(sub)
    assert sub._placement is sub.dev._blocks
    ptrs = [a.allocate(30 << 20) for _ in range(3)]
    st = a.memory_stats()
    assert (sub.extensions, st["num_device_alloc"]) == (8, 3)
    a.deallocate(ptrs[0])
    a.empty_cache()
    copy = sub.clone()
    assert (sub.releases, copy.extensions, copy.releases) == (2, 8, 2)
    assert copy.dev.blocks() == sub.dev.blocks() and len(copy.dev.blocks()) == 2
    # the pages of expandable segments count against the device for the table too
    sub.create_page(950 << 20)
    with pytest.raises(gpudash.OutOfMemoryError):
        a.allocate(60 << 20)
    sub.release_page(1, 950 << 20)
    a.deallocate(a.allocate(60 << 20))


def test_a_bin_of_hundreds_of_cached_blocks_is_sorted_and_answers_as_the_pure_model():
    """Thousands of cached blocks of one size (every other one of a burst freed, on two
    streams): the compiled pools keep those bins sorted past 256 entries, and every answer,
    address and statistic stays the pure model's."""
    from gpudash.caching import PyCachingAllocator

    devs = [fuzz_core.FlakyTorchDevice(8 << 30, 1, 0.0) for _ in range(2)]
    ref = PyCachingAllocator(devs[0], "max_split_size_mb:20")
    fast = gpudash.CachingAllocator(devs[1], "max_split_size_mb:20")
    pair = fuzz_core.Pair(ref, fast, devs[0], devs[1], "sorted bins")
    most, held = 0, []
    for rnd in range(3):
        for size in (512, 3 << 20, 25 << 20):
            live = [pair.call("allocate", size, stream)[1] for stream in (0, 5)
                    for _ in range(1200 if size == 512 else 300 if size == 3 << 20 else 40)]
            for p in live[rnd % 2::2]:
                pair.call("deallocate", p)
            most = max(most, fast._sorted_bins())
            # takes from the sorted bins: least first, per stream; a larger request walks
            # past them; an oversize one releases cached blocks (max_split_size)
            for stream in (5, 0):
                for n in (size, size - 100, size + 512, 60 << 20):
                    held.append(pair.call("allocate", n, stream)[1])
            pair.call("cached_block_for", size, 5)
            for p in live[(rnd + 1) % 2::2]:
                pair.call("deallocate", p)
        pair.same("memory_stats", ref.memory_stats(), fast.memory_stats())
        pair.same("snapshot", fuzz_core._without_times(ref.snapshot()),
                  fuzz_core._without_times(fast.snapshot()))
        pair.call("empty_cache")
    fuzz_core._compare_torch_state(pair)
    assert most >= 2 and fast._sorted_bins() > 0
    for p in held:
        pair.call("deallocate", p)
    pair.call("empty_cache")
    fuzz_core._compare_torch_state(pair)
    assert fast._sorted_bins() == 0 and fast.memory_stats()["reserved_bytes.all.current"] == 0
