"""The two allocator models side by side: the same traces replayed through TensorFlow's BFC
and PyTorch's caching allocator, in one run.

For each synthetic trace (``training_loop``, ``fragmentation_stress``, ``finetune``: about
``--events`` events each) the replay runs through both models on the same simulated device
(80 GiB, no fraction, no recording, no per-call samples), alternating, best of ``--repeat``;
and a PyTorch snapshot of ``finetune`` (made by the model) is replayed exactly, with its
own addresses and fidelity checks, as ``replay(snapshot)`` does by default. The last column
is PyTorch's cost per event over BFC's (the goal is at most 1.5). ``--snapshots`` adds real
PyTorch snapshots (``torch.cuda.memory._dump_snapshot`` pickles), each replayed through both
models the same way (PyTorch's as a what-if, ``exact=False``).

Run: ``python benchmarks/bench_models.py [--events N] [--repeat R] [--snapshots PATH ...]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpudash.trace.replay import replay
from gpudash.formats.torch_snapshot import load_torch_snapshot
from gpudash.workloads import (
    caching_snapshot,
    finetune,
    finetune_calls,
    fragmentation_stress,
    training_loop,
)


def traces(events: int) -> dict:
    # events per unit: training_loop ~200 a step, fragmentation_stress ~6.4 a round,
    # finetune (24 layers) ~1,100 a step
    return {
        "training_loop": training_loop(steps=max(1, events // 200)),
        "fragmentation_stress": fragmentation_stress(rounds=max(1, int(events / 6.37))),
        "finetune": finetune(steps=max(1, events // 1100)),
    }


def best(trace, repeat: int, **kw):
    out = None
    for _ in range(repeat):
        r = replay(trace, record=False, per_call=False, device_bytes="80GiB", **kw)
        if out is None or r.elapsed_s < out.elapsed_s:
            out = r
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--snapshots", nargs="*", default=[], metavar="PATH",
                        help="PyTorch snapshot pickles to replay through both models too")
    args = parser.parse_args(argv)
    print(f"{'trace':<22}{'events':>10}{'BFC ev/s':>12}{'PyTorch ev/s':>14}"
          f"{'PyTorch/BFC':>13}")
    for name, t in traces(args.events).items():
        bfc = best(t, args.repeat, allocator="bfc")
        torch = best(t, args.repeat, allocator="torch")
        ratio = bfc.events_per_second / torch.events_per_second
        print(f"{name:<22}{bfc.events:>10,}{bfc.events_per_second:>12,.0f}"
              f"{torch.events_per_second:>14,.0f}{ratio:>12.2f}x")
    for path in args.snapshots:
        t = load_torch_snapshot(path)
        bfc = best(t, args.repeat, allocator="bfc")
        torch = best(t, args.repeat, allocator="torch", exact=False)
        ratio = bfc.events_per_second / torch.events_per_second
        name = Path(path).name[:21]
        print(f"{name:<22}{bfc.events:>10,}{bfc.events_per_second:>12,.0f}"
              f"{torch.events_per_second:>14,.0f}{ratio:>12.2f}x")
    steps = max(1, args.events // 1100)
    snap = load_torch_snapshot(caching_snapshot(finetune_calls(steps=steps),
                                                device_bytes="80GiB",
                                                max_entries=10 * args.events))
    exact = None
    for _ in range(args.repeat):
        r = replay(snap, record=False, per_call=False)
        if exact is None or r.elapsed_s < exact.elapsed_s:
            exact = r
    what = best(snap, args.repeat, allocator="torch", exact=False)
    print()
    print(f"finetune snapshot ({exact.events:,} events): exact replay "
          f"{exact.events_per_second:,.0f} events/s ({exact.fidelity.summary()}); "
          f"what-if replay {what.events_per_second:,.0f} events/s")


if __name__ == "__main__":
    main()
