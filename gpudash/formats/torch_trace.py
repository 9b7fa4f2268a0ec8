"""One device's PyTorch trace as arrays, and what a snapshot says existed before it.

The data side of PyTorch's snapshots, shared by the importer
(:mod:`gpudash.formats.torch_snapshot`) and exact replay (:mod:`gpudash.trace.torch_replay`):

- :class:`TorchTrace`: a device's ``device_traces`` entries as numpy columns (action codes
  :data:`ACTIONS`, addresses, sizes, streams) with the final segments and settings;
  :func:`from_snapshot` (a snapshot dict) and :func:`from_trace` (an imported trace, or a
  ``.gdtrace`` saved from one) make them;
- :func:`start_state`: what existed when the trace began (PyTorch keeps the last
  ``max_entries`` events, so a trace can start mid-run): the final segments walked back over
  the trace, as MemoryViz does; :class:`StartSegment` per segment or mapped range;
- the final segments in a compact, JSON-friendly form (:func:`compact_segments`,
  :func:`expand_segments`), as an imported trace keeps them in ``meta["torch"]``;
- :func:`read_entries`: a device's entries as numpy columns (:class:`Entries`) in bulk, a
  few thousand at a time, checked as the importer checks them, with their call stacks
  interned on the way (:class:`StackInterner`) and, for a snapshot the importer loaded
  itself, each chunk released once read.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import reprlib
from bisect import bisect_left, bisect_right
from itertools import repeat
from typing import Any

import numpy as np

from .._errors import TraceFormatError
from .._torch_conf import CachingAllocatorConfig, parse_torch_version
from ..caching import K_MIN_BLOCK_SIZE, K_SMALL_SIZE, round_size
from ..events import EventKind
from .stacks import Frame, Stack, StackTable

__all__ = ["TorchTrace", "StartSegment", "from_snapshot", "from_trace", "start_state",
           "compact_segments", "expand_segments", "ACTIONS", "ACTION_NAMES", "guess_version"]

ACTION_NAMES = ("", "alloc", "free_requested", "free_completed", "segment_alloc",
                "segment_free", "segment_map", "segment_unmap", "oom", "snapshot",
                "user_defined")
ACTIONS = {name: i for i, name in enumerate(ACTION_NAMES) if name}
A_ALLOC, A_FREE_REQ, A_FREE, A_SEG_ALLOC, A_SEG_FREE, A_MAP, A_UNMAP, A_OOM = range(1, 9)
_SEGMENT_ACTIONS = (A_SEG_ALLOC, A_SEG_FREE, A_MAP, A_UNMAP)
_RELEASES = (A_SEG_FREE, A_UNMAP)
_GETS = (A_SEG_ALLOC, A_MAP)
_MASK64 = (1 << 64) - 1
_MAX_DEVICE = (1 << 15) - 1   # a trace's device column is int16


# ---------------------------------------------------------------------------------- input
@dataclasses.dataclass(eq=False)
class TorchTrace:
    """One device's PyTorch trace as arrays, with what else the snapshot says.

    Attributes
    ----------
    device : int
    action : numpy.ndarray of int8
        :data:`ACTIONS` codes.
    addr, size, stream : numpy.ndarray of int64
        As the entries hold them (``addr`` is ``device_free`` for ``oom``; ``size`` is the
        request for ``alloc``, the rounded request for ``oom``); streams as unsigned values
        in an int64 array.
    final : list of dict or None
        The snapshot's final segments of this device (PyTorch's dicts), or None.
    settings : dict or None
        ``allocator_settings`` (PyTorch 2.4 on).
    version : tuple of int
        The PyTorch version the snapshot's layout points to.
    rows : numpy.ndarray of int64 or None
        The row of each entry in the :class:`~gpudash.trace.Trace` it was read from
        (:func:`from_trace`; None from a snapshot dict).
    """

    device: int
    action: np.ndarray
    addr: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    final: list[dict] | None = None
    settings: dict | None = None
    version: tuple[int, int] = (2, 11)
    rows: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.action)


def guess_version(snap: dict) -> tuple[int, int]:
    """The oldest PyTorch whose snapshot layout matches: ``allocator_settings`` -> 2.4,
    ``time_us`` -> 2.2, ``requested_size``/``is_expandable`` -> 2.1, ``history`` -> 2.0,
    else 1.13. Newer versions decide the same way where it matters for a replay, so the
    oldest consistent one is a safe guess; pass ``version=`` when known."""
    if snap.get("allocator_settings"):
        return (2, 4)
    traces = snap.get("device_traces") or []
    for lst in traces:
        for e in (lst or [])[:1]:
            if isinstance(e, dict) and "time_us" in e:
                return (2, 2)
    segs = snap.get("segments") or []
    for seg in segs[:1]:
        if isinstance(seg, dict):
            if "is_expandable" in seg or "requested_size" in seg:
                return (2, 1)
            blocks = seg.get("blocks") or []
            if blocks and isinstance(blocks[0], dict) and "history" in blocks[0]:
                return (2, 0)
    return (1, 13)


def from_snapshot(snap: dict, name: str = "<snapshot>") -> dict[int, TorchTrace]:
    """Every device of a loaded snapshot dict (``load_torch_snapshot_dict``) as a
    :class:`TorchTrace`, by device index (devices with a trace or segments)."""
    traces = snap.get("device_traces") or []
    segments = snap.get("segments") or []
    if not isinstance(traces, list) or not isinstance(segments, list):
        raise TraceFormatError(f"{name}: 'segments' and 'device_traces' must be lists")
    settings = snap.get("allocator_settings") if isinstance(
        snap.get("allocator_settings"), dict) else None
    version = guess_version(snap)
    final: dict[int, list[dict]] = {}
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict):
            raise TraceFormatError(f"{name}: segments[{i}] is not a dict")
        final.setdefault(_as_int(seg.get("device", 0), f"{name}: segments[{i}].device"),
                         []).append(seg)
    out: dict[int, TorchTrace] = {}
    devices = set(final) | {d for d, lst in enumerate(traces) if lst}
    for d in sorted(devices):
        lst = traces[d] if d < len(traces) and traces[d] else []
        n = len(lst)
        action = np.zeros(n, dtype=np.int8)
        addr = np.zeros(n, dtype=np.int64)
        size = np.zeros(n, dtype=np.int64)
        stream = np.zeros(n, dtype=np.int64)
        for i, e in enumerate(lst):
            where = f"{name}: device_traces[{d}][{i}]"
            if not isinstance(e, dict):
                raise TraceFormatError(f"{where}: not a dict")
            code = ACTIONS.get(e.get("action"), 0)
            action[i] = code
            if not code or code >= 9:
                continue
            a = e.get("device_free" if code == A_OOM else "addr", 0)
            addr[i] = _as_int(a if a is not None else 0, where + ".addr", signed=True)
            size[i] = _as_int(e.get("size"), where + ".size")
            s = e.get("stream", 0)
            s = _as_int(s if s is not None else 0, where + ".stream", signed=True) & _MASK64
            stream[i] = s - (1 << 64) if s >= 1 << 63 else s
        out[d] = TorchTrace(d, action, addr, size, stream, final.get(d), settings, version)
    return out


def from_trace(trace: Any, device: int | None = None) -> TorchTrace:
    """One device of a :class:`~gpudash.trace.Trace` as a :class:`TorchTrace`.

    A trace imported from a PyTorch snapshot keeps what an exact replay needs: its entries
    (the rows after the rebuilt starting state, ``meta["torch"]["prefix"]``), their streams
    and the final segments (``meta["torch"]["final"]``). Any other trace is read from its
    events: ``extend``/``release`` become ``segment_alloc``/``segment_free`` (or
    ``segment_map``/``segment_unmap`` under ``expandable_segments:True``), with no final
    layout to compare.
    """
    c = trace.columns
    devs = np.unique(c["device"]).tolist()
    if device is None:
        device = int(devs[0]) if devs else 0
    torch_meta = trace.meta.get("torch") if isinstance(trace.meta.get("torch"), dict) else {}
    rows = np.flatnonzero(c["device"] == device)
    prefix = torch_meta.get("prefix", {}).get(str(device), 0) if isinstance(
        torch_meta.get("prefix"), dict) else 0
    if isinstance(prefix, int) and 0 < prefix <= len(rows):
        rows = rows[prefix:]
    kind = c["kind"][rows]
    settings = trace.meta.get("allocator_settings") if isinstance(
        trace.meta.get("allocator_settings"), dict) else None
    expandable = bool(settings and settings.get("expandable_segments") is True)
    action = np.zeros(len(rows), dtype=np.int8)
    action[kind == int(EventKind.ALLOC)] = A_ALLOC
    action[kind == int(EventKind.FREE)] = A_FREE
    action[kind == int(EventKind.EXTEND)] = A_MAP if expandable else A_SEG_ALLOC
    action[kind == int(EventKind.RELEASE)] = A_UNMAP if expandable else A_SEG_FREE
    action[kind == int(EventKind.OOM)] = A_OOM
    addr = c["ptr"][rows].copy()
    size = c["size"][rows].copy()
    req = c["requested"][rows]
    asks = (action == A_ALLOC) | (action == A_FREE) | (action == A_OOM)
    size[asks] = req[asks]              # PyTorch's entries carry the request
    oom_free = trace.meta.get("oom_device_free")
    if isinstance(oom_free, list):
        where = {int(r): int(b) for r, b in (x for x in oom_free
                                             if isinstance(x, list) and len(x) == 2)}
        for k in np.flatnonzero(action == A_OOM).tolist():
            addr[k] = where.get(int(rows[k]), 0)
    keep = action != 0
    final = None
    compact = torch_meta.get("final", {}).get(str(device)) if isinstance(
        torch_meta.get("final"), dict) else None
    if isinstance(compact, list):
        final = expand_segments(compact, device)
    try:
        version = parse_torch_version(torch_meta.get("version") or None)
    except Exception:
        version = parse_torch_version(None)
    return TorchTrace(device, action[keep], addr[keep], size[keep],
                      trace.streams()[rows][keep], final, settings, version, rows[keep])


def _as_int(value: Any, where: str, signed: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where}: expected an integer, found {_short(value)}")
    if not signed and value < 0:
        what = where.rsplit(".", 1)[-1]
        raise TraceFormatError(f"{where}: a negative {what} ({_short(value)}); expected an integer "
                               f">= 0")
    return value


def _u64(v: int) -> int:
    return v & _MASK64


def _earliest_at_each_address(act: np.ndarray, addr: np.ndarray, a: int, b: int
                              ) -> np.ndarray:
    """The index of the earliest entry of action ``a`` or ``b`` at each address."""
    idx = np.flatnonzero((act == a) | (act == b))
    if not len(idx):
        return idx
    _, first = np.unique(addr[idx], return_index=True)
    return idx[first]


def _starts_empty(tt: TorchTrace) -> bool:
    """The trace starts from an empty allocator: every free follows its alloc, every final
    allocated block and segment was made in the trace (the validation plan's step 2)."""
    act, addr, size = tt.action, tt.addr, tt.size
    live = segs = None
    for made, gone in ((A_ALLOC, A_FREE), (A_SEG_ALLOC, A_SEG_FREE)):
        # at each address, each free must come right after an alloc there
        idx = np.flatnonzero((act == made) | (act == gone))
        order = idx[np.lexsort((idx, addr[idx]))]
        a, k = addr[order], act[order]
        first = np.ones(len(order), dtype=bool)
        first[1:] = a[1:] != a[:-1]
        prev_made = np.zeros(len(order), dtype=bool)
        prev_made[1:] = k[:-1] == made
        if ((k == gone) & (first | ~prev_made)).any():
            return False
        last = np.ones(len(order), dtype=bool)
        last[:-1] = first[1:]
        alive = set(a[last & (k == made)].tolist())
        if made == A_ALLOC:
            live = alive
        else:
            segs = alive
    mapped = _Ranges()
    for k in np.flatnonzero((act == A_MAP) | (act == A_UNMAP)).tolist():
        lo, hi = int(addr[k]), int(addr[k]) + int(size[k])
        if act[k] == A_MAP:
            mapped.add(lo, hi)
        else:
            if not mapped.covers(lo, hi):
                return False
            mapped.sub(lo, hi)
    for seg in tt.final or ():
        base = seg["address"]
        if seg.get("is_expandable"):
            if not mapped.covers(base, base + seg["total_size"]):
                return False
        elif base not in segs:
            return False
        for blk, baddr in _blocks_of(seg):
            if _state(blk).startswith("active") and baddr not in live:
                return False
    return True


class _Ranges:
    """Disjoint address ranges ``[lo, hi)``, sorted, with adjacent ones joined: what an
    expandable segment has mapped. Adding or removing a range costs a bisect plus the
    ranges it touches, so a trace of many maps and unmaps is read in n log n."""

    __slots__ = ("lo", "hi")

    def __init__(self, ranges: Any = ()) -> None:
        self.lo: list[int] = []
        self.hi: list[int] = []
        for lo, hi in sorted(ranges):
            self.add(lo, hi)

    def add(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        i = bisect_left(self.hi, lo)           # first range ending at or after lo
        j = bisect_right(self.lo, hi)          # ranges starting at or before hi
        if i < j:
            lo = min(lo, self.lo[i])
            hi = max(hi, self.hi[j - 1])
        self.lo[i:j] = [lo]
        self.hi[i:j] = [hi]

    def sub(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        i = bisect_right(self.hi, lo)          # first range ending after lo
        j = bisect_left(self.lo, hi)           # ranges starting before hi
        if i >= j:
            return
        keep_lo, keep_hi = [], []
        if self.lo[i] < lo:
            keep_lo.append(self.lo[i])
            keep_hi.append(lo)
        if self.hi[j - 1] > hi:
            keep_lo.append(hi)
            keep_hi.append(self.hi[j - 1])
        self.lo[i:j] = keep_lo
        self.hi[i:j] = keep_hi

    def covers(self, lo: int, hi: int) -> bool:
        i = bisect_right(self.lo, lo) - 1
        return i >= 0 and self.hi[i] >= hi

    def items(self) -> list[tuple[int, int]]:
        return list(zip(self.lo, self.hi))


def _blocks_of(seg: dict):
    addr = seg["address"]
    for blk in seg.get("blocks") or []:
        a = blk.get("address", addr)
        yield blk, a
        addr = a + blk["size"]


def _state(blk: dict) -> str:
    state = blk.get("state")
    if state is None:
        return "active_allocated" if blk.get("allocated") else "inactive"
    return "active_pending_free" if state == "active_awaiting_free" else state


@dataclasses.dataclass
class StartSegment:
    """A segment that existed when a trace began: a cudaMalloc segment, or a mapped range
    of an expandable segment (``expandable``; ``base`` is its reservation's start).
    ``blocks`` are ``(address, size, requested)`` of the blocks allocated then, by address;
    the rest is free. ``freed_at`` is the trace index of the ``segment_free`` that showed
    the segment (-1: it is one of the final segments), ``blocks_freed_at`` the same for each
    block (the index of the ``free_completed`` that freed it; -1: a final block)."""

    address: int
    size: int
    small: bool
    stream: int
    expandable: bool = False
    base: int = 0
    blocks: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    freed_at: int = -1
    blocks_freed_at: list[int] = dataclasses.field(default_factory=list)


def start_state(tt: TorchTrace, conf: CachingAllocatorConfig | None = None
                ) -> tuple[list[StartSegment], dict]:
    """What existed when ``tt`` began, rebuilt from its final segments by walking the trace
    backwards (see the module docstring): the segments (mapped ranges for expandable ones)
    with the blocks allocated in them, and counts ``segments``, ``blocks`` (allocated before
    the trace) and ``guessed`` (of those, sized from their request because the trace freed
    them). Empty for a trace that starts from an empty allocator."""
    conf = conf if conf is not None else (
        CachingAllocatorConfig.from_snapshot_settings(tt.settings, version=tt.version))
    act, addr, size = tt.action, tt.addr, tt.size
    segs: dict[int, dict] = {}
    exp_ranges: list[tuple[int, int, int, bool]] = []   # (lo, hi, stream, small)
    blocks: dict[int, list] = {}   # addr -> [size or None, requested, trace index of free]
    for seg in tt.final or ():
        strm = _u64(seg.get("stream", 0) or 0)
        small = seg.get("segment_type") == "small"
        if seg.get("is_expandable"):
            exp_ranges.append((seg["address"], seg["address"] + seg["total_size"], strm, small))
        else:
            segs[seg["address"]] = {"size": seg["total_size"], "small": small, "stream": strm}
        for blk, baddr in _blocks_of(seg):
            if _state(blk).startswith("active"):
                req = blk.get("requested_size")
                if req is None:
                    hist = blk.get("history") or []
                    req = hist[-1].get("real_size") if hist else None
                blocks[baddr] = [blk["size"], int(req or blk["size"]), -1]
    # Walking the trace backwards, what is at an address before the trace is decided by the
    # earliest entry there: an alloc (or segment_alloc) means nothing was, a free (or
    # segment_free) that something was; no entry, that the final state's was.
    for made, gone in ((A_ALLOC, A_FREE), (A_SEG_ALLOC, A_SEG_FREE)):
        ks = _earliest_at_each_address(act, addr, made, gone)
        table = blocks if made == A_ALLOC else segs
        if len(ks) and table:
            touched = set(addr[ks].tolist())
            for a in [a for a in table if a in touched]:
                del table[a]
        for k in ks[act[ks] == gone].tolist():
            a, sz = int(addr[k]), int(size[k])
            if made == A_ALLOC:
                blocks[a] = [None, sz, k]
            else:   # a segment of 2 MiB is the small pool's (large segments are >= 10 MiB)
                segs[a] = {"size": sz, "small": sz == (2 << 20),
                           "stream": _u64(int(tt.stream[k])), "freed_at": k}
    mapped = _Ranges((lo, hi) for lo, hi, _, _ in exp_ranges)
    for k in np.flatnonzero((act == A_MAP) | (act == A_UNMAP))[::-1].tolist():
        lo, hi = int(addr[k]), int(addr[k]) + int(size[k])
        if act[k] == A_MAP:
            mapped.sub(lo, hi)
        else:
            mapped.add(lo, hi)
    starts = sorted(blocks)
    counts = {"segments": 0, "blocks": 0, "guessed": 0}
    # allocations by address, with their trace index: evidence of where free blocks began
    lazy: list = []

    def first_alloc_in(lo: int, hi: int, before: int) -> int | None:
        """The address of the earliest allocation (before trace index ``before``) in
        [lo, hi): where the free block there began (an allocation takes the front)."""
        if not lazy:
            ai = np.flatnonzero(act == A_ALLOC)
            order = np.lexsort((ai, addr[ai]))
            lazy.extend((addr[ai][order], ai[order]))
        alloc_addrs, alloc_ks = lazy
        ks = alloc_ks[np.searchsorted(alloc_addrs, lo):np.searchsorted(alloc_addrs, hi)]
        ks = ks[ks < before]
        return None if not len(ks) else int(addr[ks.min()])

    def blocks_in(lo: int, hi: int, small: bool, expandable: bool,
                  freed: list[int]) -> list[tuple[int, int, int]]:
        """The allocated blocks of [lo, hi), with their sizes (and, into ``freed``, the trace
        index of the free of each, -1 for a final block)."""
        out = []
        k = bisect_left(starts, lo)
        inside = []
        while k < len(starts) and starts[k] < hi:
            inside.append(starts[k])
            k += 1
        for j, b0 in enumerate(inside):
            sz, req, freed_at = blocks[b0]
            nxt = inside[j + 1] if j + 1 < len(inside) else hi
            if sz is None:
                # freed in the trace: its size is the request rounded, unless the allocator
                # did not split off what was left. The trace may say where the free space
                # after it began (its first allocation there); else what is left before the
                # next boundary decides (too little to split: the block owns it)
                counts["guessed"] += 1
                sz = round_size(req, conf)
                keep = K_MIN_BLOCK_SIZE if (small or expandable) else K_SMALL_SIZE + 1
                mss = conf.max_split_size
                start = first_alloc_in(b0 + sz, nxt, freed_at)
                if start is not None and start - (b0 + sz) < keep:
                    sz = start - b0
                elif start is None and (nxt - (b0 + sz) < keep or
                                        (mss is not None and sz >= mss and not expandable)):
                    sz = nxt - b0
            sz = min(sz, nxt - b0)
            out.append((b0, sz, min(req, sz) or sz))
            freed.append(freed_at)
            counts["blocks"] += 1
        return out

    out: list[StartSegment] = []
    for base in sorted(segs):
        info = segs[base]
        freed: list[int] = []
        out.append(StartSegment(base, info["size"], info["small"], info["stream"],
                                blocks=blocks_in(base, base + info["size"], info["small"],
                                                 False, freed),
                                freed_at=info.get("freed_at", -1), blocks_freed_at=freed))
        counts["segments"] += 1
    # expandable segments: one reservation per (stream, pool), based at its lowest mapped
    # range (the allocator maps a reservation from its start upward)
    groups: dict[tuple[int, bool], list[tuple[int, int]]] = {}
    final_lo = sorted((lo, hi, st, sm) for lo, hi, st, sm in exp_ranges)
    final_starts = [x[0] for x in final_lo]
    for lo, hi in mapped.items():
        k = bisect_right(final_starts, lo) - 1
        owner = (final_lo[k][2], final_lo[k][3]) if k >= 0 and lo < final_lo[k][1] \
            else (0, False)
        groups.setdefault(owner, []).append((lo, hi))
    for (strm, small), ranges in sorted(groups.items()):
        ranges.sort()
        for lo, hi in ranges:
            freed = []
            out.append(StartSegment(lo, hi - lo, small, strm, True, ranges[0][0],
                                    blocks_in(lo, hi, small, True, freed),
                                    blocks_freed_at=freed))
        counts["segments"] += 1
    _check_start(out, tt)
    return out, counts


def _check_start(state: list[StartSegment], tt: TorchTrace) -> None:
    """Refuse a starting state no allocator could have had: an empty segment, or two that
    overlap. It comes from trace entries that do not fit the snapshot's segments (a
    ``segment_free`` or ``segment_unmap`` inside a segment that lives on, of no size...);
    the error names the entry and what the other segment held there."""
    spans = sorted(state, key=lambda seg: (seg.address, seg.size))
    for k, seg in enumerate(spans):
        if seg.size <= 0:
            raise TraceFormatError(
                f"{_origin(seg, tt)} says a segment of {seg.size} bytes existed at "
                f"{seg.address:#x} before the trace: PyTorch never makes or returns an empty "
                "segment; the trace does not fit the snapshot")
        if k and spans[k - 1].address + spans[k - 1].size > seg.address:
            a, b = spans[k - 1], seg
            if a.freed_at < 0 and not a.expandable and (b.freed_at >= 0 or b.expandable):
                a, b = b, a   # name the trace's entry first where one of them is the trace's
            at = max(a.address, b.address)
            raise TraceFormatError(
                f"{_origin(a, tt)} does not fit the snapshot: before the trace it needs "
                f"{_describe(a)}, which overlaps {_describe(b)} ({_origin(b, tt)}); at "
                f"{at:#x} that segment held {_held(b, at)}. A device never hands out one "
                "range twice: the trace or the segments are damaged, or come from different "
                "runs")


def _origin(seg: StartSegment, tt: TorchTrace) -> str:
    """Which trace entry (or the snapshot's segments) a starting segment comes from."""
    where = "device_traces[{}][{}]" if tt.rows is None else "trace entry {1} (device {0})"
    if seg.freed_at >= 0:
        k = seg.freed_at
        return (where.format(tt.device, k) + f" ({ACTION_NAMES[int(tt.action[k])]} at "
                f"{int(tt.addr[k]):#x}, {int(tt.size[k])} bytes)")
    if seg.expandable:
        lo, hi = seg.address, seg.address + seg.size
        ks = np.flatnonzero((tt.action == A_UNMAP) & (tt.addr < hi)
                            & (tt.addr + tt.size > lo))
        if len(ks):
            k = int(ks[0])
            return (where.format(tt.device, k) + f" (segment_unmap at {int(tt.addr[k]):#x}, "
                    f"{int(tt.size[k])} bytes)")
    for i, fs in enumerate(tt.final or ()):
        if isinstance(fs, dict) and fs.get("address") is not None and \
                fs["address"] <= seg.address < fs["address"] + (fs.get("total_size") or 0):
            return f"the snapshot's segments[{i}] (at {fs['address']:#x})"
    return f"the snapshot's segment at {seg.address:#x}"


def _describe(seg: StartSegment) -> str:
    kind = "a mapped range of an expandable segment" if seg.expandable else "a segment"
    pool = "small" if seg.small else "large"
    return (f"{kind} at {seg.address:#x}..{seg.address + seg.size:#x} ({seg.size:,} bytes, "
            f"{pool} pool)")


def _held(seg: StartSegment, at: int) -> str:
    for b0, sz, req in seg.blocks:
        if b0 <= at < b0 + sz:
            return (f"an allocated block at {b0:#x} ({sz:,} bytes, {req:,} requested)")
    return "free memory (no block allocated there)"


_STATE_CODES = {"inactive": 0, "active_allocated": 1, "active_pending_free": 2,
                "active_awaiting_free": 2}


def compact_segments(final: list[dict] | None) -> list[list]:
    """A device's final segments, as replay compares them: ``[address, total_size, small,
    expandable, stream, [[size, state, requested], ...]]`` with state 0 inactive, 1
    allocated, 2 pending free (JSON-friendly; :func:`expand_segments` reads it back)."""
    out = []
    for seg in final or ():
        blocks = []
        for blk in seg.get("blocks") or []:
            state = blk.get("state")
            if state is None:
                state = "active_allocated" if blk.get("allocated") else "inactive"
            req = blk.get("requested_size")
            if req is None:
                hist = blk.get("history") or []
                req = hist[-1].get("real_size", 0) if hist and isinstance(hist[-1], dict) else 0
            blocks.append([int(blk["size"]), _STATE_CODES.get(state, 0), int(req or 0)])
        out.append([int(seg["address"]), int(seg["total_size"]),
                    int(seg.get("segment_type") == "small"), int(bool(seg.get("is_expandable"))),
                    int(seg.get("stream") or 0), blocks])
    return out


def expand_segments(compact: list, device: int) -> list[dict]:
    """:func:`compact_segments`' form back as PyTorch's segment dicts."""
    names = {0: "inactive", 1: "active_allocated", 2: "active_pending_free"}
    out = []
    for address, total, small, expandable, stream, blocks in compact:
        addr = address
        bl = []
        for size, state, req in blocks:
            bl.append({"address": addr, "size": size, "requested_size": req,
                       "state": names.get(state, "inactive")})
            addr += size
        out.append({"device": device, "address": address, "total_size": total,
                    "segment_type": "small" if small else "large",
                    "is_expandable": bool(expandable), "stream": stream, "blocks": bl})
    return out




# ------------------------------------------------------------------ reading entries fast
#: Entry codes that become rows of an imported trace.
ROW_CODES = (A_ALLOC, A_FREE, A_SEG_ALLOC, A_SEG_FREE, A_MAP, A_UNMAP, A_OOM)
_ROW_MASK = np.zeros(len(ACTION_NAMES), dtype=bool)
_ROW_MASK[list(ROW_CODES)] = True
_CHECKED_MASK = np.zeros(len(ACTION_NAMES), dtype=bool)   # addr, size, stream are read
_CHECKED_MASK[1:9] = True
_CHUNK = 1 << 12           # entries read (and released) at a time: a few MB, in cache
_CACHE_MAX = 1 << 20       # entries of an id-keyed cache before it is cleared
_MISSING = type("_Missing", (), {"__slots__": (), "__repr__": lambda self: "<missing>"})()
_T_MAX = 1 << 53


class StackInterner:
    """PyTorch's frames as a :class:`~gpudash.formats.stacks.StackTable`, each frame dict and
    each distinct stack read once.

    A pickle shares equal frames as one dict object, but makes a frames list per call, so a
    list is looked up among the distinct stacks with its length and the ``id()`` of three of
    its frames (a bucket), then compared with each list of the bucket (``==``, which finds
    shared frames equal by identity, at C speed); only a list new to the table is read frame
    by frame (frame dicts by ``id()``, then by value). A JSON snapshot, which shares nothing,
    is interned by value the same way. Every object whose ``id()`` is a key belongs to the
    snapshot, and all of them were alive together when it was loaded (a bucket keeps its
    lists), so two of them never share an id, even after some are released.
    """

    __slots__ = ("_buckets", "_by_mid", "_frames", "table")

    def __init__(self) -> None:
        self.table = StackTable()
        self._frames: dict[int, int] = {}          # id(frame dict) -> frame id
        self._buckets: dict[tuple, list] = {}      # (len, ids, cc, um) -> [(list, sid)...]
        # (cc, um) -> {(len, id(middle frame)): (a list, its stack id)}: bulk's first guess
        self._by_mid: dict[tuple, dict[tuple[int, int], tuple[list, int]]] = {}

    def of(self, frames: Any, cc: Any, um: Any, where: str) -> int:
        """The stack id of ``frames`` (PyTorch's frame dicts, innermost first) with a
        compile context and user metadata (-1: no frames and nothing else recorded)."""
        for what, value in (("compile_context", cc), ("user_metadata", um)):
            if value is not None and not isinstance(value, str):
                raise TraceFormatError(f"{where}.{what}: expected a string, found "
                                       f"{type(value).__name__}")
        if frames is not None and not isinstance(frames, (list, tuple)):
            raise TraceFormatError(f"{where}.frames: expected a list of frames, found "
                                   f"{type(frames).__name__}")
        return self.lookup(frames, cc, um, where)

    def lookup(self, frames: list | tuple | None, cc: str | None, um: str | None,
               where: str = "") -> int:
        """:meth:`of` for values whose types are known to be right."""
        n = len(frames) if frames else 0
        key = (n, id(frames[n >> 1]), id(frames[n // 3]), id(frames[-1 - n // 4]), cc, um) \
            if n else (0, cc, um)
        bucket = self._buckets.get(key)
        if bucket is not None:
            for rep, sid in bucket:
                try:
                    if rep == frames:
                        return sid
                except RecursionError:       # nested values no frame has: not this one
                    continue
        else:
            bucket = self._buckets[key] = []
        sid = self._new(frames, cc, um, where)
        bucket.append((frames, sid))
        return sid

    def bulk(self, frames: list, ccs: list, ums: list) -> np.ndarray:
        """:meth:`lookup` of many frames lists (of known types) at once, in C where it can:
        lists with one compile context and user metadata, looked up by their length and
        middle frame, each checked against the list found (``==``); the others, and those
        not found, one by one."""
        m = len(frames)
        out = np.empty(m, dtype=np.int64)
        if not m:
            return out
        one = (len(set(ccs)) == 1 and len(set(ums)) == 1
               and type(None) not in set(map(type, frames)))
        lens = np.fromiter(map(len, frames), np.int64, m) if one else None
        if not one or not lens.all():
            if one:         # empty lists one by one, the rest in bulk
                rest = np.flatnonzero(lens)
                for j in np.flatnonzero(lens == 0).tolist():
                    out[j] = self.lookup(frames[j], ccs[j], ums[j])
                if len(rest):
                    sub = [frames[j] for j in rest.tolist()]
                    out[rest] = self.bulk(sub, [ccs[0]] * len(sub), [ums[0]] * len(sub))
                return out
            out[:] = list(map(self.lookup, frames, ccs, ums))
            return out
        cc, um = ccs[0], ums[0]
        cache = self._by_mid.get((cc, um))
        if cache is None:
            cache = self._by_mid[(cc, um)] = {}
        keys = list(zip(lens.tolist(), map(id, map(operator.getitem, frames,
                                                   (lens >> 1).tolist()))))
        found = list(map(cache.get, keys, repeat(_NOT_FOUND)))
        try:
            same = np.fromiter(map(operator.eq, map(_FIRST, found), frames), bool, m)
        except RecursionError:         # nested values no frame has: one by one
            same = np.zeros(m, dtype=bool)
        out[:] = np.fromiter(map(_SECOND, found), np.int64, m)
        for j in np.flatnonzero(~same).tolist():
            sid = out[j] = self.lookup(frames[j], cc, um)
            cache[keys[j]] = (frames[j], sid)
        return out

    def _new(self, frames: Any, cc: Any, um: Any, where: str) -> int:
        frames = frames or ()
        cc, um = cc or "", um or ""
        if not frames and not um and cc in ("", "N/A"):
            return -1
        get = self._frames.get
        ids = []
        for j, f in enumerate(frames):
            fid = get(id(f))
            ids.append(fid if fid is not None else self._frame(f, where, j))
        return self.table._add_stack(Stack(tuple(ids), cc, um))

    def _frame(self, f: Any, where: str, j: int) -> int:
        if isinstance(f, dict):
            filename, line, name = f.get("filename"), f.get("line"), f.get("name")
        if not (isinstance(f, dict) and isinstance(filename, str) and isinstance(name, str)
                and isinstance(line, int) and not isinstance(line, bool)):
            raise TraceFormatError(
                f"{where}.frames[{j}]: expected a frame, a dict with 'filename' (str), "
                f"'line' (int) and 'name' (str); found {_short(f)}")
        if len(self._frames) >= _CACHE_MAX:    # a snapshot that shares no frames (JSON)
            self._frames.clear()
        fid = self._frames[id(f)] = self.table._add_frame(Frame(filename, line, name))
        return fid


def _short(value: Any, width: int = 80) -> str:
    """``value`` for a message, at most ``width`` characters: a bounded repr (a few levels
    and items of a container, so that a list shared at every level of a pickle, whose full
    repr is exponential in its depth, costs no more than a flat one; an int of more than
    64 digits by its size)."""
    text = _REPR.repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


class _BoundedRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 200:
            return f"<a {x.bit_length()}-bit integer>"
        return super().repr_int(x, level)


_REPR = _BoundedRepr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 3, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 40, 64


def _int(value: Any, where: str, what: str, top: int = (1 << 63) - 1) -> int:
    """``value``, an int in ``0 .. top`` (addresses, sizes and devices are never negative)."""
    if isinstance(value, bool) or not isinstance(value, int):
        text = _short(value, 60) if isinstance(value, (str, float, type(None))) else \
            type(value).__name__
        raise TraceFormatError(f"{where}: expected an integer {what}, found {text}")
    if value < 0:
        raise TraceFormatError(f"{where}: a negative {what} ({_short(value)}); expected an integer "
                               f">= 0")
    if value > top:
        shown = value if value.bit_length() < 100 else f"a {value.bit_length()}-bit number"
        raise TraceFormatError(f"{where}: {what} {shown} is above {top:,}")
    return value


def _time_ns(tu: Any, where: str, i: int) -> int:
    """An entry's ``time_us`` in ns (its index * 1000 when it has none)."""
    if tu is None:
        return i * 1000
    if isinstance(tu, bool) or not isinstance(tu, (int, float)) \
            or not (math.isfinite(tu) and -_T_MAX < tu < _T_MAX):
        text = _short(tu, 40) if isinstance(tu, (int, float, str)) else type(tu).__name__
        raise TraceFormatError(f"{where}: time_us {text} is not a time in microseconds "
                               f"(a finite number below 2**53)")
    return int(tu) * 1000


def _stream_value(entry: dict, where: str) -> int:
    """An entry's stream as a signed int64 (a cudaStream_t value; 0 when absent)."""
    s = entry.get("stream", 0)
    if s is None:
        return 0
    if isinstance(s, bool) or not isinstance(s, int) or not -(1 << 63) <= s < (1 << 64):
        raise TraceFormatError(f"{where}: expected an integer stream (a cudaStream_t value), "
                               f"found {_short(s, 60)}")
    return s - (1 << 64) if s >= 1 << 63 else s


@dataclasses.dataclass(eq=False)
class Entries:
    """One device's ``device_traces`` entries as columns (:func:`read_entries`).

    ``action`` (:data:`ACTIONS` codes, 0 for others), ``addr`` (``device_free`` for
    ``oom``), ``size``, ``stream`` (signed) as :class:`TorchTrace` holds them (0 for
    entries that are no allocator call); ``time_ns`` (``time_us`` * 1000, the entry's
    index * 1000 without one); ``requested`` (an entry's ``requested_size``, -1 where it
    has none); ``stack`` (int32 stack ids of the entries that become rows, else -1);
    ``skipped``: the names of other actions, counted.
    """

    action: np.ndarray
    addr: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    time_ns: np.ndarray
    requested: np.ndarray
    stack: np.ndarray
    skipped: dict[str, int]

    def torch_trace(self, device: int, final: list[dict] | None, settings: dict | None,
                    version: tuple[int, int]) -> TorchTrace:
        return TorchTrace(device, self.action, self.addr, self.size, self.stream, final,
                          settings, version)


def read_entries(lst: list, device: int, name: str, stacks: StackInterner | None = None,
                 release: bool = False) -> Entries:
    """``device_traces[device]`` as :class:`Entries`, checked as an import checks them.

    Entries are read :data:`_CHUNK` at a time, each field of a chunk in one pass of C
    (``map(dict.get, ...)``) and into numpy; a chunk with anything unusual (a missing
    field, a value of another type, a negative size) is read again entry by entry, which
    says what is wrong with which entry. With ``release``, each chunk's entries are
    dropped from ``lst`` once read (the snapshot's objects are freed as the columns grow).

    Raises
    ------
    TraceFormatError
        An entry that is no dict with an ``action`` string, a bad ``time_us``, or a call
        without the fields its action needs (named ``device_traces[device][i]``).
    """
    n = len(lst)
    # columns filled chunk by chunk: their pages are taken as entries are released
    out = Entries(np.empty(n, np.int8), np.empty(n, np.int64), np.empty(n, np.int64),
                  np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64),
                  np.empty(n, np.int32), {})
    skipped: dict[str, int] = {}
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        chunk = lst[lo:hi]
        if not _read_fast(chunk, lo, out, stacks, skipped):
            _read_slow(chunk, lo, device, name, out, stacks, skipped)
        if release:
            lst[lo:hi] = [None] * (hi - lo)
        del chunk
    out.skipped = skipped
    empty = np.flatnonzero(np.isin(out.action, (A_SEG_ALLOC, A_SEG_FREE, A_MAP, A_UNMAP))
                           & (out.size == 0))
    if len(empty):
        k = int(empty[0])
        raise TraceFormatError(
            f"{name}: device_traces[{device}][{k}]: a {ACTION_NAMES[int(out.action[k])]} of 0 "
            f"bytes at {int(out.addr[k]):#x}; PyTorch records segments and mapped ranges of "
            "one byte or more (the snapshot is damaged)")
    return out


_get = dict.get
_ACTION_CODE = ACTIONS.get
_NOT_FOUND = (None, -1)
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_IS_NONE = type(None)


def _types(values: list) -> set:
    return set(map(type, values))


def _read_fast(chunk: list, lo: int, out: Entries, stacks: StackInterner | None,
               skipped: dict[str, int]) -> bool:
    """Read one chunk in bulk; False (nothing half-written that matters) when it needs
    :func:`_read_slow`."""
    from itertools import compress, repeat

    m = len(chunk)
    hi = lo + m
    try:
        acts = list(map(_get, chunk, repeat("action")))
        names = set(acts)           # a few distinct actions: their types are cheap to check
    except TypeError:          # an entry that is not a dict, or an unhashable action
        return False
    if _types(names) != {str}:
        return False
    code = np.fromiter(map(_ACTION_CODE, acts, repeat(0)), np.int8, m)
    checked = _CHECKED_MASK[code]
    rows = _ROW_MASK[code]
    # time_us
    tus = list(map(_get, chunk, repeat("time_us")))
    tt = _types(tus)
    if tt == {int}:
        try:
            t = np.fromiter(tus, np.int64, m)
        except OverflowError:
            return False
        if m and (t.min() <= -_T_MAX or t.max() >= _T_MAX):
            return False
        t *= 1000
    elif tt == {_IS_NONE}:
        t = np.arange(lo, hi, dtype=np.int64) * 1000
    else:
        return False
    # addr, size, stream: read where the action is a call (from_snapshot's rule)
    cols = []
    for key in ("addr", "size", "stream"):
        vals = list(map(_get, chunk, repeat(key)))
        types = _types(vals)
        if not types <= {int, _IS_NONE}:
            return False
        nones = None
        if _IS_NONE in types:
            nones = np.fromiter(map(operator.is_, vals, repeat(None)), bool, m)
            vals = [0 if v is None else v for v in vals]
        try:
            arr = np.fromiter(vals, np.int64, m)
        except OverflowError:
            return False
        cols.append((arr, nones))
    (addr, addr_none), (size, size_none), (stream, _) = cols
    calls_rows = rows & (code != A_OOM)
    if addr_none is not None and (addr_none & calls_rows).any():
        return False
    if size_none is not None and (size_none & checked).any():
        return False
    if (size[checked] < 0).any() or (addr[calls_rows] < 0).any():
        return False
    # requested_size (gpudash's exports): where present on alloc and free_completed
    reqs = list(map(_get, chunk, repeat("requested_size"), repeat(_MISSING)))
    types = _types(reqs)
    if types == {type(_MISSING)}:
        req = None
    elif types <= {int, type(_MISSING)}:
        asks = (code == A_ALLOC) | (code == A_FREE)
        present = np.fromiter(map(operator.is_not, reqs, repeat(_MISSING)), bool, m)
        try:
            req = np.fromiter([-1 if v is _MISSING else v for v in reqs], np.int64, m)
        except OverflowError:
            return False
        if ((req < 0) & present & asks).any():
            return False
        req[~asks] = -1
    else:
        return False
    # the entries that are no allocator call: nothing of theirs is kept but their name
    other = np.flatnonzero(~checked)
    if len(other):
        addr[other] = size[other] = stream[other] = 0
        for k in other.tolist():
            skipped[acts[k]] = skipped.get(acts[k], 0) + 1
    # oom: its device_free in addr
    for k in np.flatnonzero(code == A_OOM).tolist():
        df = chunk[k].get("device_free")
        if df is not None and (type(df) is not int or df < 0 or df >= 1 << 63):
            return False
        addr[k] = df or 0
    # stacks of the entries that become rows
    sid = None
    if stacks is not None:
        row_idx = np.flatnonzero(rows)
        sel = rows.tolist()
        frames = list(compress(map(_get, chunk, repeat("frames")), sel))
        ccs = list(compress(map(_get, chunk, repeat("compile_context")), sel))
        ums = list(compress(map(_get, chunk, repeat("user_metadata")), sel))
        if not (_types(frames) <= {list, _IS_NONE} and _types(ccs) <= {str, _IS_NONE}
                and _types(ums) <= {str, _IS_NONE}):
            return False
        try:
            got = stacks.bulk(frames, ccs, ums)
        except TraceFormatError:      # read again entry by entry, to say which
            return False
        sid = (row_idx, got.astype(np.int32))
    out.action[lo:hi] = code
    out.addr[lo:hi] = addr
    out.size[lo:hi] = size
    out.stream[lo:hi] = stream
    out.time_ns[lo:hi] = t
    out.requested[lo:hi] = req if req is not None else -1
    out.stack[lo:hi] = -1
    if sid is not None:
        out.stack[lo + sid[0]] = sid[1]
    return True


def _read_slow(chunk: list, lo: int, device: int, name: str, out: Entries,
               stacks: StackInterner | None, skipped: dict[str, int]) -> None:
    """Read one chunk entry by entry, with the message for the first entry that is wrong."""
    for k, e in enumerate(chunk):
        i = lo + k
        where = f"{name}: device_traces[{device}][{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("action"), str):
            raise TraceFormatError(f"{where}: expected a dict with an 'action' string")
        t = _time_ns(e.get("time_us"), where, i)
        code = ACTIONS.get(e["action"], 0)
        addr = size = stream = 0
        req = sid = -1
        if 1 <= code <= 8:
            a = e.get("device_free" if code == A_OOM else "addr", 0)
            addr = _as_int(a if a is not None else 0, where + ".addr", signed=True)
            size = _as_int(e.get("size"), where + ".size")
            s = e.get("stream", 0)
            s = _as_int(s if s is not None else 0, where + ".stream", signed=True) & _MASK64
            stream = s - (1 << 64) if s >= 1 << 63 else s
            if code == A_OOM:
                _int(size, where, "size")
                _stream_value(e, where)
                addr = _int(e.get("device_free") or 0, where, "device_free")
            elif code != A_FREE_REQ:       # a row: the importer's checks
                _int(e.get("addr"), where, "addr")
                _int(size, where, "size")
                if code in (A_ALLOC, A_FREE) and "requested_size" in e:
                    req = _int(e["requested_size"], where, "requested_size")
                if code != A_FREE:
                    _stream_value(e, where)
            if code != A_FREE_REQ and stacks is not None:
                sid = stacks.of(e.get("frames"), e.get("compile_context"),
                                e.get("user_metadata"), where)
        else:
            if code == 0 or code >= 9:
                skipped[e["action"]] = skipped.get(e["action"], 0) + 1
        out.action[i] = code
        out.addr[i] = addr
        out.size[i] = size
        out.stream[i] = stream
        out.time_ns[i] = t
        out.requested[i] = req
        out.stack[i] = sid
