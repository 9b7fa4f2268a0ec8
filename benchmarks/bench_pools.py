"""PyTorch's model with many cached blocks of one size, and with a new segment per request.

- **Cached blocks of one size.** ``--cached N`` blocks of 30 MiB are allocated and freed,
  then allocated again from the cache; and 2N blocks of 512 bytes, every other one freed (no
  merges), then N allocated again. The time per allocation should not grow with N: the
  compiled pools keep a bin of more than 256 entries sorted.
- **A new segment per request.** 2,000 allocations of 30 MiB on an empty allocator: each is a
  cudaMalloc on the simulated device, which the compiled model places without Python.

Best of ``--repeat`` runs, microseconds per allocation; the compiled core and, with
``--pure``, the pure-Python model in a second process.

Run: ``python benchmarks/bench_pools.py [--cached 1000,4000,16000] [--repeat 5] [--pure]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

MIB = 1 << 20


def _best(fn, repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def cached_large(n: int) -> float:
    from gpudash import CachingAllocator, SimulatedDevice

    a = CachingAllocator(SimulatedDevice(f"{(n * 30 >> 10) + 4}GiB"))
    ptrs = [a.allocate(30 * MIB) for _ in range(n)]
    for p in ptrs:
        a.deallocate(p)
    t = time.perf_counter()
    for _ in range(n):
        a.allocate(30 * MIB)
    return (time.perf_counter() - t) / n * 1e6


def cached_small(n: int) -> float:
    from gpudash import CachingAllocator, SimulatedDevice

    a = CachingAllocator(SimulatedDevice("80GiB"))
    ptrs = [a.allocate(512) for _ in range(2 * n)]
    for p in ptrs[::2]:
        a.deallocate(p)
    t = time.perf_counter()
    for _ in range(n):
        a.allocate(512)
    return (time.perf_counter() - t) / n * 1e6


def new_segments(n: int = 2000) -> float:
    from gpudash import CachingAllocator, SimulatedDevice

    a = CachingAllocator(SimulatedDevice("80GiB"))
    t = time.perf_counter()
    for _ in range(n):
        a.allocate(30 * MIB)
    return (time.perf_counter() - t) / n * 1e6


def run(sizes: list[int], repeat: int) -> None:
    from gpudash import _accel

    print(f"allocator core: {_accel.describe()}")
    print(f"{'cached blocks':>14}{'30 MiB (us)':>14}{'512 B (us)':>13}")
    for n in sizes:
        print(f"{n:>14,}{_best(lambda: cached_large(n), repeat):>14.3f}"
              f"{_best(lambda: cached_small(n), repeat):>13.3f}", flush=True)
    print(f"a new 30 MiB segment per allocation: {_best(new_segments, repeat):.3f} us")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cached", default="1000,4000,16000",
                        help="numbers of cached blocks, comma-separated")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pure", action="store_true",
                        help="also run the pure-Python model (a second process)")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.cached.split(",") if x.strip()]
    run(sizes, args.repeat)
    if args.pure:
        print()
        env = dict(os.environ, GPUDASH_PURE_PYTHON="1")
        subprocess.run([sys.executable, __file__, "--cached", args.cached,
                        "--repeat", str(args.repeat)], env=env, check=True)


if __name__ == "__main__":
    main()
