"""GPU check: ``gpudash.watch("torch")`` as users run it, for ~15 s while the program allocates.

For a machine with a CUDA build of PyTorch and a GPU. The monitor runs with its defaults
(4 polls a second, a layout every 2 s, the allocator history on with 100,000 entries) while
the main thread allocates and frees tensors of mixed sizes, and takes the feed's samples as a
live model would. Then it checks, with ``PASS``/``FAIL`` lines (exit status 1 when one fails):

- the polling thread never stopped: polls kept coming to the end, about 4 a second;
- layouts kept coming (one every ``snapshot_interval``), and no call was reported stuck
  (``feed.error`` stayed None; slow calls are listed from ``monitor.errors``);
- ``feed.latest`` is ``feed.history``'s last point, and after the work stops it equals
  ``torch.cuda.memory_allocated()`` / ``memory_reserved()``;
- ``monitor.driver_view()``: the framework's pool is above 0 (and within what the driver
  counts for this process, when NVML can say);
- ``stop()`` returns at once.

It prints how long one ``memory_snapshot()`` takes with the history on, the calls the monitor
found slow (``monitor.errors``), and, when a check fails, the stack of every gpudash thread
still running (where it waits). Without a usable GPU it prints one line saying so
and exits 0; ``--standin`` runs the same checks against the tests' stand-in for torch (no
GPU: a check of this script).

Run: ``python benchmarks/gpu_check_torch_monitor.py [--seconds 15] [--standin]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

MiB = 1 << 20


class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def check(self, ok: bool, what: str, detail: str = "") -> None:
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}: {what}" + (f" ({detail})" if detail else ""))


def gpudash_stacks() -> str:
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        if t.name.startswith("gpudash") and t.ident in frames:
            out.append(f"--- thread {t.name}\n" + "".join(traceback.format_stack(frames[t.ident])))
    return "\n".join(out)


def real_torch() -> tuple[Any, Any, Any, Any] | str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"this PyTorch ({torch.__version__}) has no CUDA device"

    def alloc(nbytes: int) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def truth() -> tuple[int, int]:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)

    return torch, alloc, (lambda x: None), truth


def standin_torch() -> tuple[Any, Any, Any, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from torch_standin import StandInTorch

    fake = StandInTorch()

    def truth() -> tuple[int, int]:
        s = fake.cuda.memory_stats(0)
        return s["allocated_bytes.all.current"], s["reserved_bytes.all.current"]

    return fake, fake.allocate, fake.free, truth


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--standin", action="store_true",
                   help="watch the tests' stand-in for torch instead (no GPU needed)")
    args = p.parse_args(argv)
    got = standin_torch() if args.standin else real_torch()
    if isinstance(got, str):
        print(f"gpu_check_torch_monitor: skipped: {got}")
        return 0
    torch, alloc, free, truth = got
    import gpudash

    print(f"torch {torch.__version__}; watching for {args.seconds:g} s")
    options = {"module": torch} if args.standin else {}
    mon = gpudash.watch("torch", **options)
    feed = mon.feeds[0]
    checks = Checks()
    rng = random.Random(0)
    held: list = []
    layouts = samples = 0
    polls_at: list[tuple[float, int]] = []
    errors_seen: list[str] = []
    was_error = False
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < args.seconds:
            for _ in range(8):
                held.append(alloc(rng.choice((512, 4096, 1 * MiB, 3 * MiB, 17 * MiB, 64 * MiB))))
            while len(held) > 96:
                free(held.pop(rng.randrange(len(held))))
            sample = feed.sample()  # as a live model takes them
            if sample is not None:
                samples += 1
                layouts += sample.table is not None
            error = feed.error
            if error is not None and not was_error:  # each time one appears
                errors_seen.append(error)
            was_error = error is not None
            polls_at.append((time.monotonic() - t0, mon.polls))
            time.sleep(0.02)
        allocated, reserved = truth()
        polls = mon.polls
        waited = time.monotonic()
        while mon.polls < polls + 2 and time.monotonic() - waited < 5:
            time.sleep(0.05)
        latest = feed.latest
        s = latest.stats if latest is not None else None
        view = mon.driver_view()
        t_snap = time.perf_counter()
        torch.cuda.memory_snapshot(**mon._snap_kwargs)
        print(f"one memory_snapshot({'include_traces=False' if mon._snap_kwargs else ''}) "
              f"with the history on: {time.perf_counter() - t_snap:.3f} s")
    finally:
        t_stop = time.monotonic()
        mon.stop()
        stop_s = time.monotonic() - t_stop

    last_second = [n for t, n in polls_at if t >= args.seconds - 1.0]
    rate = mon.polls / args.seconds
    checks.check(bool(last_second) and last_second[-1] > last_second[0],
                 "the polling thread kept polling to the end",
                 f"{mon.polls} polls in {args.seconds:g} s, {rate:.1f}/s")
    checks.check(rate >= 2.0, "about 4 polls a second", f"{rate:.1f}/s")
    checks.check(layouts >= max(2, int(args.seconds / mon.snapshot_interval) // 2),
                 "layouts kept coming", f"{layouts} layouts in {samples} samples")
    checks.check(not errors_seen, "no call reported stuck or failed",
                 "; ".join(errors_seen[:3]))
    last = feed.latest  # the monitor is stopped: nothing moves now
    point = None if last is None else (last.time_ms, last.stats.bytes_in_use,
                                       last.stats.pool_bytes, last.stats.bytes_limit)
    checks.check(point is not None and point == feed.history[-1],
                 "feed.latest is feed.history's last point")
    seen = "none" if s is None else f"{s.bytes_in_use:,} / {s.pool_bytes:,}"
    checks.check(s is not None and (s.bytes_in_use, s.pool_bytes) == (allocated, reserved),
                 "latest equals memory_allocated() / memory_reserved()",
                 f"latest {seen}; torch {allocated:,} / {reserved:,}")
    if view["available"] and view["devices"]:
        row = view["devices"][0]
        driver = row["driver"]
        detail = f"pool {row['pool']:,}, driver {driver}"
        checks.check(row["pool"] > 0, "driver_view: the framework's pool is above 0", detail)
        if isinstance(driver, int):
            checks.check(driver >= row["pool"], "driver_view: the driver counts the pool",
                         detail)
    else:
        print(f"NOTE: driver_view: NVML cannot say here ({view['reason']})")
    checks.check(stop_s < 3.0, "stop() returned at once", f"{stop_s:.2f} s")
    if mon.polls:
        print(f"the monitor's own time per poll: {1e3 * mon.poll_seconds / mon.polls:.2f} ms")
    slow = [text for _, _, text in mon.errors]
    if slow:
        print("monitor.errors:\n  " + "\n  ".join(slow))
    if checks.failed and any(t.name.startswith("gpudash") for t in threading.enumerate()):
        print("gpudash threads still running:\n" + gpudash_stacks())
    print(f"gpu_check_torch_monitor: {'FAIL' if checks.failed else 'PASS'}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
