"""Install mode's hot path: ns per alloc/free pair through the C entry points PyTorch's
CUDAPluggableAllocator calls (gpudash_torch_malloc / gpudash_torch_free), over host memory.

A C loop drives the pair (ctypes' own cost, about 1 us a call, would hide the allocator's);
the sizes cycle through a small-pool and a large-pool mix with one tensor in 8 kept live,
so blocks split and merge. Also the same pairs through ctypes, one thread and four. Each
allocator install mode runs: ``torch`` (PyTorch's caching allocator) and ``bfc``
(TensorFlow's, growth on, a 8 GiB limit). Then what the dashboard's refresh reads of the
installed allocator (its feed's ``sample()``: the figures and every block, as numpy columns
read in C) with 1,000 to 40,000 live blocks, against the same blocks as Python tuples.

    python benchmarks/bench_install.py [--pairs 2000000] [--allocator torch|bfc|both]
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time

from gpudash import _core as core
from gpudash.torch_install import load_hooks


SIZES = (512, 4096, 65536, 300_000, 2 << 20, 6 << 20, 24 << 20, 1000)


def through_ctypes(lib: ctypes.CDLL, pairs: int) -> float:
    keep = []
    t0 = time.perf_counter_ns()
    for i in range(pairs):
        n = SIZES[i & 7]
        p = lib.gpudash_torch_malloc(n, 0, None)
        if i & 7 == 0:
            keep.append((p, n))
            if len(keep) > 64:
                q, m = keep.pop(0)
                lib.gpudash_torch_free(q, m, 0, None)
        else:
            lib.gpudash_torch_free(p, n, 0, None)
    dt = time.perf_counter_ns() - t0
    for q, m in keep:
        lib.gpudash_torch_free(q, m, 0, None)
    return dt / pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2_000_000)
    ap.add_argument("--allocator", choices=("torch", "bfc", "both"), default="both")
    args = ap.parse_args()
    for allocator in (("torch", "bfc") if args.allocator == "both" else (args.allocator,)):
        run(allocator, args.pairs)


def run(allocator: str, pairs: int) -> None:
    core.pluggable_setup("host", total=8 << 30, on_oom="null", allocator=allocator)
    lib = load_hooks()
    lib.gpudash_torch_init(1)
    print(f"allocator={allocator!r}")
    ns = core.pluggable_bench(pairs)
    print(f"C loop:          {ns:8.1f} ns per alloc/free pair ({pairs:,} pairs)")
    n = max(pairs // 20, 1000)
    print(f"ctypes, 1 thread:{through_ctypes(lib, n):8.1f} ns per pair ({n:,} pairs)")
    out = []
    threads = [threading.Thread(target=lambda: out.append(through_ctypes(lib, n // 4)))
               for _ in range(4)]
    t0 = time.perf_counter_ns()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = (time.perf_counter_ns() - t0) / (n // 4 * 4)
    print(f"ctypes, 4 threads: {wall:6.1f} ns per pair, wall clock over all pairs")
    core.pluggable_empty_cache(-1)
    s = core.pluggable_state(0)
    assert s["stats"]["allocation"][0] == 0 and s["reserved"] == 0, s
    refresh_reads(lib, allocator)


def refresh_reads(lib: ctypes.CDLL, allocator: str) -> None:
    import statistics
    from types import SimpleNamespace

    from gpudash import torch_install
    from gpudash.testing import StandInTorch

    torch = StandInTorch()
    torch.cuda.is_initialized = lambda: False
    torch.cuda.memory = SimpleNamespace(CUDAPluggableAllocator=lambda *a: a,
                                        change_current_allocator=lambda a: None)
    core.pluggable_setup("host", total=8 << 30, on_oom="null", allocator=allocator)
    handle = torch_install.install(allocator, torch=torch, backend="host", total=8 << 30,
                                   on_oom="null", quiet=True)
    feed = handle.feed(0)
    live = []
    print(f"{'live blocks':>12} {'sample() ms':>12} {'as tuples ms':>13}")
    try:
        for target in (1_000, 10_000, 40_000):
            while len(live) < target:
                n = 512 * (1 + len(live) % 31)
                live.append((lib.gpudash_torch_malloc(n, 0, None), n))
            times = {}
            for name, fn in (("sample", feed.sample),
                             ("rows", lambda: core.pluggable_state(0, "rows"))):
                ts = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                times[name] = statistics.median(ts) * 1e3
            print(f"{target:>12,} {times['sample']:>12.2f} {times['rows']:>13.2f}")
    finally:
        for p, n in live:
            lib.gpudash_torch_free(p, n, 0, None)
        torch_install._reset_for_tests()
        core.pluggable_empty_cache(-1)


if __name__ == "__main__":
    main()
