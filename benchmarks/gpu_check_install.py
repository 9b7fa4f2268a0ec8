"""On a GPU: does a small model train to the same loss on gpudash's installed allocator as on
PyTorch's own, and how does the per-step time compare (bar: at most 1.1x)?

Each run is a fresh process (the allocator must be chosen before CUDA starts): the same
seeded MLP + conv model, ``--steps`` steps of SGD on synthetic data, cudnn deterministic;
the first 20 steps are warm-up and not timed. Prints the final losses, the median step
times and their ratio, and gpudash's memory_stats next to PyTorch's.

    python benchmarks/gpu_check_install.py [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

JOB = r"""
import json, statistics, sys, time
import torch
mode = sys.argv[1]
if mode == "gpudash":
    import gpudash.torch as gt
    gt.install(quiet=True)
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
times, loss = [], None
for step in range(int(sys.argv[2])):
    x = torch.randn(128, 3, 32, 32, device="cuda", generator=g)
    y = torch.randint(0, 10, (128,), device="cuda", generator=g)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    if step >= 20:
        times.append(time.perf_counter() - t0)
s = torch.cuda.memory_stats()
print(json.dumps({"loss": loss.item(), "step_ms": statistics.median(times) * 1e3,
                  "allocated_peak": s["allocated_bytes.all.peak"],
                  "reserved": s["reserved_bytes.all.current"],
                  "device_allocs": s["num_device_alloc"]}))
"""


def run(mode: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", JOB, mode, str(steps)], capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch_run = run("torch", args.steps)
    ours = run("gpudash", args.steps)
    torch_again = run("torch", args.steps)   # the baseline twice: its own spread
    ratio = ours["step_ms"] / min(torch_run["step_ms"], torch_again["step_ms"])
    print(json.dumps({"torch": torch_run, "gpudash": ours, "torch_again": torch_again,
                      "step_ratio": round(ratio, 3),
                      "same_loss": abs(ours["loss"] - torch_run["loss"]) <= 1e-5 * max(
                          1.0, abs(torch_run["loss"]))}, indent=1))
    if ratio > 1.1:
        print(f"per-step time {ratio:.2f}x PyTorch's allocator: over the 1.1x bar")


if __name__ == "__main__":
    main()
