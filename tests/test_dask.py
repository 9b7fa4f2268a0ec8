"""gpudash on a Dask cluster: real ``LocalCluster``s (2 worker processes, 1 thread each), no
mocks.

Most tests share one cluster (module scope) and register a fresh :class:`GpudashPlugin` first,
which replaces every worker's session, so no test sees another's allocations. The killed-worker
and clean-shutdown tests make clusters of their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")
cloudpickle = pytest.importorskip("cloudpickle")

from distributed import Client, LocalCluster  # noqa: E402

import gpudash  # noqa: E402
from gpudash import ConfigError  # noqa: E402
from gpudash.dask import (  # noqa: E402
    ClusterDashboard,
    ClusterModel,
    GpudashPlugin,
    collect_traces,
    configure_workers,
    worker_session,
)
from gpudash.dask import _wire  # noqa: E402
from gpudash.trace import read_trace  # noqa: E402
from gpudash.trace.whatif import min_fraction, sweep  # noqa: E402
from gpudash.workloads import training_loop  # noqa: E402

# Functions below run on the workers. Dask pickles them by reference: the LocalCluster's
# worker processes import this module (they start with this process's sys.path); a worker
# started otherwise gets tests/ on its PYTHONPATH.

GIB = 1 << 30
MIB = 1 << 20


def _local_cluster() -> LocalCluster:
    return LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                        dashboard_address=":0")


@pytest.fixture(scope="module")
def client():
    with _local_cluster() as cluster, Client(cluster) as c:
        c.wait_for_workers(2)
        yield c


@pytest.fixture(autouse=True)
def fresh_plugin(request):
    """A new plugin (new sessions on every worker) before each test that uses the shared
    cluster."""
    if "client" in request.fixturenames:
        c = request.getfixturevalue("client")
        c.register_plugin(GpudashPlugin(simulate="16GiB"))
    yield


@pytest.fixture
def model(client):
    m = ClusterModel(client)
    yield m
    m.close()


def wait_for(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def addresses(client) -> list[str]:
    return sorted(client.nthreads())


def on(client, address, fn, *args):
    """Run ``fn(*args)`` as a task on one worker."""
    return client.submit(fn, *args, workers=[address], allow_other_workers=False,
                         pure=False).result(timeout=60)


# ---------------------------------------------------------------------- worker-side helpers
def _allocate(sizes):
    s = worker_session()
    ptrs = [s.allocate(n) for n in sizes]
    return ptrs, s.devices[0].allocator.bytes_in_use


def _free_now(ptrs):
    s = worker_session()
    for p in ptrs:
        s.free_now(p)
    return s.devices[0].allocator.bytes_in_use


def _session_facts():
    s = worker_session()
    d = s.devices[0]
    return {"n": len(s.devices), "kind": d.kind, "total": d.total, "limit": d.memory_limit,
            "name": d.allocator.name, "closed": s.closed}


def _limit():
    return worker_session().devices[0].memory_limit


def _settings():
    d = worker_session().devices[0]
    return (d.options.per_process_gpu_memory_fraction, d.options.allow_growth,
            d._deferred.threshold, d.memory_limit)


def _chunk_table():
    return worker_session().devices[0].allocator.chunk_table()


def _random_workload(seed, n, record=False):
    """Random allocations and frees; optionally a local Recorder of the same allocator."""
    import random

    s = worker_session()
    alloc = s.devices[0].allocator
    rec = gpudash.Recorder(alloc) if record else None
    rng = random.Random(seed)
    live = []
    allocs = frees = 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            s.free_now(live.pop(rng.randrange(len(live))))
            frees += 1
        else:
            live.append(s.allocate(int(2 ** rng.uniform(8, 24))))
            allocs += 1
    out = {"allocs": allocs, "frees": frees, "in_use": alloc.bytes_in_use}
    if rec is not None:
        rec.flush()
        t = rec.to_trace()
        out["columns"] = {k: np.asarray(v) for k, v in t.columns.items()}
        rec.detach()
    return out


def _oom(nbytes):
    try:
        worker_session().allocate(nbytes)
    except gpudash.OutOfMemoryError as exc:
        return exc.requested
    return None


def _threads():
    return sorted(t.name for t in threading.enumerate())


def _in_use_run():
    """For client.run: the session found without being told the worker."""
    return worker_session().devices[0].allocator.bytes_in_use


def _in_use_run_of(dask_worker):
    """For client.run: the session of the worker client.run passes."""
    return worker_session(dask_worker).devices[0].allocator.bytes_in_use


async def _thread_tick_then_sync(sizes, dask_worker):
    """On the worker's event loop (client.run): allocations whose events go out in a message
    numbered on another thread (its send waits for the loop), then a message sent from the
    loop itself. Returns the stream id, the last number before, and the numbers after the
    other thread's message and after the loop's."""
    import asyncio

    from gpudash.dask.plugin import _runtime_of

    rt = _runtime_of(dask_worker)
    while rt._blocked():  # let Dask write what gpudash queued before
        await asyncio.sleep(0.01)
    # from here to the return the loop is ours: what other threads post waits for it
    before = rt._n
    ptrs = [rt.session.allocate(n) for n in sizes]
    helper = threading.Thread(target=rt.tick, kwargs={"force": True})
    helper.start()
    helper.join()  # it posted (or, when it found the stream thread's, that one did)
    after_thread = rt._n
    after_sync = rt.tick(sync=True)
    for p in ptrs:
        rt.session.free_now(p)
    return {"rid": rt.rid, "before": before, "thread": after_thread, "sync": after_sync}


def _runtime_state():
    from distributed import get_worker

    from gpudash.dask.plugin import _runtime_of

    rt = _runtime_of(get_worker())
    alloc = rt.session.devices[0].allocator
    return {"journal_on": alloc._journal is not None, "dropped": dict(rt.dropped),
            "ev_ops": rt.devices[0].ev_ops, "ev_cap": rt.devices[0].ev_cap}


# ---------------------------------------------------------------------- the wire (no cluster)
def test_tables_and_records_survive_the_wire():
    sess = gpudash.Session(simulate="4GiB", config={"allow_growth": True})
    alloc = sess.devices[0].allocator
    sink: list = []
    alloc._add_sink(lambda rec, extra: sink.append(list(rec)), raw=True)
    rng = np.random.default_rng(3)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            sess.free_now(live.pop(int(rng.integers(len(live)))))
        else:
            live.append(sess.allocate(int(2 ** rng.uniform(0, 25))))
    alloc.flush_events()
    table = alloc.chunk_table()
    back = _wire.decode_table(_wire.encode_table(table))
    assert list(back) == list(table)
    for k in table:
        assert back[k].dtype == table[k].dtype, k
        assert np.array_equal(back[k], table[k]), k
    n, data = _wire.encode_records(sink)
    flat = [x for batch in sink for x in batch]
    assert n == len(flat) // 8 and len(data) < 16 * n  # well under the 64 raw bytes a record
    assert np.array_equal(_wire.decode_records(n, data), np.array(flat).reshape(-1, 8))
    with pytest.raises(gpudash.TraceFormatError, match="chunk table"):
        _wire.decode_table({"nr": 1, "nc": 5, "z": _wire.encode_table(table)["z"]})
    with pytest.raises(gpudash.TraceFormatError, match="damaged"):
        _wire.decode_records(n, b"not zlib")
    sess.close()


def test_a_layout_replica_follows_the_journal_exactly():
    """What a feed does when the worker sends events instead of tables: a replica from one
    table plus the records after it equals the allocator's own table, through splits,
    merges, growth, garbage collection, released regions, limit changes and close()."""
    from gpudash.dask.plugin import _chunk_table_locked

    sess = gpudash.Session(simulate="1GiB", config={"allow_growth": True})
    sess.configure(per_process_gpu_memory_fraction=0.5)
    alloc = sess.devices[0].allocator
    alloc._gc = True
    batches: list = []
    alloc._add_sink(lambda rec, extra: batches.append(list(rec)), raw=True)
    rng = np.random.default_rng(11)
    live = [sess.allocate(1 << 20)]
    alloc.flush_events()
    batches.clear()
    with alloc._lock:
        start = _chunk_table_locked(alloc)
        aid0 = alloc._next_aid
    layout = _wire.Layout(start)
    for step in range(6):
        for _ in range(700):
            if live and rng.random() < 0.5:
                sess.free_now(live.pop(int(rng.integers(len(live)))))
            else:
                try:
                    live.append(sess.allocate(int(2 ** rng.uniform(6, 27))))
                except gpudash.OutOfMemoryError:
                    pass
        if step == 2:
            alloc.release_free_regions()
        if step == 3:
            sess.configure(per_process_gpu_memory_fraction=0.3)
        alloc.flush_events()
        records = np.array([x for b in batches for x in b], dtype=np.int64).reshape(-1, 8)
        batches.clear()
        layout.apply(records, aid0)
        aid0 += int((records[:, 1] == 1).sum())
        table, got = alloc.chunk_table(), layout.table()
        assert list(got) == list(table)
        for k in table:
            assert got[k].dtype == table[k].dtype and np.array_equal(got[k], table[k]), (step, k)
    alloc.close()
    alloc.flush_events()
    layout.apply(np.array([x for b in batches for x in b], dtype=np.int64).reshape(-1, 8), aid0)
    assert layout.chunks == {} and layout.regions == {}
    with pytest.raises(gpudash.TraceFormatError, match="does not fit"):
        layout.apply(np.array([[0, 2, 4096, 256, 10, 1, 0, 0]]), 1)
    sess.close()


def test_plugin_arguments_are_checked_on_the_client():
    with pytest.raises(ConfigError, match="rate_hz"):
        GpudashPlugin(rate_hz=0)
    with pytest.raises(ConfigError, match="simulated device size"):
        GpudashPlugin(simulate="lots")
    with pytest.raises(ConfigError, match="config must be"):
        GpudashPlugin(config=42)
    with pytest.raises(ConfigError, match="install"):
        GpudashPlugin(install="yes")
    p = GpudashPlugin(config={"allow_growth": True}, simulate="2x8GiB")
    assert p.config.gpu_options.allow_growth is True
    assert cloudpickle.loads(cloudpickle.dumps(p)).config == p.config


def test_worker_session_outside_a_worker_is_a_config_error():
    with pytest.raises(ConfigError, match=r"client\.submit.*client\.run"):
        worker_session()


def test_import_gpudash_stays_free_of_distributed():
    code = ("import sys, gpudash, gpudash.dask; "
            "assert 'distributed' not in sys.modules, 'distributed imported'; "
            "sys.modules['distributed'] = None\n"
            "try:\n    gpudash.dask.GpudashPlugin\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install 'gpudash[dask]'" in out.stdout


# ---------------------------------------------------------------------- the plugin
def test_plugin_sets_up_on_every_worker(client):
    addrs = addresses(client)
    assert len(addrs) == 2
    facts = {a: on(client, a, _session_facts) for a in addrs}
    for a, f in facts.items():
        assert f == {"n": 1, "kind": "simulated", "total": 16 * GIB, "limit": f["limit"],
                     "name": "GPU_0_bfc", "closed": False}, a
    # the stream thread runs on each worker, and the summary is in the heartbeat metrics
    threads = client.run(_threads)
    assert all("gpudash-dask-stream" in names for names in threads.values()), threads
    on(client, addrs[0], _allocate, [3 * MIB])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
        metrics = info[addrs[0]]["metrics"]
        if metrics.get("gpudash_in_use") == 3 * MIB:
            break
        time.sleep(0.2)
    assert metrics["gpudash_in_use"] == 3 * MIB, metrics
    assert metrics["gpudash_limit"] == facts[addrs[0]]["limit"]
    assert metrics["gpudash_pool"] >= 3 * MIB and metrics["gpudash_peak"] == 3 * MIB
    assert metrics["gpudash_ooms"] == 0 and 0.0 <= metrics["gpudash_fragmentation"] <= 1.0
    assert metrics["gpudash"][0]["stats"]["bytes_in_use"] == 3 * MIB


def test_worker_session_in_client_run(client):
    """client.run, Dask's way to run a function on every worker, finds each worker's
    session, with or without the dask_worker argument; a refusal reaches the client as the
    ConfigError it is, and the workers log no pickling failure."""
    a, b = addresses(client)
    on(client, a, _allocate, [3 * MIB])
    assert client.run(_in_use_run) == {a: 3 * MIB, b: 0}
    assert client.run(_in_use_run_of) == {a: 3 * MIB, b: 0}
    client.unregister_worker_plugin("gpudash")
    try:
        with pytest.raises(ConfigError, match="register the plugin"):
            client.run(_in_use_run, workers=[a])
        logs = client.get_worker_logs(workers=[a])[a]
        assert not [m for _, m in logs if "pickle" in m], logs
    finally:
        client.register_plugin(GpudashPlugin(simulate="16GiB"))


def test_worker_session_in_client_run_where_workers_share_a_loop():
    """With processes=False every worker runs on one event loop: a client.run function must
    name its worker, and the error says how."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        c.register_plugin(GpudashPlugin(simulate="1GiB"))
        assert sorted(c.run(_in_use_run_of).values()) == [0, 0]
        with pytest.raises(ConfigError, match=r"share this event loop.*worker_session\("
                                              r"dask_worker\)"):
            c.run(_in_use_run)


def _topic_subscribers(topic, dask_scheduler=None):
    return sorted(dask_scheduler._broker._topics[topic].subscribers)


def test_a_model_starts_only_once_the_scheduler_forwards_it_the_topic(client, monkeypatch):
    """The topic subscription goes to the scheduler on the client's batched stream, which
    the model's first lease (another connection) can overtake: a model that started before
    it arrived missed the workers' first messages (a recording without a worker's first
    allocations). Here the subscription is held back half a second: the client's hub, which
    a model's constructor makes first, returns only once the scheduler forwards the topic."""
    from gpudash.dask.model import _Hub

    assert _Hub.recording_model(client) is None   # no model of this client is open
    assert client.id not in client.run_on_scheduler(_topic_subscribers, _wire.TOPIC)
    send = client._send_to_scheduler

    def late(msg):
        if msg.get("op") == "subscribe-topic":
            threading.Timer(0.5, send, args=(msg,)).start()
        else:
            send(msg)

    monkeypatch.setattr(client, "_send_to_scheduler", late)
    t0 = time.monotonic()
    _Hub(client)
    try:
        assert client.id in client.run_on_scheduler(_topic_subscribers, _wire.TOPIC)
        assert time.monotonic() - t0 >= 0.5
    finally:
        client.unsubscribe_topic(_wire.TOPIC)


def test_model_shows_both_workers_bytes_within_two_seconds(client, model):
    a, b = addresses(client)
    assert model.wait(lambda w: {a, b} <= set(w), timeout=5)
    (_, used_a), (_, used_b) = on(client, a, _allocate, [5 * MIB, 1000]), \
        on(client, b, _allocate, [7 * MIB])
    t0 = time.monotonic()
    ok = model.wait(lambda w: w[a]["bytes_in_use"] == used_a and
                    w[b]["bytes_in_use"] == used_b, timeout=2.0)
    elapsed = time.monotonic() - t0
    assert ok, (model.workers, used_a, used_b)
    assert elapsed < 2.0
    w = model.workers
    assert used_a == 5 * MIB + 1024 and used_b == 7 * MIB
    for addr in (a, b):
        row = w[addr]
        assert set(row) >= {"bytes_in_use", "pool_bytes", "bytes_limit", "peak_bytes_in_use",
                            "ooms", "events"}
        assert row["state"] == "live" and not row["gone"]
        assert row["pool_bytes"] >= row["bytes_in_use"] and row["bytes_limit"] > 0
        assert row["ooms"] == 0 and row["events"] >= 1
        hist = model.history(addr)
        assert len(hist["time_ms"]) >= 1 and hist["bytes_in_use"][-1] == row["bytes_in_use"]
    assert w[a]["allocs"] == 2 and w[b]["allocs"] == 1
    # an idle worker sends nothing
    assert model.sync()
    before = {x: model.workers[x]["messages"] for x in (a, b)}
    time.sleep(1.0)
    assert {x: model.workers[x]["messages"] for x in (a, b)} == before
    # the plugin registered again: new sessions, new streams, which the model follows
    client.register_plugin(GpudashPlugin(simulate="16GiB"))
    assert model.wait(lambda w: w[a]["bytes_in_use"] == w[b]["bytes_in_use"] == 0 and
                      w[a]["allocs"] == w[b]["allocs"] == 0, timeout=5)
    on(client, b, _allocate, [MIB])
    assert model.wait(lambda w: w[b]["bytes_in_use"] == MIB and w[b]["allocs"] == 1, 5)


def test_configure_workers_changes_each_workers_limit(client, model):
    a, b = addresses(client)
    out = configure_workers(client, per_process_gpu_memory_fraction=0.25)
    assert set(out) == {a, b}
    for addr in (a, b):
        assert on(client, addr, _limit) == int(0.25 * 16 * GIB)
        assert out[addr][0]["limit"] == int(0.25 * 16 * GIB)
        assert out[addr][0]["fraction"] == 0.25
    # one worker only, by address
    configure_workers(client, workers=[b], per_process_gpu_memory_fraction=0.5,
                      allow_growth=True, deferred_deletion_bytes=MIB)
    assert on(client, a, _settings) == (0.25, False, 8 * MIB, int(0.25 * 16 * GIB))
    assert on(client, b, _settings) == (0.5, True, MIB, 8 * GIB)
    # the model hears of it
    assert model.wait(lambda w: w[b]["bytes_limit"] == 8 * GIB and
                      w[a]["bytes_limit"] == 4 * GIB, timeout=5)


def test_a_bad_value_is_refused_on_the_client_and_no_worker_changes(client):
    a, b = addresses(client)
    configure_workers(client, per_process_gpu_memory_fraction=0.4)
    before = {x: on(client, x, _settings) for x in (a, b)}

    def runs() -> int:
        return sum(1 for _, e in client.get_events("all")
                   if isinstance(e, dict) and e.get("action") == "run-function")

    n_runs = runs()
    for bad in ({"per_process_gpu_memory_fraction": -0.5},
                {"per_process_gpu_memory_fraction": "half"},
                {"allow_growth": "yes"},
                {"deferred_deletion_bytes": -1},
                {"per_process_gpu_memory_fraction": 0.3, "visible_device_list": "0"},
                {"memory_limit": 1 << 30}):
        with pytest.raises(ConfigError) as info:
            configure_workers(client, **bad)
        assert any(k in str(info.value) for k in bad), (bad, str(info.value))
    with pytest.raises(ConfigError, match="no worker 'tcp://nowhere:1'"):
        configure_workers(client, workers=["tcp://nowhere:1"], allow_growth=True)
    assert runs() == n_runs, "a value refused on the client still reached the workers"
    # A value only the workers can refuse (oversubscription needs unified memory): checked
    # on every worker before any applies it; the error names each worker.
    with pytest.raises(ConfigError) as info:
        configure_workers(client, per_process_gpu_memory_fraction=1.5)
    assert a in str(info.value) and b in str(info.value) and "unified" in str(info.value)
    assert {x: on(client, x, _settings) for x in (a, b)} == before


def _devices():
    return len(worker_session().devices)


def _all_settings():
    return [(d.options.per_process_gpu_memory_fraction, d.options.allow_growth,
             d._deferred.threshold, d.memory_limit) for d in worker_session().devices]


def test_a_value_one_worker_refuses_changes_no_worker(client):
    """A cluster whose workers differ: a third worker with two simulated devices joins; a
    change of device 1 is refused by the two one-device workers, named, and the third,
    which could apply it, does not change either."""
    a, b = addresses(client)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, GPUDASH_SIMULATE="2x16GiB",
               PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker",
                             client.scheduler.address, "--nthreads", "1", "--no-dashboard",
                             "--name", "two-devices"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client.wait_for_workers(3, timeout=60)
        [c] = [x for x in addresses(client) if x not in (a, b)]
        client.register_plugin(GpudashPlugin())  # devices from GPUDASH_SIMULATE, else 1
        assert {x: on(client, x, _devices) for x in (a, b, c)} == {a: 1, b: 1, c: 2}
        before = {x: on(client, x, _all_settings) for x in (a, b, c)}
        with pytest.raises(ConfigError) as info:
            configure_workers(client, device=1, per_process_gpu_memory_fraction=0.5)
        text = str(info.value)
        assert a in text and b in text and c not in text and "device 1" in text, text
        assert {x: on(client, x, _all_settings) for x in (a, b, c)} == before
        # by name, only the worker that has the device: applied
        out = configure_workers(client, workers=["two-devices"], device=1,
                                per_process_gpu_memory_fraction=0.5)
        assert [d["limit"] for d in out[c]] == [before[c][0][3], 8 * GIB]
    finally:
        client.retire_workers([x for x in addresses(client) if x not in (a, b)])
        proc.terminate()
        proc.wait(timeout=30)


def test_feed_samples_match_the_workers_chunk_table(client, model):
    a, _ = addresses(client)
    assert model.wait(lambda w: a in w, timeout=5)
    feed = model.feed(a)
    assert feed.kind == "dask" and feed.name == f"{a} GPU_0_bfc" and feed.capacity == 16 * GIB
    assert feed.controls is None
    woken = threading.Event()
    feed.start(woken.set)
    try:
        run = on(client, a, _random_workload, 5, 2000)
        assert on(client, a, _oom, 64 * GIB) == 64 * GIB
        assert model.sync()
        assert woken.wait(5)
        sample = feed.sample()
        assert sample is not None
        table = on(client, a, _chunk_table)
        assert list(sample.table) == list(table)
        for k in table:
            assert np.array_equal(sample.table[k], table[k]), k
        assert sample.stats.bytes_in_use == run["in_use"] == int(table["size"][
            table["in_use"]].sum())
        assert sample.stats.pool_bytes == int(table["regions"][:, 1].sum())
        assert sample.allocs == run["allocs"] and sample.frees == run["frees"]
        assert [o[2] for o in sample.ooms] == [64 * GIB]
        assert sample.extra["worker"] == a
        assert feed.sample() is None  # nothing new
        # controls act on that worker only, validated first
        feed.configure(per_process_gpu_memory_fraction=0.5)
        assert on(client, a, _limit) == 8 * GIB
        with pytest.raises(ConfigError):
            feed.configure(per_process_gpu_memory_fraction=2)
        assert on(client, a, _limit) == 8 * GIB
        assert model.sync()
        s = feed.sample()
        assert s.stats.bytes_limit == 8 * GIB
        assert ("per_process_gpu_memory_fraction", 0.0, 0.5) in [x[1:] for x in s.settings]
        assert feed.settings()["fraction"] == 0.5 and feed.settings()["limit"] == 8 * GIB
        assert feed.release_free_regions() >= 0 and feed.flush_deferred() >= 0
    finally:
        feed.stop()


def _build_live(n):
    import random

    s = worker_session()
    rng = random.Random(4)
    s._test_live = [s.allocate(int(2 ** rng.uniform(8, 16))) for _ in range(n)]
    return len(s._test_live)


def _trickle(ops, pause):
    import random

    s = worker_session()
    rng = random.Random(5)
    live = s._test_live
    for _ in range(ops // 2):
        i = rng.randrange(len(live))
        s.free_now(live[i])
        live[i] = s.allocate(int(2 ** rng.uniform(8, 16)))
        time.sleep(pause)
    return s.devices[0].allocator.bytes_in_use


def _layout_mode():
    from distributed import get_worker

    from gpudash.dask.plugin import _runtime_of

    ds = _runtime_of(get_worker()).devices[0]
    return {"layout_events": ds.layout_events, "journal": ds.ev_remove is not None}


def test_a_large_quiet_layout_travels_as_events(client):
    """A watched device with many chunks and few operations sends its layout as events
    (smaller than tables); the feed's table still equals the worker's, and tables resume
    when the client stops watching."""
    a, _ = addresses(client)
    with ClusterModel(client, record=False) as m:
        assert m.wait(lambda w: a in w, 5)
        on(client, a, _build_live, 4000)
        feed = m.feed(a)
        feed.start(lambda: None)
        try:
            on(client, a, _trickle, 40, 0.02)  # ~100 operations a second
            assert on(client, a, _layout_mode) == {"layout_events": True, "journal": True}
            tables_before = m.workers[a]["devices"][0]["layout_tables"]
            used = on(client, a, _trickle, 60, 0.02)
            assert m.sync()
            dev = m.workers[a]["devices"][0]
            assert dev["layout_tables"] == tables_before  # the changes came as events
            assert dev["layout_event_batches"] >= 2
            sample = feed.sample()
            table = on(client, a, _chunk_table)
            assert len(table["ptr"]) > 4000
            for k in table:
                assert np.array_equal(sample.table[k], table[k]), k
            assert sample.stats.bytes_in_use == used
        finally:
            feed.stop()
    deadline = time.monotonic() + 5
    while on(client, a, _layout_mode)["journal"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert on(client, a, _layout_mode) == {"layout_events": False, "journal": False}


def _many_ooms(n):
    s = worker_session()
    for _ in range(n):
        try:
            s.allocate(64 * GIB)
        except gpudash.OutOfMemoryError:
            pass


def test_ooms_are_counted_exactly_and_their_marks_bounded(client, model):
    a, _ = addresses(client)
    assert model.wait(lambda w: a in w, 5)
    feed = model.feed(a)
    feed.start(lambda: None)
    try:
        assert feed.sample() is not None or model.sync()
        on(client, a, _many_ooms, 100)
        assert model.wait(lambda w: w[a]["ooms"] == 100, 5)
        sample = feed.sample()
        assert 0 < len(sample.ooms) <= 64  # the marks wait in a bounded queue
        assert all(o[2] == 64 * GIB for o in sample.ooms)
    finally:
        feed.stop()


def test_tables_keep_to_their_wire_budget(client):
    budget = 8000
    client.register_plugin(GpudashPlugin(simulate="16GiB", table_bytes_per_s=budget))
    a, _ = addresses(client)
    on(client, a, _build_live, 1500)  # a table of some 15 kB
    with ClusterModel(client, record=False) as m:
        assert m.wait(lambda w: a in w, 5)
        feed = m.feed(a)
        feed.start(lambda: None)
        try:
            t0 = time.monotonic()
            on(client, a, _trickle, 3000, 0.0)  # busy: tables, not events
            on(client, a, _trickle, 300, 0.004)
            elapsed = time.monotonic() - t0
            tables = m.workers[a]["devices"][0]["layout_tables"]
            table_bytes = len(_wire.encode_table(on(client, a, _chunk_table))["z"])
            # the first (forced) table, then at most the budget's worth
            assert tables <= 2 + elapsed * budget / table_bytes, (tables, elapsed, table_bytes)
            assert m.sync()
            # a watched layout that changed is sent again once the budget allows
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                sample = feed.sample()
                table = on(client, a, _chunk_table)
                if sample is not None and len(sample.table["ptr"]) == len(table["ptr"]) and \
                        all(np.array_equal(sample.table[k], table[k]) for k in table):
                    break
                time.sleep(0.5)
            else:
                pytest.fail("the layout never caught up")
        finally:
            feed.stop()


def test_collect_traces_one_device_per_worker(client, model, tmp_path):
    a, b = addresses(client)
    runs = {a: on(client, a, _random_workload, 1, 800, True),
            b: on(client, b, _random_workload, 2, 500, True)}
    configure_workers(client, workers=[b], per_process_gpu_memory_fraction=0.5)
    path = tmp_path / "run.gdtrace"
    trace = collect_traces(client, path)
    back = read_trace(path)
    assert back == trace
    devices = back.meta["devices"]
    assert [d["name"] for d in devices] == sorted([a, b], key=lambda x: [
        d["worker"] for d in devices].index(x))
    assert sorted(d["name"] for d in devices) == [a, b]
    assert all(d["dropped_events"] == 0 and not d["gone"] for d in devices)
    for i, d in enumerate(devices):
        own = back.select(device=i).columns
        local = runs[d["worker"]]["columns"]
        # the worker's own Recorder saw a stretch of the same events: the trace has them all
        idx = np.searchsorted(own["seq"], local["seq"])
        assert np.array_equal(own["seq"][idx], local["seq"])
        for col in ("kind", "ptr", "size", "requested", "bin", "region", "alloc_id"):
            assert np.array_equal(own[col][idx], local[col]), (d["worker"], col)
        assert int((own["kind"] == 1).sum()) == runs[d["worker"]]["allocs"]
    ib = [d["worker"] for d in devices].index(b)
    changes = [s for s in back.settings if s["device"] == ib]
    assert {"setting": "per_process_gpu_memory_fraction", "old": 0.0, "new": 0.5} in [
        {k: s[k] for k in ("setting", "old", "new")} for s in changes]
    with pytest.raises(ConfigError, match="exists"):
        collect_traces(client, path)


def test_messages_leave_a_worker_in_the_order_they_are_numbered(client, model):
    """A message the stream thread numbered goes out before one the worker's event loop
    numbers after it (client.run: sync, lease), so the client never drops it as old and its
    events reach the trace."""
    a, _ = addresses(client)
    sizes = [MIB, 2 * MIB, 5 * MIB]
    out = client.run(_thread_tick_then_sync, sizes, workers=[a])[a]
    assert out["before"] < out["thread"] and out["sync"] == out["thread"] + 1
    numbers = [msg["n"] for _, msg in client.get_events(_wire.TOPIC)
               if msg.get("worker") == a and msg.get("rid") == out["rid"]]
    assert numbers == sorted(numbers), numbers
    trace = collect_traces(client, model=model)
    dev = [d["index"] for d in trace.meta["devices"] if d["worker"] == a]
    allocs = trace.select(kinds="alloc", device=dev[0]).columns["requested"].tolist()
    assert allocs == sizes


def test_a_plugin_registered_again_is_a_new_device_of_the_trace(client, model):
    a, b = addresses(client)
    on(client, a, _allocate, [MIB])
    client.register_plugin(GpudashPlugin(simulate="16GiB"))
    deadline = time.monotonic() + 10
    while not on(client, a, _runtime_state)["journal_on"] and time.monotonic() < deadline:
        time.sleep(0.1)  # the model leases the new stream within a second or so
    on(client, a, _allocate, [2 * MIB, 3 * MIB])
    trace = collect_traces(client)
    devices = {d["name"]: d for d in trace.meta["devices"]}
    assert set(devices) == {a, b, f"{a} (plugin run 2)"}, list(devices)
    sizes = {name: sorted(trace.select(kinds="alloc", device=d["index"]).columns[
        "requested"].tolist()) for name, d in devices.items()}
    assert sizes[a] == [MIB] and sizes[f"{a} (plugin run 2)"] == [2 * MIB, 3 * MIB]


def test_collect_traces_needs_a_recording_model(client):
    with ClusterModel(client, record=False) as m:
        with pytest.raises(ConfigError, match="record"):
            collect_traces(client)
        with pytest.raises(ConfigError, match="record=False"):
            collect_traces(client, model=m)


def test_event_budget_drops_and_counts(client, tmp_path):
    """A worker keeps at most max_event_rate / rate_hz operations between two messages;
    the rest are dropped and counted, and the layout stays exact (tables do not depend on
    events). With no client leasing, the allocator's journal is off."""
    client.register_plugin(GpudashPlugin(simulate="16GiB", rate_hz=4, max_event_rate=400))
    a, _ = addresses(client)
    assert on(client, a, _runtime_state)["journal_on"] is False
    with ClusterModel(client) as m:
        state = on(client, a, _runtime_state)
        assert state["journal_on"] and state["ev_cap"] == 100
        feed = m.feed(a) if m.wait(lambda w: a in w, 5) else None
        feed.start(lambda: None)
        run = on(client, a, _random_workload, 9, 4000)
        assert on(client, a, _runtime_state)["ev_ops"] <= 100
        assert m.sync()
        w = m.workers[a]["devices"][0]
        assert w["dropped_events"] > 0
        assert w["recorded_events"] + w["dropped_events"] >= run["allocs"] + run["frees"]
        trace = collect_traces(client, tmp_path / "t.gdtrace", model=m)
        dev = [d for d in trace.meta["devices"] if d["worker"] == a][0]
        assert dev["dropped_events"] == w["dropped_events"]
        sample = feed.sample()
        table = on(client, a, _chunk_table)
        assert all(np.array_equal(sample.table[k], table[k]) for k in table)
        feed.stop()
    # the lease ends with the model: the journal goes off at the worker's next tick
    deadline = time.monotonic() + 5
    while on(client, a, _runtime_state)["journal_on"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert on(client, a, _runtime_state)["journal_on"] is False


def test_an_absent_client_stops_costing_the_workers(client):
    """A client that records and then disappears without a word: once its lease runs out,
    the workers turn their event journal off again and send summaries only."""
    a, b = addresses(client)
    code = ("import os, sys\n"
            "from distributed import Client\n"
            "from gpudash.dask import ClusterModel\n"
            "c = Client(sys.argv[1])\n"
            "m = ClusterModel(c, record=True, lease_ttl=2.0)\n"
            "print('leased', flush=True)\n"
            "os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code, client.scheduler.address],
                         capture_output=True, text=True, timeout=60)
    assert "leased" in out.stdout, out.stderr
    assert on(client, a, _runtime_state)["journal_on"]  # the lease holds for a while
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not any(on(client, x, _runtime_state)["journal_on"] for x in (a, b)):
            break
        time.sleep(0.2)
    assert not on(client, a, _runtime_state)["journal_on"]
    assert not on(client, b, _runtime_state)["journal_on"]


def _slow_stream(seconds):
    """Make Dask's outgoing stream slow (one batch per ``seconds``) while allocating."""
    from distributed import get_worker

    from gpudash.dask.plugin import _runtime_of

    w = get_worker()
    rt = _runtime_of(w)
    bs = w.batched_stream
    old = bs.interval
    bs.interval = seconds
    try:
        # let the stream pick up the new interval, then keep the allocator busy
        s = rt.session
        end = time.monotonic() + 3 * seconds
        peak = 0
        while time.monotonic() < end:
            p = s.allocate(MIB)
            s.free_now(p)
            queued = sum(1 for m in list(bs.buffer) if isinstance(m, dict)
                         and m.get("topic") == _wire.TOPIC)
            peak = max(peak, queued)
            time.sleep(0.001)
        return {"dropped": rt.dropped["messages"], "peak_queued": peak}
    finally:
        bs.interval = old


def test_a_slow_comm_never_queues_more_than_one_message(client):
    a, _ = addresses(client)
    out = on(client, a, _slow_stream, 1.0)
    assert out["dropped"] > 0
    assert out["peak_queued"] <= 1


def test_sweep_on_the_cluster_equals_local(client):
    trace = training_loop(steps=3, layers=4, hidden=2048, seed=1)
    kw = dict(fractions=(0.05, 0.1, 0.2, 0.4), allow_growth=(True, False),
              device_bytes="4GiB")
    seen = []
    remote = sweep(trace, client=client, progress=lambda d, t: seen.append((d, t)), **kw)
    local = sweep(trace, **kw)
    assert remote == local and remote.rows == local.rows
    assert seen[-1] == (8, 8) and [d for d, _ in seen] == list(range(1, 9))
    with pytest.raises(ValueError, match="not both"):
        sweep(trace, client=client, jobs=2, **kw)
    r_local = min_fraction(trace, "4GiB", tolerance=0.01)
    r_remote = min_fraction(trace, "4GiB", tolerance=0.01, client=client)
    assert (r_remote.fraction, r_remote.history, r_remote.replays, r_remote.known,
            r_remote.limit_bytes) == (r_local.fraction, r_local.history, r_local.replays,
                                      r_local.known, r_local.limit_bytes)


def test_min_fraction_bisects_several_levels_at_once_with_the_same_result():
    """With 3 threads the bisection replays three midpoints per round; the fractions it
    reports, its history, the fractions it knew without a replay and its progress are still
    those of the local run."""
    trace = training_loop(steps=3, layers=4, hidden=2048, seed=1)
    with LocalCluster(n_workers=1, threads_per_worker=3, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        progress_local: list = []
        progress_remote: list = []
        r_local = min_fraction(trace, "4GiB", tolerance=0.002,
                               progress=lambda d, t: progress_local.append((d, t)))
        with distributed.get_task_stream(client=c) as stream:
            r_remote = min_fraction(trace, "4GiB", tolerance=0.002, client=c,
                                    progress=lambda d, t: progress_remote.append((d, t)))
        keys = [t["key"] for t in stream.data if "gpudash-bisect" in str(t["key"])]
    assert (r_remote.fraction, r_remote.history, r_remote.replays, r_remote.known,
            r_remote.non_monotone) == (r_local.fraction, r_local.history, r_local.replays,
                                       r_local.known, r_local.non_monotone)
    assert progress_remote == progress_local
    # speculation: more replays ran than the path needed, in fewer rounds
    assert len(keys) > r_local.replays


_REFUSED: list = []   # the fraction _fits_or_refuse fails at (set by the test below)


def _fits_or_refuse(settings, calls, max_ooms):
    """The bisection's task (``_fits_task``), failing at one fraction beside the path."""
    from gpudash.dask._whatif import _lists
    from gpudash.trace.tasks import probe

    if settings["fraction"] in _REFUSED:
        raise ValueError(f"no replay at {settings['fraction']}")
    return tuple(probe(settings, _lists(calls), max_ooms))


def test_min_fraction_survives_a_replay_failing_beside_its_path(monkeypatch):
    """A replay the cluster runs ahead of the path may fail; only the path's count."""
    from gpudash.dask import _whatif
    from gpudash.trace import tasks

    trace = training_loop(steps=3, layers=4, hidden=2048, seed=1)
    asked: list = []
    real_ahead = tasks._ahead

    def ahead(*args):
        out = real_ahead(*args)
        asked.extend(out)
        return out

    monkeypatch.setattr(tasks, "_ahead", ahead)
    r_local = min_fraction(trace, "4GiB", tolerance=0.002, jobs=3)
    beside = [f for f in asked if f not in dict(r_local.history)]
    assert beside   # three replays a round: some were off the path
    _REFUSED[:] = beside
    monkeypatch.setattr(_whatif, "_fits_task", _fits_or_refuse)
    try:
        with LocalCluster(n_workers=1, threads_per_worker=3, processes=False,
                          dashboard_address=":0") as cluster, Client(cluster) as c:
            r_remote = min_fraction(trace, "4GiB", tolerance=0.002, client=c)
    finally:
        _REFUSED.clear()
    assert (r_remote.fraction, r_remote.history, r_remote.known) == (
        r_local.fraction, r_local.history, r_local.known)


def test_cli_whatif_on_a_scheduler(client, tmp_path, capsys):
    from gpudash.cli import main
    from gpudash.trace import save_trace

    path = tmp_path / "t.gdtrace"
    save_trace(training_loop(steps=2, layers=3, hidden=1024, seed=2), path)
    address = client.scheduler.address
    args = ["whatif", str(path), "--device", "1GiB", "--fractions", "0.05,0.2,0.6"]
    assert main(args + ["--jobs", "1"]) == 0
    local = capsys.readouterr().out
    assert main(args + ["--scheduler", address]) == 0
    remote = capsys.readouterr().out
    assert f"Dask cluster at {address} (2 worker(s))" in remote
    table = lambda text: text[text.index("fraction  growth"):]  # noqa: E731
    assert table(remote) == table(local)
    assert "smallest fraction that fits" in remote
    import dask

    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        assert main(args + ["--scheduler", "tcp://127.0.0.1:1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach the Dask scheduler" in err[0]


def test_cli_whatif_on_a_dask_scheduler_and_worker_of_its_own(tmp_path, capsys):
    """As run by hand: `dask scheduler` and `dask worker` processes, and `gpudash whatif
    --scheduler` in a process of its own, where no Dask client is the default one."""
    from gpudash.cli import main
    from gpudash.trace import save_trace

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    path = tmp_path / "t.gdtrace"
    save_trace(training_loop(steps=2, layers=3, hidden=1024, seed=2), path)
    args = ["whatif", str(path), "--device", "1GiB", "--fractions", "0.05,0.2,0.6"]
    sched_file = tmp_path / "scheduler.json"
    dask = [sys.executable, "-m", "dask"]
    procs = [subprocess.Popen(dask + ["scheduler", "--scheduler-file", str(sched_file),
                                      "--port", "0", "--dashboard-address", ":0"],
                              env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    try:
        assert wait_for(sched_file.exists, 60), "the scheduler did not start"
        procs.append(subprocess.Popen(dask + ["worker", "--scheduler-file", str(sched_file),
                                              "--nthreads", "2", "--no-nanny",
                                              "--dashboard-address", ":0"],
                                      env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        import json

        address = json.loads(sched_file.read_text())["address"]
        with Client(address, set_as_default=False) as c:
            c.wait_for_workers(1, timeout=60)
        out = subprocess.run([sys.executable, "-m", "gpudash"] + args +
                             ["--scheduler", address], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:  # a worker that lost its scheduler may try to reach it again: not for long
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "internal error" not in out.stderr
    assert f"Dask cluster at {address} (1 worker(s))" in out.stdout
    assert "smallest fraction that fits" in out.stdout
    assert main(args + ["--jobs", "1"]) == 0
    local = capsys.readouterr().out
    table = lambda text: text[text.index("fraction  growth"):]  # noqa: E731
    assert table(out.stdout) == table(local)


def test_cluster_dashboard_rows_controls_and_views(client):
    import ipywidgets as widgets

    a, b = addresses(client)
    dash = ClusterDashboard(client, views=lambda feeds: widgets.Label(
        ", ".join(f.name for f in feeds)))
    try:
        assert dash.model.wait(lambda w: {a, b} <= set(w), 5)
        on(client, a, _allocate, [300 * MIB])
        assert dash.model.wait(lambda w: w[a]["bytes_in_use"] == 300 * MIB, 5)
        dash.update()
        assert sorted(dash.rows) == [a, b] and len(dash.rows_box.children) == 2
        row = dash.rows[a]
        assert "300.00 MiB" in row.figures.value and "<polyline" in row.spark.value
        assert "0 OOM" in row.ooms.value and "live" in row.state.value
        assert "frag" in row.frag.value
        assert [v for _, v in dash.target.options] == ["", a, b]
        # all workers, through the controls (only what was touched applies)
        dash.fraction.value = 0.3
        assert dash.apply_touched() is not None
        assert on(client, a, _settings)[0] == on(client, b, _settings)[0] == 0.3
        assert dash.error.value == "" and "2 worker(s)" in dash.status.value
        assert dash.apply_touched() is None and "nothing to apply" in dash.status.value
        # one worker
        dash.target.value = b
        dash.growth.value = True
        dash.apply_touched()
        assert on(client, b, _settings)[1] is True and on(client, a, _settings)[1] is False
        # refused on the client: nothing changes anywhere
        dash.target.value = ""
        before = {x: on(client, x, _settings) for x in (a, b)}
        assert dash.apply(per_process_gpu_memory_fraction=-1) is None
        assert "refused" in dash.error.value and "per_process_gpu_memory_fraction" in \
            dash.error.value
        # refused by the workers: shown with their names, nothing changes
        assert dash.apply(per_process_gpu_memory_fraction=1.5) is None
        assert a in dash.error.value and b in dash.error.value
        assert {x: on(client, x, _settings) for x in (a, b)} == before
        assert dash.release_free_regions() is not None and dash.flush_deferred() is not None
        # picking a worker opens its views from its feeds; views without controls of their
        # own leave the cluster's shown, aimed at the picked worker
        view = dash.pick(a)
        assert isinstance(view, widgets.Label) and view.value == f"{a} GPU_0_bfc"
        assert dash.detail.children[-1] is view
        assert dash.target.value == a and dash.controls.layout.display != "none"
    finally:
        dash.close()
    assert dash.model.closed


def test_cluster_dashboard_controls_show_what_the_workers_run(client):
    """The controls show the workers' settings, whoever set them, say "mixed" where the
    target workers differ, and apply a fraction as the slider shows it."""
    import ipywidgets as widgets

    a, b = addresses(client)
    configure_workers(client, per_process_gpu_memory_fraction=0.5)
    dash = ClusterDashboard(client, views=lambda feeds: widgets.Label())
    try:
        assert wait_for(lambda: dash.fraction.value == 0.5)
        assert dash.fraction_label.value == ""  # the slider says it all
        configure_workers(client, workers=[b], per_process_gpu_memory_fraction=0.25,
                          allow_growth=True)
        assert wait_for(lambda: dash.fraction_label.value == "<b>mixed:</b> 0.25, 0.5")
        assert dash.growth.description == "allow growth (mixed)"
        dash.target.value = b  # one worker: its own settings, nothing mixed
        assert (dash.fraction.value, dash.fraction_label.value) == (0.25, "")
        assert dash.growth.value is True and dash.growth.description == "allow growth"
        dash.target.value = a
        assert (dash.fraction.value, dash.growth.value) == (0.5, False)
        dash.fraction.value = 0.4  # moved, not applied: the label says what runs
        assert dash.fraction_label.value == "now 0.5"
        # a browser's slider sends 0.05 + 20 * 0.01 as it computes it; the readout says 0.25
        dash.target.value = ""
        assert "mixed" in dash.fraction_label.value
        dash.fraction.value = 0.24999999999999994
        assert dash.apply_touched() is not None
        assert on(client, a, _settings)[0] == on(client, b, _settings)[0] == 0.25
        assert "per_process_gpu_memory_fraction=0.25 on 2 worker(s)" in dash.status.value
        assert dash.fraction_label.value == ""
        # deferred deletion, as the workers run it
        configure_workers(client, deferred_deletion_bytes=64 * MIB)
        assert wait_for(lambda: dash.deferred_label.value == "64.00 MiB")
        assert dash.deferred.value == 64 * MIB
        dash.deferred.value = 16 * MIB
        assert dash.deferred_label.value == "16.00 MiB &middot; now 64.00 MiB"
    finally:
        dash.close()


def test_picking_a_worker_opens_its_dashboard_whose_controls_act_on_it(client):
    """``views_for`` is the usual :class:`gpudash.widgets.Dashboard` over the worker's feeds:
    it shows what the worker's allocator holds, and its controls change that worker only."""
    from gpudash.widgets.dashboard import Dashboard

    a, b = addresses(client)
    dash = ClusterDashboard(client)
    try:
        # both workers listed (b is picked below: a row the dashboard has not shown yet
        # cannot be picked)
        assert dash.model.wait(lambda w: a in w and b in w, 10)
        assert repr(dash.model).startswith("ClusterModel(2 live, 0 gone, record=")
        on(client, a, _allocate, [10 * MIB])
        assert dash.model.wait(lambda w: w[a]["bytes_in_use"] == 10 * MIB, 5)
        on(client, a, _allocate, [30 * MIB])
        assert dash.model.wait(lambda w: w[a]["bytes_in_use"] == 40 * MIB, 5)
        history = dash.model.history(a, 0)
        with dash._lock:  # the list not refreshed yet (the model's thread lags): pick lists it
            dash.target.options = [("all workers", "")]
            view = dash.pick(a)
        assert isinstance(view, Dashboard) and dash.detail.children[-1] is view
        assert view.setup["devices"] == [f"{a} GPU_0_bfc"]
        assert wait_for(lambda: view.model.state(0) is not None and
                        view.model.state(0).stats.bytes_in_use == 40 * MIB)
        # one set of controls, the views', acting on the picked worker
        assert dash.controls.layout.display == "none" and dash.target.value == a
        # the timeline starts with the worker's history, then goes on without a gap or dip
        timeline = view.model.state(0).timeline
        k = len(history["time_ms"]) - 1  # the last point is the views' first sample
        assert k >= 2 and np.array_equal(timeline["time_ms"][:k], history["time_ms"][:k])
        assert np.array_equal(timeline["in_use"][:k], history["bytes_in_use"][:k])
        assert 10 * MIB in timeline["in_use"][:k].tolist()
        assert set(timeline["in_use"][k:].tolist()) == {40 * MIB}
        assert view.model.start_ms == history["time_ms"][0]
        # the worker's deferred deletion can be flushed and tuned from its dashboard
        assert view._controls_info(0)["session"] is True
        assert view._act({"name": "flush"})["ok"]
        before_b = on(client, b, _settings)
        reply = view._act({"name": "fraction", "value": 0.25})
        assert reply["ok"], reply
        assert on(client, a, _settings)[0] == 0.25 and on(client, b, _settings) == before_b
        dash.pick(b)  # the previous views close, and their model with them
        assert view.model.closed and dash.target.value == b
        dash.unpick()  # the cluster's controls again, for all workers
        assert dash.view is None and dash.detail.children == ()
        assert dash.controls.layout.display != "none" and dash.target.value == ""
    finally:
        dash.close()


# ---------------------------------------------------------------------- death and shutdown
def _pid():
    return os.getpid()


def test_a_killed_worker_is_gone_and_the_other_keeps_streaming(tmp_path):
    with _local_cluster() as cluster, Client(cluster) as c:
        c.wait_for_workers(2)
        c.register_plugin(GpudashPlugin(simulate="16GiB"))
        model = ClusterModel(c)
        dash = ClusterDashboard(c, model=model)
        try:
            a, b = addresses(c)
            on(c, a, _random_workload, 3, 300)
            on(c, b, _allocate, [MIB])
            assert model.wait(lambda w: w.get(a, {}).get("allocs", 0) > 0 and
                              w.get(b, {}).get("allocs", 0) > 0, 5)
            assert model.sync()
            events_a = model.workers[a]["devices"][0]["recorded_events"]
            assert events_a > 0
            pid = c.run(_pid, workers=[a])[a]
            os.kill(pid, signal.SIGKILL)
            assert model.wait(lambda w: w[a]["gone"], timeout=15), model.workers[a]
            gone = model.workers[a]
            assert gone["state"] == "gone" and gone["allocs"] > 0
            assert len(model.history(a)["time_ms"]) > 0
            dash.update()
            assert "gone" in dash.rows[a].state.value and dash.rows[a].pick.disabled
            assert model.feed(a).controls is not None
            # the other keeps streaming
            on(c, b, _allocate, [2 * MIB])
            assert model.wait(lambda w: w[b]["bytes_in_use"] == 3 * MIB and not w[b]["gone"],
                              timeout=5)
            # the nanny's replacement is a worker that joins later: it gets a session too
            c.wait_for_workers(2, timeout=30)
            new = [x for x in addresses(c) if x not in (a, b)]
            assert len(new) == 1
            assert on(c, new[0], _session_facts)["kind"] == "simulated"
            assert model.wait(lambda w: new[0] in w and w[new[0]]["state"] == "live", 10)
            # the dead worker keeps what it sent in a trace
            trace = collect_traces(c, tmp_path / "after-death.gdtrace")
            by_worker = {d["worker"]: d for d in trace.meta["devices"]}
            assert by_worker[a]["gone"] and by_worker[a]["recorded_events"] == events_a
            ia = by_worker[a]["index"]
            assert int((trace.columns["device"] == ia).sum()) >= events_a
        finally:
            dash.close()
            model.close()


def test_clean_shutdown_leaves_no_threads_or_comms():
    from distributed.comm.core import Comm

    def ours() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("gpudash")]

    assert ours() == []
    before = {id(comm) for comm in list(Comm._instances) if not comm.closed()}
    with _local_cluster() as cluster, Client(cluster) as c:
        c.register_plugin(GpudashPlugin(simulate="16GiB"))
        model = ClusterModel(c)
        dash = ClusterDashboard(c)
        a, b = addresses(c)
        feed = model.feed(a) if model.wait(lambda w: a in w, 5) else None
        feed.start(lambda: None)
        on(c, a, _random_workload, 4, 200)
        assert model.sync()
        assert "gpudash-cluster-model" in ours()
        # on the workers: the plugin's removal stops its stream and closes the session,
        # and the model shows them stopped
        c.unregister_worker_plugin("gpudash")
        left = c.run(lambda: [t.name for t in threading.enumerate()
                              if t.name.startswith("gpudash")])
        assert left == {a: [], b: []}
        assert model.wait(lambda w: w[a]["state"] == w[b]["state"] == "stopped", 5)
        feed.stop()
        dash.close()
        model.close()
        assert ours() == []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        open_comms = [comm for comm in list(Comm._instances)
                      if not comm.closed() and id(comm) not in before]
        if not open_comms:
            break
        time.sleep(0.1)
    assert open_comms == []
    assert ours() == []


# ---------------------------------------------------------------------- GPU workers
def _cuda_facts():
    import cupy

    s = worker_session()
    before = s.devices[0].allocator.bytes_in_use
    x = cupy.zeros(1 << 20, dtype=cupy.uint8)  # through the session (install=True)
    after = s.devices[0].allocator.bytes_in_use
    del x
    return {"kind": s.devices[0].kind, "installed": s.installed, "grew": after - before}


def _rmm_facts():
    import rmm

    s = worker_session()
    before = s.devices[0].allocator.bytes_in_use
    buf = rmm.DeviceBuffer(size=3 << 20)
    after = s.devices[0].allocator.bytes_in_use
    del buf
    return {"resource": type(rmm.mr.get_current_device_resource()).__name__,
            "grew": after - before}


@pytest.mark.gpu
def test_gpu_worker_uses_cuda_and_routes_cupy():
    with LocalCluster(n_workers=1, processes=True, threads_per_worker=1,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        c.register_plugin(GpudashPlugin(config={"allow_growth": True}))
        [a] = addresses(c)
        facts = on(c, a, _cuda_facts)
        assert facts["kind"] == "cuda" and facts["installed"]
        assert facts["grew"] >= 1 << 20


@pytest.mark.gpu
def test_gpu_worker_routes_rmm_through_the_session():
    pytest.importorskip("rmm")
    with LocalCluster(n_workers=1, processes=True, threads_per_worker=1,
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        c.register_plugin(GpudashPlugin(config={"allow_growth": True}))
        [a] = addresses(c)
        facts = on(c, a, _rmm_facts)
        assert facts["resource"] == "CallbackMemoryResource"
        assert facts["grew"] >= 3 << 20



def test_pytorch_what_ifs_on_the_cluster_equal_local(client):
    """PyTorch's calls travel with their streams and empty_cache() calls."""
    from gpudash.formats.torch_snapshot import load_torch_snapshot
    from gpudash.workloads import caching_snapshot, finetune_calls

    snap = caching_snapshot(finetune_calls(steps=6, layers=6, max_len=1024),
                            device_bytes="8GiB")
    trace = load_torch_snapshot(snap)
    kw = dict(fractions=(0.2, 0.4, 0.8), device_bytes="8GiB")
    remote = sweep(trace, client=client, **kw)
    assert remote == sweep(trace, **kw) and remote.allocator == "torch"
    assert {r["expandable_segments"] for r in remote} == {False, True}
    r_local = min_fraction(trace, "8GiB", tolerance=0.01)
    r_remote = min_fraction(trace, "8GiB", tolerance=0.01, client=client)
    assert (r_remote.fraction, r_remote.history, r_remote.allocator) == (
        r_local.fraction, r_local.history, "torch")
