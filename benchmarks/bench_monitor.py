"""The cost of watching a framework: a training loop's steps per second with the monitor off
and on (4 and 20 polls a second).

    python benchmarks/bench_monitor.py                       # TensorFlow on the CPU BFC
    python benchmarks/bench_monitor.py --framework torch     # on a GPU machine
    python benchmarks/bench_monitor.py --framework jax       # on a GPU machine

Each setting runs ``--rounds`` times, interleaved (off, 4 Hz, 20 Hz, off, ...), for
``--seconds`` each; the table gives the median steps/s, its ratio to "off", and the monitor's
own CPU time per poll. Prints one table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _tf_step():
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    device = gpus[0].name if gpus else "/CPU:0"
    with tf.device(device):
        w1 = tf.Variable(tf.random.normal((512, 512)) * 0.01)
        w2 = tf.Variable(tf.random.normal((512, 10)) * 0.01)
        x = tf.random.normal((128, 512))
        y = tf.one_hot(tf.random.uniform((128,), maxval=10, dtype=tf.int32), 10)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = tf.nn.relu(x @ w1)
            loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(y, h @ w2))
        g1, g2 = tape.gradient(loss, [w1, w2])
        w1.assign_sub(0.01 * g1)
        w2.assign_sub(0.01 * g2)
        return loss

    def run():
        step().numpy()

    watch_kwargs = {} if gpus else {"devices": ["CPU:0"]}
    return run, watch_kwargs, device


def _torch_step():
    import torch

    dev = "cuda"
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(512, 2048, device=dev)
    y = torch.randint(0, 10, (512,), device=dev)

    def run():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()

    return run, {}, "cuda:0"


def _jax_step():
    import jax
    import jax.numpy as jnp

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = (jax.random.normal(k1, (2048, 2048)) * 0.01, jax.random.normal(k2, (2048, 10)) * 0.01)
    x = jax.random.normal(k3, (512, 2048))
    y = jax.nn.one_hot(jnp.arange(512) % 10, 10)

    def loss(p):
        return -jnp.mean(jnp.sum(y * jax.nn.log_softmax(jax.nn.relu(x @ p[0]) @ p[1]), -1))

    @jax.jit
    def update(p):
        g = jax.grad(loss)(p)
        return tuple(a - 0.01 * b for a, b in zip(p, g))

    state = {"p": params}

    def run():
        state["p"] = update(state["p"])
        state["p"][0].block_until_ready()

    return run, {}, str(jax.devices()[0])


def _steps_per_second(run, seconds: float) -> float:
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        run()
        n += 1
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("tensorflow", "torch", "jax"), default="tensorflow")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    run, watch_kwargs, device = {"tensorflow": _tf_step, "torch": _torch_step,
                                 "jax": _jax_step}[args.framework]()
    from gpudash.monitors import watch

    for _ in range(20):  # warm up (compilation, first regions)
        run()
    settings = [("off", None), ("4 Hz", 0.25), ("20 Hz", 0.05)]
    results: dict[str, list[float]] = {name: [] for name, _ in settings}
    per_poll: dict[str, list[float]] = {name: [] for name, _ in settings}
    for _ in range(args.rounds):
        for name, interval in settings:
            mon = None
            if interval is not None:
                mon = watch(args.framework, interval=interval, **watch_kwargs)
            try:
                results[name].append(_steps_per_second(run, args.seconds))
            finally:
                if mon is not None:
                    mon.stop()
                    if mon.polls:
                        per_poll[name].append(mon.poll_seconds / mon.polls)
    base = statistics.median(results["off"])
    print(f"bench_monitor: {args.framework} training loop on {device}, {args.rounds} x "
          f"{args.seconds:g} s per setting (median), python {sys.version.split()[0]}")
    print(f"{'monitor':<8} {'steps/s':>9} {'vs off':>7} {'per poll':>10}")
    for name, _ in settings:
        med = statistics.median(results[name])
        poll = (f"{statistics.median(per_poll[name]) * 1e6:8.0f} us" if per_poll[name]
                else "         -")
        print(f"{name:<8} {med:9.1f} {med / base:7.3f} {poll:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
