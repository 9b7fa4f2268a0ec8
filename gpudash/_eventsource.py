"""The event machinery both allocator models share: journal, subscribers and batch sinks.

An allocator keeps ``_journal``: None while nobody listens (its hot paths then skip all event
work), else a flat list of op records of 8 ints each::

    (time_ns, code, ptr, size, requested, a, b, c)

    alloc:   a = bytes split off into a new free block after it (0: no split)
    free:    a = allocation id, b = bytes of the next block merged, c = bytes of the
             previous block merged into
    extend:  requested = the rounded request that asked for the region/segment
    release, oom, limit, split, merge: as gpudash.events' table (one event each)

One record per operation keeps recording cheap; :meth:`EventSource._after_op` expands an
op's records into :class:`~gpudash.events.Event` objects for per-event callbacks, and
:meth:`EventSource._flush_locked` hands whole batches to sinks: expanded in numpy (replay's
collector), as the journal itself (the live views, which only count) or as a
:class:`JournalBatch` that expands when read (the Recorder).

Subclasses provide the lock (a plain ``threading.Lock``; call ``_init_events`` after making
it), the allocation-id counter ``_next_aid``, and two lookups: ``_region_table()`` (sorted
region starts and ends now, as new lists: a batch keeps them) and ``_region_at(ptr)`` (0
outside every region).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from threading import get_ident as _get_ident
from typing import Any, Callable

import numpy as np

from ._errors import GpudashWarning
from .events import (
    COLUMN_DTYPES, Event, ALLOC as _ALLOC, FREE as _FREE, SPLIT as _SPLIT, MERGE as _MERGE,
    EXTEND as _EXTEND, RELEASE as _RELEASE, OOM as _OOM, LIMIT as _LIMIT,
)

__all__ = ["EventSource", "JournalBatch", "code_counts", "count_events", "expand_records", "W",
           "JOURNAL_FLUSH", "OUTBOX_MAX"]

W = 8  # ints per journal record
JOURNAL_FLUSH = 8192 * W  # journal ints buffered before batch sinks receive them
#: Operations whose events may wait for ``subscribe`` callbacks before a thread that makes
#: one more waits for the callbacks to catch up (see ``EventSource._deliver``).
OUTBOX_MAX = 4096


now_ns = time.time_ns


def bin_num_for_size(nbytes: int) -> int:
    """TensorFlow's ``BinNumForSize`` (the ``bin`` column of every event table)."""
    b = (max(nbytes, 256) >> 8).bit_length() - 1
    return b if b < 20 else 20


def count_events(journal: list[int], start: int, end: int | None = None) -> int:
    """Events in the journal records between ``start`` and ``end`` (an alloc may carry a
    split, a free up to two merges)."""
    n = 0
    for i in range(start, len(journal) if end is None else end, W):
        code = journal[i + 1]
        if code == _ALLOC:
            n += 2 if journal[i + 5] else 1
        elif code == _FREE:
            n += 1 + (journal[i + 6] > 0) + (journal[i + 7] > 0)
        else:
            n += 1
    return n


def code_counts(journal: Any) -> list[int]:
    """How many records of each code a journal holds (a list indexed by code, 0..8):
    counted in C for the compiled core's journal, by list operations for a list. Neither
    releases the GIL, so a batch sink may call it with the allocator's lock held."""
    if isinstance(journal, list):
        codes = journal[1::W]
        return [codes.count(k) for k in range(9)]
    return journal.code_counts()


def _events_per_record(code: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which records carry a split (an alloc with ``a``) and merges (a free with ``b``,
    ``c``), as :func:`count_events` counts them."""
    is_free = code == _FREE
    return (code == _ALLOC) & (a != 0), is_free & (b > 0), is_free & (c > 0)


def _bins_of(sizes: np.ndarray) -> np.ndarray:
    """BinNumForSize over an array (exact for sizes below 2**53)."""
    v = np.maximum(sizes, 256) >> 8
    return np.minimum(np.frexp(v.astype(np.float64))[1] - 1, 20)


def expand_records(rec: np.ndarray, seq0: int, next_aid: int, region_ptrs: Any,
                   region_ends: Any, device: int) -> dict[str, np.ndarray]:
    """Journal records (one row per op) -> event columns (one row per event), vectorised.

    Allocation ids of alloc events are consecutive, so they follow from ``next_aid``;
    regions follow from the region table now, corrected for regions released within the
    batch (processed newest first, so an address range reused by a later region resolves
    to the region that was live at each event).
    """
    t, code, ptr, size, req, a, b, c = (rec[:, i] for i in range(W))
    n_rec = len(code)
    is_alloc = code == _ALLOC
    is_free = code == _FREE
    split, m_next, m_prev = _events_per_record(code, a, b, c)
    counts = 1 + split + m_next + m_prev
    total = int(counts.sum())
    rid = np.repeat(np.arange(n_rec), counts)
    pos = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)

    # region of each record
    rptr = np.zeros(n_rec, dtype=np.int64)
    chunky = is_alloc | is_free
    if len(region_ptrs):
        rp = np.asarray(region_ptrs, dtype=np.int64)
        re = np.asarray(region_ends, dtype=np.int64)
        idx = np.searchsorted(rp, ptr, side="right") - 1
        ok = chunky & (idx >= 0)
        ok[ok] &= ptr[ok] < re[idx[ok]]
        rptr[ok] = rp[idx[ok]]
    rel = np.flatnonzero(code == _RELEASE)
    for j in rel[::-1]:
        inside = chunky[:j] & (ptr[:j] >= ptr[j]) & (ptr[:j] < ptr[j] + size[j])
        rptr[:j][inside] = ptr[j]
    ext = (code == _EXTEND) | (code == _RELEASE)
    rptr[ext] = ptr[ext]

    aid = np.full(n_rec, -1, dtype=np.int64)
    n_alloc = int(is_alloc.sum())
    aid[is_alloc] = np.arange(next_aid - n_alloc, next_aid, dtype=np.int64)
    aid[is_free] = a[is_free]

    e_code = code[rid].copy()
    e_ptr = ptr[rid].copy()
    e_size = size[rid].copy()
    e_req = req[rid].copy()
    e_aid = aid[rid].copy()
    e_b, e_c, e_a = b[rid], c[rid], a[rid]
    rsize = size[rid]

    ev_split = split[rid] & (pos == 0)
    e_code[ev_split] = _SPLIT
    e_ptr[ev_split] += rsize[ev_split]
    e_size[ev_split] = e_a[ev_split]
    e_req[ev_split] = rsize[ev_split]
    e_aid[ev_split] = -1

    ev_next = m_next[rid] & (pos == 1)
    ev_prev = m_prev[rid] & (pos == 1 + (e_b > 0))
    e_code[ev_next | ev_prev] = _MERGE
    e_aid[ev_next | ev_prev] = -1
    e_size[ev_next] = rsize[ev_next] + e_b[ev_next]
    e_req[ev_next] = e_b[ev_next]
    e_ptr[ev_prev] -= e_c[ev_prev]
    e_size[ev_prev] = e_c[ev_prev] + rsize[ev_prev] + e_b[ev_prev]
    e_req[ev_prev] = rsize[ev_prev] + e_b[ev_prev]

    binned = (e_code == _ALLOC) | (e_code == _FREE) | (e_code == _SPLIT) | (e_code == _OOM)
    e_bin = np.where(binned, _bins_of(e_size), -1)
    return {
        "seq": np.arange(seq0, seq0 + total, dtype=np.int64),
        "time_ns": t[rid],
        "kind": e_code.astype(COLUMN_DTYPES["kind"]),
        "ptr": e_ptr,
        "size": e_size,
        "requested": e_req,
        "bin": e_bin.astype(COLUMN_DTYPES["bin"]),
        "region": rptr[rid],
        "alloc_id": e_aid,
        "device": np.full(total, device, dtype=COLUMN_DTYPES["device"]),
    }


class JournalBatch:
    """One flush of an allocator's journal, kept as it came (8 ints per operation), with
    what expanding it into event columns needs: the seq of its first event, the allocation
    id after it, the region table at the flush and the device. :meth:`columns` expands it
    (:func:`expand_records`, or the compiled core's). Keeping batches so costs nothing per
    event until someone reads them, and 64 bytes per operation (an expanded event takes 60).
    """

    __slots__ = ("records", "extra", "seq0", "events", "next_aid", "region_ptrs",
                 "region_ends", "device", "_expand")

    def __init__(self, records: Any, extra: dict, seq0: int, events: int, next_aid: int,
                 region_ptrs: list, region_ends: list, device: int,
                 expand: Callable[..., dict]) -> None:
        self.records = records      # int64 buffer, 8 ints per operation
        self.extra = extra          # {seq: (setting, old, new)}
        self.seq0 = seq0
        self.events = events        # events the records expand into
        self.next_aid = next_aid
        self.region_ptrs = region_ptrs
        self.region_ends = region_ends
        self.device = device
        self._expand = expand

    def columns(self) -> dict[str, np.ndarray]:
        """The batch's events as columns keyed like :data:`gpudash.events.COLUMNS`."""
        return self._expand(self.records, self.seq0, self.next_aid, self.region_ptrs,
                            self.region_ends, self.device)


class _Outbox:
    """Events on their way to ``subscribe`` callbacks; guarded by the allocator's lock.

    ``batches`` holds ``(events, callbacks)`` of each operation, in seq order; ``thread`` is
    the ident of the thread delivering them now (None: nobody); ``waiting`` counts the
    threads held back while ``OUTBOX_MAX`` batches wait; ``cond`` (on the allocator's lock)
    wakes them."""

    __slots__ = ("batches", "cond", "thread", "waiting")

    def __init__(self, lock: Any) -> None:
        self.batches: deque = deque()
        self.thread: int | None = None
        self.waiting = 0
        self.cond = threading.Condition(lock)


class EventSource:
    """Mixin: ``subscribe``, batch sinks, ``flush_events``, ``seq`` over ``_journal``."""

    _lock: Any
    _name: str
    _next_aid: int
    device_index: int

    def _init_events(self) -> None:
        self._journal: list[int] | None = None
        self._journal_seq = 0  # seq of the first event of _journal
        self._journal_extra: dict[int, tuple] = {}  # seq -> (setting, old, new)
        self._counted = (0, 0)  # (journal position, events in the records before it)
        self._flush_at = JOURNAL_FLUSH  # journal length at which _after_op must run
        self._callbacks: list[Callable[[Event], Any]] = []
        self._sinks: list[Callable[[dict, dict], Any]] = []
        self._raw_sinks: list[Callable[[list, dict], Any]] = []
        self._batch_sinks: list[Callable[[JournalBatch], Any]] = []
        self._outbox = _Outbox(self._lock)
        self.device_index = 0

    def _reset_listeners(self) -> None:
        """No listener, nothing buffered (a copy of an allocator starts so)."""
        self._journal = None
        self._journal_extra = {}
        self._callbacks = []
        self._sinks = []
        self._raw_sinks = []
        self._batch_sinks = []
        self._outbox = _Outbox(self._lock)
        self._flush_at = JOURNAL_FLUSH

    @staticmethod
    def _expand_journal(journal: Any, seq0: int, next_aid: int, region_ptrs: Any,
                        region_ends: Any, device: int) -> dict[str, np.ndarray]:
        """:func:`expand_records` of a journal (the compiled core brings its own)."""
        recs = journal if isinstance(journal, np.ndarray) else \
            np.fromiter(journal, np.int64, len(journal))
        return expand_records(recs.reshape(-1, W), seq0, next_aid, region_ptrs, region_ends,
                              device)

    #: :func:`count_events` (the compiled core brings its own).
    _count_events = staticmethod(count_events)

    @staticmethod
    def _keep_journal(journal: Any, pos: int) -> tuple[Any, int]:
        """A flushed journal as a :class:`JournalBatch` keeps it, an int64 array, and the
        events of its records from ``pos`` on (the compiled core keeps its own journal when
        it is mostly full, and knows its events)."""
        records = np.fromiter(journal, np.int64, len(journal))
        r = records[pos:].reshape(-1, W)
        more = sum(int(np.count_nonzero(m))
                   for m in _events_per_record(r[:, 1], r[:, 5], r[:, 6], r[:, 7]))
        return records, len(r) + more

    # -- hooks ---------------------------------------------------------------------------
    def _region_table(self) -> tuple[list[int], list[int]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _region_at(self, ptr: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- subscribing -------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[Event], Any]) -> Callable[[], None]:
        """Call ``callback(event)`` after every change of state; returns ``unsubscribe``.

        Callbacks run after the change, outside the allocator's lock, one event at a time,
        in ``seq`` order. One thread delivers at a time: the thread that made the change,
        unless another thread is delivering already; then that thread delivers these
        events too, after the ones before them, and the call that made the change returns
        at once. So in one thread a call returns after its events were delivered; a slow
        callback holds up no other thread's allocations (they take the lock and go on);
        and a callback may wait for a thread that allocates (a ``join``): that thread's
        events are delivered when the callback has returned. Only when 4,096 operations
        (``OUTBOX_MAX``) wait for delivery does a thread that makes one more wait for the
        callbacks to catch up (a callback that waits on a thread making that many never
        returns). A callback that allocates or frees (on this allocator) sees its own
        events after the event it is handling has reached every callback.

        A callback that raises is reported with a :class:`GpudashWarning` and never breaks
        the allocator or the other subscribers.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable; got {callback!r}")
        with self._lock:
            if self._journal:
                self._flush_locked()
            self._callbacks.append(callback)
            self._update_journal()

        def unsubscribe() -> None:
            with self._lock:
                try:
                    self._callbacks.remove(callback)
                except ValueError:
                    return
                self._update_journal()

        return unsubscribe

    def _add_sink(self, sink: Callable[..., Any], *, raw: bool = False, batch: bool = False
                  ) -> Callable[[], None]:
        """Deliver events in batches, every few thousand events and on :meth:`flush_events`.

        ``sink(columns, extra)``: numpy arrays keyed like :data:`gpudash.events.COLUMNS`
        (one row per event) and ``extra`` = {seq: (setting, old, new)}. With ``raw=True``,
        ``sink(records, extra)`` gets the journal itself instead: a flat list of ints, 8 per
        operation, read-only, with no conversion at all -- for listeners that only count
        (the live views). With ``batch=True``, ``sink(batch)`` gets a :class:`JournalBatch`:
        the records kept as they are, expanded only when read (the Recorder).
        """
        if raw and batch:
            raise ValueError("a sink is raw or takes batches, not both")
        sinks = "_raw_sinks" if raw else "_batch_sinks" if batch else "_sinks"
        with self._lock:
            if self._journal:
                self._flush_locked()  # earlier events go to earlier listeners only
            getattr(self, sinks).append(sink)
            self._update_journal()

        def remove() -> None:
            self.flush_events()
            with self._lock:
                try:
                    getattr(self, sinks).remove(sink)
                except ValueError:
                    return
                self._update_journal()

        return remove

    def _update_journal(self) -> None:
        if self._journal:
            self._flush_locked()
        listening = bool(self._callbacks or self._sinks or self._raw_sinks or self._batch_sinks)
        if listening and self._journal is None:
            self._journal = []
            self._counted = (0, 0)
        elif not listening and self._journal is not None:
            self._journal = None
            self._journal_extra.clear()
        # With per-event callbacks every op must dispatch; otherwise only a full journal
        # needs attention.
        self._flush_at = 0 if self._callbacks else JOURNAL_FLUSH

    def _seq_now(self) -> int:
        """Lock held: the seq the next event will get."""
        journal = self._journal
        if journal is None:
            return self._journal_seq
        pos, n = self._counted
        if pos < len(journal):
            n += self._count_events(journal, pos)
            self._counted = (len(journal), n)
        return self._journal_seq + n

    @property
    def seq(self) -> int:
        """The seq the next event will get (events are counted while anyone listens)."""
        with self._lock:
            return self._seq_now()

    def _log_setting(self, setting: str, old: Any, new: Any, new_int: int, old_int: int) -> None:
        journal = self._journal
        if journal is None:
            return
        self._journal_extra[self._seq_now()] = (setting, old, new)
        journal.extend((now_ns(), _LIMIT, 0, new_int, old_int, 0, 0, 0))

    def note_setting(self, setting: str, old: Any, new: Any) -> None:
        """Record a ``limit`` event for a setting changed above the allocator (a session's
        fraction, a PyTorch setting), so that views can mark it."""
        with self._lock:
            journal = self._journal
            if journal is None:
                return
            start = len(journal)
            as_int = [v if type(v) is int else 0 for v in (new, old)]
            self._log_setting(setting, old, new, as_int[0], as_int[1])
            self._after_op(start)

    # -- expansion ------------------------------------------------------------------------------
    def _expand_python(self, records: list[int], seq: int) -> list[Event]:
        """Lock held, right after the op: a few journal records as Event objects."""
        out: list[Event] = []
        extra = self._journal_extra
        dev = self.device_index
        name = self._name
        released = [(records[i + 2], records[i + 3]) for i in range(0, len(records), W)
                    if records[i + 1] == _RELEASE]
        aid_next = self._next_aid - sum(1 for i in range(0, len(records), W)
                                        if records[i + 1] == _ALLOC)
        for i in range(0, len(records), W):
            t, code, ptr, size, req, a, b, c = records[i:i + W]
            rptr = self._region_at(ptr) if code in (_ALLOC, _FREE) else 0
            if not rptr and code == _FREE:
                rptr = next((rp for rp, rs in released if rp <= ptr < rp + rs), 0)
            if code == _ALLOC:
                if a:
                    out.append(Event(seq, t, _SPLIT, ptr + size, a, size, bin_num_for_size(a),
                                     rptr, -1, dev, name))
                    seq += 1
                out.append(Event(seq, t, _ALLOC, ptr, size, req, bin_num_for_size(size), rptr,
                                 aid_next, dev, name))
                aid_next += 1
                seq += 1
            elif code == _FREE:
                out.append(Event(seq, t, _FREE, ptr, size, req, bin_num_for_size(size), rptr,
                                 a, dev, name))
                seq += 1
                if b:
                    out.append(Event(seq, t, _MERGE, ptr, size + b, b, -1, rptr, -1, dev, name))
                    seq += 1
                if c:
                    out.append(Event(seq, t, _MERGE, ptr - c, c + size + b, size + b, -1, rptr,
                                     -1, dev, name))
                    seq += 1
            else:
                b_ = bin_num_for_size(size) if code in (_OOM, _SPLIT) else -1
                rptr = ptr if code in (_EXTEND, _RELEASE) else 0
                ev = Event(seq, t, code, ptr, size, req, b_, rptr, -1, dev, name)
                if code == _LIMIT and seq in extra:
                    ev.setting, ev.old, ev.new = extra[seq]
                out.append(ev)
                seq += 1
        return out

    def _after_op(self, start: int) -> None:
        """Lock held: queue the op's events for callbacks and deliver them
        (:meth:`_deliver`), and hand full batches to sinks."""
        journal = self._journal
        if self._callbacks and len(journal) > start:
            # seq of the op's first event: count the events of the records before it.
            pos, n = self._counted
            if pos < start:
                n += self._count_events(journal, pos, start)
            seq = self._journal_seq + n
            events = self._expand_python(journal[start:], seq)
            self._counted = (len(journal), n + self._count_events(journal, start))
            # queued under the lock, so the batches are in seq order
            batch = (events, list(self._callbacks))
            outbox = self._outbox
            outbox.batches.append(batch)
            self._deliver(outbox, batch)
            journal = self._journal
            if journal is None:
                return
        if len(journal) >= JOURNAL_FLUSH:
            self._flush_locked()

    def _deliver(self, outbox: _Outbox, own: tuple) -> None:
        """Lock held on entry and on return: hand queued events to callbacks, with the
        lock released while they run.

        One thread delivers at a time (``outbox.thread``), batch by batch in seq order,
        until none is left: its own batch ``own``, those queued before it and those other
        threads queue meanwhile. A thread that finds a deliverer at work returns at once,
        unless ``OUTBOX_MAX`` batches wait: then it waits (outside the lock) until they
        are fewer, or until the deliverer, its own batch delivered, hands the role over
        to a waiting thread (so no thread delivers for others for ever)."""
        batches = outbox.batches
        if outbox.thread is not None:
            if outbox.thread == _get_ident() or len(batches) <= OUTBOX_MAX:
                return  # the deliverer (this thread, in a callback, or another) takes it
            outbox.waiting += 1
            try:
                while outbox.thread is not None and len(batches) > OUTBOX_MAX:
                    outbox.cond.wait()
            finally:
                outbox.waiting -= 1
            if outbox.thread is not None or not batches:
                return
        lock = self._lock
        outbox.thread = _get_ident()
        done = False
        try:
            while batches:
                if outbox.waiting:
                    if done:
                        break  # a waiting thread delivers the rest
                    outbox.cond.notify_all()
                events, callbacks = batch = batches.popleft()
                if batch is own:
                    done = True
                lock.release()
                try:
                    for ev in events:
                        for cb in callbacks:
                            try:
                                cb(ev)
                            except Exception as exc:  # noqa: BLE001 - isolate subscribers
                                warnings.warn(
                                    f"gpudash: event subscriber {cb!r} raised {exc!r} on "
                                    f"{ev!r}; the allocator goes on", GpudashWarning,
                                    stacklevel=4)
                finally:
                    lock.acquire()
        finally:
            outbox.thread = None
            if outbox.waiting:
                outbox.cond.notify_all()

    def flush_events(self) -> None:
        """Hand buffered events to batch sinks (the Recorder, live views) now."""
        with self._lock:
            if self._journal is not None:
                self._flush_locked()

    def _flush_locked(self) -> None:
        journal = self._journal
        if not journal:
            return
        seq0 = self._journal_seq
        extra = self._journal_extra
        pos, counted = self._counted
        self._journal = []
        self._journal_extra = {}
        self._counted = (0, 0)
        for sink in list(self._raw_sinks):
            try:
                sink(journal, extra)
            except Exception as exc:  # noqa: BLE001 - isolate subscribers
                warnings.warn(f"gpudash: event sink {sink!r} raised {exc!r}; the allocator goes on",
                              GpudashWarning, stacklevel=3)
        if not (self._sinks or self._batch_sinks):
            self._journal_seq = seq0 + counted + self._count_events(journal, pos)
            return
        ptrs, ends = self._region_table()
        if self._batch_sinks:
            records, n = self._keep_journal(journal, pos)
            n += counted
            batch = JournalBatch(records, extra, seq0, n, self._next_aid, ptrs, ends,
                                 self.device_index, self._expand_journal)
            self._journal_seq = seq0 + n
            for sink in list(self._batch_sinks):
                try:
                    sink(batch)
                except Exception as exc:  # noqa: BLE001 - isolate subscribers
                    warnings.warn(f"gpudash: event sink {sink!r} raised {exc!r}; the allocator "
                                  f"goes on", GpudashWarning, stacklevel=3)
            if not self._sinks:
                return
        columns = self._expand_journal(journal, seq0, self._next_aid, ptrs, ends,
                                       self.device_index)
        self._journal_seq = seq0 + len(columns["seq"])
        for sink in list(self._sinks):
            try:
                sink(columns, extra)
            except Exception as exc:  # noqa: BLE001 - isolate subscribers
                warnings.warn(f"gpudash: event sink {sink!r} raised {exc!r}; the allocator goes on",
                              GpudashWarning, stacklevel=3)
