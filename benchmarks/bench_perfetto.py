"""Time and size of the Perfetto / Chrome-trace export of large traces.

Traces of 10^5, 10^6 and 10^7 events on one device (a random walk of allocations and frees
inside regions that are obtained and released, wall-clock times 1-2000 ns apart, one OOM
per 10,000 events) are exported with :func:`gpudash.formats.perfetto.to_chrome_trace` (the
dict) and :func:`~gpudash.formats.perfetto.write_chrome_trace` (the JSON file, plain and
gzipped), at the default bound of points per counter and, for the smaller traces, unbounded.
The dict is timed three times, alternating with :meth:`Trace.summary` of the same trace (one
numpy pass over its columns) as the baseline, best of each: the ratio says what the export
costs in units of a pass over the trace, which moves less than seconds on a shared machine.

Run: ``python benchmarks/bench_perfetto.py [--events 100000 1000000 10000000]``. Prints one
table: seconds for summary(), the dict (and their ratio) and each file, the points written,
and the file sizes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpudash.events import COLUMN_DTYPES, COLUMNS, EventKind
from gpudash.trace import Trace
from gpudash.formats.perfetto import DEFAULT_MAX_POINTS, to_chrome_trace, write_chrome_trace

T0 = 1_700_000_000_000_000_000


def make_trace(n: int, seed: int = 0) -> Trace:
    """``n`` rows: allocs and frees of random sizes (each free pairs with an earlier alloc),
    an extend before every 64th alloc and a release after every 64th free, an OOM every
    10,000 rows; built with numpy, without a Python loop per row."""
    rng = np.random.default_rng(seed)
    kind = np.where(rng.random(n) < 0.5, int(EventKind.ALLOC), int(EventKind.FREE))
    kind[rng.integers(0, n, n // 10_000 + 1)] = int(EventKind.OOM)
    allocs = np.flatnonzero(kind == int(EventKind.ALLOC))
    frees = np.flatnonzero(kind == int(EventKind.FREE))
    kind[allocs[::64]] = int(EventKind.EXTEND)
    kind[frees[::64]] = int(EventKind.RELEASE)
    size = (rng.integers(1, 4096, n) * 256).astype(np.int64)
    is_a = kind == int(EventKind.ALLOC)
    is_f = kind == int(EventKind.FREE)
    # a free takes back the size of an earlier allocation, so the sum stays a walk
    a_sizes = size[is_a]
    k = np.cumsum(is_a) - 1
    size[is_f] = a_sizes[np.clip(k[is_f], 0, None)] if len(a_sizes) else 256
    size[kind == int(EventKind.EXTEND)] = 64 << 20
    size[kind == int(EventKind.RELEASE)] = 64 << 20
    cols = {name: np.zeros(n, dtype=COLUMN_DTYPES[name]) for name in COLUMNS}
    cols["seq"] = np.arange(n)
    cols["time_ns"] = T0 + np.cumsum(rng.integers(1, 2000, n))
    cols["kind"] = kind.astype(np.int8)
    cols["size"] = size
    cols["requested"] = size
    cols["alloc_id"][:] = -1
    return Trace(cols, {"source": "pytorch-snapshot",
                        "devices": [{"index": 0, "name": "cuda:0"}]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.events:
            trace = make_trace(n)
            bounds = [DEFAULT_MAX_POINTS] + ([None] if n <= 1_000_000 else [])
            for bound in bounds:
                t_dict = t_base = float("inf")
                for _ in range(3):          # alternating: baseline, export
                    t = time.perf_counter()
                    trace.summary()
                    t_base = min(t_base, time.perf_counter() - t)
                    t = time.perf_counter()
                    obj = to_chrome_trace(trace, max_points=bound)
                    t_dict = min(t_dict, time.perf_counter() - t)
                points = sum(sum(d["points"].values())
                             for d in obj["otherData"]["gpudash"]["devices"])
                del obj
                sizes, secs = [], []
                for name in ("out.json", "out.json.gz"):
                    path = os.path.join(tmp, name)
                    t = time.perf_counter()
                    write_chrome_trace(trace, path, max_points=bound, overwrite=True)
                    secs.append(time.perf_counter() - t)
                    sizes.append(os.path.getsize(path))
                rows.append((n, bound, t_base, t_dict, secs[0], secs[1], points, sizes[0],
                             sizes[1]))
            del trace
    print(f"{'events':>12} {'max_points':>10} {'summary s':>9} {'dict s':>7} {'ratio':>6} "
          f"{'json s':>7} {'json.gz s':>9} {'points':>10} {'json MB':>8} {'gz MB':>7}")
    for n, bound, base, a, b, c, p, s1, s2 in rows:
        print(f"{n:>12,} {bound if bound else 'none':>10} {base:>9.2f} {a:>7.2f} "
              f"{a / base:>6.1f} {b:>7.2f} {c:>9.2f} {p:>10,} {s1 / 1e6:>8.1f} {s2 / 1e6:>7.1f}")


if __name__ == "__main__":
    main()
