"""The in-memory trace (:class:`Trace`) and gpudash's own trace file format (``.gdtrace``).

A trace is a table of allocator events with the columns of :data:`gpudash.events.COLUMNS`
(one numpy array per column, all the same length), a JSON-serialisable ``meta`` dict and the
``settings`` of its ``limit`` events.

File format
-----------
A ``.gdtrace`` file is written in batches, so a process killed mid-run loses at most the batch
it had not written yet::

    b"GPUDASH-TRACE 2\\n"                       magic line (version 1 files are still read)
    record*                                    each one:
        header   24 bytes, little endian: b"GDRC", type (u8), 3 pad bytes,
                 json_len (u32), payload_len (u64), crc32 (u32) of the first 20 header
                 bytes + JSON + payload
        JSON     json_len bytes of UTF-8 JSON
        payload  payload_len bytes

Record types: ``1`` metadata (JSON = ``meta``; always the first record), ``2`` an event batch
(JSON = ``{"n", "columns": [[name, offset, nbytes], ...], "settings", "holders"}``; payload =
each column as ``.npy`` bytes, in :data:`~gpudash.events.COLUMNS` order, then the ``holder``
column when the batch has holders and the ``stream`` column when it has streams), ``3`` a
metadata update (JSON merged into ``meta``), ``4`` end (written by :meth:`TraceWriter.close`).

Holders (version 2). An event may carry a *holder*: who asked for the memory (an op name with
its dtype and shape from a profile, "requested by op" in a log, a label). A trace keeps them as
an ``int32`` column, :attr:`Trace.holder` (``-1`` = none), indexing a string table,
:attr:`Trace.holders`: 4 bytes per event, each distinct string stored once. In a file, each
batch's JSON lists the strings first used in that batch (``"holders": [...]``, appended to the
table in order), so a file written in batches needs no rewrite of its metadata. Version 1
files (no holders) read with every holder ``-1``.

Streams. An event may carry the stream its block belongs to (PyTorch's allocator caches
blocks per ``cudaStream_t``): :attr:`Trace.stream`, an ``int64`` column, or None when every
row is on the default stream 0 (no bytes spent). A batch writes it only when it has one; a
reader that does not know the column ignores it, and a file without it reads as stream 0.

A reader keeps every complete, crc-valid record after the metadata and warns about the bytes
it ignored; it raises :class:`~gpudash.TraceFormatError` only when the file is not a gpudash
trace or its metadata record is damaged.

Helpers shared by the importers and exporters
---------------------------------------------
Public to the modules of :mod:`gpudash.formats` and the layers above it, not user API (they
are not in ``__all__`` and may change):

- :class:`EventBuilder`: rows appended one event at a time, made into a :class:`Trace`;
- :func:`bins_for_sizes`: TensorFlow's bin of each size (vectorised :func:`bin_for_size`);
- :func:`row_regions`: the region (extended block) each row falls in;
- :func:`device_entries`: ``meta["devices"]`` by index;
- :func:`check_meta`, :func:`check_values`: what a writer refuses to save;
- :func:`parse_flag`, :func:`parse_byte_count`: a recorded on/off setting, a byte count;
- :func:`source_name`, :func:`file_kind`: a source's name and what a non-file is, for messages;
- :func:`open_regular`, :func:`open_new`, :func:`text_source`: opening a file to read (a
  regular file only, never blocking on a FIFO), to write (no clobbering unless asked), and a
  text stream over a path or a file object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import stat
import struct
import time
import warnings
import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any, BinaryIO

import numpy as np
from numpy.lib import format as npformat

from .._errors import GpudashWarning, TraceFormatError
from .._version import __version__
from ..events import (
    COLUMN_DTYPES, COLUMNS, Event, EventKind, ALLOC as _ALLOC, FREE as _FREE, EXTEND as _EXTEND,
    RELEASE as _RELEASE, OOM as _OOM, LIMIT as _LIMIT,
)
from .stacks import STACK_DTYPE, Stack, StackTable

__all__ = [
    "Trace",
    "Calls",
    "TraceWriter",
    "read_trace",
    "write_trace",
    "MAGIC",
    "MAGICS",
    "HOLDER_DTYPE",
    "PRE_EXISTING_HOLDER",
    "round_up_256",
    "bin_for_size",
]

#: First line of every ``.gdtrace`` file gpudash writes (format version 2).
MAGIC = b"GPUDASH-TRACE 2\n"
#: First lines gpudash reads: versions 1 (no holders) and 2.
MAGICS = (b"GPUDASH-TRACE 1\n", MAGIC)
#: dtype of the stream column (:meth:`Trace.streams`).
STREAM_DTYPE = np.int64
#: dtype of the holder column (an index into :attr:`Trace.holders`, -1 = none).
HOLDER_DTYPE = np.int32
#: Holder of the allocations an importer adds for memory in use before its source began
#: (a profile taken mid-run); :meth:`Trace.summary` does not count them as allocations.
PRE_EXISTING_HOLDER = "(in use before the profile)"

_RECORD = struct.Struct("<4sB3xIQI")
_RECORD_MAGIC = b"GDRC"
_REC_META, _REC_EVENTS, _REC_META_UPDATE, _REC_END = 1, 2, 3, 4
_REC_NAMES = {1: "metadata", 2: "event batch", 3: "metadata update", 4: "end"}
# a JSON header larger than this is not one gpudash wrote (guards against garbage lengths)
_MAX_JSON = 1 << 30

# Calls.op's codes (1, 2, 7) are these kinds' own: _calls_by_id copies the kinds


def round_up_256(nbytes: int) -> int:
    """``nbytes`` rounded up to TensorFlow's 256-byte unit (at least 256)."""
    return max(256, (int(nbytes) + 255) & ~255)


def bin_for_size(size: int) -> int:
    """TensorFlow's ``BinNumForSize``: ``min(20, log2(max(size, 256) >> 8))``."""
    return min(20, (max(int(size), 256) >> 8).bit_length() - 1)


def bins_for_sizes(size: np.ndarray) -> np.ndarray:
    """Vectorised :func:`bin_for_size` (exact: values are clipped below 2**21 first)."""
    s = np.minimum(np.maximum(size, 256) >> 8, 1 << 21).astype(np.float64)
    return np.minimum(20, np.floor(np.log2(s))).astype(np.int8)


def device_entries(meta: Mapping) -> dict[int, dict]:
    """``meta["devices"]`` by index (the first entry of each index). Entries that are not
    objects with an integer ``index`` are left out, and so is a ``devices`` that is not a
    list: a trace read from a file had them refused (:func:`read_trace`), and one built in
    memory with odd ones is still usable.

    The result is shared (read it, do not change it): the last list read is remembered, so
    asking per device of a trace with thousands of devices stays linear."""
    devs = meta.get("devices")
    if not isinstance(devs, list):
        return {}
    key = (id(devs), len(devs), id(devs[0]) if devs else 0, id(devs[-1]) if devs else 0)
    last = _ENTRIES_SEEN
    if last and last[0] is devs and last[1] == key:
        return last[2]
    out: dict[int, dict] = {}
    for d in devs:
        if _has_index(d):
            out.setdefault(int(d["index"]), d)
    _ENTRIES_SEEN[:] = [devs, key, out]
    return out


# the last ``meta["devices"]`` list device_entries read: [the list, its key, the entries]
_ENTRIES_SEEN: list = []


def _has_index(entry: Any) -> bool:
    """Whether a ``meta["devices"]`` entry is an object with an integer ``index``."""
    if not isinstance(entry, dict):
        return False
    idx = entry.get("index")
    return isinstance(idx, (int, np.integer)) and not isinstance(idx, (bool, np.bool_))


def _default_meta(meta: Mapping | None) -> dict:
    out = dict(meta) if meta is not None else {}
    out.setdefault("gpudash_version", __version__)
    out.setdefault("source", "gpudash")
    out.setdefault("devices", [])
    return out


def _kind_values(kinds: Any) -> list[int]:
    if isinstance(kinds, (int, str, EventKind)):
        kinds = [kinds]
    out = []
    for k in kinds:
        if isinstance(k, str):
            try:
                k = EventKind[k.upper()]
            except KeyError:
                raise ValueError(f"unknown event kind {k!r}; expected one of "
                                 f"{[str(e) for e in EventKind]}") from None
        out.append(int(k))
    return out


@dataclasses.dataclass(eq=False)
class Calls:
    """The replayable calls of a trace: every alloc, free and refused allocation, in order.

    Attributes
    ----------
    op : numpy.ndarray of int8
        1 (alloc), 2 (free) or 7 (an allocation that was refused: an OOM attempt).
    key : numpy.ndarray of int64
        Pairs each free with its alloc (0 for OOM attempts). It is the ``alloc_id`` where the
        trace has one (> 0), else a key assigned by matching the free's pointer to the live
        allocation at that pointer. When a trace holds several devices whose ids collide,
        keys become ``(device << 40) | key``.
    nbytes : numpy.ndarray of int64
        Bytes requested (for a free: those requested by its alloc).
    time_ns : numpy.ndarray of int64
        The event's time.
    device : numpy.ndarray of int16
        The device of each call.
    row : numpy.ndarray of int64
        The row of each call in the trace it came from.
    unmatched_frees : int
        Frees with no live allocation to pair with (a log that starts mid-run); they are
        dropped from the call list.
    """

    op: np.ndarray
    key: np.ndarray
    nbytes: np.ndarray
    time_ns: np.ndarray
    device: np.ndarray
    row: np.ndarray
    unmatched_frees: int = 0

    def __len__(self) -> int:
        return len(self.op)

    def __repr__(self) -> str:
        return (f"Calls(n={len(self)}, allocs={int((self.op == 1).sum())}, "
                f"frees={int((self.op == 2).sum())}, ooms={int((self.op == 7).sum())}, "
                f"unmatched_frees={self.unmatched_frees})")


class Trace:
    """A columnar table of allocator events.

    Parameters
    ----------
    columns : mapping of str to array-like, optional
        Exactly the columns of :data:`gpudash.events.COLUMNS`, all the same length. Arrays of
        the right dtype are used as they are (not copied); others are converted.
    meta : dict, optional
        JSON-serialisable facts about the trace. Missing ``gpudash_version``, ``source``
        (``"gpudash"``) and ``devices`` (``[]``) are filled in. ``devices`` is a list of
        ``{"index", "name", "capacity", "options"}``.
    settings : list of dict, optional
        ``{"seq", "setting", "old", "new"}`` for each ``limit`` event, matched to its row by
        ``seq`` (and by ``device`` when the dict has one: a Recorder of several allocators
        numbers each allocator's events from 0).
    holder : array-like of int, optional
        The holder of each row: an index into ``holders``, or -1 for none (the default for
        every row). A free carries the holder of the allocation it frees.
    holders : sequence of str, optional
        The string table ``holder`` indexes (default empty).
    stack : array-like of int, optional
        The call stack each row's source recorded (PyTorch: the frames of each allocator
        call): an index into ``stacks``, or -1 for none. Default: no stacks (None).
    stacks : StackTable, optional
        The interned frames and stacks ``stack`` indexes (:mod:`gpudash.formats.stacks`).

    Attributes
    ----------
    holder : numpy.ndarray of int32
        See above; always present (all -1 when the source named no holders).
    holders : list of str
        The holder string table. Slices of a trace share it; :meth:`intern_holder` appends.
    stack : numpy.ndarray of int32 or None
        See above; None when the source recorded no stacks (:meth:`stack_ids` is then all
        -1, and no bytes are spent).
    stacks : StackTable
        The stack table. Slices of a trace share it.

    Raises
    ------
    TraceFormatError
        Missing or unknown columns, columns of different lengths, values that do not fit
        a column's dtype, or holder or stack indices outside their tables.

    Notes
    -----
    Slicing and :meth:`select` keep the ``seq`` values of the rows they keep, so a row can be
    traced back to its source; :meth:`concat` renumbers ``seq`` from 0.
    """

    __slots__ = ("columns", "meta", "settings", "holder", "holders", "stream", "stack",
                 "stacks")

    def __init__(self, columns: Mapping[str, Any] | None = None, meta: Mapping | None = None,
                 settings: Iterable[Mapping] | None = None, *, holder: Any = None,
                 holders: Iterable[str] | None = None, stream: Any = None, stack: Any = None,
                 stacks: StackTable | None = None) -> None:
        if columns is None:
            columns = {name: np.empty(0, dtype=COLUMN_DTYPES[name]) for name in COLUMNS}
        self.columns = _check_columns(columns)
        self.meta = _default_meta(meta)
        self.settings = [dict(s) for s in settings] if settings is not None else []
        self.holders = holders if isinstance(holders, list) else list(holders or ())
        self.holder = _check_holder(holder, len(self.columns["seq"]), len(self.holders))
        self.stream = _check_stream(stream, len(self.columns["seq"]))
        if stacks is not None and not isinstance(stacks, StackTable):
            raise TypeError(f"stacks must be a gpudash.formats.stacks.StackTable; got "
                            f"{type(stacks).__name__}")
        self.stacks = stacks if stacks is not None else StackTable()
        self.stack = _check_stack(stack, len(self.columns["seq"]), len(self.stacks))

    # ---------------------------------------------------------------- construction
    @classmethod
    def empty(cls, meta: Mapping | None = None) -> Trace:
        """A trace with no events."""
        return cls(None, meta)

    @classmethod
    def concat(cls, traces: Iterable[Trace]) -> Trace:
        """One trace holding the rows of ``traces`` in order, ``seq`` renumbered from 0.

        ``meta`` is the first trace's, with the ``devices`` of all of them (the first entry
        for each device index wins); settings follow their rows.
        """
        traces = list(traces)
        if not traces:
            return cls.empty()
        cols = {name: np.concatenate([t.columns[name] for t in traces]) for name in COLUMNS}
        cols["seq"] = np.arange(len(cols["seq"]), dtype=np.int64)
        meta = dict(traces[0].meta)
        devices: dict[int, dict] = {}
        for t in traces:
            for i, d in device_entries(t.meta).items():
                devices.setdefault(i, d)
        meta["devices"] = [devices[i] for i in sorted(devices)]
        settings = []
        offset = 0
        for t in traces:
            for s, row in t._settings_rows():
                settings.append({**s, "seq": offset + row})
            offset += len(t)
        holders: list[str] = []
        index: dict[str, int] = {}
        parts = []
        for t in traces:
            remap = np.array([index.setdefault(h, len(index)) for h in t.holders] + [-1],
                             dtype=HOLDER_DTYPE)
            parts.append(remap[t.holder])          # -1 indexes the trailing -1
        holders = list(index)
        holder = np.concatenate(parts) if parts else None
        stream = None
        if any(t.stream is not None for t in traces):
            stream = np.concatenate([t.streams() for t in traces])
        stacks, stack = StackTable(), None
        if any(t.stack is not None for t in traces):
            ids = []
            for t in traces:
                if t.stacks is stacks or not len(t.stacks):
                    ids.append(t.stack_ids())
                    continue
                if not len(stacks):     # the first table is taken as it is
                    stacks = t.stacks.copy()
                    ids.append(t.stack_ids())
                    continue
                stacks, remap = stacks.merged(t.stacks)
                ids.append(remap[t.stack_ids()])
            stack = np.concatenate(ids)
        return cls(cols, meta, settings, holder=holder, holders=holders, stream=stream,
                   stack=stack, stacks=stacks)

    # ---------------------------------------------------------------- container protocol
    def __len__(self) -> int:
        return len(self.columns["seq"])

    def __getattr__(self, name: str) -> np.ndarray:
        if name in COLUMN_DTYPES:
            return self.columns[name]
        raise AttributeError(f"'Trace' object has no attribute {name!r}")

    def __getitem__(self, index: Any) -> Event | Trace:
        if isinstance(index, (int, np.integer)):
            n = len(self)
            i = int(index) + n if index < 0 else int(index)
            if not 0 <= i < n:
                raise IndexError(f"event index {index} out of range for a trace of {n} events")
            return self._event(i)
        cols = {name: col[index] for name, col in self.columns.items()}
        kept = Trace(cols, self.meta, holder=self.holder[index], holders=self.holders,
                     stream=None if self.stream is None else self.stream[index],
                     stack=None if self.stack is None else self.stack[index],
                     stacks=self.stacks)
        if self.settings:
            rows = set(np.arange(len(self))[index].tolist())
            kept.settings = [s for s, row in self._settings_rows() if row in rows]
        return kept

    def __iter__(self):
        for i in range(len(self)):
            yield self._event(i)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        if not (len(self) == len(other)
                and all(np.array_equal(self.columns[n], other.columns[n]) for n in COLUMNS)
                and self.meta == other.meta and self.settings == other.settings
                and np.array_equal(self.streams(), other.streams())
                and _same_stacks(self, other)):
            return False
        if self.holders == other.holders:
            return bool(np.array_equal(self.holder, other.holder))
        return bool(np.array_equal(self.holder_names(), other.holder_names()))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Trace(events={len(self)}, devices={len(self.devices)}, "
                f"source={self.meta.get('source')!r}, duration_ns={self.duration_ns})")

    def _event(self, i: int) -> Event:
        c = self.columns
        kind = int(c["kind"][i])
        device = int(c["device"][i])
        names = {i: d.get("name") or "" for i, d in device_entries(self.meta).items()}
        setting = old = new = None
        seq = int(c["seq"][i])
        if kind == _LIMIT:
            for s in self.settings:
                if int(s["seq"]) == seq and int(s.get("device", device)) == device:
                    setting, old, new = s.get("setting"), s.get("old"), s.get("new")
                    break
        return Event(seq, int(c["time_ns"][i]), kind, int(c["ptr"][i]), int(c["size"][i]),
                     int(c["requested"][i]), int(c["bin"][i]), int(c["region"][i]),
                     int(c["alloc_id"][i]), device, names.get(device, ""), setting, old, new)

    def _settings_rows(self) -> list[tuple[dict, int]]:
        """Each setting with the row of its ``limit`` event (settings with no row left out)."""
        if not self.settings:
            return []
        c = self.columns
        rows = np.flatnonzero(c["kind"] == _LIMIT)
        by_seq: dict[int, list[int]] = {}
        for r in rows.tolist():
            by_seq.setdefault(int(c["seq"][r]), []).append(r)
        out = []
        for s in self.settings:
            for r in by_seq.get(int(s["seq"]), ()):
                if "device" not in s or int(s["device"]) == int(c["device"][r]):
                    out.append((s, r))
                    break
        return out

    def streams(self) -> np.ndarray:
        """The stream of every row (int64; 0, the default stream, where the source names
        none). A stream is what PyTorch keeps per block (a ``cudaStream_t`` value): its
        allocator caches blocks per stream."""
        if self.stream is None:
            return np.zeros(len(self), dtype=STREAM_DTYPE)
        return self.stream

    def stack_ids(self) -> np.ndarray:
        """The stack id of every row (int32; -1 where none was recorded)."""
        if self.stack is None:
            return np.full(len(self), -1, dtype=STACK_DTYPE)
        return self.stack

    def stack_of(self, i: int) -> Stack | None:
        """The recorded stack of row ``i`` (frame ids into ``stacks.frames``), or None."""
        s = -1 if self.stack is None else int(self.stack[i])
        return self.stacks.stacks[s] if s >= 0 else None

    def frames_of(self, i: int) -> list:
        """The frames (:class:`~gpudash.formats.stacks.Frame`) of row ``i``'s stack,
        innermost first ([] when none was recorded)."""
        return self.stacks.frames_of(-1 if self.stack is None else int(self.stack[i]))

    # ---------------------------------------------------------------- holders
    def intern_holder(self, name: str) -> int:
        """The index of ``name`` in :attr:`holders`, appending it when new.

        Importers and recorders use it to fill :attr:`holder`; an empty name is "no holder"
        (-1).
        """
        if not name:
            return -1
        try:
            return self.holders.index(name)
        except ValueError:
            self.holders.append(str(name))
            return len(self.holders) - 1

    def holder_of(self, i: int) -> str:
        """The holder of row ``i`` ("" when it has none)."""
        h = int(self.holder[i])
        return self.holders[h] if h >= 0 else ""

    def holder_names(self) -> np.ndarray:
        """The holder of every row as a numpy array of str ("" where none)."""
        table = np.array(list(self.holders) + [""], dtype=object)
        return table[self.holder]

    def set_holders(self, names: Iterable[str | None]) -> None:
        """Set the holder of every row from one name per row (None or "" for none)."""
        names = list(names)
        if len(names) != len(self):
            raise ValueError(f"set_holders needs {len(self)} names, one per row; got "
                             f"{len(names)}")
        self.holder = np.array([self.intern_holder(n) if n else -1 for n in names],
                               dtype=HOLDER_DTYPE)

    # ---------------------------------------------------------------- queries
    @property
    def devices(self) -> list[dict]:
        """The devices of ``meta`` (entries that are objects with an integer ``index``);
        derived from the ``device`` column when meta has none."""
        devs = self.meta.get("devices")
        good = [d for d in devs if _has_index(d)] if isinstance(devs, list) else []
        if good:
            return good
        return [{"index": int(i), "name": f"device{int(i)}", "capacity": None, "options": None}
                for i in np.unique(self.columns["device"])]

    @property
    def duration_ns(self) -> int:
        """Time from the first to the last event (0 for fewer than two events)."""
        t = self.columns["time_ns"]
        return int(t.max() - t.min()) if len(t) else 0

    def select(self, kinds: Any = None, device: int | Iterable[int] | None = None) -> Trace:
        """The rows of some kinds and/or devices.

        Parameters
        ----------
        kinds : EventKind, int, str or iterable of them, optional
            ``"alloc"``, ``EventKind.FREE``, ``[1, 2]``...
        device : int or iterable of int, optional
            Device index or indices.
        """
        mask = np.ones(len(self), dtype=bool)
        if kinds is not None:
            mask &= np.isin(self.columns["kind"], _kind_values(kinds))
        if device is not None:
            devs = [device] if isinstance(device, (int, np.integer)) else list(device)
            mask &= np.isin(self.columns["device"], devs)
        return self[mask]

    def summary(self) -> dict:
        """Counts and peaks, computed with numpy.

        Returns
        -------
        dict
            ``events``, ``kinds`` (events per kind name), ``allocations``, ``frees``,
            ``ooms``, ``devices`` (indices), ``duration_ns``, ``peak_requested_bytes`` and
            ``peak_allocated_bytes`` (highest running sum of +bytes on alloc / -bytes on
            free over all devices; a log that starts mid-run, whose first frees have no
            alloc, is undercounted), and the same two per device index.
            ``allocations`` leaves out the allocations an importer added for memory in use
            before the source began (holder :data:`PRE_EXISTING_HOLDER`), counted in
            ``pre_existing_allocations``; the peaks include that memory.
        """
        c = self.columns
        kind = c["kind"]
        counts = np.bincount(kind.astype(np.int64), minlength=9) if len(kind) else np.zeros(9)
        is_a, is_f = kind == _ALLOC, kind == _FREE

        def peak(col: np.ndarray) -> int:
            delta = np.where(is_a, col, 0) - np.where(is_f, col, 0)
            return max(0, int(np.cumsum(delta).max())) if len(delta) else 0

        devs, peaks_by_device = _peaks_by_device(c["device"], is_a, is_f,
                                                 (c["requested"], c["size"]))
        pre = 0
        if PRE_EXISTING_HOLDER in self.holders:
            pre = int(np.count_nonzero(
                is_a & (self.holder == self.holders.index(PRE_EXISTING_HOLDER))))
        return {
            "events": len(self),
            "kinds": {str(k): int(counts[int(k)]) for k in EventKind},
            "allocations": int(counts[_ALLOC]) - pre,
            "pre_existing_allocations": pre,
            "frees": int(counts[_FREE]),
            "ooms": int(counts[_OOM]),
            "devices": devs,
            "duration_ns": self.duration_ns,
            "peak_requested_bytes": peak(c["requested"]),
            "peak_allocated_bytes": peak(c["size"]),
            "peak_requested_bytes_by_device": peaks_by_device[0],
            "peak_allocated_bytes_by_device": peaks_by_device[1],
        }

    def calls(self, device: int | None = None) -> Calls:
        """The replayable call list: every alloc, free and OOM row, in order.

        Parameters
        ----------
        device : int, optional
            Only this device's calls.

        Returns
        -------
        Calls
            See :class:`Calls`. A free that matches no live allocation (neither by
            ``alloc_id`` nor by pointer) is dropped and counted in ``unmatched_frees``;
            importers of logs that start mid-run produce such frees.
        """
        op, key, nbytes, rows, keep, unmatched = self._paired_calls(device)
        c = self.columns
        every = len(rows) == len(c["kind"])

        def col(name: str) -> np.ndarray:
            # a trace of nothing but calls (most are) needs no gather
            return c[name] if every else c[name][rows]

        devs = col("device")
        if (len(rows) and device is None and devs.min() != devs.max()
                and _has_duplicates(key[op == 1])):
            key = np.where(op == 7, 0, (devs.astype(np.int64) << 40) | key)
        time_ns = col("time_ns")
        if keep is None:
            # rows is this call's own array (flatnonzero): no copy
            return Calls(op, key, nbytes, time_ns.copy() if every else time_ns,
                         devs.copy() if every else devs, rows.astype(np.int64, copy=False),
                         unmatched)
        return Calls(op[keep], key[keep], nbytes[keep], time_ns[keep], devs[keep],
                     rows[keep].astype(np.int64), unmatched)

    def _call_columns(self, device: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``calls(device)``'s ``op``, ``key`` and ``nbytes`` alone: what a replay needs,
        without building the time, device and row columns (a long trace's replay would
        wait on them)."""
        op, key, nbytes, _, keep, _ = self._paired_calls(device, rows=False)
        if keep is None:
            return op, key, nbytes
        return op[keep], key[keep], nbytes[keep]

    def _paired_calls(self, device: int | None, rows: bool = True) -> tuple:
        """The call rows (``device``'s, or all) paired: ``op, key, nbytes`` for each, the
        rows (None with ``rows=False`` where every row is a call), and ``keep`` (None: all)
        with the count of frees left unmatched."""
        c = self.columns
        kind = c["kind"]
        mask = (kind == _ALLOC) | (kind == _FREE) | (kind == _OOM)
        if device is not None:
            mask &= c["device"] == device
        every = bool(mask.all())
        where = None if every and not rows else np.flatnonzero(mask)

        def col(name: str) -> np.ndarray:
            return c[name] if every else c[name][where]

        fast = _calls_by_id(col("kind"), col("alloc_id"), col("device"), col("requested"))
        if fast is not None:
            return (*fast, where, None, 0)
        if where is None:
            where = np.flatnonzero(mask)
        op, key, nbytes, keep, unmatched = self._calls_loop(where)
        return op, key, nbytes, where, keep, unmatched

    def _calls_loop(self, rows: np.ndarray) -> tuple:
        """Pair frees with allocs one row at a time (ids missing, or frees to drop)."""
        c = self.columns
        k = c["kind"][rows].tolist()
        aid = c["alloc_id"][rows].tolist()
        ptr = c["ptr"][rows].tolist()
        dev = c["device"][rows].tolist()
        req = c["requested"][rows].tolist()
        n = len(rows)
        op = np.empty(n, dtype=np.int8)
        key = np.zeros(n, dtype=np.int64)
        nbytes = np.empty(n, dtype=np.int64)
        keep = np.ones(n, dtype=bool)
        pos_ids = c["alloc_id"][rows][c["alloc_id"][rows] > 0]
        next_key = int(pos_ids.max()) + 1 if len(pos_ids) else 1
        live: dict[tuple[int, int], int] = {}        # (device, key) -> requested
        at_ptr: dict[tuple[int, int], int] = {}      # (device, ptr) -> key
        unmatched = 0
        for i in range(n):
            ki = k[i]
            d = dev[i]
            if ki == _ALLOC:
                a = aid[i]
                if a <= 0:
                    a = next_key
                    next_key += 1
                live[(d, a)] = req[i]
                at_ptr[(d, ptr[i])] = a
                op[i] = 1
                key[i] = a
                nbytes[i] = req[i]
            elif ki == _FREE:
                a = aid[i]
                if a <= 0:
                    a = at_ptr.get((d, ptr[i]), -1)
                r = live.pop((d, a), None)
                if r is None:
                    unmatched += 1
                    keep[i] = False
                    continue
                if at_ptr.get((d, ptr[i])) == a:
                    del at_ptr[(d, ptr[i])]
                op[i] = 2
                key[i] = a
                nbytes[i] = r
            else:
                op[i] = 7
                nbytes[i] = req[i]
        return op, key, nbytes, keep, unmatched


def _peaks_by_device(device: np.ndarray, is_a: np.ndarray, is_f: np.ndarray,
                     cols: tuple[np.ndarray, ...]) -> tuple[list[int], list[dict[int, int]]]:
    """The device indices and, for each column, ``{device: peak}``: the highest running sum
    of +value on alloc / -value on free over each device's rows (0 at least). One stable
    sort by device for all of them: time linear in events + devices (a mask per device
    took devices x events)."""
    if not len(device):
        return [], [{} for _ in cols]
    order = np.argsort(device, kind="stable")
    d_sorted = device[order]
    starts = np.flatnonzero(np.r_[True, d_sorted[1:] != d_sorted[:-1]])
    counts = np.diff(np.append(starts, len(order)))
    devs = d_sorted[starts].tolist()
    out = []
    for col in cols:
        delta = (np.where(is_a, col, 0) - np.where(is_f, col, 0))[order]
        cum = np.cumsum(delta)
        run = cum - np.repeat(cum[starts] - delta[starts], counts)
        peaks = np.maximum(np.maximum.reduceat(run, starts), 0)
        out.append(dict(zip(devs, peaks.tolist())))
    return devs, out


def _has_duplicates(values: np.ndarray, presorted: bool = False) -> bool:
    # a sort, not np.unique: numpy 2's hash-based unique is several times slower here
    s = values if presorted else np.sort(values)
    return bool(len(s) > 1 and (s[1:] == s[:-1]).any())


def _calls_by_id(kind: np.ndarray, alloc_id: np.ndarray, device: np.ndarray,
                 requested: np.ndarray) -> tuple | None:
    """Vectorised pairing for the usual case: every alloc and free has an id (> 0), ids are
    unique per device, and every free follows its alloc and is its only free. None when the
    trace is not like that (the caller then pairs row by row)."""
    a_idx, f_idx = np.flatnonzero(kind == _ALLOC), np.flatnonzero(kind == _FREE)
    a_ids, f_ids = alloc_id[a_idx], alloc_id[f_idx]
    for ids in (a_ids, f_ids):
        if len(ids) and (ids.min() <= 0 or ids.max() >= 1 << 47):
            return None
    if len(device) and device.min() != device.max():
        # ids are unique per device: the key is (device, id)
        a_keys = (device[a_idx].astype(np.int64) << 47) | a_ids
        f_keys = (device[f_idx].astype(np.int64) << 47) | f_ids
    else:
        a_keys = a_ids.astype(np.int64, copy=False)
        f_keys = f_ids.astype(np.int64, copy=False)
    n_a = len(a_keys)
    if n_a and int(a_keys[-1]) - int(a_keys[0]) == n_a - 1 and (np.diff(a_keys) > 0).all():
        # the ids count up by one from the first (a recorder's, a snapshot's): a free's
        # alloc is at its id's offset, no sort or search
        if len(f_idx):
            j = f_keys - a_keys[0]
            if not ((j >= 0) & (j < n_a)).all():
                return None
            seen = np.zeros(n_a, dtype=bool)
            seen[j] = True
            if np.count_nonzero(seen) != len(j):
                return None   # an alloc freed twice
            alloc_pos = a_idx[j]
            if not (alloc_pos < f_idx).all():
                return None
    else:
        order = np.argsort(a_keys, kind="stable")
        sk = a_keys[order]
        if _has_duplicates(sk, presorted=True):
            return None
        if len(f_idx):
            if not len(sk) or _has_duplicates(f_keys):
                return None
            j = np.minimum(np.searchsorted(sk, f_keys), len(sk) - 1)
            alloc_pos = a_idx[order[j]]
            if not ((sk[j] == f_keys) & (alloc_pos < f_idx)).all():
                return None
    # the call ops are the kinds' own codes (alloc 1, free 2, refused 7), and the keys the
    # ids (0 for refusals): one copy each
    op = kind.astype(np.int8, copy=True)
    key = alloc_id.astype(np.int64, copy=True)
    if len(a_idx) + len(f_idx) < len(kind):
        key[kind == _OOM] = 0
    nbytes = requested.astype(np.int64, copy=True)
    if len(f_idx):
        nbytes[f_idx] = requested[alloc_pos]
    return op, key, nbytes


def _check_stream(stream: Any, n: int) -> np.ndarray | None:
    """None (every row on stream 0) or an int64 array of ``n`` streams."""
    if stream is None:
        return None
    try:
        arr = np.asarray(stream)
        if arr.dtype != np.dtype(STREAM_DTYPE):
            if arr.size and arr.dtype.kind not in "iu":
                raise ValueError(f"streams must be integers; got {arr.dtype}")
            arr = arr.astype(STREAM_DTYPE)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TraceFormatError(f"trace stream column: {exc}") from None
    if arr.shape != (n,):
        raise TraceFormatError(f"trace stream column must have {n} values (one per row); got "
                               f"shape {arr.shape}")
    return arr if arr.any() else None


def _check_stack(stack: Any, n: int, n_stacks: int) -> np.ndarray | None:
    if stack is None:
        return None
    if not (isinstance(stack, np.ndarray) and stack.dtype == STACK_DTYPE):
        try:
            arr = np.asarray(stack)
            if arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"expected integers, found {arr.dtype}")
            stack = arr.astype(STACK_DTYPE, casting="same_kind") if arr.size else \
                np.zeros(arr.shape, dtype=STACK_DTYPE)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TraceFormatError(f"trace stack column: {exc}") from None
    if stack.shape != (n,):
        raise TraceFormatError(f"trace stack column must have {n} values (one per row); "
                               f"got shape {stack.shape}")
    if n and (stack.min() < -1 or stack.max() >= n_stacks):
        raise TraceFormatError(
            f"trace stack column: indices must be -1 or in [0, {n_stacks}) (the stack "
            f"table); got {int(stack.min())}..{int(stack.max())}")
    return stack


def _same_stacks(a: Trace, b: Trace) -> bool:
    """Whether every row of ``a`` and ``b`` has the same recorded stack, frame by frame."""
    if a.stack is None and b.stack is None:
        return True
    sa, sb = a.stack_ids(), b.stack_ids()
    if a.stacks == b.stacks:
        return bool(np.array_equal(sa, sb))
    if not np.array_equal(sa < 0, sb < 0):
        return False
    def resolved(t: Trace) -> list:
        return [(tuple(t.stacks.frames_of(s)), *t.stacks.stacks[s][1:])
                for s in range(len(t.stacks))]
    ra, rb = resolved(a), resolved(b)
    keep = sa >= 0
    return all(ra[x] == rb[y] for x, y in zip(sa[keep].tolist(), sb[keep].tolist()))


def _check_holder(holder: Any, n: int, n_holders: int) -> np.ndarray:
    if holder is None:
        return np.full(n, -1, dtype=HOLDER_DTYPE)
    if not (isinstance(holder, np.ndarray) and holder.dtype == HOLDER_DTYPE):
        try:
            arr = np.asarray(holder)
            out = arr.astype(HOLDER_DTYPE)
            if arr.size and not np.array_equal(out, arr):
                raise ValueError("values do not fit int32")
        except (ValueError, TypeError, OverflowError) as exc:
            raise TraceFormatError(f"trace holder column: {exc}") from None
        holder = out
    if holder.shape != (n,):
        raise TraceFormatError(f"trace holder column must have {n} values (one per row); "
                               f"got shape {holder.shape}")
    if n and (holder.min() < -1 or holder.max() >= n_holders):
        raise TraceFormatError(
            f"trace holder column: indices must be -1 or in [0, {n_holders}) (the holder "
            f"table); got {int(holder.min())}..{int(holder.max())}")
    return holder


def _check_columns(columns: Mapping[str, Any]) -> dict[str, np.ndarray]:
    names = set(columns)
    missing = [n for n in COLUMNS if n not in names]
    extra = sorted(names - set(COLUMNS))
    if missing or extra:
        raise TraceFormatError(
            f"trace columns must be exactly {list(COLUMNS)}; "
            + (f"missing {missing}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"unknown {extra}" if extra else ""))
    out = {}
    for name in COLUMNS:
        dtype = np.dtype(COLUMN_DTYPES[name])
        col = columns[name]
        if isinstance(col, np.ndarray) and col.dtype == dtype and col.ndim == 1:
            out[name] = col
            continue
        try:
            arr = np.asarray(col)
            if arr.ndim != 1:
                raise ValueError(f"expected a 1-d array, got shape {arr.shape}")
            conv = arr.astype(dtype)
            if arr.size and not np.array_equal(conv, arr):
                raise ValueError(f"values do not fit {dtype}")
        except (ValueError, TypeError, OverflowError) as exc:
            raise TraceFormatError(f"trace column {name!r}: {exc}") from None
        out[name] = conv
    lengths = {name: len(col) for name, col in out.items()}
    if len(set(lengths.values())) > 1:
        raise TraceFormatError(f"trace columns must all have the same length; got {lengths}")
    return out


# ============================================================================ checks
#: The largest device index a trace holds (its ``device`` column is int16).
MAX_DEVICE = (1 << 15) - 1
_MAX_BYTES = (1 << 63) - 1


def _short(value: Any) -> str:
    """A value for a message: its repr, cut to 40 characters."""
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else \
        type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def parse_flag(value: Any) -> bool | None:
    """A recorded on/off setting (``allow_growth``, ``garbage_collection``): a JSON
    boolean (or numpy's), None when absent.

    Raises
    ------
    ValueError
        Anything else, the strings ``"true"`` and ``"false"`` included: as the live
        settings refuse ``allow_growth="false"``, a value that is not a boolean is not
        guessed at (``bool("false")`` is True).
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, str):
        raise ValueError(f"{_short(value)} (a string); expected true or false (JSON "
                         "booleans)")
    raise ValueError(f"{_short(value)}; expected true or false")


def parse_byte_count(value: Any) -> int | None:
    """A recorded byte count (``capacity``, ``memory_limit``): an integer 0 .. 2**63-1, or
    None. ValueError for anything else (a string, NaN, infinity, a fraction, a negative)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 0 <= value <= _MAX_BYTES:
        raise ValueError(f"{_short(value)}; expected a whole number of bytes 0 .. 2**63-1")
    return int(value)


def check_meta(meta: Mapping, name: str) -> None:
    """Refuse metadata whose ``devices`` a reader of the trace could not use: not a list of
    objects, an ``index`` that is not an integer 0 .. 32767, a ``name`` that is not a
    string, a ``capacity`` or ``memory_limit`` that is not a byte count, ``options`` that
    are not an object, or an ``allow_growth``/``garbage_collection`` that is not a
    boolean (see :func:`parse_flag`). The message names the file, the entry and the field."""
    devs = meta.get("devices")
    if devs is None:
        return
    if not isinstance(devs, list):
        raise TraceFormatError(f"{name}: metadata 'devices' is {_short(devs)}; expected a "
                               "list of objects with an 'index'")
    for i, d in enumerate(devs):
        where = f"{name}: metadata devices[{i}]"
        if not isinstance(d, dict):
            raise TraceFormatError(f"{where} is {_short(d)}; expected an object with an "
                                   "'index'")
        idx = d.get("index")
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx <= MAX_DEVICE:
            raise TraceFormatError(f"{where}: 'index' is {_short(idx)}; expected an integer "
                                   f"0 .. {MAX_DEVICE}")
        if d.get("name") is not None and not isinstance(d["name"], str):
            raise TraceFormatError(f"{where}: 'name' is {_short(d['name'])}; expected a "
                                   "string")
        opts = d.get("options")
        if opts is not None and not isinstance(opts, dict):
            raise TraceFormatError(f"{where}: 'options' is {_short(opts)}; expected an "
                                   "object")
        checks = [(d, "capacity", parse_byte_count), (d, "memory_limit", parse_byte_count)]
        if opts:
            checks += [(opts, "memory_limit", parse_byte_count), (opts, "allow_growth", parse_flag),
                       (opts, "garbage_collection", parse_flag)]
        for holder, key, check in checks:
            try:
                check(holder.get(key))
            except ValueError as exc:
                field = key if holder is d else f"options.{key}"
                raise TraceFormatError(f"{where}: '{field}' is {exc}") from None


def check_values(trace: Trace, name: str) -> None:
    """Refuse events whose numbers cannot be right: a negative ``size``, a negative
    ``requested`` (but in ``limit`` rows, where it is a setting's old value) or a negative
    ``device``. The message names the file, the event and the value."""
    c = trace.columns
    if not len(c["size"]):
        return
    kind = c["kind"]
    for col, bad, what in (
            ("size", c["size"] < 0, "a negative size ({} B); sizes are bytes >= 0"),
            ("requested", (c["requested"] < 0) & (kind != _LIMIT),
             "a negative requested size ({} B); requested sizes are bytes >= 0"),
            ("device", c["device"] < 0,
             f"device {{}}; devices are 0 .. {MAX_DEVICE}")):
        rows = np.flatnonzero(bad)
        if len(rows):
            raise TraceFormatError(f"{name}: event {int(rows[0])} has "
                                   + what.format(int(c[col][rows[0]])))


# ============================================================================ builder
class EventBuilder:
    """Collects events from an importer and builds a :class:`Trace`.

    It applies the conventions for foreign allocators: ids from 1 in allocation order (over
    the whole trace), frees paired with the live allocation at their pointer (taking its
    size, requested bytes, id and holder), sizes rounded up to 256 when unknown, ``bin`` and
    ``region`` filled in, ``seq`` = row number. ``holder=`` names who asked for the memory
    (allocs and OOMs; "" for none); ``stream=`` the stream an allocation is on (frees and
    segments take theirs).
    """

    def __init__(self) -> None:
        self.time: list[int] = []
        self.kind: list[int] = []
        self.ptr: list[int] = []
        self.size: list[int] = []
        self.requested: list[int] = []
        self.alloc_id: list[int] = []
        self.device: list[int] = []
        self.holder: list[int] = []
        self.stream: list[int] = []
        self._holders: dict[str, int] = {}
        self._live: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        self._next_id = 1
        self.unmatched_frees = 0
        self.devices: dict[int, dict] = {}

    def __len__(self) -> int:
        return len(self.kind)

    def add_device(self, index: int, name: str, capacity: int | None = None,
                   options: dict | None = None) -> int:
        if index not in self.devices:
            self.devices[index] = {"index": index, "name": name, "capacity": capacity,
                                   "options": options}
        return index

    def holder_index(self, name: str | None) -> int:
        """The index of a holder name in the trace's table (-1 for none)."""
        if not name:
            return -1
        h = self._holders.get(name)
        if h is None:
            h = self._holders[name] = len(self._holders)
        return h

    def _row(self, t: int, kind: int, device: int, ptr: int, size: int, requested: int,
             alloc_id: int, holder: int = -1, stream: int = 0) -> None:
        self.holder.append(holder)
        self.stream.append(stream)
        self.time.append(t)
        self.kind.append(kind)
        self.device.append(device)
        self.ptr.append(ptr)
        self.size.append(size)
        self.requested.append(requested)
        self.alloc_id.append(alloc_id)

    def alloc(self, t: int, device: int, ptr: int, requested: int,
              size: int | None = None, holder: str | None = None, stream: int = 0) -> int:
        if size is None:
            size = round_up_256(requested)
        aid = self._next_id
        self._next_id += 1
        self._live[(device, ptr)] = (aid, size, requested, len(self.kind))
        self._row(t, _ALLOC, device, ptr, size, requested, aid, self.holder_index(holder),
                  stream)
        return aid

    def free(self, t: int, device: int, ptr: int, requested: int | None = None,
             size: int | None = None) -> bool:
        """Add a free; False when no live allocation is at ``ptr`` (still added, id -1)."""
        hit = self._live.pop((device, ptr), None)
        if hit is not None:
            aid, sz, req, row = hit
            self._row(t, _FREE, device, ptr, sz, req, aid, self.holder[row], self.stream[row])
            return True
        self.unmatched_frees += 1
        req = int(requested or 0)
        self._row(t, _FREE, device, ptr, size if size is not None else round_up_256(req),
                  req, -1)
        return False

    def oom(self, t: int, device: int, requested: int, size: int | None = None,
            holder: str | None = None, stream: int = 0) -> None:
        self._row(t, _OOM, device, 0, size if size is not None else round_up_256(requested),
                  requested, -1, self.holder_index(holder), stream)

    def extend(self, t: int, device: int, ptr: int, size: int,
               requested: int | None = None, stream: int = 0) -> None:
        self._row(t, _EXTEND, device, ptr, size, size if requested is None else requested, -1,
                  -1, stream)

    def release(self, t: int, device: int, ptr: int, size: int, stream: int = 0) -> None:
        self._row(t, _RELEASE, device, ptr, size, 0, -1, -1, stream)

    def live(self) -> dict[tuple[int, int], tuple[int, int, int, int]]:
        """(device, ptr) -> (alloc_id, size, requested, row) of allocations not yet freed."""
        return self._live

    def set_requested(self, device: int, ptr: int, requested: int) -> None:
        """Correct the requested bytes of the live allocation at ``ptr`` (learnt later)."""
        aid, size, _, row = self._live[(device, ptr)]
        self._live[(device, ptr)] = (aid, size, requested, row)
        self.requested[row] = requested

    def build(self, meta: dict) -> Trace:
        n = len(self.kind)
        cols = {
            "seq": np.arange(n, dtype=np.int64),
            "time_ns": np.array(self.time, dtype=np.int64),
            "kind": np.array(self.kind, dtype=np.int8),
            "ptr": np.array(self.ptr, dtype=np.int64),
            "size": np.array(self.size, dtype=np.int64),
            "requested": np.array(self.requested, dtype=np.int64),
            "alloc_id": np.array(self.alloc_id, dtype=np.int64),
            "device": np.array(self.device, dtype=np.int16),
        }
        kind = cols["kind"]
        sized = np.isin(kind, (_ALLOC, _FREE, _OOM))
        cols["bin"] = np.where(sized, bins_for_sizes(cols["size"]), -1).astype(np.int8)
        cols["region"] = row_regions(cols)
        meta = dict(meta)
        if self.devices and not meta.get("devices"):
            meta["devices"] = [self.devices[i] for i in sorted(self.devices)]
        meta.setdefault("unmatched_frees", self.unmatched_frees)
        return Trace(cols, meta, holder=np.array(self.holder, dtype=HOLDER_DTYPE),
                     holders=list(self._holders),
                     stream=np.array(self.stream, dtype=STREAM_DTYPE) if any(self.stream)
                     else None)


def row_regions(cols: dict[str, np.ndarray]) -> np.ndarray:
    """``region`` for each row: its own address for extend/release, the containing extended
    region (same device; the latest-starting region at or below the address) for alloc and
    free, else 0."""
    kind, ptr, size, device = cols["kind"], cols["ptr"], cols["size"], cols["device"]
    region = np.zeros(len(kind), dtype=np.int64)
    own = np.isin(kind, (_EXTEND, _RELEASE))
    region[own] = ptr[own]
    ext = kind == _EXTEND
    if not ext.any():
        return region
    # all devices at once (a pass per device over every row took devices x events): the
    # regions sorted by (device, start) as one key, device * K + the start's rank among
    # all addresses, and each alloc/free looked up by the same key of its address
    e_rows = np.flatnonzero(ext)
    e_rows = e_rows[np.lexsort((ptr[e_rows], device[e_rows]))]
    rows = np.flatnonzero(np.isin(kind, (_ALLOC, _FREE)))
    starts = ptr[e_rows]
    ends = starts + size[e_rows]
    p = ptr[rows]
    uniq, rank = np.unique(np.concatenate([starts, p]), return_inverse=True)
    rank = rank.reshape(-1)
    k = len(uniq)
    e_dev = device[e_rows].astype(np.int64)
    r_dev = device[rows].astype(np.int64)
    e_key = e_dev * k + rank[:len(e_rows)]
    r_key = r_dev * k + rank[len(e_rows):]
    # the last region of the same device starting at or below the address
    idx = np.searchsorted(e_key, r_key, side="right") - 1
    ok = idx >= 0
    ok[ok] = (e_dev[idx[ok]] == r_dev[ok]) & (p[ok] < ends[idx[ok]])
    region[rows[ok]] = starts[idx[ok]]
    return region


# ============================================================================ file format
def source_name(src: Any) -> str:
    return os.fspath(src) if isinstance(src, (str, os.PathLike)) else getattr(
        src, "name", "<stream>")


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, for messages: ``"a FIFO (named pipe)"``."""
    return ("a directory" if stat.S_ISDIR(mode) else
            "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """``open(path, "rb")`` for a regular file only.

    A FIFO, a device, a socket or a directory is refused with a
    :class:`~gpudash.TraceFormatError` naming the path, without blocking: the path is opened
    non-blocking and checked with ``fstat`` before anything is read (reading a FIFO would
    wait for a writer forever, a device such as ``/dev/zero`` never ends). Other errors
    (a missing file, no permission) are the ``OSError`` of ``open``.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise TraceFormatError(f"{os.fspath(path)}: is {file_kind(mode)}, not a trace "
                                   "file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def text_source(src: Any, newline: str | None = None) -> Iterator[IO[str]]:
    """A text stream over a path (a regular file: see :func:`open_regular`), a binary file
    object or a text file object (undecodable bytes replaced; a caller's file object is left
    open)."""
    if isinstance(src, (str, os.PathLike)):
        with open_regular(src) as raw, io.TextIOWrapper(
                raw, encoding="utf-8", errors="replace", newline=newline) as f:
            yield f
    elif isinstance(src, io.TextIOBase):
        yield src
    else:
        wrapper = io.TextIOWrapper(src, encoding="utf-8", errors="replace", newline=newline)
        try:
            yield wrapper
        finally:
            wrapper.detach()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _dumps(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, default=_json_default, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"the trace's {what} cannot be written as JSON: {exc}") from None


def _record(rtype: int, header: Any, payload: bytes = b"", what: str = "metadata",
            at: int | None = None) -> bytes:
    """One record; with ``at`` (its offset in the file), the JSON header is padded with
    spaces so that the payload starts at a multiple of 64 bytes (then the columns a reader
    maps from it are aligned and need no copy)."""
    js = _dumps(header, what)
    if at is not None:
        js += b" " * (-(at + _RECORD.size + len(js)) % 64)
    head = _RECORD.pack(_RECORD_MAGIC, rtype, len(js), len(payload), 0)[:20]
    crc = zlib.crc32(payload, zlib.crc32(js, zlib.crc32(head)))
    return head + struct.pack("<I", crc) + js + payload


def open_new(path: str | os.PathLike, overwrite: bool, mode: str = "b") -> BinaryIO:
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None and overwrite and not stat.S_ISREG(st.st_mode):
        # opening a FIFO to write would wait for a reader; a device is no trace file
        raise TraceFormatError(f"{os.fspath(path)}: is {file_kind(st.st_mode)}; a trace is "
                               "written to a regular file")
    try:
        return open(path, ("w" if overwrite else "x") + mode)
    except FileExistsError:
        raise TraceFormatError(
            f"{os.fspath(path)} already exists; pass overwrite=True to replace it") from None


class TraceWriter:
    """Writes a ``.gdtrace`` file in batches, so a killed process loses at most one batch.

    Parameters
    ----------
    path : str or os.PathLike
        The file to create.
    meta : dict
        The trace's metadata (JSON-serialisable), written at once as the first record.
    overwrite : bool, default False
        Replace an existing file. Without it an existing file raises
        :class:`~gpudash.TraceFormatError`.
    flush_interval : float, default 1.0
        Buffered events are written when :meth:`append` is called at least this many seconds
        after the last write (there is no background thread).
    batch_events : int, default 65536
        Buffered events are also written once this many are waiting.
    fsync : bool, default False
        ``os.fsync`` after each batch (survives a machine crash, not only a killed process).

    Examples
    --------
    >>> with TraceWriter("run.gdtrace", {"source": "gpudash"}) as w:  # doctest: +SKIP
    ...     w.append(trace)
    """

    def __init__(self, path: str | os.PathLike, meta: Mapping | None = None, *,
                 overwrite: bool = False, flush_interval: float = 1.0,
                 batch_events: int = 65536, fsync: bool = False) -> None:
        self.path = os.fspath(path)
        self.meta = _default_meta(meta)
        self.flush_interval = float(flush_interval)
        self.batch_events = max(1, int(batch_events))
        self.fsync = bool(fsync)
        self.events_written = 0
        self.batches_written = 0
        self._buffer: list[dict[str, np.ndarray]] = []
        self._buffer_settings: list[dict] = []
        self._buffered = 0
        self._holders: dict[str, int] = {}     # the file's holder table
        self._new_holders: list[str] = []      # names not written yet
        self._stacks = StackTable()            # the file's stack table
        self._frames_written = self._stacks_written = 0
        first = MAGIC + _record(_REC_META, self.meta)
        self._file: BinaryIO | None = open_new(self.path, overwrite)
        self._write(first)
        self._last_flush = time.monotonic()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._file is None

    def _write(self, data: bytes) -> None:
        assert self._file is not None
        self._file.write(data)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def append(self, events: Trace | Mapping[str, Any], settings: Iterable[Mapping] = (), *,
               holder: Any = None, holders: Iterable[str] = (), stack: Any = None,
               stacks: StackTable | None = None) -> None:
        """Buffer events (a :class:`Trace` or a dict of columns) and write when due.

        Parameters
        ----------
        events : Trace or mapping of str to array-like
            Rows to add. A Trace brings its own settings and holders.
        settings : iterable of dict, optional
            Settings of the ``limit`` rows in ``events`` when it is a dict of columns.
        holder, holders : optional
            For a dict of columns: the holder of each row (index into ``holders``, -1 for
            none) and its string table (see :class:`Trace`).
        stack, stacks : optional
            For a dict of columns: the stack of each row (index into ``stacks``, -1 for none)
            and its :class:`~gpudash.formats.stacks.StackTable`.
        """
        if self._file is None:
            raise ValueError(f"TraceWriter for {self.path} is closed")
        if isinstance(events, Trace):
            cols, sets = events.columns, events.settings
            holder, holders = events.holder, events.holders
            stack, stacks = events.stack, events.stacks
            if events.stream is not None:
                cols = {**cols, "stream": events.stream}
        else:
            cols, sets = _check_columns(events), [dict(s) for s in settings]
            holders = list(holders)
            holder = _check_holder(holder, len(cols["seq"]), len(holders))
            stacks = stacks if stacks is not None else StackTable()
            stack = _check_stack(stack, len(cols["seq"]), len(stacks))
        n = len(cols["seq"])
        if n and stack is not None:
            cols = {**cols, "stack": self._file_stacks(stack, stacks)}
        if n:
            if holders and (holder >= 0).any():
                table = self._holders
                remap = np.full(len(holders) + 1, -1, dtype=HOLDER_DTYPE)
                used = np.unique(holder[holder >= 0]).tolist()
                for h in used:
                    name = holders[h]
                    idx = table.get(name)
                    if idx is None:
                        idx = table[name] = len(table)
                        self._new_holders.append(name)
                    remap[h] = idx
                cols = {**cols, "holder": remap[holder]}
            self._buffer.append(cols)
            self._buffered += n
        self._buffer_settings.extend(sets)
        if (self._buffered >= self.batch_events
                or time.monotonic() - self._last_flush >= self.flush_interval):
            self.flush()

    def _file_stacks(self, stack: np.ndarray, stacks: StackTable) -> np.ndarray:
        """``stack`` (ids into ``stacks``) as ids into the file's stack table, adding the
        stacks it uses that the file does not have yet."""
        table = self._stacks
        remap = np.full(len(stacks) + 1, -1, dtype=STACK_DTYPE)
        frames = stacks.frames
        fmap: dict[int, int] = {}
        for sid in np.unique(stack[stack >= 0]).tolist():
            st = stacks.stacks[sid]
            ids = []
            for f in st.frames:
                g = fmap.get(f)
                if g is None:
                    g = fmap[f] = table._add_frame(frames[f])
                ids.append(g)
            remap[sid] = table._add_stack(Stack(tuple(ids), st.compile_context,
                                                st.user_metadata))
        return remap[stack]

    def update_meta(self, **changes: Any) -> None:
        """Merge ``changes`` into the metadata (written as a record of its own)."""
        if self._file is None:
            raise ValueError(f"TraceWriter for {self.path} is closed")
        self.flush()
        self.meta.update(changes)
        self._write(_record(_REC_META_UPDATE, changes, what="metadata update"))

    def flush(self) -> None:
        """Write the buffered events as one batch now."""
        self._last_flush = time.monotonic()
        if self._file is None or (not self._buffered and not self._buffer_settings):
            return
        names = COLUMNS
        if any("holder" in b for b in self._buffer):
            names = (*COLUMNS, "holder")
            self._buffer = [b if "holder" in b else
                            {**b, "holder": np.full(len(b["seq"]), -1, dtype=HOLDER_DTYPE)}
                            for b in self._buffer]
        if any("stream" in b for b in self._buffer):
            names = (*names, "stream")
            self._buffer = [b if "stream" in b else
                            {**b, "stream": np.zeros(len(b["seq"]), dtype=STREAM_DTYPE)}
                            for b in self._buffer]
        if any("stack" in b for b in self._buffer):
            names = (*names, "stack")
            self._buffer = [b if "stack" in b else
                            {**b, "stack": np.full(len(b["seq"]), -1, dtype=STACK_DTYPE)}
                            for b in self._buffer]
        if len(self._buffer) == 1:
            cols = self._buffer[0]
        else:
            cols = {name: np.concatenate([b[name] for b in self._buffer]) for name in names}
        payload = io.BytesIO()
        layout = []
        for name in names:
            payload.write(b"\0" * (-payload.tell() % 64))  # each column 64-byte aligned
            start = payload.tell()
            npformat.write_array(payload, np.ascontiguousarray(cols[name]), allow_pickle=False)
            layout.append([name, start, payload.tell() - start])
        header = {"n": self._buffered, "columns": layout, "settings": self._buffer_settings}
        if self._new_holders:
            header["holders"] = self._new_holders
        if len(self._stacks.stacks) > self._stacks_written:
            header["frames"] = self._stacks.frames_json(self._frames_written)
            header["stacks"] = self._stacks.stacks_json(self._stacks_written)
        try:
            at = self._file.tell()
        except (OSError, ValueError):
            at = None
        self._write(_record(_REC_EVENTS, header, payload.getvalue(), what="settings", at=at))
        self.events_written += self._buffered
        self.batches_written += 1
        self._buffer, self._buffer_settings, self._buffered = [], [], 0
        self._new_holders = []
        self._frames_written = len(self._stacks.frames)
        self._stacks_written = len(self._stacks.stacks)

    def close(self) -> None:
        """Write what is buffered and an end record, and close the file (idempotent)."""
        if self._file is None:
            return
        try:
            self.flush()
            self._write(_record(_REC_END, {"events": self.events_written,
                                           "batches": self.batches_written}))
        finally:
            self._file.close()
            self._file = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (f"TraceWriter({self.path!r}, {state}, events_written={self.events_written}, "
                f"buffered={self._buffered})")


def write_trace(trace: Trace, path: str | os.PathLike, overwrite: bool = False) -> None:
    """Write ``trace`` to a ``.gdtrace`` file (one batch per 1M events).

    Raises
    ------
    TraceFormatError
        ``path`` exists and ``overwrite`` is False, or ``meta`` is not JSON-serialisable.
    """
    with TraceWriter(path, trace.meta, overwrite=overwrite, flush_interval=float("inf"),
                     batch_events=1 << 20) as w:
        step = 1 << 20
        for start in range(0, max(len(trace), 1), step):
            w.append(trace[start:start + step])


def read_trace(path: str | os.PathLike | BinaryIO) -> Trace:
    """Read a ``.gdtrace`` file, even one cut short by a killed writer.

    Parameters
    ----------
    path : str, os.PathLike or binary file object

    Returns
    -------
    Trace
        Every event up to the last complete, crc-valid batch.

    Warns
    -----
    GpudashWarning
        When bytes after the last good record were ignored (a truncated or damaged tail), or
        the file has no end record (its writer was not closed).

    Raises
    ------
    TraceFormatError
        Not a gpudash trace, the metadata record (the first) is damaged or cut short, the
        metadata's ``devices`` cannot be used (an index that is not an integer 0 .. 32767,
        an ``allow_growth`` that is not true or false...), or an event has a negative size,
        requested size or device.
    """
    name = source_name(path)
    if isinstance(path, (str, os.PathLike)):
        # one writable buffer; the columns of the batches are numpy views into it (no copy)
        # (a numpy buffer, not a bytearray: a bytearray freed by the garbage collector while
        # a view of it is alive reports a SystemError)
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            buf = np.empty(size, dtype=np.uint8)
            got = f.readinto(memoryview(buf))
            data = memoryview(buf[:got])
    else:
        data = memoryview(path.read())
    head = bytes(data[:len(MAGIC)])
    if len(data) < len(MAGIC) and any(m.startswith(head) for m in MAGICS):
        raise TraceFormatError(
            f"{name}: cut short at byte {len(data)}, inside the magic line {MAGIC!r}")
    if not head.startswith(MAGICS):
        raise TraceFormatError(
            f"{name} is not a gpudash trace: expected the line {MAGIC!r} (or version 1's "
            f"{MAGICS[0]!r}) at byte 0, found {head!r}")
    meta, off, problem = None, len(MAGIC), None
    batches: list[dict[str, np.ndarray]] = []
    settings: list[dict] = []
    holders: list[str] = []
    stacks = StackTable()
    recno, ended, n_events = 0, False, 0
    while off < len(data):
        rec_off = off
        rec, problem = _parse_record(data, off)
        if rec is None:
            if recno == 0:
                raise TraceFormatError(
                    f"{name}: record 0 (metadata) at byte offset {rec_off} is damaged: "
                    f"{problem}")
            break
        rtype, js, payload, off = rec
        try:
            header = json.loads(js)
        except (ValueError, RecursionError) as exc:
            problem = f"its JSON header does not parse ({type(exc).__name__}: {exc})"
            if recno == 0:
                raise TraceFormatError(f"{name}: record 0 (metadata) at byte offset {rec_off}"
                                       f" is damaged: {problem}") from None
            off = rec_off
            break
        if recno == 0:
            if rtype != _REC_META or not isinstance(header, dict):
                raise TraceFormatError(
                    f"{name}: record 0 at byte offset {rec_off} should be the metadata "
                    f"(type {_REC_META}), found type {rtype}")
            meta = header
        elif rtype == _REC_EVENTS:
            new = header.get("holders", []) if isinstance(header, dict) else []
            if not (isinstance(new, list) and all(isinstance(h, str) for h in new)):
                raise TraceFormatError(f"{name}: record {recno} (event batch) at byte offset "
                                       f"{rec_off}: 'holders' must be a list of strings")
            holders.extend(new)
            _extend_stacks(stacks, header, f"{name}: record {recno} (event batch) at byte "
                                           f"offset {rec_off}")
            cols = _decode_batch(name, recno, rec_off, header, payload, len(holders),
                                 len(stacks))
            new_settings = header.get("settings", [])
            if not (isinstance(new_settings, list)
                    and all(isinstance(x, dict) for x in new_settings)):
                raise TraceFormatError(f"{name}: record {recno} (event batch) at byte offset "
                                       f"{rec_off}: 'settings' must be a list of objects")
            batches.append(cols)
            n_events += len(cols["seq"])
            settings.extend(new_settings)
        elif rtype == _REC_META_UPDATE:
            if not isinstance(header, dict):
                raise TraceFormatError(f"{name}: record {recno} (metadata update) at byte "
                                       f"offset {rec_off}: expected a JSON object, found "
                                       f"{type(header).__name__}")
            meta.update(header)
        elif rtype == _REC_END:
            ended = True
            recno += 1
            break
        else:
            raise TraceFormatError(f"{name}: record {recno} at byte offset {rec_off} has "
                                   f"unknown type {rtype}")
        recno += 1
    if meta is None:
        raise TraceFormatError(f"{name}: ends at byte offset {off} before its metadata record")
    ignored = len(data) - off
    if ignored:
        warnings.warn(
            f"{name}: ignored {ignored} bytes from byte offset {off} (record {recno}: "
            f"{problem or 'data after the end record'}); read {n_events} events in "
            f"{len(batches)} batches", GpudashWarning, stacklevel=2)
    elif not ended:
        warnings.warn(
            f"{name}: no end record after {recno} records (the writer was not closed); "
            f"read {n_events} events in {len(batches)} batches", GpudashWarning,
            stacklevel=2)
    check_meta(meta, name)
    if not batches:
        return Trace(None, meta, settings, holders=holders, stacks=stacks)
    stream = stack = None
    if any("stream" in b for b in batches):
        stream = np.concatenate([b.get("stream", np.zeros(len(b["seq"]), dtype=STREAM_DTYPE))
                                 for b in batches])
    if any("stack" in b for b in batches):
        stack = np.concatenate([b.get("stack", np.full(len(b["seq"]), -1, dtype=STACK_DTYPE))
                                for b in batches])
    if len(batches) == 1:
        cols = dict(batches[0])
        cols.pop("stream", None)
        cols.pop("stack", None)
    else:
        cols = {n: np.concatenate([b[n] for b in batches]) for n in (*COLUMNS, "holder")}
    holder = cols.pop("holder")
    trace = Trace(cols, meta, settings, holder=holder, holders=holders, stream=stream,
                  stack=stack, stacks=stacks)
    check_values(trace, name)
    return trace


def _parse_record(data: bytes, off: int) -> tuple[tuple | None, str | None]:
    end = len(data)
    if end - off < _RECORD.size:
        return None, (f"cut short: a record header needs {_RECORD.size} bytes, "
                      f"{end - off} left")
    magic, rtype, jlen, plen, crc = _RECORD.unpack_from(data, off)
    if magic != _RECORD_MAGIC:
        return None, f"expected the record marker {_RECORD_MAGIC!r}, found {magic!r}"
    body = off + _RECORD.size
    if jlen > _MAX_JSON or body + jlen + plen > end:
        return None, (f"cut short: the record needs {_RECORD.size + jlen + plen} bytes, "
                      f"{end - off} left")
    js = bytes(data[body:body + jlen])
    payload = memoryview(data)[body + jlen:body + jlen + plen]
    got = zlib.crc32(payload, zlib.crc32(js, zlib.crc32(data[off:off + 20])))
    if got != crc:
        return None, f"crc32 mismatch (stored {crc:#010x}, computed {got:#010x})"
    return (rtype, js, payload, body + jlen + plen), None


def _read_npy(chunk: memoryview) -> np.ndarray:
    """The 1-D array stored as ``.npy`` bytes in ``chunk``: a view into it, not a copy
    (writable when ``chunk`` is). Raises ValueError for anything but plain numbers, and
    whatever numpy's header parser raises for a damaged header (``tokenize.TokenError``,
    ``SyntaxError``...)."""
    head = io.BytesIO(bytes(chunk[:min(len(chunk), 1 << 17)]))
    version = npformat.read_magic(head)
    if version == (1, 0):
        shape, _fortran, dtype = npformat.read_array_header_1_0(head)
    elif version == (2, 0):
        shape, _fortran, dtype = npformat.read_array_header_2_0(head)
    else:
        raise ValueError(f"unsupported .npy version {version}")
    if dtype.hasobject or len(shape) != 1:
        raise ValueError(f"expected a 1-D array of numbers, found shape {shape} of {dtype}")
    return np.frombuffer(chunk, dtype=dtype, count=shape[0], offset=head.tell())


def _column(payload: memoryview, span: tuple[int, int], col: str, where: str) -> np.ndarray:
    """One column of a batch. However its ``.npy`` bytes are damaged (a header numpy's
    parser chokes on raises ``tokenize.TokenError``, ``SyntaxError``, ``ValueError``...),
    the batch is refused with the one error of a damaged batch."""
    start, nbytes = span
    try:
        return _read_npy(payload[start:start + nbytes])
    except Exception as exc:  # noqa: BLE001 - any failure to decode is a damaged batch
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise TraceFormatError(f"{where}: column {col!r} is not valid .npy data "
                               f"({type(exc).__name__}{': ' + detail if detail else ''})"
                               ) from None


def _extend_stacks(stacks: StackTable, header: Any, where: str) -> None:
    """Add a batch's new frames and stacks (``"frames"``, ``"stacks"``) to ``stacks``."""
    if not isinstance(header, dict):
        return
    frames, new = header.get("frames", []), header.get("stacks", [])
    if not (isinstance(frames, list) and isinstance(new, list)):
        raise TraceFormatError(f"{where}: 'frames' and 'stacks' must be lists")
    try:
        stacks.extend_json(frames, new)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{where}: {exc}") from None


def _decode_batch(name: str, recno: int, off: int, header: dict, payload: bytes,
                  n_holders: int = 0, n_stacks: int = 0) -> dict[str, np.ndarray]:
    """The batch's columns, with ``holder`` (all -1 when the batch has none)."""
    where = f"{name}: record {recno} (event batch) at byte offset {off}"
    try:
        n = int(header["n"])
        layout = {c[0]: (int(c[1]), int(c[2])) for c in header["columns"]}
    except (KeyError, TypeError, ValueError, IndexError):
        raise TraceFormatError(f"{where}: expected a JSON header with 'n' and 'columns'") \
            from None
    cols = {}
    for col in COLUMNS:
        if col not in layout:
            raise TraceFormatError(f"{where}: column {col!r} is missing")
        arr = _column(payload, layout[col], col, where)
        if arr.dtype != np.dtype(COLUMN_DTYPES[col]) or arr.shape != (n,):
            raise TraceFormatError(
                f"{where}: column {col!r} should be {n} values of "
                f"{np.dtype(COLUMN_DTYPES[col])}, found shape {arr.shape} of {arr.dtype}")
        cols[col] = arr if arr.flags.writeable and arr.flags.aligned else arr.copy()
    if "holder" in layout:
        arr = _column(payload, layout["holder"], "holder", where)
        if arr.dtype != np.dtype(HOLDER_DTYPE) or arr.shape != (n,):
            raise TraceFormatError(f"{where}: column 'holder' should be {n} values of int32, "
                                   f"found shape {arr.shape} of {arr.dtype}")
        if n and (arr.min() < -1 or arr.max() >= n_holders):
            raise TraceFormatError(f"{where}: column 'holder' indexes beyond the "
                                   f"{n_holders} holder names listed so far")
        cols["holder"] = arr if arr.flags.writeable and arr.flags.aligned else arr.copy()
    else:
        cols["holder"] = np.full(n, -1, dtype=HOLDER_DTYPE)
    if "stream" in layout:
        arr = _column(payload, layout["stream"], "stream", where)
        if arr.dtype != np.dtype(STREAM_DTYPE) or arr.shape != (n,):
            raise TraceFormatError(f"{where}: column 'stream' should be {n} values of int64, "
                                   f"found shape {arr.shape} of {arr.dtype}")
        cols["stream"] = arr if arr.flags.writeable and arr.flags.aligned else arr.copy()
    if "stack" in layout:
        arr = _column(payload, layout["stack"], "stack", where)
        if arr.dtype != np.dtype(STACK_DTYPE) or arr.shape != (n,):
            raise TraceFormatError(f"{where}: column 'stack' should be {n} values of int32, "
                                   f"found shape {arr.shape} of {arr.dtype}")
        if n and (arr.min() < -1 or arr.max() >= n_stacks):
            raise TraceFormatError(f"{where}: column 'stack' indexes beyond the "
                                   f"{n_stacks} stacks listed so far")
        cols["stack"] = arr if arr.flags.writeable and arr.flags.aligned else arr.copy()
    return cols
