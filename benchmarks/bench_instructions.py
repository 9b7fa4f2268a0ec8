"""Instructions per allocate+free pair under callgrind: a noise-free companion to
``bench_ratios.py`` (whose timings move with whatever else the machine runs).

Each configuration of ``bench_ratios.py`` (bare, session, recorder, reference; and ``torch``,
PyTorch's caching allocator on the same calls) runs under
``valgrind --tool=callgrind`` twice: once running the workload of ``--pairs`` pairs, once
running the same workload twice over, on the same allocator; the difference of the two
instruction counts, divided by the pairs, is what one pair costs (start-up, imports and
drawing the workload cancel out, so the harness varies little). Needs valgrind; takes a
few minutes.

Counts are deterministic (``PYTHONHASHSEED=0``, one OpenBLAS thread): run to run they
agree to the instruction. They move by about 10 a pair with ``--pairs`` (the allocators'
and Python's own memory are in other states), so compare configurations at one size.
Instructions are not time: a clock read through the kernel's vDSO or a page fault costs
far more time than its few counted instructions (see ``bench_ratios.py``).

That figure includes the harness: the loop that makes the two calls (about 780
instructions a pair on CPython 3.11). ``floor`` runs
the same harness with two built-in functions in place of allocate and free; the table's
``net`` column is a configuration's figure minus the floor: what the allocator itself
costs per pair, the figure to hold against the targets in the README.

The runs are also made with ``GPUDASH_PURE_PYTHON=1`` when ``--pure`` is given (the
pure-Python models side by side with the compiled core).

Run: ``python benchmarks/bench_instructions.py [--pairs N] [--only bare,session]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = ("floor", "bare", "session", "recorder", "reference", "torch")

ONE = r"""
import contextlib
import sys
sys.path.insert(0, sys.argv[1])
from bench_ratios import LIMIT, make_workload, run
import gpudash
from gpudash import BFCAllocator, CachingAllocator, Recorder, SimulatedDevice
from reference_bfc import ReferenceBFC
config, pairs, times = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
steps = make_workload(pairs)
with contextlib.ExitStack() as stack:
    if config == "floor":
        calls = (abs, id)
    elif config == "session":
        sess = stack.enter_context(
            gpudash.Session(simulate="16GiB", config={"allow_growth": True}))
        calls = (sess.allocate, sess.free)
    elif config == "torch":
        a = CachingAllocator(SimulatedDevice("16GiB"))
        calls = (a.allocate, a.deallocate)
    elif config == "reference":
        r = ReferenceBFC(LIMIT)
        calls = (r.allocate, r.deallocate)
    else:  # bare, recorder
        a = BFCAllocator(SimulatedDevice("16GiB"), LIMIT, allow_growth=True)
        calls = (a.allocate, a.deallocate)
        if config == "recorder":
            stack.callback(Recorder(a, capacity=4 * pairs * times + 1000).detach)
    for _ in range(times):
        run(*calls, steps)
"""


def instructions(config: str, pairs: int, times: int, pure: bool = False) -> int:
    # Deterministic counts: one hash seed, and no OpenBLAS threads (numpy starts them at
    # import; they spin for a while, and their instructions vary from run to run).
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("GPUDASH_PURE_PYTHON", None)
    if pure:
        env["GPUDASH_PURE_PYTHON"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             sys.executable, "-c", ONE, str(HERE), config, str(pairs), str(times)],
            capture_output=True, text=True, env=env)
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
    ap.add_argument("--pure", action="store_true",
                    help="also run the configurations on the pure-Python models")
    args = ap.parse_args(argv)
    configs = [c for c in args.only.split(",") if c]
    if "floor" not in configs:
        configs.insert(0, "floor")
    paths = [("", False)] + ([("pure ", True)] if args.pure else [])
    per_pair: dict[str, float] = {}
    print(f"{'configuration':<18}{'per pair':>12}{'net':>12}   (instructions)", flush=True)
    for label, pure in paths:
        for config in configs:
            if config == "floor" and label:
                continue
            lo = instructions(config, args.pairs, 1, pure)
            hi = instructions(config, args.pairs, 2, pure)
            name = label + config
            per_pair[name] = (hi - lo) / args.pairs
            net = per_pair[name] - per_pair["floor"] if config != "floor" else 0.0
            print(f"{name:<18}{per_pair[name]:>12,.0f}{net:>12,.0f}", flush=True)
    floor = per_pair["floor"]

    def net(name: str) -> float:
        return per_pair[name] - floor

    for label, _ in paths:
        b = label + "bare"
        if b not in per_pair:
            continue
        print(f"-- {label or 'compiled '}ratios (net of the harness; gross in brackets)")
        for other, text in (("session", "session / bare (cost)     "),
                            ("recorder", "recorder / bare (cost)    "),
                            ("torch", "PyTorch's model / BFC     ")):
            o = label + other
            if o in per_pair:
                print(f"{text} {net(o) / net(b):.2f}x  ({per_pair[o] / per_pair[b]:.2f}x)")
        r = label + "reference"
        if r in per_pair:
            print(f"bare / reference (speed)   {net(r) / net(b):.2f}   "
                  f"({per_pair[r] / per_pair[b]:.2f})")


if __name__ == "__main__":
    main()
