"""Dashboard costs: refresh CPU time, bytes on the wire, allocator throughput.

(a) Kernel CPU time of one refresh (``LiveModel.refresh_now``, measured with
    ``time.thread_time``) on a device with ~10,000 live chunks, with a ``Dashboard`` shown
    (its update built and sent in the refresh), and for the model alone. Target: < 50 ms.
(b) Bytes the dashboard sends: the snapshot a connecting page gets and each update after it
    (the comm is a recording comm that JSON-encodes each message as the kernel would, plus
    binary buffers); also once the timeline holds 5,000 points and the heatmap 600 columns.
(c) Allocator throughput: allocate+free pairs a second in a tight loop (mixed sizes, 300
    slots, over a pool of ~2,000 live chunks) on a bare session; with a no-op batch sink (what
    any sink costs: the allocator journals every op while anyone listens and expands each
    batch into numpy columns); and watched by a warm dashboard, paused (the model's sink) and
    refreshing at 4 Hz (the refresher thread also competes for the GIL). Runs are
    interleaved; medians. Target: >= 70 % of the bare rate.
(d) A PyTorch session of 1,000 segments (blocks labelled, as ``with sess.label(...)``
    makes them, a third freed): bytes of the snapshot a connecting page gets (the holders
    go as an ``int32`` id a block and each string once; before, as a JSON string a block),
    and refresh CPU with the dashboard shown.
(e) The holders view, on a session recording stacks (``record_stacks=True``): 2,000 live
    blocks allocated from 500 lines in 50 files under 4 labels. Refresh CPU of a model
    whose dashboard shows it against one whose dashboard does not (two models over the
    same session, refreshed in turn), the bytes the tree adds to a snapshot and to an update
    in which it changed, and a moment picked on the timeline: the time to rebuild the
    blocks in use then and their tree from a history of 100,000 refreshes' changes, and
    the history's bytes.
(f) What ``record_stacks=True`` costs ``Session.allocate`` + ``free``: microseconds a pair
    with stacks off and on, called from a shallow stack (a script) and from 25 frames down
    (about a notebook cell's depth under IPython), runs interleaved, medians.

Run: ``python benchmarks/bench_dashboard.py [--chunks N] [--pairs N] [--repeat R]
[--only a,b,c,d,e,f]``. Prints one table. (e) needs the holders view; the others run on
any checkout (``PYTHONPATH=OTHER python benchmarks/bench_dashboard.py --only f`` measures
another checkout with this script).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import comm
import numpy as np
from comm.base_comm import BaseComm

import gpudash
from gpudash.widgets import Dashboard, LiveModel

MIB = 1 << 20


class RecordingComm(BaseComm):
    """Keeps the size of every message instead of publishing it."""

    log: list = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        size = len(json.dumps(data)) + sum(memoryview(b).nbytes for b in buffers or ())
        RecordingComm.log.append((self.comm_id, size))

    def open(self, data=None, metadata=None, buffers=None):
        self._closed = False
        self.publish_msg("comm_open", data=data, buffers=buffers)

    def close(self, data=None, metadata=None, buffers=None, deleting=False):
        self._closed = True


def install_recording_comm() -> None:
    comm.create_comm = lambda *a, **k: RecordingComm(**k)


def populate(sess: gpudash.Session, live: int, seed: int = 1,
             max_bytes: int = 1 << 20) -> list[int]:
    """``2 * live`` allocations, every other one freed: ~``live`` in use, ~``live`` free."""
    rng = random.Random(seed)
    ptrs = [sess.allocate(rng.randint(1, max_bytes)) for _ in range(2 * live)]
    for p in ptrs[::2]:
        sess.free_now(p)
    return ptrs[1::2]


def _hello(dash: Dashboard) -> None:
    """What a rendered view sends first: from then on the dashboard sends updates."""
    dash._handle_msg({"content": {"data": {"method": "custom",
                                           "content": {"type": "hello"}}}, "buffers": []})


def _sent_bytes(dash: Dashboard) -> int:
    return sum(n for _, n in dash.sent.values())


def bench_refresh(chunks: int, repeat: int) -> dict:
    install_recording_comm()
    out = {}
    with gpudash.Session(simulate="16GiB", poll=False) as sess:
        live = populate(sess, chunks)
        n_chunks = len(sess.devices[0].allocator.chunk_table()["ptr"])
        out["chunks"] = n_chunks
        out["live"] = len(live)

        # model alone
        with LiveModel(sess, start=False) as model:
            times = []
            for i in range(repeat):
                sess.free_now(live[i])
                live[i] = sess.allocate(1000 + i)
                t0 = time.thread_time()
                model.refresh_now()
                times.append(time.thread_time() - t0)
            out["model_ms"] = 1e3 * statistics.median(times)

        # a dashboard shown (its update built and sent from the refresh)
        model = LiveModel(sess, start=False)
        with Dashboard(model=model) as dash:
            _hello(dash)
            out["snapshot_bytes"] = _sent_bytes(dash)
            times, sizes, tables = [], [], 0
            for i in range(repeat):
                sess.free_now(live[i])
                live[i] = sess.allocate(2000 + i)
                before = _sent_bytes(dash)
                t0 = time.thread_time()
                model.refresh_now()
                times.append(time.thread_time() - t0)
                sizes.append(_sent_bytes(dash) - before)
                time.sleep(0.25)  # 4 Hz: the large table goes at most once a second
            out["dashboard_ms"] = 1e3 * statistics.median(times)
            out["bytes_median"] = statistics.median(sizes)
            out["bytes_max"] = max(sizes)
        model.close()
    return out


def bench_steady_state_bytes(history: int = 5000, columns: int = 600) -> dict:
    """Bytes of one update once the timeline holds ``history`` points and the heatmap
    ``columns`` columns, and of the snapshot a (re)connecting page gets."""
    install_recording_comm()
    out = {}
    with gpudash.Session(simulate="16GiB", poll=False) as sess:
        live = populate(sess, 100, max_bytes=64 * MIB)  # ~3 GiB of 16 in use
        rng = random.Random(2)
        with LiveModel(sess, start=False, history=history, heatmap_columns=columns) as model:
            for _ in range(history):
                j = rng.randrange(len(live))
                sess.free_now(live[j])
                live[j] = sess.allocate(rng.randint(1, 64 * MIB))
                model.refresh_now()
            with Dashboard(model=model) as dash:
                _hello(dash)
                out["snapshot"] = _sent_bytes(dash)
                sess.free_now(live[0])
                live[0] = sess.allocate(100 * MIB)
                before = _sent_bytes(dash)
                model.refresh_now()
                out["update"] = _sent_bytes(dash) - before
    return out


def bench_segments(n: int = 1000, repeat: int = 5) -> dict:
    """(d): a PyTorch session of ``n`` segments, every block labelled."""
    install_recording_comm()
    out: dict = {}
    rng = random.Random(5)
    with gpudash.Session(allocator="torch", simulate="80GiB", poll=False) as sess:
        live = []
        for i in range(n):
            with sess.label(f"layer {i % 12}"):
                live.append(sess.allocate(rng.randint(12 * MIB, 60 * MIB)))
        for p in live[::3]:
            sess.free(p)
        del live[::3]
        out["segments"] = len(sess.devices[0].allocator.chunk_table()["regions"])
        model = LiveModel(sess, start=False)
        with Dashboard(model=model) as dash:
            RecordingComm.log.clear()
            _hello(dash)
            out["snapshot"] = _sent_bytes(dash)
            times = []
            for i in range(repeat):
                p = live.pop()
                sess.free(p)
                with sess.label("optimizer"):
                    live.append(sess.allocate(rng.randint(12 * MIB, 60 * MIB)))
                t0 = time.thread_time()
                model.refresh_now()
                times.append(time.thread_time() - t0)
                time.sleep(1.05)  # the table of a large layout goes at most once a second
            out["refresh_ms"] = 1e3 * statistics.median(times)
        model.close()
    return out


def _generated_lines(n_files: int, per_file: int) -> list:
    """``n_files * per_file`` functions, each allocating on a line of its own, in files of
    their own names (``/work/gen/model_K.py``): stacks of the user's code."""
    fns = []
    for k in range(n_files):
        src = "".join(f"def f{j}(s, n):\n    return s.allocate(n)\n" for j in range(per_file))
        ns: dict = {}
        exec(compile(src, f"/work/gen/model_{k}.py", "exec"), ns)  # noqa: S102 - our code
        fns += [ns[f"f{j}"] for j in range(per_file)]
    return fns


def bench_holders(repeat: int, history_refreshes: int = 100_000) -> dict:
    """(e): see the module docstring."""
    from gpudash.widgets.dashboard import VIEWS

    install_recording_comm()
    out: dict = {}
    rng = random.Random(11)
    fns = _generated_lines(50, 10)
    with gpudash.Session(simulate="80GiB", poll=False, record_stacks=True) as sess:
        live = []
        for i in range(2000):
            with sess.label(f"phase {i % 4}"):
                live.append(fns[i % len(fns)](sess, rng.randint(1, 16 * MIB)))
        m_off, m_on = LiveModel(sess, start=False), LiveModel(sess, start=False)
        d_off = Dashboard(model=m_off, views=VIEWS)
        d_on = Dashboard(model=m_on, views=VIEWS + ("holders",))
        try:
            for d in (d_off, d_on):
                RecordingComm.log.clear()
                _hello(d)
            out["snapshot_off"], out["snapshot_on"] = _sent_bytes(d_off), _sent_bytes(d_on)
            t_off, t_on, added = [], [], []
            for i in range(repeat):
                j = rng.randrange(len(live))
                sess.free_now(live[j])
                with sess.label(f"phase {rng.randrange(4)}"):
                    live[j] = fns[rng.randrange(len(fns))](sess, rng.randint(1, 16 * MIB))
                sizes = []
                for model, dash, times in ((m_off, d_off, t_off), (m_on, d_on, t_on)):
                    before = _sent_bytes(dash)
                    t0 = time.thread_time()
                    model.refresh_now()
                    times.append(time.thread_time() - t0)
                    sizes.append(_sent_bytes(dash) - before)
                added.append(sizes[1] - sizes[0])
                time.sleep(0.3)
            out["refresh_off_ms"] = 1e3 * statistics.median(t_off)
            out["refresh_on_ms"] = 1e3 * statistics.median(t_on)
            out["update_added"] = statistics.median(added)
        finally:
            for x in (d_off, d_on, m_off, m_on):
                x.close()
    # a long history: blocks coming and going over many refreshes (their changes fed to the
    # history as the model's refreshes feed it)
    from gpudash.live.model import _HolderLog

    log = _HolderLog(10**9)
    aid = np.arange(1, 2001, dtype=np.int64)
    size = np.array([rng.randint(1, 16 * MIB) for _ in range(2000)], dtype=np.int64)
    stack = np.array([rng.randrange(500) for _ in range(2000)], dtype=np.int32)
    label = np.array([rng.randrange(4) for _ in range(2000)], dtype=np.int32)
    nxt = 2001
    for step in range(history_refreshes):
        j = step % 2000
        aid[j] = nxt
        nxt += 1
        log.update(float(step), aid.copy(), size, stack, label)
    out["history_events"] = len(log.adds) + len(log.gone)
    out["history_bytes"] = log.nbytes
    times = []
    for k in range(repeat):
        t0 = time.perf_counter()
        _, arrays, _ = log.at(float(history_refreshes * (k + 1) // (repeat + 1)))
        times.append(time.perf_counter() - t0)
    out["moment_ms"] = 1e3 * statistics.median(times)
    # the tree of such a moment (the stacks of the session above)
    from gpudash.holder_tree import holder_tree
    from gpudash.formats.stacks import StackTable

    st = StackTable()
    for k in range(500):
        st.intern_frames([(f"/work/gen/model_{k // 10}.py", 2 * (k % 10) + 2, f"f{k % 10}"),
                          ("/work/train.py", 40, "step"), ("/work/train.py", 90, "<module>")])
    t0 = time.perf_counter()
    holder_tree(arrays[1], arrays[2], st, label=arrays[3],
                labels=[f"phase {i}" for i in range(4)])
    out["tree_ms"] = 1e3 * (time.perf_counter() - t0)
    return out


def _pairs_at_depth(sess: gpudash.Session, steps: list, depth: int) -> float:
    """Pairs a second of ``sess.allocate`` + ``free_now``, called ``depth`` frames down."""
    if depth:
        return _pairs_at_depth(sess, steps, depth - 1)
    slots = [0] * 300
    allocate, free = sess.allocate, sess.free_now
    t0 = time.perf_counter()
    for slot, nbytes in steps:
        p = slots[slot]
        if p:
            free(p)
        slots[slot] = allocate(nbytes)
    for p in slots:
        if p:
            free(p)
    return len(steps) / (time.perf_counter() - t0)


def bench_stacks_cost(pairs: int, repeat: int) -> dict:
    """(f): see the module docstring."""
    steps = make_workload(pairs)
    rates: dict[str, list[float]] = {}
    with gpudash.Session(simulate="32GiB", poll=False) as off, \
            gpudash.Session(simulate="32GiB", poll=False, record_stacks=True) as on:
        for _ in range(repeat):
            for depth in (0, 25):
                for name, sess in (("off", off), ("on", on)):
                    rates.setdefault(f"{name} {depth}", []).append(
                        _pairs_at_depth(sess, steps, depth))
    return {k: 1e6 / statistics.median(v) for k, v in rates.items()}


def make_workload(pairs: int, live: int = 300, seed: int = 7) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randrange(live), int(2 ** rng.uniform(0, 22))) for _ in range(pairs)]


def run_pairs(alloc, steps, live: int = 300) -> float:
    slots = [0] * live
    allocate, deallocate = alloc.allocate, alloc.deallocate
    t0 = time.perf_counter()
    for slot, nbytes in steps:
        deallocate(slots[slot])
        slots[slot] = allocate(nbytes)
    for p in slots:
        deallocate(p)
    return len(steps) / (time.perf_counter() - t0)


def bench_throughput(pairs: int, repeat: int, background_chunks: int) -> dict:
    """Identical sessions, runs interleaved: one bare; one with a no-op batch sink (the
    allocator's own cost of journaling events and expanding them into numpy columns, which
    any sink pays); one watched by a warm dashboard, paused (the model's sink) and then
    refreshing at 4 Hz."""
    install_recording_comm()
    steps = make_workload(pairs)
    rates: dict[str, list[float]] = {"bare": [], "no-op sink": [], "dashboard paused": [],
                                     "dashboard 4 Hz": []}
    sessions = [gpudash.Session(simulate="32GiB", poll=False) for _ in range(3)]
    try:
        for sess in sessions:
            populate(sess, background_chunks)  # a realistic pool for the views to draw
        a_bare, a_noop, a_watched = (s.devices[0].allocator for s in sessions)
        remove = a_noop._add_sink(lambda columns, extra: None)
        with Dashboard(sessions[2], rate_hz=4) as dash:
            dash.model.paused = True
            run_pairs(a_watched, steps[: pairs // 10])  # warm up
            dash.model.refresh_now()
            refreshes = 0
            for _ in range(repeat):
                rates["bare"].append(run_pairs(a_bare, steps))
                rates["no-op sink"].append(run_pairs(a_noop, steps))
                rates["dashboard paused"].append(run_pairs(a_watched, steps))
                dash.model.paused = False
                before = dash.model.refreshes
                rates["dashboard 4 Hz"].append(run_pairs(a_watched, steps))
                refreshes = dash.model.refreshes - before
                dash.model.paused = True
        remove()
    finally:
        for sess in sessions:
            sess.close()
    out = {k: statistics.median(v) for k, v in rates.items()}
    out["refreshes_last_run"] = refreshes
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=10_000, help="live chunks for (a), (b)")
    parser.add_argument("--pairs", type=int, default=2_000_000,
                        help="pairs for (c): enough for a few refreshes at 4 Hz")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--background-chunks", type=int, default=2_000,
                        help="live chunks in the pool during (c)")
    parser.add_argument("--only", default="a,b,c,d,e,f",
                        help="the rows to measure, comma-separated (default all)")
    parser.add_argument("--stack-pairs", type=int, default=200_000, help="pairs for (f)")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))

    rows = []
    if only & {"a", "b"}:
        r = bench_refresh(args.chunks, args.repeat)
        full = bench_steady_state_bytes()
        rows += [
            ("chunks in the table (a, b)", f"{r['chunks']:,} ({r['live']:,} live)", ""),
            ("(a) refresh CPU, model only", f"{r['model_ms']:.1f} ms", ""),
            ("(a) refresh CPU, dashboard shown", f"{r['dashboard_ms']:.1f} ms",
             "target < 50 ms"),
            ("(b) snapshot (a page connects)", f"{r['snapshot_bytes'] / 1e3:,.1f} kB", ""),
            ("(b) update, median / largest", f"{r['bytes_median'] / 1e3:,.1f} / "
                                             f"{r['bytes_max'] / 1e3:,.1f} kB",
             "the large table at most 1/s"),
            ("(b) snapshot, 5,000 points + 600 columns", f"{full['snapshot'] / 1e3:,.1f} kB",
             "steady state"),
            ("(b) update, same", f"{full['update'] / 1e3:,.1f} kB", "increments only"),
        ]
    if "c" in only:
        t = bench_throughput(args.pairs, args.repeat, args.background_chunks)
        bare = t["bare"]
        for name in ("bare", "no-op sink", "dashboard paused", "dashboard 4 Hz"):
            rate = t[name]
            rows.append((f"(c) alloc+free pairs/s, {name}", f"{rate:,.0f}",
                         f"{rate / bare:.0%} of bare" + (" (target >= 70%)"
                                                         if name == "dashboard 4 Hz" else "")))
        rows.append(("(c) refreshes during the last 4 Hz run", str(t["refreshes_last_run"]),
                     ""))
    if "d" in only:
        seg = bench_segments(repeat=args.repeat)
        rows += [
            (f"(d) snapshot, {seg['segments']:,} segments, labelled",
             f"{seg['snapshot'] / 1e3:,.1f} kB", "PyTorch session"),
            ("(d) refresh CPU, dashboard shown", f"{seg['refresh_ms']:.1f} ms", ""),
        ]
    if "e" in only:
        h = bench_holders(args.repeat)
        rows += [
            ("(e) refresh CPU, 2,000 blocks, no holders view", f"{h['refresh_off_ms']:.1f} ms",
             "500 stacks, 4 labels"),
            ("(e) refresh CPU, same, holders view shown", f"{h['refresh_on_ms']:.1f} ms", ""),
            ("(e) snapshot without / with the holders view",
             f"{h['snapshot_off'] / 1e3:,.1f} / {h['snapshot_on'] / 1e3:,.1f} kB",
             "200 nodes at most"),
            ("(e) the tree in an update where it changed", f"{h['update_added'] / 1e3:,.1f} kB",
             "median"),
            ("(e) history of 100,000 refreshes: events, bytes",
             f"{h['history_events']:,}, {h['history_bytes'] / 1e6:,.1f} MB", ""),
            ("(e) a moment from it: blocks, then their tree",
             f"{h['moment_ms']:.1f} ms, {h['tree_ms']:.1f} ms", "a click on the timeline"),
        ]
    if "f" in only:
        f = bench_stacks_cost(args.stack_pairs, args.repeat)
        for depth in (0, 25):
            off, on = f[f"off {depth}"], f[f"on {depth}"]
            rows.append((f"(f) allocate+free, {depth} frames down: stacks off / on",
                         f"{off:.2f} / {on:.2f} us", f"record_stacks costs {on / off:.2f}x"))
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    print(f"{'measure':<{w0}}  {'value':>{w1}}  note")
    print(f"{'-' * w0}  {'-' * w1}  {'-' * 24}")
    for a, b, c in rows:
        print(f"{a:<{w0}}  {b:>{w1}}  {c}")


if __name__ == "__main__":
    main()
