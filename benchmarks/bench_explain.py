"""``gpudash explain --html`` on a large allocator dump: time, memory and report size.

Writes a synthetic ``MemoryDump`` protobuf (what ``TF_BFC_MEMORY_DUMP`` makes TensorFlow
write) with N chunks in a few regions (sizes 256 B to 1 MiB, about half of them in use), then
runs ``python -m gpudash explain DUMP --request 64MiB --limit ... --html OUT`` in a fresh
process and reports its wall time, its maximum resident set and the size of the HTML file.

Usage: python benchmarks/bench_explain.py [CHUNKS] [REPEATS]  (default 1,000,000 and 1).
Run it from the repository root (the command runs with this checkout on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def make_dump(path: str, n: int, seed: int = 0) -> int:
    """Write an n-chunk MemoryDump protobuf; returns its pool bytes (the regions' sum)."""
    sys.path.insert(0, str(ROOT))
    from gpudash.proto import bfc_memory_map_pb2

    rng = np.random.default_rng(seed)
    sizes = rng.choice([256, 1024, 4096, 65536, 1 << 20], size=n).astype(np.int64)
    in_use = rng.random(n) < 0.5
    in_use[np.flatnonzero(~in_use[:-1] & ~in_use[1:])] = True   # no two free chunks side by side
    regions = 8
    cut = np.linspace(0, n, regions + 1).astype(np.int64)
    addr = np.empty(n, dtype=np.int64)
    base = 0x7F0000000000
    for r in range(regions):   # each region a contiguous run, with a gap before the next
        part = sizes[cut[r]:cut[r + 1]]
        addr[cut[r]:cut[r + 1]] = base + np.concatenate([[0], np.cumsum(part)[:-1]])
        base += int(part.sum()) + (1 << 30)
    md = bfc_memory_map_pb2.MemoryDump(allocator_name="GPU_0_bfc")
    for a, s, u in zip(addr.tolist(), sizes.tolist(), in_use.tolist()):
        md.chunk.add(address=a, size=s, requested_size=s - 7 if u else 0, in_use=u,
                     op_name="MatMul" if u else "", bin=0)
    md.stats.bytes_in_use = int(sizes[in_use].sum())
    md.stats.num_allocs = int(in_use.sum())
    with open(path, "wb") as f:
        f.write(md.SerializeToString())
    return int(sizes.sum())


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "bench.memdump")
        t0 = time.perf_counter()
        pool = make_dump(dump, n)
        print(f"dump: {n:,} chunks, {os.path.getsize(dump) / 1e6:.1f} MB protobuf, made in "
              f"{time.perf_counter() - t0:.1f} s")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        out = os.path.join(tmp, "explain.html")
        cmd = [sys.executable, "-m", "gpudash", "explain", dump, "--request", "64MiB",
               "--limit", str(pool), "--device", "16GiB", "--html", out, "--overwrite"]
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            best = min(best, time.perf_counter() - t0)
            if proc.returncode != 0:
                sys.exit(f"explain failed ({proc.returncode}): {proc.stderr.strip()}")
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB -> MiB
        print(f"{'chunks':>10}  {'wall (best)':>11}  {'max RSS':>9}  {'HTML':>9}")
        print(f"{n:>10,}  {best:>9.1f} s  {rss:>5.0f} MiB  "
              f"{os.path.getsize(out) / 1e6:>6.2f} MB")


if __name__ == "__main__":
    main()
