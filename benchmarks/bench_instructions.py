"""Instructions per allocate+free pair under callgrind: a noise-free companion to
``bench_ratios.py`` (whose timings move with whatever else the machine runs).

Each configuration of ``bench_ratios.py`` (bare, session, recorder, reference; and ``torch``,
PyTorch's caching allocator on the same calls) runs under
``valgrind --tool=callgrind`` twice, with ``--pairs`` and with twice as many; the difference
of the two instruction counts, divided by the extra pairs, is what one pair costs (start-up
and imports cancel out). Needs valgrind; takes a few minutes.

Run: ``python benchmarks/bench_instructions.py [--pairs N] [--only bare,session]``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = ("bare", "session", "recorder", "reference", "torch")

ONE = r"""
import sys
sys.path.insert(0, sys.argv[1])
from bench_ratios import LIMIT, make_workload, run
import gpudash
from gpudash import BFCAllocator, CachingAllocator, Recorder, SimulatedDevice
from reference_bfc import ReferenceBFC
config, pairs = sys.argv[2], int(sys.argv[3])
steps = make_workload(pairs)
if config == "bare":
    a = BFCAllocator(SimulatedDevice("16GiB"), LIMIT, allow_growth=True)
    run(a.allocate, a.deallocate, steps)
elif config == "session":
    with gpudash.Session(simulate="16GiB", config={"allow_growth": True}) as sess:
        run(sess.allocate, sess.free, steps)
elif config == "recorder":
    a = BFCAllocator(SimulatedDevice("16GiB"), LIMIT, allow_growth=True)
    rec = Recorder(a, capacity=4 * pairs + 1000)
    run(a.allocate, a.deallocate, steps)
    rec.detach()
elif config == "torch":
    a = CachingAllocator(SimulatedDevice("16GiB"))
    run(a.allocate, a.deallocate, steps)
else:
    r = ReferenceBFC(LIMIT)
    run(r.allocate, r.deallocate, steps)
"""


def instructions(config: str, pairs: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             sys.executable, "-c", ONE, str(HERE), config, str(pairs)],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{config}: valgrind failed:\n{proc.stderr[-2000:]}")
        m = re.search(r"Collected\s*:\s*(\d+)", proc.stderr)
        if m is None:
            raise SystemExit(f"{config}: no instruction count in valgrind's output")
        return int(m.group(1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=20_000)
    ap.add_argument("--only", default=",".join(CONFIGS))
    args = ap.parse_args(argv)
    per_pair = {}
    for config in args.only.split(","):
        lo = instructions(config, args.pairs)
        hi = instructions(config, 2 * args.pairs)
        per_pair[config] = (hi - lo) / args.pairs
        print(f"{config:<10} {per_pair[config]:>10,.0f} instructions per pair", flush=True)
    if "bare" in per_pair:
        b = per_pair["bare"]
        if "session" in per_pair:
            print(f"session / bare (speed)      {b / per_pair['session']:.2f}")
        if "recorder" in per_pair:
            print(f"recorder cost               {per_pair['recorder'] / b:.2f}x")
        if "reference" in per_pair:
            print(f"bare / reference (speed)    {per_pair['reference'] / b:.2f}")
        if "torch" in per_pair:
            print(f"PyTorch's model / BFC       {per_pair['torch'] / b:.2f}x")


if __name__ == "__main__":
    main()
