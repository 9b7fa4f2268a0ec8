"""Import PyTorch profiler traces (``prof.export_chrome_trace(...)``, ``.json`` or ``.json.gz``).

``torch.profiler.profile(profile_memory=True, with_stack=True)`` writes a Chrome trace (JSON
with ``traceEvents``, through Kineto; read here as PyTorch 2.13 writes it) in which every
call of PyTorch's allocators is an instant event, and every Python call a slice::

    {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid", "tid", "ts" (us),
     "args": {"Addr", "Bytes" (+ allocated / - freed), "Total Allocated", "Total Reserved",
              "Device Type" (0 CPU, 1 CUDA), "Device Id" (-1 for the CPU)}}
    {"ph": "X", "cat": "python_function", "name": "train.py(23): forward", "ts", "dur",
     "args": {"Python id", "Python parent id"}}
    {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts", "dur", ...}
    {"ph": "X", "cat": "user_annotation", "name": "step 3", "ts", "dur", ...}

PyTorch is not needed to read one.

Events
------
Each ``[memory]`` event is an ``alloc`` (``Bytes`` > 0) or a ``free`` (``Bytes`` < 0) of
``|Bytes|`` bytes at ``Addr``, at ``time_ns = baseTimeNanoseconds + ts * 1000`` (``ts``
alone when the file has no base time), in time order (file order for equal times).
``requested`` is the size: the profiler reports the block (for CUDA: PyTorch's rounded block
size), not the request.

Devices: CUDA memory (``Device Type`` 1, which ROCm builds also report) is device ``N``,
named ``cuda:N``, of the ``Device Id``; its capacity is the ``totalGlobalMem`` of the file's
``deviceProperties``. CPU memory (``Device Type`` 0) is a device of its own named ``cpu``
(index 0 in a CPU-only trace, else after the CUDA devices), kept by default only when the
trace has no CUDA memory event: in a GPU run the host tensors (inputs, the data loader's
batches) are another allocator's memory, and a replay or a peak of both together would
answer nothing. ``cpu=True`` keeps them as their own device, ``cpu=False`` leaves them out
always; what was left out is said in ``meta["left_out"]``. Memory of other device types
(MPS, XPU, ...) is left out and counted there too.

Pairing. Allocations and frees are paired by device and address, as the allocator pairs
them; what the profile did not see is made up as the other importers do:

- a free of an address the profile never saw allocated is a block allocated before the
  profile began: it gets an allocation at the trace's first instant (same address and
  size, holder ``"(in use before the profile)"``), counted per device in
  ``pre_existing_blocks``;
- what ``Total Allocated`` says was in use at a device's first event beyond those blocks
  (model weights loaded before the profile) is one more allocation at address 0 with that
  holder, never freed; so after every event the trace's bytes allocated equal the
  profiler's ``Total Allocated`` (``pre_existing_bytes`` says how much each device had;
  ``inconsistent_events`` counts events where they differ, with a warning). The CPU's
  events need neither in the trace of ``tests/data/real``: their ``Total Allocated`` counts
  only what the profile saw allocated, and no free of an older block appears;
- an allocation at an address still allocated means the earlier block was freed unseen:
  a free is added just before it (``meta["unseen_frees"]``);
- a free at an address already freed (its allocation unseen) is left out and counted in
  ``meta["unmatched_frees"]``; a 0-byte event in ``meta["zero_byte_events"]``.

A free takes the size, allocation id and holder of the allocation it frees, as in every
gpudash trace.

Who asked
---------
Each event's stack (:attr:`Trace.stack`, with ``with_stack=True``) is the innermost
``python_function`` slice of its thread (pid, tid) whose ``[ts, ts + dur]`` holds the event,
then that slice's ancestors by ``Python parent id``, innermost first, as frames
``Frame(file, line, function)`` parsed from ``file(line): function``. Slices that are not
Python code keep their name as a frame with no file: the C functions Python called
(``<built-in method relu of type object>``, the object's address dropped so that equal
calls are one frame) and the profiler's module marks (``nn.Module: Linear_0``). Stacks are
cut at :data:`MAX_STACK_DEPTH` frames.

What a profile's frames say differs from a memory snapshot's in two ways. A frame names the
line where its function begins (the profiler records each call's first line, not the line
running when memory was allocated), except for the calls already running when the profile
began (``<module>``, the function that opened the profiler), which keep the line running
then. And files are named relative to ``sys.path`` (``torch/nn/modules/linear.py``,
``train.py``, ``typing.py``): the standard library and installed packages cannot be told
from the user's code by their path, so ``top_holders(..., user_code=...)`` may be needed to
point at the right files. Events on a thread that runs no Python (the autograd engine's
threads that run a CUDA backward pass) have no stack. As in an imported memory snapshot, an
allocation's row holds the stack that allocated and a free's row the stack that freed; the
made-up rows have none.

Each allocation's holder (:attr:`Trace.holder`) is the innermost ``cpu_op`` slice of its
thread that holds it (``aten::addmm``, ``aten::empty_strided``), as TensorFlow's profiles
name an op; a free carries its allocation's. Both lookups are interval searches with numpy
(slices sorted by thread and start, a binary search per event, and a sparse table of the
slices' ends for the innermost one still open), not a scan of the slices per event.

``user_annotation`` slices (``record_function`` ranges, the optimizer's
``Optimizer.step#Adam.step``, ``ProfilerStep#N``) become ``meta["annotations"]``, ``{"names":
[...], "ranges": [[-1, name index, start_ns, end_ns], ...]}`` (device -1: they hold for
every device), so :func:`gpudash.trace.leaks` finds iterations and ``top_holders(...,
by="annotation")`` names them.

Allocator
---------
A profile records no allocator settings. ``meta["allocator"]`` is ``"torch"`` (answers
speak PyTorch's words, and a replay runs PyTorch's caching allocator with its defaults);
each device entry says which allocator recorded it (``recorded_by``: PyTorch's CUDA caching
allocator, or its CPU allocator) and the largest ``Total Allocated`` and, for CUDA,
``Total Reserved`` the profiler reported (``peak_bytes_allocated``,
``peak_bytes_reserved``): the reserved figure a replay through the caching allocator can be
checked against. ``meta["torch_version"]`` is the PyTorch version when the file says it.

Bounds
------
A ``.json.gz`` may expand to at most :data:`MAX_GZIP_RATIO` times its size, and any file
may hold at most one JSON object per byte read from disk (at least
:data:`MIN_OBJECTS`; the real trace of ``tests/data/real`` expands 16 times and holds one
per 11 bytes of its gzip file, one per 170 bytes of JSON): a 2 MB file that expands to
millions of events is refused before it is parsed. Numbers outside
what they can mean (a negative address, sizes of 2**63 or more, times that are not finite),
events that are not objects, memory events without ``Addr``, ``Bytes`` or ``Device Type``,
and JSON nested past Python's stack are refused with a :class:`~gpudash.TraceFormatError`
naming the file and the event.
"""

from __future__ import annotations

import json
import os
import re
import warnings
import zlib
from typing import IO, Any

import numpy as np

from .._errors import GpudashWarning, TraceFormatError
from .format import (HOLDER_DTYPE, MAX_DEVICE, PRE_EXISTING_HOLDER, Trace, bins_for_sizes, open_regular,
                     row_regions, source_name)
from .stacks import STACK_DTYPE, StackTable

from ..events import ALLOC as _ALLOC, FREE as _FREE
__all__ = ["load_torch_profile", "MAX_GZIP_RATIO", "MIN_OBJECTS", "MAX_STACK_DEPTH"]

#: A gzip-compressed trace may expand to at most this many times its size (Kineto's JSON
#: compresses about 16 times).
MAX_GZIP_RATIO = 200
#: Every file may hold at least this many JSON objects (events and their ``args``), however
#: small; beyond it, one per byte of the file as read from disk.
MIN_OBJECTS = 200_000
#: The most frames a stack keeps (the innermost ones).
MAX_STACK_DEPTH = 1000
#: The most frames all distinct stacks may hold together.
MAX_STACK_FRAMES = 50_000_000

_I63 = 1 << 63
_T_MAX = 1 << 62                     # ns: a time (base + ts) must stay below
_DUR_MAX = 1 << 60                   # ns: a duration must stay below
_GZIP = b"\x1f\x8b"
_FRAME = re.compile(r"^(.+?)\((\d{1,9})\): (.*)$", re.DOTALL)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>$")
_DEVICE_TYPES = {0: "cpu", 1: "cuda", 2: "mkldnn", 3: "opengl", 4: "opencl", 5: "ideep",
                 6: "hip", 7: "fpga", 8: "maia", 9: "xla", 10: "vulkan", 11: "metal",
                 12: "xpu", 13: "mps", 14: "meta", 15: "hpu", 16: "ve", 17: "lazy",
                 18: "ipu", 19: "mtia", 20: "privateuseone"}
_CPU, _CUDA = 0, 1
_NO_MEMORY = ("a PyTorch profiler trace without memory events: record it with "
              "torch.profiler.profile(profile_memory=True) (and with_stack=True for the lines "
              "that allocated)")


# ============================================================================ reading
def _read(path_or_file: str | os.PathLike | IO, name: str) -> tuple[bytes, int]:
    """The JSON text of the file (gunzipped when it is gzip) and the bytes read from disk."""
    if isinstance(path_or_file, (str, os.PathLike)):
        with open_regular(path_or_file) as f:
            data = f.read()
    else:
        data = path_or_file.read()
        if isinstance(data, str):
            data = data.encode()
    if not data:
        raise TraceFormatError(f"{name}: the file is empty")
    size = len(data)
    if data[:2] == _GZIP:
        data = gunzip(data, name, limit=max(1 << 20, size * MAX_GZIP_RATIO))
    return data, size


def gunzip(data: bytes, name: str, limit: int) -> bytes:
    """``data`` gunzipped (every member), refused past ``limit`` bytes of output.

    Raises
    ------
    TraceFormatError
        Damaged or cut-off gzip data, or more than ``limit`` bytes.
    """
    parts: list[bytes] = []
    total = 0
    rest = data
    try:
        while rest:
            d = zlib.decompressobj(wbits=31)
            chunk = d.decompress(rest, limit + 1 - total)
            while True:
                parts.append(chunk)
                total += len(chunk)
                if total > limit:
                    raise TraceFormatError(
                        f"{name}: the gzip data expand to more than {limit:,} bytes (gzip-"
                        f"compressed traces may expand to {MAX_GZIP_RATIO} times their size; "
                        "a real trace expands about 16 times)")
                if d.eof or not d.unconsumed_tail:
                    break
                chunk = d.decompress(d.unconsumed_tail, limit + 1 - total)
            if not d.eof:
                raise TraceFormatError(f"{name}: the gzip data are cut off (the file is "
                                       "incomplete)")
            rest = d.unused_data.lstrip(b"\x00")
            if rest and rest[:2] != _GZIP:
                raise TraceFormatError(f"{name}: bytes that are not gzip data follow the "
                                       "compressed trace")
    except zlib.error as exc:
        raise TraceFormatError(f"{name}: damaged gzip data ({exc})") from None
    return b"".join(parts)


def gunzip_head(data: bytes, size: int) -> bytes:
    """The first ``size`` bytes (or fewer) that the gzip data at the start of ``data``
    expand to; b"" when they are not gzip data."""
    try:
        return zlib.decompressobj(wbits=31).decompress(data, size)
    except zlib.error:
        return b""


def _parse(text: bytes, nbytes: int, name: str) -> tuple[dict, list]:
    """The header dict and the event list of a Chrome trace's JSON text."""
    cap = max(MIN_OBJECTS, nbytes)
    objects = text.count(b"{")
    if objects > cap:
        raise TraceFormatError(
            f"{name}: more than {cap:,} JSON objects in a file of {nbytes:,} bytes "
            f"(gpudash reads at most one per byte of the file, and at least {MIN_OBJECTS:,}; "
            "a real trace holds one per 10 bytes or more, compressed or not)")
    try:
        obj = json.loads(text)
    except RecursionError:
        raise TraceFormatError(f"{name}: JSON nested too deeply to be a PyTorch profiler "
                               "trace") from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{name}: not UTF-8 text ({exc.reason} at byte "
                               f"{exc.start:,})") from None
    except ValueError as exc:
        raise TraceFormatError(f"{name}: not a readable JSON trace ({exc})") from None
    if isinstance(obj, list):
        return {}, obj
    if not isinstance(obj, dict) or "traceEvents" not in obj:
        keys = sorted(str(k)[:40] for k in obj)[:8] if isinstance(obj, dict) else []
        raise TraceFormatError(
            f"{name}: expected a Chrome trace (a JSON object with 'traceEvents', as "
            f"torch.profiler's export_chrome_trace writes); found {type(obj).__name__}"
            + (f" with keys {keys}" if isinstance(obj, dict) else ""))
    events = obj["traceEvents"]
    if not isinstance(events, list):
        raise TraceFormatError(f"{name}: 'traceEvents' is {_what(events)}; expected a list "
                               "of events")
    return obj, events


def _what(value: Any) -> str:
    if isinstance(value, (str, int, float, bool, type(None))):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(value).__name__}"


# ============================================================================ events
class _Slices:
    """``X`` slices of one category as the file gives them: thread (a number per (pid,
    tid)), start and duration (us), name (an index into ``names``) and Python ids."""

    __slots__ = ("thread", "start", "dur", "name", "pyid", "parent", "names")

    def __init__(self) -> None:
        self.thread: list[int] = []
        self.start: list[Any] = []
        self.dur: list[Any] = []
        self.name: list[int] = []
        self.pyid: list[int] = []
        self.parent: list[int] = []
        self.names: dict[str, int] = {}


def _num(value: Any, where: str, what: str, top_ns: int = _T_MAX) -> float:
    """A time or duration in microseconds: a finite number 0 .. ``top_ns`` ns."""
    t = type(value)
    if t is not float and t is not int:
        raise TraceFormatError(f"{where}: {what} is {_what(value)}; expected a number of "
                               "microseconds")
    if not 0 <= value <= top_ns / 1000:    # NaN fails both
        raise TraceFormatError(f"{where}: {what} is {_what(value)}; expected a finite number "
                               f"of microseconds, 0 .. {top_ns // 1000:,}")
    return value


def _int(value: Any, where: str, what: str, lo: int = -_I63, hi: int = _I63 - 1) -> int:
    if type(value) is not int:
        raise TraceFormatError(f"{where}: {what} is {_what(value)}; expected an integer")
    if not lo <= value <= hi:
        shown = value if value.bit_length() < 100 else f"a {value.bit_length()}-bit number"
        raise TraceFormatError(f"{where}: {what} {shown} is outside {lo:,} .. {hi:,}")
    return value


def _collect(events: list, name: str) -> tuple[dict, _Slices, _Slices, _Slices]:
    """One pass over the events: the memory events' fields and the three kinds of slices."""
    threads: dict[Any, int] = {}
    mem: dict[str, list] = {k: [] for k in ("ts", "thread", "addr", "bytes", "dtype", "did",
                                            "total", "reserved", "index")}
    py, ops, ann = _Slices(), _Slices(), _Slices()
    kinds = {"python_function": py, "cpu_op": ops, "user_annotation": ann}

    def thread_of(e: dict, where: str) -> int:
        key = (e.get("pid"), e.get("tid"))
        try:
            t = threads.get(key)
        except TypeError:
            raise TraceFormatError(f"{where}: pid and tid are {_what(key[0])} and "
                                   f"{_what(key[1])}; expected numbers or strings") from None
        if t is None:
            t = threads[key] = len(threads)
        return t

    for i, e in enumerate(events):
        if e.__class__ is not dict:
            raise TraceFormatError(f"{name}: traceEvents[{i}] is {_what(e)}; expected an event "
                                   "object")
        ph = e.get("ph")
        if ph == "X":
            sl = kinds.get(e.get("cat"))
            if sl is None:
                continue
            where = f"{name}: traceEvents[{i}]"
            ts = _num(e.get("ts"), where, "ts")
            sl.start.append(ts)
            sl.dur.append(_num(e.get("dur", 0), where, "dur", _DUR_MAX))
            sl.thread.append(thread_of(e, where))
            text = e.get("name")
            if not isinstance(text, str):
                raise TraceFormatError(f"{where}: name is {_what(text)}; expected a string")
            nid = sl.names.get(text)
            if nid is None:
                nid = sl.names[text] = len(sl.names)
            sl.name.append(nid)
            if sl is py:
                args = e.get("args")
                if not isinstance(args, dict):
                    args = {}
                pid_ = args.get("Python id")
                par = args.get("Python parent id")
                sl.pyid.append(-1 if pid_ is None else
                               _int(pid_, where, "args['Python id']", 0))
                sl.parent.append(-1 if par is None else
                                 _int(par, where, "args['Python parent id']", 0))
        elif ph == "i" and e.get("name") == "[memory]":
            where = f"{name}: traceEvents[{i}] (a [memory] event)"
            args = e.get("args")
            if not isinstance(args, dict):
                raise TraceFormatError(f"{where}: args is {_what(args)}; expected an object "
                                       "with Addr, Bytes and Device Type")
            for key in ("Addr", "Bytes", "Device Type"):
                if key not in args:
                    raise TraceFormatError(
                        f"{where}: no '{key}' in its args (PyTorch's profiler records Addr, "
                        "Bytes, Device Type and Device Id with each; without them allocations "
                        "and frees cannot be paired)")
            mem["ts"].append(_num(e.get("ts"), where, "ts"))
            mem["thread"].append(thread_of(e, where))
            mem["addr"].append(_int(args["Addr"], where, "Addr", 0))
            mem["bytes"].append(_int(args["Bytes"], where, "Bytes", -_I63 + 1))
            mem["dtype"].append(_int(args["Device Type"], where, "Device Type", -(1 << 15),
                                     1 << 15))
            mem["did"].append(_int(args.get("Device Id", -1), where, "Device Id", -1,
                                   MAX_DEVICE))
            tot, res = args.get("Total Allocated"), args.get("Total Reserved")
            mem["total"].append(-1 if tot is None else
                                _int(tot, where, "Total Allocated", 0))
            mem["reserved"].append(-1 if res is None else
                                   _int(res, where, "Total Reserved", 0))
            mem["index"].append(i)
    return mem, py, ops, ann


def _ns(us: list, base: int, name: str) -> np.ndarray:
    """Times in microseconds (each checked 0 .. 2**62 ns) as int64 ns after ``base``.

    Raises
    ------
    TraceFormatError
        A time that would be 2**62 ns or more after adding ``base``.
    """
    ns = np.rint(np.asarray(us, dtype=np.float64) * 1000.0).astype(np.int64)
    if len(ns) and base + int(ns.max()) >= _T_MAX:
        raise TraceFormatError(f"{name}: a time {int(ns.max()):,} ns after the base time "
                               f"{base:,} ns is 2**62 ns or more")
    return base + ns


def _dur(us: list) -> np.ndarray:
    """Durations in microseconds (each checked 0 .. 2**60 ns) as int64 ns."""
    return np.rint(np.asarray(us, dtype=np.float64) * 1000.0).astype(np.int64)


# ============================================================================ intervals
def innermost(s_thread: np.ndarray, s_start: np.ndarray, s_end: np.ndarray,
              q_thread: np.ndarray, q_time: np.ndarray) -> np.ndarray:
    """For each query (thread, time), the slice of that thread that holds it and began
    last (for nested slices: the innermost), as an index into the slices, or -1.

    The slices must be sorted by (thread, start) with, among equal starts, the enclosing
    slice first. A binary search finds the last slice of the thread begun at or before the
    time; a sparse table of the running maximum of the ends over windows of 2**k slices
    then walks back, in ``log2(n)`` numpy steps for all queries at once, to the last of
    those still open at the time (its end at or after it).
    """
    n, q = len(s_start), len(q_time)
    out = np.full(q, -1, dtype=np.int64)
    if not n or not q:
        return out
    # thread-major keys: the thread, then the time's rank among all starts and times
    times = np.concatenate([s_start, q_time])
    _, rank = np.unique(times, return_inverse=True)
    rank = rank.reshape(-1).astype(np.int64)
    span = int(rank.max()) + 1
    s_key = s_thread.astype(np.int64) * span + rank[:n]
    q_key = q_thread.astype(np.int64) * span + rank[n:]
    pos = np.searchsorted(s_key, q_key, side="right") - 1
    # levels[k][j] = max(end[j - 2**k + 1 .. j]) (from 0 where j < 2**k - 1)
    levels = [s_end]
    k = 1
    while (1 << k) <= n:
        prev, h = levels[-1], 1 << (k - 1)
        cur = prev.copy()
        np.maximum(prev[h:], prev[:-h], out=cur[h:])
        levels.append(cur)
        k += 1
    for k in range(len(levels) - 1, -1, -1):
        live = np.flatnonzero(pos >= 0)
        if not len(live):
            break
        step = levels[k][pos[live]] < q_time[live]   # none of those 2**k slices is open
        pos[live[step]] -= 1 << k
    ok = np.flatnonzero(pos >= 0)
    good = (s_thread[pos[ok]] == q_thread[ok]) & (s_end[pos[ok]] >= q_time[ok])
    out[ok[good]] = pos[ok[good]]
    return out


def _sorted_slices(sl: _Slices, base: int, name: str) -> tuple[np.ndarray, ...]:
    """A kind of slices as arrays sorted by (thread, start, longest first, Python id):
    ``order`` (into the file's order), thread, start, end."""
    thread = np.asarray(sl.thread, dtype=np.int64)
    start = _ns(sl.start, base, name)
    end = start + _dur(sl.dur)
    pyid = np.asarray(sl.pyid, dtype=np.int64) if sl.pyid else np.zeros(len(start), np.int64)
    order = np.lexsort((pyid, -end, start, thread))
    return order, thread[order], start[order], end[order]


def _frame_of(text: str) -> tuple[str, int, str]:
    m = _FRAME.match(text)
    if m is not None:
        return m.group(1), int(m.group(2)), m.group(3)
    return "", 0, _ADDRESS.sub(">", text)


def _stacks(py: _Slices, hit: np.ndarray, name: str) -> tuple[np.ndarray, StackTable]:
    """The stack id of each slice in ``hit`` (indices in file order; -1: none) and the
    table of those stacks: each slice's frame, then its ancestors' by Python parent id.

    Every slice on the way is given a *chain*, its frame on top of its parent's chain
    (``(frame, parent chain)`` pairs interned, so equal call paths share one), walking up
    from each slice until a slice with a chain: each slice is walked once, and a cycle of
    parent ids ends the walk. Only the chains of the slices that events fall in become
    stacks (their innermost :data:`MAX_STACK_DEPTH` frames).
    """
    table = StackTable()
    out = np.full(len(hit), -1, dtype=STACK_DTYPE)
    has = hit >= 0
    if not has.any():
        return out, table
    frame_id = [table.intern_frame(*_frame_of(t)) for t in py.names]
    pyid = np.asarray(py.pyid, dtype=np.int64)
    parent_id = np.asarray(py.parent, dtype=np.int64)
    # parent slice of each slice (the first slice with that Python id), or -1
    valid = np.flatnonzero(pyid >= 0)
    ids, first = np.unique(pyid[valid], return_index=True)
    parent = np.full(len(pyid), -1, dtype=np.int64)
    if len(ids):
        at = np.minimum(np.searchsorted(ids, parent_id), len(ids) - 1)
        found = (parent_id >= 0) & (ids[at] == parent_id)
        parent[found] = valid[first[at[found]]]
    parent_l = parent.tolist()
    frame_l = py.name
    chain_of: dict[int, int] = {}                   # slice -> chain
    chains: dict[tuple[int, int], int] = {}         # (frame, parent chain) -> chain
    c_frame: list[int] = []
    c_up: list[int] = []
    hits = np.unique(hit[has]).tolist()
    for s in hits:
        path: list[int] = []
        on_path: set[int] = set()
        q = s
        while q >= 0 and q not in chain_of and q not in on_path:
            path.append(q)
            on_path.add(q)
            q = parent_l[q]
        cid = chain_of.get(q, -1) if q >= 0 else -1
        for node in reversed(path):
            key = (frame_id[frame_l[node]], cid)
            nxt = chains.get(key)
            if nxt is None:
                nxt = chains[key] = len(c_frame)
                c_frame.append(key[0])
                c_up.append(cid)
            cid = chain_of[node] = nxt
    budget = MAX_STACK_FRAMES
    stack_of: dict[int, int] = {}                   # chain -> stack id
    sid_of_hit = np.empty(len(hits), dtype=np.int64)
    for k, s in enumerate(hits):
        cid = chain_of[s]
        sid = stack_of.get(cid)
        if sid is None:
            frames = []
            c = cid
            while c >= 0 and len(frames) < MAX_STACK_DEPTH:
                frames.append(c_frame[c])
                c = c_up[c]
            budget -= len(frames)
            if budget < 0:
                raise TraceFormatError(
                    f"{name}: the Python stacks of the memory events hold more than "
                    f"{MAX_STACK_FRAMES:,} frames in all (gpudash's bound on what one import "
                    "may expand to)")
            sid = stack_of[cid] = table.intern(frames)
        sid_of_hit[k] = sid
    pos = np.searchsorted(np.asarray(hits, dtype=np.int64), hit[has])
    out[has] = sid_of_hit[pos]
    return out, table


def _annotations(ann: _Slices, base: int, name: str) -> dict | None:
    if not ann.start:
        return None
    start = _ns(ann.start, base, name)
    end = start + _dur(ann.dur)
    order = np.lexsort((-end, start))
    nid = np.asarray(ann.name, dtype=np.int64)[order]
    return {"names": list(ann.names),
            "ranges": [[-1, n, s, e] for n, s, e in zip(nid.tolist(), start[order].tolist(),
                                                        end[order].tolist())]}


# ============================================================================ the loader
def load_torch_profile(path_or_file: str | os.PathLike | IO, *,
                       cpu: bool | None = None) -> Trace:
    """Load the memory events of a PyTorch profiler trace as a :class:`Trace`.

    Parameters
    ----------
    path_or_file : str, os.PathLike or binary file
        What ``prof.export_chrome_trace(...)`` wrote (``.json``, or ``.json.gz``: gzip is
        recognised by its first bytes).
    cpu : bool, optional
        Keep the CPU's memory events as a device named ``cpu``. Default: only when the
        trace has no CUDA memory event (see the module docstring).

    Returns
    -------
    Trace
        One device per CUDA device (``cuda:N``, index N) and the CPU's when kept;
        ``meta["source"] = "pytorch-profile"``, ``meta["allocator"] = "torch"``; stacks
        (with ``with_stack=True``), holders (the innermost ``cpu_op``) and
        ``meta["annotations"]`` (``record_function`` ranges); the pairing, what was made up
        and what was left out in ``meta`` (see the module docstring).

    Raises
    ------
    TraceFormatError
        Not a Chrome trace, a trace without memory events (``profile_memory`` was off:
        the message says to turn it on), no memory event left for the devices asked for,
        a value that cannot be what its field means, or a file that would expand past
        gpudash's bounds (the message names the file and the event).
    """
    name = source_name(path_or_file)
    if cpu is not None and not isinstance(cpu, bool):
        raise TypeError(f"cpu must be True, False or None; got {cpu!r}")
    text, nbytes = _read(path_or_file, name)
    header, events = _parse(text, nbytes, name)
    del text
    base = header.get("baseTimeNanoseconds", 0)
    if base is None:
        base = 0
    base = _int(base, f"{name}: baseTimeNanoseconds", "the base time", 0, _T_MAX)
    mem, py, ops, ann = _collect(events, name)
    del events
    n_all = len(mem["ts"])
    if not n_all:
        said = header.get("profile_memory")
        raise TraceFormatError(
            f"{name}: {_NO_MEMORY}"
            + (" (the file says profile_memory was off)" if said in (0, False) else ""))
    dtype = np.asarray(mem["dtype"], dtype=np.int64)
    did = np.asarray(mem["did"], dtype=np.int64)
    nbytes_ev = np.asarray(mem["bytes"], dtype=np.int64)
    is_cuda, is_cpu = dtype == _CUDA, dtype == _CPU
    bad = np.flatnonzero(is_cuda & (did < 0))
    if len(bad):
        raise TraceFormatError(f"{name}: traceEvents[{mem['index'][int(bad[0])]}] (a [memory] "
                               f"event): a CUDA event with Device Id {int(did[bad[0]])}; "
                               f"expected 0 .. {MAX_DEVICE}")
    has_cuda = bool(is_cuda.any())
    keep_cpu = (not has_cuda) if cpu is None else cpu
    keep = is_cuda | (is_cpu & keep_cpu)
    left_out: dict[str, dict] = {}
    out_codes, out_inv = np.unique(dtype[~keep], return_inverse=True)
    out_events = np.bincount(out_inv.reshape(-1), minlength=len(out_codes))
    out_bytes = np.bincount(out_inv.reshape(-1), weights=np.maximum(nbytes_ev[~keep], 0),
                            minlength=len(out_codes))
    for code, count, nb in zip(out_codes.tolist(), out_events.tolist(), out_bytes.tolist()):
        label = _DEVICE_TYPES.get(code, f"device type {code}")
        why = ("the trace has CUDA memory events; pass cpu=True to keep the CPU's as a device "
               "of its own" if code == _CPU and cpu is None else
               "cpu=False" if code == _CPU else "gpudash reads CPU and CUDA memory only")
        left_out[label] = {"events": count, "bytes_allocated": int(nb), "why": why}
    if not keep.any():
        have = ", ".join(f"{v['events']:,} {k}" for k, v in left_out.items())
        raise TraceFormatError(f"{name}: no memory events left to read ({have} left out"
                               + ("; pass cpu=True or leave cpu unset to read the CPU's"
                                  if "cpu" in left_out else "") + ")")
    cuda_ids = sorted(set(did[is_cuda].tolist()))
    cpu_index = (max(cuda_ids) + 1) if cuda_ids else 0
    if keep_cpu and is_cpu.any() and cpu_index > MAX_DEVICE:
        raise TraceFormatError(f"{name}: no device index left for the CPU after cuda:"
                               f"{max(cuda_ids)}; pass cpu=False")
    device = np.where(is_cuda, did, cpu_index)

    # ---- time order, and who asked (before anything is left out: stacks need the threads)
    t = _ns(mem["ts"], base, name)
    thread = np.asarray(mem["thread"], dtype=np.int64)
    rows = np.flatnonzero(keep)
    rows = rows[np.argsort(t[rows], kind="stable")]
    stack, stacks = np.full(len(rows), -1, dtype=STACK_DTYPE), StackTable()
    if py.start:
        order, s_thread, s_start, s_end = _sorted_slices(py, base, name)
        hit = innermost(s_thread, s_start, s_end, thread[rows], t[rows])
        hit = np.where(hit >= 0, order[np.maximum(hit, 0)], -1)
        stack, stacks = _stacks(py, hit, name)
    op_of = np.full(len(rows), -1, dtype=np.int64)
    if ops.start:
        order, s_thread, s_start, s_end = _sorted_slices(ops, base, name)
        hit = innermost(s_thread, s_start, s_end, thread[rows], t[rows])
        op_of = np.where(hit >= 0, np.asarray(ops.name, dtype=np.int64)[order[
            np.maximum(hit, 0)]], -1)
    trace = _build(rows, t, device.astype(np.int64), np.asarray(mem["addr"], dtype=np.int64),
                   nbytes_ev, np.asarray(mem["total"], dtype=np.int64), stack, op_of,
                   list(ops.names), name)
    cols, holder, holders, stack_col, info = trace
    # ---- metadata
    reserved = np.asarray(mem["reserved"], dtype=np.int64)
    totals = np.asarray(mem["total"], dtype=np.int64)
    props = header.get("deviceProperties")
    capacity: dict[int, int] = {}
    if isinstance(props, list):
        for p in props:
            if isinstance(p, dict) and type(p.get("id")) is int and \
                    type(p.get("totalGlobalMem")) is int and 0 < p["totalGlobalMem"] < _I63:
                capacity.setdefault(p["id"], p["totalGlobalMem"])
    # per device, at once: whether it is CUDA, and the largest totals the profiler reported
    devs, d_inv = np.unique(device[rows], return_inverse=True)
    d_inv = d_inv.reshape(-1)
    first = np.full(len(devs), len(rows), dtype=np.int64)
    np.minimum.at(first, d_inv, np.arange(len(rows)))
    cuda_dev = is_cuda[rows][first]
    peak_tot = np.full(len(devs), -1, dtype=np.int64)
    np.maximum.at(peak_tot, d_inv, totals[rows])
    peak_res = np.full(len(devs), -1, dtype=np.int64)
    np.maximum.at(peak_res, d_inv, reserved[rows])
    entries = []
    for d, cuda, tot, res in zip(devs.tolist(), cuda_dev.tolist(), peak_tot.tolist(),
                                 peak_res.tolist()):
        entry = {"index": d, "name": f"cuda:{d}" if cuda else "cpu",
                 "capacity": capacity.get(d) if cuda else None, "options": None,
                 "recorded_by": ("PyTorch's CUDA caching allocator" if cuda else
                                 "PyTorch's CPU allocator"),
                 "pre_existing_bytes": info["pre_bytes"].get(d, 0),
                 "pre_existing_blocks": info["pre_blocks"].get(d, 0)}
        if tot >= 0:
            entry["peak_bytes_allocated"] = tot
        if cuda and res >= 0:
            entry["peak_bytes_reserved"] = res
        entries.append(entry)
    meta: dict[str, Any] = {
        "source": "pytorch-profile",
        "allocator": "torch",
        "devices": entries,
        "with_stack": bool(py.start),
        "unmatched_frees": info["unmatched"],
        "unseen_frees": info["unseen"],
        "inconsistent_events": info["inconsistent"],
        "zero_byte_events": info["zero"],
        "left_out": left_out,
        "base_time_ns": base,
    }
    for key in ("torch_version", "pytorch_version"):
        v = header.get(key)
        if isinstance(v, str) and v:
            meta["torch_version"] = v[:40]
            break
    annotations = _annotations(ann, base, name)
    if annotations is not None:
        meta["annotations"] = annotations
    if info["inconsistent"] or info["unseen"] or info["unmatched"]:
        warnings.warn(
            f"{name}: {info['inconsistent']} memory event(s) report a Total Allocated that the "
            f"events before them do not add up to, {info['unseen']} allocation(s) came at an "
            f"address still allocated and {info['unmatched']} free(s) at an address already "
            "freed: the profiler dropped events; peaks and replays of this trace are "
            "approximate", GpudashWarning, stacklevel=2)
    return Trace(cols, meta, holder=holder, holders=holders, stack=stack_col, stacks=stacks)


def _build(rows: np.ndarray, t: np.ndarray, device: np.ndarray, addr: np.ndarray,
           nbytes: np.ndarray, totals: np.ndarray, stack: np.ndarray, op_of: np.ndarray,
           op_names: list[str], name: str) -> tuple:
    """The trace's columns from the kept memory events (``rows``, in time order; ``stack``
    and ``op_of`` are per row), pairing allocations with frees (module docstring)."""
    t, dev, ptr, nb, tot = t[rows], device[rows], addr[rows], nbytes[rows], totals[rows]
    zero = nb == 0
    n_zero = int(zero.sum())
    if n_zero:
        live = ~zero
        t, dev, ptr, nb, tot = t[live], dev[live], ptr[live], nb[live], tot[live]
        stack, op_of = stack[live], op_of[live]
    n = len(nb)
    is_a = nb > 0
    size = np.abs(nb)
    # ---- pair by (device, address); in time order within each address
    grp = np.lexsort((np.arange(n), ptr, dev))
    g_dev, g_ptr, g_a = dev[grp], ptr[grp], is_a[grp]
    same = np.zeros(n, dtype=bool)
    same[1:] = (g_dev[1:] == g_dev[:-1]) & (g_ptr[1:] == g_ptr[:-1])
    prev_a = np.zeros(n, dtype=bool)
    prev_a[1:] = same[1:] & g_a[:-1]
    next_a = np.zeros(n, dtype=bool)            # an allocation follows in the same address
    next_a[:-1] = same[1:] & g_a[1:]
    partner = np.full(n, -1, dtype=np.int64)    # a free's allocation (event index)
    matched = ~g_a & prev_a
    gi = np.flatnonzero(matched)
    partner[grp[gi]] = grp[gi - 1]
    pre = grp[~g_a & ~same]                     # frees of blocks from before the profile
    unmatched = grp[~g_a & same & ~prev_a]      # frees at an address already freed
    unseen = grp[g_a & next_a]                  # allocations freed without a free event
    unseen_next = grp[np.flatnonzero(g_a & next_a) + 1]
    # ---- rows: made-up allocations first, then the events with the made-up frees
    n_pre = len(pre)
    pre = pre[np.lexsort((ptr[pre], dev[pre]))]
    t0 = int(t[0]) if n else 0
    drop = np.zeros(n, dtype=bool)
    drop[unmatched] = True
    kept = np.flatnonzero(~drop)
    # order keys: made-up allocations -1, event i at 2i+1, a made-up free just before 2i
    key = np.concatenate([np.full(n_pre, -1, dtype=np.int64), 2 * kept + 1,
                          2 * unseen_next.astype(np.int64)])
    kind = np.concatenate([np.full(n_pre, _ALLOC, dtype=np.int8),
                           np.where(is_a[kept], _ALLOC, _FREE).astype(np.int8),
                           np.full(len(unseen), _FREE, dtype=np.int8)])
    r_t = np.concatenate([np.full(n_pre, t0, dtype=np.int64), t[kept], t[unseen_next]])
    r_dev = np.concatenate([dev[pre], dev[kept], dev[unseen]])
    r_ptr = np.concatenate([ptr[pre], ptr[kept], ptr[unseen]])
    r_stack = np.concatenate([np.full(n_pre, -1, dtype=STACK_DTYPE), stack[kept],
                              np.full(len(unseen), -1, dtype=STACK_DTYPE)])
    # each row's allocation row (in these concatenated rows): events by index, made-up ones
    where = np.full(n, -1, dtype=np.int64)
    where[kept] = n_pre + np.arange(len(kept))
    alloc_row = np.full(len(key), -1, dtype=np.int64)
    alloc_row[:n_pre] = np.arange(n_pre)
    ev_rows = n_pre + np.arange(len(kept))
    a_ev = is_a[kept]
    alloc_row[ev_rows[a_ev]] = ev_rows[a_ev]
    f_ev = ~a_ev
    part = partner[kept[f_ev]]
    pre_row = np.full(n, -1, dtype=np.int64)
    pre_row[pre] = np.arange(n_pre)
    alloc_row[ev_rows[f_ev]] = np.where(part >= 0, where[np.maximum(part, 0)],
                                        pre_row[kept[f_ev]])
    alloc_row[n_pre + len(kept):] = where[unseen]
    r_size = np.concatenate([size[pre], size[kept], size[unseen]])
    r_size = r_size[alloc_row]                  # a free takes its allocation's size
    # holders: the innermost op of each allocation; frees carry their allocation's
    op_row = np.concatenate([np.full(n_pre, -1, dtype=np.int64), op_of[kept],
                             np.full(len(unseen), -1, dtype=np.int64)])
    used = np.unique(op_row[op_row >= 0])
    holders = [op_names[i] for i in used.tolist()]
    remap = np.full(len(op_names) + 1, -1, dtype=HOLDER_DTYPE)
    remap[used] = np.arange(len(used), dtype=HOLDER_DTYPE)
    r_holder = remap[op_row]                    # -1 maps through remap[-1] = -1
    pre_h = len(holders)
    holders.append(PRE_EXISTING_HOLDER)
    r_holder[:n_pre] = pre_h
    r_holder = r_holder[alloc_row]
    # ---- what Total Allocated says was in use before the first event, beyond those blocks
    order = np.argsort(key, kind="stable")
    delta = np.where(kind == _ALLOC, r_size, -r_size)
    ids, d_rows = np.unique(r_dev, return_inverse=True)
    d_rows = d_rows.reshape(-1)
    # the running bytes of each device, for all devices at once: each device's rows (in
    # order) are one run of a stable sort by device
    by = order[np.argsort(d_rows[order], kind="stable")]
    d_by = d_rows[by]
    starts = np.searchsorted(d_by, np.arange(len(ids)))
    counts = np.diff(np.append(starts, len(by)))
    cs = np.cumsum(delta[by])
    run = np.empty(len(key), dtype=np.int64)
    run[by] = cs - np.repeat(cs[starts] - delta[by][starts], counts)
    r_tot = np.concatenate([np.full(n_pre, -1, dtype=np.int64), tot[kept],
                            np.full(len(unseen), -1, dtype=np.int64)])
    remainder = np.zeros(len(ids), dtype=np.int64)
    rep = by[r_tot[by] >= 0]                    # rows that report a total, by device
    inconsistent = 0
    if len(rep):
        rep_dev, first = np.unique(d_rows[rep], return_index=True)
        remainder[rep_dev] = np.maximum(r_tot[rep[first]] - run[rep[first]], 0)
        inconsistent = int(np.count_nonzero(r_tot[rep] != run[rep] + remainder[d_rows[rep]]))
    pre_blocks: dict[int, int] = {}
    pre_bytes: dict[int, int] = {}
    for d, s in zip(dev[pre].tolist(), size[pre].tolist()):
        pre_blocks[d] = pre_blocks.get(d, 0) + 1
        pre_bytes[d] = pre_bytes.get(d, 0) + s
    rem_dev = [int(ids[k]) for k in range(len(ids)) if remainder[k] > 0]
    rem_size = [int(remainder[k]) for k in range(len(ids)) if remainder[k] > 0]
    for d, s in zip(rem_dev, rem_size):
        pre_bytes[d] = pre_bytes.get(d, 0) + s
    m = len(rem_dev)
    # ---- assemble in order: the remainders, then the rows by key
    o_kind = np.concatenate([np.full(m, _ALLOC, dtype=np.int8), kind[order]])
    o_alloc = np.concatenate([np.full(m, -1, dtype=np.int64), alloc_row[order]])
    pos_of = np.empty(len(order), dtype=np.int64)
    pos_of[order] = np.arange(len(order)) + m
    total_rows = m + len(order)
    alloc_id = np.zeros(total_rows, dtype=np.int64)
    is_alloc = o_kind == _ALLOC
    alloc_id[is_alloc] = np.arange(1, int(is_alloc.sum()) + 1)
    frees = np.flatnonzero(~is_alloc)
    alloc_id[frees] = alloc_id[pos_of[o_alloc[frees]]]
    cols = {
        "seq": np.arange(total_rows, dtype=np.int64),
        "time_ns": np.concatenate([np.full(m, t0, dtype=np.int64), r_t[order]]),
        "kind": o_kind,
        "ptr": np.concatenate([np.zeros(m, dtype=np.int64), r_ptr[order]]),
        "size": np.concatenate([np.asarray(rem_size, dtype=np.int64), r_size[order]]),
        "alloc_id": alloc_id,
        "device": np.concatenate([np.asarray(rem_dev, dtype=np.int64),
                                  r_dev[order]]).astype(np.int16),
    }
    cols["requested"] = cols["size"].copy()
    cols["bin"] = bins_for_sizes(cols["size"])
    cols["region"] = row_regions(cols)
    holder = np.concatenate([np.full(m, pre_h, dtype=HOLDER_DTYPE), r_holder[order]])
    stack_col = np.concatenate([np.full(m, -1, dtype=STACK_DTYPE), r_stack[order]])
    info = {"pre_blocks": pre_blocks, "pre_bytes": pre_bytes, "unmatched": len(unmatched),
            "unseen": len(unseen), "inconsistent": inconsistent, "zero": n_zero}
    if not (stack_col >= 0).any():
        stack_col = None
    if not (holder == pre_h).any():
        holders.pop()
    return cols, holder, holders, stack_col, info
