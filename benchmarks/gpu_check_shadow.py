"""On a GPU: shadow mode follows a small real model's training, and its what-if predicts
where PyTorch itself fails at a lower fraction.

Two fresh processes, the same seeded job (a small CNN + MLP, SGD on synthetic data, cudnn
deterministic, and a deliberate leak: one activation kept per step, so memory grows step by
step):

1. **shadow**: ``gpudash.torch.attach()`` before the first CUDA allocation (so the history
   ring starts from an empty allocator); the job trains ``--steps`` steps, marking them with
   ``shadow.step()``, while the fraction is driven from code (``shadow.configure(fraction=
   0.99)`` a third of the way, ``1.0`` at two thirds: PyTorch's call, live); then the
   what-if at ``f_low`` = the reserved bytes at the middle step / the device's memory:
   the call (counted from 1, allocations, frees and failed requests) and the step that
   would fail;
2. **torch**: the same job on PyTorch alone with ``set_per_process_memory_fraction(f_low)``
   from the start, its history recorded: where PyTorch really fails (the call of its
   ``oom`` entry, and the step it raised in).

Exits 0 when the predicted call and step are PyTorch's, 1 on a mismatch or when the model
left PyTorch's decisions, 2 where it cannot run (no PyTorch, no CUDA), 3 past
``--time-limit``. Writes its figures as JSON (``--out``), and both processes' recorded
histories as vectors beside the other PyTorch vectors (``--vectors``: a snapshot
``.pickle`` and its ``.json`` side file each, the format
``benchmarks/gpu_record_torch_vectors.py`` writes and ``tests/test_torch_vectors.py``
replays). Also measures what a read of PyTorch's history costs here (``_snapshot()`` per
ring entry: what shadow mode's default ring is sized from).

    python benchmarks/gpu_check_shadow.py [--steps 40] [--time-limit 540]

With ``$OUT`` set, the JSON and the vectors go under it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The job both processes run: ``MODE STEPS HISTORY FRACTION OUT`` (FRACTION "none" or a
#: float; OUT the snapshot's path without its suffix). Prints one JSON line.
CHILD = r"""
import json, pickle, statistics, sys, time
import numpy as np
import torch
mode, steps, history, fraction, out = sys.argv[1:6]
steps, history = int(steps), int(history)
fraction = None if fraction == "none" else float(fraction)
shadow = None
if mode == "shadow":
    import gpudash.torch
    shadow = gpudash.torch.attach(history=history, interval=0.1)
else:
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=history)
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction)
torch.manual_seed(0)
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
    torch.nn.Flatten(), torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10),
).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator(device="cuda").manual_seed(1)
kept, times, answers = [], [], []
failed_step = reserved_mid = None
for step in range(1, steps + 1):
    if shadow is not None:
        shadow.step(step)
        time.sleep(0.002)      # the step's mark well before its first allocation
        if step == steps // 3:
            answers.append(shadow.configure(fraction=0.99))
        if step == 2 * steps // 3:
            answers.append(shadow.configure(fraction=1.0))
    t0 = time.perf_counter()
    try:
        x = torch.randn(256, 3, 32, 32, device="cuda", generator=g)
        y = torch.randint(0, 10, (256,), device="cuda", generator=g)
        opt.zero_grad(set_to_none=True)
        h = model[:3](x)
        kept.append(h.detach().clone())            # the leak: 8 MiB a step
        loss = torch.nn.functional.cross_entropy(model[3:](h), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        failed_step = step
        break
    times.append(time.perf_counter() - t0)
    if step == steps // 2:
        reserved_mid = torch.cuda.memory_stats()["reserved_bytes.all.current"]
torch.cuda.synchronize()
res = {"mode": mode, "failed_step": failed_step, "reserved_mid": reserved_mid,
       "steps_done": len(times), "step_ms": statistics.median(times) * 1e3 if times else None,
       "total_props": torch.cuda.get_device_properties(0).total_memory,
       "total_mem_get_info": torch.cuda.mem_get_info()[1],
       "torch_version": torch.__version__.split("+")[0]}
if shadow is not None:
    shadow.refresh()
    dev = shadow.devices[0]
    res.update(exact=dev.exact, summary=dev.summary(), divergences=dev.divergences[:3],
               answers=answers, reads=shadow.refreshes,
               read_ms_median=statistics.median(shadow.refresh_seconds) * 1e3,
               read_ms_max=max(shadow.refresh_seconds) * 1e3,
               fraction_after=torch.cuda.get_per_process_memory_fraction(0)
               if hasattr(torch.cuda, "get_per_process_memory_fraction") else None)
    f_low = reserved_mid / res["total_props"]
    wi = shadow.what_if(fraction=f_low)
    res.update(f_low=f_low, what_if=wi.text, predicted_call=wi.call, predicted_step=wi.step,
               what_if_failed=wi.failed)
snap = torch.cuda.memory._snapshot()
# what one read of the history costs here: the ring's entries, and _snapshot()'s time
n = len(snap["device_traces"][0])
t = []
for _ in range(3):
    t0 = time.perf_counter()
    torch.cuda.memory._snapshot()
    t.append(time.perf_counter() - t0)
res.update(ring_entries=n, snapshot_ms=statistics.median(t) * 1e3,
           snapshot_us_per_entry=statistics.median(t) * 1e6 / max(n, 1))
if shadow is None:
    from gpudash.trace.torch_replay import from_snapshot
    from gpudash.trace.torch_trace import A_ALLOC, A_FREE, A_OOM
    tt = from_snapshot(snap)[0]
    acts = tt.action[np.isin(tt.action, (A_ALLOC, A_FREE, A_OOM))]
    ooms = np.flatnonzero(acts == A_OOM)
    res["oom_call"] = int(ooms[0]) + 1 if len(ooms) else None
else:
    shadow.stop()
with open(out + ".pickle", "wb") as f:
    pickle.dump(snap, f)
print(json.dumps(res))
"""


class _TooLate(Exception):
    pass


def _run(mode: str, steps: int, history: int, fraction: float | None, out: Path,
         deadline: float) -> dict:
    left = deadline - time.monotonic()
    if left <= 5:
        raise _TooLate(f"no time left for the {mode} run")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(steps), str(history),
             "none" if fraction is None else repr(fraction), str(out)],
            capture_output=True, text=True, timeout=left, env=env)
    except subprocess.TimeoutExpired:
        raise _TooLate(f"the {mode} run did not end within the time limit") from None
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _side(out: Path, res: dict, fraction: float | None, steps: int) -> None:
    side = {"conf": "", "fraction": fraction, "device_total": res["total_mem_get_info"],
            "torch_version": res["torch_version"], "ooms": int(res["failed_step"] is not None),
            "calls": None, "streams": 1, "empty_cache_every": 0,
            "made_by": "benchmarks/gpu_check_shadow.py", "steps": steps}
    out.with_suffix(".json").write_text(json.dumps(side, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--history", type=int, default=200_000,
                    help="history ring entries: the what-if replays the whole run")
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds, in all")
    ap.add_argument("--out", type=Path, default=(here or ROOT / "benchmarks")
                    / "gpu_check_shadow.json", help="the figures (JSON)")
    ap.add_argument("--vectors", type=Path, default=(here / "torch_vectors" if here else
                                                     ROOT / "tests" / "data" / "torch_vectors"),
                    help="where the recorded histories go (snapshot pickles + side files)")
    args = ap.parse_args(argv)
    if args.steps < 6:
        ap.error("--steps must be at least 6 (the fraction moves at a third and two thirds)")
    deadline = time.monotonic() + args.time_limit
    try:
        import torch
    except ImportError:
        print("gpu_check_shadow: PyTorch is not installed here; run it on a machine with a "
              "CUDA GPU and PyTorch (nothing checked)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"gpu_check_shadow: PyTorch {torch.__version__} sees no CUDA device here; run it "
              "on a machine with a CUDA GPU (nothing checked)", file=sys.stderr)
        return 2
    args.vectors.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        a = _run("shadow", args.steps, args.history, None, args.vectors / "shadow_cnn_run",
                 deadline)
        _side(args.vectors / "shadow_cnn_run", a, None, args.steps)
        b = _run("torch", args.steps, args.history, a["f_low"],
                 args.vectors / "shadow_cnn_fraction", deadline)
        _side(args.vectors / "shadow_cnn_fraction", b, a["f_low"], args.steps)
    except _TooLate as exc:
        print(f"gpu_check_shadow: {exc} ({args.time_limit:g} s): nothing decided",
              file=sys.stderr)
        return 3
    except RuntimeError as exc:
        print(f"gpu_check_shadow: {exc}", file=sys.stderr)
        return 1
    problems = []
    if not a.get("exact"):
        problems.append(f"the model left PyTorch's decisions: {a.get('divergences')}")
    if not a.get("what_if_failed"):
        problems.append(f"the what-if at {a['f_low']:.6f} predicted no failure")
    if b["failed_step"] is None:
        problems.append(f"PyTorch did not fail at {a['f_low']:.6f}")
    if (a.get("predicted_call"), a.get("predicted_step")) != (b.get("oom_call"),
                                                              b.get("failed_step")):
        problems.append(f"predicted call {a.get('predicted_call')} (step "
                        f"{a.get('predicted_step')}); PyTorch failed at call "
                        f"{b.get('oom_call')} (step {b.get('failed_step')})")
    if a["total_props"] != a["total_mem_get_info"]:
        problems.append(f"the device's memory differs: get_device_properties "
                        f"{a['total_props']:,}, mem_get_info {a['total_mem_get_info']:,} "
                        "(PyTorch's limit is a fraction of the latter)")
    figures = {"date": time.strftime("%Y-%m-%d"), "shadow": a, "torch": b,
               "match": not problems, "problems": problems}
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps({k: figures[k] for k in ("match", "problems")}, indent=1))
    print(f"what-if: {a.get('what_if')}\nPyTorch: failed at call {b.get('oom_call')} "
          f"(step {b.get('failed_step')}); figures in {args.out}, vectors in {args.vectors}")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
