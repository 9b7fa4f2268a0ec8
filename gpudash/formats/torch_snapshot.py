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

Loading
-------
A pickle is unpickled from its file (not from a copy of it in memory), with Python's
garbage collector paused for the load (each of its full collections would walk every
object of the snapshot). Each device's entries are then read in bulk into columns, a few
thousand at a time (:func:`~gpudash.formats.torch_trace.read_entries`), and, when the
snapshot was loaded from a file, released as they are read, so the columns grow into the
memory the entries leave: a load takes no more memory than ``pickle.load`` of the file.

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
import mmap
import os
import pickle
from collections import Counter, deque
from itertools import compress, repeat
from operator import itemgetter
from typing import IO, Any

import numpy as np

from .._accel import twin
from .._errors import TraceFormatError
from .._gc import collector_paused
from ..events import (
    EventKind, ALLOC as _ALLOC, FREE as _FREE, EXTEND as _EXTEND, RELEASE as _RELEASE, OOM as _OOM,
)
from .format import Trace, bins_for_sizes, device_entries, open_new, open_regular, row_regions, source_name
from .stacks import StackTable
from .torch_trace import (
    _MAX_DEVICE,
    A_ALLOC,
    A_FREE,
    A_FREE_REQ,
    A_MAP,
    A_OOM,
    A_SEG_ALLOC,
    A_SEG_FREE,
    A_UNMAP,
    ACTION_NAMES,
    StackInterner,
    TorchTrace,
    _int,
    _short,
    _stream_value,
    _time_ns,
    compact_segments,
    guess_version,
    read_entries,
    start_state,
)

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
    with collector_paused():
        return _load_snapshot_dict(path_or_file)[0]


def _load_snapshot_dict(path_or_file: str | os.PathLike | IO) -> tuple[dict, int]:
    """:func:`load_torch_snapshot_dict` and the size of the file in bytes."""
    name = source_name(path_or_file)
    if isinstance(path_or_file, (str, os.PathLike)):
        with open_regular(path_or_file) as f:
            if f.peek(1)[:1] == b"\x80":    # a pickle: read from the file, not a copy of it
                obj = _unpickle(f, name)
                return _snapshot_of(obj, name), os.fstat(f.fileno()).st_size
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
    return _snapshot_of(obj, name), len(data)


def _snapshot_of(obj: Any, name: str) -> dict:
    """A loaded object as a snapshot dict (a bare list of segments is one), or the error."""
    if isinstance(obj, list):
        obj = {"segments": obj}
    if not isinstance(obj, dict) or not ({"segments", "device_traces"} & set(obj)):
        keys = [k[:40] for k in obj if isinstance(k, str)][:8] if isinstance(obj, dict) else []
        raise TraceFormatError(
            f"{name}: expected a PyTorch memory snapshot, a dict with 'segments' and/or "
            f"'device_traces'; found {type(obj).__name__}"
            + (f" with keys {sorted(keys)}" if isinstance(obj, dict) else ""))
    return obj


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


# The opcodes a snapshot's pickle may hold, each with how its argument is read: a fixed
# number of bytes (>= 0), a length of 1, 4 or 8 bytes then that many bytes (-1, -4, -8), or
# text lines (-10: one, -20: two).
_ARG = {
    b"(": 0, b".": 0, b"0": 0, b"1": 0, b"2": 0, b"F": -10, b"I": -10, b"J": 4, b"K": 1,
    b"L": -10, b"M": 2, b"N": 0, b"S": -10, b"T": -4, b"U": -1, b"V": -10, b"X": -4,
    b"a": 0, b"d": 0, b"}": 0, b"e": 0, b"g": -10, b"h": 1, b"j": 4, b"l": 0, b"]": 0,
    b"p": -10, b"q": 1, b"r": 4, b"s": 0, b"t": 0, b")": 0, b"u": 0, b"G": 8,
    b"\x80": 1, b"\x85": 0, b"\x86": 0, b"\x87": 0, b"\x88": 0, b"\x89": 0, b"\x8a": -1,
    b"\x8b": -4, b"B": -4, b"C": -1, b"\x8c": -1, b"\x8d": -8, b"\x8e": -8, b"\x8f": 0,
    b"\x90": 0, b"\x91": 0, b"\x94": 0, b"\x95": 8, b"\x96": -8,
    # refused when met (a global or a persistent id: by the unpickler, with its message)
    b"c": -20, b"\x93": 0, b"P": -10, b"Q": 0,
}
_ARG = {op[0]: n for op, n in _ARG.items()}
_STRINGS = frozenset(b"SVXTU\x8c\x8d")      # opcodes that push a str


def _check_pickle(data: Any, name: str) -> None:
    """Refuse, before it is unpickled, a pickle that would take gigabytes or hours to load
    although it is small: a memo index far beyond the entries stored so far (the
    unpickler's memo is an array as long as the largest index: 9 bytes can ask for 2 GB),
    a dict key or set element that is not a string (a tuple shared at every level of a
    60-deep chain takes 2**60 steps to hash; ints can be made to collide; PyTorch keys
    every dict of a snapshot by a string), an opcode no snapshot holds (a class built, an
    extension, a buffer), or a length past the end. ``data``: the pickle's bytes (or an
    mmap of them). Stops at a global or a persistent id, which the unpickler refuses."""
    n = len(data)
    arg, strings = _ARG, _STRINGS
    stack: list[bool] = []          # per item: is it a str
    push = stack.append
    marks: list[int] = []
    memo: list[bool] = []
    from_bytes = int.from_bytes
    i = 0

    def refuse(why: str) -> TraceFormatError:
        return TraceFormatError(f"refusing to load {name}: {why} at byte {i:,} of the pickle "
                                "(a PyTorch memory snapshot holds only dicts keyed by "
                                "strings, lists, strings and numbers)")

    def unreadable(why: str) -> TraceFormatError:
        return TraceFormatError(f"{name}: neither JSON nor a readable pickle ({why} at byte "
                                f"{i:,})")

    while i < n:
        op = data[i]
        # the most frequent opcodes of a snapshot first
        if op == 0x6a:                  # LONG_BINGET
            k = from_bytes(data[i + 1:i + 5], "little")
            push(memo[k] if k < len(memo) else False)
            i += 5
            continue
        if op == 0x68:                  # BINGET
            k = data[i + 1] if i + 1 < n else 0
            push(memo[k] if k < len(memo) else False)
            i += 2
            continue
        if op == 0x94:                  # MEMOIZE
            memo.append(stack[-1] if stack else False)
            i += 1
            continue
        if op == 0x28:                  # MARK
            marks.append(len(stack))
            i += 1
            continue
        if op == 0x75 or op == 0x65:    # SETITEMS APPENDS
            k = marks.pop() if marks else 0
            if op == 0x75 and not all(stack[k::2]):
                raise refuse("a dict key that is not a string")
            del stack[k:]
            i += 1
            continue
        a = arg.get(op)
        if a is None:
            raise unreadable(f"the opcode {bytes([op])!r}, which no snapshot holds: it builds "
                             "an object other than builtin data, or is no opcode")
        j = i + 1
        if a > 0:
            end = j + a
        elif a == 0:
            end = j
        elif a >= -8:
            end = j - a + from_bytes(data[j:j - a], "little", signed=op == 0x8b)
            j -= a
        else:
            end = j
            for _ in range(-a // 10):
                end = data.find(b"\n", end) + 1
                if end == 0:
                    raise unreadable("a text argument with no end of line")
        if end > n or end < j:
            raise unreadable("an argument that runs past the end of the file")
        if op in strings:
            push(True)
        elif op == 0x71 or op == 0x72 or op == 0x70:    # PUT
            if op == 0x70:
                try:
                    k = int(data[j:end])
                except ValueError:
                    raise unreadable("a memo index that is not a number") from None
            else:
                k = from_bytes(data[j:end], "little")
            if not 0 <= k <= len(memo) + 256:
                raise refuse(f"the memo index {k:,} with {len(memo):,} entries stored")
            if k >= len(memo):
                memo.extend([False] * (k + 1 - len(memo)))
            memo[k] = stack[-1] if stack else False
        elif op == 0x67:                # GET, protocol 0
            try:
                k = int(data[j:end])
            except ValueError:
                k = -1
            push(memo[k] if 0 <= k < len(memo) else False)
        elif op == 0x90 or op == 0x91 or op == 0x64 or op == 0x6c or op == 0x74 or op == 0x31:
            # ADDITEMS FROZENSET DICT LIST TUPLE POP_MARK: back to the mark
            k = marks.pop() if marks else 0
            if op == 0x64 and not all(stack[k::2]):
                raise refuse("a dict key that is not a string")
            if (op == 0x90 or op == 0x91) and not all(stack[k:]):
                raise refuse("a set element that is not a string")
            del stack[k:]
            if op != 0x90 and op != 0x31:
                push(False)
        elif op == 0x73:                # SETITEM
            if len(stack) >= 2 and not stack[-2]:
                raise refuse("a dict key that is not a string")
            del stack[-2:]
        elif op == 0x61 or op == 0x30:  # APPEND POP
            del stack[-1:]
        elif op == 0x85 or op == 0x86 or op == 0x87:    # TUPLE1..3
            del stack[len(stack) - (op - 0x84):]
            push(False)
        elif op == 0x32:                # DUP
            push(stack[-1] if stack else False)
        elif op == 0x2e:                # STOP
            return
        elif op == 0x63 or op == 0x93 or op == 0x50 or op == 0x51:
            return                      # refused by the unpickler, with its own message
        elif op != 0x80 and op != 0x95:
            push(False)                 # a number, bytes, None, a bool, an empty container
        i = end


#: The check that runs: the compiled core's twin of :func:`_check_pickle` (the same verdicts
#: and messages, in C over the same buffer) where the core runs, else :func:`_check_pickle`.
_pickle_check = twin("check_pickle", _check_pickle)


def _check_source(data: bytes | IO[bytes], name: str) -> None:
    """:func:`_check_pickle` of bytes, or of a file (mapped, not read, when it can be; left
    at the position it was at)."""
    if isinstance(data, (bytes, bytearray)):
        _pickle_check(data, name)
        return
    pos = data.tell()
    try:
        if pos:
            raise ValueError("not at the start")
        mapped = mmap.mmap(data.fileno(), 0, access=mmap.ACCESS_READ)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        _pickle_check(data.read(), name)
    else:
        with mapped:
            _pickle_check(mapped, name)
    data.seek(pos)


def _unpickle(data: bytes | IO[bytes], name: str) -> Any:
    """The object a pickle (bytes or a binary file) holds, read with no global allowed."""
    _check_source(data, name)
    try:
        return _NoGlobalsUnpickler(io.BytesIO(data) if isinstance(data, bytes) else data,
                                   name).load()
    except TraceFormatError:
        raise
    except Exception as exc:  # any unpickling failure is a format error
        raise TraceFormatError(
            f"{name}: neither JSON nor a readable pickle ({type(exc).__name__}: {exc})") from None


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
        A dict is read, never changed. A snapshot read from a file is released entry by
        entry as it is converted, so a load takes no more memory than ``pickle.load``.
    reconstruct : bool, default True
        Add the segments and allocations that existed before the first trace entry (see
        the module docstring). With False only the trace entries are imported (unless there
        are none, when the final state is).

    Returns
    -------
    Trace
        Devices ``cuda:N``; ``meta["source"] = "pytorch-snapshot"``, with
        ``allocator_settings``, ``free_requested``, ``pending_free_blocks``,
        ``reconstructed``, ``skipped_actions``, ``oom_device_free``, ``annotations``
        (when the snapshot has some); the stacks in :attr:`Trace.stack`.

    Raises
    ------
    TraceFormatError
        Unreadable file, a refused pickle global, or an entry without the fields its action
        needs (names ``device_traces[d][i]`` or ``segments[i]``).
    """
    with collector_paused():
        if isinstance(path_or_file, dict):
            return _import(path_or_file, "<dict>", None, reconstruct, release=False)
        name = source_name(path_or_file)
        snap, nbytes = _load_snapshot_dict(path_or_file)
        return _import(snap, name, nbytes, reconstruct, release=True)



def _final_state(segments: list, name: str) -> tuple:
    """The final segments: non-expandable ones by device (address -> size), allocated blocks
    by device (address -> (size, requested)), where each was made ((frames, where) by
    ``(device, address)``, segments at ``-1 - address``), the count of blocks pending free,
    and the segment dicts by device."""
    final_segs: dict[int, dict[int, int]] = {}
    final_blocks: dict[int, dict[int, tuple[int, int]]] = {}
    final_frames: dict[tuple[int, int], tuple[Any, str]] = {}
    by_device: dict[int, list[dict]] = {}
    pending = 0
    for si, seg in enumerate(segments):
        where = f"{name}: segments[{si}]"
        if not isinstance(seg, dict):
            raise TraceFormatError(f"{where}: expected a dict, found {type(seg).__name__}")
        dev = _int(seg.get("device", 0), where, "device", _MAX_DEVICE)
        by_device.setdefault(dev, []).append(seg)
        base = _int(seg.get("address"), where, "address")
        total = _int(seg.get("total_size"), where, "total_size")
        if not seg.get("is_expandable", False):
            final_segs.setdefault(dev, {})[base] = total
            final_frames[(dev, -1 - base)] = (seg.get("frames"), where)
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
                                         bwhere)
            final_blocks.setdefault(dev, {})[addr] = (size, _int(req if req is not None
                                                                 else size, bwhere,
                                                                 "requested_size"))
    return final_segs, final_blocks, final_frames, pending, by_device


#: The trace event kind of each row action code (-1: no row).
_KIND_OF_CODE = np.full(len(ACTION_NAMES), -1, dtype=np.int8)
for _code, _kind in ((A_ALLOC, EventKind.ALLOC), (A_FREE, EventKind.FREE),
                     (A_SEG_ALLOC, EventKind.EXTEND), (A_MAP, EventKind.EXTEND),
                     (A_SEG_FREE, EventKind.RELEASE), (A_UNMAP, EventKind.RELEASE),
                     (A_OOM, EventKind.OOM)):
    _KIND_OF_CODE[_code] = int(_kind)


def _import(snap: dict, name: str, nbytes: int | None, reconstruct: bool,
            release: bool) -> Trace:
    """:func:`load_torch_snapshot` of a loaded snapshot dict (``release``: drop its entries
    as they are read)."""
    segments = snap.get("segments") or []
    traces = snap.get("device_traces") or []
    if not isinstance(segments, list) or not isinstance(traces, list):
        raise TraceFormatError(f"{name}: 'segments' and 'device_traces' must be lists")
    raw_annotations = snap.get("external_annotations")
    _check_size(name, segments, traces, nbytes,
                len(raw_annotations) if isinstance(raw_annotations, list) else 0)
    final_segs, final_blocks, final_frames, pending, final_by_dev = _final_state(segments,
                                                                                 name)
    settings = snap.get("allocator_settings") if isinstance(
        snap.get("allocator_settings"), dict) else None
    version = guess_version(snap)
    annotations = _annotations(raw_annotations, name)
    meta_settings = _jsonable(snap.get("allocator_settings") or {}, name)

    # ---- the trace entries, device by device, as columns (released as they are read)
    stacks = StackInterner()
    entries: dict[int, Any] = {}
    shared = Counter(id(lst) for lst in traces)
    for dev, lst in enumerate(traces):
        if not lst:
            continue
        if not isinstance(lst, list):
            raise TraceFormatError(f"{name}: device_traces[{dev}] must be a list")
        if dev > _MAX_DEVICE:
            raise TraceFormatError(f"{name}: device_traces[{dev}] has entries; device indices "
                                   f"go up to {_MAX_DEVICE:,}")
        own = release and shared[id(lst)] == 1
        entries[dev] = read_entries(lst, dev, name, stacks, release=own)
        if own:
            lst.clear()

    # ---- what existed before the first entry: rebuilt as exact replay rebuilds it
    parts: list[tuple] = []
    prefix: dict[str, int] = {}
    n_rec_segs = n_rec_blocks = 0
    skipped: Counter[str] = Counter()
    free_requested = 0
    devices = sorted(set(entries) | set(final_by_dev))
    finals = {}
    for dev in devices:
        ent = entries.get(dev)
        final = final_by_dev.get(dev)
        if final is not None:
            finals[str(dev)] = compact_segments(final)
        if (reconstruct or not entries):
            tt = ent.torch_trace(dev, final, settings, version) if ent is not None else \
                TorchTrace(dev, *(np.zeros(0, t) for t in (np.int8, np.int64, np.int64,
                                                           np.int64)), final, settings,
                           version)
            rebuilt = _rebuilt_rows(dev, tt, final_frames, stacks,
                                    int(ent.time_ns[0]) if ent is not None and len(ent.action)
                                    else 0, name)
            if rebuilt is not None:
                parts.append(rebuilt)
                prefix[str(dev)] = len(rebuilt[0])
                n_rec_segs += rebuilt[-1][0]
                n_rec_blocks += rebuilt[-1][1]
        if ent is not None:
            skipped.update(ent.skipped)
            free_requested += int(np.count_nonzero(ent.action == A_FREE_REQ))
            idx = np.flatnonzero(_KIND_OF_CODE[ent.action] >= 0)
            parts.append((ent.time_ns[idx], np.ones(len(idx), np.int8),
                          np.full(len(idx), dev, np.int16), idx, ent.action[idx],
                          ent.addr[idx], ent.size[idx], ent.stream[idx],
                          ent.requested[idx], ent.stack[idx], None))
            entries[dev] = None     # its columns are no longer needed
    row_devices = set(entries) | set(final_segs) | {int(d) for d in prefix}
    meta = {
        "source": "pytorch-snapshot",
        "allocator_settings": meta_settings,
        "free_requested": free_requested,
        "pending_free_blocks": pending,
        "reconstructed": {"segments": n_rec_segs, "allocations": n_rec_blocks},
        "skipped_actions": dict(skipped),
        "oom_device_free": [],
        "torch": {
            "version": ".".join(map(str, version)) if devices else "",
            "prefix": prefix,
            "final": finals,
        },
    }
    if annotations is not None:
        meta["annotations"] = annotations
    return _rows_to_trace(parts, sorted(row_devices), final_blocks, meta, stacks)


def _rebuilt_rows(dev: int, tt: TorchTrace, final_frames: dict, stacks: StackInterner,
                  t0: int, name: str) -> tuple | None:
    """The rows that rebuild what existed on ``dev`` when its trace began (columns as
    :func:`_rows_to_trace` takes them), or None."""
    state, _ = start_state(tt)
    if not state:
        return None
    where = f"{name}: segments (device {dev})"
    code, addr, size, stream, req, sid = [], [], [], [], [], []
    n_blocks = 0
    for seg in state:       # the segments first, then what was allocated in them
        made = final_frames.get((dev, -1 - seg.address)) \
            if seg.freed_at < 0 and not seg.expandable else None
        code.append(A_MAP if seg.expandable else A_SEG_ALLOC)
        addr.append(seg.address)
        size.append(seg.size)
        stream.append(seg.stream)
        req.append(-1)
        sid.append(-1 if made is None else stacks.of(made[0], None, None, made[1]))
    for seg in state:
        for (a, s, r), freed_at in zip(seg.blocks, seg.blocks_freed_at, strict=True):
            made = final_frames.get((dev, a)) if freed_at < 0 else None
            code.append(A_ALLOC)
            addr.append(a)
            size.append(s)
            stream.append(seg.stream)
            req.append(r)
            sid.append(-1 if made is None else stacks.of(made[0], None, None, made[1]))
            n_blocks += 1
    n = len(code)
    streams = np.array([_stream_value({"stream": s}, where) for s in stream], dtype=np.int64)
    return (np.full(n, t0, np.int64), np.zeros(n, np.int8), np.full(n, dev, np.int16),
            np.arange(n, dtype=np.int64), np.array(code, np.int8),
            np.array(addr, np.int64), np.array(size, np.int64), streams,
            np.array(req, np.int64), np.array(sid, np.int32), (len(state), n_blocks))


def _rows_to_trace(parts: list[tuple], devices: list[int], final_blocks: dict, meta: dict,
                   stacks: StackInterner) -> Trace:
    """The rows of every device (time, phase, device, index, code, address, size, stream,
    requested or -1, stack), put in order of (time, phase: rebuilt first, device, index),
    as a :class:`Trace`: ids from 1 in allocation order, each free paired with the live
    allocation at its address (taking its size, request, id and stream), sizes of refused
    requests rounded to 256, ``bin`` and ``region`` filled in, as an importer's builder
    does (:class:`~gpudash.formats.format.EventBuilder`)."""
    cols = [np.concatenate([p[k] for p in parts]) if parts else
            np.zeros(0, dt) for k, dt in enumerate((np.int64, np.int8, np.int16, np.int64,
                                                    np.int8, np.int64, np.int64, np.int64,
                                                    np.int64, np.int32))]
    parts.clear()
    t, phase, dev, idx, code, ptr, size, stream, req, sid = cols
    n = len(t)
    if n > 1 and not _in_order(t, phase, dev, idx):
        order = np.lexsort((idx, dev, phase, t))
        t, dev, code, ptr, size, stream, req, sid = (
            x[order] for x in (t, dev, code, ptr, size, stream, req, sid))
    del phase, idx, cols
    kind = _KIND_OF_CODE[code]
    del code
    is_a = kind == _ALLOC
    is_f = kind == _FREE
    is_o = kind == _OOM
    requested = np.where(req >= 0, req, size)
    requested[kind == _RELEASE] = 0
    alloc_id = np.full(n, -1, dtype=np.int64)
    alloc_id[is_a] = np.arange(1, int(is_a.sum()) + 1)
    # each free with the live allocation at its address: the previous alloc or free there
    af = np.flatnonzero(is_a | is_f)
    order = af[np.lexsort((af, ptr[af], dev[af]))]
    prev, cur = order[:-1], order[1:]
    same = (dev[prev] == dev[cur]) & (ptr[prev] == ptr[cur])
    hit = same & is_a[prev] & is_f[cur]
    a_rows, f_rows = prev[hit], cur[hit]
    unmatched = is_f.copy()
    unmatched[f_rows] = False
    size[f_rows] = size[a_rows]
    requested[f_rows] = requested[a_rows]
    alloc_id[f_rows] = alloc_id[a_rows]
    stream[f_rows] = stream[a_rows]
    stream[unmatched] = 0
    oom_rows = np.flatnonzero(is_o)
    device_free = ptr[oom_rows].tolist()
    ptr[oom_rows] = 0
    size[oom_rows] = (size[oom_rows] + 255) & ~255
    # trace entries carry no requested size: take it from the final blocks still live
    last = np.ones(len(order), dtype=bool)
    last[:-1] = ~same
    live = order[last & is_a[order]]
    if len(live) and final_blocks:
        for r, d, p, s, q in zip(live.tolist(), dev[live].tolist(), ptr[live].tolist(),
                                 size[live].tolist(), requested[live].tolist()):
            hit_ = final_blocks.get(d, {}).get(p)
            if hit_ is not None and hit_[0] == s and hit_[1] != q:
                requested[r] = hit_[1]
    meta["oom_device_free"] = [[r, f] for r, f in zip(oom_rows.tolist(), device_free)]
    meta["devices"] = [{"index": d, "name": f"cuda:{d}", "capacity": None, "options": None}
                       for d in devices]
    meta["unmatched_frees"] = int(unmatched.sum())
    columns = {"seq": np.arange(n, dtype=np.int64), "time_ns": t, "kind": kind, "ptr": ptr,
               "size": size, "requested": requested, "alloc_id": alloc_id, "device": dev}
    sized = is_a | is_f | is_o
    columns["bin"] = np.where(sized, bins_for_sizes(size), -1).astype(np.int8)
    columns["region"] = row_regions(columns)
    return Trace(columns, meta, stream=stream if stream.any() else None,
                 stack=sid if (sid >= 0).any() else None, stacks=stacks.table)


def _in_order(t: np.ndarray, phase: np.ndarray, dev: np.ndarray, idx: np.ndarray) -> bool:
    """Whether rows are already in order of (t, phase, dev, idx)."""
    dt = np.diff(t)
    if (dt < 0).any():
        return False
    tie = dt == 0
    if not tie.any():
        return True
    dp = np.diff(phase.astype(np.int64))[tie]
    dd = np.diff(dev.astype(np.int64))[tie]
    di = np.diff(idx)[tie]
    return bool(((dp > 0) | ((dp == 0) & ((dd > 0) | ((dd == 0) & (di > 0))))).all())


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

    __slots__ = ("_frames", "_lists", "_table")

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
    devices = set(dev_col) | set(device_entries(trace.meta))
    n_dev = max(devices) + 1 if devices else 0
    traces: list[list[dict]] = [[] for _ in range(n_dev)]
    allocs: dict[tuple[int, int], tuple[int, int, int]] = {}
    segs: dict[tuple[int, int], tuple[int, int]] = {}
    ALLOC, FREE, EXTEND, RELEASE, OOM = _ALLOC, _FREE, _EXTEND, _RELEASE, _OOM
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


_KIND_OR_REQUEST = {**_KIND_OF_ACTION, "free_requested": 100}


def _with_stacks(snap: dict, recording: Trace, device: int, start: dict[int, int]) -> None:
    """Give a model's own snapshot (``CachingAllocator.snapshot()``, made alongside
    ``recording``, which records the same calls as events with stacks) the frames of
    ``recording``'s stacks: each trace entry its event's (``free_requested`` its
    ``free_completed``'s), each allocated block of the final segments its allocation's
    (``start``: stack ids of blocks allocated before the recording began, by address).
    Entries that do not line up with the events, kind by kind, are left as they are."""
    traces = snap.get("device_traces") or []
    entries = traces[device] if device < len(traces) else []
    n = len(entries)
    k = recording.columns["kind"]
    sid = recording.stack_ids()
    kinds = np.fromiter(map(_KIND_OR_REQUEST.get, map(dict.get, entries, repeat("action")),
                            repeat(-1)), np.int8, n)
    got = np.full(n, -1, dtype=np.int64)
    for kind in set(_KIND_OF_ACTION.values()):
        mine = np.flatnonzero(kinds == kind)
        theirs = sid[k == kind]
        if len(mine) != len(theirs):
            return
        got[mine] = theirs
    # free_requested: its free_completed's (the next entry of that address)
    is_fc = kinds == _KIND_OF_ACTION["free_completed"]
    is_fr = kinds == _KIND_OR_REQUEST["free_requested"]
    if is_fr.any():
        addrs = list(map(dict.get, entries, repeat("addr")))
        fr = np.flatnonzero(is_fr[:-1] & is_fc[1:])       # the common case: right after
        fr = fr[[addrs[j] == addrs[j + 1] for j in fr.tolist()]] if len(fr) else fr
        got[fr] = got[fr + 1]
        is_fr[fr] = False
        if is_fr.any():         # the others: the next free_completed of the same address
            after: dict[Any, int] = {}
            for j in np.flatnonzero(is_fr | is_fc)[::-1].tolist():
                if is_fc[j]:
                    after[addrs[j]] = got[j]
                elif is_fr[j]:
                    got[j] = after.get(addrs[j], -1)
    out = _FramesOut(recording.stacks)
    keep = got >= 0
    if keep.any():
        sids = got[keep].tolist()
        made = {s: out.of(s) for s in set(sids)}
        values = list(map(made.__getitem__, sids))
        chosen = list(compress(entries, keep.tolist()))
        deque(map(dict.__setitem__, chosen, repeat("frames"), map(itemgetter(0), values)),
              maxlen=0)
        # the model writes "N/A" and "": only what the stacks recorded otherwise replaces it
        for j, key, default in ((1, "compile_context", "N/A"), (2, "user_metadata", "")):
            if any(v[j] not in ("", default) for v in made.values()):
                deque(map(dict.__setitem__, chosen, repeat(key), map(itemgetter(j), values)),
                      maxlen=0)
    # the final blocks: the allocation live at each address (its last event an alloc)
    c = recording.columns
    rows = np.flatnonzero((k == _KIND_OF_ACTION["alloc"]) | (k == _KIND_OF_ACTION[
        "free_completed"]))
    ptr = c["ptr"][rows]
    order = np.lexsort((rows, ptr))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = ptr[order][1:] != ptr[order][:-1]
    final_rows = rows[order[last]]
    touched = set(ptr.tolist()) if start else set()
    live = {p: s for p, s in start.items() if p not in touched}
    alive = final_rows[k[final_rows] == _KIND_OF_ACTION["alloc"]]
    live.update(zip(c["ptr"][alive].tolist(), sid[alive].tolist()))
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
    with open_new(path, overwrite) as f:
        if format == "pickle":
            pickle.dump(snap, f, protocol=4)
        else:
            f.write(json.dumps(snap, separators=(",", ":")).encode())
