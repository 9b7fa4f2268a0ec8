"""The worker side: :class:`GpudashPlugin` gives every Dask worker a gpudash session and
streams what its allocators do through Dask's own event channel.

On each worker (those present when the plugin is registered and those that join later) the
plugin

- creates a :class:`~gpudash.Session` from the given ``ConfigProto``/``GPUOptions``: CUDA
  devices where CuPy can use a GPU (``install=True`` routes CuPy's allocations through the
  session; where RMM is importable, ``rmm=True`` makes an ``rmm.mr.CallbackMemoryResource``
  over the session RMM's current device resource, so cuDF and everything else on RMM is
  seen), simulated devices elsewhere;
- runs one thread (``gpudash-dask-stream``) that, at most ``rate_hz`` times a second and only
  when something changed, publishes a message on the Dask topic ``"gpudash"``
  (``Worker.log_event``): per device the allocator's statistics, cumulative allocation, free
  and OOM counts, the OOMs and setting changes since the previous message and the settings
  in force. While a client asks for them (a *lease*, renewed by the client) it adds the
  layout of the devices the client watches -- a chunk table, or the events since the last
  one when they are smaller (a large layout that changes slowly) -- and, while a client
  records, the allocator's events, for traces;
- publishes the same summary in the worker's heartbeat metrics (``gpudash_in_use``,
  ``gpudash_pool``, ``gpudash_limit``, ``gpudash_peak``, ``gpudash_ooms``,
  ``gpudash_fragmentation``, and the full summary as ``gpudash``), which Dask's own
  dashboard lists in its workers table.

Drop policy (a slow or absent client never makes a worker buffer without bound):

- **summaries** are cumulative, so when Dask's outgoing stream still holds the previous
  gpudash message (a slow comm) the worker skips that tick and counts it in
  ``dropped["messages"]``; the next message carries the counts, and up to 64 OOMs and 64
  setting changes per device wait for it (older ones beyond that are only counted);
- **chunk tables** are sent only for devices a client watches, only when the layout changed,
  and at most ``table_bytes_per_s`` on average; a table that would go over waits for a later
  tick and replaces the ones skipped;
- **events** are kept only while a client records or a watched layout travels as events, at
  most ``max_event_rate / rate_hz`` operations per device between two messages: once that
  many wait, newer operations are dropped until the next message and counted in the
  message's ``dropped`` figure (a trace has a gap there; a watched layout gets a table);
- with no client leasing, no tables or events are taken at all (the allocators' event
  journal is off) and only summaries flow; Dask's scheduler keeps the last few of them.

OOMs are counted where the session refuses an allocation (``Session.allocate``, which is
also the path of CuPy and RMM allocations); allocations and frees from the allocator's own
counters, so the summary costs nothing per allocation.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from typing import Any

import numpy as np
from distributed import WorkerPlugin
from distributed.core import Status
from distributed.worker import Worker, get_worker

from .._errors import ConfigError, OutOfMemoryError
from ..options import memory_limit, simulated_devices_from_env
from ..session import Session, _simulate_sizes
from . import _wire
from ..devices import CudaMemory

__all__ = ["GpudashPlugin", "worker_session", "PLUGIN_NAME"]

logger = logging.getLogger("gpudash")

#: The name the plugin is registered under on every worker.
PLUGIN_NAME = "gpudash"
#: OOMs and setting changes per device that wait for the next message (older ones counted).
MAX_PENDING_MARKS = 64

_METRICS = {
    "gpudash_in_use": "bytes_in_use",
    "gpudash_pool": "pool_bytes",
    "gpudash_limit": "bytes_limit",
    "gpudash_peak": "peak_bytes_in_use",
}


class GpudashPlugin(WorkerPlugin):
    """A gpudash session on every Dask worker, streaming its allocators' state.

    Parameters
    ----------
    config : ConfigProto, GPUOptions, dict, optional
        The options of each worker's :class:`~gpudash.Session` (validated here, on the
        client).
    simulate : bool, int, str or list, optional
        Simulated devices (as ``Session(simulate=...)``: ``"16GiB"``, ``"2x16GiB"``...). By
        default a worker uses ``GPUDASH_SIMULATE`` if set, its CUDA GPUs when CuPy can use
        them, and one simulated 16 GiB device otherwise.
    install : bool, default True
        On CUDA devices, route CuPy's allocations through the session.
    rmm : bool, default True
        On CUDA devices where ``rmm`` imports, make RMM's current device resource an
        ``rmm.mr.CallbackMemoryResource`` over the session (restored at teardown).
    rate_hz : float, default 4.0
        Most messages a worker sends a second (0 < rate <= 20).
    max_event_rate : int, default 20000
        Most allocator operations per second and device a worker sends while a client
        records events (each costs about 1 µs to pack on the worker and 10 bytes on the
        wire); beyond it operations are dropped and counted.
    table_bytes_per_s : int, default 262144
        Average wire budget for the chunk tables of watched devices, per worker.

    Examples
    --------
    >>> from dask.distributed import Client, LocalCluster          # doctest: +SKIP
    >>> client = Client(LocalCluster(n_workers=2, threads_per_worker=1))  # doctest: +SKIP
    >>> client.register_plugin(GpudashPlugin(simulate="16GiB"))     # doctest: +SKIP
    """

    name = PLUGIN_NAME
    idempotent = False

    def __init__(self, config: Any = None, *, simulate: Any = None, install: bool = True,
                 rmm: bool = True, rate_hz: float = 4.0, max_event_rate: int = 20_000,
                 table_bytes_per_s: int = 256 << 10) -> None:
        self.config = None if config is None else Session._to_config(config)
        if simulate is not None and simulate is not False:
            _simulate_sizes(simulate)  # validate here: a bad size fails on the client
        self.simulate = simulate
        self.install = _bool("install", install)
        self.rmm = _bool("rmm", rmm)
        self.rate_hz = _number("rate_hz", rate_hz, 0.0, 20.0, "messages a second, in (0, 20]")
        self.max_event_rate = int(_number("max_event_rate", max_event_rate, 0, float("inf"),
                                          "operations a second, > 0"))
        self.table_bytes_per_s = int(_number("table_bytes_per_s", table_bytes_per_s, 0,
                                             float("inf"), "bytes a second, > 0"))
        self._runtime: _Runtime | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_runtime"] = None  # per worker, never pickled
        return state

    def setup(self, worker: Any) -> None:
        self._runtime = _Runtime(self, worker)

    def teardown(self, worker: Any) -> None:
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            runtime.close()

    @property
    def session(self) -> Session | None:
        """This worker's session (None before setup and after teardown)."""
        return None if self._runtime is None else self._runtime.session

    def __repr__(self) -> str:
        return (f"GpudashPlugin(config={self.config!r}, simulate={self.simulate!r}, "
                f"rate_hz={self.rate_hz})")


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"GpudashPlugin {name} must be True or False; got {value!r}")
    return value


def _number(name: str, value: Any, lo: float, hi: float, accepted: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"GpudashPlugin {name} must be a number ({accepted}); got {value!r}")
    if not lo < value <= hi:
        raise ConfigError(f"GpudashPlugin {name} must be {accepted}; got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------ session
class _WorkerSession(Session):
    """A Session that tells the worker's stream about refused allocations."""

    _gpudash_on_oom: Any = None

    def allocate(self, nbytes: int, device: Any = 0) -> int:
        try:
            return super().allocate(nbytes, device)
        except OutOfMemoryError as exc:
            hook = self._gpudash_on_oom
            if hook is not None:
                hook(self.device(device).index, exc)
            raise


def worker_session(dask_worker: Any = None) -> Session:
    """The gpudash session of a Dask worker: the worker running the current task
    (``client.submit``), or the worker a ``client.run`` function runs on.

    Parameters
    ----------
    dask_worker : distributed.Worker, optional
        The worker, as ``client.run`` passes it to a function with a ``dask_worker``
        argument. By default the worker running the current task, else the worker whose
        event loop runs this call (a function run by ``client.run``).

    Raises
    ------
    ConfigError
        Outside a Dask worker, on a worker without :class:`GpudashPlugin`, or inside
        ``client.run`` in a process where several workers share one event loop (a
        ``LocalCluster(processes=False)``: pass ``dask_worker`` there).

    Examples
    --------
    >>> client.submit(lambda: worker_session().allocate(1 << 20)).result()  # doctest: +SKIP
    >>> client.run(lambda: worker_session().bytes_in_use())                 # doctest: +SKIP
    >>> client.run(lambda dask_worker: worker_session(dask_worker).bytes_in_use())  # doctest: +SKIP
    """
    worker = dask_worker if dask_worker is not None else _current_worker()
    runtime = _runtime_of(worker)
    if runtime is None:
        raise ConfigError(f"worker {worker.address} has no gpudash session: register the "
                          "plugin first, client.register_plugin(gpudash.dask.GpudashPlugin())")
    return runtime.session


def _current_worker() -> Any:
    """The worker of the running task, else the one whose event loop runs this thread.

    Errors are raised outside Dask's ``except``: an error chained to Dask's LookupError
    would carry its ContextVar, which cannot be pickled back to the client."""
    try:
        return get_worker()
    except ValueError:
        pass
    me = threading.get_ident()
    here = [w for w in list(Worker._instances)
            if getattr(w, "thread_id", None) == me and w.status != Status.closed]
    if len(here) == 1:
        return here[0]
    if here:
        raise ConfigError(
            f"{len(here)} Dask workers share this event loop (a LocalCluster with "
            "processes=False), so worker_session() cannot tell which one runs this "
            "client.run call: take the worker as an argument and pass it, "
            "client.run(lambda dask_worker: worker_session(dask_worker)...)")
    raise ConfigError("worker_session() works in a Dask task (client.submit(fn)) or in a "
                      "function client.run(fn) runs on the workers; there is no Dask worker "
                      "here")


def _runtime_of(worker: Any) -> _Runtime | None:
    plugin = getattr(worker, "plugins", {}).get(PLUGIN_NAME)
    return getattr(plugin, "_runtime", None)


# ------------------------------------------------------------------------------ devices
class _DeviceStream:
    """What the stream knows of one device: counters, pending marks, the event buffer, and
    how its layout reaches a watching client (tables, or the events since the last one)."""

    #: A layout switches to events when they are expected to cost less than half a table
    #: (and back when they cost more than one); tables under this many bytes stay tables.
    SMALL_TABLE = 8192

    def __init__(self, index: int, device: Any, rate_hz: float, max_event_rate: int) -> None:
        self.index = index
        self.device = device
        self.alloc = device.allocator
        # summary
        self.stats: Any = None
        self.key: tuple | None = None
        self.num_allocs = 0
        self.live = 0
        self.allocs = 0
        self.frees = 0
        self.ops_last = 0
        self.ooms = 0
        self.settings_total = 0
        self.new_ooms: deque = deque(maxlen=MAX_PENDING_MARKS)
        self.new_settings: deque = deque(maxlen=MAX_PENDING_MARKS)
        self.last_opts: tuple | None = None
        # layout of a watched device
        self.watched = False
        self.layout_events = False  # the journal is on so that events carry the layout
        self.chain_ok = False  # events since the last layout point are all here
        self.need_table = False
        self.table_key: tuple | None = None
        self.table_bpc = 12.0  # bytes per chunk of the last table sent
        self.event_bpo = 16.0  # bytes per operation of the last events sent
        # events (guarded by the allocator's lock: the sink runs under it)
        self.ev_cap = max(1, int(max_event_rate / rate_hz))
        self.ev_remove: Any = None
        self.ev_pending: list = []
        self.ev_ops = 0
        self.ev_dropping = False
        self.ev_dropped = 0
        self.ev_seq0 = 0
        self.ev_aid0 = 0
        self.ev_extra: dict = {}
        self.ev_regions: list = []

    # -------------------------------------------------------------- summary
    def observe(self, now: int, lock: threading.Lock) -> bool:
        """Read the allocator's counters; note setting changes. True when anything changed."""
        alloc = self.alloc
        with alloc._lock:
            st = alloc._stats()
            live = len(alloc._by_ptr) - sum(map(len, alloc._bins))
        dev = self.device
        opts = dev.options
        cur = (opts.per_process_gpu_memory_fraction, opts.allow_growth,
               dev._deferred.threshold, st.bytes_limit)
        na = st.num_allocs
        da = na - self.num_allocs if na >= self.num_allocs else na  # clear_stats() resets
        with lock:
            self.num_allocs = na
            self.allocs += da
            df = max(0, da - (live - self.live))
            self.frees += df
            self.ops_last = da + df
            self.live = live
            if self.last_opts is not None and cur != self.last_opts:
                names = ("per_process_gpu_memory_fraction", "allow_growth",
                         "deferred_deletion_bytes", "memory_limit")
                for name, old, new in zip(names, self.last_opts, cur):
                    if old != new:
                        self.settings_total += 1
                        self.new_settings.append([now, name, old, new])
            self.last_opts = cur
            key = (na, st.bytes_in_use, st.pool_bytes, st.bytes_limit, live)
            changed = key != self.key or bool(self.new_ooms) or bool(self.new_settings)
            self.key = key
            self.stats = st
        return changed

    def entry(self, lock: threading.Lock, pop: bool) -> dict:
        dev = self.device
        opts = dev.options
        backend = dev.backend
        with lock:
            ooms = [list(o) for o in self.new_ooms]
            settings = [list(s) for s in self.new_settings]
            if pop:
                self.new_ooms.clear()
                self.new_settings.clear()
            out = {
                "index": self.index,
                "name": self.alloc.name,
                "kind": dev.kind,
                "capacity": int(dev.total),
                "stats": {k: (float(v) if k == "fragmentation" else int(v))
                          for k, v in self.stats.as_dict().items()},
                "allocs": self.allocs,
                "frees": self.frees,
                "ooms": self.ooms,
                "settings_changes": self.settings_total,
                "new_ooms": ooms,
                "new_settings": settings,
            }
        out["options"] = {
            "fraction": float(opts.per_process_gpu_memory_fraction),
            "allow_growth": bool(opts.allow_growth),
            "deferred_deletion_bytes": int(dev._deferred.threshold),
            "limit": int(self.alloc.memory_limit),
            "total": int(dev.total),
            "unified": bool(getattr(backend, "unified", False)
                            or getattr(backend, "managed", False)),
        }
        out["deferred_bytes"] = int(dev.deferred_bytes)
        return out

    # -------------------------------------------------------------- the journal
    def plan(self, recording: bool, watched: bool) -> None:
        """Journal on while recording, or while events are the cheaper way to send this
        watched device's layout (a large layout that changes slowly); off otherwise."""
        self.watched = watched
        if watched and not recording:
            est_table = len(self.alloc._by_ptr) * self.table_bpc
            est_events = self.ops_last * self.event_bpo
            if not self.layout_events and est_table > self.SMALL_TABLE and \
                    2 * est_events < est_table:
                self.layout_events = True
            elif self.layout_events and est_events > est_table:
                self.layout_events = False
        else:
            self.layout_events = False
        self.set_journal(recording or self.layout_events)

    def set_journal(self, on: bool) -> None:
        if on and self.ev_remove is None:
            self.start_events()
        elif not on and self.ev_remove is not None:
            self.stop_events()

    def start_events(self) -> None:
        alloc = self.alloc
        self.ev_remove = alloc._add_sink(self._sink, raw=True)
        with alloc._lock:
            # Records from before this point are dropped: the recording starts from the
            # state taken here, under the same lock.
            if alloc._journal:
                alloc._flush_locked()
            self._reset_events()
            self.ev_regions = _regions_flat(alloc)
        self.chain_ok = False
        self.need_table = self.watched

    def stop_events(self) -> None:
        remove, self.ev_remove = self.ev_remove, None
        if remove is not None:
            remove()
        with self.alloc._lock:
            self._reset_events()
        self.chain_ok = False

    def _reset_events(self) -> None:
        self.ev_pending = []
        self.ev_ops = 0
        self.ev_dropping = False
        self.ev_dropped = 0
        self.ev_extra = {}

    def _sink(self, records: list, extra: dict) -> None:
        """Raw journal sink; runs under the allocator's lock (the allocating thread)."""
        n = len(records) >> 3
        if not n:
            return
        if self.ev_dropping:
            self.ev_dropped += n
            return
        room = self.ev_cap - self.ev_ops
        keep = records
        if n > room:
            self.ev_dropping = True
            self.ev_dropped += n - room
            if room <= 0:
                return
            keep = records[:room << 3]
        if not self.ev_pending:
            alloc = self.alloc
            self.ev_seq0 = alloc._journal_seq
            self.ev_aid0 = alloc._next_aid - _wire.count_allocs(records)
        self.ev_pending.append(keep)
        self.ev_ops += len(keep) >> 3
        if extra:
            self.ev_extra.update(extra)

    # -------------------------------------------------------------- one message's data
    def take(self, recording: bool, force: bool, table_budget: bool
             ) -> tuple[dict | None, dict | None]:
        """The events since the previous message and, for a watched device whose layout
        changed, a chunk table -- both taken under one hold of the allocator's lock, so the
        table is the state right after the events. The table is left out when the events
        continue the client's copy of the layout and cost less than it."""
        alloc = self.alloc
        journal = self.ev_remove is not None
        table_raw = None
        pending: list = []
        dropped = 0
        with alloc._lock:
            if journal:
                if alloc._journal:
                    alloc._flush_locked()
                pending, seq0, aid0, extra = (self.ev_pending, self.ev_seq0, self.ev_aid0,
                                              self.ev_extra)
                dropped, ops = self.ev_dropped, self.ev_ops
                self._reset_events()
                regions0, self.ev_regions = self.ev_regions, _regions_flat(alloc)
            chain = journal and self.chain_ok and not dropped
            if self.watched:
                key = (alloc._num_allocs, alloc._in_use, alloc._pool, alloc._limit,
                       len(alloc._by_ptr) - sum(map(len, alloc._bins)))
                changed = key != self.table_key
                cheaper = chain and (ops * self.event_bpo < len(alloc._by_ptr) * self.table_bpc)
                if force or self.need_table or (changed and not cheaper):
                    if force or table_budget:
                        table_raw = _chunk_table_locked(alloc)
                        self.table_key = key
                        self.need_table = False
                        self.chain_ok = journal
                    else:
                        self.need_table = True  # over the budget: at a later tick
                        self.chain_ok = False
                elif changed:
                    self.table_key = key  # the events carry the change
            else:
                self.chain_ok = False
        ev = None
        if pending or dropped:
            n, data = _wire.encode_records(pending)
            if n:
                self.event_bpo = 0.5 * self.event_bpo + 0.5 * len(data) / n
            ev = {
                "seq0": int(seq0), "aid0": int(aid0), "n": n, "z": data, "dropped": dropped,
                "regions0": regions0, "chain": bool(chain), "rec": bool(recording),
                "extra": [[int(s), str(v[0]), _plain(v[1]), _plain(v[2])]
                          for s, v in extra.items()],
            }
        table = None
        if table_raw is not None:
            table = _wire.encode_table(table_raw)
            self.table_bpc = max(1.0, len(table["z"]) / max(1, len(table_raw["size"])))
        return ev, table


def _regions_flat(alloc: Any) -> list[int]:
    """Lock held: region addresses, then sizes."""
    regions = alloc._regions
    return [r.ptr for r in regions] + [r.size for r in regions]


def _chunk_table_locked(alloc: Any) -> dict:
    """``BFCAllocator.chunk_table()`` with the allocator's lock already held (so that it is
    taken at the same instant as the journal records before it)."""
    ptrs: list[int] = []
    sizes: list[int] = []
    reqs: list[int] = []
    aids: list[int] = []
    bins: list[int] = []
    regs: list[int] = []
    for r in alloc._regions:
        c = r.first
        while c is not None:
            ptrs.append(c.ptr)
            sizes.append(c.size)
            reqs.append(c.requested if c.aid >= 0 else 0)
            aids.append(c.aid)
            bins.append(c.bin)
            regs.append(r.ptr)
            c = c.next
    aid = np.array(aids, dtype=np.int64)
    return {"ptr": np.array(ptrs, dtype=np.int64), "size": np.array(sizes, dtype=np.int64),
            "requested": np.array(reqs, dtype=np.int64), "alloc_id": aid,
            "bin": np.array(bins, dtype=np.int8), "region": np.array(regs, dtype=np.int64),
            "in_use": aid >= 0,
            "regions": np.array([(r.ptr, r.size) for r in alloc._regions],
                                dtype=np.int64).reshape(-1, 2)}


def _plain(value: Any) -> Any:
    """A msgpack-able scalar (numpy numbers become Python numbers)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        return value.item()
    except AttributeError:
        return str(value)


# ------------------------------------------------------------------------------ runtime
class _Runtime:
    """One worker's gpudash state: the session, the stream thread, leases, routing."""

    def __init__(self, plugin: GpudashPlugin, worker: Any) -> None:
        self.worker = worker
        self.address = str(worker.address)
        self.rid = uuid.uuid4().hex[:12]  # tells this stream from an earlier plugin's
        self.rate_hz = plugin.rate_hz
        self.table_bytes_per_s = plugin.table_bytes_per_s
        self.session = self._make_session(plugin)
        self.session._gpudash_on_oom = self._on_oom
        self._lock = threading.Lock()
        self._tick_lock = threading.Lock()
        self._leases: dict[str, tuple[float, bool, frozenset]] = {}
        self._force = True
        # messages numbered but not yet handed to Dask, oldest first (see _post)
        self._outbox: deque = deque()
        self._n = 0
        self._table_free_at = 0.0
        self.dropped = {"messages": 0}
        self.summary: list[dict] = []
        self.devices = [_DeviceStream(d.index, d, plugin.rate_hz, plugin.max_event_rate)
                        for d in self.session.devices]
        self._undo: list[Any] = []
        try:
            self._route(plugin)
        except BaseException:
            self.session.close()
            raise
        now = time.time_ns()
        for ds in self.devices:
            ds.observe(now, self._lock)
        self.summary = [ds.entry(self._lock, pop=False) for ds in self.devices]
        self._metric_names = self._add_metrics()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread = threading.Thread(target=_Runtime._loop, args=(weakref.ref(self),),
                                        name="gpudash-dask-stream", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- setup
    @staticmethod
    def _make_session(plugin: GpudashPlugin) -> Session:
        simulate = plugin.simulate
        if simulate is None and simulated_devices_from_env(os.environ) is None:
            ok, _ = CudaMemory.available()
            if not ok:
                simulate = True  # "elsewhere, simulated devices" (no fallback notice needed)
        config = plugin.config.copy() if plugin.config is not None else None
        return _WorkerSession(config, simulate=simulate)

    def _route(self, plugin: GpudashPlugin) -> None:
        sess = self.session
        if sess.simulated:
            return
        if plugin.install:
            sess.install()
            self._undo.append(sess.uninstall)
        if plugin.rmm:
            try:
                import rmm  # noqa: F401
                import rmm.mr
            except ImportError:
                return
            previous = rmm.mr.get_current_device_resource()
            resource = rmm.mr.CallbackMemoryResource(self._rmm_allocate, self._rmm_deallocate)
            rmm.mr.set_current_device_resource(resource)
            self.rmm_resource = resource
            self._undo.append(lambda: rmm.mr.set_current_device_resource(previous))

    def _rmm_allocate(self, nbytes: int, stream: Any = None) -> int:
        """RMM's allocate callback (``(nbytes, stream)``; older RMM passes no stream)."""
        import cupy

        sess = self.session
        dev = sess._device_for_cuda_id(cupy.cuda.runtime.getDevice())
        return sess.allocate(int(nbytes), device=dev.index)

    def _rmm_deallocate(self, ptr: int, nbytes: int, stream: Any = None) -> None:
        """RMM's deallocate callback (``(ptr, nbytes, stream)``): deferred deletion."""
        sess = self.session
        if ptr and not sess.closed:
            sess.free(int(ptr))

    def _add_metrics(self) -> list[str]:
        metrics = getattr(self.worker, "metrics", None)
        if metrics is None:
            return []
        ref = weakref.ref(self)
        names = []
        for name, key in _METRICS.items():
            metrics[name] = functools.partial(_metric_sum, ref, key)
            names.append(name)
        metrics["gpudash_ooms"] = functools.partial(_metric_ooms, ref)
        metrics["gpudash_fragmentation"] = functools.partial(_metric_fragmentation, ref)
        metrics["gpudash"] = functools.partial(_metric_summary, ref)
        names += ["gpudash_ooms", "gpudash_fragmentation", "gpudash"]
        return names

    # -------------------------------------------------------------- leases
    def lease(self, listener: str, ttl: float, events: bool, tables: Any,
              force: bool = False) -> None:
        """Ask for events / the tables of ``tables`` (device indices) for ``ttl`` seconds;
        ``ttl <= 0`` ends the lease. A new or changed lease (or ``force``) makes the next
        message a full one."""
        with self._lock:
            if ttl <= 0:
                self._leases.pop(listener, None)
                return
            entry = (time.monotonic() + float(ttl), bool(events), frozenset(tables or ()))
            old = self._leases.get(listener)
            self._leases[listener] = entry
            if force or old is None or old[1:] != entry[1:]:
                self._force = True
        if events:
            # Start recording now, not at the next tick: what runs after the client's
            # lease call returns is recorded.
            with self._tick_lock:
                if not self._stop.is_set():
                    for ds in self.devices:
                        ds.set_journal(True)
        self._kick.set()

    def _lease_state(self) -> tuple[bool, frozenset, bool]:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, v in self._leases.items() if v[0] < now]:
                del self._leases[k]
            events = any(v[1] for v in self._leases.values())
            tables = frozenset().union(*(v[2] for v in self._leases.values()))
            force, self._force = self._force, False
        return events, tables, force

    # -------------------------------------------------------------- OOMs
    def _on_oom(self, index: int, exc: OutOfMemoryError) -> None:
        ds = self.devices[index]
        with self._lock:
            ds.ooms += 1
            ds.new_ooms.append([time.time_ns(), int(exc.rounded), int(exc.requested)])

    # -------------------------------------------------------------- the stream
    @staticmethod
    def _loop(ref: weakref.ref) -> None:
        while True:
            rt = ref()
            if rt is None:
                return
            stop, kick, interval = rt._stop, rt._kick, 1.0 / rt.rate_hz
            del rt
            kick.wait(interval)
            kick.clear()
            if stop.is_set():
                return
            rt = ref()
            if rt is None:
                return
            try:
                rt.tick()
            except Exception:  # noqa: BLE001 - the stream must survive a bad tick
                logger.exception("gpudash: the Dask worker stream failed one tick")
            del rt

    def _blocked(self) -> bool:
        """True while Dask has not yet written gpudash's previous message (slow comm)."""
        if self._outbox:
            return True
        stream = getattr(self.worker, "batched_stream", None)
        buffer = getattr(stream, "buffer", None)
        if not buffer:
            return False
        for m in list(buffer):
            if isinstance(m, dict) and m.get("op") == "log-event" and m.get("topic") == \
                    _wire.TOPIC:
                return True
        return False

    def tick(self, force: bool = False, sync: bool = False) -> int | None:
        """One round of the stream: send a message if anything changed. ``force`` sends the
        full state (with the tables of watched devices); ``sync`` sends a message in any
        case, at once (from ``client.run``). Returns the message's number, or None when
        nothing was sent."""
        with self._tick_lock:
            if self._stop.is_set() and not sync:
                return None
            now = time.time_ns()
            recording, tables, lease_force = self._lease_state()
            force = force or lease_force
            changed = force or sync
            for ds in self.devices:
                changed |= ds.observe(now, self._lock)
                ds.plan(recording, ds.index in tables)
            self.summary = [ds.entry(self._lock, pop=False) for ds in self.devices]
            if not sync and self._blocked():
                if changed or recording:
                    self.dropped["messages"] += 1
                    if force:
                        with self._lock:
                            self._force = True  # do not lose a new listener's first message
                return None
            entries = []
            for ds in self.devices:
                entry = ds.entry(self._lock, pop=True)
                mono = time.monotonic()
                ev, table = ds.take(recording, force, mono >= self._table_free_at)
                if ev is not None:
                    entry["events"] = ev
                    changed = True
                if table is not None:
                    entry["table"] = table
                    self._table_free_at = mono + len(table["z"]) / self.table_bytes_per_s
                    changed = True
                entries.append(entry)
            if not changed:
                return None
            self._n += 1
            msg = {"v": _wire.WIRE_VERSION, "worker": self.address, "rid": self.rid,
                   "name": str(self.worker.name), "pid": os.getpid(), "n": self._n, "t": now,
                   "devices": entries, "dropped": dict(self.dropped),
                   "events_on": recording, "bye": False}
            self._post(msg)
            return self._n

    def _post(self, msg: dict) -> None:
        """Hand a message to Dask, after every message numbered before it.

        Called with the tick lock held, so the outbox is in message order. Only the worker's
        event loop sends: from the stream thread through a callback, from the loop itself
        (``client.run``, teardown) at once -- and then the messages still waiting for their
        callback go first, or the client would see message n + 1 before n and drop n."""
        with self._lock:
            self._outbox.append(msg)
        if threading.get_ident() == getattr(self.worker, "thread_id", None):
            self._send_on_loop()
            return
        try:
            self.worker.loop.add_callback(self._send_on_loop)
        except Exception:  # noqa: BLE001 - the loop is closed: the worker is going away
            with self._lock:
                self._outbox.clear()

    def _send_on_loop(self) -> None:
        """On the worker's event loop: send what the outbox holds, in order."""
        while True:
            with self._lock:
                if not self._outbox:
                    return
                msg = self._outbox.popleft()
            try:
                self.worker.log_event(_wire.TOPIC, msg)
            except Exception:  # noqa: BLE001 - the comm to the scheduler is closing
                pass

    # -------------------------------------------------------------- control
    def settings(self) -> list[dict]:
        out = []
        for dev in self.session.devices:
            alloc = dev.allocator
            out.append({"device": dev.index, "name": alloc.name,
                        "fraction": dev.options.per_process_gpu_memory_fraction,
                        "allow_growth": dev.options.allow_growth,
                        "deferred_deletion_bytes": dev._deferred.threshold,
                        "limit": alloc.memory_limit, "total": dev.total,
                        "pool_bytes": alloc.pool_bytes, "bytes_in_use": alloc.bytes_in_use})
        return out

    def check(self, changes: dict, device: Any) -> None:
        """Refuse what :meth:`Session.configure` would refuse here, changing nothing."""
        sess = self.session
        targets = sess.devices if device is None else [sess.device(device)]
        for dev in targets:
            opts = dev.options.copy(**changes)
            fraction = opts.per_process_gpu_memory_fraction
            backend = dev.backend
            if fraction > 1.0 and not (getattr(backend, "unified", False)
                                       or getattr(backend, "managed", False)):
                raise ConfigError(
                    f"per_process_gpu_memory_fraction={fraction} oversubscribes {dev.name}, "
                    "which needs unified memory (a session created with a fraction above 1); "
                    "choose a fraction <= 1")
            memory_limit(dev.total, dev.available, fraction, dev.cc_major,
                         environ=sess._environ)

    def apply(self, changes: dict, device: Any) -> dict:
        """Apply ``changes``; returns the previous values (to roll back) and the settings."""
        sess = self.session
        targets = sess.devices if device is None else [sess.device(device)]
        before = [{k: getattr(d.options, k) for k in changes} for d in targets]
        sess.configure(device=device, **changes)
        self._kick.set()
        return {"before": before, "settings": self.settings()}

    # -------------------------------------------------------------- teardown
    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        try:
            self.tick(sync=True)  # what this worker still holds goes out before the bye
        except Exception:  # noqa: BLE001 - the worker's comm may be closed already
            pass
        metrics = getattr(self.worker, "metrics", None)
        for name in self._metric_names:
            if metrics is not None:
                metrics.pop(name, None)
        for ds in self.devices:
            try:
                ds.set_journal(False)
            except Exception:  # noqa: BLE001
                pass
        with self._tick_lock:
            self._n += 1
            self._post({"v": _wire.WIRE_VERSION, "worker": self.address, "rid": self.rid,
                        "n": self._n, "t": time.time_ns(), "devices": [], "bye": True})
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception:  # noqa: BLE001
                logger.exception("gpudash: restoring an allocator on worker teardown failed")
        self._undo.clear()
        self.session.close()


def _metric_sum(ref: weakref.ref, key: str, worker: Any) -> int:
    rt = ref()
    return 0 if rt is None else sum(int(d["stats"][key]) for d in rt.summary)


def _metric_ooms(ref: weakref.ref, worker: Any) -> int:
    rt = ref()
    return 0 if rt is None else sum(int(d["ooms"]) for d in rt.summary)


def _metric_fragmentation(ref: weakref.ref, worker: Any) -> float:
    rt = ref()
    if rt is None or not rt.summary:
        return 0.0
    return max(float(d["stats"]["fragmentation"]) for d in rt.summary)


def _metric_summary(ref: weakref.ref, worker: Any) -> list:
    rt = ref()
    if rt is None:
        return []
    return [{k: v for k, v in d.items() if k not in ("new_ooms", "new_settings")}
            for d in rt.summary]


# ------------------------------------------------------------------------------ client.run
# Targets of ``client.run``. A refusal comes back as ``{"error": message}`` rather than an
# exception, so that Dask does not log a traceback on the worker for a user's bad value.
def _need_runtime(dask_worker: Any) -> _Runtime:
    rt = _runtime_of(dask_worker)
    if rt is None:
        raise ConfigError(f"worker {dask_worker.address} has no gpudash session (register "
                          "gpudash.dask.GpudashPlugin on the cluster)")
    return rt


def _refusal(exc: BaseException) -> dict:
    return {"error": str(exc) or type(exc).__name__, "type": type(exc).__name__}


def run_lease(listener: str, ttl: float, events: bool, tables: Any, force: bool = False,
              dask_worker: Any = None) -> bool:
    """Take, renew or end a listener's lease; False on a worker without the plugin."""
    rt = _runtime_of(dask_worker)
    if rt is None:
        return False
    rt.lease(listener, ttl, events, tables, force)
    return True


def run_sync(dask_worker: Any = None) -> Any:
    """Send everything now; ``[stream id, number of the last message sent]``."""
    try:
        rt = _need_runtime(dask_worker)
    except ConfigError as exc:
        return _refusal(exc)
    rt.tick(sync=True)
    return [rt.rid, rt._n]


def run_check(changes: dict, device: Any, dask_worker: Any = None) -> Any:
    """Would ``configure(**changes)`` be accepted here? True, or a refusal."""
    try:
        _need_runtime(dask_worker).check(changes, device)
    except (ValueError, TypeError) as exc:  # ConfigError is a ValueError
        return _refusal(exc)
    return True


def run_apply(changes: dict, device: Any, dask_worker: Any = None) -> Any:
    try:
        return _need_runtime(dask_worker).apply(changes, device)
    except (ValueError, TypeError) as exc:
        return _refusal(exc)


def run_settings(dask_worker: Any = None) -> Any:
    try:
        return _need_runtime(dask_worker).settings()
    except ConfigError as exc:
        return _refusal(exc)


def run_release(device: Any, dask_worker: Any = None) -> Any:
    try:
        rt = _need_runtime(dask_worker)
        freed = rt.session.release_free_regions(device)
    except (ValueError, TypeError) as exc:
        return _refusal(exc)
    rt._kick.set()
    return freed


def run_flush_deferred(device: Any, dask_worker: Any = None) -> Any:
    try:
        rt = _need_runtime(dask_worker)
        freed = rt.session.flush(device)
    except (ValueError, TypeError) as exc:
        return _refusal(exc)
    rt._kick.set()
    return freed
