"""Speed as ratios measured side by side in one process (absolute figures depend on the
machine; ratios much less).

One seeded workload of allocate+free pairs (sizes 1 B .. 4 MiB, log-uniform; 300 slots,
each step frees what a random slot holds and allocates a new block there) runs, interleaved
``--repeat`` times, through:

- ``bare``: :class:`gpudash.BFCAllocator` with no listener;
- ``session``: :meth:`gpudash.Session.allocate` / :meth:`~gpudash.Session.free` on a
  simulated device, deferred deletion on (TensorFlow's default 8 MiB; frees reach the
  allocator in batches, each returned by the free that completes it);
- ``session+stacks``: the same with ``record_stacks=True`` (each block's allocating frame);
- ``recorder``: the bare allocator with a :class:`gpudash.Recorder` attached;
- ``reference``: ``reference_bfc.ReferenceBFC``, a plain Python BFC with no hooks.

It prints the median pairs/s of each and the ratios the project tracks: session / bare
(target >= 0.8), bare / recorder time (the recorder's cost, target <= 1.25) and bare /
reference (target >= 2.5).

Run: ``python benchmarks/bench_ratios.py [--pairs N] [--repeat R] [--only bare,recorder]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpudash  # noqa: E402
from gpudash import BFCAllocator, Recorder, SimulatedDevice  # noqa: E402
from reference_bfc import ReferenceBFC  # noqa: E402

LIMIT = 8 << 30
CONFIGS = ("bare", "session", "session+stacks", "recorder", "reference")


def make_workload(pairs: int, live: int = 300, seed: int = 7) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randrange(live), int(2 ** rng.uniform(0, 22))) for _ in range(pairs)]


def run(allocate, free, steps, live: int = 300) -> float:
    slots = [0] * live
    t0 = time.perf_counter()
    for slot, nbytes in steps:
        p = slots[slot]
        if p:
            free(p)
        slots[slot] = allocate(nbytes)
    for p in slots:
        if p:
            free(p)
    return len(steps) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", default=",".join(CONFIGS),
                    help="the configurations to run, comma-separated (bare always runs)")
    args = ap.parse_args(argv)
    only = {c for c in args.only.split(",") if c} | {"bare"}
    unknown = only - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configuration(s) {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    steps = make_workload(args.pairs)
    rates: dict[str, list[float]] = {c: [] for c in CONFIGS if c in only}
    for _ in range(args.repeat):
        a = BFCAllocator(SimulatedDevice("16GiB"), LIMIT, allow_growth=True)
        rates["bare"].append(run(a.allocate, a.deallocate, steps))
        if "session" in only:
            with gpudash.Session(simulate="16GiB", config={"allow_growth": True}) as sess:
                rates["session"].append(run(sess.allocate, sess.free, steps))
        if "session+stacks" in only:
            with gpudash.Session(simulate="16GiB", config={"allow_growth": True},
                                 record_stacks=True) as sess:
                rates["session+stacks"].append(run(sess.allocate, sess.free, steps))
        if "recorder" in only:
            a = BFCAllocator(SimulatedDevice("16GiB"), LIMIT, allow_growth=True)
            rec = Recorder(a, capacity=4 * args.pairs + 1000)
            rates["recorder"].append(run(a.allocate, a.deallocate, steps))
            rec.detach()
        if "reference" in only:
            r = ReferenceBFC(LIMIT)
            rates["reference"].append(run(r.allocate, r.deallocate, steps))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{'configuration':<15} {'pairs/s (median)':>18}   runs")
    for k, v in med.items():
        print(f"{k:<15} {v:>18,.0f}   {', '.join(f'{x:,.0f}' for x in rates[k])}")
    print()
    if "session" in med:
        print(f"session / bare          {med['session'] / med['bare']:.2f}   (target >= 0.8)")
    if "session+stacks" in med and "session" in med:
        print(f"record_stacks cost      {med['session'] / med['session+stacks']:.2f}x  "
              "(session time with vs without)")
    if "recorder" in med:
        print(f"recorder cost           {med['bare'] / med['recorder']:.2f}x  (target <= 1.25)")
    if "reference" in med:
        print(f"bare / reference BFC    {med['bare'] / med['reference']:.2f}   (target >= 2.5)")


if __name__ == "__main__":
    main()
