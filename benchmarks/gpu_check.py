"""GPU check: a small MLP trained in plain CuPy under gpudash and under CuPy's MemoryPool,
then live reconfiguration of a gpudash session on the real device.

For a machine with a CUDA GPU; it takes well under a few minutes. Steps:

1. Train a 3-layer MLP (forward, backward, SGD) for a few hundred steps with batch sizes that
   vary from step to step, once with CuPy routed through a ``gpudash.Session``
   (``sess.install()``) and once through a fresh ``cupy.cuda.MemoryPool``; print one table:
   wall time, peak bytes in use and peak pool bytes (gpudash: ``peak_bytes_in_use`` and
   ``peak_pool_bytes``; CuPy: ``used_bytes()``/``total_bytes()`` sampled every step) and the
   pool bytes left at the end.
2. On a live gpudash session: lower ``per_process_gpu_memory_fraction``, check the limit
   changed and that an allocation above the new limit fails; raise it again and check that
   the same allocation succeeds (and holds the right values). ``PASS``/``FAIL`` lines; the
   exit status is 1 when anything failed.

Without a usable GPU it prints one line saying so and exits 0.

Run: ``python benchmarks/gpu_check.py [--steps N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any, Callable

import numpy as np

MiB = 1 << 20
GiB = 1 << 30

IN_DIM, HIDDEN, CLASSES = 512, 1024, 10
BATCH_SIZES = (32, 64, 96, 128, 256, 384, 512, 1024)


# ----------------------------------------------------------------------------- the model


def make_data(seed: int, n: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """A learnable synthetic task: labels from a random linear teacher (host arrays)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, IN_DIM), dtype=np.float32)
    teacher = rng.standard_normal((IN_DIM, CLASSES), dtype=np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int64)
    return x, y


def init_params(xp: Any, seed: int) -> list:
    rng = np.random.default_rng(seed + 1)
    shapes = [(IN_DIM, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, CLASSES)]
    params = []
    for fan_in, fan_out in shapes:
        w = rng.standard_normal((fan_in, fan_out), dtype=np.float32) * np.float32(
            np.sqrt(2.0 / fan_in))
        params.append(xp.asarray(w))
        params.append(xp.zeros((fan_out,), dtype=xp.float32))
    return params


def train_step(xp: Any, params: list, xb: Any, yb: Any, lr: float) -> Any:
    """One SGD step of softmax cross-entropy; returns the loss (a 0-d array)."""
    w1, b1, w2, b2, w3, b3 = params
    n = xb.shape[0]
    # forward
    z1 = xb @ w1 + b1
    h1 = xp.maximum(z1, 0)
    z2 = h1 @ w2 + b2
    h2 = xp.maximum(z2, 0)
    logits = h2 @ w3 + b3
    logits = logits - logits.max(axis=1, keepdims=True)
    e = xp.exp(logits)
    probs = e / e.sum(axis=1, keepdims=True)
    rows = xp.arange(n)
    loss = -xp.log(probs[rows, yb] + 1e-12).mean()
    # backward
    d_logits = probs
    d_logits[rows, yb] -= 1
    d_logits /= n
    g_w3 = h2.T @ d_logits
    g_b3 = d_logits.sum(axis=0)
    d_h2 = (d_logits @ w3.T) * (z2 > 0)
    g_w2 = h1.T @ d_h2
    g_b2 = d_h2.sum(axis=0)
    d_h1 = (d_h2 @ w2.T) * (z1 > 0)
    g_w1 = xb.T @ d_h1
    g_b1 = d_h1.sum(axis=0)
    # SGD, in place
    for p, g in zip(params, (g_w1, g_b1, g_w2, g_b2, g_w3, g_b3)):
        p -= lr * g
    return loss


def train(xp: Any, steps: int, seed: int, on_step: Callable[[], None] | None = None,
          sync: Callable[[], None] = lambda: None, lr: float = 0.05) -> dict:
    """Train for ``steps`` steps with varying batch sizes; the data lives on ``xp``'s device.

    Returns wall time (after a sync), the mean loss of the first and last 10% of the
    sampled losses, and the number of steps.
    """
    x_host, y_host = make_data(seed)
    rng = np.random.default_rng(seed + 2)
    batches = rng.choice(BATCH_SIZES, size=steps)
    sync()
    t0 = time.perf_counter()
    x = xp.asarray(x_host)
    y = xp.asarray(y_host)
    params = init_params(xp, seed)
    losses = []
    for step in range(steps):
        b = int(batches[step])
        idx = xp.asarray(rng.integers(0, x_host.shape[0], size=b))
        loss = train_step(xp, params, x[idx], y[idx], lr)
        if step % 10 == 0 or step == steps - 1:
            losses.append(float(loss))  # a sync every 10 steps
        if on_step is not None:
            on_step()
        del idx, loss
    sync()
    wall = time.perf_counter() - t0
    del x, y, params
    k = max(1, len(losses) // 10)
    return {"wall": wall, "first_loss": float(np.mean(losses[:k])),
            "last_loss": float(np.mean(losses[-k:])), "steps": steps}


# ----------------------------------------------------------------------------- reporting


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / MiB:,.1f} MiB"


def print_table(rows: list[dict]) -> None:
    cols = [("allocator", "name", str), ("wall s", "wall", lambda v: f"{v:.3f}"),
            ("steps/s", "rate", lambda v: f"{v:,.0f}"),
            ("peak in use", "peak_in_use", fmt_bytes), ("peak pool", "peak_pool", fmt_bytes),
            ("pool at end", "pool_end", fmt_bytes),
            ("loss first->last", "loss", str)]
    table = [[h for h, _, _ in cols]]
    for r in rows:
        table.append([f(r[k]) for _, k, f in cols])
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                        for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        print(f"{'PASS' if ok else 'FAIL'}: {what}" + (f" ({detail})" if detail else ""))
        if not ok:
            self.failed += 1
        return ok


# ----------------------------------------------------------------------------- runs


def run_gpudash(cupy: Any, gpudash: Any, steps: int, seed: int) -> dict:
    config = gpudash.ConfigProto()
    config.gpu_options.allow_growth = True
    config.gpu_options.per_process_gpu_memory_fraction = 0.5
    sess = gpudash.Session(config, environ={})
    try:
        sess.install()
        try:
            res = train(cupy, steps, seed, sync=cupy.cuda.Device().synchronize)
        finally:
            sess.uninstall()
        gc.collect()
        cupy.cuda.Device().synchronize()
        sess.flush()
        stats = sess.stats(0)
        res.update(name="gpudash (BFC)", peak_in_use=stats.peak_bytes_in_use,
                   peak_pool=stats.peak_pool_bytes, pool_end=stats.pool_bytes,
                   in_use_end=stats.bytes_in_use)
    finally:
        sess.close()
    return res


def run_cupy_pool(cupy: Any, steps: int, seed: int) -> dict:
    pool = cupy.cuda.MemoryPool()
    prev = cupy.cuda.get_allocator()
    peaks = {"used": 0, "total": 0}

    def sample() -> None:
        peaks["used"] = max(peaks["used"], pool.used_bytes())
        peaks["total"] = max(peaks["total"], pool.total_bytes())

    cupy.cuda.set_allocator(pool.malloc)
    try:
        res = train(cupy, steps, seed, on_step=sample, sync=cupy.cuda.Device().synchronize)
    finally:
        cupy.cuda.set_allocator(prev)
    gc.collect()
    cupy.cuda.Device().synchronize()
    res.update(name="CuPy MemoryPool", peak_in_use=peaks["used"], peak_pool=peaks["total"],
               pool_end=pool.total_bytes(), in_use_end=pool.used_bytes())
    pool.free_all_blocks()
    return res


def check_reconfiguration(cupy: Any, gpudash: Any, checks: Checks) -> None:
    """Lower the fraction on a live session, check it bites, raise it, check it lets go."""
    config = gpudash.ConfigProto()
    config.gpu_options.allow_growth = True
    config.gpu_options.per_process_gpu_memory_fraction = 0.5
    sess = gpudash.Session(config, environ={})
    dev = sess.devices[0]
    total = dev.total
    oom_errors = (gpudash.OutOfMemoryError, cupy.cuda.memory.OutOfMemoryError, MemoryError)
    try:
        checks.check(dev.memory_limit == int(total * 0.5), "initial limit is 0.5 x total",
                     f"{dev.memory_limit} vs {int(total * 0.5)}")
        with cupy.cuda.Device(dev.visible_id), sess.as_default():
            keep = cupy.ones(64 * MiB // 4, dtype=cupy.float32)  # something live
            checks.check(dev.allocator.owns(keep.data.ptr), "CuPy allocates through gpudash")
            low_fraction = GiB / total
            sess.configure(per_process_gpu_memory_fraction=low_fraction)
            low_limit = int(total * low_fraction)
            checks.check(dev.memory_limit == low_limit, "lowered fraction changes the limit",
                         f"{fmt_bytes(dev.memory_limit)}")
            checks.check(dev.allocator.pool_bytes <= low_limit,
                         "free regions returned: pool fits the lowered limit",
                         f"pool {fmt_bytes(dev.allocator.pool_bytes)}")
            big = low_limit + 256 * MiB
            try:
                arr = cupy.empty(big // 4, dtype=cupy.float32)
                del arr
                refused = False
            except oom_errors:
                refused = True
            checks.check(refused, "an allocation above the lowered limit fails",
                         f"{fmt_bytes(big)} > {fmt_bytes(low_limit)}")
            try:
                sess.free_now(sess.allocate(big))
                refused_raw = False
            except gpudash.OutOfMemoryError:
                refused_raw = True
            checks.check(refused_raw, "sess.allocate above the lowered limit raises "
                         "OutOfMemoryError")
            sess.configure(per_process_gpu_memory_fraction=0.5)
            checks.check(dev.memory_limit == int(total * 0.5), "raised fraction restores the "
                         "limit")
            try:
                arr = cupy.full(big // 4, 2.0, dtype=cupy.float32)
                ok = dev.allocator.owns(arr.data.ptr) and float(arr[::4096].sum()) == 2.0 * len(
                    range(0, big // 4, 4096))
                detail = ""
            except oom_errors as exc:
                ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            checks.check(ok, "after raising, the same allocation succeeds", detail)
            checks.check(float(keep.sum()) == float(keep.size), "live memory kept its values")
            arr = keep = None
        gc.collect()
        cupy.cuda.Device().synchronize()
    finally:
        sess.close()
    checks.check(dev.backend.used == 0 and dev.backend.blocks() == [],
                 "close() returns every region to CUDA")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps per run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import gpudash
    from gpudash.devices import CudaMemory

    ok, reason = CudaMemory.available()
    if not ok:
        print(f"gpu_check: no usable CUDA GPU here ({reason}); nothing to check.")
        return 0
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"gpu_check: {name}, CuPy {cupy.__version__}, gpudash {gpudash.__version__}, "
          f"{args.steps} steps, batch sizes {BATCH_SIZES}")

    # Warm-up (kernels, cuBLAS handles) so that neither measured run pays for it.
    train(cupy, 20, args.seed + 100, sync=cupy.cuda.Device().synchronize)
    cupy.get_default_memory_pool().free_all_blocks()

    checks = Checks()
    rows = []
    for run in (lambda: run_gpudash(cupy, gpudash, args.steps, args.seed),
                lambda: run_cupy_pool(cupy, args.steps, args.seed)):
        r = run()
        r["rate"] = r["steps"] / r["wall"]
        r["loss"] = f"{r['first_loss']:.3f}->{r['last_loss']:.3f}"
        rows.append(r)
    print()
    print_table(rows)
    print()
    for r in rows:
        checks.check(r["last_loss"] < r["first_loss"], f"{r['name']}: the loss decreases",
                     r["loss"])
        print(f"INFO: {r['name']}: {fmt_bytes(r['in_use_end'])} still in use after training "
              "(0 unless CuPy caches something)")
    checks.check(abs(rows[0]["last_loss"] - rows[1]["last_loss"]) < 1e-2,
                 "same training under both allocators",
                 f"{rows[0]['last_loss']:.4f} vs {rows[1]['last_loss']:.4f}")
    check_reconfiguration(cupy, gpudash, checks)
    print()
    print(f"gpu_check: {'FAIL' if checks.failed else 'PASS'}"
          + (f" ({checks.failed} check(s) failed)" if checks.failed else ""))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
