"""Shadow mode's cost (gpudash.torch.attach), on the torch stand-in that records history as
PyTorch 2.11 does (tests/torch_standin.ModelTorch), or on real PyTorch with ``--cuda``.

    python benchmarks/bench_shadow.py
    python benchmarks/bench_shadow.py --cuda          # on a GPU machine

(a) Refresh cost per 1,000 new history entries: a job makes N entries, then one refresh
    reads them; the refresh's time is split into PyTorch's ``_snapshot()`` call (which
    copies the whole ring into Python: PyTorch's cost, growing with ``--history``) and
    gpudash's (finding the new entries, feeding them through the exact model, stacks).
    Bar: gpudash's part <= 20 ms per 1,000 entries.
(b) A training loop allocating in a thread, the dashboard open on the shadow (its views at
    ``--rate`` Hz, sending to a comm that drops the messages): the views' updates sent per
    second with the loop running and without it (they must stay at the rate), the history
    reads per second, the slowest read, and the loop's steps per second without shadow mode
    and with it.
(c) The history ring's size: the time of one read of a full ring (PyTorch's ``_snapshot()``)
    by size, and the fastest job the reading thread follows without the ring wrapping
    between two reads, keeping to its budget (a read of t seconds, then at least 7t of
    waiting: an eighth of one core). What :data:`gpudash.torch_shadow.SHADOW_HISTORY_ENTRIES`
    is chosen from.
(d) A preview (what the dashboard says while the fraction slider is dragged, before the
    change is applied: the exact replay of the ring under the value): its time on a full
    ring of ``--history`` entries at three fractions, with the history read a drag shares
    (within ``PREVIEW_AGE``) and with a read of its own.

Prints four tables.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

MiB = 1 << 20


def _standin(total_gib: int = 16):
    from gpudash.testing import GiB, ModelTorch

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


def bench_thread(torch, alloc, free, history, rate, seconds, interval):
    """(steps/s, view updates/s, longest gap between two updates ms, reads/s, share of a
    core reading, slowest read ms, exact) by mode."""
    from gpudash.torch_shadow import attach
    from gpudash.widgets import Dashboard

    def loop(stop, count):
        kept: list = []
        k = 0
        while not stop.is_set():
            _step(alloc, free, kept, k)
            k += 1
        count.append(k)
        for t in kept:
            free(t)

    out = {}
    for mode in ("loop alone", "views alone", "loop + shadow"):
        shadow = dash = None
        if mode != "loop alone":
            shadow = attach(torch, interval=interval, history=history)
            dash = Dashboard(shadow, rate_hz=rate)
            dash._hellos = 1          # a page is showing it (the comm drops the messages)
            sends: list = []
            post = dash._post

            def timed(kind, content, buffers=None, post=post, sends=sends):
                if kind == "update":
                    sends.append(time.perf_counter())
                return post(kind, content, buffers)

            dash._post = timed
        stop = threading.Event()
        count: list = []
        t = threading.Thread(target=loop, args=(stop, count)) if mode != "views alone" \
            else None
        r0 = shadow.refreshes if shadow else 0
        u0 = dash.sent.get("update", [0])[0] if dash else 0
        t0 = time.perf_counter()
        if t is not None:
            t.start()
        time.sleep(seconds)
        dt = time.perf_counter() - t0       # the window: what the views and reads did in it
        u1 = dash.sent.get("update", [0])[0] if dash else 0
        r1 = shadow.refreshes if shadow else 0
        stop.set()
        if t is not None:
            t.join()
        steps = count[0] / (time.perf_counter() - t0) if count else 0.0
        if shadow is not None:
            updates = (u1 - u0) / dt
            gap = max(b - a for a, b in zip(sends, sends[1:])) * 1e3 if len(sends) > 1 \
                else float("nan")
            reads = (r1 - r0) / dt
            share = sum(shadow.refresh_seconds[-(r1 - r0):]) / dt if r1 > r0 else 0.0
            worst = max(shadow.refresh_seconds) * 1e3
            exact = shadow.devices[0].exact
            dash.close()
            shadow.stop()
        else:
            updates = reads = worst = share = gap = 0.0
            exact = None
        out[mode] = (steps, updates, gap, reads, share, worst, exact)
    return out


def bench_ring(torch, alloc, free, sizes, interval, pace=7.0):
    """(ring entries, read ms, fastest job followed in entries/s)."""
    from gpudash._gc import collector_paused

    rows = []
    kept: list = []
    for size in sizes:
        torch.cuda.memory._record_memory_history(enabled="all", context="all",
                                                 stacks="python", max_entries=size)
        k = 0
        while len(torch.cuda.memory._snapshot()["device_traces"][0]) < size:
            for _ in range(max(1, size // 200)):
                _step(alloc, free, kept, k)
                k += 1
        times = []
        for _ in range(3):
            with collector_paused():     # as shadow mode reads
                t0 = time.perf_counter()
                torch.cuda.memory._snapshot()
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        # the ring must hold what the job makes between two reads: read, then wait
        rows.append((size, t * 1e3, size / (t + max(interval, pace * t))))
        torch.cuda.memory._record_memory_history(enabled=None)
    for t in kept:
        free(t)
    return rows


def bench_preview(torch, alloc, free, history, rounds):
    import gpudash.torch_shadow as ts

    shadow = ts.attach(torch, interval=0, history=history)
    kept: list = []
    k = 0
    try:
        while len(torch.cuda.memory._snapshot()["device_traces"][0]) < history:
            _step(alloc, free, kept, k)
            k += 1
        shadow.refresh()
        rows = []
        for fraction in (0.001, 0.005, 0.9):
            shared, fresh = [], []
            text = ""
            for _ in range(rounds):
                shadow._snap_at = time.monotonic()          # the drag's shared read
                t0 = time.perf_counter()
                text = shadow.preview("per_process_gpu_memory_fraction", fraction)
                shared.append(time.perf_counter() - t0)
                shadow._snap_at = 0.0                       # too old: read again
                t0 = time.perf_counter()
                shadow.preview("per_process_gpu_memory_fraction", fraction)
                fresh.append(time.perf_counter() - t0)
            rows.append((fraction, statistics.median(shared) * 1e3, max(shared) * 1e3,
                         statistics.median(fresh) * 1e3, text.split(": ", 2)[-1][:70]))
        return rows
    finally:
        for t in kept:
            free(t)
        shadow.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="real PyTorch on a GPU")
    ap.add_argument("--history", type=int, default=None,
                    help="history ring entries (default: shadow mode's)")
    ap.add_argument("--refresh-history", type=int, default=100_000,
                    help="the ring of table (a): it must hold 50,000 new entries")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--interval", type=float, default=0.25,
                    help="seconds between history reads, at least")
    args = ap.parse_args()
    if args.history is None:
        from gpudash.torch_shadow import SHADOW_HISTORY_ENTRIES

        args.history = SHADOW_HISTORY_ENTRIES
    torch, alloc, free = _cuda() if args.cuda else _standin()
    where = "CUDA" if args.cuda else "the torch stand-in (gpudash's model as PyTorch 2.11)"
    print(f"(a) refresh cost on {where}, history ring {args.refresh_history:,} entries")
    print(f"{'new entries':>12} {'gpudash ms/1k':>14} {'_snapshot() ms':>15} {'exact':>6}"
          "   (nan: more new entries than the ring holds: it wrapped, the model was rebuilt)")
    for n, ms, snap, exact in bench_refresh(torch, alloc, free, args.refresh_history,
                                            (1_000, 10_000, 50_000), args.rounds):
        print(f"{n:>12,} {ms:>14.2f} {snap:>15.1f} {str(exact):>6}")
    print(f"\n(b) a training loop in a thread; the dashboard's views at {args.rate:g} Hz, "
          f"history read every >= {args.interval:g} s, {args.seconds:g} s each")
    print(f"{'mode':>14} {'steps/s':>9} {'view updates/s':>15} {'longest gap ms':>15} "
          f"{'reads/s':>8} {'reading share':>14} {'slowest read ms':>16} {'exact':>6}")
    for mode, (steps, updates, gap, reads, share, worst, exact) in bench_thread(
            torch, alloc, free, args.history, args.rate, args.seconds, args.interval).items():
        print(f"{mode:>14} {steps:>9.0f} {updates:>15.2f} {gap:>15.0f} {reads:>8.2f} "
              f"{share:>14.1%} {worst:>16.1f} {str(exact) if exact is not None else '-':>6}")
    print(f"\n(c) one read of a full history ring, and the fastest job followed without "
          f"the ring wrapping (reads every >= {args.interval:g} s, 7x a read's time between)")
    print(f"{'ring entries':>12} {'read ms':>9} {'job entries/s followed':>23}")
    for size, ms, rate in bench_ring(torch, alloc, free, (5_000, 10_000, 20_000, 50_000,
                                                           100_000), args.interval):
        print(f"{size:>12,} {ms:>9.1f} {rate:>23,.0f}")
    print(f"\n(d) a preview of the fraction slider on a full ring of {args.history:,} entries "
          "(the replay of the run so far under the value, nothing applied)")
    print(f"{'fraction':>9} {'shared read ms':>15} {'slowest ms':>11} {'fresh read ms':>14}  what it says")
    for frac, shared, worst, fresh, text in bench_preview(torch, alloc, free, args.history,
                                                         args.rounds):
        print(f"{frac:>9g} {shared:>15.1f} {worst:>11.1f} {fresh:>14.1f}  {text}")

if __name__ == "__main__":
    main()
