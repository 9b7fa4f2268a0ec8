"""gpudash on a Dask cluster: what the stream costs a worker, what it puts on the wire, and a
what-if sweep on a 2-worker ``LocalCluster`` against local processes.

1. **Worker throughput**: allocate+free pairs/s of ``bench_allocator``'s workload, run as a
   Dask task through a session, with the stream off (a plain ``Session`` in the same task)
   and on: summaries only (no client watching), a client watching the device (chunk tables
   at 4 Hz), and a client recording events (``ClusterModel(record=True)``). Target: >= 90 %
   of off.
2. **Wire**: bytes/s per worker a second client receives on the ``"gpudash"`` topic
   (each message measured as msgpack) while a task allocates and frees, at default
   settings: for a busy workload (a few hundred live blocks, as fast as the allocator goes)
   and a large quiet one (20,000 live blocks, 200 operations a second) -- with summaries
   only, with a watched device (tables) and with recording (events): tables against events
   is the choice the views' feed makes.
3. **Sweep**: 10 fractions x growth on/off (20 replays) of a 120,000-event fragmentation
   trace: in this process, ``jobs=2`` and ``client=`` on a 2-worker ``LocalCluster`` (1
   thread each; the cluster's start is shown apart).

Run: ``python benchmarks/bench_dask.py [--pairs N] [--seconds S] [--repeat R]``.
Timing on a shared machine is noisy: repeat it.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_allocator import make_workload  # noqa: E402


def _throughput(steps: list, plain: bool) -> float:
    import gpudash
    from gpudash.dask import worker_session

    sess = gpudash.Session(simulate="64GiB", config={"allow_growth": True}) if plain \
        else worker_session()
    allocate, free = sess.allocate, sess.free_now
    slots = [0] * 300
    t0 = time.perf_counter()
    for slot, nbytes in steps:
        free(slots[slot])
        slots[slot] = allocate(nbytes)
    for p in slots:
        free(p)
    elapsed = time.perf_counter() - t0
    if plain:
        sess.close()
    return len(steps) / elapsed


def _setup(live: int) -> None:
    """Allocate ``live`` blocks on the worker's session and keep them there."""
    import random

    from gpudash.dask import worker_session

    sess = worker_session()
    rng = random.Random(1)
    sess._bench_live = [sess.allocate(int(2 ** rng.uniform(8, 20))) for _ in range(live)]


def _busy(seconds: float, rate: float | None) -> int:
    """Replace random blocks of the live set for ``seconds``, at most ``rate`` ops/s."""
    import random

    from gpudash.dask import worker_session

    sess = worker_session()
    ptrs = sess._bench_live
    rng = random.Random(2)
    ops = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i = rng.randrange(len(ptrs))
        sess.free_now(ptrs[i])
        ptrs[i] = sess.allocate(int(2 ** rng.uniform(8, 20)))
        ops += 2
        if rate is not None:
            time.sleep(2 / rate)
    return ops


def _teardown() -> None:
    from gpudash.dask import worker_session

    sess = worker_session()
    for p in sess._bench_live:
        sess.free_now(p)
    del sess._bench_live


class _WireMeter:
    """A second client subscribed to the topic, adding up message sizes by part."""

    def __init__(self, address: str) -> None:
        from distributed import Client

        from gpudash.dask._wire import TOPIC

        self.client = Client(address, set_as_default=False)
        self.lock = threading.Lock()
        self.reset()
        self.client.subscribe_topic(TOPIC, self._on)

    def reset(self) -> None:
        with self.lock:
            self.total = self.tables = self.events = self.messages = 0

    def _on(self, event) -> None:
        _, msg = event
        size = len(msgpack.packb(msg, use_bin_type=True))
        tables = events = 0
        for d in msg.get("devices", ()):
            if "table" in d:
                tables += len(msgpack.packb(d["table"], use_bin_type=True))
            if "events" in d:
                events += len(msgpack.packb(d["events"], use_bin_type=True))
        with self.lock:
            self.total += size
            self.tables += tables
            self.events += events
            self.messages += 1

    def close(self) -> None:
        self.client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    from distributed import Client, LocalCluster

    from gpudash.dask import ClusterModel, GpudashPlugin
    from gpudash.trace.whatif import sweep
    from gpudash.workloads import fragmentation_stress

    rows: list[tuple[str, str, str]] = []
    t0 = time.perf_counter()
    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        startup = time.perf_counter() - t0
        client.register_plugin(GpudashPlugin(simulate="64GiB", config={"allow_growth": True}))
        a, b = sorted(client.nthreads())

        def run(fn, *fargs):
            return client.submit(fn, *fargs, workers=[a], pure=False).result()

        # 1. throughput --------------------------------------------------------------
        steps = make_workload(args.pairs)
        best: dict[str, float] = {}
        modes = ["off", "summaries", "watched (tables)", "recording (events)"]
        for _ in range(args.repeat):
            for mode in modes:
                model = feed = None
                if mode == "watched (tables)":
                    model = ClusterModel(client, record=False)
                    model.wait(lambda w: a in w, 10)
                    feed = model.feed(a)
                    feed.start(lambda: None)
                elif mode == "recording (events)":
                    model = ClusterModel(client, record=True)
                rate = run(_throughput, steps, mode == "off")
                best[mode] = max(best.get(mode, 0.0), rate)
                if feed is not None:
                    feed.stop()
                if model is not None:
                    model.close()
        for mode in modes:
            rows.append((f"throughput, stream {mode}", f"{best[mode]:,.0f} pairs/s",
                         f"{best[mode] / best['off']:.0%} of off"))

        # 2. wire ----------------------------------------------------------------------
        meter = _WireMeter(client.scheduler.address)
        for label, live, rate in (("busy: 300 live, full speed", 300, None),
                                  ("quiet: 20,000 live, 200 ops/s", 20_000, 200.0)):
            for mode in ("summaries", "watched (tables)", "recording (events)"):
                model = feed = None
                if mode != "summaries":
                    model = ClusterModel(client, record=mode.startswith("recording"))
                    model.wait(lambda w: a in w, 10)
                if mode == "watched (tables)":
                    feed = model.feed(a)
                    feed.start(lambda: None)
                run(_setup, live)
                time.sleep(1.0)
                meter.reset()
                t = time.perf_counter()
                ops = run(_busy, args.seconds, rate)
                elapsed = time.perf_counter() - t
                time.sleep(0.6)
                with meter.lock:
                    total, tables, events, n = (meter.total, meter.tables, meter.events,
                                                meter.messages)
                run(_teardown)
                if feed is not None:
                    feed.stop()
                if model is not None:
                    model.close()
                detail = f"{n / elapsed:.1f} msg/s, {ops / elapsed:,.0f} ops/s"
                if tables:
                    detail += f", tables {tables / elapsed / 1024:,.1f} KiB/s"
                if events:
                    detail += f", events {events / elapsed / 1024:,.1f} KiB/s"
                rows.append((f"wire, {label}, {mode}", f"{total / elapsed / 1024:,.1f} KiB/s",
                             detail))
        meter.close()

        # 3. sweep ---------------------------------------------------------------------
        trace = fragmentation_stress(rounds=20_000, seed=3)
        fractions = [round(0.1 * i, 1) for i in range(1, 11)]
        kw = dict(fractions=fractions, allow_growth=(True, False), device_bytes="16GiB")
        times = {}
        for name, extra in (("local, jobs=1", {"jobs": 1}), ("local, jobs=2", {"jobs": 2}),
                            ("2-worker LocalCluster", {"client": client})):
            t = time.perf_counter()
            table = sweep(trace, **kw, **extra)
            times[name] = time.perf_counter() - t
            assert len(table) == 20
        for name, secs in times.items():
            rows.append((f"20-setting sweep ({len(trace):,} events), {name}", f"{secs:.2f} s",
                         f"{times['local, jobs=2'] / secs:.2f}x jobs=2"))
        rows.append(("LocalCluster start (2 processes)", f"{startup:.2f} s", ""))

    w = max(len(r[0]) for r in rows)
    print(f"{'benchmark':<{w}}  {'result':>18}  note")
    for name, result, note in rows:
        print(f"{name:<{w}}  {result:>18}  {note}")


if __name__ == "__main__":
    main()
