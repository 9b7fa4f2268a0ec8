"""Import and export PyTorch CUDA memory snapshots (``torch.cuda.memory._dump_snapshot``).

A snapshot is a dict of builtin types (``segments``, ``device_traces``,
``allocator_settings``...), written as a pickle by PyTorch or as JSON by MemoryViz and by
:func:`save_torch_snapshot`. Pickles are read with an unpickler that refuses every global, so
loading one never runs code; PyTorch is not needed.

Import
------
``device_traces[d]`` entries become events of device ``d``: ``alloc`` -> alloc,
``free_completed`` -> free (``free_requested`` only counted in ``meta["free_requested"]``),
``segment_alloc``/``segment_map`` -> extend, ``segment_free``/``segment_unmap`` -> release,
``oom`` -> oom (its ``device_free`` is kept in ``meta["oom_device_free"]`` as
``[row, bytes]``); ``time_us`` -> ``time_ns``. ``snapshot``, ``annotate`` and other actions are
counted in ``meta["skipped_actions"]``. Trace entries carry only a block's size, so
``requested`` is that size (or the entry's ``requested_size``, which gpudash's export adds).

The history is a ring buffer, so the trace may start after allocations and segments that
still exist. As MemoryViz does, the importer walks the trace backwards from the final
``segments`` to find what existed before its first entry, and adds an extend per such segment
and an alloc per such block first (counted in ``meta["reconstructed"]``). Without any trace
this gives the snapshot's state: one extend per segment, one alloc per allocated or
pending-free block (``active_allocated``, ``active_pending_free`` or
``active_awaiting_free``). Expandable segments are left out of that reconstruction (their
mapped ranges are not segment addresses). Legacy blocks with ``history: [{real_size, ...}]``
and no ``requested_size`` or ``address`` are read too.

Stacks
------
Each row keeps the call stack PyTorch recorded with its entry (:attr:`Trace.stack`, ids
into :attr:`Trace.stacks`): the entry's ``frames`` (Python and C++ frames alike, innermost
first as PyTorch lists them; each frame's ``filename``, ``line`` and ``name``, other keys
dropped) with its ``compile_context`` and ``user_metadata`` kept as PyTorch wrote them
(``"N/A"`` stays ``"N/A"``; an absent one is ``""``). An entry with no or empty ``frames``
and nothing else recorded (no metadata, a compile context absent, empty or ``"N/A"``) has
none (-1). An alloc row holds the allocating stack; a free row holds its own entry's
stack, which is where the block was freed (with ``context="all"``; PyTorch records the
allocation's stack there only with ``context="alloc"``). A rebuilt allocation or segment
takes the ``frames`` of its final block or segment (for legacy blocks: of the last
``history`` record); one rebuilt from a free in the trace has none: where it was allocated
was not recorded.

Annotations
-----------
``external_annotations`` (``record_function`` ranges: ``{name, stage: START|END, device,
time_us}``) are kept in ``meta["annotations"]`` as ``{"names": [name, ...], "ranges":
[[device, name index, start_ns, end_ns], ...]}``: each END closes the latest open START of
the same name and device (ranges nest), times in ns as ``time_ns``, ``null`` for a
range the trace saw only begin or only end, in the order of their START (of their END for
those that only end). No key when the snapshot has none.
"""

from __future__ import annotations

import bisect
import io
import json
import math
import os
import pickle
from collections import Counter
from typing import IO, Any

import numpy as np

from .._errors import TraceFormatError
from ..events import EventKind
from .format import Trace, _device_entries, _EventBuilder, _open_new, _open_regular, _source_name
from .stacks import STACK_DTYPE, Frame, Stack, StackTable
from .torch_trace import compact_segments

__all__ = ["load_torch_snapshot", "load_torch_snapshot_dict", "save_torch_snapshot"]

_ALLOCATED_STATES = {"active_allocated", "active_pending_free", "active_awaiting_free"}
_PENDING_STATES = {"active_pending_free", "active_awaiting_free"}


class _NoGlobalsUnpickler(pickle.Unpickler):
    """An unpickler for builtin data only: any global (class, function) is refused."""

    def __init__(self, file: IO[bytes], name: str) -> None:
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        raise TraceFormatError(
            f"refusing to load {self._name}: the pickle names the global {module}.{name}; a "
            "PyTorch memory snapshot holds only builtin types (dict, list, str, int, float)")

    def persistent_load(self, pid: Any) -> Any:
        raise TraceFormatError(
            f"refusing to load {self._name}: the pickle uses a persistent id; a PyTorch "
            "memory snapshot holds only builtin types")


def load_torch_snapshot_dict(path_or_file: str | os.PathLike | IO) -> dict:
    """The raw snapshot dict of a pickle or JSON file, loaded without running code.

    A legacy snapshot that is a bare list of segments is returned as ``{"segments": [...]}``.

    Raises
    ------
    TraceFormatError
        Neither a builtin-only pickle nor JSON, a pickle naming a global, or not a snapshot.
    """
    return _load_snapshot_dict(path_or_file)[0]


def _load_snapshot_dict(path_or_file: str | os.PathLike | IO) -> tuple[dict, int]:
    """:func:`load_torch_snapshot_dict` and the size of the file in bytes."""
    name = _source_name(path_or_file)
    if isinstance(path_or_file, (str, os.PathLike)):
        with _open_regular(path_or_file) as f:
            data = f.read()
    else:
        data = path_or_file.read()
        if isinstance(data, str):
            data = data.encode()
    obj = None
    if data[:1] == b"\x80":
        obj = _unpickle(data, name)
    else:
        try:
            obj = json.loads(data)
        except RecursionError:
            raise TraceFormatError(f"{name}: JSON nested too deeply to be a PyTorch memory "
                                   "snapshot") from None
        except (ValueError, UnicodeDecodeError):
            obj = _unpickle(data, name)   # protocol 0/1 pickles have no PROTO opcode
    if isinstance(obj, list):
        obj = {"segments": obj}
    if not isinstance(obj, dict) or not ({"segments", "device_traces"} & set(obj)):
        keys = [k[:40] for k in obj if isinstance(k, str)][:8] if isinstance(obj, dict) else []
        raise TraceFormatError(
            f"{name}: expected a PyTorch memory snapshot, a dict with 'segments' and/or "
            f"'device_traces'; found {type(obj).__name__}"
            + (f" with keys {sorted(keys)}" if isinstance(obj, dict) else ""))
    return obj, len(data)


#: The most segments + blocks + trace entries a snapshot may hold. Real snapshots hold far
#: fewer (the largest PyTorch keeps by default: ~10^6).
MAX_SNAPSHOT_ITEMS = 20_000_000
#: A file may hold at most one segment, block or trace entry per this many bytes (with a
#: floor of :data:`_MIN_ITEMS`). The smallest entry PyTorch or gpudash writes takes several
#: times more (a pickled trace entry: ~45 bytes; in JSON: ~100; the least a block or entry
#: that means anything can take, its keys memoised: 12), but a pickle can repeat one object
#: by reference (its memo) for 2 bytes, so that 2 MB expand to millions of entries: minutes
#: of work and gigabytes for nothing. Counting every reference against the file's size
#: bounds the work of an import by the size of what was read.
BYTES_PER_ITEM = 8
_MIN_ITEMS = 10_000
#: The most values (at any depth) of the ``allocator_settings`` kept in the metadata.
_MAX_SETTINGS_VALUES = 10_000


def _check_size(name: str, segments: list, traces: list, nbytes: int | None = None,
                extra: int = 0) -> None:
    """Refuse a snapshot whose segments, blocks and trace entries (and ``extra`` other
    items: annotations), counted with every repeated reference, exceed
    :data:`MAX_SNAPSHOT_ITEMS` or (for a file of ``nbytes``) one per :data:`BYTES_PER_ITEM`
    bytes, before walking them (len() of each list only: nothing is expanded)."""
    cap = MAX_SNAPSHOT_ITEMS
    if nbytes is not None:
        cap = min(cap, max(_MIN_ITEMS, nbytes // BYTES_PER_ITEM))
    total = len(segments) + extra   # a device's trace list is no item: only its entries are
    if total <= cap:
        for seg in segments:
            blocks = seg.get("blocks") if isinstance(seg, dict) else None
            total += len(blocks) if isinstance(blocks, list) else 0
            if total > cap:
                break
    if total <= cap:
        for t in traces:
            total += len(t) if isinstance(t, list) else 0
            if total > cap:
                break
    if total <= cap:
        return
    if cap == MAX_SNAPSHOT_ITEMS:
        raise TraceFormatError(
            f"{name}: more than {MAX_SNAPSHOT_ITEMS:,} segments, blocks and trace entries "
            "(gpudash's bound on what one import may expand to; a pickle's shared references "
            "can make a small file this large)")
    raise TraceFormatError(
        f"{name}: more than {cap:,} segments, blocks and trace entries in {nbytes:,} bytes "
        f"(gpudash's bound on what one import may expand to: one per {BYTES_PER_ITEM} bytes "
        "of the file; a pickle that repeats objects by reference holds more)")


def _unpickle(data: bytes, name: str) -> Any:
    try:
        return _NoGlobalsUnpickler(io.BytesIO(data), name).load()
    except TraceFormatError:
        raise
    except Exception as exc:  # any unpickling failure is a format error
        raise TraceFormatError(
            f"{name}: neither JSON nor a readable pickle ({type(exc).__name__}: {exc})") from None


_MAX_DEVICE = (1 << 15) - 1   # the trace's device column is int16


def _int(value: Any, where: str, what: str, top: int = (1 << 63) - 1) -> int:
    """``value``, an int in ``0 .. top`` (addresses, sizes and devices are never negative)."""
    if isinstance(value, bool) or not isinstance(value, int):
        text = repr(value) if isinstance(value, (str, float, type(None))) else \
            type(value).__name__
        raise TraceFormatError(f"{where}: expected an integer {what}, found {text[:60]}")
    if value < 0:
        raise TraceFormatError(f"{where}: a negative {what} ({value}); expected an integer "
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
            or not (math.isfinite(tu) and -(1 << 53) < tu < 1 << 53):
        text = repr(tu) if isinstance(tu, (int, float, str)) else type(tu).__name__
        raise TraceFormatError(f"{where}: time_us {text[:40]} is not a time in microseconds "
                               f"(a finite number below 2**53)")
    return int(tu) * 1000


class _StackInterner:
    """PyTorch's frames as a :class:`~gpudash.trace.stacks.StackTable`, each frame dict and
    each frames list read once.

    A pickle shares equal frames as one dict object and often one frames list between the
    entries of a call (alloc, or free_requested and free_completed), so frames are interned
    by the ``id()`` of their dict and stacks by the ``id()`` of their list (with the
    compile context and user metadata). Every object looked up belongs to the snapshot and
    all of them were alive together when it was loaded, so two of them never share an id,
    even after some are released.
    """

    __slots__ = ("table", "_frames", "_stacks", "_name")

    def __init__(self, name: str) -> None:
        self.table = StackTable()
        self._frames: dict[int, int] = {}
        self._stacks: dict[tuple[int, Any, Any], int] = {}
        self._name = name

    def of(self, frames: Any, cc: Any, um: Any, where: str) -> int:
        """The stack id of ``frames`` (PyTorch's frame dicts, innermost first) with a
        compile context and user metadata (-1: no frames and nothing else recorded)."""
        key = (id(frames), cc, um)
        try:
            sid = self._stacks.get(key)
        except TypeError:       # an unhashable compile context or metadata: refused below
            sid = None
        if sid is not None:
            return sid
        if frames is None:
            frames = ()
        elif not isinstance(frames, (list, tuple)):
            raise TraceFormatError(f"{where}.frames: expected a list of frames, found "
                                   f"{type(frames).__name__}")
        for what, value in (("compile_context", cc), ("user_metadata", um)):
            if value is not None and not isinstance(value, str):
                raise TraceFormatError(f"{where}.{what}: expected a string, found "
                                       f"{type(value).__name__}")
        cc = cc or ""
        um = um or ""
        if not frames and not um and cc in ("", "N/A"):
            sid = -1
        else:
            ids = tuple(self._frame(f, where, j) for j, f in enumerate(frames))
            sid = self.table._add_stack(Stack(ids, cc, um))
        self._stacks[key] = sid
        return sid

    def _frame(self, f: Any, where: str, j: int) -> int:
        fid = self._frames.get(id(f))
        if fid is None:
            if isinstance(f, dict):
                filename, line, name = f.get("filename"), f.get("line"), f.get("name")
            if not (isinstance(f, dict) and isinstance(filename, str)
                    and isinstance(name, str) and isinstance(line, int)
                    and not isinstance(line, bool)):
                raise TraceFormatError(
                    f"{where}.frames[{j}]: expected a frame, a dict with 'filename' (str), "
                    f"'line' (int) and 'name' (str); found {_short(f)}")
            fid = self._frames[id(f)] = self.table._add_frame(Frame(filename, line, name))
        return fid


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, (dict, str, int, float, type(None))) else \
        type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _entry_stack(stacks: _StackInterner, e: dict, where: str) -> int:
    return stacks.of(e.get("frames"), e.get("compile_context"), e.get("user_metadata"), where)


def _annotations(raw: Any, name: str) -> dict | None:
    """``external_annotations`` as ranges (see the module docstring), or None when the
    snapshot has none."""
    if not raw:
        return None
    if not isinstance(raw, list):
        raise TraceFormatError(f"{name}: external_annotations must be a list of "
                               f"{{name, stage, device, time_us}} dicts")
    names: dict[str, int] = {}
    ranges: list[list] = []
    open_: dict[tuple[int, int], list[int]] = {}
    for i, a in enumerate(raw):
        where = f"{name}: external_annotations[{i}]"
        if not isinstance(a, dict):
            raise TraceFormatError(f"{where}: expected a dict with name, stage, device and "
                                   f"time_us; found {type(a).__name__}")
        label, stage = a.get("name"), a.get("stage")
        if not isinstance(label, str) or stage not in ("START", "END"):
            raise TraceFormatError(f"{where}: expected a 'name' string and a 'stage' of "
                                   f"'START' or 'END'; found {_short(label)}, {_short(stage)}")
        dev = _int(a.get("device", 0), where, "device", _MAX_DEVICE)
        t = _time_ns(a.get("time_us"), where, 0) if a.get("time_us") is not None else None
        if t is None:
            raise TraceFormatError(f"{where}: no time_us (an annotation is placed by time)")
        nid = names.setdefault(label, len(names))
        if stage == "START":
            ranges.append([dev, nid, t, None])
            open_.setdefault((dev, nid), []).append(len(ranges) - 1)
        else:
            stack = open_.get((dev, nid))
            if stack:
                ranges[stack.pop()][3] = t
            else:
                ranges.append([dev, nid, None, t])
    return {"names": list(names), "ranges": ranges}


def load_torch_snapshot(path_or_file: str | os.PathLike | IO | dict, *,
                        reconstruct: bool = True) -> Trace:
    """Load a PyTorch memory snapshot (pickle, JSON or an already-loaded dict) as a Trace.

    Parameters
    ----------
    path_or_file : str, os.PathLike, binary file object or dict
    reconstruct : bool, default True
        Add the segments and allocations that existed before the first trace entry (see
        the module docstring). With False only the trace entries are imported (unless there
        are none, when the final state is).

    Returns
    -------
    Trace
        Devices ``cuda:N``; ``meta["source"] = "pytorch-snapshot"``, with
        ``allocator_settings``, ``free_requested``, ``pending_free_blocks``,
        ``reconstructed``, ``skipped_actions``, ``oom_device_free``.

    Raises
    ------
    TraceFormatError
        Unreadable file, a refused pickle global, or an entry without the fields its action
        needs (names ``device_traces[d][i]`` or ``segments[i]``).
    """
    nbytes = None
    if isinstance(path_or_file, dict):
        name, snap = "<dict>", path_or_file
    else:
        name = _source_name(path_or_file)
        snap, nbytes = _load_snapshot_dict(path_or_file)
    segments = snap.get("segments") or []
    traces = snap.get("device_traces") or []
    if not isinstance(segments, list) or not isinstance(traces, list):
        raise TraceFormatError(f"{name}: 'segments' and 'device_traces' must be lists")
    raw_annotations = snap.get("external_annotations")
    _check_size(name, segments, traces, nbytes,
                len(raw_annotations) if isinstance(raw_annotations, list) else 0)

    # ---- final state from segments
    final_segs: dict[int, dict[int, int]] = {}
    final_blocks: dict[int, dict[int, tuple[int, int]]] = {}
    # where each final segment and allocated block was made: (frames, entry, where)
    final_frames: dict[tuple[int, int], tuple[Any, dict, str]] = {}
    pending = 0
    for si, seg in enumerate(segments):
        where = f"{name}: segments[{si}]"
        if not isinstance(seg, dict):
            raise TraceFormatError(f"{where}: expected a dict, found {type(seg).__name__}")
        dev = _int(seg.get("device", 0), where, "device", _MAX_DEVICE)
        base = _int(seg.get("address"), where, "address")
        total = _int(seg.get("total_size"), where, "total_size")
        if not seg.get("is_expandable", False):
            final_segs.setdefault(dev, {})[base] = total
            final_frames[(dev, -1 - base)] = (seg.get("frames"), seg, where)
        offset = base
        for bi, blk in enumerate(seg.get("blocks") or []):
            bwhere = f"{where}.blocks[{bi}]"
            if not isinstance(blk, dict):
                raise TraceFormatError(f"{bwhere}: expected a dict")
            size = _int(blk.get("size"), bwhere, "size")
            addr = _int(blk.get("address", offset), bwhere, "address")
            offset = addr + size
            state = blk.get("state")
            if state is None and "allocated" in blk:  # very old snapshots
                state = "active_allocated" if blk["allocated"] else "inactive"
            if not isinstance(state, (str, type(None))):
                raise TraceFormatError(f"{bwhere}: expected a string state "
                                       "(active_allocated, inactive...), found "
                                       f"{type(state).__name__}")
            if state not in _ALLOCATED_STATES:
                continue
            pending += state in _PENDING_STATES
            req = blk.get("requested_size")
            hist = blk.get("history") or []
            last = hist[-1] if isinstance(hist, list) and hist and isinstance(hist[-1], dict) \
                else None
            if req is None and last is not None:
                req = last.get("real_size")
            final_frames[(dev, addr)] = (blk["frames"] if "frames" in blk else
                                         last.get("frames") if last is not None else None,
                                         blk, bwhere)
            final_blocks.setdefault(dev, {})[addr] = (size, _int(req if req is not None
                                                                 else size, bwhere,
                                                                 "requested_size"))

    # ---- trace entries
    entries: list[tuple[int, int, int, int, dict]] = []
    first_time: dict[int, int] = {}
    for dev, lst in enumerate(traces):
        if not lst:
            continue
        if not isinstance(lst, list):
            raise TraceFormatError(f"{name}: device_traces[{dev}] must be a list")
        if dev > _MAX_DEVICE:
            raise TraceFormatError(f"{name}: device_traces[{dev}] has entries; device indices "
                                   f"go up to {_MAX_DEVICE:,}")
        for i, e in enumerate(lst):
            where = f"{name}: device_traces[{dev}][{i}]"
            if not isinstance(e, dict) or not isinstance(e.get("action"), str):
                raise TraceFormatError(f"{where}: expected a dict with an 'action' string")
            t = _time_ns(e.get("time_us"), where, i)
            first_time.setdefault(dev, t)
            entries.append((t, 1, dev, i, e))

    # ---- what existed before the first entry: rebuilt as exact replay rebuilds it
    from .torch_trace import from_snapshot, start_state

    per_device = from_snapshot(snap, name)
    initial: list[tuple[int, int, int, int, dict]] = []
    n_rec_segs = n_rec_blocks = 0
    for dev, tt in per_device.items():
        if entries and not reconstruct:
            break
        t0 = first_time.get(dev, 0)
        state, _ = start_state(tt)
        for seg in state:     # the segments first, then what was allocated in them
            made = final_frames.get((dev, -1 - seg.address)) \
                if seg.freed_at < 0 and not seg.expandable else None
            initial.append((t0, 0, dev, len(initial), {
                "action": "segment_map" if seg.expandable else "segment_alloc",
                "addr": seg.address, "size": seg.size, "stream": seg.stream,
                "made": made}))
            n_rec_segs += 1
        for seg in state:
            for (addr, size, req), freed_at in zip(seg.blocks, seg.blocks_freed_at,
                                                    strict=True):
                initial.append((t0, 0, dev, len(initial), {
                    "action": "alloc", "addr": addr, "size": size, "requested_size": req,
                    "stream": seg.stream,
                    "made": final_frames.get((dev, addr)) if freed_at < 0 else None}))
                n_rec_blocks += 1
    prefix: dict[str, int] = {}
    for _, _, dev, _, _ in initial:
        prefix[str(dev)] = prefix.get(str(dev), 0) + 1

    b = _EventBuilder()
    stacks = _StackInterner(name)
    stack_col: list[int] = []
    free_requested = 0
    skipped: Counter[str] = Counter()
    oom_free: list[list[int]] = []
    all_entries = initial + entries
    all_entries.sort(key=lambda x: x[:4])
    for dev in sorted({x[2] for x in all_entries} | set(final_segs)):
        b.add_device(dev, f"cuda:{dev}")
    for t, phase, dev, i, e in all_entries:
        a = e["action"]
        where = (f"{name}: device_traces[{dev}][{i}]" if phase else
                 f"{name}: segments (device {dev})")
        if a == "free_requested":
            free_requested += 1
            continue
        if a not in _ROW_ACTIONS:
            skipped[str(a)] += 1
            continue
        if phase:
            stack_col.append(_entry_stack(stacks, e, where))
        else:   # rebuilt: the stack of the final block or segment it is, if any
            made = e["made"]
            stack_col.append(-1 if made is None else
                             _entry_stack(stacks, {"frames": made[0]}, made[2]))
        if a == "oom":
            size = _int(e.get("size"), where, "size")
            b.oom(t, dev, size, stream=_stream(e, where))
            oom_free.append([len(b) - 1, _int(e.get("device_free") or 0, where,
                                              "device_free")])
        elif a in ("alloc", "free_completed", "segment_alloc", "segment_map", "segment_free",
                   "segment_unmap"):
            addr = _int(e.get("addr"), where, "addr")
            size = _int(e.get("size"), where, "size")
            if a == "alloc":
                b.alloc(t, dev, addr, _int(e.get("requested_size", size), where,
                                           "requested_size"), size, stream=_stream(e, where))
            elif a == "free_completed":
                b.free(t, dev, addr, _int(e.get("requested_size", size), where,
                                          "requested_size"), size)
            elif a in ("segment_alloc", "segment_map"):
                b.extend(t, dev, addr, size, stream=_stream(e, where))
            else:
                b.release(t, dev, addr, size, stream=_stream(e, where))
    # trace entries carry no requested size: take it from the final blocks still live
    live = b.live()
    for dev, blocks in final_blocks.items():
        for addr, (size, req) in blocks.items():
            hit = live.get((dev, addr))
            if hit is not None and hit[1] == size and hit[2] != req:
                b.set_requested(dev, addr, req)
    meta = {
        "source": "pytorch-snapshot",
        "allocator_settings": _jsonable(snap.get("allocator_settings") or {}, name),
        "free_requested": free_requested,
        "pending_free_blocks": pending,
        "reconstructed": {"segments": n_rec_segs, "allocations": n_rec_blocks},
        "skipped_actions": dict(skipped),
        "oom_device_free": oom_free,
        "torch": {
            "version": ".".join(map(str, next(iter(per_device.values())).version))
            if per_device else "",
            "prefix": prefix,
            "final": {str(dev): compact_segments(tt.final)
                      for dev, tt in per_device.items() if tt.final is not None},
        },
    }
    annotations = _annotations(raw_annotations, name)
    if annotations is not None:
        meta["annotations"] = annotations
    t = b.build(meta)
    stack = np.array(stack_col, dtype=STACK_DTYPE) if any(s >= 0 for s in stack_col) else None
    return Trace(t.columns, t.meta, t.settings, holder=t.holder, holders=t.holders,
                 stream=t.stream, stack=stack, stacks=stacks.table)


_ROW_ACTIONS = frozenset(("alloc", "free_completed", "segment_alloc", "segment_map",
                          "segment_free", "segment_unmap", "oom"))


def _stream(entry: dict, where: str) -> int:
    """An entry's stream as a signed int64 (a cudaStream_t value; 0 when absent)."""
    s = entry.get("stream", 0)
    if s is None:
        return 0
    if isinstance(s, bool) or not isinstance(s, int) or not -(1 << 63) <= s < (1 << 64):
        raise TraceFormatError(f"{where}: expected an integer stream (a cudaStream_t value), "
                               f"found {s!r:.60}")
    return s - (1 << 64) if s >= 1 << 63 else s


def _jsonable(obj: Any, name: str = "<dict>") -> Any:
    """Tuples (pickled pool ids...) as lists, so meta equals its JSON round trip.

    At most :data:`_MAX_SETTINGS_VALUES` values (every reference counted: a pickle can
    repeat one list by reference until it expands to billions) and strings of a million
    characters in all, 32 levels deep; values that are not JSON (bytes, sets) become their
    type's name.
    """
    budget = [_MAX_SETTINGS_VALUES, 1 << 20]

    def too_big() -> TraceFormatError:
        return TraceFormatError(
            f"{name}: allocator_settings hold more than {_MAX_SETTINGS_VALUES:,} values or "
            "1,000,000 characters, or nest deeper than 32 levels (PyTorch writes a few "
            "dozen values)")

    def conv(o: Any, depth: int) -> Any:
        budget[0] -= 1
        if budget[0] < 0 or depth > 32:
            raise too_big()
        if isinstance(o, dict):
            out = {}
            for k, v in o.items():
                key = conv(k, depth + 1) if isinstance(k, str) else (
                    str(k) if isinstance(k, (int, float, bool, type(None))) else
                    f"<{type(k).__name__}>")
                out[key] = conv(v, depth + 1)
            return out
        if isinstance(o, (list, tuple)):
            return [conv(v, depth + 1) for v in o]
        if isinstance(o, str):
            budget[1] -= len(o)
            if budget[1] < 0:
                raise too_big()
            return o
        if o is None or isinstance(o, (bool, int, float)):
            return o
        return f"<{type(o).__name__}>"

    return conv(obj, 0)


class _FramesOut:
    """A stack table's stacks as PyTorch writes them: per stack one ``frames`` list of
    ``{"filename", "line", "name"}`` dicts, each frame dict and each list made once and
    shared by every entry that has it (a pickle then stores each once, as PyTorch's do)."""

    __slots__ = ("_table", "_frames", "_lists")

    def __init__(self, table: StackTable) -> None:
        self._table = table
        self._frames: dict[int, dict] = {}
        self._lists: dict[int, tuple[list, str, str]] = {}

    def of(self, sid: int) -> tuple[list, str, str]:
        """``(frames, compile_context, user_metadata)`` of stack ``sid`` (-1: none)."""
        if sid < 0:
            return [], "", ""
        out = self._lists.get(sid)
        if out is None:
            st = self._table.stacks[sid]
            frames = []
            for f in st.frames:
                d = self._frames.get(f)
                if d is None:
                    fr = self._table.frames[f]
                    d = self._frames[f] = {"filename": fr.filename, "line": fr.line,
                                           "name": fr.name}
                frames.append(d)
            out = self._lists[sid] = (frames, st.compile_context, st.user_metadata)
        return out

    def entry(self, sid: int, **fields: Any) -> dict:
        """A trace entry with the frames (and compile context and user metadata, where
        recorded) of stack ``sid``."""
        frames, cc, um = self.of(sid)
        fields["frames"] = frames
        if cc:
            fields["compile_context"] = cc
        if um:
            fields["user_metadata"] = um
        return fields


def _snapshot_dict(trace: Trace) -> dict:
    c = trace.columns
    kind = c["kind"].tolist()
    ptr, size, req = c["ptr"].tolist(), c["size"].tolist(), c["requested"].tolist()
    dev_col, t_col = c["device"].tolist(), (c["time_ns"] // 1000).tolist()
    sid_col = trace.stack_ids().tolist()
    out = _FramesOut(trace.stacks)
    entry = out.entry
    devices = set(dev_col) | set(_device_entries(trace.meta))
    n_dev = max(devices) + 1 if devices else 0
    traces: list[list[dict]] = [[] for _ in range(n_dev)]
    allocs: dict[tuple[int, int], tuple[int, int, int]] = {}
    segs: dict[tuple[int, int], tuple[int, int]] = {}
    ALLOC, FREE, EXTEND, RELEASE, OOM = (
        int(EventKind.ALLOC), int(EventKind.FREE), int(EventKind.EXTEND),
        int(EventKind.RELEASE), int(EventKind.OOM))
    for k, p, s, r, d, t, sid in zip(kind, ptr, size, req, dev_col, t_col, sid_col,
                                     strict=True):
        if k == ALLOC:
            traces[d].append(entry(sid, action="alloc", addr=p, size=s, requested_size=r,
                                   stream=0, time_us=t))
            allocs[(d, p)] = (s, r, sid)
        elif k == FREE:
            traces[d].append(entry(sid, action="free_requested", addr=p, size=s, stream=0,
                                   time_us=t))
            traces[d].append(entry(sid, action="free_completed", addr=p, size=s,
                                   requested_size=r, stream=0, time_us=t))
            allocs.pop((d, p), None)
        elif k == EXTEND:
            traces[d].append(entry(sid, action="segment_alloc", addr=p, size=s, stream=0,
                                   time_us=t))
            segs[(d, p)] = (s, sid)
        elif k == RELEASE:
            traces[d].append(entry(sid, action="segment_free", addr=p, size=s, stream=0,
                                   time_us=t))
            segs.pop((d, p), None)
        elif k == OOM:
            traces[d].append(entry(sid, action="oom", device_free=0, size=r, stream=0,
                                   time_us=t))
    # final state: live segments, tiled by their live blocks and inactive gaps
    segments = []
    for d in range(n_dev):
        starts = sorted(p for (dd, p) in segs if dd == d)
        members: dict[int, list[tuple[int, int, int, int]]] = {p: [] for p in starts}
        orphans = []
        for (dd, p), (s, r, sid) in sorted(allocs.items()):
            if dd != d:
                continue
            j = bisect.bisect_right(starts, p) - 1
            if j >= 0 and p < starts[j] + segs[(d, starts[j])][0]:
                members[starts[j]].append((p, s, r, sid))
            else:
                orphans.append((p, s, r, sid))
        for base in starts:
            total, sid = segs[(d, base)]
            segments.append(_segment(d, base, total, members[base], out.of(sid)[0], out))
        for p, s, r, sid in orphans:  # allocations outside any known segment
            segments.append(_segment(d, p, s, [(p, s, r, sid)], [], out))
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": trace.meta.get("allocator_settings") or {},
            "external_annotations": _annotations_out(trace.meta.get("annotations"))}


_KIND_OF_ACTION = {"alloc": int(EventKind.ALLOC), "free_completed": int(EventKind.FREE),
                   "segment_alloc": int(EventKind.EXTEND), "segment_map": int(EventKind.EXTEND),
                   "segment_free": int(EventKind.RELEASE),
                   "segment_unmap": int(EventKind.RELEASE), "oom": int(EventKind.OOM)}


def _with_stacks(snap: dict, recording: Trace, device: int, start: dict[int, int]) -> None:
    """Give a model's own snapshot (``CachingAllocator.snapshot()``, made alongside
    ``recording``, which records the same calls as events with stacks) the frames of
    ``recording``'s stacks: each trace entry its event's (``free_requested`` its
    ``free_completed``'s), each allocated block of the final segments its allocation's
    (``start``: stack ids of blocks allocated before the recording began, by address).
    Entries that do not line up with the events, kind by kind, are left as they are."""
    traces = snap.get("device_traces") or []
    entries = traces[device] if device < len(traces) else []
    k = recording.columns["kind"]
    sid = recording.stack_ids()
    by_kind = {kind: sid[k == kind].tolist() for kind in set(_KIND_OF_ACTION.values())}
    counts = Counter(_KIND_OF_ACTION.get(e.get("action")) for e in entries)
    if any(counts.get(kind, 0) != len(ids) for kind, ids in by_kind.items()):
        return
    out = _FramesOut(recording.stacks)
    pos = dict.fromkeys(by_kind, 0)
    got: list[int] = [-1] * len(entries)
    for i, e in enumerate(entries):
        kind = _KIND_OF_ACTION.get(e.get("action"))
        if kind is not None:
            got[i] = by_kind[kind][pos[kind]]
            pos[kind] += 1
    after: dict[Any, int] = {}     # address -> the stack of its next free_completed
    for i in range(len(entries) - 1, -1, -1):
        e = entries[i]
        if e.get("action") == "free_completed":
            after[e.get("addr")] = got[i]
        elif e.get("action") == "free_requested":
            got[i] = after.get(e.get("addr"), -1)
    for e, s in zip(entries, got, strict=True):
        if s >= 0:
            e["frames"], e["compile_context"], e["user_metadata"] = out.of(s)
    # the final blocks: the allocation live at each address
    live = dict(start)
    c = recording.columns
    for kind, p, s in zip(k.tolist(), c["ptr"].tolist(), sid.tolist()):
        if kind == _KIND_OF_ACTION["alloc"]:
            live[p] = s
        elif kind == _KIND_OF_ACTION["free_completed"]:
            live.pop(p, None)
    for seg in snap.get("segments") or []:
        if seg.get("device", 0) != device:
            continue
        for blk in seg.get("blocks") or []:
            s = live.get(blk.get("address"), -1)
            if s >= 0 and str(blk.get("state", "")).startswith("active"):
                blk["frames"] = out.of(s)[0]


def _annotations_out(ann: Any) -> list[dict]:
    """``meta["annotations"]`` (see the module docstring) back as PyTorch's
    ``external_annotations``: START and END entries by time."""
    if not isinstance(ann, dict) or not isinstance(ann.get("ranges"), list):
        return []
    names = ann.get("names") or []
    events = []
    for n, rng in enumerate(ann["ranges"]):
        try:
            dev, nid, lo, hi = rng
            label = names[nid]
        except (TypeError, ValueError, IndexError):
            continue
        zero = lo is not None and lo == hi
        # at one time: ends first (a range that ends where the next begins), a zero-length
        # range's START right before its END
        if lo is not None:
            events.append((lo // 1000, 1 if zero else 3, n, label, "START", dev))
        if hi is not None:
            events.append((hi // 1000, 2 if zero else 0, n, label, "END", dev))
    events.sort()
    return [{"name": label, "stage": stage, "device": dev, "time_us": t}
            for t, _, _, label, stage, dev in events]


def _segment(dev: int, base: int, total: int, blocks: list[tuple[int, int, int, int]],
             frames: list, out: _FramesOut) -> dict:
    blks, cursor = [], base
    for p, s, r, sid in blocks:
        if p > cursor:
            blks.append({"address": cursor, "size": p - cursor, "requested_size": 0,
                         "state": "inactive", "frames": []})
        blks.append({"address": p, "size": s, "requested_size": r,
                     "state": "active_allocated", "frames": out.of(sid)[0]})
        cursor = max(cursor, p + s)
    if cursor < base + total:
        blks.append({"address": cursor, "size": base + total - cursor, "requested_size": 0,
                     "state": "inactive", "frames": []})
    allocated = sum(s for _, s, _, _ in blocks)
    return {"device": dev, "address": base, "total_size": total, "allocated_size": allocated,
            "active_size": allocated, "requested_size": sum(r for _, _, r, _ in blocks),
            "stream": 0, "segment_type": "large" if total > (1 << 20) else "small",
            "segment_pool_id": [0, 0], "is_expandable": False, "frames": frames,
            "blocks": blks}


def save_torch_snapshot(trace: Trace, path: str | os.PathLike, *, overwrite: bool = False,
                        format: str | None = None) -> None:
    """Write ``trace`` as a PyTorch memory snapshot that MemoryViz can open.

    ``device_traces`` come from the events (alloc, free_requested + free_completed,
    segment_alloc, segment_free, oom; ``time_us`` = ``time_ns // 1000``; entries also carry
    ``requested_size``, which :func:`load_torch_snapshot` reads back); ``segments`` are the
    final state: the regions still extended, tiled by their live blocks and inactive gaps
    (a live allocation in no known region gets a segment of its own). Each entry carries its
    row's stack (:attr:`Trace.stack`) as ``frames`` (with ``compile_context`` and
    ``user_metadata`` where recorded; both entries of a free take the free row's), each
    allocated block its allocation's and each segment its extend's, so MemoryViz shows where
    memory was asked for; each frame dict and frames list is written once and shared. The
    ``meta["annotations"]`` ranges become ``external_annotations`` again.

    Parameters
    ----------
    trace : Trace
    path : str or os.PathLike
    overwrite : bool, default False
    format : {"json", "pickle"}, optional
        By default a protocol-4 pickle when ``path`` ends in ``.pickle`` or ``.pkl``, else
        JSON (MemoryViz reads both; it rejects protocol-5 pickles).

    Raises
    ------
    TraceFormatError
        ``path`` exists and ``overwrite`` is False.
    """
    if format is None:
        format = "pickle" if str(path).lower().endswith((".pickle", ".pkl")) else "json"
    if format not in ("json", "pickle"):
        raise ValueError(f"format must be 'json' or 'pickle'; got {format!r}")
    snap = _snapshot_dict(trace)
    with _open_new(path, overwrite) as f:
        if format == "pickle":
            pickle.dump(snap, f, protocol=4)
        else:
            f.write(json.dumps(snap, separators=(",", ":")).encode())
