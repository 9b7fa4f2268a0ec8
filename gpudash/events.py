"""Allocator events: their kinds, their fields, and the columnar layout shared by
the Recorder, trace files, importers, replay and the views.

Every change of an allocator's state is one event. The meaning of the numeric fields
depends on the kind:

========  =================  ==================  ======================  ==========  =========
kind      ptr                size                requested               bin         region
========  =================  ==================  ======================  ==========  =========
alloc     chunk address      chunk bytes         bytes asked for         bin of size  region
free      chunk address      chunk bytes         bytes asked for         bin of size  region
split     new free chunk     its bytes           bytes kept by the old   its bin      region
merge     surviving chunk    merged bytes        bytes absorbed          -1           region
extend    region address     region bytes        rounded request         -1           region
release   region address     region bytes        0                       -1           region
oom       0                  rounded request     bytes asked for         bin of size  0
limit     0                  new value           old value               -1           0
========  =================  ==================  ======================  ==========  =========

``alloc_id`` is the allocation's id (TensorFlow's ``allocation_id``, from 1) for alloc and
free, else -1. ``limit`` events carry the setting's name in ``setting`` (``memory_limit``,
``allow_growth``, ``per_process_gpu_memory_fraction``, ``deferred_deletion_bytes``...) and
its ``old`` and ``new`` values as given (the integer columns hold bytes where the setting is
a byte count, else 0).
"""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["EventKind", "Event", "COLUMNS", "COLUMN_DTYPES", "ALLOC", "FREE", "SPLIT", "MERGE",
           "EXTEND", "RELEASE", "OOM", "LIMIT"]


class EventKind(enum.IntEnum):
    """The kinds of allocator events (their values are stored in the ``kind`` column)."""

    ALLOC = 1
    FREE = 2
    SPLIT = 3
    MERGE = 4
    EXTEND = 5
    RELEASE = 6
    OOM = 7
    LIMIT = 8

    def __str__(self) -> str:
        return self.name.lower()


#: The event codes as plain ints (:class:`EventKind`'s values), for the journals, the
#: ``kind`` column's comparisons and the hot loops: gpudash defines them here only (the
#: compiled core's copy, ``_core.pyx``, is held to them when it loads: ``gpudash._accel``).
ALLOC = int(EventKind.ALLOC)
FREE = int(EventKind.FREE)
SPLIT = int(EventKind.SPLIT)
MERGE = int(EventKind.MERGE)
EXTEND = int(EventKind.EXTEND)
RELEASE = int(EventKind.RELEASE)
OOM = int(EventKind.OOM)
LIMIT = int(EventKind.LIMIT)

#: Column names of an event table, in order.
COLUMNS = ("seq", "time_ns", "kind", "ptr", "size", "requested", "bin", "region",
           "alloc_id", "device")

#: numpy dtype of each column.
COLUMN_DTYPES = {
    "seq": np.int64,
    "time_ns": np.int64,
    "kind": np.int8,
    "ptr": np.int64,
    "size": np.int64,
    "requested": np.int64,
    "bin": np.int8,
    "region": np.int64,
    "alloc_id": np.int64,
    "device": np.int16,
}


class Event:
    """One change of an allocator's state, as given to ``subscribe`` callbacks.

    Attributes are those of the table in this module's docstring, plus ``allocator`` (the
    allocator's name) and, for ``limit`` events, ``setting``, ``old`` and ``new``.
    """

    __slots__ = ("seq", "time_ns", "kind", "ptr", "size", "requested", "bin", "region",
                 "alloc_id", "device", "allocator", "setting", "old", "new")

    def __init__(self, seq: int, time_ns: int, kind: int, ptr: int, size: int,
                 requested: int, bin: int, region: int, alloc_id: int = -1,
                 device: int = 0, allocator: str = "", setting: str | None = None,
                 old: object = None, new: object = None) -> None:
        self.seq = seq
        self.time_ns = time_ns
        self.kind = EventKind(kind)
        self.ptr = ptr
        self.size = size
        self.requested = requested
        self.bin = bin
        self.region = region
        self.alloc_id = alloc_id
        self.device = device
        self.allocator = allocator
        self.setting = setting
        self.old = old
        self.new = new

    def as_dict(self) -> dict:
        """The event's fields as a plain dict (``kind`` as its lower-case name)."""
        d = {name: getattr(self, name) for name in self.__slots__}
        d["kind"] = str(self.kind)
        return d

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Event):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        extra = ""
        if self.kind == EventKind.LIMIT:
            extra = f", setting={self.setting!r}, old={self.old!r}, new={self.new!r}"
        return (f"Event(seq={self.seq}, kind={self.kind}, ptr={self.ptr:#x}, size={self.size}, "
                f"requested={self.requested}, bin={self.bin}, region={self.region:#x}, "
                f"alloc_id={self.alloc_id}{extra})")
