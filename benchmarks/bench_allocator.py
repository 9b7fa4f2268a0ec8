"""Allocator throughput: allocate+free pairs per second on a fixed mixed workload.

Sizes run from 1 B to 64 MiB (log-uniform, so most are small), a few hundred blocks stay
live, and each step frees one live block at random and allocates a new one. The workload is
generated once (seeded) and replayed for each configuration:

- no subscriber,
- a no-op per-event subscriber (``alloc.subscribe(lambda e: None)``),
- the Recorder (columnar buffer).

Run: ``python benchmarks/bench_allocator.py [--pairs N] [--repeat R]``. Prints one table.
"""

from __future__ import annotations

import argparse
import random
import time

from gpudash import BFCAllocator, Recorder
from gpudash.devices import SimulatedDevice


def make_workload(pairs: int, live: int = 300, seed: int = 7) -> list[tuple[int, int]]:
    """(slot, nbytes) steps: free whatever sits in ``slot`` (if any), then allocate."""
    rng = random.Random(seed)
    steps = []
    for _ in range(pairs):
        nbytes = int(2 ** rng.uniform(0, 26))  # 1 B .. 64 MiB, log-uniform
        steps.append((rng.randrange(live), nbytes))
    return steps


def run(steps: list[tuple[int, int]], mode: str, live: int = 300) -> float:
    device = SimulatedDevice(64 << 30)
    alloc = BFCAllocator(device, 32 << 30, allow_growth=True)
    slots = [0] * live
    rec = None
    if mode == "no-op subscriber":
        alloc.subscribe(lambda event: None)
    elif mode == "recorder":
        rec = Recorder(alloc, capacity=2_000_000)
    allocate = alloc.allocate
    deallocate = alloc.deallocate
    t0 = time.perf_counter()
    for slot, nbytes in steps:
        deallocate(slots[slot])
        slots[slot] = allocate(nbytes)
    for p in slots:
        deallocate(p)
    if rec is not None:
        rec.flush()
    elapsed = time.perf_counter() - t0
    alloc.check()
    return len(steps) / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    steps = make_workload(args.pairs)
    modes = ["no subscriber", "no-op subscriber", "recorder"]
    best = {}
    for mode in modes:
        best[mode] = max(run(steps, mode) for _ in range(args.repeat))
    base = best["no subscriber"]
    print(f"{'mode':<18} {'pairs/s':>12} {'vs none':>8}")
    for mode in modes:
        print(f"{mode:<18} {best[mode]:>12,.0f} {best[mode] / base:>8.2f}")


if __name__ == "__main__":
    main()
