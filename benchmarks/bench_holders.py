"""Who holds the memory at 10^6 events: ``top_holders`` (by line, stack, category, holder),
``diff_holders`` and ``leaks`` against a plain per-event Python loop, in one run.

The trace is synthetic, made here and not timed: ``--events`` events (default 1,000,000;
half allocations, half frees, 1 % of allocations never freed), ``--stacks`` distinct stacks
(default 2,000) of 30 frames each (C++ frames, torch's, then two of the user's among 200
lines), annotations marking 10 iterations. Each measure is the best of ``--repeat`` runs
(default 3); the baseline is what a notebook would write without gpudash: walk the events
in a Python loop keeping a dict of live allocations, then find each live allocation's
innermost user frame (cached per stack) and add up by line. The last column is the
baseline's time over gpudash's, both measured in this run (the machine may be shared:
compare ratios, not seconds, across runs).

Run: ``python benchmarks/bench_holders.py [--events N] [--stacks S] [--repeat R]``.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import numpy as np

from gpudash.events import COLUMNS, COLUMN_DTYPES
from gpudash.trace import Trace
from gpudash.trace.callers import user_code_rule
from gpudash.trace.diff import diff_holders, leaks
from gpudash.trace.holders import top_holders
from gpudash.formats.stacks import StackTable

SITE = "/home/u/.venv/lib/python3.11/site-packages/torch"


def make(events: int, n_stacks: int, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    st = StackTable()
    ids = []
    for k in range(n_stacks):
        frames = \
            [("??", 0, f"at::_ops::op{(k + j) % 60}::call") for j in range(20)] + \
            [(f"{SITE}/nn/modules/module{j}.py", 100 + j, "_call_impl") for j in range(8)] + \
            [("/home/u/proj/model.py", k % 200, f"f{k % 37}"),
             ("/home/u/proj/train.py", 10 + k % 7, "main")]
        ids.append(st.intern_frames(frames))
    n = events // 2
    kind = np.tile(np.array([1, 2], dtype=np.int8), n)
    aid = np.repeat(np.arange(1, n + 1, dtype=np.int64), 2)
    keep = rng.random(n) < 0.01
    kind[1::2][keep] = 1
    aid[1::2][keep] = n + 1 + np.arange(int(keep.sum()))
    size = np.repeat(rng.integers(1, 1 << 12, n) * 512, 2).astype(np.int64)
    m = 2 * n
    cols = {"seq": np.arange(m), "time_ns": np.arange(m) * 1000, "kind": kind,
            "ptr": aid * 4096, "size": size, "requested": size, "bin": np.zeros(m),
            "region": np.zeros(m), "alloc_id": aid, "device": np.zeros(m)}
    cols = {c: np.asarray(cols[c], dtype=COLUMN_DTYPES[c]) for c in COLUMNS}
    stack = np.array(ids, dtype=np.int32)[rng.integers(0, n_stacks, m)]
    ends = np.linspace(0, m * 1000, 11)[1:-1].astype(np.int64)
    meta = {"source": "pytorch-snapshot",
            "annotations": {"names": ["Optimizer.step#Adam.step"],
                            "ranges": [[0, 0, int(e) - 500, int(e)] for e in ends]}}
    holder = np.where(kind == 1, rng.integers(0, 50, m), -1).astype(np.int32)
    return Trace(cols, meta, holder=holder, holders=[f"op{i}" for i in range(50)],
                 stack=stack, stacks=st)


def baseline_by_line(trace: Trace) -> Counter:
    """The notebook's loop: live allocations at the end, by innermost user frame."""
    rule = user_code_rule(None)
    c = trace.columns
    live: dict[int, tuple[int, int]] = {}
    for k, a, s, sid in zip(c["kind"].tolist(), c["alloc_id"].tolist(), c["size"].tolist(),
                            trace.stack.tolist()):
        if k == 1:
            live[a] = (s, sid)
        elif k == 2:
            live.pop(a, None)
    site: dict[int, object] = {}
    out: Counter = Counter()
    for s, sid in live.values():
        if sid not in site:
            site[sid] = next((f for f in trace.stacks.frames_of(sid) if rule(f.filename)), None)
        out[site[sid]] += s
    return out


def best(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--stacks", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    trace = make(args.events, args.stacks)
    base_s, expected = best(lambda: baseline_by_line(trace), args.repeat)
    rows = []
    for name, fn in [
        ("top_holders(at='end', by='line')", lambda: top_holders(trace, at="end", by="line")),
        ("top_holders(at='peak', by='line')", lambda: top_holders(trace, by="line")),
        ("top_holders(at='end', by='stack')", lambda: top_holders(trace, at="end", by="stack")),
        ("top_holders(at='end', by='category')",
         lambda: top_holders(trace, at="end", by="category")),
        ("top_holders(at='end', by='holder')",
         lambda: top_holders(trace, at="end", by="holder")),
        ("diff_holders(at='peak', to='end')",
         lambda: diff_holders(trace, at="peak", to="end")),
        ("leaks() (9 Optimizer.step marks)", lambda: leaks(trace)),
    ]:
        s, result = best(fn, args.repeat)
        if name.startswith("top_holders(at='end', by='line')"):
            got = {r.key: r.bytes for r in result}
            assert sum(got.values()) == sum(expected.values()), "totals differ"
            assert all(got[k] == v for k, v in expected.items() if k is not None)
        rows.append((name, s))
    print(f"{len(trace):,} events, {len(trace.stacks):,} distinct stacks of 30 frames; "
          f"best of {args.repeat}")
    print(f"{'measure':<40} {'seconds':>9} {'loop/this':>10}")
    print(f"{'per-event Python loop, by line (baseline)':<40} {base_s:>9.3f} {'1.0':>10}")
    for name, s in rows:
        print(f"{name:<40} {s:>9.3f} {base_s / s:>10.1f}")


if __name__ == "__main__":
    main()
