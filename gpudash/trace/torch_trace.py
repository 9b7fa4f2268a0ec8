"""One device's PyTorch trace as arrays, and what a snapshot says existed before it.

The data side of PyTorch's snapshots, shared by the importer
(:mod:`gpudash.trace.torch_snapshot`) and exact replay (:mod:`gpudash.trace.torch_replay`):

- :class:`TorchTrace`: a device's ``device_traces`` entries as numpy columns (action codes
  :data:`ACTIONS`, addresses, sizes, streams) with the final segments and settings;
  :func:`from_snapshot` (a snapshot dict) and :func:`from_trace` (an imported trace, or a
  ``.gdtrace`` saved from one) make them;
- :func:`start_state`: what existed when the trace began (PyTorch keeps the last
  ``max_entries`` events, so a trace can start mid-run): the final segments walked back over
  the trace, as MemoryViz does; :class:`StartSegment` per segment or mapped range;
- the final segments in a compact, JSON-friendly form (:func:`compact_segments`,
  :func:`expand_segments`), as an imported trace keeps them in ``meta["torch"]``.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left, bisect_right
from typing import Any

import numpy as np

from .._errors import TraceFormatError
from .._torch_conf import CachingAllocatorConfig, parse_torch_version
from ..caching import K_MIN_BLOCK_SIZE, K_SMALL_SIZE, round_size

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
    from ..events import EventKind

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
    except Exception:  # noqa: BLE001 - an odd version string: the default rules
        version = parse_torch_version(None)
    return TorchTrace(device, action[keep], addr[keep], size[keep],
                      trace.streams()[rows][keep], final, settings, version, rows[keep])


def _as_int(value: Any, where: str, signed: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where}: expected an integer, found {value!r}")
    if not signed and value < 0:
        what = where.rsplit(".", 1)[-1]
        raise TraceFormatError(f"{where}: a negative {what} ({value}); expected an integer "
                               f">= 0")
    return value


def _u64(v: int) -> int:
    return v & _MASK64


def _starts_empty(tt: TorchTrace) -> bool:
    """The trace starts from an empty allocator: every free follows its alloc, every final
    allocated block and segment was made in the trace (the validation plan's step 2)."""
    live: set[int] = set()
    segs: set[int] = set()
    mapped = _Ranges()
    for a, addr, size in zip(tt.action.tolist(), tt.addr.tolist(), tt.size.tolist()):
        if a == A_ALLOC:
            live.add(addr)
        elif a == A_FREE:
            if addr not in live:
                return False
            live.discard(addr)
        elif a == A_SEG_ALLOC:
            segs.add(addr)
        elif a == A_SEG_FREE:
            if addr not in segs:
                return False
            segs.discard(addr)
        elif a == A_MAP:
            mapped.add(addr, addr + size)
        elif a == A_UNMAP:
            if not mapped.covers(addr, addr + size):
                return False
            mapped.sub(addr, addr + size)
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
    act, addr, size = tt.action.tolist(), tt.addr.tolist(), tt.size.tolist()
    stream = [_u64(s) for s in tt.stream.tolist()]
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
    mapped = _Ranges((lo, hi) for lo, hi, _, _ in exp_ranges)
    for k in range(len(act) - 1, -1, -1):
        a = act[k]
        if a == A_ALLOC:
            blocks.pop(addr[k], None)
        elif a == A_FREE:
            blocks[addr[k]] = [None, size[k], k]
        elif a == A_SEG_ALLOC:
            segs.pop(addr[k], None)
        elif a == A_SEG_FREE:
            # a segment of 2 MiB is the small pool's (large segments are >= 10 MiB)
            segs[addr[k]] = {"size": size[k], "small": size[k] == (2 << 20),
                             "stream": stream[k], "freed_at": k}
        elif a == A_MAP:
            mapped.sub(addr[k], addr[k] + size[k])
        elif a == A_UNMAP:
            mapped.add(addr[k], addr[k] + size[k])
    starts = sorted(blocks)
    counts = {"segments": 0, "blocks": 0, "guessed": 0}
    # allocations by address, with their trace index: evidence of where free blocks began
    alloc_at = sorted((addr[k], k) for k in range(len(act)) if act[k] == A_ALLOC)
    alloc_addrs = [x for x, _ in alloc_at]

    def first_alloc_in(lo: int, hi: int, before: int) -> int | None:
        """The address of the earliest allocation (before trace index ``before``) in
        [lo, hi): where the free block there began (an allocation takes the front)."""
        best = None
        for j in range(bisect_left(alloc_addrs, lo), bisect_left(alloc_addrs, hi)):
            k = alloc_at[j][1]
            if k < before and (best is None or k < best[1]):
                best = (alloc_addrs[j], k)
        return None if best is None else best[0]

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
    return out, counts


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


