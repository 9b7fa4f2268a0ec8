"""Analysis of allocation traces: fragmentation over time, address x time heatmaps, and the
allocator's full state at any event.

=========================  ===================================================================
:func:`fragmentation_series`  in use, requested, pool, internal and external fragmentation
                              after every event
:func:`heatmap`               an address x time occupancy grid (:class:`Heatmap`), numpy only
:class:`HeatmapBuilder`       the same grid built column by column from event batches (live)
:func:`state_at`              the allocator's :class:`~gpudash.MemoryDump` right after an event
:class:`StateScrubber`        the same, fast enough to scrub back and forth (checkpoints)
:func:`chunk_map_at_peak`     the state at the event of peak bytes in use
:func:`bin_occupancy`         a dump's bins as numpy columns
=========================  ===================================================================

Blocks and pairing: an allocation lives from its alloc row to the next alloc or free row at the
same address on the same device (its free), or to the end of the trace. This pairs every free
with the allocation it frees whenever the trace is consistent, and it is vectorised.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import ConfigError
from .bfc import AllocatorStats, MemoryDump
from .events import ALLOC as _ALLOC, FREE as _FREE, EXTEND as _EXTEND, RELEASE as _RELEASE
from .options import GPUOptions
from .formats.format import Trace
from .models.bfc import _FROM_GPU_OPTIONS
from .trace.replay import (
    _Engine,
    _model_calls,
    _pick_device,
    resolve_settings,
    trace_settings,
)
from .trace.replay import _model

__all__ = [
    "fragmentation_series",
    "heatmap",
    "Heatmap",
    "HeatmapBuilder",
    "state_at",
    "StateScrubber",
    "chunk_map_at_peak",
    "bin_occupancy",
]


# =============================================================================== helpers
def _as_trace(trace_or_columns: Any) -> Trace:
    if isinstance(trace_or_columns, Trace):
        return trace_or_columns
    if isinstance(trace_or_columns, Mapping):
        return Trace(trace_or_columns)
    raise TypeError(f"expected a Trace or a dict of event columns; got "
                    f"{type(trace_or_columns).__name__}")


def _device_rows(trace: Trace, device: int | None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The columns of one device's rows (all rows when ``device`` is None) and their row
    numbers in the trace."""
    cols = trace.columns
    if device is None:
        return cols, np.arange(len(trace), dtype=np.int64)
    mask = cols["device"] == int(device)
    rows = np.flatnonzero(mask)
    if len(rows) == len(trace):
        return cols, rows
    return {k: v[rows] for k, v in cols.items()}, rows


def _pair(kind: np.ndarray, ptr: np.ndarray, device: np.ndarray) -> tuple[np.ndarray, ...]:
    """Pair allocations with their frees, vectorised.

    Returns
    -------
    alloc_rows, end_rows : numpy.ndarray
        Each alloc row and the row that ends it: the next alloc or free row at the same
        (device, address), or ``len(kind)`` when none follows.
    free_rows, freed_alloc : numpy.ndarray
        Each free row and the alloc row it frees (-1 for a free with no live allocation).
    """
    n = len(kind)
    af = np.flatnonzero((kind == _ALLOC) | (kind == _FREE))
    if len(af) == 0:
        e = np.empty(0, dtype=np.int64)
        return e, e, e, e
    p = ptr[af]
    order = np.lexsort((af, p, device[af]))
    sr = af[order]
    sp = p[order]
    sd = device[af][order]
    same_next = np.zeros(len(sr), dtype=bool)
    same_next[:-1] = (sp[1:] == sp[:-1]) & (sd[1:] == sd[:-1])
    nxt = np.empty(len(sr), dtype=np.int64)
    nxt[:-1] = sr[1:]
    nxt[-1] = n
    end = np.where(same_next, nxt, n)
    sk = kind[sr]
    is_a = sk == _ALLOC
    a_rows, a_end = sr[is_a], end[is_a]
    a_order = np.argsort(a_rows, kind="stable")
    # a free is matched when the previous row of its group is an alloc
    prev_alloc = np.zeros(len(sr), dtype=bool)
    prev_alloc[1:] = same_next[:-1] & is_a[:-1]
    prev_row = np.full(len(sr), -1, dtype=np.int64)
    prev_row[1:] = sr[:-1]
    is_f = ~is_a
    f_rows = sr[is_f]
    f_alloc = np.where(prev_alloc[is_f], prev_row[is_f], -1)
    f_order = np.argsort(f_rows, kind="stable")
    return a_rows[a_order], a_end[a_order], f_rows[f_order], f_alloc[f_order]


def _merge_intervals(starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int]]:
    """Union of [start, end) intervals, sorted (overlapping ones merged, touching ones kept
    apart)."""
    if len(starts) == 0:
        return []
    order = np.argsort(starts, kind="stable")
    out: list[list[int]] = []
    for s, e in zip(starts[order].tolist(), ends[order].tolist()):
        if out and s < out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        elif s != e:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _infer_regions(cols: dict[str, np.ndarray]) -> list[tuple[int, int]]:
    """The address space of some rows: every region extended (merged where they overlap);
    for a device with no extend rows, the hull of its allocations."""
    kind, ptr, size, dev = cols["kind"], cols["ptr"], cols["size"], cols["device"]
    spans: list[tuple[int, int]] = []
    for d in np.unique(dev).tolist():
        m = dev == d
        ext = m & (kind == _EXTEND)
        if ext.any():
            spans.extend(_merge_intervals(ptr[ext], ptr[ext] + size[ext]))
        else:
            al = m & (kind == _ALLOC)
            if al.any():
                spans.append((int(ptr[al].min()), int((ptr[al] + size[al]).max())))
    return _merge_intervals(np.array([s for s, _ in spans], dtype=np.int64),
                            np.array([e for _, e in spans], dtype=np.int64)) if spans else []


def _parse_address_space(address_space: Any) -> list[tuple[int, int]]:
    """(ptr, size) pairs -> sorted [start, end) intervals."""
    if hasattr(address_space, "capacity") and hasattr(address_space, "base"):
        align = int(getattr(address_space, "alignment", 1) or 1)
        base = (int(address_space.base) + align - 1) & -align
        pairs = [(base, int(address_space.capacity))]
    else:
        try:
            items = list(address_space)
        except TypeError:
            raise TypeError("address_space must be (ptr, size) pairs, one (ptr, size) pair or "
                            f"a device with base and capacity; got {address_space!r}") from None
        if len(items) == 2 and all(isinstance(v, (int, np.integer)) for v in items):
            items = [tuple(items)]
        pairs = [(int(p), int(s)) for p, s in items]
    for p, s in pairs:
        if s <= 0 or p < 0:
            raise ValueError(f"address_space region ({p:#x}, {s}) needs ptr >= 0 and size > 0")
    starts = np.array([p for p, _ in pairs], dtype=np.int64)
    ends = np.array([p + s for p, s in pairs], dtype=np.int64)
    return _merge_intervals(starts, ends)


class _AddressMap:
    """Regions laid end to end in address order: address -> offset."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.starts = np.array([s for s, _ in spans], dtype=np.int64)
        self.ends = np.array([e for _, e in spans], dtype=np.int64)
        sizes = self.ends - self.starts
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) \
            if len(spans) else np.zeros(0, dtype=np.int64)
        self.total = int(sizes.sum()) if len(spans) else 0

    def regions(self) -> list[tuple[int, int, int]]:
        return [(int(s), int(e - s), int(o))
                for s, e, o in zip(self.starts, self.ends, self.offsets)]

    def map(self, ptr: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                               np.ndarray]:
        """(start offset, end offset, inside) of blocks [ptr, ptr + size); a block that runs
        past its region's end is cut there."""
        if self.total == 0:
            z = np.zeros(len(ptr), dtype=np.int64)
            return z, z, np.zeros(len(ptr), dtype=bool)
        i = np.searchsorted(self.starts, ptr, side="right") - 1
        ic = np.maximum(i, 0)
        inside = (i >= 0) & (ptr < self.ends[ic])
        s = self.offsets[ic] + (ptr - self.starts[ic])
        e = s + np.minimum(size, self.ends[ic] - ptr)
        return s, e, inside


def _coverage(x0: np.ndarray, x1: np.ndarray, t0: np.ndarray, t1: np.ndarray, rows: int,
              cols: int) -> np.ndarray:
    """Fraction of each cell covered by rectangles [x0, x1) x [t0, t1), exactly.

    Coordinates are in cell units (row i spans [i, i + 1), column j spans [j, j + 1)).
    A rectangle's coverage of row r is ``I(r) + P(r)``: an indicator of the rows it covers
    from start to end (difference +1 at its first row, -1 at its last, summed over rows)
    plus point corrections at the two end rows (minus the part of the first row below it,
    plus the part of the last row inside it); the same along columns (``J + Q``). The area
    in a cell is the product ``(I + P)(J + Q)``: four grids filled with four corner updates
    each (``np.bincount``) and finished by cumulative sums along both axes (I x J), rows
    only (I x Q), columns only (P x J) or none (P x Q).
    """
    x0 = np.clip(x0, 0.0, rows)
    x1 = np.clip(x1, 0.0, rows)
    t0 = np.clip(t0, 0.0, cols)
    t1 = np.clip(t1, 0.0, cols)
    keep = (x1 > x0) & (t1 > t0)
    if not keep.all():
        x0, x1, t0, t1 = x0[keep], x1[keep], t0[keep], t1[keep]
    w = cols + 1
    cells = (rows + 1) * w
    if len(x0) == 0:
        return np.zeros((rows, cols))
    r0 = np.minimum(np.floor(x0), rows).astype(np.int64)
    r1 = np.minimum(np.floor(x1), rows).astype(np.int64)
    c0 = np.minimum(np.floor(t0), cols).astype(np.int64)
    c1 = np.minimum(np.floor(t1), cols).astype(np.int64)
    p0, p1 = x0 - r0, x1 - r1
    q0, q1 = t0 - c0, t1 - c1
    idx = np.concatenate([r0 * w + c0, r0 * w + c1, r1 * w + c0, r1 * w + c1])
    ones = np.ones(len(x0))

    def grid(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> np.ndarray:
        return np.bincount(idx, weights=np.concatenate([a, b, c, d]),
                           minlength=cells).reshape(rows + 1, w)

    ij = grid(ones, -ones, -ones, ones)                    # I x J
    iq = grid(-q0, q1, q0, -q1)                            # I x Q
    pj = grid(-p0, p0, p1, -p1)                            # P x J
    pq = grid(p0 * q0, -p0 * q1, -p1 * q0, p1 * q1)        # P x Q
    out = np.cumsum(np.cumsum(ij, axis=0), axis=1)
    out += np.cumsum(iq, axis=0)
    out += np.cumsum(pj, axis=1)
    out += pq
    out = out[:rows, :cols]
    # values are fractions: clear the rounding noise of the cumulative sums
    np.clip(out, 0.0, 1.0, out=out)
    out[np.abs(out) < 1e-12] = 0.0
    return out


# =============================================================================== fragmentation
def fragmentation_series(trace_or_columns: Any, *, device: int | None = None) -> dict[str,
                                                                                    np.ndarray]:
    """In use, pool and fragmentation after every event.

    Parameters
    ----------
    trace_or_columns : Trace or dict of numpy arrays
        A trace, or event columns (:data:`gpudash.events.COLUMNS`).
    device : int, optional
        Only this device's rows. By default all rows (devices have separate address ranges,
        so several devices add up: one pool, one free space).

    Returns
    -------
    dict of numpy.ndarray
        One value per event (row), after the event:

        - ``row``: the row in the trace;
        - ``in_use``: bytes of live allocations (their ``size``, chunk bytes for gpudash
          traces), a cumulative sum over alloc/free rows;
        - ``requested_in_use``: bytes asked for by the live allocations;
        - ``internal``: ``in_use - requested_in_use`` (rounding and unsplit chunks);
        - ``pool``: bytes of regions held (cumulative sum over extend/release rows);
        - ``pool_minus_in_use``: free bytes of the pool;
        - ``largest_free``: the largest free block;
        - ``external``: ``1 - largest_free / pool_minus_in_use`` (0 when nothing is free),
          TensorFlow's ``GetFragmentation``.

    Notes
    -----
    ``largest_free`` is exact: it is the largest gap between live allocations inside the
    regions, tracked event by event (a sorted list of live blocks and a heap of gap sizes;
    the one per-event loop here). For a trace gpudash recorded this is exactly the
    allocator's largest free chunk (``BFCAllocator._largest_free_chunk()``) after every
    call, because the BFC allocator always coalesces neighbouring free chunks, so its free
    chunks are exactly those gaps; the tests check this against a replay. Gaps are measured
    between allocations' ``size`` extents, so for imported traces whose ``size`` is a
    rounded request the free space includes any slack the real allocator kept.

    A device with no extend rows (most imported traces) gets one region spanning its
    allocations, present from the start. Allocations outside every region are counted in
    ``in_use`` but not in the free-space figures. A region released while it still holds
    live allocations (``BFCAllocator.close``) ends them.
    """
    trace = _as_trace(trace_or_columns)
    cols, rows_idx = _device_rows(trace, device)
    kind, ptr, size, req = cols["kind"], cols["ptr"], cols["size"], cols["requested"]
    dev = cols["device"]
    n = len(kind)
    is_a = kind == _ALLOC
    a_rows, _, f_rows, f_alloc = _pair(kind, ptr, dev)
    matched = f_rows[f_alloc >= 0]
    d_use = np.zeros(n, dtype=np.int64)
    d_req = np.zeros(n, dtype=np.int64)
    d_use[is_a] = size[is_a]
    d_req[is_a] = req[is_a]
    d_use[matched] -= size[f_alloc[f_alloc >= 0]]
    d_req[matched] -= req[f_alloc[f_alloc >= 0]]

    # regions: extend rows, or the hull of a device's allocations when it has none
    d_pool = np.zeros(n, dtype=np.int64)
    ext, rel = kind == _EXTEND, kind == _RELEASE
    d_pool[ext] = size[ext]
    d_pool[rel] = -size[rel]
    initial: list[tuple[int, int]] = []
    for d in np.unique(dev).tolist():
        m = dev == d
        if not (m & ext).any():
            al = m & is_a
            if al.any():
                initial.append((int(ptr[al].min()), int((ptr[al] + size[al]).max())))
    pool0 = sum(e - s for s, e in initial)

    largest, drops = _largest_free_loop(kind, ptr, size, req, initial)
    for row, nbytes, nreq in drops:
        d_use[row] -= nbytes
        d_req[row] -= nreq
    in_use = np.cumsum(d_use)
    requested = np.cumsum(d_req)
    pool = pool0 + np.cumsum(d_pool)
    free = pool - in_use
    with np.errstate(divide="ignore", invalid="ignore"):
        external = np.where(free > 0, 1.0 - largest / np.where(free > 0, free, 1), 0.0)
    return {
        "row": rows_idx,
        "time_ns": cols["time_ns"],
        "in_use": in_use,
        "requested_in_use": requested,
        "internal": in_use - requested,
        "pool": pool,
        "pool_minus_in_use": free,
        "largest_free": largest,
        "external": external,
    }


def _largest_free_loop(kind: np.ndarray, ptr: np.ndarray, size: np.ndarray, req: np.ndarray,
                       initial: list[tuple[int, int]]) -> tuple[np.ndarray, list]:
    """Largest gap between live blocks inside the regions, after every row."""
    n = len(kind)
    out = np.zeros(n, dtype=np.int64)
    rows = np.flatnonzero(np.isin(kind, (_ALLOC, _FREE, _EXTEND, _RELEASE)))
    k_l, p_l, s_l, q_l = (kind[rows].tolist(), ptr[rows].tolist(), size[rows].tolist(),
                          req[rows].tolist())
    reg_starts: list[int] = []
    reg_end: dict[int, int] = {}
    live: list[int] = []           # sorted starts of live blocks
    live_end: dict[int, int] = {}  # start -> end
    live_req: dict[int, int] = {}
    count: dict[int, int] = {}     # gap size -> how many
    heap: list[int] = []           # -gap sizes (lazy: stale entries skipped)
    drops: list[tuple[int, int, int]] = []
    bl, br, ins = bisect.bisect_left, bisect.bisect_right, bisect.insort
    push, pop = heapq.heappush, heapq.heappop

    def add(g: int) -> None:
        c = count.get(g, 0)
        count[g] = c + 1
        if c == 0:
            push(heap, -g)

    def remove(g: int) -> None:
        c = count[g] - 1
        if c:
            count[g] = c
        else:
            del count[g]

    def gaps_between(lo: int, hi: int) -> list[int]:
        out_g = []
        cur = lo
        j = bl(live, lo)
        while j < len(live) and live[j] < hi:
            s = live[j]
            if s > cur:
                out_g.append(s - cur)
            cur = max(cur, live_end[s])
            j += 1
        if hi > cur:
            out_g.append(hi - cur)
        return out_g

    def region_of(p: int) -> tuple[int, int] | None:
        i = br(reg_starts, p) - 1
        if i >= 0:
            rs = reg_starts[i]
            re_ = reg_end[rs]
            if p < re_:
                return rs, re_
        return None

    def bounds(j: int, rs: int, re_: int) -> tuple[int, int]:
        """(left, right) edges of the gap around position j of ``live``."""
        left = rs
        if j > 0:
            q = live[j - 1]
            if q >= rs:
                left = max(rs, live_end[q])
        right = re_
        if j < len(live) and live[j] < re_:
            right = live[j]
        return left, right

    for s, e in initial:
        reg_starts.append(s)
        reg_end[s] = e
        add(e - s)
    reg_starts.sort()

    current = max(count) if count else 0
    prev_row = 0
    for r, k, p, sz, rq in zip(rows.tolist(), k_l, p_l, s_l, q_l):
        out[prev_row:r] = current
        prev_row = r
        if k == _ALLOC:
            if p in live_end:
                pass  # inconsistent trace: the address is live already
            else:
                reg = region_of(p)
                j = bl(live, p)
                if reg is not None:
                    left, right = bounds(j, *reg)
                    e = min(p + sz, reg[1])
                    if right - left > 0 and left <= p and e <= right:
                        remove(right - left)
                        if p > left:
                            add(p - left)
                        if right > e:
                            add(right - e)
                live.insert(j, p)
                live_end[p] = p + sz
                live_req[p] = rq
        elif k == _FREE:
            e = live_end.pop(p, None)
            if e is not None:
                live_req.pop(p, None)
                j = bl(live, p)
                del live[j]
                reg = region_of(p)
                if reg is not None:
                    e = min(e, reg[1])
                    left, right = bounds(j, *reg)
                    if p > left:
                        remove(p - left)
                    if right > e:
                        remove(right - e)
                    add(right - left)
        elif k == _EXTEND:
            if p not in reg_end:
                for g in gaps_between(p, p + sz):
                    add(g)
                ins(reg_starts, p)
                reg_end[p] = p + sz
        else:  # release
            end = reg_end.get(p)
            if end is not None:
                for g in gaps_between(p, end):
                    remove(g)
                # allocations still inside end with their region (close())
                j = bl(live, p)
                while j < len(live) and live[j] < end:
                    q = live.pop(j)
                    drops.append((r, live_end.pop(q) - q, live_req.pop(q, 0)))
                del reg_starts[bl(reg_starts, p)]
                del reg_end[p]
        while heap and -heap[0] not in count:
            pop(heap)
        current = -heap[0] if heap else 0
    out[prev_row:n] = current
    return out, drops


# =============================================================================== heatmap
@dataclass
class Heatmap:
    """An address x time occupancy grid.

    Attributes
    ----------
    values : numpy.ndarray of float64, shape (rows, cols)
        Each cell's fraction of bytes in use, averaged over the cell's time span.
    row_edges : numpy.ndarray of float64, shape (rows + 1,)
        Byte offsets of the row boundaries in the concatenated address space.
    col_edges : numpy.ndarray of float64, shape (cols + 1,)
        Event indices (``by="event"``) or ``time_ns`` values (``by="time"``) of the column
        boundaries.
    regions : list of (int, int, int)
        ``(ptr, size, offset)`` of each region laid end to end, in address order.
    by : str
        ``"event"`` or ``"time"``.
    outside : int
        Allocations that lie outside every region (left out).
    """

    values: np.ndarray
    row_edges: np.ndarray
    col_edges: np.ndarray
    regions: list[tuple[int, int, int]]
    by: str = "event"
    outside: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape  # type: ignore[return-value]

    def address(self, offset: float) -> int:
        """The device address at a byte offset of the concatenated space."""
        offset = int(offset)
        for ptr, size, off in self.regions:
            if off <= offset < off + size:
                return ptr + offset - off
        raise ValueError(f"offset {offset} lies outside the address space "
                         f"({self.regions[-1][2] + self.regions[-1][1] if self.regions else 0}"
                         " bytes)")

    def used_bytes(self) -> np.ndarray:
        """Bytes in use per column (time-averaged): the column sums weighted by row height."""
        heights = np.diff(self.row_edges)
        return heights @ self.values

    def __repr__(self) -> str:
        r, c = self.values.shape
        total = self.row_edges[-1] if len(self.row_edges) else 0
        return (f"Heatmap({r} x {c}, by={self.by!r}, regions={len(self.regions)}, "
                f"address space {int(total):,} bytes)")


def _blocks(cols: dict[str, np.ndarray], amap: _AddressMap, by: str) -> tuple[np.ndarray, ...]:
    """Offsets and times of every allocation: (off_start, off_end, t_start, t_end, outside)."""
    kind = cols["kind"]
    n = len(kind)
    a_rows, a_end, _, _ = _pair(kind, cols["ptr"], cols["device"])
    s, e, inside = amap.map(cols["ptr"][a_rows], cols["size"][a_rows])
    outside = int((~inside).sum())
    if by == "event":
        t0 = a_rows.astype(np.float64)
        t1 = a_end.astype(np.float64)
    else:
        # relative to the first event, in int64 first: epoch nanoseconds (~1.7e18) are not
        # exact in float64, their differences are
        t = cols["time_ns"] - cols["time_ns"][0] if n else cols["time_ns"]
        t_end = t[-1] if n else 0
        t0 = t[a_rows].astype(np.float64)
        t1 = np.where(a_end < n, t[np.minimum(a_end, n - 1)], t_end).astype(np.float64)
    return s[inside], e[inside], t0[inside], t1[inside], outside


def heatmap(trace: Any, *, rows: int = 512, cols: int = 1000, by: str = "event",
            address_space: Any = None, device: int | None = None) -> Heatmap:
    """Occupancy of the address space over time, as a rows x cols grid.

    Parameters
    ----------
    trace : Trace or dict of numpy arrays
    rows : int, default 512
        Equal slices of the address space.
    cols : int, default 1000
        Equal slices of the time axis.
    by : {"event", "time"}
        Time axis: event index (the state after event ``i`` holds over ``[i, i + 1)``;
        columns span ``[0, n_events)``) or ``time_ns`` (from the first event's time to the
        last's).
    address_space : optional
        The regions to lay end to end: ``(ptr, size)`` pairs, one ``(ptr, size)`` pair, or a
        device with ``base`` and ``capacity`` (a :class:`~gpudash.SimulatedDevice`). By
        default every region the trace ever extended (overlaps merged); for a device with no
        extend rows, the span of its allocations.
    device : int, optional
        Only this device's rows (event indices then count that device's rows).

    Returns
    -------
    Heatmap
        ``values[r, c]`` is the fraction of row ``r``'s bytes in use, averaged over column
        ``c``'s span (time-averaged, not sampled at the column's end). Partial coverage is
        exact on both axes: a 1 KiB block alive for a whole column in a 2 MiB row adds
        exactly 1/2048.

    Notes
    -----
    One pass, numpy only: allocations are paired with their frees (:func:`_pair`), mapped
    to offsets in the concatenated space and to columns, and summed into the grid with 2-D
    difference arrays and cumulative sums (see :func:`_coverage`). An allocation's bytes are
    its ``size`` (the chunk, for gpudash traces). Release rows are not read: allocations
    still live when ``BFCAllocator.close`` releases their region stay shown to the end.
    """
    if by not in ("event", "time"):
        raise ValueError(f"by must be 'event' or 'time'; got {by!r}")
    rows, cols = int(rows), int(cols)
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be >= 1; got {rows} x {cols}")
    tr = _as_trace(trace)
    c, _ = _device_rows(tr, device)
    spans = _parse_address_space(address_space) if address_space is not None \
        else _infer_regions(c)
    amap = _AddressMap(spans)
    n = len(c["kind"])
    t_first = int(c["time_ns"][0]) if n else 0
    if by == "event":
        lo, hi = 0.0, float(n)
    else:
        lo, hi = 0.0, float(int(c["time_ns"][-1]) - t_first) if n else 1.0
    if hi <= lo:
        hi = lo + 1.0
    col_edges = np.linspace(lo, hi, cols + 1)
    if by == "time":
        col_edges += t_first
    row_edges = np.linspace(0.0, float(amap.total), rows + 1)
    if amap.total == 0 or n == 0:
        return Heatmap(np.zeros((rows, cols)), row_edges, col_edges, amap.regions(), by, 0)
    s, e, t0, t1, outside = _blocks(c, amap, by)
    row_h = amap.total / rows
    col_w = (hi - lo) / cols
    values = _coverage(s / row_h, e / row_h, (t0 - lo) / col_w, (t1 - lo) / col_w, rows, cols)
    return Heatmap(values, row_edges, col_edges, amap.regions(), by, outside)


class HeatmapBuilder:
    """Builds a heatmap column by column from event batches (for live views).

    Parameters
    ----------
    rows : int, default 512
    address_space
        Fixed for the builder's life: ``(ptr, size)`` pairs, one pair, or a device with
        ``base`` and ``capacity`` (a live view uses the device's whole capacity).
    by : {"event", "time"}
    events_per_col : int, default 1000
        Column width for ``by="event"``.
    ns_per_col : float, optional
        Column width for ``by="time"`` (required then).
    t0_ns : int, optional
        Start of the first time column; default the first event's time.
    device : int, optional
        Only this device's events.
    keep_cols : int, optional
        Keep only the newest columns in :attr:`values` (older ones are dropped).

    Examples
    --------
    >>> b = HeatmapBuilder(64, [(0x1000, 1 << 20)], events_per_col=100)
    >>> b.add_events(trace.columns).shape  # doctest: +SKIP
    (64, 12)

    Notes
    -----
    :meth:`add_events` returns only columns that are complete: in event mode, once
    ``events_per_col`` more events have arrived; in time mode, once an event (or
    :meth:`flush`'s ``now_ns``) is past the column's end. Events after the last complete
    column wait for the next call. Allocations still live are carried over (as arrays), so
    each call costs O(new events + live allocations), with numpy only. The columns equal
    those :func:`heatmap` computes over the whole trace with the same edges.
    """

    def __init__(self, rows: int = 512, address_space: Any = None, *, by: str = "event",
                 events_per_col: int = 1000, ns_per_col: float | None = None,
                 t0_ns: int | None = None, device: int | None = None,
                 keep_cols: int | None = None) -> None:
        if address_space is None:
            raise ValueError("HeatmapBuilder needs a fixed address_space (the device's range "
                             "for a live view)")
        if by not in ("event", "time"):
            raise ValueError(f"by must be 'event' or 'time'; got {by!r}")
        self.rows = int(rows)
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1; got {rows}")
        self.by = by
        if by == "event":
            self.width = float(int(events_per_col))
            if self.width < 1:
                raise ValueError(f"events_per_col must be >= 1; got {events_per_col}")
        else:
            if ns_per_col is None or not float(ns_per_col) > 0:
                raise ValueError("by='time' needs ns_per_col > 0")
            self.width = float(ns_per_col)
        self._amap = _AddressMap(_parse_address_space(address_space))
        self.row_edges = np.linspace(0.0, float(self._amap.total), self.rows + 1)
        self.regions = self._amap.regions()
        self.device = device
        self.keep_cols = keep_cols
        self.t0 = None if t0_ns is None else int(t0_ns)
        self.n_events = 0          # events seen
        self.n_cols = 0            # columns completed
        self.first_col = 0         # index of the oldest column kept
        self._chunks: list[np.ndarray] = []
        self._values: np.ndarray | None = None
        # pending alloc/free rows: event index, time, kind, ptr, size, device
        self._pend = {k: np.empty(0, dtype=np.int64) for k in ("i", "t", "k", "p", "s", "d")}
        # live allocations carried over: ptr, device, start offset, end offset, start
        self._live = {k: np.empty(0, dtype=np.int64) for k in ("p", "d", "x0", "x1")}
        self._live_t = np.empty(0, dtype=np.float64)
        self.outside = 0
        self._last_t: int | None = None

    # -- properties ------------------------------------------------------------------------
    @property
    def values(self) -> np.ndarray:
        """Every kept column so far, (rows, n_kept)."""
        if self._values is None:
            self._values = (np.hstack(self._chunks) if self._chunks
                            else np.zeros((self.rows, 0)))
            self._chunks = [self._values] if self._chunks else []
        return self._values

    @property
    def col_edges(self) -> np.ndarray:
        """Edges of the kept columns (event index or time_ns)."""
        edges = self.width * np.arange(self.first_col, self.n_cols + 1, dtype=np.float64)
        return edges if self.by == "event" else edges + (self.t0 or 0)

    def heatmap(self) -> Heatmap:
        """The kept columns as a :class:`Heatmap`."""
        return Heatmap(self.values.copy(), self.row_edges.copy(), self.col_edges,
                       list(self.regions), self.by, self.outside)

    # -- feeding ---------------------------------------------------------------------------
    def add_events(self, columns: Any, now_ns: int | None = None) -> np.ndarray:
        """Take a batch of events; return the columns it completed, (rows, k).

        Parameters
        ----------
        columns : Trace or dict of numpy arrays
            Event columns (a Recorder batch, a Trace slice...), in order.
        now_ns : int, optional
            Time mode: the current time (columns ending at or before it complete); default
            the batch's last event time.
        """
        if isinstance(columns, Trace):
            columns = columns.columns
        kind = np.asarray(columns["kind"])
        mask = None
        if self.device is not None:
            mask = np.asarray(columns["device"]) == self.device
            kind = kind[mask]

        def col(name: str) -> np.ndarray:
            v = np.asarray(columns[name])
            return v[mask] if mask is not None else v

        n = len(kind)
        t = col("time_ns").astype(np.int64)
        if n and self.t0 is None:
            self.t0 = int(t[0])
        if n:
            self._last_t = int(t[-1])
        if self.t0 is not None:
            t = t - self.t0  # relative, exact: epoch nanoseconds do not fit float64
        af = np.flatnonzero((kind == _ALLOC) | (kind == _FREE))
        if len(af):
            new = {"i": self.n_events + af, "t": t[af], "k": kind[af].astype(np.int64),
                   "p": col("ptr")[af].astype(np.int64), "s": col("size")[af].astype(np.int64),
                   "d": col("device")[af].astype(np.int64)}
            self._pend = {k: np.concatenate([self._pend[k], new[k]]) for k in new}
        self.n_events += n
        if self.by == "event":
            done = int(self.n_events // self.width)
        else:
            now = now_ns if now_ns is not None else self._last_t
            if now is None or self.t0 is None:
                return np.zeros((self.rows, 0))
            done = int(np.floor(float(int(now) - self.t0) / self.width))
        return self._complete(max(done, self.n_cols))

    def flush(self, now_ns: int | None = None) -> np.ndarray:
        """Complete the columns that end by ``now_ns`` (time mode; default the last event's
        time) or by the events seen (event mode); return them."""
        return self.add_events({k: np.empty(0, dtype=np.int64) for k in
                                ("kind", "time_ns", "ptr", "size", "device")}, now_ns=now_ns)

    def _complete(self, upto: int) -> np.ndarray:
        c0 = self.n_cols
        k = upto - c0
        if k <= 0:
            return np.zeros((self.rows, 0))
        w = self.width
        lo = c0 * w  # event index, or ns after t0
        hi = upto * w
        pend = self._pend
        key = pend["i"] if self.by == "event" else pend["t"]
        take = key < hi
        now = {k_: v[take] for k_, v in pend.items()}
        self._pend = {k_: v[~take] for k_, v in pend.items()}

        live = self._live
        m = len(live["p"])
        # carried allocations act as alloc rows before every new row
        kinds = np.concatenate([np.full(m, _ALLOC, dtype=np.int64), now["k"]])
        ptrs = np.concatenate([live["p"], now["p"]])
        devs = np.concatenate([live["d"], now["d"]])
        a_rows, a_end, _, _ = _pair(kinds, ptrs, devs)
        total = len(kinds)
        tkey = (now["i"] if self.by == "event" else now["t"]).astype(np.float64)
        start_all = np.concatenate([self._live_t, tkey])
        end_all = np.concatenate([np.full(m, np.nan), tkey])
        is_new = a_rows >= m
        j = a_rows - m
        # offsets: carried ones are known, new ones are mapped now
        x0 = np.empty(len(a_rows), dtype=np.int64)
        x1 = np.empty(len(a_rows), dtype=np.int64)
        ok = np.ones(len(a_rows), dtype=bool)
        x0[~is_new] = live["x0"][a_rows[~is_new]]
        x1[~is_new] = live["x1"][a_rows[~is_new]]
        if is_new.any():
            s, e, inside = self._amap.map(now["p"][j[is_new]], now["s"][j[is_new]])
            x0[is_new], x1[is_new], ok[is_new] = s, e, inside
            self.outside += int((~inside).sum())
        t_start = start_all[a_rows]
        ended = a_end < total
        t_end = np.where(ended, end_all[np.minimum(a_end, total - 1)], hi)
        row_h = self._amap.total / self.rows if self._amap.total else 1.0
        sel = ok
        values = _coverage(x0[sel] / row_h, x1[sel] / row_h, (t_start[sel] - lo) / w,
                           (t_end[sel] - lo) / w, self.rows, k)
        still = ok & ~ended
        self._live = {"p": ptrs[a_rows[still]], "d": devs[a_rows[still]], "x0": x0[still],
                      "x1": x1[still]}
        self._live_t = t_start[still]
        self.n_cols = upto
        self._chunks.append(values)
        self._values = None
        if self.keep_cols is not None and self.n_cols - self.first_col > self.keep_cols:
            allv = self.values
            drop = allv.shape[1] - self.keep_cols
            self._chunks = [allv[:, drop:]]
            self._values = None
            self.first_col += drop
        return values

    def __repr__(self) -> str:
        return (f"HeatmapBuilder(rows={self.rows}, by={self.by!r}, cols={self.n_cols}, "
                f"events={self.n_events}, live={len(self._live['p'])})")


# =============================================================================== allocator state
def _analysis_settings(trace: Trace, options: Any, device: int | None) -> dict[str, Any]:
    """The trace's own settings (from its metadata), overridden by ``options``; where the
    model takes no ``GPUOptions`` (PyTorch's), a dict of its replay settings, and the
    trace's calls replayed under them."""
    model = _model(trace, options, {})
    if not model.gpu_options:
        opts = dict(options) if isinstance(options, Mapping) else {}
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(f"options for a trace of {model.title} must be a dict of replay "
                              f"settings; got {options!r}")
        opts["exact"] = False
        if device is not None:
            opts["device"] = device
        return resolve_settings(trace, opts)
    merged: dict[str, Any] = trace_settings(trace, device)
    if options is None:
        pass
    elif isinstance(options, GPUOptions):
        merged.update({v: getattr(options, k) for k, v in _FROM_GPU_OPTIONS.items()})
        merged.pop("memory_limit", None)
    elif isinstance(options, Mapping):
        opts = dict(options)
        if ("fraction" in opts or "per_process_gpu_memory_fraction" in opts) \
                and "memory_limit" not in opts:
            merged.pop("memory_limit", None)
        merged.update(opts)
    else:
        raise ConfigError(f"options must be a GPUOptions or a dict; got {options!r}")
    if device is not None:
        merged["device"] = device
    return resolve_settings(trace, merged)


# Copying a checkpoint costs about as much as replaying this many calls.
_RESTORE_COST_CALLS = 512


class StateScrubber:
    """The allocator's state at any event of a trace, fast enough to scrub back and forth.

    Parameters
    ----------
    trace : Trace
    checkpoint_every : int, optional
        Keep a copy of the allocator every this many calls (made as replay first passes
        them). Default: 1024, or more for long traces so that at most 256 copies are kept.
    device : int, optional
        Which device; default the first.
    options : GPUOptions or dict, optional
        Settings over the trace's own (see :func:`state_at`).

    Notes
    -----
    One live allocator replays forward when moving forward. Moving backward (or forward past
    a checkpoint) restarts from a copy of the nearest checkpoint at or before the target
    (the allocator's whole state: chunks, bins, regions, counters, and the simulated
    device's blocks), so once replay has passed a point any move costs at most
    ``checkpoint_every`` calls plus a copy and a snapshot. Where the allocator cannot be
    copied (unknown state in a newer BFCAllocator) it falls back to replaying from the
    start.
    """

    def __init__(self, trace: Trace, *, checkpoint_every: int | None = None,
                 device: int | None = None, options: Any = None) -> None:
        self.trace = trace
        self.settings = _analysis_settings(trace, options, device)
        calls = trace.calls(self.settings["device"])
        if checkpoint_every is None:
            checkpoint_every = max(1024, -(-len(calls) // 256))
        self.checkpoint_every = int(checkpoint_every)
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1; got {checkpoint_every}")
        op, key, nbytes, streams, _, rows = _model_calls(trace, self.settings, with_rows=True)
        self._rows = rows
        self._lists = (op.tolist(), key.tolist(), nbytes.tolist())
        self._streams = streams
        self._engine = self._fresh()
        self._checkpoints: dict[int, _Engine] = {}
        self._can_clone = True
        self._save_checkpoint()

    def _fresh(self) -> _Engine:
        return _Engine(self.settings, *self._lists, streams=self._streams)

    def _save_checkpoint(self) -> None:
        eng = self._engine
        if not self._can_clone or eng.pos in self._checkpoints:
            return
        try:
            self._checkpoints[eng.pos] = eng.clone()
        except NotImplementedError:
            self._can_clone = False
            self._checkpoints.clear()

    def __len__(self) -> int:
        return len(self.trace)

    @property
    def calls(self) -> int:
        """Calls in the replay."""
        return len(self._rows)

    @property
    def position(self) -> int:
        """Calls made so far by the live allocator."""
        return self._engine.pos

    def _calls_through(self, index: int) -> int:
        n = len(self.trace)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"event index {index} out of range for a trace of {n} events")
        return int(np.searchsorted(self._rows, i, side="right"))

    def goto_call(self, ncalls: int) -> None:
        """Move the live allocator to the state after ``ncalls`` calls."""
        ncalls = max(0, min(int(ncalls), self.calls))
        eng = self._engine
        best = -1
        if self._can_clone and self._checkpoints:
            best = max((k for k in self._checkpoints if k <= ncalls), default=-1)
        if ncalls < eng.pos or best - eng.pos > _RESTORE_COST_CALLS:
            # back, or far forward past a checkpoint: restart from a copy of the nearest one
            eng = self._checkpoints[best].clone() if best >= 0 else self._fresh()
            self._engine = eng
        k = self.checkpoint_every
        while eng.pos < ncalls:
            nxt = min(ncalls, (eng.pos // k + 1) * k)
            eng.run_to(nxt)
            if eng.pos % k == 0:
                self._save_checkpoint()

    def state_at(self, index: int) -> MemoryDump:
        """The state right after event ``index`` (see :func:`state_at`)."""
        self.goto_call(self._calls_through(index))
        row = int(index) + len(self.trace) if int(index) < 0 else int(index)
        return _with_seq(self._engine.dump(), self.trace, row)

    __getitem__ = state_at

    def stats_at(self, index: int) -> AllocatorStats:
        """Only the statistics after event ``index`` (cheaper than a full snapshot)."""
        self.goto_call(self._calls_through(index))
        return self._engine.alloc.stats()

    def __repr__(self) -> str:
        return (f"StateScrubber(events={len(self.trace)}, calls={self.calls}, "
                f"position={self.position}, checkpoints={len(self._checkpoints)})")


def state_at(trace: Trace, index: int, *, options: Any = None,
             device: int | None = None) -> MemoryDump:
    """The allocator's state right after event ``index``.

    Parameters
    ----------
    trace : Trace
    index : int
        A row of the trace (negative counts from the end).
    options : GPUOptions or dict, optional
        Replay settings (``device_bytes``, ``memory_limit``, ``fraction``,
        ``allow_growth``, ``garbage_collection``, ``fragmentation_fraction``,
        ``deferred_deletion_bytes``) over those the trace records in ``meta["devices"]``
        (capacity, memory limit, allow_growth, garbage_collection); where it records none,
        :func:`~gpudash.trace.replay.replay`'s defaults.
    device : int, optional
        Which device; default the first.

    Returns
    -------
    MemoryDump
        Chunks, bins, regions and stats of a fresh allocator of the trace's model (BFC; for
        a PyTorch trace PyTorch's caching allocator, its pools as the dump's bins) on a
        simulated device that made every call (alloc, free, refused alloc, and for PyTorch
        the ``empty_cache()`` calls its releases show) of the trace at or before row
        ``index``, with ``seq`` set to the seq of the trace's next event. For a trace
        gpudash recorded this is the recorded allocator's state. The
        split, merge and extend rows that accompany a call are applied with it: the state
        after an extend or split row is the state before the alloc row that follows it.

    See Also
    --------
    StateScrubber : many indices, back and forth.
    """
    settings = _analysis_settings(trace, options, device)
    op, key, nbytes, streams, _, rows = _model_calls(trace, settings, with_rows=True)
    n = len(trace)
    i = int(index) + n if int(index) < 0 else int(index)
    if not 0 <= i < n:
        raise IndexError(f"event index {index} out of range for a trace of {n} events")
    stop = int(np.searchsorted(rows, i, side="right"))
    eng = _Engine(settings, op[:stop].tolist(), key[:stop].tolist(), nbytes[:stop].tolist(),
                  streams=None if streams is None else streams[:stop])
    eng.run_to(stop)
    return _with_seq(eng.dump(), trace, i)


def _with_seq(dump: MemoryDump, trace: Trace, row: int) -> MemoryDump:
    """The dump with ``seq`` = the seq the trace's next event has (its row's seq + 1)."""
    return dataclasses.replace(dump, seq=int(trace.columns["seq"][row]) + 1)


def chunk_map_at_peak(trace: Trace, *, options: Any = None,
                      device: int | None = None) -> MemoryDump:
    """The allocator's state at the event of peak bytes in use (the first such event).

    The peak is found in the trace itself (``in_use`` of :func:`fragmentation_series`, the
    running sum of live allocation sizes); the state comes from :func:`state_at`.
    """
    tr = _as_trace(trace)
    dev = _pick_device(tr, device)
    cols, rows = _device_rows(tr, dev)
    kind = cols["kind"]
    size = cols["size"]
    _, _, f_rows, f_alloc = _pair(kind, cols["ptr"], cols["device"])
    delta = np.where(kind == _ALLOC, size, 0).astype(np.int64)
    ok = f_alloc >= 0
    delta[f_rows[ok]] -= size[f_alloc[ok]]
    if len(delta) == 0:
        raise ValueError("the trace has no events for this device")
    peak_row = int(rows[int(np.argmax(np.cumsum(delta)))])
    return state_at(tr, peak_row, options=options, device=dev)


def bin_occupancy(dump: MemoryDump) -> dict[str, np.ndarray]:
    """A dump's bins as numpy columns (one entry per bin, 21 bins).

    Returns
    -------
    dict of numpy.ndarray of int64
        ``bin``, ``bin_size`` (smallest chunk size of the bin), ``free_chunks`` and
        ``free_bytes`` (free chunks sitting in the bin), ``in_use_chunks``,
        ``in_use_bytes`` and ``requested_bytes`` (chunks in use whose size maps to the bin,
        as TensorFlow's ``MemoryDump`` buckets them), ``total_chunks`` and ``total_bytes``.
    """
    bins = dump.bins
    get = lambda attr: np.array([getattr(b, attr) for b in bins], dtype=np.int64)  # noqa: E731
    return {
        "bin": get("bin"),
        "bin_size": get("bin_size"),
        "free_chunks": get("free_chunks"),
        "free_bytes": get("free_bytes"),
        "in_use_chunks": get("total_chunks_in_use"),
        "in_use_bytes": get("total_bytes_in_use"),
        "requested_bytes": get("total_requested_bytes_in_use"),
        "total_chunks": get("total_chunks_in_bin"),
        "total_bytes": get("total_bytes_in_bin"),
    }

