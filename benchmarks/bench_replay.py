"""Replay throughput (trace events per second) and state-scrubbing latency.

Part 1 replays synthetic traces of about 1,000,000 events (``training_loop`` and
``fragmentation_stress``) with the default settings (16 GiB, TensorFlow's limit rule, growth),
with and without recording, and with per-call sampling off. Part 2 measures
:class:`gpudash.analysis.StateScrubber` on a 100,000-event trace: the first pass to the end
(which builds the checkpoints), then random jumps back and forth (state of the allocator as
a full ``MemoryDump``) and small steps.

Run: ``python benchmarks/bench_replay.py [--events N] [--scrub-events M] [--repeat R]``.
Prints two tables; the best of ``R`` runs is kept.
"""

from __future__ import annotations

import argparse
import random
import time

from gpudash.analysis import StateScrubber
from gpudash.trace.replay import replay
from gpudash.workloads import fragmentation_stress, training_loop


def traces(events: int) -> dict:
    # training_loop: ~200 events per step (12 layers); fragmentation_stress: ~6.4 per round
    return {
        "training_loop": training_loop(steps=max(1, events // 200)),
        "fragmentation_stress": fragmentation_stress(rounds=max(1, int(events / 6.37))),
    }


def bench_replay(events: int, repeat: int) -> None:
    print(f"{'trace':<22}{'events':>11}{'record':>8}{'per_call':>10}{'seconds':>10}"
          f"{'events/s':>12}")
    for name, t in traces(events).items():
        for record, per_call in ((False, True), (True, True), (False, False)):
            best = None
            for _ in range(repeat):
                r = replay(t, record=record, per_call=per_call)
                if best is None or r.elapsed_s < best.elapsed_s:
                    best = r
            print(f"{name:<22}{best.events:>11,}{'yes' if record else 'no':>8}"
                  f"{'yes' if per_call else 'no':>10}{best.elapsed_s:>10.3f}"
                  f"{best.events_per_second:>12,.0f}")


def bench_scrub(events: int, checkpoint_every: int | None) -> None:
    t = fragmentation_stress(rounds=max(1, int(events / 6.37)))
    n = len(t)
    sc = StateScrubber(t, checkpoint_every=checkpoint_every)
    t0 = time.perf_counter()
    sc.state_at(n - 1)
    first = time.perf_counter() - t0
    rng = random.Random(0)
    jumps = []
    for _ in range(50):
        i = rng.randrange(n)
        t0 = time.perf_counter()
        sc.state_at(i)
        jumps.append(time.perf_counter() - t0)
    steps = []
    i = n // 2
    for _ in range(50):
        i = min(n - 1, max(0, i + rng.choice((-1, 1)) * rng.randrange(1, 20)))
        t0 = time.perf_counter()
        sc.state_at(i)
        steps.append(time.perf_counter() - t0)
    jumps.sort()
    steps.sort()
    chunks = len(sc.state_at(n // 2).chunks)
    print()
    print(f"StateScrubber on fragmentation_stress: {n:,} events, {sc.calls:,} calls, "
          f"~{chunks:,} chunks, checkpoint_every={sc.checkpoint_every}")
    print(f"{'move':<34}{'median ms':>10}{'p90 ms':>10}{'max ms':>10}")
    print(f"{'first pass to the end':<34}{first * 1e3:>10.1f}{'':>10}{'':>10}")
    for label, xs in (("random jump (back or forth)", jumps), ("step of 1-20 events", steps)):
        print(f"{label:<34}{xs[len(xs) // 2] * 1e3:>10.1f}{xs[int(len(xs) * 0.9)] * 1e3:>10.1f}"
              f"{xs[-1] * 1e3:>10.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--scrub-events", type=int, default=100_000)
    parser.add_argument("--checkpoint-every", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    bench_replay(args.events, args.repeat)
    bench_scrub(args.scrub_events, args.checkpoint_every)


if __name__ == "__main__":
    main()
