"""Differential fuzz: install mode's C hooks against the Python models, at scale.

Install mode runs PyTorch's allocations on C twins of gpudash's models (``gpudash/_csrc/
pluggable.pxi``: no GIL on the path). This drives the hooks through ``ctypes``, as PyTorch's
loader calls them (``gpudash_torch_malloc``, the 4-argument ``gpudash_torch_free``,
``gpudash_torch_reset``, ``gpudash_torch_memory_fraction``), over host memory, and the same
calls on the Python model over the same segments (``gpudash.caching.CachingAllocator`` for
``torch``, ``gpudash.bfc.BFCAllocator`` for ``bfc``). Every allocation must return the same
address (or both refuse), and every ``--check-every`` operations the statistics must be
equal (PyTorch's ``memory_stats()``; the BFC's bytes in use, pool and chunk table).

The number of live blocks swings between a few and ``--max-live`` (30,000 by default), so
the C core's block records grow through several doublings and move while blocks split:
what the tests' 1,500-call runs never reach. Operations: allocations (nine in ten small,
splitting 2 MiB segments, the rest log-uniform up to 96 MiB; PyTorch's model on two
streams), frees of random live blocks, ``empty_cache()``, the fraction hook (PyTorch's) or the BFC's limit, live, up and
down, ``max_split_size_mb`` (PyTorch's model; never lowered where install mode refuses it,
``TORCH.split_hazard``) and growth (the BFC's).

Run: ``python benchmarks/fuzz_install.py [--allocator torch|bfc|both] [--ops N] [--seed S]``.
Prints one line per allocator; exits 1 at the first difference, naming the operation.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time


from gpudash import _core as core
from gpudash.bfc import BFCAllocator
from gpudash.caching import CachingAllocator
from gpudash.models import TORCH
from gpudash.testing import InstalledSegments
from gpudash.torch_install import load_hooks, memory_stats_of

MiB = 1 << 20
TOTAL = 16 << 30


class Mismatch(AssertionError):
    pass


def _size(rng: random.Random) -> int:
    if rng.random() < 0.9:
        return 256 * rng.randint(1, 64)                       # small: splits 2 MiB segments
    return int(math.exp(rng.uniform(math.log(512), math.log(96 * MiB))))


def fuzz(allocator: str, ops: int, seed: int, max_live: int = 30_000,
         check_every: int = 2_000) -> int:
    """Drive both sides with ``ops`` seeded operations; the operations run. Raises
    :class:`Mismatch` at the first difference."""
    rng = random.Random(seed)
    bfc = allocator == "bfc"
    core.pluggable_empty_cache(-1)
    core.pluggable_setup("host", total=TOTAL, on_oom="null", allocator=allocator,
                         allow_growth=True)
    lib = load_hooks()
    lib.gpudash_torch_init(1)
    sub = InstalledSegments(TOTAL)
    if bfc:
        limit = TOTAL // 2
        core.pluggable_settings(0, memory_limit=limit)
        model = BFCAllocator(sub, limit, allow_growth=True)
    else:
        model = CachingAllocator(sub)
    live: list[tuple[int, int, int]] = []
    streams = (0,) if bfc else (0, 0, 0, 0x7000)     # the BFC tells no streams apart
    target = rng.randint(10, max_live)
    growth = True

    def check(op: int, what: str) -> None:
        s = core.pluggable_state(0, "columns")
        if bfc:
            t = model.chunk_table()
            mine = (int(s["stats"]["allocated_bytes"][0]), int(s["reserved"]),
                    s["blocks"]["ptr"].tolist(), s["blocks"]["aid"].tolist())
            theirs = (model.stats().bytes_in_use, model.pool_bytes, t["ptr"].tolist(),
                      t["alloc_id"].tolist())
            if mine != theirs:
                raise Mismatch(f"op {op} ({what}): C in use/pool {mine[:2]}, Python "
                               f"{theirs[:2]}; chunks equal: {mine[2:] == theirs[2:]}")
        else:
            ours = memory_stats_of(core.pluggable_state(0, None))
            want = model.memory_stats()
            diff = {k: (ours.get(k), want.get(k)) for k in set(ours) | set(want)
                    if ours.get(k) != want.get(k)}
            if diff:
                raise Mismatch(f"op {op} ({what}): memory_stats differ: "
                               f"{dict(sorted(diff.items())[:6])}")

    for op in range(ops):
        r = rng.random()
        if len(live) >= target or (live and r < 0.3):
            k = rng.randrange(len(live))
            live[k], live[-1] = live[-1], live[k]
            burst = rng.randint(1, 200) if len(live) >= target else 1
            for _ in range(min(burst, len(live))):
                ptr, n, stream = live.pop()
                lib.gpudash_torch_free(ptr, n, 0, stream or None)
                model.deallocate(ptr)
            if len(live) < 10:
                target = rng.randint(10, max_live)
            what = "free"
        elif r < 0.302:
            lib.gpudash_torch_reset()
            if bfc:
                model.release_free_regions()
            else:
                model.empty_cache()
            what = "empty_cache"
        elif r < 0.304:
            if bfc:
                new = rng.choice([TOTAL // 8, TOTAL // 4, TOTAL // 2, TOTAL])
                core.pluggable_settings(0, memory_limit=new)
                model.set_memory_limit(new)
                what = f"limit {new}"
            else:
                f = rng.choice([0.05, 0.2, 0.5, 1.0])
                lib.gpudash_torch_memory_fraction(f, 0)
                model.set_memory_fraction(f)
                what = f"fraction {f}"
        elif r < 0.305:
            if bfc:
                growth = not growth
                core.pluggable_settings(0, allow_growth=growth)
                model.set_allow_growth(growth)
                what = f"growth {growth}"
            else:
                # as install mode allows it: not lowered live where a split segment's free
                # run would become oversize (TORCH.split_hazard)
                mss = rng.choice([None, 40, 100, 400])
                new = None if mss is None else mss * MiB
                old = core.pluggable_state(0, None)["max_split_size"]
                if TORCH.split_hazard(model.chunk_table(), old, new):
                    what = f"max_split_size_mb {mss} (refused: unsafe live)"
                else:
                    core.pluggable_settings(0, max_split_size=new)
                    model.set_allocator_settings("" if mss is None
                                                 else f"max_split_size_mb:{mss}")
                    what = f"max_split_size_mb {mss}"
        else:
            n = _size(rng)
            stream = rng.choice(streams)
            got = lib.gpudash_torch_malloc(n, 0, stream or None) or 0
            want = model.try_allocate(n) if bfc else model.try_allocate(n, stream=stream)
            if got != want:
                raise Mismatch(f"op {op}: malloc({n}) on stream {stream:#x} gave {got:#x} in "
                               f"C, {want:#x} in Python ({len(live):,} live blocks; seed "
                               f"{seed})")
            if got:
                live.append((got, n, stream))
            what = f"malloc({n}, stream {stream:#x})"
        if op % check_every == check_every - 1:
            check(op, what)
    check(ops, "end")
    for ptr, n, stream in live:
        lib.gpudash_torch_free(ptr, n, 0, stream or None)
        model.deallocate(ptr)
    lib.gpudash_torch_reset()
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allocator", choices=("torch", "bfc", "both"), default="both")
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-live", type=int, default=30_000)
    args = ap.parse_args()
    failed = False
    # the hooks print each out-of-memory refusal (as install mode does for PyTorch); the
    # fuzz makes thousands on purpose: their lines go to /dev/null
    import os

    quiet = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    os.dup2(quiet, 2)
    for allocator in (("torch", "bfc") if args.allocator == "both" else (args.allocator,)):
        t0 = time.perf_counter()
        try:
            n = fuzz(allocator, args.ops, args.seed, args.max_live)
            peak = core.pluggable_state(0, None)["stats"]["allocation"][1]
            print(f"{allocator}: {n:,} operations, 0 differences, at most {peak:,} live "
                  f"blocks, {time.perf_counter() - t0:.1f} s")
        except Mismatch as exc:
            failed = True
            print(f"{allocator}: DIFFERENCE: {exc}")
    os.dup2(saved, 2)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
