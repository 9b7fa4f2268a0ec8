"""Shadow mode's cost (gpudash.torch.attach), on the torch stand-in that records history as
PyTorch 2.11 does (tests/torch_standin.ModelTorch), or on real PyTorch with ``--cuda``.

    python benchmarks/bench_shadow.py
    python benchmarks/bench_shadow.py --cuda          # on a GPU machine

(a) Refresh cost per 1,000 new history entries: a job makes N entries, then one refresh
    reads them; the refresh's time is split into PyTorch's ``_snapshot()`` call (which
    copies the whole ring into Python: PyTorch's cost, growing with ``--history``) and
    gpudash's (finding the new entries, feeding them through the exact model, stacks).
    Bar: gpudash's part <= 20 ms per 1,000 entries.
(b) A training loop allocating in a thread while the refresh thread runs at ``--rate`` Hz:
    the refreshes achieved per second, and the loop's steps per second with and without
    shadow mode.

Prints two tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

MiB = 1 << 20


def _standin(total_gib: int = 16):
    from torch_standin import GiB, ModelTorch

    torch = ModelTorch(total=total_gib * GiB)
    return torch, torch.allocate, torch.free


def _cuda():
    import torch

    def alloc(n, device=0):
        return torch.empty(n, dtype=torch.uint8, device="cuda")

    def free(t, device=0):
        del t

    return torch, alloc, free


def _step(alloc, free, kept, k):
    acts = [alloc((k % 7 + 1) * MiB + j * 4096) for j in range(8)]
    kept.append(acts.pop(3))
    if len(kept) > 64:
        free(kept.pop(0))
    for a in acts:
        free(a)


def bench_refresh(torch, alloc, free, history, sizes, rounds):
    from gpudash.torch_shadow import attach

    shadow = attach(torch, interval=0, history=history)
    real = torch.cuda.memory._snapshot
    spent = []

    def timed():
        t0 = time.perf_counter()
        try:
            return real()
        finally:
            spent.append(time.perf_counter() - t0)

    torch.cuda.memory._snapshot = timed
    rows = []
    kept: list = []
    try:
        for n in sizes:
            per = []
            snap = []
            for _ in range(rounds):
                made = 0
                k = 0
                before = shadow.devices[0].entries
                while made < n:
                    _step(alloc, free, kept, k)
                    k += 1
                    made += 17   # about 17 entries a step (8 allocs, 8 frees of 2 entries...)
                spent.clear()
                t0 = time.perf_counter()
                shadow.refresh()
                total = time.perf_counter() - t0
                fed = shadow.devices[0].entries - before
                own = total - sum(spent)
                # a ring that wrapped is rebuilt, not fed: its time is a resync's (nan here)
                per.append(own / fed * 1000 if fed >= n else float("nan"))
                snap.append(sum(spent))
            rows.append((n, statistics.median(per) * 1e3, statistics.median(snap) * 1e3,
                         shadow.devices[0].exact))
    finally:
        torch.cuda.memory._snapshot = real
        shadow.stop()
    return rows


def bench_thread(torch, alloc, free, history, rate, seconds):
    from gpudash.torch_shadow import attach

    def loop(stop, count):
        kept: list = []
        k = 0
        while not stop.is_set():
            _step(alloc, free, kept, k)
            k += 1
        count.append(k)

    out = {}
    for mode in ("off", "shadow"):
        shadow = attach(torch, interval=1.0 / rate, history=history) if mode == "shadow" \
            else None
        stop = threading.Event()
        count: list = []
        t = threading.Thread(target=loop, args=(stop, count))
        r0 = shadow.refreshes if shadow else 0
        t0 = time.perf_counter()
        t.start()
        time.sleep(seconds)
        stop.set()
        t.join()
        dt = time.perf_counter() - t0
        refreshes = (shadow.refreshes - r0) / dt if shadow else 0.0
        exact = shadow.devices[0].exact if shadow else None
        if shadow:
            worst = max(shadow.refresh_seconds) * 1e3
            shadow.stop()
        else:
            worst = 0.0
        out[mode] = (count[0] / dt, refreshes, worst, exact)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="real PyTorch on a GPU")
    ap.add_argument("--history", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    torch, alloc, free = _cuda() if args.cuda else _standin()
    where = "CUDA" if args.cuda else "the torch stand-in (gpudash's model as PyTorch 2.11)"
    print(f"(a) refresh cost on {where}, history ring {args.history:,} entries")
    print(f"{'new entries':>12} {'gpudash ms/1k':>14} {'_snapshot() ms':>15} {'exact':>6}"
          "   (nan: more new entries than the ring holds: it wrapped, the model was rebuilt)")
    for n, ms, snap, exact in bench_refresh(torch, alloc, free, args.history,
                                            (1_000, 10_000, 50_000), args.rounds):
        print(f"{n:>12,} {ms:>14.2f} {snap:>15.1f} {str(exact):>6}")
    print(f"\n(b) a training loop in a thread, refreshes at {args.rate:g} Hz, {args.seconds:g} s")
    print(f"{'mode':>8} {'steps/s':>10} {'refreshes/s':>12} {'worst refresh ms':>17} "
          f"{'exact':>6}")
    for mode, (steps, rate, worst, exact) in bench_thread(
            torch, alloc, free, args.history, args.rate, args.seconds).items():
        print(f"{mode:>8} {steps:>10.0f} {rate:>12.2f} {worst:>17.1f} {str(exact):>6}")


if __name__ == "__main__":
    main()
