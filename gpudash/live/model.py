"""The live model: turns a fast event stream into a few consistent updates a second.

:class:`LiveModel` attaches one batch sink to each device's allocator. Events only mark a
device dirty and add to counters (allocations, frees, OOMs, setting changes); nothing is
computed per event. A refresher **thread** (not an asyncio task: a running cell blocks the
kernel's event loop, but widget messages sent from a thread still reach the browser) wakes
``rate_hz`` times a second, asks the allocators to hand over buffered events
(``flush_events``) and, for each device that changed, builds one :class:`DeviceState`:

- the chunk table (``BFCAllocator.chunk_table()``) and stats made consistent with it,
- per-bin counts (numpy over the chunk table),
- fragmentation figures (external, internal, pool - in use),
- a timeline point ``(time, in_use, pool, limit)`` appended to a bounded history,
- a heatmap column: the fraction of bytes in use in each of ``heatmap_rows`` equal slices of
  the device's address space (regions laid end to end, exact partial coverage, computed with
  difference arrays),

and hands the changed states to its listeners (the dashboard), in the refresher thread.

Threading: the sinks run in the allocating thread, under the allocator's lock, and only take
the model's small lock to add counters. The refresher copies what it needs under the
allocator's lock (``chunk_table``) and computes outside it. ``refresh_now`` and the thread
never refresh at the same time.

Views read the model (``state(device)``, ``add_listener``) and act through it: a control
goes to :meth:`LiveModel.act`, which has the allocator model check the value, the device's
source (the session, the allocator, or a feed) apply it, and the model answer in words.
Views never reach the session, the allocator or a feed themselves. Nothing here imports a
UI library: the model is a ``traitlets.HasTraits`` (for ``rate_hz`` and ``paused``), no
widget.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import traitlets

from .._errors import ConfigError
from .._eventsource import code_counts
from ..bfc import AllocatorStats
from ..events import ALLOC as _ALLOC, FREE as _FREE, OOM as _OOM, LIMIT as _LIMIT
from ..models import BFC, AllocatorModel, model_of
from ..formats.stacks import StackTable

__all__ = ["LiveModel", "DeviceState", "BinCounts", "OomMark", "SettingMark", "HeldBlocks",
           "bin_of_sizes", "bin_labels", "heatmap_column", "NUM_BINS", "HOLDER_HISTORY"]

logger = logging.getLogger("gpudash")

#: TensorFlow's number of BFC bins (256 B << b, the last one open-ended).
NUM_BINS = 21


#: Most OOM marks and setting marks a device keeps (oldest dropped).
MAX_MARKS = 200
#: Allocations and frees a device's history of who held what keeps by default (the oldest
#: are folded into the state they leave: see :class:`_HolderLog`).
HOLDER_HISTORY = 500_000


# --------------------------------------------------------------------------------------
# numpy helpers shared by the model and the views
# --------------------------------------------------------------------------------------


def bin_of_sizes(sizes: np.ndarray) -> np.ndarray:
    """TensorFlow's ``BinNumForSize`` over an array of byte counts (int8 bins 0..20)."""
    v = np.maximum(np.asarray(sizes, dtype=np.int64), 256) >> 8
    # frexp gives the exponent e with v = m * 2**e, 0.5 <= m < 1: floor(log2 v) = e - 1
    # (exact for v < 2**53, far above any allocation).
    b = np.frexp(v.astype(np.float64))[1] - 1
    return np.minimum(b, NUM_BINS - 1).astype(np.int8)


def bin_labels() -> list[str]:
    """Labels of the 21 bins: ``256B``, ``512B``, ``1KiB`` ... ``256MiB+``."""
    return BFC.bin_labels()


def heatmap_column(table: dict, rows: int, row_bytes: int) -> np.ndarray:
    """Fraction of bytes in use in each address row, from a chunk table.

    The device's regions are laid end to end in address order (offset 0 is the first byte
    of the lowest region), and the offsets ``[0, rows * row_bytes)`` are cut into ``rows``
    equal slices. Row ``r``'s value is (bytes of in-use chunks inside the slice) /
    ``row_bytes``: partial coverage is exact. Rows past the end of the pool hold no memory
    and read 0. Bytes past ``rows * row_bytes`` are ignored.

    Computed with difference arrays: each in-use interval adds its partial first and last
    rows directly (``bincount`` with weights) and marks its fully covered rows with +1/-1
    in a difference array whose cumulative sum counts full rows.
    """
    span = rows * row_bytes
    regions = table["regions"]
    in_use = table["in_use"]
    if not len(regions) or not in_use.any():
        return np.zeros(rows, dtype=np.float64)
    # Offset of each region when regions are laid end to end in address order.
    reg_ptr = regions[:, 0]
    reg_start = np.concatenate(([0], np.cumsum(regions[:, 1])[:-1]))
    ri = np.searchsorted(reg_ptr, table["region"][in_use])
    s = table["ptr"][in_use] - reg_ptr[ri] + reg_start[ri]
    e = s + table["size"][in_use]
    keep = s < span
    s = s[keep]
    e = np.minimum(e[keep], span)
    r0 = s // row_bytes
    r1 = (e - 1) // row_bytes
    same = r0 == r1
    partial = np.bincount(r0[same], weights=(e - s)[same], minlength=rows).astype(np.float64)
    multi = ~same
    r0m, r1m, sm, em = r0[multi], r1[multi], s[multi], e[multi]
    partial += np.bincount(r0m, weights=(r0m + 1) * row_bytes - sm, minlength=rows)
    partial += np.bincount(r1m, weights=em - r1m * row_bytes, minlength=rows)
    diff = np.zeros(rows + 1, dtype=np.int64)
    np.add.at(diff, r0m + 1, 1)
    np.add.at(diff, r1m, -1)
    full = np.cumsum(diff[:rows])
    return (partial + full * float(row_bytes)) / row_bytes


# --------------------------------------------------------------------------------------
# Records handed to views
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BinCounts:
    """Per-bin figures of one state: arrays of one value per bar of the model's bins view
    (TensorFlow's 21 bins, chunks bucketed by ``BinNumForSize``; PyTorch's 2 pools)."""

    free_chunks: np.ndarray
    free_bytes: np.ndarray
    in_use_chunks: np.ndarray
    in_use_bytes: np.ndarray
    requested_bytes: np.ndarray

    @classmethod
    def from_table(cls, table: dict, model: AllocatorModel = BFC) -> BinCounts:
        b = model.bin_index(table)
        k = len(model.bin_labels())
        used = table["in_use"]
        size = table["size"]

        def count(mask: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
            w = None if weights is None else weights[mask].astype(np.float64)
            return np.bincount(b[mask], weights=w, minlength=k).astype(np.int64)

        free = ~used
        return cls(free_chunks=count(free), free_bytes=count(free, size),
                   in_use_chunks=count(used), in_use_bytes=count(used, size),
                   requested_bytes=count(used, table["requested"]))


@dataclasses.dataclass(frozen=True)
class OomMark:
    """An allocation that failed: when (ms since the epoch), the rounded and asked bytes,
    and the bytes in use the model saw next (where the timeline marks it)."""

    time_ms: float
    rounded: int
    requested: int
    in_use: int


@dataclasses.dataclass(frozen=True)
class SettingMark:
    """A setting changed on the allocator (a ``limit`` event)."""

    time_ms: float
    seq: int
    setting: str
    old: Any
    new: Any


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceState:
    """One consistent picture of a device, built by one refresh.

    Attributes
    ----------
    device, name : int, str
        The device's index in the model and its name.
    time_ms : float
        When the state was taken (ms since the epoch; ``LiveModel.seconds`` turns it into
        seconds since the model started, the views' x axis).
    version : int
        Counts the states built for this device (1 for the first).
    stats : AllocatorStats
        TensorFlow's stats; ``bytes_in_use``, ``pool_bytes``, ``largest_free_block_bytes``
        and ``fragmentation`` are computed from ``table``, so they agree with it.
    table : dict of numpy arrays
        ``BFCAllocator.chunk_table()``.
    bins : BinCounts
    internal_fragmentation : int
        Allocated - requested bytes of the live chunks (rounding waste).
    capacity : int
        The device's memory (what the heatmap rows split).
    counters : dict
        ``allocs``, ``frees``, ``ooms``, ``settings``, ``events``: totals since the model
        started.
    timeline : dict of numpy arrays
        ``time_ms``, ``in_use``, ``pool``, ``limit``: the bounded history (copies).
    ooms, settings : tuple
        The latest :class:`OomMark` / :class:`SettingMark` records (bounded).
    heatmap_time_ms, heatmap : numpy arrays
        Times of the kept heatmap columns and the columns (``rows x columns``, float32
        fractions in use, oldest first); ``heatmap[:, -1]`` belongs to this state.
    heatmap_row_bytes : int
        Bytes per heatmap row.
    model : AllocatorModel
        The allocator's model: what the views call things, its bins or pools, its stats
        rows (:mod:`gpudash.models`).
    figures : dict
        The allocator's own statistics the views show, by the framework's names
        (PyTorch's ``memory_stats()`` keys; empty for the BFC).
    in_force : dict
        The allocator's settings when the state was taken (``model.live_settings``).
    """

    device: int
    name: str
    time_ms: float
    version: int
    stats: AllocatorStats
    table: dict
    bins: BinCounts
    internal_fragmentation: int
    capacity: int
    counters: dict
    timeline: dict
    ooms: tuple
    settings: tuple
    heatmap_time_ms: np.ndarray
    heatmap: np.ndarray
    heatmap_row_bytes: int
    model: AllocatorModel = BFC
    figures: dict = dataclasses.field(default_factory=dict)
    in_force: dict = dataclasses.field(default_factory=dict)

    @property
    def limit(self) -> int:
        return self.stats.bytes_limit

    @property
    def reserved_unused(self) -> int:
        """Pool bytes not in use (PyTorch's reserved - allocated)."""
        return self.stats.pool_bytes - self.stats.bytes_in_use

    @property
    def over_limit(self) -> bool:
        return self.stats.bytes_in_use > self.stats.bytes_limit

    @property
    def num_chunks(self) -> int:
        return len(self.table["size"])

    def __repr__(self) -> str:
        s = self.stats
        return (f"DeviceState(device={self.device}, version={self.version}, "
                f"chunks={self.num_chunks}, in_use={s.bytes_in_use}, pool={s.pool_bytes}, "
                f"limit={s.bytes_limit})")


# --------------------------------------------------------------------------------------
# Per-device bookkeeping
# --------------------------------------------------------------------------------------


class _Timeline:
    """Bounded (time, in_use, pool, limit) history. When full, the older half is halved by
    merging neighbour pairs (the max of in_use and pool, the later limit), so peaks survive
    and recent points keep full resolution."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(4, int(capacity))
        self.data = np.zeros((4, self.capacity), dtype=np.float64)
        self.n = 0

    def append(self, t: float, in_use: int, pool: int, limit: int) -> None:
        if self.n == self.capacity:
            self._decimate()
        self.data[:, self.n] = (t, in_use, pool, limit)
        self.n += 1

    def _decimate(self) -> None:
        d = self.data
        half = (self.n // 2) & ~1
        old = d[:, :half].reshape(4, half // 2, 2)
        merged = np.empty((4, half // 2))
        merged[0] = old[0, :, 0]
        merged[1] = old[1].max(axis=1)
        merged[2] = old[2].max(axis=1)
        merged[3] = old[3, :, 1]
        rest = d[:, half:self.n].copy()
        k = half // 2
        d[:, :k] = merged
        d[:, k:k + rest.shape[1]] = rest
        self.n = k + rest.shape[1]

    def arrays(self) -> dict[str, np.ndarray]:
        d = self.data[:, :self.n]
        return {"time_ms": d[0].copy(), "in_use": d[1].copy(), "pool": d[2].copy(),
                "limit": d[3].copy()}


class _Heatmap:
    """The last ``columns`` heatmap columns (rows x columns float32, oldest first)."""

    def __init__(self, rows: int, columns: int, span: int) -> None:
        self.rows = int(rows)
        self.columns = max(1, int(columns))
        self.row_bytes = max(256, -(-int(span) // self.rows))
        self.z = np.zeros((self.rows, self.columns), dtype=np.float32)
        self.t = np.zeros(self.columns, dtype=np.float64)
        self.n = 0

    def fit(self, pool: int) -> None:
        """Double the row size (merging row pairs of the kept columns, which is exact for
        equal rows) until the pool fits in the rows."""
        while pool > self.rows * self.row_bytes:
            z = self.z
            merged = np.zeros_like(z)
            half = self.rows // 2
            pairs = z[: half * 2].reshape(half, 2, -1).mean(axis=1)
            merged[:half] = pairs
            if self.rows % 2:
                merged[half] = z[-1] / 2
            self.z = merged
            self.row_bytes *= 2

    def append(self, t: float, column: np.ndarray) -> None:
        if self.n == self.columns:
            self.z[:, :-1] = self.z[:, 1:]
            self.t[:-1] = self.t[1:]
            self.n -= 1
        self.z[:, self.n] = column
        self.t[self.n] = t
        self.n += 1


class _Columns:
    """Numpy columns of one length, appended to at the end and dropped from the front; the
    arrays grow by doubling (and are compacted when the front has room)."""

    def __init__(self, **dtypes: Any) -> None:
        self.cols = {k: np.zeros(64, dtype=d) for k, d in dtypes.items()}
        self.start = 0
        self.end = 0

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, **arrays: Any) -> None:
        n = len(next(iter(arrays.values())))
        cap = len(next(iter(self.cols.values())))
        if self.end + n > cap:
            live = self.end - self.start
            size = cap if live + n <= cap // 2 else max(64, 2 * (live + n))
            for k, col in self.cols.items():
                new = np.empty(size, dtype=col.dtype)
                new[:live] = col[self.start:self.end]
                self.cols[k] = new
            self.start, self.end = 0, live
        for k, col in self.cols.items():
            col[self.end:self.end + n] = arrays[k]
        self.end += n

    def drop(self, n: int) -> None:
        self.start = min(self.end, self.start + int(n))

    def view(self, name: str) -> np.ndarray:
        return self.cols[name][self.start:self.end]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cols.values())


class _HolderLog:
    """Who held what at each refresh of a device: the history the holders view's moments in
    the past are read from.

    Each refresh that changed the blocks in use appends one entry: its time, the blocks in
    use that were not at the entry before (allocation id, size, stack id, label code) and
    the allocation ids of those no longer in use. The blocks in use after entry ``e`` are
    those that appeared up to ``e`` and were not gone by it: the state the views showed from
    that refresh until the next (a block allocated and freed between two refreshes was in no
    state they showed, and is not here either).

    Bounded: past ``max_events`` blocks that appeared or went, the oldest entries are folded
    into :attr:`base` (the blocks in use after the last entry folded, at :attr:`base_ms`),
    so every moment after it stays exact; an earlier moment is answered with the base.
    Memory: 32 bytes per block that appeared (int64 id, size and entry, int32 stack and
    label), 16 per block that went, 8 per entry, in arrays that grow by doubling (so at most
    twice that), plus the base (the blocks in use at one moment).
    """

    def __init__(self, max_events: int) -> None:
        self.max_events = max(16, int(max_events))
        self.times = _Columns(t=np.float64)
        self.adds = _Columns(aid=np.int64, size=np.int64, stack=np.int32, label=np.int32,
                             at=np.int64)
        self.gone = _Columns(aid=np.int64, at=np.int64)
        self.first = 0          # the entry times' first row is entry number `first`
        self.entries = 0        # entries ever appended
        self.folded = 0         # entries folded into the base
        z8, z4 = np.zeros(0, np.int64), np.zeros(0, np.int32)
        self.base = (z8, z8, z4, z4)
        self.base_ms: float | None = None
        self.prev = (z8, z4, z4)   # aid (sorted), stack, label of the blocks in use now

    @property
    def nbytes(self) -> int:
        """Bytes of the history's arrays (the base and the blocks in use now included)."""
        return (self.times.nbytes + self.adds.nbytes + self.gone.nbytes
                + sum(a.nbytes for a in self.base) + sum(a.nbytes for a in self.prev))

    def update(self, t_ms: float, aid: np.ndarray, size: np.ndarray, stack: np.ndarray,
               label: np.ndarray) -> None:
        """The blocks in use at a refresh (their allocation ids, sizes, stacks, labels)."""
        order = np.argsort(aid, kind="stable")
        aid = aid[order].astype(np.int64)
        size = size[order].astype(np.int64)
        stack = stack[order].astype(np.int32)
        label = label[order].astype(np.int32)
        p_aid, p_stack, p_label = self.prev
        if len(p_aid):
            pos = np.minimum(np.searchsorted(p_aid, aid), len(p_aid) - 1)
            seen = p_aid[pos] == aid
            back = np.minimum(np.searchsorted(aid, p_aid), max(len(aid) - 1, 0))
            gone = ~(aid[back] == p_aid) if len(aid) else np.ones(len(p_aid), dtype=bool)
            # a holder noted after a refresh saw its block (the session notes it once the
            # allocator has answered): the block's history takes it
            changed = seen & ((p_stack[pos] != stack) | (p_label[pos] != label))
            if changed.any():
                self._relabel(aid[changed], stack[changed], label[changed])
        else:
            seen = np.zeros(len(aid), dtype=bool)
            gone = np.zeros(0, dtype=bool)
        new = ~seen
        self.prev = (aid, stack, label)
        if self.entries and not new.any() and not gone.any():
            return
        e = self.entries
        self.entries += 1
        self.times.append(t=np.array([t_ms]))
        k = int(new.sum())
        self.adds.append(aid=aid[new], size=size[new], stack=stack[new], label=label[new],
                         at=np.full(k, e, dtype=np.int64))
        g = p_aid[gone]
        self.gone.append(aid=g, at=np.full(len(g), e, dtype=np.int64))
        if len(self.adds) + len(self.gone) > self.max_events:
            self._fold()

    def _relabel(self, aid: np.ndarray, stack: np.ndarray, label: np.ndarray) -> None:
        for a_aid, a_stack, a_label in ((self.adds.view("aid"), self.adds.view("stack"),
                                         self.adds.view("label")),
                                        (self.base[0], self.base[2], self.base[3])):
            hit = np.flatnonzero(np.isin(a_aid, aid))
            if len(hit):
                j = np.searchsorted(aid, a_aid[hit])
                a_stack[hit] = stack[j]
                a_label[hit] = label[j]

    def _fold(self) -> None:
        """Fold the oldest entries into the base until a quarter of the bound is free."""
        a_at, g_at = self.adds.view("at"), self.gone.view("at")
        n_ent = self.entries - self.first
        per = (np.bincount(a_at - self.first, minlength=n_ent)
               + np.bincount(g_at - self.first, minlength=n_ent))
        excess = len(a_at) + len(g_at) - self.max_events * 3 // 4
        k = min(n_ent, int(np.searchsorted(np.cumsum(per), excess)) + 1)
        cut = self.first + k
        na = int(np.searchsorted(a_at, cut))
        ng = int(np.searchsorted(g_at, cut))
        adds = [self.adds.view(c)[:na] for c in ("aid", "size", "stack", "label")]
        base = [np.concatenate((b, a)) for b, a in zip(self.base, adds)]
        keep = ~np.isin(base[0], self.gone.view("aid")[:ng])
        self.base = tuple(b[keep] for b in base)  # type: ignore[assignment]
        self.base_ms = float(self.times.view("t")[k - 1])
        self.adds.drop(na)
        self.gone.drop(ng)
        self.times.drop(k)
        self.first = cut
        self.folded += k

    def at(self, t_ms: float, start_ms: float = np.inf) -> tuple[float, tuple, str]:
        """The blocks in use at ``t_ms`` (ms since the epoch): the time of the state taken
        (the last refresh at or before it that changed something), its arrays (aid, size,
        stack, label) and a note ("" when the moment is exact). The first state holds from
        ``start_ms`` (when the model started, just before it took that state)."""
        tv = self.times.view("t")
        # a time read back from the page's seconds: a hair's tolerance
        e = int(np.searchsorted(tv, t_ms + 1e-3, side="right")) - 1
        if e < 0:
            if self.base_ms is not None:   # the state the folded refreshes left
                return self.base_ms, self.base, "" if t_ms + 1e-3 >= self.base_ms else (
                    f"the history kept reaches back to this moment ({self.folded:,} older "
                    "refreshes were folded into it)")
            if not len(tv):
                z8, z4 = np.zeros(0, np.int64), np.zeros(0, np.int32)
                return t_ms, (z8, z8, z4, z4), "no state taken yet"
            e = 0
            note = "" if t_ms >= start_ms else \
                "before the model started: the first state it took"
        else:
            note = ""
        cut = self.first + e + 1
        na = int(np.searchsorted(self.adds.view("at"), cut))
        ng = int(np.searchsorted(self.gone.view("at"), cut))
        arrays = [np.concatenate((b, self.adds.view(c)[:na]))
                  for b, c in zip(self.base, ("aid", "size", "stack", "label"))]
        keep = ~np.isin(arrays[0], self.gone.view("aid")[:ng])
        return float(tv[e]), tuple(a[keep] for a in arrays), note


@dataclasses.dataclass(frozen=True, eq=False)
class HeldBlocks:
    """The blocks in use on a device at one moment, with who holds them.

    Attributes
    ----------
    device : int
    time_ms : float
        When that state was taken (a refresh; ms since the epoch).
    live : bool
        True for the latest state, False for a moment of the history.
    size, stack, label : numpy.ndarray
        Each block's bytes, stack id in ``stacks`` (-1: none recorded) and label, an index
        into ``labels`` (-1: none).
    labels : list of str
    stacks : StackTable or None
        The session's stacks (``record_stacks=True``), else None.
    note : str
        What the moment is short of ("" when exact): a moment before the history kept.
    """

    device: int
    time_ms: float
    live: bool
    size: np.ndarray
    stack: np.ndarray
    label: np.ndarray
    labels: list
    stacks: Any
    note: str = ""

    @property
    def total(self) -> int:
        return int(self.size.sum())

    def __len__(self) -> int:
        return len(self.size)


class _Device:
    """What the model keeps for one allocator."""

    def __init__(self, index: int, name: str, allocator: Any, capacity: int, history: int,
                 rows: int, columns: int, session_device: Any = None, feed: Any = None) -> None:
        self.index = index
        self.name = name
        self.allocator = allocator
        # a feed is drawn in the words of the model it names, else the neutral (BFC) ones:
        # its layout is TensorFlow-binned then
        self.model = model_of(allocator) if allocator is not None else \
            (getattr(feed, "model", None) or BFC)
        self.session_device = session_device
        self.feed = feed
        self.sample: Any = None  # the feed's latest sample not yet built into a state
        self.table: dict | None = None  # a layout feed's last chunk table
        self.capacity = capacity
        self.timeline = _Timeline(history)
        if allocator is not None:
            span = max(capacity, allocator.memory_limit, allocator.pool_bytes, 1)
        else:
            span = max(capacity, 1 << 20)
        self.heatmap = _Heatmap(rows, columns, span)
        self.remove_sink: Callable[[], None] | None = None
        self.counters = {"allocs": 0, "frees": 0, "ooms": 0, "settings": 0, "events": 0}
        self.pending_ooms: list[tuple[int, int, int]] = []
        self.ooms: deque = deque(maxlen=MAX_MARKS)
        self.settings: deque = deque(maxlen=MAX_MARKS)
        self.version = 0
        self.state: DeviceState | None = None
        self.holder_log: _HolderLog | None = None
        self.note: str | None = None   # the source's words beside the figures (note())


def _capacity_of(allocator: Any, session_device: Any) -> int:
    if session_device is not None:
        return int(session_device.total)
    total = getattr(allocator.sub_allocator, "total", None)
    if isinstance(total, int) and total > 0:
        return total
    return int(allocator.memory_limit)


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


class LiveModel(traitlets.HasTraits):
    """Coalesce allocator events into a few consistent device states a second.

    Parameters
    ----------
    source : Session or BFCAllocator
        What to watch: every device of a session, or one allocator.
    rate_hz : float
        Refreshes a second (at most); changeable while running.
    history : int
        Timeline points kept per device (older ones are merged in pairs).
    heatmap_rows, heatmap_columns : int
        Address rows of the heatmap, and how many columns (states) it keeps.
    holder_history : int
        Blocks that appeared in use or went a device's history of who held what keeps
        (:meth:`held_blocks` at a moment in the past; 0 keeps none). Past it, the oldest
        refreshes are folded into the state they left; about 32 bytes a block allocated and
        16 a block freed, at most twice that while its arrays grow.
    start : bool
        Start the refresher thread (default True); without it, call :meth:`refresh_now`.

    Attributes
    ----------
    start_ms : float
        When the model started (ms since the epoch); the time views count seconds from it.
    rate_hz, paused : traits
        Adjustable while running (the controls link to them).
    refreshes : int
        Refreshes that notified listeners.
    last_refresh_ms : float
        When the latest refresh ran (ms since the epoch), whether or not a device changed:
        every state drawn holds until then (the timeline draws its lines up to it).
    errors : deque of str
        Tracebacks of listeners (views) that raised, newest last (at most 20); a failing
        view never stops the others or the refresher.

    Examples
    --------
    >>> import gpudash
    >>> from gpudash.live import LiveModel
    >>> with gpudash.Session(simulate="1GiB", poll=False) as sess, LiveModel(sess) as model:
    ...     p = sess.allocate(1000)
    ...     model.refresh_now()[0].stats.bytes_in_use
    1024
    """

    rate_hz = traitlets.Float(4.0, help="Refreshes a second, at most (0.1 to 60).")
    paused = traitlets.Bool(False, help="While True the refresher sends no updates.")
    closed = traitlets.Bool(False, read_only=True, help="True once close() ran.")

    def __init__(self, source: Any = None, *, rate_hz: float = 4.0, history: int = 5000,
                 heatmap_rows: int = 256, heatmap_columns: int = 600,
                 start: bool = True, feeds: Any = None,
                 holder_history: int = HOLDER_HISTORY) -> None:
        super().__init__()
        checked = []
        for label, v, low, top in (("history", history, 1, 10_000_000),
                                   ("heatmap_rows", heatmap_rows, 1, 65_536),
                                   ("heatmap_columns", heatmap_columns, 1, 100_000),
                                   ("holder_history", holder_history, 0, 100_000_000)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or \
                    not low <= v <= top:
                raise ConfigError(f"{label} must be an integer from {low} to {top:,}; "
                                  f"got {v!r}")
            checked.append(int(v))
        history, heatmap_rows, heatmap_columns, holder_history = checked
        try:
            self.rate_hz = rate_hz
        except traitlets.TraitError as exc:
            raise ConfigError(str(exc)) from None
        self._session = None
        self.start_ms = time.time_ns() / 1e6
        pairs: list[tuple[Any, Any]] = []
        feed_list: list[Any] = []
        if feeds is not None:
            if source is not None:
                raise TypeError("LiveModel takes a source or feeds=[...], not both")
            feed_list = list(feeds)
            if not feed_list or not all(hasattr(f, "sample") for f in feed_list):
                raise TypeError("feeds must be a non-empty list of DeviceFeed objects "
                                "(gpudash.live.feeds)")
        elif hasattr(source, "devices") and hasattr(source, "configure"):
            self._session = source
            pairs = [(d.allocator, d) for d in source.devices]
        elif hasattr(source, "_add_sink"):
            pairs = [(source, None)]
        else:
            raise TypeError(f"LiveModel watches a gpudash.Session, a BFCAllocator or "
                            f"feeds=[DeviceFeed, ...]; got {type(source).__name__}")
        self._lock = threading.Lock()  # counters, dirty set, listeners
        self._refresh_lock = threading.RLock()  # one refresh at a time
        self._listeners: list[Callable[[dict], Any]] = []
        self._tick_listeners: list[Callable[[float, set], Any]] = []
        self.last_refresh_ms = self.start_ms
        self._dirty: set[int] = set()
        self.errors: deque = deque(maxlen=20)
        self.refreshes = 0
        self._devices: list[_Device] = []
        # labels of the blocks (Session.label) as codes, for the holders' history
        self._label_codes: dict[str, int] = {}
        self._label_names: list[str] = []
        self._stack_lock = threading.Lock()
        self._stack_table: Any = None   # the session's stacks as a StackTable (stack_table)
        for i, (alloc, sdev) in enumerate(pairs):
            name = sdev.name if sdev is not None else alloc.name
            dev = _Device(i, name, alloc, _capacity_of(alloc, sdev), history, heatmap_rows,
                          heatmap_columns, sdev)
            if holder_history:
                dev.holder_log = _HolderLog(holder_history)
            self._devices.append(dev)
        for feed in feed_list:
            dev = _Device(len(self._devices), str(feed.name), None,
                          int(getattr(feed, "capacity", 0) or 0), history, heatmap_rows,
                          heatmap_columns, feed=feed)
            self._devices.append(dev)
        ref = weakref.ref(self)
        removes = []
        for dev in self._devices:
            if dev.allocator is not None:
                dev.remove_sink = dev.allocator._add_sink(_make_sink(ref, dev.index), raw=True)
                removes.append(dev.remove_sink)
        self._wake = threading.Event()
        self._stop = threading.Event()
        wake = self._wake
        for dev in self._devices:
            if dev.feed is not None:
                dev.feed.start(wake.set)
                removes.append(dev.feed.stop)
                self._seed_timeline(dev)
        self._finalizer = weakref.finalize(self, _shutdown, removes, self._stop, self._wake)
        self.refresh_now(force=True)
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=_refresh_loop, args=(ref, self._stop,
                                                                        self._wake),
                                            name="gpudash-live-model", daemon=True)
            self._thread.start()

    def _seed_timeline(self, dev: _Device) -> None:
        """A feed's points from before its first sample (``feed.history()``): the timeline
        starts with them, and its time axis at the first."""
        history = getattr(dev.feed, "history", None)
        points = history() if callable(history) else None
        if not points or not len(points["time_ms"]):
            return
        for row in zip(*(np.asarray(points[k]).tolist()
                         for k in ("time_ms", "in_use", "pool", "limit"))):
            dev.timeline.append(*row)
        self.start_ms = min(self.start_ms, float(points["time_ms"][0]))

    # ------------------------------------------------------------------ traits
    @traitlets.validate("rate_hz")
    def _validate_rate_hz(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0.1 <= value <= 60.0:
            raise traitlets.TraitError(f"rate_hz must be between 0.1 and 60 refreshes a "
                                       f"second; got {value}")
        return value

    @traitlets.observe("rate_hz")
    def _on_rate_hz_change(self, change: dict) -> None:
        self._poke()  # take the new interval at once

    @traitlets.observe("paused")
    def _on_paused_change(self, change: dict) -> None:
        self._poke()  # a resume refreshes at once

    def _poke(self) -> None:
        wake = getattr(self, "_wake", None)
        if wake is not None:
            wake.set()

    # ------------------------------------------------------------------ reading
    def seconds(self, time_ms: Any) -> Any:
        """Seconds since the model started, for times in ms since the epoch (a number, a list
        or an array): the x axis of the time views."""
        if isinstance(time_ms, (list, tuple)):
            return [(t - self.start_ms) / 1e3 for t in time_ms]
        return (time_ms - self.start_ms) / 1e3

    @property
    def start_label(self) -> str:
        """The model's start as local wall-clock time (``HH:MM:SS``)."""
        import datetime

        return datetime.datetime.fromtimestamp(self.start_ms / 1e3).strftime("%H:%M:%S")

    @property
    def session(self) -> Any:
        """The session watched, or None when the model watches one allocator."""
        return self._session

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    @property
    def device_names(self) -> list[str]:
        return [d.name for d in self._devices]

    def state(self, device: int = 0) -> DeviceState:
        """The latest state of a device."""
        return self._devices[self._index(device)].state  # type: ignore[return-value]

    @property
    def states(self) -> dict[int, DeviceState]:
        """The latest state of every device, ``{index: state}``."""
        return {d.index: d.state for d in self._devices}  # type: ignore[misc]

    def _index(self, device: Any) -> int:
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise ConfigError(f"device must be an index into the model's devices; "
                              f"got {device!r}")
        if not 0 <= int(device) < len(self._devices):
            raise ConfigError(f"device {device} does not exist: the model watches "
                              f"{len(self._devices)} device(s)")
        return int(device)

    def add_listener(self, callback: Callable[[dict], Any]) -> Callable[[], None]:
        """Call ``callback({index: DeviceState})`` with the devices that changed, after each
        refresh (in the refresher thread); returns ``remove``. A listener that raises is
        logged and kept in :attr:`errors`; the others still run."""
        return self._subscribe(self._listeners, callback, "listener")

    def add_tick_listener(self, callback: Callable[[float, set], Any]) -> Callable[[], None]:
        """Call ``callback(now_ms, changed)`` after every refresh, also the refreshes in which
        no device changed (the refresher's, ``rate_hz`` times a second while not paused):
        ``now_ms`` is :attr:`last_refresh_ms`, ``changed`` the indices of the devices rebuilt
        (their listeners ran just before). For views that show time going by (the timeline
        draws the latest state up to now). Returns ``remove``; errors are kept in
        :attr:`errors` as the listeners' are."""
        return self._subscribe(self._tick_listeners, callback, "tick listener")

    def _subscribe(self, listeners: list, callback: Callable, what: str) -> Callable[[], None]:
        if not callable(callback):
            raise TypeError(f"{what} must be callable; got {callback!r}")
        with self._lock:
            listeners.append(callback)

        def remove() -> None:
            with self._lock:
                try:
                    listeners.remove(callback)
                except ValueError:
                    pass

        return remove

    # ------------------------------------------------------------------ events in
    def _receive(self, index: int, records: list, extra: dict) -> None:
        """Raw batch sink (allocating thread, allocator lock held): count, mark dirty.

        ``records`` is the allocator's journal, 8 ints per operation (time_ns, code, ptr,
        size, requested, ...), counted by ``code_counts``. Nothing here releases the GIL (no
        numpy): a thread that waits for the allocator's lock must not be woken while it is
        held.
        """
        n = len(records) // 8
        if not n:
            return
        counts = code_counts(records)
        allocs, frees, n_ooms = counts[_ALLOC], counts[_FREE], counts[_OOM]
        codes = records[1::8] if n_ooms or extra else []
        ooms = []
        if n_ooms:
            at = [i for i, c in enumerate(codes) if c == _OOM][-MAX_MARKS:]
            ooms = [(records[8 * i], records[8 * i + 3], records[8 * i + 4]) for i in at]
        settings = []
        if extra:
            limit_times = [records[8 * i] for i, c in enumerate(codes) if c == _LIMIT]
            for k, (seq, (setting, old, new)) in enumerate(sorted(extra.items())):
                t = limit_times[k] if k < len(limit_times) else time.time_ns()
                settings.append(SettingMark(t / 1e6, int(seq), str(setting), old, new))
        dev = self._devices[index]
        with self._lock:
            c = dev.counters
            c["allocs"] += allocs
            c["frees"] += frees
            c["ooms"] += n_ooms
            c["settings"] += len(settings)
            c["events"] += n
            dev.pending_ooms.extend(ooms)
            dev.settings.extend(settings)
            self._dirty.add(index)

    # ------------------------------------------------------------------ refresh
    def request_refresh(self) -> None:
        """Wake the refresher now (after a control changed something)."""
        self._wake.set()

    def refresh_now(self, force: bool = False) -> dict[int, DeviceState]:
        """Take in buffered events and rebuild the states of devices that changed (every
        device with ``force``); notify listeners; return the latest states of all devices.
        Works while paused."""
        with self._refresh_lock:
            if self.closed:
                return self.states
            for dev in self._devices:
                if dev.allocator is not None:
                    dev.allocator.flush_events()
                else:
                    self._take_sample(dev)
            self._take_notes()
            with self._lock:
                dirty = set(range(len(self._devices))) if force else self._dirty
                self._dirty = set()
                listeners = list(self._listeners)
                ticks = list(self._tick_listeners)
            changed = {}
            for i in sorted(dirty):
                changed[i] = self._build(self._devices[i])
            if changed:
                self.refreshes += 1
                for cb in listeners:
                    try:
                        cb(changed)
                    except Exception as exc:  # noqa: BLE001 - isolate views
                        self.errors.append(f"{cb!r}: {''.join(traceback.format_exception(exc))}")
                        logger.error("gpudash: live view %r failed on update: %r", cb, exc)
            now_ms = max((s.time_ms for s in changed.values()), default=time.time_ns() / 1e6)
            self.last_refresh_ms = now_ms
            for tick in ticks:
                try:
                    tick(now_ms, set(changed))
                except Exception as exc:  # noqa: BLE001 - isolate views
                    self.errors.append(f"{tick!r}: {''.join(traceback.format_exception(exc))}")
                    logger.error("gpudash: live view %r failed on tick: %r", tick, exc)
            return self.states

    def _take_notes(self) -> None:
        """A source that says how current its figures are (``live_note(device_name)``:
        shadow mode's "history read 0.8 s ago", a rebuilt model): its devices are rebuilt
        and sent at every refresh, so the views go on at their rate, from the source's
        latest state, while the source itself is read more slowly (and say how old it
        is)."""
        note_of = getattr(self._session, "live_note", None)
        if not callable(note_of):
            return
        for dev in self._devices:
            if dev.session_device is None:
                continue
            try:
                note = note_of(dev.name)
            except Exception as exc:  # noqa: BLE001 - said instead of the note
                note = f"{type(exc).__name__}: {exc}"
            dev.note = note
            with self._lock:
                self._dirty.add(dev.index)

    def note(self, device: int = 0) -> str | None:
        """The source's words on how current a device's figures are (shadow mode: when
        PyTorch's history was last read, a model rebuilt after the ring wrapped); None for
        a source that has none."""
        return self._devices[self._index(device)].note

    def _take_sample(self, dev: _Device) -> None:
        """Ask a feed for what changed (refresher thread); count it and mark dirty."""
        try:
            sample = dev.feed.sample()
        except Exception as exc:  # noqa: BLE001 - a failing feed never stops the others
            self.errors.append(f"{dev.feed!r}: {''.join(traceback.format_exception(exc))}")
            logger.error("gpudash: feed %r failed: %r", dev.feed, exc)
            return
        if sample is None:
            return
        ooms = [(int(t), int(r), int(q)) for t, r, q in sample.ooms][-MAX_MARKS:]
        settings = [SettingMark(t / 1e6, -1, str(k), old, new)
                    for t, k, old, new in sample.settings]
        with self._lock:
            c = dev.counters
            c["allocs"] += int(sample.allocs)
            c["frees"] += int(sample.frees)
            c["ooms"] += len(sample.ooms)
            c["settings"] += len(settings)
            c["events"] += int(sample.events)
            dev.pending_ooms.extend(ooms)
            dev.settings.extend(settings)
            dev.sample = sample
            self._dirty.add(dev.index)

    def _feed_table(self, dev: _Device, sample: Any) -> dict:
        """The chunk table of a feed's state: the sample's, else (a layout feed) the last
        one it sent, else an empty table."""
        if sample is not None and sample.table is not None:
            dev.table = sample.table
        if dev.table is not None and getattr(dev.feed, "has_layout", True):
            return dev.table
        return _empty_table()

    def _build(self, dev: _Device) -> DeviceState:
        if dev.feed is not None:
            return self._build_from_feed(dev)
        alloc = dev.allocator
        table = alloc.chunk_table()
        holders = getattr(dev.session_device, "_holders", None)
        if holders:  # who holds a session's live blocks (Session.label, record_stacks)
            self._add_holders(table, holders)
        raw = alloc.stats()
        now_ms = time.time_ns() / 1e6
        size = table["size"]
        used = table["in_use"]
        if dev.holder_log is not None:
            n = int(used.sum())
            none = np.full(n, -1, dtype=np.int32)
            dev.holder_log.update(now_ms, table["alloc_id"][used], size[used],
                                  table["stack"][used] if "stack" in table else none,
                                  table["label"][used] if "label" in table else none)
        in_use = int(size[used].sum())
        pool = int(table["regions"][:, 1].sum())
        free_sizes = size[~used]
        largest_free = int(free_sizes.max()) if len(free_sizes) else 0
        free = pool - in_use
        frag = (free - largest_free) / free if free > 0 else 0.0
        stats = dataclasses.replace(
            raw, bytes_in_use=in_use, pool_bytes=pool, largest_free_block_bytes=largest_free,
            fragmentation=frag, peak_bytes_in_use=max(raw.peak_bytes_in_use, in_use),
            peak_pool_bytes=max(raw.peak_pool_bytes, pool))
        internal = in_use - int(table["requested"][used].sum())
        model = dev.model
        return self._finish_state(dev, now_ms, stats, table, internal, pool,
                                  figures=model.figures(alloc),
                                  in_force=model.live_settings(alloc))

    def _add_holders(self, table: dict, holders: dict) -> None:
        """Who holds each chunk of a session's table: ``holder`` (the words the chunk map
        shows: ``label``, ``file.py:42 step``, ``label @ file.py:42 step``; "" for none),
        ``stack`` (the stack id in :meth:`stack_table`, -1 for none) and ``label`` (an index
        into :attr:`labels`, -1 for none)."""
        text_of = self._session._holder_text
        get = holders.get
        n = len(table["ptr"])
        texts = [""] * n
        stack = np.full(n, -1, dtype=np.int32)
        label = np.full(n, -1, dtype=np.int32)
        seen: dict[tuple, tuple] = {}
        for i, p in enumerate(table["ptr"].tolist()):
            h = get(p)
            if h is None:
                continue
            r = seen.get(h)
            if r is None:
                r = seen[h] = (text_of(h), h[1], self._label_code(h[0]))
            texts[i], stack[i], label[i] = r
        table["holder"] = np.array(texts, dtype=object)
        table["stack"] = stack
        table["label"] = label

    def _label_code(self, name: str) -> int:
        if not name:
            return -1
        code = self._label_codes.get(name)
        if code is None:
            with self._stack_lock:
                code = self._label_codes.setdefault(name, len(self._label_names))
                if code == len(self._label_names):
                    self._label_names.append(name)
        return code

    @property
    def labels(self) -> list[str]:
        """The labels of the blocks seen (``Session.label``), by their code."""
        return list(self._label_names)

    def stack_table(self) -> Any:
        """The session's allocating stacks (``Session(record_stacks=True)``) as a
        :class:`~gpudash.formats.stacks.StackTable` with the session's stack ids (kept and
        extended as the session meets new stacks), or None when it records none."""
        stacks = getattr(self._session, "stacks", None)
        if stacks is None:
            return None

        with self._stack_lock:
            st = self._stack_table
            if st is None:
                st = self._stack_table = StackTable()
            n_stacks = len(stacks.stacks)      # stacks first: their frames came before them
            n_frames = len(stacks.frames)
            if n_stacks > len(st.stacks) or n_frames > len(st.frames):
                st.extend_json(stacks.frames[len(st.frames):n_frames],
                               [(list(ids), "", "")
                                for ids in stacks.stacks[len(st.stacks):n_stacks]])
            return st

    def held_blocks(self, device: int = 0, at_ms: float | None = None,
                    state: DeviceState | None = None) -> HeldBlocks:
        """The blocks in use on a device and who holds them: in ``state`` (default: the
        latest state), or, with ``at_ms`` (ms since the epoch), at that moment of the
        history (the state the views showed then: the last refresh at or before it).

        Raises
        ------
        ConfigError
            ``at_ms`` for a device without a history (a framework's feed, or
            ``holder_history=0``).
        """
        i = self._index(device)
        dev = self._devices[i]
        if at_ms is not None:
            log = dev.holder_log
            if log is None or dev.allocator is None:
                raise ConfigError(f"{dev.name}: no history of who held what (it is kept for "
                                  "a gpudash session or allocator, with holder_history > 0)")
            with self._refresh_lock:
                t, (_, size, stack, label), note = log.at(float(at_ms), self.start_ms)
            return HeldBlocks(i, t, False, size, stack.astype(np.int64),
                              label.astype(np.int64), self.labels, self.stack_table(), note)
        state = state if state is not None else dev.state
        if state is None:
            z = np.zeros(0, dtype=np.int64)
            return HeldBlocks(i, time.time_ns() / 1e6, True, z, z, z, [], None)
        t = state.table
        used = t["in_use"]
        n = int(used.sum())
        stack = t["stack"][used].astype(np.int64) if "stack" in t else \
            np.full(n, -1, dtype=np.int64)
        labels = self.labels
        if "label" in t:
            label = t["label"][used].astype(np.int64)
        elif "holder" in t:   # a feed's holder strings: labels of their own
            names, code = np.unique(np.asarray(t["holder"], dtype=object)[used].astype(str),
                                    return_inverse=True)
            labels = names.tolist()
            label = np.where(names[code] != "", code, -1).astype(np.int64)
        else:
            label = np.full(n, -1, dtype=np.int64)
        return HeldBlocks(i, state.time_ms, True, t["size"][used].astype(np.int64), stack,
                          label, labels, self.stack_table() if "stack" in t else None)

    def _build_from_feed(self, dev: _Device) -> DeviceState:
        sample, dev.sample = dev.sample, None
        prev = dev.state
        if sample is None and prev is not None:
            return prev
        now_ms = sample.time_ms if sample is not None else time.time_ns() / 1e6
        table = self._feed_table(dev, sample)
        if sample is not None:
            stats = sample.stats
        else:
            stats = AllocatorStats(bytes_limit=0)
        used = table["in_use"]
        internal = int(table["size"][used].sum()) - int(table["requested"][used].sum())
        layout_pool = int(table["regions"][:, 1].sum()) if len(table["regions"]) else 0
        return self._finish_state(dev, now_ms, stats, table, internal,
                                  max(int(stats.pool_bytes), layout_pool))

    def _finish_state(self, dev: _Device, now_ms: float, stats: AllocatorStats, table: dict,
                      internal: int, span: int, figures: dict | None = None,
                      in_force: dict | None = None) -> DeviceState:
        """The part of a refresh every source shares: timeline point, heatmap column (its
        rows fit ``span`` bytes), OOM marks, counters; the new :class:`DeviceState`."""
        in_use = int(stats.bytes_in_use)
        dev.timeline.append(now_ms, in_use, int(stats.pool_bytes), int(stats.bytes_limit))
        hm = dev.heatmap
        hm.fit(span)
        hm.append(now_ms, heatmap_column(table, hm.rows, hm.row_bytes))
        with self._lock:
            pending, dev.pending_ooms = dev.pending_ooms, []
            counters = dict(dev.counters)
            settings = tuple(dev.settings)
        for t_ns, rounded, requested in pending:
            dev.ooms.append(OomMark(t_ns / 1e6, rounded, requested, in_use))
        dev.version += 1
        state = DeviceState(
            device=dev.index, name=dev.name, time_ms=now_ms, version=dev.version, stats=stats,
            table=table, bins=BinCounts.from_table(table, dev.model),
            internal_fragmentation=internal,
            capacity=dev.capacity, counters=counters, timeline=dev.timeline.arrays(),
            ooms=tuple(dev.ooms), settings=settings, heatmap_time_ms=hm.t[:hm.n].copy(),
            heatmap=hm.z[:, :hm.n].copy(), heatmap_row_bytes=hm.row_bytes, model=dev.model,
            figures=figures or {}, in_force=in_force or {})
        dev.state = state
        return state

    def feed(self, device: int = 0) -> Any:
        """The :class:`~gpudash.live.feeds.DeviceFeed` of a device, or None (an
        allocator the model watches directly)."""
        return self._devices[self._index(device)].feed

    def model(self, device: int = 0) -> AllocatorModel:
        """The allocator model of a device (:mod:`gpudash.models`): its controls, words,
        bins or pools. A feed's is the model it names (``feed.model``), else the BFC's neutral
        words."""
        return self._devices[self._index(device)].model

    def has_layout(self, device: int = 0) -> bool:
        """Whether the device's source gives a chunk layout (chunk map, bins, heatmap)."""
        feed = self._devices[self._index(device)].feed
        return feed is None or bool(getattr(feed, "has_layout", True))

    def controls_disabled(self, device: int = 0) -> str | None:
        """``None`` when the controls act on the device, else the reason they cannot."""
        dev = self._devices[self._index(device)]
        if dev.feed is not None:
            return getattr(dev.feed, "controls", "this source cannot be controlled")
        if self._session is None:
            return None  # a bare allocator: limit and growth act, deferred does not
        return None

    def unavailable_controls(self, device: int = 0) -> dict[str, str]:
        """The device's controls that cannot act on its source, by name, with the reason
        (a feed's :meth:`~gpudash.live.feeds.DeviceFeed.unavailable`); ``{}`` for a session
        or an allocator watched directly."""
        feed = self._devices[self._index(device)].feed
        own = getattr(feed, "unavailable", None)
        return dict(own()) if callable(own) else {}

    def pending_release(self, device: int = 0) -> tuple[int, int]:
        """``(bytes, regions)`` the pool is above a limit lowered live (see
        :meth:`gpudash.BFCAllocator.pending_release`); a feed's own ``pending_release()``
        where it has one, else ``(0, 0)``."""
        dev = self._devices[self._index(device)]
        if dev.allocator is None:
            own = getattr(dev.feed, "pending_release", None)
            return tuple(own()) if callable(own) else (0, 0)
        return dev.model.pending_release(dev.allocator)

    # ------------------------------------------------------------------ acting (controls)
    def _require_session(self, what: str) -> Any:
        if self._session is None:
            raise ConfigError(f"{what} needs a gpudash.Session; this model watches a single "
                              "allocator")
        return self._session

    def device_settings(self, device: int = 0) -> dict:
        """The settings in force on a device: ``fraction``, ``allow_growth``,
        ``deferred_deletion_bytes`` (effective), ``limit`` and ``total`` bytes, and the
        model's own (PyTorch's ``expandable_segments``, ``max_split_size_mb``,
        ``garbage_collection_threshold``, ``conf``): what its controls show."""
        dev = self._devices[self._index(device)]
        if dev.feed is not None:
            out = {"fraction": None, "allow_growth": None, "deferred_deletion_bytes": None,
                   "limit": None, "total": dev.capacity or None}
            out.update(dev.feed.settings())
            return out
        out = {"total": dev.capacity, "allow_growth": None, "fraction": None,
               "deferred_deletion_bytes": None}
        out.update(dev.model.live_settings(dev.allocator))
        sdev = dev.session_device
        if sdev is not None:
            out.update(sdev.settings())
        return out

    def answer_facts(self, device: int = 0) -> dict:
        """What a control's answer is worded from (:meth:`AllocatorModel.answer`): the
        device's settings, the bytes and regions above a limit lowered live (``pending``,
        ``held``), the regions as the chunk map draws them (``regions``) and the allocator's
        own figures."""
        dev = self._devices[self._index(device)]
        pending, held = self.pending_release(device)
        out = dict(self.device_settings(device), pending=pending, held=held)
        if dev.allocator is not None:
            out["regions"] = len(dev.allocator.chunk_table()["regions"])
            out.update(dev.model.figures(dev.allocator))
        else:
            own = getattr(dev.feed, "figures", None)
            if callable(own):
                out.update(own())
        return out

    def act(self, device: int, name: str, value: Any = None) -> dict[str, Any]:
        """Run one control of a device: the one path by which a control acts.

        ``name`` is one of the device's allocator model's :class:`~gpudash.models.Control`
        names (``"fraction"``, ``"growth"``, ``"expandable"``, ``"empty_cache"``...);
        ``value`` the setting's new value (ignored for a button). In order:

        1. the model checks the value (:meth:`~gpudash.models.AllocatorModel.check_setting`:
           no coercion, so growth ``"false"`` or a fraction of ``None`` is refused);
        2. the device's source applies it: the session's ``configure`` (TensorFlow's BFC:
           ``set_memory_limit``; PyTorch's: ``set_memory_fraction``), the allocator's own
           ``release_free_regions``, or the feed's control methods (a Dask worker's:
           :func:`gpudash.dask.configure_workers`); a source that cannot be controlled (a
           framework watched read-only) refuses with its reason;
        3. the refresher is woken, and the model answers in its framework's words
           (:meth:`~gpudash.models.AllocatorModel.answer`, from :meth:`answer_facts`).

        Returns ``{"ok": True, "text": ..., "warning": ...}`` (``warning`` when there is
        one). Raises :class:`~gpudash.ConfigError` naming the control and the value when any
        step refuses; nothing has changed then.
        """
        i = self._index(device)
        dev = self._devices[i]
        model = dev.model
        control = self._control(model, name)
        if control.setting:
            # before anything changes (a None would otherwise read as "no change" and be
            # answered as if it had acted)
            model.check_setting(control.setting, value)
        reason = self.controls_disabled(i)
        if reason:
            raise ConfigError(reason)
        # a source that answers in its own words (shadow mode: PyTorch's reserved before
        # and after, the replay of the run so far) keeps them in ``answers``
        said = getattr(self._session, "answers", None)
        said_before = len(said) if isinstance(said, list) else None
        result = None
        if control.setting:
            self.configure(device=i, **{control.setting: value})
        else:
            if control.needs_session and self._session is None and dev.feed is None:
                raise ConfigError(f"{name} needs a gpudash.Session (deferred frees live "
                                  "there)")
            result = getattr(self, control.action)(i)
        answer = {"ok": True, **model.answer(name, value, result, self.answer_facts(i))}
        if said_before is not None and len(said) > said_before:
            answer["text"] = "\n".join(said[said_before:])
        return answer

    @staticmethod
    def _control(model: AllocatorModel, name: str) -> Any:
        control = model.control(name)
        if control is None:
            raise ConfigError(f"unknown control {name!r}; {model.title}'s are: "
                              f"{', '.join(c.name for c in model.controls)}")
        return control

    def can_preview(self, device: int = 0) -> bool:
        """Whether the device's source says what a setting would do before it is applied
        (:meth:`preview`): shadow mode, whose changes act on a real job."""
        return self._devices[self._index(device)].feed is None and \
            callable(getattr(self._session, "preview", None))

    def preview(self, device: int, name: str, value: Any) -> dict[str, Any]:
        """What control ``name`` at ``value`` would do, said before anything changes: the
        source's ``preview(setting, value, device)`` (shadow mode: the exact replay of the
        run so far under it). The value is checked as :meth:`act` checks it. Returns
        ``{"ok": True, "text": ..., "preview": True}``.

        Raises
        ------
        ConfigError
            An unknown control, a button (nothing to preview), a bad value, or a source
            that has no preview.
        """
        i = self._index(device)
        model = self._devices[i].model
        control = self._control(model, name)
        if not control.setting:
            raise ConfigError(f"{name} is a button: it has no setting to preview")
        model.check_setting(control.setting, value)
        if not self.can_preview(i):
            raise ConfigError("this source applies a setting at once: it has no preview")
        return {"ok": True, "preview": True,
                "text": self._session.preview(control.setting, value, device=i)}

    def configure(self, device: int | None = None, **changes: Any) -> None:
        """``Session.configure(**changes, device=...)`` on the watched session, then wake
        the refresher. Raises what the session raises (nothing changes then)."""
        if self._devices and self._devices[0].feed is not None:
            targets = range(len(self._devices)) if device is None else [self._index(device)]
            for i in targets:
                feed = self._devices[i].feed
                if feed.controls is not None:
                    raise ConfigError(f"{feed.name}: {feed.controls}")
            for i in targets:
                self._devices[i].feed.configure(**changes)
            self.request_refresh()
            return
        sess = self._require_session("configure()")
        sess.configure(device=device, **changes)
        self.request_refresh()

    def release_free_regions(self, device: int | None = None) -> int:
        """Return wholly free regions of one device (or all) to the backend; bytes returned."""
        if self._devices[0].feed is not None:
            targets = range(len(self._devices)) if device is None else [self._index(device)]
            freed = 0
            for i in targets:
                feed = self._devices[i].feed
                if feed.controls is not None:
                    raise ConfigError(f"{feed.name}: {feed.controls}")
                freed += int(feed.release_free_regions())
        elif self._session is not None:
            freed = self._session.release_free_regions(device)
        else:
            freed = self._devices[0].allocator.release_free_regions()
        self.request_refresh()
        return freed

    def empty_cache(self, device: int | None = None) -> int:
        """PyTorch's ``empty_cache()`` on a device (or all): wholly free cached segments go
        back to the device (:meth:`release_free_regions` under PyTorch's name); bytes
        returned."""
        return self.release_free_regions(device)

    def flush_deferred(self, device: int | None = None) -> int:
        """Return the session's deferred frees to the allocators now; bytes returned."""
        if self._devices[0].feed is not None:
            targets = range(len(self._devices)) if device is None else [self._index(device)]
            freed = 0
            for i in targets:
                feed = self._devices[i].feed
                if feed.controls is not None:
                    raise ConfigError(f"{feed.name}: {feed.controls}")
                freed += int(feed.flush_deferred())
            self.request_refresh()
            return freed
        sess = self._require_session("flush_deferred()")
        freed = sess.flush(device)
        self.request_refresh()
        return freed

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop the refresher thread and detach every sink. Idempotent."""
        if self.closed:
            return
        with self._refresh_lock:
            self.set_trait("closed", True)
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        for dev in self._devices:
            remove, dev.remove_sink = dev.remove_sink, None
            if remove is not None:
                remove()
            if dev.feed is not None:
                try:
                    dev.feed.stop()
                except Exception as exc:  # noqa: BLE001 - close the other feeds too
                    logger.error("gpudash: feed %r failed to stop: %r", dev.feed, exc)
        with self._lock:
            self._listeners.clear()
            self._tick_listeners.clear()
        self._finalizer.detach()

    @property
    def running(self) -> bool:
        """True while the refresher thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> LiveModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("paused" if self.paused else "live")
        return (f"LiveModel({len(self._devices)} device(s), {state}, rate_hz={self.rate_hz:g}, "
                f"refreshes={self.refreshes})")


def _empty_table() -> dict:
    """A chunk table without chunks (a source without a layout)."""
    z = np.zeros(0, dtype=np.int64)
    return {"ptr": z, "size": z, "requested": z, "alloc_id": z,
            "bin": np.zeros(0, dtype=np.int8), "region": z, "in_use": np.zeros(0, dtype=bool),
            "regions": np.zeros((0, 2), dtype=np.int64)}


def _make_sink(ref: weakref.ref[LiveModel], index: int) -> Callable[[dict, dict], None]:
    """A sink holding the model weakly, so a dropped model can be collected."""

    def sink(records: list, extra: dict) -> None:
        model = ref()
        if model is not None:
            model._receive(index, records, extra)

    return sink


def _shutdown(removes: list, stop: threading.Event, wake: threading.Event) -> None:
    """Finalizer of a model collected without close(): stop the thread, detach sinks."""
    stop.set()
    wake.set()
    for remove in removes:
        try:
            remove()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def _refresh_loop(ref: weakref.ref[LiveModel], stop: threading.Event,
                  wake: threading.Event) -> None:
    """The refresher thread: sleeps ``1 / rate_hz`` (or until woken by a control, a rate
    change or a resume), refreshes, and holds the model only weakly while it sleeps."""
    last = time.monotonic()
    while not stop.is_set():
        model = ref()
        if model is None:
            return
        interval = None if model.paused else 1.0 / model.rate_hz
        del model
        if interval is not None:
            interval = max(0.0, last + interval - time.monotonic())
        wake.wait(interval)
        wake.clear()
        if stop.is_set():
            return
        model = ref()
        if model is None:
            return
        if not model.paused:
            now = time.monotonic()
            due = last + 1.0 / model.rate_hz
            # on the rate's grid: a tick that starts late (the GIL held by a busy thread)
            # does not push the next ones later; an early one (a control's wake) restarts it
            last = due if due <= now < due + 1.0 / model.rate_hz else now
            try:
                model.refresh_now()
            except Exception as exc:  # noqa: BLE001 - the refresher must survive
                model.errors.append(f"refresh: {''.join(traceback.format_exception(exc))}")
                logger.error("gpudash: live refresh failed: %r", exc)
        del model
