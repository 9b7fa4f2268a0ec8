"""Make a big, realistic PyTorch memory snapshot for the load benchmarks.

The snapshot is written the way ``torch.cuda.memory._dump_snapshot`` writes one (a dict of
builtin types, ``pickle.dump`` at protocol 4), scaled from the real ones in
``shared/reference/external``:

- the model's weights and a first step allocated before the history is switched on (so
  the trace starts mid-run, as most real ones do; ``--start empty`` for one that starts
  from an empty allocator), then a training loop of a 12-layer model (forward activations and temporaries, backward
  gradients freeing activations in reverse, optimizer temporaries, a changing batch shape
  now and then, ``empty_cache()`` every 50 steps) run through gpudash's model of PyTorch's
  caching allocator with its history on, so addresses, segments (``segment_alloc``,
  ``segment_free``), block sizes and the final ``segments`` are consistent and an exact
  replay follows them;
- every entry with 20-30 frames (Python frames of the model and the training script, then
  PyTorch's C++ frames): equal frames are one shared dict object, each allocation has its
  own frames list (as PyTorch's tracebacks), shared by its ``segment_alloc``, and each free
  one list shared by its ``free_requested`` and ``free_completed``; allocated blocks of the
  final segments share their allocation's list;
- ``time_us``, ``compile_context`` ``"N/A"`` and ``user_metadata`` ``""`` on every entry,
  ``allocator_settings``, and ``record_function`` annotations around each optimizer step.

Snapshots are cached (``cached_snapshot``) under ``$GPUDASH_BENCH_CACHE`` or the temp
directory's ``gpudash-bench/``, never in the repository.

Run: ``python benchmarks/make_big_snapshot.py SIZE_MB [--start mid-run|empty] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import sys
import tempfile
import time
from pathlib import Path

from gpudash import CachingAllocator, SimulatedDevice

#: Bump when the generator changes, so cached files are made again.
VERSION = 2
MiB = 1 << 20

_PY_FILES = ["/opt/conda/lib/python3.11/site-packages/torch/nn/modules/module.py",
             "/opt/conda/lib/python3.11/site-packages/torch/nn/modules/linear.py",
             "/opt/conda/lib/python3.11/site-packages/torch/nn/functional.py",
             "/opt/conda/lib/python3.11/site-packages/torch/autograd/graph.py",
             "/opt/conda/lib/python3.11/site-packages/torch/optim/adamw.py",
             "/opt/conda/lib/python3.11/site-packages/torch/optim/optimizer.py",
             "/opt/conda/lib/python3.11/site-packages/torch/_tensor.py",
             "/home/user/project/model.py", "/home/user/project/attention.py",
             "/home/user/project/train.py"]
_CPP = ["torch::unwind::unwind()", "torch::CapturedTraceback::gather(bool, bool, bool)",
        "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(...)",
        "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::malloc(...)",
        "at::TensorBase at::detail::_empty_generic<long>(...)",
        "at::detail::empty_cuda(...)", "at::native::empty_cuda(...)",
        "at::(anonymous namespace)::create_out(...)", "at::_ops::mm::call(...)",
        "at::_ops::addmm::redispatch(...)", "torch::autograd::VariableType::addmm(...)",
        "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::free(...)",
        "c10::StorageImpl::~StorageImpl()", "c10::TensorImpl::~TensorImpl()",
        "torch::autograd::Engine::evaluate_function(...)", "_PyEval_EvalFrameDefault"]


class _Frames:
    """A pool of shared frame dicts and call sites (stacks of 20-30 of them)."""

    def __init__(self, rng: random.Random, sites: int = 400) -> None:
        self.rng = rng
        pool: dict[tuple, dict] = {}

        def frame(filename: str, line: int, name: str) -> dict:
            key = (filename, line, name)
            if key not in pool:
                pool[key] = {"filename": filename, "line": line, "name": name}
            return pool[key]

        cpp = [frame("??" if k % 3 else "CUDACachingAllocator.cpp", 0, n)
               for k, n in enumerate(_CPP)]
        outer = [frame("/home/user/project/train.py", 200 + k, f"train_{k}") for k in range(4)]
        outer.append(frame("/home/user/project/train.py", 412, "<module>"))
        self.sites: list[list[dict]] = []
        for _ in range(sites):
            n_cpp = rng.randint(6, 12)
            n_py = rng.randint(20, 30) - n_cpp - 3
            inner = [frame(rng.choice(_PY_FILES), rng.randint(10, 2000),
                           f"fn_{rng.randint(0, 150)}") for _ in range(max(1, n_py))]
            self.sites.append(rng.sample(cpp, n_cpp) + inner + rng.sample(outer, 3))

    def new_list(self, site: int) -> list[dict]:
        """A new frames list for a call at ``site`` (PyTorch makes one per traceback)."""
        return list(self.sites[site])


def _step(a: CachingAllocator, rng: random.Random, calls: list, batch: int,
          params: list[int], layers: int = 12) -> None:
    """One training step: allocations and frees through ``a``; each call's site appended
    to ``calls`` as ``(kind, site)`` in order (kind 1 alloc, 2 free)."""
    def alloc(n: int, site: int) -> int:
        p = a.allocate(n)
        calls.append((1, site))
        return p

    def free(p: int, site: int) -> None:
        a.deallocate(p)
        calls.append((2, site))

    acts = []
    for layer in range(layers):                   # forward
        base = 10 * layer
        x = alloc(batch * 3072 * 4, base)
        t1 = alloc(batch * 1024 * 4 + rng.randrange(0, 4096, 512), base + 1)
        t2 = alloc(rng.choice((512, 4096, 65536, 1 << 20)), base + 2)
        free(t2, base + 3)
        acts.append((x, t1))
        if rng.random() < 0.5:
            t3 = alloc(batch * 512 * 2, base + 4)
            free(t3, base + 5)
    loss = alloc(batch * 50257 * 2, 130)
    for layer in reversed(range(layers)):         # backward
        base = 140 + 10 * layer
        g = alloc(batch * 3072 * 4, base)
        x, t1 = acts.pop()
        free(t1, base + 1)
        free(x, base + 2)
        if not params[layer]:
            params[layer] = alloc(3072 * 1024 * 4, base + 3)
        free(g, base + 4)
    free(loss, 270)
    for layer in range(layers):                   # optimizer
        base = 280 + 9 * (layer % 12)
        m = alloc(3072 * 1024 * 4, base)
        v = alloc(rng.choice((4096, 8192, 3072 * 4)), base + 1)
        free(v, base + 2)
        free(m, base + 3)


def make_snapshot(entries: int, seed: int = 0, start: str = "mid-run") -> dict:
    """A snapshot dict with about ``entries`` trace entries (see the module docstring).

    ``start``: ``"mid-run"`` (the usual case: the model's weights and a first step were
    allocated before the history was switched on, so the trace starts after them and an
    exact replay rebuilds them from the final segments) or ``"empty"`` (the history is on
    from the first allocation)."""
    rng = random.Random(seed)
    frames = _Frames(rng)
    a = CachingAllocator(SimulatedDevice(80 << 30))
    params = [0] * 12
    if start == "mid-run":
        weights = [a.allocate(rng.choice((3072, 1024, 4096)) * 1024 * 4) for _ in range(48)]
        _step(a, rng, [], 8, params)
        del weights
    elif start != "empty":
        raise ValueError(f"start must be 'mid-run' or 'empty'; got {start!r}")
    a.record_history(True, max_entries=entries + 1_000_000)
    calls: list[tuple[int, int]] = []
    step = 0
    steps_t: list[int] = []
    batch = 8
    while len(a._history) < entries:
        if step % 25 == 0:
            batch = rng.choice((4, 8, 12, 16))
        if step % 50 == 49:
            a.empty_cache()
        steps_t.append(len(a._history))
        _step(a, rng, calls, batch, params)
        step += 1
    snap = a.snapshot()
    trace = snap["device_traces"][0]
    if trace and trace[-1]["action"] == "snapshot":
        trace.pop()
    t_us = 1_765_000_000_000_000
    ci = 0
    stash = None                       # a segment event's list, for the call it belongs to
    free_lists: dict[int, list] = {}   # address -> the list of its free_requested
    live: dict[int, list] = {}
    for e in trace:
        t_us += rng.randint(1, 40)
        e["time_us"] = t_us
        act = e["action"]
        if act == "alloc":
            _, site = calls[ci]
            ci += 1
            lst = stash if stash is not None else frames.new_list(site)
            stash = None
            e["frames"] = lst
            live[e["addr"]] = lst
        elif act == "free_requested":
            _, site = calls[ci]
            ci += 1
            lst = frames.new_list(site)
            free_lists[e["addr"]] = lst
            e["frames"] = lst
        elif act == "free_completed":
            e["frames"] = free_lists.pop(e["addr"], [])
            live.pop(e["addr"], None)
        elif act in ("segment_alloc", "segment_map"):
            stash = frames.new_list(calls[ci][1]) if ci < len(calls) else []
            e["frames"] = stash
        else:
            e["frames"] = []
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] != "inactive":
                blk["frames"] = live.get(blk["address"], [])
    ann = []
    for k, i in enumerate(steps_t[1:], 1):
        if i < len(trace):
            t = trace[i]["time_us"]
            ann.append({"name": "Optimizer.step#AdamW.step", "stage": "START", "device": 0,
                        "time_us": t - 30})
            ann.append({"name": "Optimizer.step#AdamW.step", "stage": "END", "device": 0,
                        "time_us": t - 5})
    snap["external_annotations"] = ann
    return snap


def _bytes_per_entry(start: str = "mid-run") -> float:
    snap = make_snapshot(20_000, seed=1, start=start)
    n = len(snap["device_traces"][0])
    return len(pickle.dumps(snap, protocol=4)) / n


def cache_dir() -> Path:
    d = Path(os.environ.get("GPUDASH_BENCH_CACHE") or Path(tempfile.gettempdir()) /
             "gpudash-bench")
    d.mkdir(parents=True, exist_ok=True)
    return d


def cached_snapshot(size_mb: int, seed: int = 0, say=print, start: str = "mid-run") -> Path:
    """The path of a cached snapshot of about ``size_mb`` MB (made when missing)."""
    path = cache_dir() / f"snapshot-v{VERSION}-{start}-{size_mb}MB-seed{seed}.pickle"
    if path.exists():
        return path
    t0 = time.perf_counter()
    entries = int(size_mb * 1e6 / _bytes_per_entry(start))
    snap = make_snapshot(entries, seed, start)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    os.replace(tmp, path)
    say(f"made {path} ({path.stat().st_size / 1e6:,.0f} MB, "
        f"{len(snap['device_traces'][0]):,} entries) in {time.perf_counter() - t0:.0f} s")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("size_mb", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", choices=("mid-run", "empty"), default="mid-run")
    ap.add_argument("--out", type=Path, help="write here instead of the cache")
    args = ap.parse_args(argv)
    if args.out is None:
        print(cached_snapshot(args.size_mb, args.seed, start=args.start))
        return 0
    entries = int(args.size_mb * 1e6 / _bytes_per_entry(args.start))
    with open(args.out, "wb") as f:
        pickle.dump(make_snapshot(entries, args.seed, args.start), f, protocol=4)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
