"""The Recorder: keeps an allocator's events, bounded, and reads them as numpy columns.

While anyone listens the allocator writes one record of 8 ints per operation into its
journal, and hands the journal over in batches (every 8,192 operations, and whenever a reader
calls :meth:`Recorder.flush`). The Recorder keeps each batch as it came, a
:class:`~gpudash._eventsource.JournalBatch`: recording costs the record and its timestamp per
operation, nothing more. A batch is expanded into event columns (one per column of
:data:`gpudash.events.COLUMNS`) when someone first reads it, and kept expanded. Once
``capacity`` events are held the oldest batches are dropped (whole; a read trims the oldest
kept one to exactly ``capacity`` events), and the events dropped are counted in
:attr:`Recorder.dropped`.

Attached to a :class:`~gpudash.Session`, the Recorder also keeps who holds each block the
session gives a holder (``Session.label``, ``record_stacks=True``): its allocation id, label
and stack id, 16 bytes a block, the oldest dropped past ``capacity`` a device.
:meth:`Recorder.to_trace` writes them into the trace: the label as the ``holder`` of the
block's alloc and free rows, the stack id as the ``stack`` of its alloc row, with the
session's stacks as the trace's :class:`~gpudash.trace.stacks.StackTable` (so
``top_holders(trace, by="line")`` names the user's lines). A stream to a ``.gdtrace`` file
(``path=``) carries the events only.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import weakref
from array import array
from collections import deque
from typing import Any

import numpy as np

from ._errors import ConfigError, GpudashError
from .events import COLUMN_DTYPES, COLUMNS, Event
from .models import model_of

logger = logging.getLogger("gpudash")

__all__ = ["Recorder"]


def _sessions_of(source: Any) -> list:
    """The gpudash sessions in ``source`` (a session, or a list holding some)."""
    if hasattr(source, "_add_holder_sink"):
        return [source]
    if isinstance(source, (list, tuple)):
        return [s for x in source for s in _sessions_of(x)]
    return []


def _allocators_of(source: Any) -> list:
    """An allocator, or anything exposing ``allocators`` (a session), or a list of them."""
    if hasattr(source, "_add_sink"):
        return [source]
    if hasattr(source, "allocators"):
        return list(source.allocators)
    if isinstance(source, (list, tuple)):
        out = []
        for s in source:
            out.extend(_allocators_of(s))
        return out
    raise TypeError(
        f"Recorder records a BFCAllocator, a Session or a list of them; got {type(source).__name__}"
    )


class Recorder:
    """Record every event of one or more allocators into numpy columns.

    Parameters
    ----------
    source : BFCAllocator, Session or list, optional
        What to record; more can be added with :meth:`attach`.
    capacity : int
        Most events kept; older ones are dropped first.
    path : str or os.PathLike, optional
        Also stream every event to this ``.gdtrace`` file, one batch every
        ``flush_interval`` seconds from a background thread, so that a process killed
        mid-run loses at most its last ``flush_interval`` of events. Closed by
        :meth:`detach` (or the context manager).
    overwrite : bool
        Replace an existing ``path``.
    flush_interval : float
        Seconds between batches written to ``path``.

    Examples
    --------
    >>> from gpudash import BFCAllocator, Recorder, SimulatedDevice
    >>> a = BFCAllocator(SimulatedDevice(1 << 30), 1 << 30)
    >>> with Recorder(a) as rec:
    ...     a.deallocate(a.allocate(1000))
    >>> [str(k) for k in rec.kinds()]
    ['extend', 'split', 'alloc', 'free', 'merge']
    """

    def __init__(self, source: Any = None, *, capacity: int = 1_000_000,
                 path: Any = None, overwrite: bool = False, flush_interval: float = 1.0) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or \
                not 0 < capacity <= 1 << 40:
            raise ConfigError(f"capacity must be a positive integer number of events; got "
                              f"{capacity!r}")
        capacity = int(capacity)
        self._capacity = capacity
        # [events, JournalBatch or its expanded columns], oldest first; together they hold
        # _held events, of which the last `capacity` are kept
        self._batches: deque[list] = deque()
        self._held = 0
        self._total = 0  # events ever received
        self._settings: dict[tuple[int, int], tuple] = {}  # (device, seq) -> (setting, old, new)
        self._lock = threading.Lock()
        self._attached: list[tuple[Any, Any]] = []  # (allocator, remove)
        # every allocator recorded, in attach order: (id, its meta when attached): the
        # settings a replay starts from, also after a detach (%%gpudash_track detaches
        # before it makes the trace); setting changes after it are the trace's settings
        self._seen: list[tuple[int, dict]] = []
        # who holds the blocks of the sessions recorded (Session.label, record_stacks): per
        # device index, allocation ids, label codes, stack ids and the session's number
        self._held_by: dict[int, tuple[array, array, array, array]] = {}
        self._labels: dict[str, int] = {}
        self._stack_sources: list[Any] = []   # each session's SessionStacks (or None)
        self._sessions: list[tuple[Any, Any]] = []   # (session, remove its holder sink)
        self._writer = None
        self._streamer: threading.Thread | None = None
        self._stop = threading.Event()
        #: The exception that stopped the stream to ``path`` (None while it is well);
        #: :meth:`detach` raises it.
        self.stream_error: BaseException | None = None
        if path is not None:
            from ._version import __version__
            from .trace.format import TraceWriter

            meta = {"gpudash_version": __version__, "source": "gpudash",
                    "devices": [self._device_meta(a) for a in _allocators_of(source)]
                    if source is not None else []}
            try:
                interval = float("nan") if isinstance(flush_interval, (bool, np.bool_)) \
                    else float(flush_interval)
            except (TypeError, ValueError, OverflowError):
                interval = float("nan")
            # Beyond TIMEOUT_MAX the streaming thread's wait() would raise OverflowError.
            if not (math.isfinite(interval) and 0 < interval <= threading.TIMEOUT_MAX):
                raise ConfigError(f"flush_interval must be a finite number of seconds > 0 (at "
                                  f"most {threading.TIMEOUT_MAX:g}); got {flush_interval!r}")
            self._writer = TraceWriter(path, meta, overwrite=overwrite,
                                       flush_interval=float("inf"), batch_events=1 << 62)
            self._flush_interval = interval
        if source is not None:
            self.attach(source)
        if self._writer is not None:
            self._streamer = threading.Thread(target=Recorder._stream_loop,
                                              args=(weakref.ref(self), self._stop),
                                              name="gpudash-recorder", daemon=True)
            # A recorder dropped without detach() still closes its file (an end record
            # after what was streamed), as detach() would.
            self._finalizer = weakref.finalize(self, Recorder._close_dropped, self._stop,
                                               self._writer)
            self._streamer.start()

    @staticmethod
    def _device_meta(alloc: Any) -> dict:
        meta = {"index": alloc.device_index, "name": alloc.name,
                "capacity": getattr(alloc.sub_allocator, "total", None),
                "memory_limit": alloc.memory_limit}
        meta.update(model_of(alloc).recorded(alloc))   # the model's own settings
        return meta

    @staticmethod
    def _close_dropped(stop: threading.Event, writer: Any) -> None:
        stop.set()
        try:
            writer.close()
        except Exception as exc:  # noqa: BLE001 - at collection there is no caller to raise to
            logger.error("gpudash: closing the stream of a dropped recorder failed: %r", exc)

    @staticmethod
    def _stream_loop(ref: "weakref.ref[Recorder]", stop: threading.Event) -> None:
        """The streaming thread. It holds the recorder only weakly while it waits, so a
        recorder dropped without detach() is collected and the thread ends."""
        while True:
            rec = ref()
            if rec is None:
                return
            interval = rec._flush_interval
            del rec
            if stop.wait(interval):
                return
            rec = ref()
            if rec is None:
                return
            try:
                rec._write_batch()
            except Exception as exc:  # noqa: BLE001 - kept, logged, and raised by detach()
                rec.stream_error = exc
                logger.error("gpudash: the recorder's stream to %s failed: %r", rec.path, exc)
                return
            finally:
                del rec

    def _write_batch(self) -> None:
        self.flush()
        with self._lock:
            if self._writer is not None:
                self._writer.flush()

    # ------------------------------------------------------------------ wiring
    def attach(self, source: Any) -> "Recorder":
        """Start recording ``source`` (an allocator, a session, or a list of them); of a
        session, who holds its blocks too."""
        for alloc in _allocators_of(source):
            if any(a is alloc for a, _ in self._attached):
                continue
            remove = alloc._add_sink(self._receive, batch=True)
            self._attached.append((alloc, remove))
            if not any(i == id(alloc) for i, _ in self._seen):
                self._seen.append((id(alloc), self._device_meta(alloc)))
        for sess in _sessions_of(source):
            if any(s is sess for s, _ in self._sessions):
                continue
            k = next((i for i, st in enumerate(self._stack_sources)
                      if st is not None and st is sess.stacks), None)
            if k is None:
                k = len(self._stack_sources)
                self._stack_sources.append(sess.stacks)
            self._sessions.append((sess, sess._add_holder_sink(self._holder_sink(k))))
        return self

    def _holder_sink(self, k: int) -> Any:
        """``sink(allocator, allocation id, label, stack id)`` for the session numbered
        ``k``: kept, at most ``capacity`` a device."""
        ref = weakref.ref(self)

        def sink(alloc: Any, aid: int, label: str, sid: int) -> None:
            rec = ref()
            if rec is None:
                return
            with rec._lock:
                code = rec._labels.setdefault(label, len(rec._labels)) if label else -1
                held = rec._held_by.get(alloc.device_index)
                if held is None:
                    held = rec._held_by[alloc.device_index] = (
                        array("q"), array("i"), array("i"), array("i"))
                held[0].append(aid)
                held[1].append(code)
                held[2].append(sid)
                held[3].append(k)
                extra = len(held[0]) - rec._capacity
                if extra > 4096 or (extra > 0 and len(held[0]) > 8192):
                    for a in held:
                        del a[:extra]

        return sink

    def detach(self) -> None:
        """Stop recording (buffered events are taken in first); closes the stream file."""
        attached, self._attached = self._attached, []
        for _, remove in attached:
            remove()
        sessions, self._sessions = self._sessions, []
        for _, remove in sessions:
            remove()
        self._stop.set()
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        if self._streamer is not None and self._streamer is not threading.current_thread():
            self._streamer.join(timeout=5)
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        if self.stream_error is not None:
            exc, self.stream_error = self.stream_error, None
            raise GpudashError(f"the recording stream failed, events after its last good "
                               f"write are missing from the file: {exc!r}") from exc

    @property
    def path(self) -> str | None:
        """The file events stream to, if any."""
        return self._writer.path if self._writer is not None else None

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def flush(self) -> None:
        """Take in the events the allocators still buffer."""
        for alloc, _ in list(self._attached):
            alloc.flush_events()

    def _receive(self, batch: Any) -> None:
        """A batch sink: keep the batch as it came (expanded now only to stream it)."""
        n = batch.events
        if n == 0:
            return
        extra = batch.extra
        with self._lock:
            item = [n, batch]
            if self._writer is not None:
                item[1] = columns = batch.columns()
                self._writer.append(columns, settings=[
                    {"device": batch.device, "seq": seq, "setting": v[0], "old": v[1],
                     "new": v[2]} for seq, v in extra.items()])
            self._batches.append(item)
            self._held += n
            self._total += n
            cap = self._capacity
            batches = self._batches
            while self._held - batches[0][0] >= cap:
                self._held -= batches.popleft()[0]
            if extra:
                for seq, value in extra.items():
                    self._settings[(batch.device, seq)] = value
                if len(self._settings) > cap:
                    for key in sorted(self._settings)[: len(self._settings) - cap]:
                        del self._settings[key]

    # ------------------------------------------------------------------ reading
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def dropped(self) -> int:
        """Events dropped because the buffer was full."""
        return max(0, self._total - self._capacity)

    @property
    def total(self) -> int:
        """Events received since the Recorder started (kept or dropped)."""
        self.flush()
        return self._total

    def __len__(self) -> int:
        self.flush()
        return min(self._held, self._capacity)

    def columns(self) -> dict[str, np.ndarray]:
        """Copies of the kept events' columns, oldest first (ordered by time across
        several allocators)."""
        self.flush()
        with self._lock:
            n = min(self._held, self._capacity)
            skip = self._held - n   # the oldest batch's events beyond capacity
            parts: dict[str, list] = {name: [] for name in COLUMNS}
            for item in self._batches:
                cols = item[1]
                if not isinstance(cols, dict):
                    item[1] = cols = cols.columns()   # expanded once, kept so
                for name in COLUMNS:
                    parts[name].append(cols[name][skip:])
                skip = 0
            out = {name: np.concatenate(parts[name]) if parts[name]
                   else np.zeros(0, dtype=COLUMN_DTYPES[name]) for name in COLUMNS}
        if len(self._seen) > 1 and n:
            order = np.lexsort((out["seq"], out["device"], out["time_ns"]))
            out = {k: v[order] for k, v in out.items()}
        return out

    def settings(self) -> list[dict]:
        """The setting changes recorded (``limit`` events): dicts with device, seq,
        setting, old, new."""
        self.flush()
        with self._lock:
            return [{"device": d, "seq": s, "setting": v[0], "old": v[1], "new": v[2]}
                    for (d, s), v in sorted(self._settings.items())]

    def kinds(self) -> list:
        """The kinds of the kept events, in order, as :class:`gpudash.EventKind`."""
        from .events import EventKind

        return [EventKind(int(k)) for k in self.columns()["kind"]]

    def events(self) -> list[Event]:
        """The kept events as :class:`gpudash.Event` objects (for small recordings)."""
        cols = self.columns()
        settings = {(d["device"], d["seq"]): d for d in self.settings()}
        out = []
        for i in range(len(cols["seq"])):
            ev = Event(*(int(cols[name][i]) for name in COLUMNS))
            s = settings.get((ev.device, ev.seq))
            if s is not None:
                ev.setting, ev.old, ev.new = s["setting"], s["old"], s["new"]
            out.append(ev)
        return out

    def to_trace(self, meta: dict | None = None):
        """The kept events as a :class:`gpudash.trace.Trace` (for saving, replay, analysis).

        ``meta["devices"]`` holds each allocator recorded (detached ones too) with the
        settings it had when recording began, what a replay starts from; later changes are
        the trace's ``settings``."""
        from ._version import __version__
        from .trace.format import Trace

        m = {"gpudash_version": __version__, "source": "gpudash"}
        m["devices"] = [copy.deepcopy(meta) for _, meta in self._seen]
        m["dropped"] = self.dropped
        if meta:
            m.update(meta)
        cols = self.columns()
        holder, holders, stack, stacks = self._holder_columns(cols)
        return Trace(columns=cols, meta=m, settings=self.settings(), holder=holder,
                     holders=holders, stack=stack, stacks=stacks)

    def _holder_columns(self, cols: dict) -> tuple:
        """``(holder, holders, stack, stacks)`` for :meth:`to_trace`: the labels and stack
        ids the sessions gave the blocks of ``cols``, matched by device and allocation id
        (Nones and [] where there are none)."""
        from .events import EventKind
        from .trace.stacks import StackTable

        with self._lock:
            held = {d: tuple(np.frombuffer(a, dtype=np.int64 if j == 0 else np.int32).copy()
                             for j, a in enumerate(arrs)) for d, arrs in self._held_by.items()}
            names = sorted(self._labels, key=self._labels.get)
            sources = list(self._stack_sources)
        n = len(cols["seq"])
        if not held or not n:
            return None, None, None, None
        # the sessions' stacks as one table (several sessions: merged, their ids remapped)
        table, remaps = None, []
        for st in sources:
            if st is None:
                remaps.append(None)
                continue
            n_stacks = len(st.stacks)
            one = StackTable(st.frames[:len(st.frames)],
                             [(list(ids), "", "") for ids in st.stacks[:n_stacks]])
            if table is None:
                table = one
                remaps.append(np.append(np.arange(n_stacks, dtype=np.int32), -1))
            else:
                table, remap = table.merged(one)
                remaps.append(remap)
        holder = np.full(n, -1, dtype=np.int32)
        stack = np.full(n, -1, dtype=np.int32)
        kind, dev, aid = cols["kind"], cols["device"], cols["alloc_id"]
        is_alloc = kind == int(EventKind.ALLOC)
        rows_of = is_alloc | (kind == int(EventKind.FREE))
        for d, (h_aid, h_label, h_sid, h_sess) in held.items():
            rows = np.flatnonzero(rows_of & (dev == d))
            if not len(rows) or not len(h_aid):
                continue
            order = np.argsort(h_aid, kind="stable")
            s_aid = h_aid[order]
            pos = np.minimum(np.searchsorted(s_aid, aid[rows]), len(s_aid) - 1)
            hit = s_aid[pos] == aid[rows]
            rows, j = rows[hit], order[pos[hit]]
            holder[rows] = h_label[j]
            sid = np.full(len(j), -1, dtype=np.int32)
            for k, remap in enumerate(remaps):
                if remap is None:
                    continue
                mine = (h_sess[j] == k) & (h_sid[j] >= 0)
                sid[mine] = remap[h_sid[j][mine]]
            alloc_rows = is_alloc[rows]
            stack[rows[alloc_rows]] = sid[alloc_rows]
        has_holder = bool((holder >= 0).any())
        has_stack = table is not None and bool((stack >= 0).any())
        return (holder if has_holder else None, names if has_holder else None,
                stack if has_stack else None, table if has_stack else None)

    def clear(self) -> None:
        """Forget every kept event."""
        self.flush()
        with self._lock:
            self._batches.clear()
            self._held = 0
            self._total = 0
            self._settings.clear()
            self._held_by.clear()

    def __repr__(self) -> str:
        return (f"Recorder(events={min(self._held, self._capacity)}, capacity={self._capacity}, "
                f"dropped={self.dropped}, allocators={len(self._attached)})")
