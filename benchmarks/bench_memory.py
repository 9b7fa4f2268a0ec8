"""Memory and time per event of big traces: load, replay, replay with recording, what-if.

A synthetic training trace of about ``--events`` events is written once as ``.gdtrace``;
each step then runs in fresh processes: one timed, one whose peak of traced allocations
(``tracemalloc``: Python objects and numpy arrays, from after the imports) is the step's
memory:

- ``load``: ``load_trace`` of the file;
- ``replay``: load, then ``replay`` without recording;
- ``replay+record``: load, then ``replay(record=True)``;
- ``min_fraction``: load, then ``min_fraction`` (the bisection of replays).

Run: ``python benchmarks/bench_memory.py [--events N]`` (default 1,000,000; 10,000,000 needs
several GB). Prints one table: seconds, extra peak memory, bytes per event, and the
timed process's maximum resident set (imports and interpreter included).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

STEP = r"""
import json, resource, sys, time, tracemalloc
import gpudash
from gpudash.trace import load_trace
from gpudash.trace.replay import replay
from gpudash.trace.whatif import min_fraction
path, step, trace_memory = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if trace_memory:
    tracemalloc.start()
t0 = time.perf_counter()
t = load_trace(path)
if step == "replay":
    replay(t, device_bytes="64GiB", record=False)
elif step == "replay+record":
    replay(t, device_bytes="64GiB", record=True)
elif step == "min_fraction":
    min_fraction(t, "64GiB", tolerance=0.01)
seconds = time.perf_counter() - t0
peak = tracemalloc.get_traced_memory()[1] if trace_memory else 0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
print(json.dumps({"seconds": seconds, "peak": peak, "rss": rss}))
"""


def _run(path: Path, step: str, trace_memory: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", STEP, str(path), step, "1" if trace_memory
                          else "0"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    from gpudash.trace import write_trace
    from gpudash.workloads import training_loop

    with tempfile.TemporaryDirectory(prefix="gpudash-mem-") as tmp:
        path = Path(tmp) / "big.gdtrace"
        steps, trace = 1, None
        while True:  # grow the workload until it has enough events
            trace = training_loop(steps=steps, layers=24, hidden=4096, seed=0)
            if len(trace) >= args.events:
                break
            steps = max(steps + 1, int(steps * 1.02 * args.events / max(len(trace), 1)) + 1)
        write_trace(trace, path)
        n = len(trace)
        del trace
        print(f"{n:,} events, {path.stat().st_size / 1e6:,.1f} MB on disk", flush=True)
        rows = []
        print(f"{'step (after import)':<22}{'seconds':>9}{'peak MB':>10}{'bytes/event':>13}"
              f"{'max RSS MB':>12}", flush=True)
        for step in ("load", "replay", "replay+record", "min_fraction"):
            timed = _run(path, step, False)
            peak = _run(path, step, True)["peak"]  # Python and numpy allocations
            print(f"{step:<22}{timed['seconds']:>9.1f}{peak / 1e6:>10,.0f}{peak / n:>13,.0f}"
                  f"{timed['rss'] / 1e6:>12,.0f}", flush=True)


if __name__ == "__main__":
    main()
