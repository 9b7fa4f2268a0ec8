"""The compiled allocator core against the pure-Python models, side by side in one run:
replay throughput and ``min_fraction`` wall time, the figures the core's targets name.

Each measure runs in a fresh process, once with the compiled core and (with ``--pure``) once
with ``GPUDASH_PURE_PYTHON=1``; the traces are made in that process and not timed:

- ``replay``: ``replay(trace, device_bytes="16GiB", record=False)`` of ``training_loop`` and
  ``fragmentation_stress`` (``--events`` events, default 1,000,000), events/s, best of 2;
- ``min_fraction``: the bisection (tolerance 0.005: 9 fractions, fewer replays where a
  replay's limit floor answers some) on the same traces at ``--events`` and at ``--big``
  events (default 10,000,000; 0 leaves it out), seconds, with the replays run and the
  fractions known without one; ``min_fraction/2``: the same with ``jobs=2`` (``--jobs``).

The instruction counts per allocate+free pair are ``bench_instructions.py``'s; PyTorch's
model against the BFC per event is ``bench_models.py``'s.

Run: ``python benchmarks/bench_core.py [--events N] [--big M] [--pure] [--jobs J]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ONE = r"""
import json, sys, time
from gpudash import _accel
from gpudash.trace.replay import replay
from gpudash.trace.whatif import min_fraction
from gpudash.workloads import fragmentation_stress, training_loop
what, name, events, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t = (training_loop(steps=max(1, events // 200)) if name == "training_loop"
     else fragmentation_stress(rounds=max(1, int(events / 6.37))))
if what == "replay":
    best = min(replay(t, device_bytes="16GiB", record=False).elapsed_s for _ in range(2))
    value = len(t) / best
else:
    t0 = time.perf_counter()
    m = min_fraction(t, "16GiB", jobs=jobs)
    value = time.perf_counter() - t0
    note = f"{m.replays} replays, {m.known} known"
print(json.dumps({"value": value, "events": len(t), "core": _accel.describe(),
                  "note": note if what == "min_fraction" else ""}))
"""


def measure(what: str, name: str, events: int, pure: bool, jobs: int = 1) -> dict:
    env = dict(os.environ)
    env.pop("GPUDASH_PURE_PYTHON", None)
    if pure:
        env["GPUDASH_PURE_PYTHON"] = "1"
    out = subprocess.run([sys.executable, "-c", ONE, what, name, str(events), str(jobs)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--big", type=int, default=10_000_000)
    ap.add_argument("--pure", action="store_true", help="also run the pure-Python models")
    ap.add_argument("--jobs", type=int, default=2,
                    help="also run min_fraction with this many worker processes (1: not)")
    args = ap.parse_args(argv)
    rows = [("replay", name, args.events, 1)
            for name in ("training_loop", "fragmentation_stress")]
    for n in (args.events, args.big):
        if n:
            rows += [("min_fraction", name, n, j)
                     for j in sorted({1, max(1, args.jobs)})
                     for name in ("training_loop", "fragmentation_stress")]
    head = f"{'measure':<16}{'trace':<22}{'events':>12}{'compiled':>16}"
    print(head + (f"{'pure Python':>16}{'speed-up':>10}" if args.pure else ""), flush=True)
    core = None
    for what, name, n, jobs in rows:
        if args.pure and jobs > 1:
            continue
        fast = measure(what, name, n, False, jobs)
        core = fast["core"]
        unit = (lambda v: f"{v:,.0f} ev/s") if what == "replay" else (lambda v: f"{v:.2f} s")
        label = what if jobs == 1 else f"{what}/{jobs}"
        line = f"{label:<16}{name:<22}{fast['events']:>12,}{unit(fast['value']):>16}"
        if args.pure:
            slow = measure(what, name, n, True)
            gain = (fast["value"] / slow["value"] if what == "replay"
                    else slow["value"] / fast["value"])
            line += f"{unit(slow['value']):>16}{gain:>9.1f}x"
        if fast["note"]:
            line += f"  ({fast['note']})"
        print(line, flush=True)
    print(f"core: {core}")


if __name__ == "__main__":
    main()
