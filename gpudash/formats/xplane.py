"""Import TensorFlow and JAX profiles (``*.xplane.pb``, TensorBoard log directories).

A profile is an ``XSpace`` protobuf (:mod:`gpudash.proto`, read with the protobuf runtime, no
TensorFlow). Its planes hold lines of events; TensorFlow's and XLA's BFC allocator record one
``MemoryAllocation`` or ``MemoryDeallocation`` event per allocation and free while a profile
is taken, on whatever plane and line (thread) made the call, with these stats::

    allocator_name   GPU_0_bfc, gpu_host_bfc, ...       one gpudash device per name
    addr             chunk address                       ptr
    allocation_bytes chunk bytes                         size
    requested_bytes  bytes asked for                     requested
    bytes_allocated  the allocator's bytes in use after the event
    tf_op, data_type, shape, region_type                 the holder: "op dtype[shape]"

Every such event on every plane becomes an event; times come from the profile (the line's
``timestamp_ns`` plus the event's ``offset_ps``), and events are put in time order.

Memory in use before the profile began
--------------------------------------
A profile usually starts in the middle of a run: its first event already reports megabytes in
use (weights, datasets). That memory is made part of the trace, so that after every event the
trace's bytes in use equal the event's ``bytes_allocated`` and :meth:`Trace.summary` peaks
equal TensorFlow's:

- each free of an address the profile never saw allocated is a block that was in use before
  the profile: it gets an allocation at the profile's first instant (same address, size and
  requested bytes), so the free pairs with it;
- what ``bytes_allocated`` says was in use at the start beyond those blocks is one more
  allocation at address 0, holder ``"(in use before the profile)"``, never freed.

Replay and what-if therefore start with that memory allocated (the blocks the profile later
frees, in address order, then the remainder) and free the blocks when the profile frees them:
no byte that was in use is left out, and none is held longer than it was. What the profile
cannot tell is where those blocks sat among each other, so the replayed layout of the first
regions may differ from TensorFlow's. ``meta["devices"][i]["pre_existing_bytes"]`` says how
much each device had; ``meta["inconsistent_events"]`` counts events whose ``bytes_allocated``
disagrees with the running sum (events the profiler dropped), with a warning.

Speed
-----
Events are decoded in bulk: the protobuf runtime parses the file with each line's events left
as bytes (``XSpaceRaw``), and the event and stat messages of all lines are then decoded at
once with numpy, following protobuf's wire format for those two messages (varints, 64-bit
values, length-delimited fields). A million memory events load in 3.6-4.9 s on a shared
2-core machine (``benchmarks/bench_xplane.py``); the tests check the result against the
protobuf runtime's own parse of every event.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import GpudashWarning, TraceFormatError
from .format import (HOLDER_DTYPE, MAX_DEVICE, PRE_EXISTING_HOLDER, Trace, bins_for_sizes,
                     file_kind, open_regular, row_regions)

__all__ = ["load_xplane", "find_profile", "PRE_EXISTING_HOLDER"]

_ALLOC_NAME, _FREE_NAME = "MemoryAllocation", "MemoryDeallocation"
_SUFFIX = ".xplane.pb"
# TensorFlow's DataType enum (types.proto), for holders such as "float[64,512]".
_DTYPES = {1: "float", 2: "double", 3: "int32", 4: "uint8", 5: "int16", 6: "int8",
           7: "string", 8: "complex64", 9: "int64", 10: "bool", 11: "qint8", 12: "quint8",
           13: "qint32", 14: "bfloat16", 15: "qint16", 16: "quint16", 17: "uint16",
           18: "complex128", 19: "half", 20: "resource", 21: "variant", 22: "uint32",
           23: "uint64", 24: "float8_e5m2", 25: "float8_e4m3fn", 26: "int4", 27: "uint4"}
_WANTED = ("allocator_name", "addr", "allocation_bytes", "requested_bytes", "bytes_allocated",
           "tf_op", "data_type", "shape", "region_type")


# ============================================================================ finding files
def find_profile(path: str | os.PathLike, run: str | None = None) -> list[Path]:
    """The ``*.xplane.pb`` files to read for ``path``.

    Parameters
    ----------
    path : str or os.PathLike
        A ``*.xplane.pb`` file; a run directory holding some; or a TensorBoard log directory
        (``LOGDIR``, or ``LOGDIR/plugins/profile``) whose ``plugins/profile/RUN/`` folders
        hold them.
    run : str, optional
        The run to read in a log directory; default the newest. TensorBoard names runs by
        their start time (``2025_12_02_17_04_05``), so the newest is the last by name.

    Returns
    -------
    list of Path
        One file per host of the run, sorted by name.

    Raises
    ------
    TraceFormatError
        No profile there (the message says what was looked for), or no run named ``run``.
    """
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError:
        raise TraceFormatError(f"{p}: no such file or directory") from None
    if stat.S_ISREG(mode):
        return [p]
    if not stat.S_ISDIR(mode):
        raise TraceFormatError(f"{p}: is {file_kind(mode)}, not a profile (an "
                               f"*{_SUFFIX} file or a directory holding some)")
    files = sorted(p.glob("*" + _SUFFIX))
    if files and run is None:
        return files
    base = p
    for sub in (("plugins", "profile"), ("profile",)):
        cand = p.joinpath(*sub)
        if cand.is_dir():
            base = cand
            break
    runs = sorted(d for d in base.iterdir() if d.is_dir() and any(d.glob("*" + _SUFFIX)))
    if run is not None:
        chosen = base / run
        if chosen not in runs:
            names = ", ".join(d.name for d in runs) or "none"
            raise TraceFormatError(f"{p}: no profile run named {run!r} (runs with "
                                   f"{_SUFFIX} files: {names})")
        return sorted(chosen.glob("*" + _SUFFIX))
    if not runs:
        raise TraceFormatError(
            f"{p}: no profile found: expected *{_SUFFIX} files here or in "
            f"plugins/profile/RUN/ (a TensorBoard log directory)")
    return sorted(runs[-1].glob("*" + _SUFFIX))


# ============================================================================ wire decoding
class _Damaged(Exception):
    """Event bytes that do not follow the wire format (turned into a TraceFormatError)."""


def _varint(buf: np.ndarray, pos: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The varint at each position: (value as uint64, position after it)."""
    b = buf[pos]
    more = b >= 0x80
    if not more.any():                     # the usual case for tags, lengths and ids
        after = pos + 1
        if (after > end).any():
            raise _Damaged("a varint runs past the end of its message")
        return b.astype(np.uint64), after
    val = (b & 0x7F).astype(np.uint64)
    cur = pos + 1
    todo = np.flatnonzero(more)
    sub_val = val[todo]
    sub_cur = cur[todo]
    keep = np.arange(len(todo))
    for k in range(1, 10):
        b = buf[sub_cur[keep]]
        sub_val[keep] |= (b & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        sub_cur[keep] += 1
        keep = keep[b >= 0x80]
        if not len(keep):
            break
    else:
        raise _Damaged("a varint longer than 10 bytes")
    val[todo] = sub_val
    cur[todo] = sub_cur
    if (cur > end).any():
        raise _Damaged("a varint runs past the end of its message")
    return val, cur


def _fields(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray,
            varint_fields: tuple[int, ...], fixed64_fields: tuple[int, ...],
            bytes_fields: tuple[int, ...]) -> dict[int, tuple[np.ndarray, ...]]:
    """Decode the fields of many messages at once.

    Returns, for each field number asked for, ``(message index, value)`` arrays (one row per
    occurrence, in no particular order across messages, in order within a message): varint
    fields as uint64, fixed64 fields as their 8 raw bytes viewed as uint64, length-delimited
    fields as ``(message index, start, end)`` (a 3-tuple). Other fields are skipped.
    """
    pos = starts.copy()
    out: dict[int, list] = {f: [] for f in (*varint_fields, *fixed64_fields, *bytes_fields)}
    active = np.flatnonzero(pos < ends)
    one_byte = [(f << 3) | 2 for f in bytes_fields if f < 16]
    while len(active):
        end = ends[active]
        at = pos[active]
        first = buf[at]
        if len(one_byte) == 1 and (first == one_byte[0]).all():
            # the common run: the same length-delimited field in every message, one-byte
            # tag, and (checked) one-byte lengths
            length = buf[at + 1]
            if (length < 0x80).all():
                stop = at + 2 + length
                if (stop > end).any():
                    raise _Damaged("a field runs past the end of its message")
                out[one_byte[0] >> 3].append((active, at + 2, stop))
                pos[active] = stop
                active = active[stop < end]
                continue
        tag, p = _varint(buf, at, end)
        wt = tag & np.uint64(7)
        fn = tag >> np.uint64(3)
        new = p                               # wire type 5 handled below; 0, 1, 2 here
        is0, is1, is2 = wt == 0, wt == 1, wt == 2
        if not (is0 | is1 | is2).all():
            is5 = wt == 5
            bad = ~(is0 | is1 | is2 | is5)
            if bad.any():
                raise _Damaged(f"wire type {int(wt[bad][0])} (groups or an invalid type)")
            new = np.where(is5, p + 4, p)
        if is0.all():
            v, new = _varint(buf, p, end)
            for f in varint_fields:
                sel = fn == f
                if sel.any():
                    out[f].append((active[sel], v[sel]))
        elif is2.all():
            length, after = _varint(buf, p, end)
            if (length > np.uint64(1 << 40)).any():
                raise _Damaged("a field length beyond any message")
            new = after + length.astype(np.int64)
            for f in bytes_fields:
                sel = fn == f
                if sel.any():
                    out[f].append((active[sel], after[sel], new[sel]))
        else:
            new = new.copy()
            if is0.any():
                v, after = _varint(buf, p[is0], end[is0])
                new[is0] = after
                for f in varint_fields:
                    sel = fn[is0] == f
                    if sel.any():
                        out[f].append((active[is0][sel], v[sel]))
            if is1.any():
                at = p[is1]
                new[is1] = at + 8
                for f in fixed64_fields:
                    sel = fn[is1] == f
                    if sel.any():
                        idx = at[sel][:, None] + np.arange(8)
                        raw = np.ascontiguousarray(buf[idx]).view("<u8").reshape(-1)
                        out[f].append((active[is1][sel], raw))
            if is2.any():
                length, after = _varint(buf, p[is2], end[is2])
                if (length > np.uint64(1 << 40)).any():
                    raise _Damaged("a field length beyond any message")
                stop = after + length.astype(np.int64)
                new[is2] = stop
                for f in bytes_fields:
                    sel = fn[is2] == f
                    if sel.any():
                        out[f].append((active[is2][sel], after[sel], stop[sel]))
        if (new > end).any():
            raise _Damaged("a field runs past the end of its message")
        pos[active] = new
        active = active[new < end]
    result: dict[int, Any] = {}
    for f, parts in out.items():
        if parts:
            result[f] = tuple(np.concatenate(col) for col in zip(*parts))
        elif f in bytes_fields:
            result[f] = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
        else:
            result[f] = (np.empty(0, np.int64), np.empty(0, np.uint64))
    return result


def _stats(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray,
           wanted: np.ndarray) -> dict[int, tuple[np.ndarray, ...]]:
    """Decode XStat messages (``metadata_id = 1``, then one value field), keeping only those
    whose metadata id is in ``wanted``. Same result layout as :func:`_fields` with the value
    fields 2 (fixed64), 3, 4, 7 (varint), 5, 6 (bytes) and 1 (the id)."""
    n = len(starts)
    # fast path: the layout protobuf writes: the id first (tag 0x08), then one value
    first = buf[starts]
    regular = (first == 0x08) & (ends > starts + 1)
    idx = np.flatnonzero(regular)
    mid, p = _varint(buf, starts[idx] + 1, ends[idx])
    keep = np.isin(mid.view(np.int64), wanted)
    idx, mid, p = idx[keep], mid[keep], p[keep]
    end = ends[idx]
    ok = p < end
    tag = buf[p[ok]]
    out: dict[int, list] = {f: [] for f in range(1, 8)}
    sub = idx[ok]
    sub_p = p[ok] + 1
    sub_end = end[ok]
    fn = tag >> 3
    wt = tag & 7
    done = np.zeros(len(sub), dtype=bool)
    m = (wt == 0) & np.isin(fn, (3, 4, 7)) & (tag < 0x80)
    if m.any():
        v, after = _varint(buf, sub_p[m], sub_end[m])
        exact = after == sub_end[m]
        for f in (3, 4, 7):
            sel = exact & (fn[m] == f)
            out[f].append((sub[m][sel], v[sel]))
        done[np.flatnonzero(m)[exact]] = True
    m = (tag == 0x11) & (sub_p + 8 == sub_end)
    if m.any():
        raw = np.ascontiguousarray(buf[sub_p[m][:, None] + np.arange(8)]).view("<u8")
        out[2].append((sub[m], raw.reshape(-1)))
        done[m] = True
    m = ((tag == 0x2A) | (tag == 0x32)) & ~done
    if m.any():
        length, after = _varint(buf, sub_p[m], sub_end[m])
        stop = after + length.astype(np.int64)
        exact = stop == sub_end[m]
        for f, t in ((5, 0x2A), (6, 0x32)):
            sel = exact & (tag[m] == t)
            out[f].append((sub[m][sel], after[sel], stop[sel]))
        done[np.flatnonzero(m)[exact]] = True
    out[1].append((idx, mid))
    # everything else (another field order, extra fields, an id of 0 left out): in general
    rest = np.concatenate([np.flatnonzero(~regular), sub[~done]])
    if len(rest):
        gen = _fields(buf, starts[rest], ends[rest], varint_fields=(1, 3, 4, 7),
                      fixed64_fields=(2,), bytes_fields=(5, 6))
        ids = _last_by_message(len(rest), gen[1], 0, np.uint64).view(np.int64)
        good = np.isin(ids, wanted)
        for f, rows in gen.items():
            sel = good[rows[0]]
            out[f].append((rest[rows[0][sel]], *(col[sel] for col in rows[1:])))
        # the fast path may have recorded an id for a stat it then handed over: drop those
        again = np.zeros(n, dtype=bool)
        again[rest] = True
        first_ids = out[1][0]
        out[1][0] = tuple(col[~again[first_ids[0]]] for col in first_ids)
    result: dict[int, Any] = {}
    for f, parts in out.items():
        parts = [pt for pt in parts if len(pt[0])] or parts[:1]
        if parts:
            result[f] = tuple(np.concatenate(col) for col in zip(*parts))
        else:
            result[f] = (np.empty(0, np.int64), np.empty(0, np.uint64)) if f not in (5, 6) \
                else (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
    return result


def _last_by_message(n: int, rows: tuple, default: Any, dtype: Any) -> np.ndarray:
    """One value per message from ``(message index, value)`` rows (the last one wins)."""
    out = np.full(n, default, dtype=dtype)
    if len(rows[0]):
        out[rows[0]] = rows[1]
    return out


# ============================================================================ reading
def _pb():
    from google.protobuf.message import DecodeError

    from ..proto import xplane_pb2  # late: its descriptors cost ~40 ms; profiles only

    return xplane_pb2, DecodeError


class _Strings:
    """Strings of stats (refs to stat metadata names, or inline ``str_value``), numbered."""

    def __init__(self) -> None:
        self.table: list[str] = [""]
        self.index: dict[str, int] = {"": 0}

    def id(self, text: str) -> int:
        i = self.index.get(text)
        if i is None:
            i = self.index[text] = len(self.table)
            self.table.append(text)
        return i


_BLOCK = 1 << 17   # events decoded together (bounds the memory of the bulk decoding)


def _read_plane(plane: Any, where: str, strings: _Strings) -> dict | None:
    """The memory events of one plane as numpy columns (None when it has none)."""
    kinds = {k: (1 if v.name == _ALLOC_NAME else 2) for k, v in plane.event_metadata.items()
             if v.name in (_ALLOC_NAME, _FREE_NAME)}
    if not kinds:
        return None
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    wanted = {name: [k for k, v in stat_names.items() if v == name] for name in _WANTED}
    wanted_ids = np.array(sorted({k for ks in wanted.values() for k in ks}), dtype=np.int64)
    # ref_value -> string id, for every stat metadata entry (refs point at their names)
    ref_keys = np.array(sorted(stat_names), dtype=np.int64)
    ref_vals = np.array([strings.id(stat_names[k]) for k in ref_keys.tolist()], dtype=np.int64)
    kind_keys = np.array(sorted(kinds), dtype=np.int64)
    kind_vals = np.array([kinds[k] for k in kind_keys.tolist()], dtype=np.int8)
    lines = list(plane.lines)
    events: list[bytes] = []
    line_of: list[np.ndarray] = []
    for li, line in enumerate(lines):
        evs = list(line.events)
        events.extend(evs)
        line_of.append(np.full(len(evs), li, dtype=np.int64))
    if not events:
        return None
    lens = np.fromiter(map(len, events), dtype=np.int64, count=len(events))
    ends = np.cumsum(lens)
    starts = ends - lens
    blob = b"".join(events)
    del events
    buf = np.frombuffer(blob + bytes(16), dtype=np.uint8)  # padding: reads never overrun
    line_all = np.concatenate(line_of)
    stamps = np.array([ln.timestamp_ns for ln in lines], dtype=np.int64)
    blocks = []
    for lo in range(0, len(lens), _BLOCK):
        hi = min(lo + _BLOCK, len(lens))
        try:
            got = _decode_block(buf, blob, starts[lo:hi], ends[lo:hi], kind_keys, kind_vals,
                                wanted, wanted_ids, ref_keys, ref_vals, strings)
        except _Damaged as exc:
            raise TraceFormatError(f"{where}: plane {plane.name!r}: event data damaged "
                                   f"({exc})") from None
        if got is None:
            continue
        keep, out = got
        li = line_all[lo:hi][keep]
        off = out.pop("offset_ps")
        out["time_ns"] = stamps[li] + off // 1000
        out["time_ps"] = off % 1000
        blocks.append(out)
    if not blocks:
        return None
    return {k: np.concatenate([bl[k] for bl in blocks]) for k in blocks[0]}


def _decode_block(buf: np.ndarray, blob: bytes, starts: np.ndarray, ends: np.ndarray,
                  kind_keys: np.ndarray, kind_vals: np.ndarray, wanted: dict,
                  wanted_ids: np.ndarray, ref_keys: np.ndarray, ref_vals: np.ndarray,
                  strings: _Strings) -> tuple[np.ndarray, dict] | None:
    """Decode a block of events: the positions of its memory events and their columns."""
    n = len(starts)
    ev = _fields(buf, starts, ends, varint_fields=(1, 2), fixed64_fields=(), bytes_fields=(4,))
    mid = _last_by_message(n, ev[1], 0, np.uint64).view(np.int64)
    is_mem = np.isin(mid, kind_keys)
    keep = np.flatnonzero(is_mem)
    if not len(keep):
        return None
    offset = _last_by_message(n, ev[2], 0, np.uint64).view(np.int64)
    s_msg, s_start, s_end = ev[4]
    sel = is_mem[s_msg]
    s_msg, s_start, s_end = s_msg[sel], s_start[sel], s_end[sel]
    st = _stats(buf, s_start, s_end, wanted_ids)
    ns = len(s_msg)
    s_mid = _last_by_message(ns, st[1], 0, np.uint64).view(np.int64)
    # every stat's value as int64 (varints; doubles truncated) and as a string id
    s_int = np.zeros(ns, dtype=np.int64)
    for f in (3, 4, 7):
        rows = st[f]
        s_int[rows[0]] = rows[1].view(np.int64)
    rows = st[2]
    doubles = rows[1].view(np.float64)
    good = np.isfinite(doubles) & (np.abs(doubles) < 2.0 ** 63)
    if not good.all():   # checked before the cast, which would warn and wrap
        raise _Damaged(f"a stat holds the double {float(doubles[~good][0])!r}; expected a "
                       "finite number below 2**63")
    s_int[rows[0]] = doubles.astype(np.int64)
    s_str = np.zeros(ns, dtype=np.int64)
    ref_rows = st[7]
    if len(ref_rows[0]):
        r = ref_rows[1].view(np.int64)
        pos = np.minimum(np.searchsorted(ref_keys, r), max(len(ref_keys) - 1, 0))
        hit = (ref_keys[pos] == r) if len(ref_keys) else np.zeros(len(r), dtype=bool)
        s_str[ref_rows[0]] = np.where(hit, ref_vals[pos] if len(ref_vals) else 0, 0)
    for f in (5, 6):
        idx, a, b = st[f]
        if len(idx):  # inline strings: rare in TensorFlow's profiles (they use refs)
            s_str[idx] = [strings.id(blob[x:y].decode("utf-8", "replace"))
                          for x, y in zip(a.tolist(), b.tolist())]
    out: dict[str, np.ndarray] = {}
    for name, mids in wanted.items():
        m = np.isin(s_mid, mids) if mids else np.zeros(ns, dtype=bool)
        text = name in ("allocator_name", "tf_op", "shape", "region_type")
        col = np.full(n, 0 if text or name == "data_type" else -1, dtype=np.int64)
        col[s_msg[m]] = (s_str if text else s_int)[m]
        out[name] = col[keep]
    out["offset_ps"] = offset[keep]
    out["kind"] = kind_vals[np.searchsorted(kind_keys, mid[keep])]
    return keep, out


def load_xplane(path: str | os.PathLike, run: str | None = None) -> Trace:
    """Load the allocator events of a TensorFlow or JAX profile as a :class:`Trace`.

    Parameters
    ----------
    path : str or os.PathLike
        A ``*.xplane.pb`` file, a run directory, or a TensorBoard log directory
        (:func:`find_profile`).
    run : str, optional
        The run of a log directory to read (default the newest).

    Returns
    -------
    Trace
        One device per allocator name (in order of first event), ``meta["source"] =
        "xplane"``, ``meta["files"]``, ``meta["run"]``; each device entry has
        ``pre_existing_bytes`` and ``peak_bytes_in_use`` (the largest ``bytes_allocated``).
        Holders are ``"op dtype[shape]"`` from the events' ``tf_op``, ``data_type`` and
        ``shape``. See the module docstring for memory in use before the profile began.

    Raises
    ------
    TraceFormatError
        Not a profile (a damaged or truncated protobuf, another file), or a profile without
        memory events (the message says which planes it has).
    """
    files = find_profile(path, run)
    xplane_pb2, DecodeError = _pb()
    strings = _Strings()
    parts: list[dict] = []
    seen_planes: list[str] = []
    for i, f in enumerate(files):
        try:
            with open_regular(f) as fh:
                data = fh.read()
        except OSError as exc:
            raise TraceFormatError(f"{f}: cannot read it ({exc.strerror or exc})") from None
        try:
            space = xplane_pb2.XSpaceRaw.FromString(data)
        except DecodeError as exc:
            raise TraceFormatError(
                f"{f}: not a readable profile (an XSpace protobuf): {exc}; the file may be "
                f"truncated or of another kind") from None
        for plane in space.planes:
            seen_planes.append(plane.name)
            got = _read_plane(plane, str(f), strings)
            if got is not None:
                got["file"] = np.full(len(got["kind"]), i, dtype=np.int64)
                parts.append(got)
    if not parts:
        planes = ", ".join(repr(p) for p in seen_planes[:8]) or "none"
        raise TraceFormatError(
            f"{files[0] if len(files) == 1 else path}: the profile has no MemoryAllocation or "
            f"MemoryDeallocation events (planes: {planes}); profile with memory tracking on "
            "(TensorFlow records them by default; JAX with the profiler's host tracer level >= 2)")
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return _build(cols, strings.table, files, path, run)


def _holder_names(op: np.ndarray, dtype: np.ndarray, shape: np.ndarray,
                  table: list[str]) -> tuple[np.ndarray, list[str]]:
    """Holder index per event and the holder table, from string ids and dtype numbers."""
    n = len(op)
    holder = np.full(n, -1, dtype=HOLDER_DTYPE)
    has = op > 0
    if not has.any():
        return holder, []
    o_, d_, s_ = op[has], dtype[has], shape[has]
    if o_.max() < 1 << 30 and s_.max() < 1 << 24 and d_.min() >= 0 and d_.max() < 1 << 8:
        key = (o_ << 32) | (d_ << 24) | s_          # one int64 key: a fast unique
        ukey, inv = np.unique(key, return_inverse=True)
        uniq = np.stack([ukey >> 32, (ukey >> 24) & 0xFF, ukey & 0xFFFFFF], axis=1)
    else:
        uniq, inv = np.unique(np.stack([o_, d_, s_], axis=1), axis=0, return_inverse=True)
    names = []
    for o, d, s in uniq.tolist():
        text = table[o]
        dt = _DTYPES.get(d, "") if d > 0 else ""
        sh = table[s] if s > 0 else ""
        if dt or sh:
            text = f"{text} {dt}{sh}"
        names.append(text)
    # equal strings from different keys share one entry
    index: dict[str, int] = {}
    remap = np.array([index.setdefault(t, len(index)) for t in names], dtype=HOLDER_DTYPE)
    holder[has] = remap[inv.reshape(-1)]
    return holder, list(index)


def _build(c: dict[str, np.ndarray], table: list[str], files: list[Path], path: Any,
           run: str | None) -> Trace:
    t_ns, t_ps = c["time_ns"], c["time_ps"]
    if len(t_ns) > 1 and not ((t_ns[1:] > t_ns[:-1]) | ((t_ns[1:] == t_ns[:-1])
                                                     & (t_ps[1:] >= t_ps[:-1]))).all():
        order = np.lexsort((t_ps, t_ns))
        c = {k: v[order] for k, v in c.items()}
    n = len(t_ns)
    # devices: one per allocator name, in order of first event
    names, first = np.unique(c["allocator_name"], return_index=True)
    names = names[np.argsort(first)]
    if len(names) > MAX_DEVICE + 1:
        raise TraceFormatError(f"{files[0]}: {len(names):,} allocators; a trace holds at most "
                               f"{MAX_DEVICE + 1:,} devices (0 .. {MAX_DEVICE}), one per "
                               "allocator")
    dev_of = {int(s): i for i, s in enumerate(names.tolist())}
    device = np.array([dev_of[int(s)] for s in c["allocator_name"].tolist()], dtype=np.int16) \
        if n < 64 else _dense(c["allocator_name"], names)
    kind = c["kind"]
    is_a, is_f = kind == 1, kind == 2
    size = c["allocation_bytes"]
    req = c["requested_bytes"]
    if (size < 0).any() or (req < 0).any() or (c["addr"] < 0).any():
        bad = int(np.flatnonzero((size < 0) | (req < 0) | (c["addr"] < 0))[0])
        raise TraceFormatError(f"{files[0]}: memory event {bad} lacks its addr, "
                               "allocation_bytes or requested_bytes stat")
    holder, holders = _holder_names(c["tf_op"], c["data_type"], c["shape"], table)
    # pair frees with allocs at the same (device, addr): in a consistent profile allocs and
    # frees alternate at each address
    addr = c["addr"]
    if n and addr.max() < 1 << 48:
        grp = np.argsort((device.astype(np.int64) << 48) | addr, kind="stable")
    else:
        grp = np.lexsort((np.arange(n), addr, device))
    g_dev, g_addr, g_kind = device[grp], c["addr"][grp], kind[grp]
    same = np.zeros(n, dtype=bool)
    same[1:] = (g_dev[1:] == g_dev[:-1]) & (g_addr[1:] == g_addr[:-1])
    prev_alloc = np.zeros(n, dtype=bool)
    prev_alloc[1:] = same[1:] & (g_kind[:-1] == 1)
    matched_free_g = (g_kind == 2) & prev_alloc
    alloc_id = np.full(n, -1, dtype=np.int64)
    a_rows = np.flatnonzero(is_a)
    # pre-existing blocks: frees with nothing allocated at their address before them
    pre_rows = grp[(g_kind == 2) & ~prev_alloc]
    n_pre = len(pre_rows)
    alloc_id[a_rows] = np.arange(len(a_rows)) + 1 + n_pre
    f_g = np.flatnonzero(matched_free_g)
    alloc_id[grp[f_g]] = alloc_id[grp[f_g - 1]]
    holder[grp[f_g]] = holder[grp[f_g - 1]]
    # starting bytes per device, for all devices at once: each device's rows (in time
    # order) are one run of a stable sort by device, so that the work is linear in events +
    # devices (a mask over all rows per device took devices x events: minutes for 30,000)
    n_dev = len(names)
    delta = np.where(is_a, size, np.where(is_f, -size, 0))
    by_dev = np.argsort(device, kind="stable")
    d_sorted = device[by_dev].astype(np.int64)
    starts = np.searchsorted(d_sorted, np.arange(n_dev))
    counts = np.diff(np.append(starts, n))         # >= 1: every name has an event
    cum = np.cumsum(delta[by_dev])
    run_sum = cum - np.repeat(cum[starts] - delta[by_dev][starts], counts)
    reported = c["bytes_allocated"][by_dev]
    has_rep = reported >= 0
    base = np.zeros(n_dev, dtype=np.int64)
    rep_pos = np.flatnonzero(has_rep)
    rep_dev, first_rep = np.unique(d_sorted[rep_pos], return_index=True)
    first_rep = rep_pos[first_rep]
    base[rep_dev] = reported[first_rep] - run_sum[first_rep]
    inconsistent = int(np.count_nonzero(reported[rep_pos]
                                        != base[d_sorted[rep_pos]] + run_sum[rep_pos]))
    peak = np.maximum.reduceat(reported, starts) if n else np.zeros(0, dtype=np.int64)
    # pre-existing blocks, by device, then address (then time)
    pre_set = np.zeros(n, dtype=bool)
    pre_set[pre_rows] = True
    pr = np.flatnonzero(pre_set)
    pr = pr[np.lexsort((c["addr"][pr], device[pr]))]
    pieces = np.zeros(n_dev, dtype=np.int64)
    np.add.at(pieces, device[pr].astype(np.int64), size[pr])
    rest = base - pieces
    inconsistent += int(np.count_nonzero(rest < 0))
    remainder = np.maximum(rest, 0).tolist()
    pre_dev = device[pr].tolist()
    pre_ptr = c["addr"][pr].tolist()
    pre_size = size[pr].tolist()
    pre_req = req[pr].tolist()
    t0 = int(c["time_ns"][0]) if n else 0
    meta_devs = [{"index": d, "name": table[nm], "capacity": None, "options": None,
                  "pre_existing_bytes": max(b, 0), "peak_bytes_in_use": pk}
                 for d, (nm, b, pk) in enumerate(zip(names.tolist(), base.tolist(),
                                                     peak.tolist()))]
    # the synthesized allocations: pre-existing blocks (their frees pair with them), then the
    # remainder of each device at address 0
    pre_id = np.arange(1, n_pre + 1, dtype=np.int64)   # listed by device, then address
    key_rows: dict[tuple[int, int], int] = {}
    for i, (d, p) in enumerate(zip(pre_dev, pre_ptr)):
        key_rows.setdefault((d, p), int(pre_id[i]))
    if n_pre:
        id_of_row = np.array([key_rows[(int(device[r]), int(c["addr"][r]))]
                              for r in pre_rows.tolist()], dtype=np.int64)
        alloc_id[pre_rows] = id_of_row
    pre_holder_idx = len(holders)
    holders = [*holders, PRE_EXISTING_HOLDER]
    holder[pre_rows] = pre_holder_idx
    rem_dev = [d for d, r in enumerate(remainder) if r > 0]
    rem_size = [remainder[d] for d in rem_dev]
    m_pre = n_pre + len(rem_dev)
    next_id = (int(alloc_id.max()) + 1) if n else 1
    syn = {
        "time_ns": np.full(m_pre, t0, dtype=np.int64),
        "kind": np.ones(m_pre, dtype=np.int8),
        "ptr": np.array(pre_ptr + [0] * len(rem_dev), dtype=np.int64),
        "size": np.array(pre_size + rem_size, dtype=np.int64),
        "requested": np.array(pre_req + rem_size, dtype=np.int64),
        "alloc_id": np.concatenate([pre_id, np.arange(next_id, next_id + len(rem_dev))]),
        "device": np.array(pre_dev + rem_dev, dtype=np.int16),
    }
    syn_holder = np.full(m_pre, pre_holder_idx, dtype=HOLDER_DTYPE)
    cols = {
        "time_ns": np.concatenate([syn["time_ns"], c["time_ns"]]),
        "kind": np.concatenate([syn["kind"], kind]),
        "ptr": np.concatenate([syn["ptr"], c["addr"]]),
        "size": np.concatenate([syn["size"], size]),
        "requested": np.concatenate([syn["requested"], req]),
        "alloc_id": np.concatenate([syn["alloc_id"], alloc_id]),
        "device": np.concatenate([syn["device"], device]),
    }
    total = len(cols["kind"])
    cols["seq"] = np.arange(total, dtype=np.int64)
    cols["bin"] = bins_for_sizes(cols["size"])
    cols["region"] = row_regions(cols)
    unmatched_allocs = int(np.count_nonzero((g_kind == 1) & np.r_[same[1:], False]
                                            & np.r_[g_kind[1:] == 1, False]))
    if inconsistent or unmatched_allocs:
        warnings.warn(
            f"{files[0]}: {inconsistent} memory event(s) report bytes in use that the events "
            f"before them do not add up to, and {unmatched_allocs} allocation(s) are followed "
            "by another at the same address without a free: the profiler dropped events; "
            "peaks and replays of this trace are approximate", GpudashWarning, stacklevel=3)
    meta = {
        "source": "xplane",
        "files": [str(f) for f in files],
        "run": files[0].parent.name if len(files) and run is None and Path(path).is_dir()
        else run,
        "devices": meta_devs,
        "allocator_names": [d["name"] for d in meta_devs],
        "inconsistent_events": inconsistent,
        "unmatched_frees": 0,
    }
    return Trace(cols, meta, holder=np.concatenate([syn_holder, holder]), holders=holders)


def _dense(values: np.ndarray, names: np.ndarray) -> np.ndarray:
    """Index of each value in ``names`` (all present), as int16."""
    order = np.argsort(names)
    pos = np.searchsorted(names[order], values)
    return order[pos].astype(np.int16)
