"""Load a PyTorch profiler trace of about 100 MB (Chrome trace JSON).

The trace is the real one in ``tests/data/real/torch_mlp.profile.json.gz`` (4 training steps
of an MLP, with memory events, Python stacks and ops) repeated until the JSON reaches the
size asked for: each copy later in time, with its own Python ids and addresses, so that the
result is one long run of the same program (about 400 events a step).

Each round times, one after the other on the same file: ``json.loads`` of its text (the floor:
every reader parses the JSON), :func:`load_torch_profile` and ``load_trace`` (sniffing and
the checks every trace gets). It also times the interval search alone (the innermost Python
slice and op of every memory event, with numpy) against the plain search, one event at a
time over all slices of its thread, on a sample of events.

Usage: python benchmarks/bench_torch_profile.py [MB] [ROUNDS]. Prints one table.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REAL = ROOT / "tests" / "data" / "real" / "torch_mlp.profile.json.gz"


def make_trace(path: Path, mb: float) -> dict:
    """Write copies of the real trace to ``path`` until the JSON holds ``mb`` MB."""
    with gzip.open(REAL, "rt") as f:
        raw = json.load(f)
    events = raw.pop("traceEvents")
    meta = [e for e in events if e.get("ph") == "M"]
    body = [e for e in events if e.get("ph") != "M"]
    ts = [e["ts"] for e in body if "ts" in e]
    span = max(ts) - min(ts) + 1000.0
    ids = [e["args"]["Python id"] for e in body if e.get("cat") == "python_function"]
    id_span = max(ids) + 1
    mem = [e for e in body if e.get("name") == "[memory]"]
    live_end = mem[-1]["args"]["Total Allocated"]
    one = len(json.dumps(body, separators=(",", ":")))
    copies = max(1, int(mb * 1e6 / one))
    out = []
    for k in range(copies):
        for e in body:
            e2 = dict(e)
            if "ts" in e2:
                e2["ts"] = round(e["ts"] + k * span, 3)
            args = e.get("args")
            if isinstance(args, dict):
                a2 = dict(args)
                if e.get("cat") == "python_function":
                    a2["Python id"] = args["Python id"] + k * id_span
                    if args.get("Python parent id") is not None:
                        a2["Python parent id"] = args["Python parent id"] + k * id_span
                if e.get("name") == "[memory]":
                    a2["Addr"] = args["Addr"] + (k << 40)
                    a2["Total Allocated"] = args["Total Allocated"] + k * live_end
                e2["args"] = a2
            out.append(e2)
    raw["traceEvents"] = meta + out
    path.write_text(json.dumps(raw, separators=(",", ":")))
    return {"copies": copies, "events": len(out) + len(meta),
            "memory": len(mem) * copies}


def naive_innermost(s_thread, s_start, s_end, q_thread, q_time):
    """The plain search: for each event, a scan of every slice (numpy over the slices)."""
    out = np.full(len(q_time), -1, dtype=np.int64)
    for k in range(len(q_time)):
        hold = np.flatnonzero((s_thread == q_thread[k]) & (s_start <= q_time[k])
                              & (s_end >= q_time[k]))
        out[k] = hold.max() if len(hold) else -1   # sorted by start: the innermost
    return out


def main() -> None:
    mb = float(sys.argv[1]) if len(sys.argv) > 1 else 100.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    from gpudash.trace import load_trace
    from gpudash.formats import torch_profile as tp

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.json"
        t0 = time.perf_counter()
        info = make_trace(path, mb)
        made = time.perf_counter() - t0
        size = path.stat().st_size
        times: dict[str, list[float]] = {"json": [], "load": [], "load_trace": []}
        for _ in range(rounds):
            for key, took in times.items():       # alternating, on the same file
                t0 = time.perf_counter()
                if key == "json":
                    json.loads(path.read_bytes())
                elif key == "load":
                    trace = tp.load_torch_profile(path)
                else:
                    load_trace(path)
                took.append(time.perf_counter() - t0)
        # the interval search alone, and the plain one on a sample
        text, nbytes = tp._read(str(path), str(path))
        header, events = tp._parse(text, nbytes, str(path))
        mem, py, ops, _ = tp._collect(events, str(path))
        del events, text
        base = header["baseTimeNanoseconds"]
        t = tp._ns(mem["ts"], base, str(path))
        thread = np.asarray(mem["thread"], dtype=np.int64)
        _, s_thread, s_start, s_end = tp._sorted_slices(py, base, str(path))
        fast = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            hit = tp.innermost(s_thread, s_start, s_end, thread, t)
            fast.append(time.perf_counter() - t0)
        sample = np.linspace(0, len(t) - 1, num=min(300, len(t))).astype(np.int64)
        t0 = time.perf_counter()
        slow_hit = naive_innermost(s_thread, s_start, s_end, thread[sample], t[sample])
        slow = (time.perf_counter() - t0) * len(t) / len(sample)
        assert np.array_equal(slow_hit, hit[sample]), "the two searches differ"

    floor = statistics.median(times["json"])
    rows = [
        ("json.loads of the text (the floor)", floor, 1.0),
        ("load_torch_profile", statistics.median(times["load"]),
         statistics.median(times["load"]) / floor),
        ("load_trace (sniffing, checks)", statistics.median(times["load_trace"]),
         statistics.median(times["load_trace"]) / floor),
        ("interval search, numpy, every memory event", statistics.median(fast), None),
        (f"interval search, one event at a time (from {len(sample)} events)", slow,
         slow / statistics.median(fast)),
    ]
    print(f"PyTorch profiler trace: {size / 1e6:.1f} MB JSON, {info['events']:,} events "
          f"({info['copies']} copies of the real trace), {info['memory']:,} memory events, "
          f"{len(py.start):,} Python slices, {len(ops.start):,} ops; made in {made:.1f} s; "
          f"{trace.summary()['allocations']:,} allocations; median of {rounds} rounds, "
          f"alternating; {os.cpu_count()} CPU(s)")
    print(f"| {'step':<58} | {'seconds':>8} | {'ratio':>7} |")
    print(f"| {'-' * 58} | {'-' * 8} | {'-' * 7} |")
    for label, secs, ratio in rows:
        r = "" if ratio is None else f"{ratio:.2f}"
        print(f"| {label:<58} | {secs:>8.3f} | {r:>7} |")


if __name__ == "__main__":
    main()
