"""Chrome Trace Event / Perfetto export of a trace's memory, alone and merged into a PyTorch
profiler trace: the format's rules, the counters against running sums computed here, OOM
instants, annotation slices, the clock alignment of a merge, decimation and the command.

Perfetto's trace processor cannot be loaded here (the ``perfetto`` package downloads its
``trace_processor_shell`` on first use), so the output is held to a checker of the format's
documented rules (:func:`check_chrome_trace`), itself tested against broken traces."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import random
import re
import time
from pathlib import Path

import numpy as np
import pytest

import gpudash
from gpudash import BFCAllocator, ConfigError, Recorder, TraceFormatError
from gpudash.cli import main
from gpudash.devices import SimulatedDevice
from gpudash.events import COLUMN_DTYPES, COLUMNS, EventKind
from gpudash.trace import Trace, load_trace, save_trace, write_trace
from gpudash.formats.perfetto import (
    PID_BASE,
    read_profiler_trace,
    to_chrome_trace,
    wall_clock_problem,
    write_chrome_trace,
)
from gpudash.formats.torch_snapshot import load_torch_snapshot, load_torch_snapshot_dict
from gpudash.workloads import training_loop

# ../shared beside the checkout (as tests/test_torch_fidelity.py finds it), or beside the
# folder of worktrees that holds this one
_ROOT = Path(__file__).resolve().parent.parent
from shared_files import EXTERNAL  # noqa: E402
A, F, E, R, O = "alloc", "free", "extend", "release", "oom"
KIND = {A: EventKind.ALLOC, F: EventKind.FREE, E: EventKind.EXTEND, R: EventKind.RELEASE,
        O: EventKind.OOM}
T0 = 1_700_000_000_123_456_789          # a wall-clock time (2023-11-14), ns since the epoch
MiB = 1 << 20


# ---------------------------------------------------------------------------- the checker
_PHASES = set("BEXiICMbnestfPONDRa")
_META_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name",
               "thread_sort_index"}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_chrome_trace(obj) -> None:
    """Raise AssertionError where ``obj`` breaks the Trace Event Format's rules (JSON object
    form) as Perfetto's and Chrome's importers read them: every event a dict with ``ph``, a
    numeric ``ts`` and a ``pid``; counters with an object of numeric ``args``; complete events
    with a numeric ``dur`` >= 0 that nest on their thread (slices of one thread may not
    partly overlap); instants with a scope of g, p or t; metadata events of a known name, a
    process_name with a name; every process gpudash writes named; the whole strict JSON."""
    assert isinstance(obj, dict), "the JSON object form is a dict"
    json.dumps(obj, allow_nan=False)   # strict JSON: no NaN or Infinity
    events = obj.get("traceEvents")
    assert isinstance(events, list), "traceEvents must be a list"
    if "displayTimeUnit" in obj:
        assert obj["displayTimeUnit"] in ("ms", "ns")
    named: set = set()
    pids: set = set()
    slices: dict = {}
    for i, e in enumerate(events):
        where = f"traceEvents[{i}] {e!r:.200}"
        assert isinstance(e, dict), where
        assert isinstance(e.get("ph"), str) and e["ph"] in _PHASES, f"{where}: ph"
        assert _number(e.get("ts")), f"{where}: ts must be a number"
        assert isinstance(e.get("pid"), (int, str)) and not isinstance(e["pid"], bool), \
            f"{where}: pid"
        if "tid" in e:
            assert isinstance(e["tid"], (int, str)) and not isinstance(e["tid"], bool), where
        ph = e["ph"]
        if ph == "M":
            assert e.get("name") in _META_NAMES, f"{where}: unknown metadata event"
            if e["name"] in ("process_name", "thread_name"):
                assert isinstance(e.get("args", {}).get("name"), str) and e["args"]["name"], \
                    f"{where}: {e['name']} needs args.name"
            if e["name"] == "process_name":
                named.add(e["pid"])
            continue
        assert isinstance(e.get("name"), str), f"{where}: name"
        if str(e.get("cat", "")).startswith("gpudash"):
            pids.add(e["pid"])
        if ph == "C":
            args = e.get("args")
            assert isinstance(args, dict) and args, f"{where}: a counter needs args"
            assert all(_number(v) for v in args.values()), f"{where}: counter args numeric"
        elif ph == "X":
            assert _number(e.get("dur")) and e["dur"] >= 0, f"{where}: dur >= 0"
            slices.setdefault((e["pid"], e.get("tid")), []).append(
                (round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000), i))
        elif ph in ("i", "I"):
            assert e.get("s", "t") in ("g", "p", "t"), f"{where}: scope"
    assert pids <= named, f"processes without a process_name: {sorted(pids - named)}"
    for key, spans in slices.items():
        stack: list = []
        for start, end, i in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], \
                f"traceEvents[{i}] overlaps a slice of {key} without nesting in it"
            stack.append(end)


def _bad(obj, **change):
    out = json.loads(json.dumps(obj))
    out["traceEvents"].append(change)
    return out


def test_the_checker_refuses_what_the_format_forbids():
    good = {"traceEvents": [
        {"name": "process_name", "ph": "M", "ts": 0, "pid": 1, "args": {"name": "p"}},
        {"name": "c", "ph": "C", "ts": 1.5, "pid": 1, "cat": "gpudash", "args": {"b": 3}},
        {"name": "s", "ph": "X", "ts": 1, "dur": 5, "pid": 1, "tid": 2},
        {"name": "s2", "ph": "X", "ts": 2, "dur": 1, "pid": 1, "tid": 2}],
        "displayTimeUnit": "ns"}
    check_chrome_trace(good)
    broken = [
        _bad(good, name="c", ph="C", pid=1, args={"b": 1}),                    # no ts
        _bad(good, name="c", ph="C", ts="5", pid=1, args={"b": 1}),           # ts a string
        _bad(good, name="c", ph="C", ts=1, args={"b": 1}),                    # no pid
        _bad(good, name="c", ph="C", ts=1, pid=1, args={"b": "x"}),           # not numeric
        _bad(good, name="c", ph="C", ts=1, pid=1),                            # no args
        _bad(good, name="x", ph="X", ts=1, dur=-1, pid=1, tid=3),             # dur < 0
        _bad(good, name="x", ph="X", ts=1, pid=1, tid=3),                     # no dur
        _bad(good, name="x", ph="X", ts=4, dur=5, pid=1, tid=2),              # overlaps
        _bad(good, name="i", ph="i", s="q", ts=1, pid=1),                     # bad scope
        _bad(good, name="process_name", ph="M", ts=0, pid=2, args={}),        # unnamed
        _bad(good, name="c", ph="C", ts=1, pid=9, cat="gpudash", args={"b": 1}),  # no name
        _bad(good, name="c", ph="Q", ts=1, pid=1),                            # phase
        _bad(good, name="c", ph="C", ts=float("nan"), pid=1, args={"b": 1}),  # NaN
    ]
    for obj in broken:
        with pytest.raises((AssertionError, ValueError)):
            check_chrome_trace(obj)


# ---------------------------------------------------------------------------- traces
def make_trace(rows, meta=None) -> Trace:
    """A trace from ``(time_ns, kind, device, ptr, size[, requested])`` rows."""
    cols = {name: np.zeros(len(rows), dtype=COLUMN_DTYPES[name]) for name in COLUMNS}
    cols["seq"] = np.arange(len(rows))
    for i, r in enumerate(rows):
        t, k, dev, ptr, size = r[:5]
        cols["time_ns"][i] = t
        cols["kind"][i] = int(KIND[k])
        cols["device"][i] = dev
        cols["ptr"][i] = ptr
        cols["size"][i] = size
        cols["requested"][i] = r[5] if len(r) > 5 else size
        cols["alloc_id"][i] = -1
    return Trace(cols, meta or {})


def random_rows(seed: int, n: int, devices=(0, 1), t0=T0) -> list:
    """Allocs and frees inside extended regions, regions released when empty, OOMs, with
    several rows at the same instant."""
    rng = random.Random(seed)
    rows = []
    live = {d: [] for d in devices}
    regions = {d: 0 for d in devices}
    t = t0
    for _ in range(n):
        t += rng.choice((0, 1, 7, 1000, 123_457))
        d = rng.choice(devices)
        roll = rng.random()
        if roll < 0.05:
            rows.append((t, O, d, 0, 1 << rng.randrange(20, 30), 12345))
        elif live[d] and roll < 0.5:
            ptr, size = live[d].pop(rng.randrange(len(live[d])))
            rows.append((t, F, d, ptr, size))
        elif roll < 0.58 and not live[d] and regions[d]:
            rows.append((t, R, d, 1 << 40, regions[d]))
            regions[d] = 0
        else:
            if not regions[d]:
                regions[d] = 64 * MiB
                rows.append((t, E, d, 1 << 40, regions[d]))
            size = rng.choice((256, 512, 4096, MiB, 3 * MiB))
            ptr = rng.randrange(1 << 30)
            live[d].append((ptr, size))
            rows.append((t, A, d, ptr, size))
    return rows


def expected_series(rows, device, plus, minus):
    """The running sum of +size / -size, written where it changes: [(t_ns, value)]."""
    out, total = [], 0
    for r in rows:
        if r[2] != device or r[1] not in (plus, minus):
            continue
        total += r[4] if r[1] == plus else -r[4]
        if not out or out[-1][1] != total:
            out.append((r[0], total))
    return out


def series(obj, pid, name):
    pts = [(e["ts"], e["args"]["bytes"]) for e in obj["traceEvents"]
           if e["ph"] == "C" and e["pid"] == pid and e["name"] == name]
    return sorted(pts, key=lambda p: p[0])   # a stable sort: same-time points keep order


def pid_named(obj, text):
    pids = [e["pid"] for e in obj["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name" and text in e["args"]["name"]]
    assert len(pids) == 1, pids
    return pids[0]


# ---------------------------------------------------------------------------- the export
def test_counters_are_the_running_sums_per_device():
    rows = random_rows(1, 3000)
    trace = make_trace(rows, {"devices": [{"index": 0, "name": "GPU_0_bfc"},
                                          {"index": 1, "name": "GPU_1_bfc"}]})
    obj = to_chrome_trace(trace)
    check_chrome_trace(obj)
    base = obj["baseTimeNanoseconds"]
    assert base == (T0 // 10**9) * 10**9           # the first event's second
    for d in (0, 1):
        pid = pid_named(obj, f"GPU_{d}_bfc memory (TensorFlow's BFC allocator)")
        assert pid == PID_BASE + d
        for name, plus, minus in (("in use", A, F), ("pool", E, R)):
            want = [((t - base) / 1000, v) for t, v in expected_series(rows, d, plus, minus)]
            assert series(obj, pid, name) == want, (d, name)
    gd = obj["otherData"]["gpudash"]
    assert gd["clock"] == "unix_ns" and gd["decimated"] == [] and gd["notes"] == []
    assert [x["points"] for x in gd["devices"]] == [
        {"in use": len(expected_series(rows, d, A, F)), "pool": len(expected_series(rows, d, E, R))}
        for d in (0, 1)]


def test_counters_speak_the_allocators_words():
    rows = [(T0, E, 0, 0, 2 * MiB), (T0 + 5, A, 0, 0, 512), (T0 + 9, F, 0, 0, 512)]
    torch_trace = make_trace(rows, {"source": "pytorch-snapshot",
                                    "devices": [{"index": 0, "name": "cuda:0"}]})
    obj = to_chrome_trace(torch_trace)
    check_chrome_trace(obj)
    names = {e["name"] for e in obj["traceEvents"] if e["ph"] == "C"}
    assert names == {"allocated", "reserved"}
    pid_named(obj, "cuda:0 memory (PyTorch's caching allocator)")
    bfc = to_chrome_trace(make_trace(rows))
    assert {e["name"] for e in bfc["traceEvents"] if e["ph"] == "C"} == {"in use", "pool"}
    assert bfc["otherData"]["gpudash"]["counters"] == {"in_use": "in use", "pool": "pool",
                                                       "unit": "bytes"}


def test_a_trace_without_regions_gets_no_pool_counter_and_says_so():
    obj = to_chrome_trace(make_trace([(T0, A, 0, 0, 512), (T0 + 1, F, 0, 0, 512)]))
    assert {e["name"] for e in obj["traceEvents"] if e["ph"] == "C"} == {"in use"}
    notes = obj["otherData"]["gpudash"]["notes"]
    assert any("no pool counter" in n and "regions" in n for n in notes), notes


def test_oom_instants_at_their_times_with_the_request():
    rows = [(T0, O, 0, 0, MiB, 1000), (T0, E, 0, 0, 8 * MiB), (T0 + 1000, A, 0, 0, 6 * MiB),
            (T0 + 2500, O, 0, 0, 4 * MiB, 4 * MiB - 100), (T0 + 3000, F, 0, 0, 6 * MiB),
            (T0 + 7777, O, 0, 0, 16 * MiB, 15 * MiB), (T0 + 9000, A, 0, 1, MiB)]
    obj = to_chrome_trace(make_trace(rows, {"source": "pytorch-snapshot"}))
    check_chrome_trace(obj)
    base = obj["baseTimeNanoseconds"]
    ooms = [e for e in obj["traceEvents"] if e["ph"] == "i"]
    assert [(e["name"], e["s"], e["ts"]) for e in ooms] == [
        ("out of memory", "p", (T0 - base) / 1000),
        ("out of memory", "p", (T0 + 2500 - base) / 1000),
        ("out of memory", "p", (T0 + 7777 - base) / 1000)]
    assert ooms[0]["args"] == {"requested bytes": 1000, "rounded bytes": MiB,
                               "allocated bytes": 0, "reserved bytes": 0}
    assert ooms[1]["args"] == {"requested bytes": 4 * MiB - 100, "rounded bytes": 4 * MiB,
                               "allocated bytes": 6 * MiB, "reserved bytes": 8 * MiB}
    assert ooms[2]["args"]["allocated bytes"] == 0
    assert obj["otherData"]["gpudash"]["devices"][0]["ooms"] == 3


def test_annotations_become_slices_nested_on_threads():
    rows = [(T0, A, 0, 0, 512), (T0 + 10**6, F, 0, 0, 512), (T0, A, 1, 0, 512)]
    meta = {"annotations": {
        "names": ["step", "forward", "backward"],
        "ranges": [
            [0, 0, T0, T0 + 900_000],                 # step
            [0, 1, T0 + 1000, T0 + 400_000],          # forward, inside step
            [0, "optimizer", T0 + 400_000, T0 + 800_000],   # a name given as a string
            [0, 2, T0 + 300_000, T0 + 950_000],       # overlaps forward and step: lane 2
            [1, 0, T0 + 5, T0 + 6],                   # device 1
            [0, 7, T0, T0 + 1],                       # a name index outside names
            [0, 1, T0 + 10, T0 + 5],                  # ends before it starts
            [0, 1, "soon", T0 + 5],                   # a time that is not an integer
            [0, 1, T0],                               # three fields
            "step",                                   # not a list
            [True, 1, T0, T0 + 1],                    # a bool is no device
        ]}}
    obj = to_chrome_trace(make_trace(rows, meta))
    check_chrome_trace(obj)
    base = obj["baseTimeNanoseconds"]
    got = sorted((e["pid"] - PID_BASE, e["tid"], e["name"], e["ts"], e["dur"])
                 for e in obj["traceEvents"] if e["ph"] == "X")
    assert got == sorted([
        (0, 1, "step", (T0 - base) / 1000, 900.0),
        (0, 1, "forward", (T0 + 1000 - base) / 1000, 399.0),
        (0, 1, "optimizer", (T0 + 400_000 - base) / 1000, 400.0),
        (0, 2, "backward", (T0 + 300_000 - base) / 1000, 650.0),
        (1, 1, "step", (T0 + 5 - base) / 1000, 0.001)])
    threads = {(e["pid"] - PID_BASE, e["tid"]): e["args"]["name"] for e in obj["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {(0, 1): "annotations", (0, 2): "annotations 2", (1, 1): "annotations"}
    gd = obj["otherData"]["gpudash"]
    assert gd["annotations"] == 5
    assert sum(gd["annotations_skipped"].values()) == 6
    assert any(n.startswith("annotations skipped: ") for n in gd["notes"])
    # only the devices asked for
    one = to_chrome_trace(make_trace(rows, meta), devices=[1])
    assert [e["name"] for e in one["traceEvents"] if e["ph"] == "X"] == ["step"]


@pytest.mark.parametrize("ann", [["not", "an", "object"], {"names": "step", "ranges": 3},
                                 {"ranges": [[0, 0, 1, 2]]}])
def test_annotations_that_cannot_be_read_are_counted_not_fatal(ann):
    obj = to_chrome_trace(make_trace([(T0, A, 0, 0, 512)], {"annotations": ann}))
    check_chrome_trace(obj)
    assert not [e for e in obj["traceEvents"] if e["ph"] == "X"]
    assert obj["otherData"]["gpudash"]["annotations_skipped"]


def test_devices_are_checked():
    trace = make_trace(random_rows(2, 200))
    obj = to_chrome_trace(trace, devices=1)
    assert {e["pid"] for e in obj["traceEvents"]} == {PID_BASE + 1}
    with pytest.raises(ConfigError, match="device 5 is not in the trace; its devices: 0, 1"):
        to_chrome_trace(trace, devices=[5])
    with pytest.raises(ConfigError, match="max_points"):
        to_chrome_trace(trace, max_points=2)
    with pytest.raises(ConfigError, match="offset_ns"):
        to_chrome_trace(trace, offset_ns=1.5)


def test_a_synthetic_trace_is_exported_from_its_first_event_without_a_clock():
    trace = training_loop(steps=2, layers=3, batch=8, hidden=256)
    obj = to_chrome_trace(trace)
    check_chrome_trace(obj)
    assert "baseTimeNanoseconds" not in obj
    ts = [e["ts"] for e in obj["traceEvents"] if e["ph"] == "C"]
    assert min(ts) == 0.0
    gd = obj["otherData"]["gpudash"]
    assert gd["clock"] == "not wall-clock" and "synthetic" in gd["notes"][0]


def test_an_empty_trace_is_a_valid_empty_export():
    obj = to_chrome_trace(Trace.empty())
    check_chrome_trace(obj)
    assert obj["traceEvents"] == []


# ---------------------------------------------------------------------------- decimation
def _spiky_rows(n: int, seed: int = 3):
    """A random walk of allocations with one tall spike and one deep trough."""
    rng = random.Random(seed)
    rows, live, t = [], [], T0
    for i in range(n):
        t += rng.randrange(1, 2000)
        if i == n // 3:
            rows.append((t, A, 0, 1, 900 * MiB))         # the peak, freed at once
            t += 1
            rows.append((t, F, 0, 1, 900 * MiB))
            continue
        if live and (rng.random() < 0.5 or len(live) > 400):
            ptr, size = live.pop(rng.randrange(len(live)))
            rows.append((t, F, 0, ptr, size))
        else:
            size = rng.randrange(1, 64) * 4096
            live.append((i + 2, size))
            rows.append((t, A, 0, i + 2, size))
    return rows


def test_decimation_bounds_points_and_keeps_the_peak_and_the_trough():
    rows = _spiky_rows(200_000)
    trace = make_trace(rows)
    want = expected_series(rows, 0, A, F)
    obj = to_chrome_trace(trace, max_points=999)
    check_chrome_trace(obj)
    base = obj["baseTimeNanoseconds"]
    got = series(obj, PID_BASE, "in use")
    assert 300 < len(got) <= 999
    peak = max(want, key=lambda p: p[1])
    assert peak[1] >= 900 * MiB
    assert ((peak[0] - base) / 1000, peak[1]) in got          # the peak, at its own time
    assert max(v for _, v in got) == peak[1]
    trough_after_start = min(v for _, v in want[len(want) // 2:])
    assert min(v for _, v in got) <= trough_after_start
    # every point kept is a true point of the series, and no two neighbours repeat a value
    true_points = {((t - base) / 1000, v) for t, v in want}
    assert set(got) <= true_points
    assert all(a[1] != b[1] for a, b in itertools.pairwise(got))
    # the last value is the series' last value
    assert got[-1] == ((want[-1][0] - base) / 1000, want[-1][1])
    gd = obj["otherData"]["gpudash"]
    assert gd["decimated"] == [f"device0 in use: {len(want):,} -> {len(got):,} points"]
    assert any("decimated" in n for n in gd["notes"])
    labels = [e["args"]["labels"] for e in obj["traceEvents"] if e["name"] == "process_labels"]
    assert labels and "in use decimated" in labels[0]
    # no bound: every change, nothing said about decimation
    full = to_chrome_trace(trace, max_points=None)
    assert series(full, PID_BASE, "in use") == [((t - base) / 1000, v) for t, v in want]
    assert full["otherData"]["gpudash"]["decimated"] == []


def test_points_that_change_nothing_are_not_written():
    rows = [(T0, A, 0, 0, 512), (T0 + 1, A, 0, 1, 0), (T0 + 2, F, 0, 1, 0),
            (T0 + 3, E, 0, 9, MiB), (T0 + 4, A, 0, 2, 256)]
    obj = to_chrome_trace(make_trace(rows))
    base = obj["baseTimeNanoseconds"]
    assert series(obj, PID_BASE, "in use") == [((T0 - base) / 1000, 512),
                                               ((T0 + 4 - base) / 1000, 768)]


# ---------------------------------------------------------------------------- merge
def _profiler(path: Path, base: int, events=None, gz=False, **top) -> Path:
    obj = {"schemaVersion": 1, "deviceProperties": [], "displayTimeUnit": "ms",
           "baseTimeNanoseconds": base, **top,
           "traceEvents": events if events is not None else [
               {"name": "process_name", "ph": "M", "ts": 0, "pid": 0, "tid": 0,
                "args": {"name": "GPU 0"}},
               {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 1000.5,
                "dur": 20.25},
               {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 4242, "tid": 4242,
                "ts": 990.0, "dur": 40.0}]}
    data = json.dumps(obj).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _read(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)


@pytest.mark.parametrize("gz_in, out_name", [(False, "merged.json"), (True, "merged.json.gz")])
def test_merge_puts_memory_on_the_profilers_clock(tmp_path, gz_in, out_name):
    base = 1_696_118_400 * 10**9                 # 2023-10-01: Kineto's base is a quarter's
    rows = [(base + 1_234_567_891, E, 0, 0, 2 * MiB), (base + 1_234_568_000, A, 0, 0, 4096),
            (base + 2_000_000_000, O, 0, 0, 4 * MiB)]
    trace = make_trace(rows, {"source": "pytorch-snapshot",
                              "devices": [{"index": 0, "name": "cuda:0"}]})
    prof = _profiler(tmp_path / ("prof.json.gz" if gz_in else "prof.json"), base, gz=gz_in)
    before = _read(prof)
    out = tmp_path / out_name
    done = write_chrome_trace(trace, out, merge=prof)
    obj = _read(out)
    check_chrome_trace(obj)
    assert obj["traceEvents"][:3] == before["traceEvents"]           # its events, unchanged
    assert obj["baseTimeNanoseconds"] == base and obj["displayTimeUnit"] == "ms"
    assert obj["schemaVersion"] == 1
    pid = pid_named(obj, "cuda:0 memory")
    assert pid not in (0, 4242)
    assert series(obj, pid, "reserved") == [(1_234_567.891, 2 * MiB)]
    assert series(obj, pid, "allocated") == [(1_234_568.0, 4096)]
    assert [e["ts"] for e in obj["traceEvents"] if e["ph"] == "i"] == [2_000_000.0]
    gd = obj["otherData"]["gpudash"]
    assert gd["merged_into"] == str(prof) and gd["profiler_base_ns"] == base
    assert done["events"] == len(obj["traceEvents"]) - 3 and done["profiler_events"] == 3
    # the memory lies 1,234 s after the profiler's events, which end near 1 ms: said
    assert any("after the profiler's events end" in n for n in done["notes"]), done["notes"]


def test_merge_aligns_a_recorded_session_between_the_ops_around_it(tmp_path):
    """A gpudash recording stamps time.time_ns(): an allocation made between two profiler
    events lands between them."""
    alloc = BFCAllocator(SimulatedDevice("1GiB"), 512 * MiB, name="GPU_0_bfc")
    rec = Recorder(alloc)
    t_before = time.time_ns()
    p = alloc.allocate(3 * MiB)
    t_after = time.time_ns()
    alloc.deallocate(p)
    trace = rec.to_trace()
    rec.detach()
    assert wall_clock_problem(trace) is None
    base = (t_before // 10**9 - 86_400) * 10**9

    def us(t):
        return (t - base) / 1000

    prof = _profiler(tmp_path / "p.json", base, events=[
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 7, "tid": 7,
         "ts": us(t_before), "dur": us(t_after) - us(t_before)}])
    write_chrome_trace(trace, tmp_path / "m.json", merge=prof)
    obj = _read(tmp_path / "m.json")
    check_chrome_trace(obj)
    pid = pid_named(obj, "GPU_0_bfc memory")
    first_alloc = series(obj, pid, "in use")[0]
    assert first_alloc[1] >= 3 * MiB
    assert us(t_before) <= first_alloc[0] <= us(t_after)


def test_merge_refuses_times_that_are_not_wall_clock_unless_given_an_offset(tmp_path):
    base = 1_696_118_400 * 10**9
    prof = _profiler(tmp_path / "p.json", base)
    synthetic = training_loop(steps=1, layers=2, batch=4, hidden=128)
    with pytest.raises(TraceFormatError, match="synthetic workload.*offset_ns"):
        write_chrome_trace(synthetic, tmp_path / "a.json", merge=prof)
    # a snapshot without time_us: entries are numbered 1 us apart from 0
    snap = {"segments": [], "device_traces": [[
        {"action": "segment_alloc", "addr": 0, "size": 2 * MiB, "stream": 0},
        {"action": "alloc", "addr": 0, "size": 512, "stream": 0}]]}
    untimed = load_torch_snapshot(snap)
    with pytest.raises(TraceFormatError, match="no time_us"):
        write_chrome_trace(untimed, tmp_path / "b.json", merge=prof)
    assert not (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()
    # a replay's recording: wall-clock numbers, but the replay's clock, not the job's
    from gpudash.trace.replay import replay
    replayed = replay(synthetic, device_bytes="16GiB", fraction=0.5, record=True).recording
    assert "replay's recording" in wall_clock_problem(replayed)
    # with offset_ns the user places it: ts = (time_ns + offset - base) / 1000
    offset = base + 5_000_000
    write_chrome_trace(untimed, tmp_path / "b.json", merge=prof, offset_ns=offset)
    obj = _read(tmp_path / "b.json")
    check_chrome_trace(obj)
    pid = pid_named(obj, "cuda:0")
    t = untimed.columns["time_ns"]
    assert series(obj, pid, "reserved")[0][0] == (int(t[0]) + offset - base) / 1000
    # an offset that still leaves the times off the clock is refused, naming it
    with pytest.raises(TraceFormatError, match="plus offset_ns 5"):
        write_chrome_trace(untimed, tmp_path / "c.json", merge=prof, offset_ns=5)


@pytest.mark.parametrize("content, message", [
    (b"{not json", "not a JSON profiler trace"),
    (gzip.compress(b'{"traceEvents": [', mtime=0)[:-6], "not a gzipped JSON profiler trace"),
    (b'[{"ph": "X", "ts": 1, "pid": 1}]', "JSON array of events, with no baseTimeNano"),
    (b'"trace"', "a JSON str, not a profiler trace"),
    (b'{"baseTimeNanoseconds": 1696118400000000000}', "no traceEvents list"),
    (b'{"traceEvents": {}, "baseTimeNanoseconds": 1696118400000000000}',
     r"no traceEvents list \(found dict\)"),
    (b'{"traceEvents": []}', "no baseTimeNanoseconds at its top level"),
    (b'{"traceEvents": [], "baseTimeNanoseconds": "1696118400000000000"}',
     "is not an integer count of nanoseconds"),
    (b'{"traceEvents": [], "baseTimeNanoseconds": 12}', "is not an integer count"),
    (b"", "the file is empty"),
])
def test_a_bad_profiler_trace_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "prof.json"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=message):
        read_profiler_trace(path)
    with pytest.raises(TraceFormatError, match="prof.json"):
        write_chrome_trace(make_trace([(T0, A, 0, 0, 512)]), tmp_path / "o.json", merge=path)
    assert not (tmp_path / "o.json").exists()


def test_merge_pids_avoid_the_profilers_own(tmp_path):
    base = 1_696_118_400 * 10**9
    prof = _profiler(tmp_path / "p.json", base, events=[
        {"ph": "X", "name": "k", "pid": PID_BASE + 1, "tid": 1, "ts": 1, "dur": 1},
        {"name": "process_name", "ph": "M", "ts": 0, "pid": PID_BASE + 1,
         "args": {"name": "theirs"}}])
    write_chrome_trace(make_trace(random_rows(4, 50, t0=base + 10**9)), tmp_path / "m.json",
                       merge=prof)
    obj = _read(tmp_path / "m.json")
    check_chrome_trace(obj)
    ours = {e["pid"] for e in obj["traceEvents"] if e.get("cat") == "gpudash.memory"}
    assert ours and PID_BASE + 1 not in ours


def test_writing_refuses_an_existing_file_and_replaces_it_when_asked(tmp_path):
    out = tmp_path / "o.json"
    out.write_text("keep")
    trace = make_trace([(T0, A, 0, 0, 512)])
    with pytest.raises(TraceFormatError, match="already exists; pass overwrite=True"):
        write_chrome_trace(trace, out)
    assert out.read_text() == "keep"
    write_chrome_trace(trace, out, overwrite=True)
    check_chrome_trace(_read(out))
    assert [p.name for p in tmp_path.iterdir()] == ["o.json"]   # no temporary file left


def test_save_trace_writes_perfetto_and_refuses_options_elsewhere(tmp_path):
    trace = make_trace([(T0, A, 0, 0, 512)])
    done = save_trace(trace, tmp_path / "x.json.gz", format="perfetto", max_points=10)
    assert done["max_points"] == 10
    check_chrome_trace(_read(tmp_path / "x.json.gz"))
    with pytest.raises(TraceFormatError, match="takes no options"):
        save_trace(trace, tmp_path / "y.gdtrace", format="gdtrace", merge="p.json")


@pytest.mark.skipif(not (EXTERNAL / "DeComFL.memory.pickle").exists(),
                    reason="../shared/reference/external is not here")
def test_a_real_snapshot_ends_at_the_layout_pytorch_reported():
    """The counters' last values are the bytes of the snapshot's own final segments and
    allocated blocks (read here from the snapshot, not from gpudash's trace). PyTorch's trace
    entries carry the bytes requested (``orig_size``), not the block's rounded size, so the
    allocated counter of a snapshot ends at the blocks' ``requested_size``."""
    path = EXTERNAL / "DeComFL.memory.pickle"
    snap = load_torch_snapshot_dict(path)
    trace = load_trace(path)
    obj = to_chrome_trace(trace, max_points=None)
    check_chrome_trace(obj)
    for seg_dev in {s["device"] for s in snap["segments"]}:
        segs = [s for s in snap["segments"] if s["device"] == seg_dev]
        reserved = sum(s["total_size"] for s in segs)
        allocated = sum(b["requested_size"] for s in segs for b in s["blocks"]
                        if b["state"] in ("active_allocated", "active_pending_free"))
        pid = PID_BASE + seg_dev
        assert series(obj, pid, "reserved")[-1][1] == reserved
        assert series(obj, pid, "allocated")[-1][1] == allocated
    assert obj["otherData"]["gpudash"]["clock"] == "unix_ns"


# ---------------------------------------------------------------------------- the command
def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def timed_trace(tmp_path) -> Path:
    path = tmp_path / "t.gdtrace"
    write_trace(make_trace(random_rows(5, 400), {"devices": [{"index": 0, "name": "GPU_0_bfc"},
                                                             {"index": 1, "name": "GPU_1_bfc"}]}),
                path)
    return path


def test_cli_writes_perfetto_and_merges(tmp_path, capsys, timed_trace):
    out = tmp_path / "mem.json.gz"
    code, text, err = run(capsys, "convert", timed_trace, "--to", "perfetto", out)
    assert code == 0, err
    assert f"-> {out} (perfetto: {len(load_trace(timed_trace)):,} trace events as" in text
    assert "on 2 device(s)" in text
    obj = _read(out)
    check_chrome_trace(obj)
    assert len({e["pid"] for e in obj["traceEvents"]}) == 2
    prof = _profiler(tmp_path / "p.json", (T0 // 10**9 - 3600) * 10**9)
    merged = tmp_path / "merged.json"
    code, text, err = run(capsys, "convert", timed_trace, merged, "--merge", prof,
                          "--max-points", "50")
    assert code == 0, err
    assert "added to" in text and "3 events" in text and "note: counters decimated" in text
    obj = _read(merged)
    check_chrome_trace(obj)
    assert obj["otherData"]["gpudash"]["max_points"] == 50
    # --merge may write over the profiler's own file, when asked to
    code, _, err = run(capsys, "convert", timed_trace, prof, "--merge", prof)
    assert code == 1 and "exists; pass --overwrite" in err
    code, _, err = run(capsys, "convert", timed_trace, prof, "--merge", prof, "--overwrite")
    assert code == 0, err
    check_chrome_trace(_read(prof))


def test_cli_json_without_to_is_still_a_pytorch_snapshot(tmp_path, capsys, timed_trace):
    code, text, err = run(capsys, "convert", timed_trace, tmp_path / "s.json")
    assert code == 0, err
    assert "(torch-json," in text and "segments" in json.loads((tmp_path / "s.json").read_text())


def test_cli_help_says_what_perfetto_writes(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for words in ("--to FORMAT", "perfetto", "Chrome Trace Event JSON", "--merge PROFILER.json",
                  "baseTimeNanoseconds", "--offset-ns NS", "--max-points N"):
        assert words in out, words


@pytest.mark.parametrize("make_args, message", [
    (lambda d, t: [t, d / "o.json", "--merge", d / "bad.json"], "not a JSON profiler trace"),
    (lambda d, t: [t, d / "o.json", "--merge", d / "nobase.json"],
     "no baseTimeNanoseconds at its top level"),
    (lambda d, t: [t, d / "o.json", "--merge", d / "missing.json"], "missing.json: no such file"),
    (lambda d, t: [d / "syn.gdtrace", d / "o.json", "--merge", d / "good.json"],
     "synthetic workload.*--offset-ns"),
    (lambda d, t: [t, "--to", "gdtrace", d / "o.gdtrace", "--merge", d / "good.json"],
     "--merge only apply to --to perfetto"),
    (lambda d, t: [t, d / "o.json", "--to", "perfetto", "--max-points", "2"],
     "must be 3.."),
    (lambda d, t: [t, d / "o.json.gz"], "cannot tell what to write from .gz"),
    (lambda d, t: [t, d / "o.json", "--to", "perfetto", "--offset-ns", "soon"],
     "expected an integer"),
])
def test_cli_refuses_bad_input_in_one_line(tmp_path, capsys, timed_trace, make_args, message):
    (tmp_path / "bad.json").write_text("{oops")
    (tmp_path / "nobase.json").write_text('{"traceEvents": []}')
    _profiler(tmp_path / "good.json", 1_696_118_400 * 10**9)
    write_trace(training_loop(steps=1, layers=2, batch=4, hidden=128), tmp_path / "syn.gdtrace")
    code, _, err = run(capsys, "convert", *make_args(tmp_path, timed_trace))
    assert code == 1
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "o.json").exists()


def test_cli_merges_an_untimed_trace_with_an_offset(tmp_path, capsys):
    base = 1_696_118_400 * 10**9
    write_trace(training_loop(steps=1, layers=2, batch=4, hidden=128), tmp_path / "syn.gdtrace")
    prof = _profiler(tmp_path / "p.json", base)
    offset = base - 1_000_000_000 + 990_000        # the first event (t = 1 s) at ts 990 us
    code, _, err = run(capsys, "convert", tmp_path / "syn.gdtrace", tmp_path / "o.json",
                          "--merge", prof, f"--offset-ns={offset}")
    assert code == 0, err
    obj = _read(tmp_path / "o.json")
    check_chrome_trace(obj)
    first = min(e["ts"] for e in obj["traceEvents"] if e["ph"] == "C")
    trace = load_trace(tmp_path / "syn.gdtrace")
    assert first == (int(trace.columns["time_ns"].min()) + offset - base) / 1000
    assert gpudash.__file__.startswith(str(Path(__file__).resolve().parent.parent))


def test_decimation_in_time_order_and_out_of_it_agree():
    """The O(n) path for points in time order keeps the same points as the sorting one, and
    points out of time order (a trace joined from parts) are still bounded with their peak."""
    from gpudash.formats.perfetto import _decimate

    rng = np.random.default_rng(7)
    t = np.cumsum(rng.integers(0, 50, 100_000)).astype(np.int64)   # ties included
    v = np.cumsum(rng.integers(-1000, 1001, 100_000)).astype(np.int64)
    v[1234] = v.max() + 1                                           # a lone peak
    fast = _decimate(t, v, 600)
    slow = _decimate(t, v, 600, in_order=False)
    assert np.array_equal(fast[0], slow[0]) and np.array_equal(fast[1], slow[1])
    few = rng.integers(0, 4, len(t)).astype(np.int64)   # many ties: the first of each is kept
    fast_ties, slow_ties = _decimate(t, few, 600), _decimate(t, few, 600, in_order=False)
    assert np.array_equal(fast_ties[0], slow_ties[0]) and len(fast_ties[0]) <= 600
    assert len(fast[1]) <= 600 and (t[1234], v[1234]) in zip(*fast)
    shuffled = rng.permutation(len(t))
    st, sv = _decimate(t[shuffled], v[shuffled], 600)
    assert len(sv) <= 600 and sv.max() == v.max() and sv.min() == v.min()
    assert set(zip(st.tolist(), sv.tolist())) <= set(zip(t.tolist(), v.tolist()))
