"""Record PyTorch vectors on a CUDA GPU: short traces of PyTorch's own caching allocator under
each setting of the validation plan, for ``tests/test_torch_vectors.py``.

Each scenario runs in a process of its own (``PYTORCH_CUDA_ALLOC_CONF`` is read when CUDA
starts): history recording is turned on before the first CUDA allocation (so the trace starts
from an empty allocator), a seeded random workload allocates and frees ``uint8`` tensors of
1 B to 1.2 GiB (on two streams where the scenario says so, with periodic ``empty_cache()``
where it says so), out-of-memory errors are caught and the run goes on, and the snapshot is
written with, beside it, what a snapshot does not record: the fraction, the device's total
memory (``cudaMemGetInfo``), the conf string and PyTorch's version.

Run on a machine with a GPU and PyTorch: ``python benchmarks/gpu_record_torch_vectors.py
[--out DIR] [--calls N]`` (default ``tests/data/torch_vectors``; ``$OUT`` when set). The files
are small (about 100-300 KB each for 3,000 calls).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

#: name -> (PYTORCH_CUDA_ALLOC_CONF, fraction, streams, empty_cache every N calls)
SCENARIOS = {
    "default_empty_cache": ("", None, 1, 97),
    "max_split_size": ("max_split_size_mb:128", None, 1, 211),
    "roundup_list": ("roundup_power2_divisions:[1:4,64:8,256:2,>:1]", None, 1, 0),
    "roundup_single": ("roundup_power2_divisions:4", None, 1, 0),
    "expandable": ("expandable_segments:True", None, 1, 131),
    "fraction_gc": ("garbage_collection_threshold:0.6", 0.04, 1, 0),
    "fraction_gc_mss": ("garbage_collection_threshold:0.7,max_split_size_mb:100", 0.03, 1, 0),
    "two_streams": ("", None, 2, 173),
    "expandable_fraction": ("expandable_segments:True", 0.03, 1, 0),
}

_CHILD = r'''
import json, pickle, random, sys
import torch
name, fraction, streams, empty_every, calls, out = sys.argv[1:7]
fraction = None if fraction == "none" else float(fraction)
streams, empty_every, calls = int(streams), int(empty_every), int(calls)
torch.cuda.memory._record_memory_history(max_entries=10 * calls + 100)
if fraction is not None:
    torch.cuda.set_per_process_memory_fraction(fraction)
total = torch.cuda.mem_get_info()[1]
side = [torch.cuda.current_stream()] + [torch.cuda.Stream() for _ in range(streams - 1)]
rng = random.Random(sum(map(ord, name)))
live, ooms = [], 0
MiB = 1 << 20
for i in range(calls):
    if empty_every and i and i % empty_every == 0:
        torch.cuda.empty_cache()
    if live and rng.random() < 0.45:
        live.pop(rng.randrange(len(live)))
        continue
    r = rng.random()
    n = (rng.randint(1, MiB) if r < 0.45 else rng.randint(MiB, 10 * MiB) if r < 0.75
         else rng.randint(10 * MiB, 200 * MiB) if r < 0.95 else rng.randint(200 * MiB, 1200 * MiB))
    with torch.cuda.stream(rng.choice(side)):
        try:
            live.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            ooms += 1
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
with open(out + ".pickle", "wb") as f:
    pickle.dump(snap, f)
print(json.dumps({"total": total, "ooms": ooms}))
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(os.environ["OUT"]) if os.environ.get("OUT") else \
        Path(__file__).resolve().parent.parent / "tests" / "data" / "torch_vectors"
    ap.add_argument("--out", type=Path, default=default)
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed here: nothing recorded")
        return 1
    if not torch.cuda.is_available():
        print("no CUDA device: nothing recorded")
        return 1
    for name, (conf, fraction, streams, empty_every) in SCENARIOS.items():
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        base = args.out / name
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, name, "none" if fraction is None else str(fraction),
             str(streams), str(empty_every), str(args.calls), str(base)],
            env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            print(f"{name}: failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        info = json.loads(done.stdout.strip().splitlines()[-1])
        side = {"conf": conf, "fraction": fraction, "device_total": info["total"],
                "torch_version": torch.__version__.split("+")[0], "ooms": info["ooms"],
                "calls": args.calls, "streams": streams, "empty_cache_every": empty_every}
        base.with_suffix(".json").write_text(json.dumps(side, indent=1) + "\n")
        size = base.with_suffix(".pickle").stat().st_size
        print(f"{name}: {size:,} B, {info['ooms']} OOM(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
