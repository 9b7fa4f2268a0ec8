"""The client side: :class:`ClusterModel` gathers what gpudash's Dask workers stream, and
:class:`WorkerFeed` hands one worker device's stream to the live views.

A model subscribes to the ``"gpudash"`` topic once per client (a hub fans the messages out
to every model of that client) and takes a *lease* on every worker (``client.run``, renewed
every ``lease_ttl / 3`` seconds): the lease makes a worker send its full state at once, and
asks for its events while the model records (``record=True``) and for the chunk tables of
the devices whose feeds are open. A worker whose lease runs out (the client went away) goes
back to summaries only.

Messages are taken in the client's event-loop thread (cheap: counters, bounded marks, the
still-compressed tables and event batches); a model thread polls the scheduler for the
workers that exist (``Client.nthreads``) about once a second, marks the ones that left as
gone (they keep their history and what they sent), leases new ones, and tells listeners
which workers changed, at most ``rate_hz`` times a second.
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import ConfigError
from ..bfc import AllocatorStats
from ..live.feeds import DeviceFeed, FeedSample
from . import _wire
from .plugin import run_flush_deferred, run_lease, run_release, run_sync
from .control import configure_workers

__all__ = ["ClusterModel", "WorkerFeed"]

#: OOM and setting marks kept per device (oldest dropped).
MAX_MARKS = 200
#: Events queued for a feed's layout before the model gives up on them and asks for a table.
MAX_QUEUED_OPS = 1_000_000


class _DevRec:
    """What a model knows of one worker device."""

    def __init__(self, index: int, history: int) -> None:
        self.index = index
        self.name = f"GPU_{index}_bfc"
        self.kind = "simulated"
        self.capacity = 0
        self.stats: dict = {}
        self.options: dict = {}
        self.deferred_bytes = 0
        self.allocs = self.frees = self.ooms = self.settings_changes = 0
        self.oom_marks: deque = deque(maxlen=MAX_MARKS)  # (n, time_ns local, rounded, req)
        self.setting_marks: deque = deque(maxlen=MAX_MARKS)  # (n, time_ns, name, old, new)
        self.n_oom = 0
        self.n_setting = 0
        self.version = 0
        self.time_ns = 0
        self.history: deque = deque(maxlen=history)  # (time_ms, in_use, pool, limit)
        # layout for feeds: what arrived since the last sample, then the replica
        self.layout_q: list[tuple[str, Any]] = []
        self.layout_q_ops = 0
        self.replica: _wire.Layout | None = None
        self.replica_version = 0
        self.replica_table: dict | None = None
        self.need_table = False
        self.tables_received = 0
        self.event_batches_received = 0
        self.segments: list[dict] = []  # recorded event batches (encoded)
        self.recorded_ops = 0
        self.dropped_ops = 0  # dropped by the worker
        self.unkept_ops = 0  # not kept here (record_bytes reached)

    def summary(self) -> dict:
        st = self.stats
        return {"index": self.index, "name": self.name, "kind": self.kind,
                "capacity": self.capacity,
                "bytes_in_use": st.get("bytes_in_use", 0), "pool_bytes": st.get("pool_bytes", 0),
                "bytes_limit": st.get("bytes_limit", 0),
                "peak_bytes_in_use": st.get("peak_bytes_in_use", 0),
                "largest_free_block_bytes": st.get("largest_free_block_bytes", 0),
                "fragmentation": st.get("fragmentation", 0.0),
                "num_allocs": st.get("num_allocs", 0),
                "allocs": self.allocs, "frees": self.frees, "ooms": self.ooms,
                "settings_changes": self.settings_changes,
                "events": self.allocs + self.frees + self.ooms + self.settings_changes,
                "options": dict(self.options), "deferred_bytes": self.deferred_bytes,
                "recorded_events": self.recorded_ops, "dropped_events": self.dropped_ops,
                "layout_tables": self.tables_received,
                "layout_event_batches": self.event_batches_received}


class _WorkerRec:
    def __init__(self, address: str, history: int) -> None:
        self.address = address
        self.name = address
        self.pid = 0
        self.state = "live"
        self.heard = False
        self.rid: str | None = None
        self.need_lease = False
        self.first_seen = time.time()
        self.last_seen = 0.0
        self.gone_at: float | None = None
        self.n = 0
        self.offset_ns: int | None = None
        self.devices: dict[int, _DevRec] = {}
        self.history: deque = deque(maxlen=history)  # (time_ms, in_use, pool, limit)
        self.dropped: dict = {}
        self.events_on = False


class _Hub:
    """One ``subscribe_topic`` per client, fanned out to its models."""

    _hubs: dict[str, _Hub] = {}
    _lock = threading.Lock()

    def __init__(self, client: Any) -> None:
        self.client = client
        self.models: list[ClusterModel] = []
        self._token = f"gpudash-hub-{uuid.uuid4().hex[:12]}"
        self._subscribed = threading.Event()
        client.subscribe_topic(_wire.TOPIC, self._on_event)
        self._wait_subscribed()

    def _wait_subscribed(self, timeout: float = 10.0) -> None:
        """Return once the scheduler forwards the topic here. The subscription travels on
        the client's batched stream, which a call on another connection (a model's first
        lease, a ``client.run``) can overtake: what workers publish before it arrives is
        never forwarded, and a recording would miss a worker's first messages. So a marker
        goes out until it comes back."""
        end = time.monotonic() + timeout
        while not self._subscribed.is_set() and time.monotonic() < end:
            try:
                self.client.log_event(_wire.TOPIC, {"hub": self._token})
            except Exception:  # noqa: BLE001 - the client is closing: nothing to wait for
                return
            self._subscribed.wait(0.05)

    @classmethod
    def attach(cls, client: Any, model: ClusterModel) -> _Hub:
        with cls._lock:
            hub = cls._hubs.get(client.id)
            if hub is None:
                hub = cls._hubs[client.id] = cls(client)
            hub.models.append(model)
            return hub

    def detach(self, model: ClusterModel) -> None:
        with _Hub._lock:
            if model in self.models:
                self.models.remove(model)
            if self.models:
                return
            _Hub._hubs.pop(self.client.id, None)
        try:
            if self.client.status == "running":
                self.client.unsubscribe_topic(_wire.TOPIC)
            else:
                self.client._event_handlers.pop(_wire.TOPIC, None)
        except Exception:  # noqa: BLE001 - the client is closing
            pass

    def _on_event(self, event: Any) -> None:
        try:
            _, msg = event
        except (TypeError, ValueError):
            return
        if isinstance(msg, dict) and "hub" in msg:
            if msg["hub"] == self._token:
                self._subscribed.set()
            return
        for model in list(self.models):
            model._receive(msg)

    @classmethod
    def recording_model(cls, client: Any) -> ClusterModel | None:
        with cls._lock:
            hub = cls._hubs.get(client.id)
            models = [] if hub is None else [m for m in hub.models if m.record]
        return models[-1] if models else None


class ClusterModel:
    """Every gpudash worker of a Dask cluster: summaries, history, feeds and recordings.

    Parameters
    ----------
    client : distributed.Client
        A synchronous client of a cluster where :class:`~gpudash.dask.GpudashPlugin` is
        registered.
    record : bool, default True
        Record each worker's allocator events (for :func:`~gpudash.dask.collect_traces`).
        This turns on the allocators' event journal on every worker, which costs allocation
        throughput there (see the README); ``record=False`` keeps only summaries and the
        tables of open feeds.
    rate_hz : float, default 2.0
        Most listener notifications a second.
    history : int, default 600
        Points of history kept per worker and per worker device (for sparklines, and the
        timeline of a worker's views, which starts with them).
    lease_ttl : float, default 30.0
        Seconds a worker keeps streaming tables/events for this model without a renewal.
    record_bytes : int, default 256 MiB
        Most bytes of compressed events kept (all workers); beyond, new batches are counted
        but not kept.

    Attributes
    ----------
    workers : dict
        ``{address: {...}}`` (a fresh copy on each access): ``bytes_in_use``,
        ``pool_bytes``, ``bytes_limit``, ``peak_bytes_in_use``, ``ooms``, ``events``
        (allocations + frees + OOMs + setting changes), ``allocs``, ``frees``, ``messages``
        (the number of the worker's latest message),
        ``fragmentation`` (the worst device's), ``largest_free_block_bytes``, ``state``
        (``"live"``, ``"stopped"`` when the plugin was removed, ``"gone"``), ``gone``,
        ``name``, ``last_seen``, ``dropped`` (the worker's drop counters) and ``devices``
        (the same figures per device). Byte figures add up the worker's devices.
    """

    def __init__(self, client: Any, *, record: bool = True, rate_hz: float = 2.0,
                 history: int = 600, lease_ttl: float = 30.0,
                 record_bytes: int = 256 << 20) -> None:
        if getattr(client, "asynchronous", False):
            raise ConfigError("ClusterModel needs a synchronous distributed.Client (not "
                              "asynchronous=True)")
        if not isinstance(record, bool):
            raise ConfigError(f"record must be True or False; got {record!r}")
        for name, value, lo in (("rate_hz", rate_hz, 0.0), ("lease_ttl", lease_ttl, 0.5)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not value > lo:
                raise ConfigError(f"{name} must be a number > {lo}; got {value!r}")
        if isinstance(history, bool) or not isinstance(history, int) or history < 2:
            raise ConfigError(f"history must be an integer >= 2; got {history!r}")
        self.client = client
        self.record = record
        self.rate_hz = float(rate_hz)
        self.lease_ttl = float(lease_ttl)
        self.record_bytes = int(record_bytes)
        self._history_len = history
        self._id = f"gpudash-model-{uuid.uuid4().hex[:12]}"
        self._lock = threading.RLock()
        self._workers: dict[str, _WorkerRec] = {}
        self._dirty: set[str] = set()
        self._listeners: list[Callable[[set], Any]] = []
        self._feeds: dict[tuple[str, int], list[WorkerFeed]] = {}
        self._kept_bytes = 0
        self._closed = False
        self._last_renew = 0.0
        self._next_poll = 0.0
        self._forced: dict[str, float] = {}
        self._no_plugin: set[str] = set()
        self._leased: set[str] = set()
        self._hub = _Hub.attach(client, self)
        self._stop = threading.Event()
        try:
            self._poll()
        except Exception:
            self._hub.detach(self)
            raise
        self._thread = threading.Thread(target=ClusterModel._loop, args=(weakref.ref(self),),
                                        name="gpudash-cluster-model", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ receiving
    def _receive(self, msg: Any) -> None:
        """A message from the topic (client event-loop thread)."""
        if not isinstance(msg, dict) or msg.get("v") != _wire.WIRE_VERSION:
            return
        address = msg.get("worker")
        if not isinstance(address, str):
            return
        now_ns = time.time_ns()
        woken: list[tuple[str, int]] = []
        with self._lock:
            if self._closed:
                return
            rec = self._workers.get(address)
            if rec is None:
                rec = self._workers[address] = _WorkerRec(address, self._history_len)
            if rec.state == "gone":
                return
            rid = msg.get("rid")
            if rid != rec.rid:
                # a (new) plugin on this worker: a new stream, new counters, and it needs
                # this model's lease (unless this is the first word of one just leased)
                if rec.rid is not None or address not in self._leased:
                    rec.need_lease = True
                rec.rid = rid
                rec.n = 0
                self._no_plugin.discard(address)
            n = int(msg.get("n", 0))
            if n <= rec.n:
                return
            rec.n = n
            rec.last_seen = time.time()
            self._dirty.add(address)
            if msg.get("bye"):
                rec.state = "stopped"
                return
            rec.heard = True
            rec.state = "live"
            rec.name = str(msg.get("name", address))
            rec.pid = int(msg.get("pid", 0))
            rec.dropped = dict(msg.get("dropped") or {})
            rec.events_on = bool(msg.get("events_on"))
            offset = now_ns - int(msg.get("t", now_ns))
            if rec.offset_ns is None or offset < rec.offset_ns:
                rec.offset_ns = offset
            off = rec.offset_ns
            t_local = int(msg.get("t", now_ns)) + off
            for entry in msg.get("devices") or ():
                index = int(entry["index"])
                dev = rec.devices.get(index)
                if dev is None:
                    dev = rec.devices[index] = _DevRec(index, self._history_len)
                self._update_device(dev, entry, t_local, off,
                                    bool(self._feeds.get((address, index))), rid)
                woken.append((address, index))
            if rec.devices:
                devs = rec.devices.values()
                rec.history.append((t_local / 1e6,
                                    sum(d.stats.get("bytes_in_use", 0) for d in devs),
                                    sum(d.stats.get("pool_bytes", 0) for d in devs),
                                    sum(d.stats.get("bytes_limit", 0) for d in devs)))
            wakes = [f._wake for key in woken for f in self._feeds.get(key, ())
                     if f._wake is not None]
        for wake in wakes:
            try:
                wake()
            except Exception:  # noqa: BLE001 - a listener's problem, not the stream's
                pass

    def _update_device(self, dev: _DevRec, entry: dict, t_local: int, off: int,
                       watched: bool, rid: Any = None) -> None:
        dev.version += 1
        dev.time_ns = t_local
        dev.name = str(entry.get("name", dev.name))
        dev.kind = str(entry.get("kind", dev.kind))
        dev.capacity = int(entry.get("capacity", dev.capacity))
        dev.stats = dict(entry.get("stats") or {})
        st = dev.stats
        dev.history.append((t_local / 1e6, st.get("bytes_in_use", 0), st.get("pool_bytes", 0),
                            st.get("bytes_limit", 0)))
        dev.options = dict(entry.get("options") or {})
        dev.deferred_bytes = int(entry.get("deferred_bytes", 0))
        dev.allocs = int(entry.get("allocs", 0))
        dev.frees = int(entry.get("frees", 0))
        dev.ooms = int(entry.get("ooms", 0))
        dev.settings_changes = int(entry.get("settings_changes", 0))
        for t, rounded, requested in entry.get("new_ooms") or ():
            dev.n_oom += 1
            dev.oom_marks.append((dev.n_oom, int(t) + off, int(rounded), int(requested)))
        for t, name, old, new in entry.get("new_settings") or ():
            dev.n_setting += 1
            dev.setting_marks.append((dev.n_setting, int(t) + off, str(name), old, new))
        table = entry.get("table")
        ev = entry.get("events")
        if watched:
            # The layout, in arrival order: a table resets it (it is the state after the
            # entry's events); chained events continue it; other events break it.
            if table is not None:
                dev.tables_received += 1
                dev.layout_q = [("table", table)]
                dev.layout_q_ops = 0
            elif ev is not None and ev.get("n"):
                dev.event_batches_received += 1
                if ev.get("chain"):
                    dev.layout_q.append(("events", ev))
                    dev.layout_q_ops += int(ev["n"])
                else:
                    dev.layout_q.append(("break", None))
            if dev.layout_q_ops > MAX_QUEUED_OPS:  # nobody samples: start again from a table
                dev.layout_q = [("break", None)]
                dev.layout_q_ops = 0
                dev.need_table = True
        if ev is not None and self.record and ev.get("rec"):
            dev.dropped_ops += int(ev.get("dropped", 0))
            n = int(ev.get("n", 0))
            size = len(ev.get("z", b""))
            if self._kept_bytes + size > self.record_bytes:
                dev.unkept_ops += n
            elif n or ev.get("dropped"):
                ev = dict(ev)
                ev["offset"] = off
                ev["rid"] = rid
                dev.segments.append(ev)
                dev.recorded_ops += n
                self._kept_bytes += size

    # ------------------------------------------------------------------ the model thread
    @staticmethod
    def _loop(ref: weakref.ref) -> None:
        while True:
            model = ref()
            if model is None:
                return
            stop, interval = model._stop, 1.0 / model.rate_hz
            del model
            if stop.wait(interval):
                return
            model = ref()
            if model is None:
                return
            try:
                model._tick()
            except Exception:  # noqa: BLE001 - keep the model alive; the client may close
                if model.client.status not in ("running", "connecting"):
                    return
            del model

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + 1.0
            self._poll()
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            listeners = list(self._listeners)
        if dirty:
            for fn in listeners:
                try:
                    fn(set(dirty))
                except Exception:  # noqa: BLE001 - isolate listeners
                    import traceback

                    traceback.print_exc()

    def _poll(self) -> None:
        """Which workers exist; mark the departed gone; lease the new and the silent."""
        if self.client.status not in ("running", "connecting"):
            return
        current = set(self.client.nthreads())
        now = time.monotonic()
        with self._lock:
            for address, rec in self._workers.items():
                if address not in current and rec.state != "gone":
                    rec.state = "gone"
                    rec.gone_at = time.time()
                    self._dirty.add(address)
            silent = [a for a in current if (a not in self._workers or
                      not self._workers[a].heard) and a not in self._no_plugin]
        # A worker not heard from yet, one whose plugin started again, or one whose layout a
        # feed lost: ask for a full message (again, after a second).
        with self._lock:
            for a, rec in self._workers.items():
                if rec.state == "gone":
                    continue
                if rec.need_lease or any(d.need_table for d in rec.devices.values()):
                    silent.append(a)
            due = [a for a in set(silent) if now - self._forced.get(a, -1e9) >= 1.0]
            for a in due:
                self._forced[a] = now
                rec = self._workers.get(a)
                if rec is not None:
                    rec.need_lease = False
                    for d in rec.devices.values():
                        d.need_table = False
        if now - self._last_renew >= self.lease_ttl / 3:
            self._last_renew = now
            # also asks the workers without the plugin again: it may have come since
            ok = self._lease(sorted(set(current) - set(due)), force=False)
            with self._lock:
                self._no_plugin -= ok
        # workers without the plugin are not asked again every second
        ok = self._lease(due, force=True)
        with self._lock:
            self._no_plugin |= set(due) - ok

    def _tables_of(self, address: str) -> list[int]:
        return sorted({k[1] for k, feeds in self._feeds.items() if k[0] == address and feeds})

    def _lease(self, addresses: list[str], force: bool, ttl: float | None = None) -> set[str]:
        """Lease ``addresses``; returns those that have the plugin."""
        if not addresses or self.client.status != "running":
            return set()
        ttl = self.lease_ttl if ttl is None else ttl
        ok: set[str] = set()
        groups: dict[tuple, list[str]] = {}
        with self._lock:
            for a in addresses:
                groups.setdefault(tuple(self._tables_of(a)), []).append(a)
        for tables, group in groups.items():
            try:
                res = self.client.run(run_lease, self._id, ttl, self.record, list(tables),
                                      force, workers=group, on_error="return")
            except Exception:  # noqa: BLE001 - a worker left meanwhile; the next poll sees it
                continue
            ok |= {a for a, r in res.items() if r is True}
        with self._lock:
            self._leased |= ok
        return ok

    # ------------------------------------------------------------------ public
    @property
    def workers(self) -> dict[str, dict]:
        """``{address: {...}}``: see the class docstring."""
        with self._lock:
            return {a: self._worker_dict(r) for a, r in self._workers.items()}

    def _worker_dict(self, rec: _WorkerRec) -> dict:
        devs = [rec.devices[i].summary() for i in sorted(rec.devices)]

        def total(key: str) -> int:
            return int(sum(d[key] for d in devs))

        return {
            "address": rec.address, "name": rec.name, "state": rec.state,
            "gone": rec.state == "gone", "last_seen": rec.last_seen,
            "bytes_in_use": total("bytes_in_use"), "pool_bytes": total("pool_bytes"),
            "bytes_limit": total("bytes_limit"), "peak_bytes_in_use": total("peak_bytes_in_use"),
            "largest_free_block_bytes": max((d["largest_free_block_bytes"] for d in devs),
                                            default=0),
            "fragmentation": max((d["fragmentation"] for d in devs), default=0.0),
            "ooms": total("ooms"), "events": total("events"), "allocs": total("allocs"),
            "frees": total("frees"), "dropped": dict(rec.dropped), "messages": rec.n,
            "recording": rec.events_on, "devices": devs,
        }

    def history(self, address: str, device: int | None = None) -> dict[str, np.ndarray]:
        """A worker's history (its devices added up), or one of its devices': ``time_ms``,
        ``bytes_in_use``, ``pool_bytes``, ``bytes_limit`` (numpy arrays, oldest first; one
        point per message received)."""
        with self._lock:
            rec = self._need(address)
            if device is None:
                rows = list(rec.history)
            elif device in rec.devices:
                rows = list(rec.devices[device].history)
            else:
                raise ConfigError(f"worker {address} has no device {device!r} (it has "
                                  f"{sorted(rec.devices)})")
        arr = np.array(rows, dtype=np.float64).reshape(-1, 4)
        return {"time_ms": arr[:, 0], "bytes_in_use": arr[:, 1].astype(np.int64),
                "pool_bytes": arr[:, 2].astype(np.int64),
                "bytes_limit": arr[:, 3].astype(np.int64)}

    def _need(self, address: str) -> _WorkerRec:
        rec = self._workers.get(address)
        if rec is None:
            raise ConfigError(f"no gpudash worker {address!r} in this model; known: "
                              f"{sorted(self._workers) or 'none yet'}")
        return rec

    def feed(self, address: str, device: int = 0) -> WorkerFeed:
        """A :class:`~gpudash.live.feeds.DeviceFeed` of one worker device."""
        with self._lock:
            rec = self._need(address)
            if device not in rec.devices:
                raise ConfigError(f"worker {address} has no device {device!r} (it has "
                                  f"{sorted(rec.devices)})")
        return WorkerFeed(self, address, device)

    def feeds(self, address: str | None = None) -> list[WorkerFeed]:
        """Feeds of every device of one worker (or of every worker), in order."""
        with self._lock:
            addrs = [address] if address is not None else list(self._workers)
            keys = [(a, i) for a in addrs for i in sorted(self._need(a).devices)]
        return [WorkerFeed(self, a, i) for a, i in keys]

    def add_listener(self, fn: Callable[[set], Any]) -> Callable[[], None]:
        """``fn(addresses)`` after workers changed, from the model's thread; returns a
        function that removes it."""
        with self._lock:
            self._listeners.append(fn)

        def remove() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)

        return remove

    def wait(self, predicate: Callable[[dict], bool], timeout: float = 10.0) -> bool:
        """Poll ``predicate(model.workers)`` until it is true (True) or ``timeout`` s pass."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate(self.workers):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def sync(self, timeout: float = 10.0) -> bool:
        """Make every live worker send what it has now and wait until it arrived.

        Returns False when some worker's message did not arrive within ``timeout``.
        """
        try:
            sent = self.client.run(run_sync, on_error="return")
        except Exception:  # noqa: BLE001 - a worker left meanwhile
            return False
        want = {a: r for a, r in sent.items() if isinstance(r, list) and len(r) == 2}

        def arrived(_: dict) -> bool:
            with self._lock:
                for a, (rid, n) in want.items():
                    rec = self._workers.get(a)
                    if rec is None:
                        return False
                    if rec.state != "gone" and (rec.rid != rid or rec.n < n):
                        return False
                return True

        return self.wait(arrived, timeout)

    def refresh(self) -> None:
        """Poll the scheduler and notify listeners now (the model's thread does this
        ``rate_hz`` times a second)."""
        self._next_poll = 0.0
        self._tick()

    def close(self) -> None:
        """Stop the model's thread, end its leases and its subscription."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            feeds = [f for fs in self._feeds.values() for f in fs]
            self._feeds.clear()
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for f in feeds:
            f._wake = None
        try:
            live = [a for a, r in self._workers.items() if r.state != "gone"]
            self._lease(live, force=False, ttl=0)
        finally:
            self._hub.detach(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ClusterModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        with self._lock:
            states = [r.state for r in self._workers.values()]
        return (f"ClusterModel({states.count('live')} live, {states.count('gone')} gone, "
                f"record={self.record})")

    # ------------------------------------------------------------------ feeds
    def _start_feed(self, feed: WorkerFeed) -> None:
        with self._lock:
            if self._closed:
                raise ConfigError("this ClusterModel is closed")
            key = (feed.address, feed.device)
            if not self._feeds.get(key):
                # nobody kept this device's layout up to date: start again from a table
                dev = self._workers[feed.address].devices[feed.device]
                dev.replica, dev.replica_table, dev.layout_q = None, None, []
                dev.replica_version += 1
            self._feeds.setdefault(key, []).append(feed)
            gone = self._workers[feed.address].state == "gone"
        if not gone:
            self._lease([feed.address], force=True)

    def _wait_first_layout(self, feed: WorkerFeed, timeout: float) -> None:
        """Until the device's first chunk table arrived (a new lease brings one at once), the
        worker left, or ``timeout`` s passed: the feed's first sample then has the layout."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                rec = self._workers[feed.address]
                dev = rec.devices[feed.device]
                if self._closed or rec.state == "gone" or dev.replica is not None or \
                        any(kind == "table" for kind, _ in dev.layout_q):
                    return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def _feed_history(self, feed: WorkerFeed) -> dict[str, np.ndarray]:
        with self._lock:
            dev = self._workers[feed.address].devices[feed.device]
            latest_ms = dev.time_ns / 1e6  # the feed's first sample has this point
            rows = [r for r in dev.history if r[0] < latest_ms]
        arr = np.array(rows, dtype=np.float64).reshape(-1, 4)
        return {"time_ms": arr[:, 0], "in_use": arr[:, 1].astype(np.int64),
                "pool": arr[:, 2].astype(np.int64), "limit": arr[:, 3].astype(np.int64)}

    def _stop_feed(self, feed: WorkerFeed) -> None:
        with self._lock:
            lst = self._feeds.get((feed.address, feed.device), [])
            if feed in lst:
                lst.remove(feed)
            if not lst:
                self._feeds.pop((feed.address, feed.device), None)
            gone = feed.address not in self._workers or \
                self._workers[feed.address].state == "gone"
            closed = self._closed
        if not gone and not closed:
            self._lease([feed.address], force=False)

    def _layout_locked(self, dev: _DevRec) -> None:
        """Lock held: bring the device's layout replica up to date with what arrived."""
        queue, dev.layout_q, dev.layout_q_ops = dev.layout_q, [], 0
        for kind, payload in queue:
            if kind == "table":
                dev.replica = _wire.Layout(_wire.decode_table(payload))
            elif kind == "events" and dev.replica is not None:
                try:
                    dev.replica.apply(_wire.decode_records(int(payload["n"]), payload["z"]),
                                      int(payload["aid0"]))
                except Exception:  # noqa: BLE001 - a replica that no longer fits
                    dev.replica = None
                    dev.need_table = True
            else:
                dev.replica = None
            dev.replica_version += 1
            dev.replica_table = None
        if dev.replica is not None and dev.replica_table is None:
            dev.replica_table = dev.replica.table()

    def _sample_feed(self, feed: WorkerFeed) -> FeedSample | None:
        with self._lock:
            rec = self._workers[feed.address]
            dev = rec.devices[feed.device]
            gone = rec.state == "gone"
            self._layout_locked(dev)
            if dev.version == feed._version and gone == feed._gone and \
                    dev.replica_version == feed._table_version:
                return None
            if dev.replica_table is not None:
                feed._table = dev.replica_table
                feed._table_version = dev.replica_version
            elif feed._table is None and not gone:
                return None  # the first layout is on its way
            feed._version = dev.version
            feed._gone = gone
            stats = dict(dev.stats)
            counts = (dev.allocs, dev.frees, dev.ooms, dev.settings_changes)
            ooms = tuple((t, r, q) for n, t, r, q in dev.oom_marks if n > feed._n_oom)
            settings = tuple((t, s, o, v) for n, t, s, o, v in dev.setting_marks
                             if n > feed._n_setting)
            feed._n_oom, feed._n_setting = dev.n_oom, dev.n_setting
            time_ms = dev.time_ns / 1e6
            extra = {"worker": rec.address, "state": rec.state,
                     "dropped": int(sum(rec.dropped.values()))}
        table = feed._table
        if table is not None:
            stats.update(_wire.table_stats(table))
            stats["peak_bytes_in_use"] = max(stats.get("peak_bytes_in_use", 0),
                                             stats["bytes_in_use"])
            stats["peak_pool_bytes"] = max(stats.get("peak_pool_bytes", 0), stats["pool_bytes"])
        last = feed._counts
        if any(c < p for c, p in zip(counts, last)):
            last = (0, 0, 0, 0)  # the worker's plugin started again: its counts did too
        feed._counts = counts
        fields = AllocatorStats.__dataclass_fields__
        return FeedSample(
            time_ms=time_ms, stats=AllocatorStats(**{k: v for k, v in stats.items()
                                                      if k in fields}), table=table,
            allocs=counts[0] - last[0], frees=counts[1] - last[1],
            events=sum(counts) - sum(last), ooms=ooms, settings=settings, extra=extra)


class WorkerFeed(DeviceFeed):
    """One Dask worker device as a :class:`~gpudash.live.feeds.DeviceFeed`.

    Its samples carry the worker's chunk table (sent by the worker while the feed is
    started, when the layout changed, within the worker's ``table_bytes_per_s``) with
    stats made consistent with it, and the allocation/free/OOM/setting counts since the
    previous sample; :meth:`start` waits for the first table, and :meth:`history` hands over
    the points the model had before. Its controls act on that worker device through
    :func:`~gpudash.dask.configure_workers` (validated on the client first).
    """

    kind = "dask"
    #: Seconds :meth:`start` waits for the worker's first chunk table (a live worker sends
    #: it at once).
    first_layout_timeout = 5.0

    def __init__(self, model: ClusterModel, address: str, device: int) -> None:
        self._model = model
        self.address = address
        self.device = device
        with model._lock:
            dev = model._workers[address].devices[device]
            self.name = f"{address} {dev.name}"
            self.capacity = int(dev.capacity)
        self._wake: Callable[[], None] | None = None
        self._version = 0
        self._gone = False
        self._table: dict | None = None
        self._table_version = 0
        self._counts = (0, 0, 0, 0)
        self._n_oom = self._n_setting = 0
        self._started = False

    @property
    def controls(self) -> str | None:  # type: ignore[override]
        with self._model._lock:
            rec = self._model._workers.get(self.address)
            state = rec.state if rec is not None else "gone"
        if state == "live":
            return None
        return f"worker {self.address} is {state}: its settings cannot change"

    def start(self, wake: Callable[[], None]) -> None:
        if self._started:
            raise RuntimeError(f"{self!r} was started already")
        self._started = True
        with self._model._lock:
            dev = self._model._workers[self.address].devices[self.device]
            # Counts start from what the model has seen: a sample reports what happened
            # since the feed started.
            self._counts = (dev.allocs, dev.frees, dev.ooms, dev.settings_changes)
            self._n_oom, self._n_setting = dev.n_oom, dev.n_setting
        self._wake = wake
        self._model._start_feed(self)
        self._model._wait_first_layout(self, self.first_layout_timeout)

    def sample(self) -> FeedSample | None:
        return self._model._sample_feed(self)

    def history(self) -> dict:
        """The device's points the model holds from before the feed's first sample
        (``time_ms``, ``in_use``, ``pool``, ``limit``): a worker's views start with them."""
        return self._model._feed_history(self)

    def stop(self) -> None:
        self._wake = None
        self._model._stop_feed(self)

    def settings(self) -> dict:
        with self._model._lock:
            dev = self._model._workers[self.address].devices[self.device]
            o = dict(dev.options)
        return {"fraction": o.get("fraction"), "allow_growth": o.get("allow_growth"),
                "deferred_deletion_bytes": o.get("deferred_deletion_bytes"),
                "limit": o.get("limit"), "total": o.get("total") or self.capacity or None}

    def configure(self, **changes: Any) -> None:
        reason = self.controls
        if reason is not None:
            raise ConfigError(reason)
        configure_workers(self._model.client, workers=[self.address], device=self.device,
                          **changes)

    def _run(self, fn: Any) -> int:
        reason = self.controls
        if reason is not None:
            raise ConfigError(reason)
        result = self._model.client.run(fn, self.device, workers=[self.address],
                                        on_error="return")
        value = result.get(self.address)
        if isinstance(value, BaseException):
            raise ConfigError(f"worker {self.address}: {value}") from value
        if isinstance(value, dict):
            raise ConfigError(f"worker {self.address}: {value.get('error')}")
        return int(value)

    def release_free_regions(self) -> int:
        return self._run(run_release)

    def flush_deferred(self) -> int:
        return self._run(run_flush_deferred)

