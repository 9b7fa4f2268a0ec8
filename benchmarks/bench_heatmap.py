"""Heatmap speed: a 1,000,000-event trace into a 512 x 1000 grid.

Times :func:`gpudash.analysis.heatmap` by event and by time, on a synthetic training trace
(few regions) and on a recorded-style trace (a replay's recording, with extend/split/merge
rows), and :class:`gpudash.analysis.HeatmapBuilder` fed in batches of 8,192 events.

Run: ``python benchmarks/bench_heatmap.py [--events N] [--rows R] [--cols C] [--repeat K]``.
Prints one table; the best of ``K`` runs is kept.
"""

from __future__ import annotations

import argparse
import time

from gpudash.analysis import HeatmapBuilder, heatmap
from gpudash.trace.replay import replay
from gpudash.workloads import fragmentation_stress, training_loop


def best_of(repeat: int, fn) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    synthetic = training_loop(steps=max(1, args.events // 200))
    # a recording has ~1.45 events per call: replay fewer calls to get as many events
    recorded = replay(fragmentation_stress(rounds=max(1, int(args.events / 9.2))),
                      per_call=False).recording
    print(f"{'trace':<26}{'events':>11}{'grid':>12}{'mode':>16}{'seconds':>10}")
    for name, t in (("training_loop", synthetic), ("recorded (replay)", recorded)):
        grid = f"{args.rows}x{args.cols}"
        for by in ("event", "time"):
            s = best_of(args.repeat, lambda: heatmap(t, rows=args.rows, cols=args.cols, by=by))
            print(f"{name:<26}{len(t):>11,}{grid:>12}{'heatmap ' + by:>16}{s:>10.3f}")
        space = [(p, sz) for p, sz, _ in heatmap(t, rows=1, cols=1).regions]
        per_col = max(1, len(t) // args.cols)

        def feed() -> None:
            b = HeatmapBuilder(args.rows, space, events_per_col=per_col)
            for i in range(0, len(t), 8192):
                b.add_events(t[i:i + 8192])

        s = best_of(args.repeat, feed)
        print(f"{name:<26}{len(t):>11,}{grid:>12}{'builder event':>16}{s:>10.3f}")


if __name__ == "__main__":
    main()
