"""Who holds the memory: the allocations live at a moment of a trace, grouped by who made them.

A trace's allocations may carry a call stack (:attr:`gpudash.trace.Trace.stack`: PyTorch
records one per allocator call) and a holder string (:attr:`gpudash.trace.Trace.holder`: the
op of a TensorFlow profile or log, a gpudash session's label). :func:`top_holders` adds up
the allocations live at a moment by one of them:

- ``by="line"`` (the default when the trace has stacks): the innermost frame of the user's
  own code, ``train.py:88 forward`` (:mod:`gpudash.trace.callers` says which frames are the
  user's; ``user_code=`` changes it); ``"function"`` and ``"file"`` the same frame's function
  or file; ``"stack"`` the whole stack;
- ``by="annotation"``: the innermost ``record_function`` range open when the allocation was
  made (``meta["annotations"]``);
- ``by="category"``: parameters, gradients, optimizer state, activations, temporaries or
  unknown (:mod:`gpudash.trace.categories`), each row with the rules that placed its bytes;
- ``by="holder"`` (the default without stacks): the holder strings.

The moment (``at=``) is ``"peak"`` (the first event after which the bytes allocated are
highest), ``"oom"`` (just before the first refused allocation), ``"end"``, an event index
(an ``int``: the state after that row) or a time from the trace's first event: a ``float`` of
seconds or a string with a unit, ``"12.5s"``, ``"300ms"``, ``"40us"``, ``"5ns"`` (the state
after the last event at or before it).

Everything is a numpy group-by: the call site of each distinct stack is found once and
mapped to the allocations by stack id, so a million events take well under a second.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import ConfigError, GpudashError
from .._units import format_bytes
from ..events import ALLOC as _ALLOC, FREE as _FREE, OOM as _OOM
from ..models import trace_model
from .callers import (NO_ANNOTATION, NO_STACK, CallSites, annotation_ranges, annotations_at,
                      call_sites, frame_text, short_paths, stack_lines, user_code_rule)
from .categories import CATEGORIES, RULES, categorize, stack_flags
from ..formats.format import PRE_EXISTING_HOLDER, Trace, device_entries
from ..formats.stacks import Frame

__all__ = ["top_holders", "HolderBytes", "HolderTable", "Moment", "resolve_moment",
           "allocations", "Allocations", "UNNAMED", "BY", "EventIndexError"]

#: The name :func:`top_holders` gives allocations without a holder.
UNNAMED = "(no holder)"
#: What ``by=`` accepts.
BY = ("line", "function", "file", "stack", "annotation", "category", "holder")
_STACK_BY = ("line", "function", "file", "stack")
_NEVER = np.iinfo(np.int64).max
_TIME = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(s|ms|us|µs|ns)\s*$")
_UNIT_NS = {"s": 1e9, "ms": 1e6, "us": 1e3, "µs": 1e3, "ns": 1.0}
_AT_TEXT = ("at must be 'peak', 'oom', 'end', an event index (an int) or a time from the "
            "trace's first event (a float of seconds, or a string with a unit: '12.5s', "
            "'300ms')")


class EventIndexError(GpudashError, IndexError):
    """An event index outside the trace."""


@dataclass(frozen=True)
class HolderBytes:
    """Bytes one holder (a line, a stack, a category...) has live at a moment.

    Attributes
    ----------
    holder : str
        What the row is, as people read it (``train.py:88 forward``).
    bytes : int
        Bytes of its live allocations (the allocator's block or chunk sizes).
    allocations : int
        How many.
    key : object
        What the row groups by, comparable across traces (a :class:`Frame` for lines, a
        tuple of frames for stacks, a string otherwise).
    frames : tuple of Frame
        The stack of its largest allocation, innermost first (empty: none recorded).
    stack_ids : tuple of int
        Every distinct stack id that fell into the row, most bytes first.
    rules : tuple of (str, int)
        ``by="category"``: the rules that placed its bytes, and their bytes.
    """

    holder: str
    bytes: int
    allocations: int
    key: Any = None
    frames: tuple = ()
    stack_ids: tuple = ()
    rules: tuple = ()

    def __str__(self) -> str:
        return f"{self.holder}: {format_bytes(self.bytes)} in {self.allocations} allocation(s)"


@dataclass(frozen=True)
class Moment:
    """A moment of a trace, as :func:`resolve_moment` resolved an ``at=``.

    Attributes
    ----------
    asked : object
        The ``at`` given.
    event : int
        The trace row the state is taken after (-1: before any event); for ``"oom"`` the row
        before the refused allocation.
    device : int or None
        The device (None: every device together).
    time_s : float or None
        Seconds from the trace's first event to ``event``.
    text : str
        The moment in words.
    oom_row : int
        ``"oom"``: the refused allocation's row; else -1.
    """

    asked: Any
    event: int
    device: int | None
    time_s: float | None
    text: str
    oom_row: int = -1


@dataclass
class Allocations:
    """Every allocation of the selected device(s), paired with its free.

    Attributes
    ----------
    row : numpy.ndarray of int64
        The alloc rows, in trace order.
    free_row : numpy.ndarray of int64
        The row of each one's free (int64 max: not freed in the trace).
    size, device, stack : numpy.ndarray
    """

    row: np.ndarray
    free_row: np.ndarray
    size: np.ndarray
    device: np.ndarray
    stack: np.ndarray

    def live_after(self, event: int) -> np.ndarray:
        """Indices (into these arrays) of the allocations live after row ``event``."""
        return np.flatnonzero((self.row <= event) & (self.free_row > event))


def allocations(trace: Trace, device: int | None = None) -> Allocations:
    """Pair every allocation of ``trace`` (of ``device``, or all) with its free, as
    :meth:`Trace.calls` pairs them: by allocation id (with the device), else by pointer; a
    free that matches no live allocation is left out."""
    c = trace.columns
    kind, aid, dev = c["kind"], c["alloc_id"], c["device"]
    sel = (kind == _ALLOC) | (kind == _FREE)
    if device is not None:
        sel &= dev == device
    rows = np.flatnonzero(sel)
    fast = _pair_by_id(rows, kind[rows], aid[rows], dev[rows])
    if fast is not None:
        a_rows, free_row = fast
    else:
        calls = trace.calls(device)
        op, key, crow = calls.op, calls.key, calls.row
        is_a = op == 1
        a_rows = crow[is_a].astype(np.int64)
        # in (key, row) order each free follows the allocation it frees
        order = np.lexsort((crow, key))
        o_op = op[order]
        freed_at = np.flatnonzero(o_op == 2)
        prev = freed_at - 1
        ok = (prev >= 0) & (o_op[np.maximum(prev, 0)] == 1) & \
            (key[order][np.maximum(prev, 0)] == key[order][freed_at])
        free_of = np.full(len(op), _NEVER, dtype=np.int64)       # by call position
        free_of[order[prev[ok]]] = crow[order[freed_at[ok]]]
        free_row = free_of[is_a]
    return Allocations(row=a_rows, free_row=free_row, size=c["size"][a_rows].astype(np.int64),
                       device=dev[a_rows].astype(np.int64),
                       stack=trace.stack_ids()[a_rows].astype(np.int64))


def _pair_by_id(rows: np.ndarray, kind: np.ndarray, aid: np.ndarray, dev: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray] | None:
    """The common case in O(n) and no sort: every allocation has a positive id, unique on
    its device and small enough to index an array, and each is freed at most once, after
    it was made. None where that does not hold (the caller pairs as :meth:`Trace.calls`)."""
    if not len(rows):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    is_a = kind == _ALLOC
    if not is_a.any() or int(aid[is_a].min()) <= 0:
        return None
    lo, hi = int(dev.min()), int(dev.max())
    span = hi - lo + 1
    if int(aid.max()) * span > 8 * len(rows) + 4096:
        return None
    key = aid.astype(np.int64) * span + (dev.astype(np.int64) - lo)
    key_a = key[is_a]
    counts = np.bincount(key_a, minlength=int(key.max()) + 1)
    if counts.max() > 1:
        return None
    is_f = ~is_a & (aid > 0)
    key_f = key[is_f]
    hit = counts[key_f] == 1
    key_f = key_f[hit]
    if len(key_f) and np.bincount(key_f).max() > 1:
        return None
    free_at = np.full(len(counts), _NEVER, dtype=np.int64)
    free_at[key_f] = rows[is_f][hit]
    a_rows = rows[is_a].astype(np.int64)
    free_row = free_at[key_a]
    if (free_row < a_rows).any():       # a free before its allocation: not this case
        return None
    return a_rows, free_row


def _device_name(trace: Trace, device: int | None) -> str:
    if device is None:
        return "every device"
    entry = device_entries(trace.meta).get(device)
    if entry is not None and entry.get("name"):
        return f"device {device} ({entry['name']})"
    return f"device {device}"


def _parse_at(at: Any) -> tuple[str, Any]:
    """``at`` as (kind, value): ("peak"|"oom"|"end", None), ("index", int), ("time", ns)."""
    if isinstance(at, (bool, np.bool_)):
        raise ConfigError(f"{_AT_TEXT}; got {at!r}")
    if isinstance(at, (int, np.integer)):
        return "index", int(at)
    if isinstance(at, (float, np.floating)):
        if not np.isfinite(at) or at < 0:
            raise ConfigError(f"{_AT_TEXT}; a time must be finite and >= 0, got {at!r}")
        return "time", float(at) * 1e9
    if isinstance(at, str):
        s = at.strip().lower()
        if s in ("peak", "oom", "end"):
            return s, None
        if re.fullmatch(r"-?\d+", s):
            return "index", int(s)
        m = _TIME.match(at)
        if m:
            return "time", float(m.group(1)) * _UNIT_NS[m.group(2)]
    raise ConfigError(f"{_AT_TEXT}; got {at!r:.60}")


def resolve_moment(trace: Trace, at: Any = "peak", device: int | None = None,
                   allocs: Allocations | None = None) -> Moment:
    """The trace row a moment names (see the module docstring for ``at``'s forms).

    Raises
    ------
    ConfigError
        An ``at`` of another form, a negative or infinite time, or ``"oom"`` where the trace
        (or ``device``) has no refused allocation.
    EventIndexError
        An event index outside the trace.
    """
    kind, value = _parse_at(at)
    c = trace.columns
    n = len(trace)
    t = c["time_ns"]
    t0 = int(t.min()) if n else 0

    def secs(row: int) -> float | None:
        return (int(t[row]) - t0) / 1e9 if 0 <= row < n else None

    where = _device_name(trace, device)

    def ev(row: int) -> str:
        when = secs(row)
        return f"event {row:,}" + (f", {when:.3f} s after the first event"
                                   if when is not None else "")

    if kind == "end":
        return Moment(at, n - 1, device, secs(n - 1), f"the end of the trace ({ev(n - 1)})")
    if kind == "index":
        i = value + n if value < 0 else value
        if not 0 <= i < n:
            raise EventIndexError(f"event index {value} out of range for a trace of {n:,} "
                                  "events")
        return Moment(at, i, device, secs(i), ev(i))
    if kind == "time":
        limit = t0 + value
        hits = np.flatnonzero(t <= limit)
        row = int(hits.max()) if len(hits) else -1
        shown = f"{value / 1e9:g} s after the trace's first event"
        return Moment(at, row, device, value / 1e9,
                      f"{shown} (event {row:,})" if row >= 0 else f"{shown} (before any event)")
    if kind == "oom":
        is_oom = c["kind"] == _OOM
        if device is not None:
            is_oom &= c["device"] == device
        rows = np.flatnonzero(is_oom)
        if not len(rows):
            raise ConfigError(f"at='oom': the trace has no refused allocation (out-of-memory "
                              f"event) on {where}; use at='peak', 'end', an event index or a "
                              "time")
        r = int(rows[0])
        dev = int(c["device"][r]) if device is None else device
        return Moment(at, r - 1, dev, secs(r), f"the out-of-memory error on "
                      f"{_device_name(trace, dev)}, just before the refused allocation "
                      f"({ev(r)})", oom_row=r)
    # the peak: a running sum over the rows (each row allocates or frees at most once)
    if allocs is None:
        allocs = allocations(trace, device)
    if not len(allocs.row):
        return Moment(at, -1, device, None, f"the peak on {where} (the trace allocates "
                      "nothing)")
    freed = allocs.free_row != _NEVER
    delta = np.zeros(n, dtype=np.int64)
    delta[allocs.row] = allocs.size
    delta[allocs.free_row[freed]] -= allocs.size[freed]
    row = int(np.argmax(np.cumsum(delta)))
    return Moment(at, row, device, secs(row), f"the peak on {where} ({ev(row)})")


def _one_device(trace: Trace, device: int | None) -> int | None:
    """``device``, or the trace's only device when it has one and none was asked for."""
    if device is not None:
        return int(device)
    col = trace.columns["device"]
    if len(col) and int(col.min()) == int(col.max()):
        return int(col[0])
    return None


def _rebuilt(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """Which alloc rows an importer added for memory that existed before its source began:
    a PyTorch snapshot's rebuilt starting state (the first ``meta["torch"]["prefix"][d]``
    rows of device ``d``) and a profile's :data:`PRE_EXISTING_HOLDER` allocations."""
    out = np.zeros(len(rows), dtype=bool)
    if PRE_EXISTING_HOLDER in trace.holders:
        out |= trace.holder[rows] == trace.holders.index(PRE_EXISTING_HOLDER)
    prefix = (trace.meta.get("torch") or {}).get("prefix") if isinstance(
        trace.meta.get("torch"), dict) else None
    if isinstance(prefix, dict) and prefix and len(rows):
        dev_col = trace.columns["device"]
        for key, count in prefix.items():
            try:
                d, k = int(key), int(count)
            except (TypeError, ValueError):
                continue
            if k <= 0:
                continue
            of_d = np.flatnonzero(dev_col == d)
            if len(of_d):
                cut = of_d[min(k, len(of_d)) - 1]
                out |= (dev_col[rows] == d) & (rows <= cut)
    return out


class HolderTable(list):
    """The rows of :func:`top_holders` (a list of :class:`HolderBytes`, most bytes first),
    with what the answer rests on.

    Attributes
    ----------
    by : str
    rule : str
        Which frames counted as the user's code (``"user code: ..."``, stack groupings), or
        how the categories were made.
    moment : Moment
        Where ``at`` resolved to: the event, the device, the time.
    total_bytes, total_allocations : int
        Of every live allocation (rows left out by ``limit`` included).
    left_out : tuple of (int, int)
        Rows left out by ``limit``, and their bytes.
    missing : dict
        ``"no stack"`` and ``"rebuilt"``: ``(allocations, bytes)`` of the live allocations
        with no recorded stack, and of those an importer rebuilt (memory that existed before
        the trace began: their stacks, if any, are the final blocks').
    notes : list of str
        What was assumed or missing, in words.
    chunk, in_use : str
        What one allocation is called in the trace's framework ("block", "chunk"), and its
        memory ("allocated", "in use").
    stacks : StackTable
        The trace's stack table (:meth:`stacks_of`).
    """

    def __init__(self, rows: list[HolderBytes] = (), **attrs: Any) -> None:
        super().__init__(rows)
        self.by: str = attrs.get("by", "holder")
        self.rule: str = attrs.get("rule", "")
        self.moment: Moment | None = attrs.get("moment")
        self.total_bytes: int = attrs.get("total_bytes", sum(r.bytes for r in rows))
        self.total_allocations: int = attrs.get("total_allocations",
                                                sum(r.allocations for r in rows))
        self.left_out: tuple[int, int] = attrs.get("left_out", (0, 0))
        self.missing: dict[str, tuple[int, int]] = attrs.get("missing", {})
        self.notes: list[str] = attrs.get("notes", [])
        self.chunk: str = attrs.get("chunk", "allocation")
        self.in_use: str = attrs.get("in_use", "in use")
        self.stacks = attrs.get("stacks")
        #: ``test(filename)``: the user-code rule the rows were grouped with (None: none)
        self.rule_test: Any = attrs.get("rule_test")

    def stacks_of(self, row: HolderBytes) -> list[list[Frame]]:
        """Every distinct stack that fell into ``row``, as frames (innermost first)."""
        if self.stacks is None:
            return []
        return [self.stacks.frames_of(s) for s in row.stack_ids]

    def header(self) -> str:
        """What the table is, in one line."""
        m = self.moment
        where = m.text if m is not None else ""
        return (f"{format_bytes(self.total_bytes)} {self.in_use} in "
                f"{self.total_allocations:,} {self.chunk}(s) at {where}, by {self.by}")

    def to_text(self, limit: int | None = None, stacks: bool = False) -> str:
        """The table as lines: the header, one line per row (the first ``limit``; the rest
        counted), with ``stacks`` each row's stack under it (the user's frames first), then
        the rule and the notes."""
        width = max((len(format_bytes(r.bytes)) for r in self), default=0)
        lines = [self.header()]
        for r in (self if limit is None else list(self)[:limit]):
            lines.append(f"  {format_bytes(r.bytes):>{width}}  {r.allocations:>6,} "
                         f"{self.chunk}(s)  {r.holder}")
            if r.rules and (len(r.rules) > 1 or self.by == "category"):
                for text, b in r.rules:
                    lines.append(f"  {'':>{width}}  {'':>6} {'':<{len(self.chunk) + 3}}  "
                                 f"- {format_bytes(b)}: {text}")
            if stacks and r.frames:
                for f in stack_lines(list(r.frames), self.rule_test):
                    lines.append(f"  {'':>{width}}      | {f}")
        rest = list(self)[limit:] if limit is not None else []
        more = (self.left_out[0] + len(rest), self.left_out[1] + sum(r.bytes for r in rest))
        if more[0]:
            lines.append(f"  ... {more[0]:,} more row(s), {format_bytes(more[1])}")
        if self.rule:
            lines.append(self.rule)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<HolderTable by {self.by}: {len(self)} row(s), {self.header()}>"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(r.holder)}</td><td>{html.escape(format_bytes(r.bytes))}"
            f"</td><td>{r.allocations:,}</td></tr>" for r in self)
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in
                        ([self.rule] if self.rule else []) + self.notes)
        return (f"<div class=\"gpudash-holders\"><p><b>{html.escape(self.header())}</b></p>"
                f"<table><tr><th>{html.escape(self.by)}</th><th>bytes</th>"
                f"<th>{html.escape(self.chunk)}s</th></tr>{rows}</table>"
                + (f"<ul>{notes}</ul>" if notes else "") + "</div>")


def _stack_keys(trace: Trace, by: str, sites: CallSites, stack_ids: np.ndarray
                ) -> tuple[np.ndarray, list[Any], list[Any]]:
    """Per stack id in ``stack_ids`` (and -1), a group code, and per code its key and what
    its label is made of: ``("frame", Frame)``, ``("outside", Frame)``, ``("text", str)``,
    ``("file", name)``, ``("function", filename, name)``, ``("stack", stack id)``."""
    frames = trace.stacks.frames
    codes: dict[Any, int] = {}
    keys: list[Any] = []
    parts: list[Any] = []
    out = np.empty(len(stack_ids), dtype=np.int64)
    for i, s in enumerate(stack_ids.tolist()):
        if s < 0:
            key, part = NO_STACK, ("text", NO_STACK)
        elif by == "stack":
            key = tuple(trace.stacks.frames_of(s))
            part = ("stack", s)
        else:
            f = int(sites.frame[s])
            if f >= 0:
                fr = frames[f]
                if by == "line":
                    key, part = fr, ("frame", fr)
                elif by == "function":
                    key, part = (fr.filename, fr.name), ("function", fr.filename, fr.name)
                else:
                    key, part = fr.filename, ("file", fr.filename)
            else:
                fb = int(sites.fallback_frame[s])
                text = sites.fallback[s]
                if fb >= 0:
                    fr = frames[fb]
                    key = (text, fr) if by == "line" else (text, fr.filename, fr.name) \
                        if by == "function" else (text, fr.filename)
                    part = ("outside", fr, by)
                else:
                    key, part = text, ("text", text)
        code = codes.get(key)
        if code is None:
            code = codes[key] = len(keys)
            keys.append(key)
            parts.append(part)
        out[i] = code
    return out, keys, parts


def _labels(trace: Trace, parts: list[Any], sites: CallSites | None) -> list[str]:
    files = []
    for p in parts:
        if p[0] in ("frame", "outside"):
            files.append(p[1].filename)
        elif p[0] in ("file", "function"):
            files.append(p[1])
        elif p[0] == "stack":
            files.extend(trace.stacks.frames[f].filename
                         for f in trace.stacks.stacks[p[1]].frames)
    short = short_paths(sorted(set(files)))
    out = []
    for p in parts:
        if p[0] == "frame":
            out.append(frame_text(p[1], short))
        elif p[0] == "outside":
            fr, by = p[1], p[2]
            what = frame_text(fr, short) if by in ("line", "stack") else (
                f"{short[fr.filename]} {fr.name}" if by == "function" else short[fr.filename])
            out.append(f"(outside user code) {what}")
        elif p[0] == "file":
            out.append(short[p[1]])
        elif p[0] == "function":
            out.append(f"{short[p[1]]} {p[2]}")
        elif p[0] == "stack":
            s = p[1]
            fr = trace.stacks.frames_of(s)
            mine = [f for f in fr if sites is not None and sites.rule(f.filename)]
            shown = mine or [f for f in fr if f.filename.lower().endswith(".py")] or fr
            text = " \u2190 ".join(frame_text(f, short) for f in shown[:4])
            if len(shown) > 4:
                text += f" \u2190 ... {len(shown) - 4} more"
            if not mine and sites is not None:
                text = f"{sites.fallback[s]} {text}".strip() if shown else sites.fallback[s]
            out.append(text or "(empty stack)")
        else:
            out.append(p[1])
    # two stacks with the same user frames: tell them apart
    seen: dict[str, int] = {}
    for i, text in enumerate(out):
        k = seen.get(text, 0)
        seen[text] = k + 1
        if k:
            out[i] = f"{text} [{k + 1}]"
    return out


def _default_by(trace: Trace) -> str:
    st = trace.stack
    return "line" if st is not None and len(st) and bool((st >= 0).any()) else "holder"


def top_holders(trace: Trace, at: Any = "peak", *, by: str | None = None,
                device: int | None = None, user_code: Any = None,
                limit: int | None = None) -> HolderTable:
    """The allocations live at a moment, grouped by who made them, most bytes first.

    Parameters
    ----------
    trace : Trace
    at : "peak", "oom", "end", int, float or str, default "peak"
        The moment (module docstring): the first peak of bytes allocated (of ``device``),
        just before the first refused allocation, the last event, the state after an event
        index, or a time from the trace's first event (``12.5`` or ``"12.5s"``, ``"300ms"``).
    by : str, optional
        ``"line"``, ``"function"``, ``"file"``, ``"stack"``, ``"annotation"``,
        ``"category"`` or ``"holder"``. Default: ``"line"`` when the trace recorded stacks,
        else ``"holder"``.
    device : int, optional
        Only this device's allocations (and its peak). Default: every device together,
        except ``at="oom"``, which takes the refused allocation's device.
    user_code : str, re.Pattern or callable, optional
        Which frames are the user's (:func:`gpudash.trace.callers.user_code_rule`); the
        default rule leaves out torch, installed packages, the standard library and C++.
    limit : int, optional
        Keep the first ``limit`` rows (the table still counts the rest).

    Returns
    -------
    HolderTable
        A list of :class:`HolderBytes`; their bytes add up to the bytes allocated at that
        moment (chunk or block sizes). ``rule``, ``moment``, ``missing`` and ``notes`` say
        what the answer rests on.

    Raises
    ------
    ConfigError
        A bad ``at``, ``by`` or ``user_code``, or ``at="oom"`` without a refused allocation.
    EventIndexError
        An event index outside the trace.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"top_holders needs a gpudash.trace.Trace; got {type(trace).__name__}")
    if by is None:
        by = _default_by(trace)
    if by not in BY:
        raise ConfigError(f"by must be one of {', '.join(repr(b) for b in BY)}; got {by!r:.40}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, np.integer))
                              or limit < 0):
        raise ConfigError(f"limit must be an integer >= 0; got {limit!r:.40}")
    return _holders(trace, at, by, device, user_code_rule(user_code), limit)


def _holders(trace: Trace, at: Any, by: str, device: int | None, rule: Any,
             limit: int | None, cache: dict | None = None) -> HolderTable:
    """:func:`top_holders` with its arguments checked; ``cache`` keeps the pairing of a
    trace's allocations by device for a second moment of the same trace."""
    kind, _ = _parse_at(at)
    device = _one_device(trace, device)
    if kind == "oom" and device is None:
        device = resolve_moment(trace, at, None).device
    allocs = cache.get(device) if cache is not None else None
    if allocs is None:
        allocs = allocations(trace, device)
        if cache is not None:
            cache[device] = allocs
    moment = resolve_moment(trace, at, device, allocs)
    live = allocs.live_after(moment.event)
    return _table(trace, allocs, live, by, rule, moment, limit)


@dataclass
class _Groups:
    """The group of each of some allocations, and what names the groups."""

    code: np.ndarray            # per allocation, an index into keys/labels
    keys: list
    labels: list
    notes: list = field(default_factory=list)
    rule_text: str = ""
    rule_test: Any = None
    cat_rules: np.ndarray | None = None   # by="category": each allocation's rule


def _group(trace: Trace, allocs: Allocations, idx: np.ndarray, by: str, rule: Any) -> _Groups:
    """Group the allocations ``idx`` (indices into ``allocs``) by ``by``."""
    stack = allocs.stack[idx]
    rows = allocs.row[idx]
    has_stacks = trace.stack is not None and bool((trace.stack >= 0).any())
    if by in _STACK_BY:
        sites = call_sites(trace.stacks, rule)
        notes = []
        if not has_stacks:
            notes.append("the trace recorded no call stacks: every allocation is "
                         f"'{NO_STACK}' (by='holder' groups by the source's holder names)")
        uniq, inv = np.unique(stack, return_inverse=True)
        ucode, keys, parts = _stack_keys(trace, by, sites, uniq)
        code = ucode[inv] if len(inv) else np.zeros(0, dtype=np.int64)
        return _Groups(code, keys, _labels(trace, parts, sites), notes,
                       f"user code: {rule.description}", sites.rule)
    c = trace.columns
    if by == "annotation":
        ranges = annotation_ranges(trace.meta)
        notes = ["annotation: the innermost record_function range open when each allocation "
                 "was made, on its device"]
        if not len(ranges):
            notes.append("the trace has no annotations (record_function ranges, "
                         f"meta['annotations']): every allocation is '{NO_ANNOTATION}'")
        at = annotations_at(ranges, c["time_ns"][rows], allocs.device[idx])
        names = list(ranges.names) + [NO_ANNOTATION]
        code = np.where(at >= 0, ranges.name[np.maximum(at, 0)] if len(ranges) else 0,
                        len(ranges.names)).astype(np.int64)
        return _Groups(code, names, names, notes)
    if by == "category":
        ranges = annotation_ranges(trace.meta)
        cz = categorize(allocs.row, allocs.free_row, allocs.device, allocs.stack,
                        trace.stacks, c["time_ns"][allocs.row], ranges, c["time_ns"],
                        stack_flags(trace.stacks))
        notes = []
        if not has_stacks:
            notes.append("the trace recorded no call stacks: only annotations can place "
                         "allocations; the rest are 'unknown'")
        return _Groups(cz.category[idx].astype(np.int64), list(CATEGORIES), list(CATEGORIES),
                       notes, "categories: stack rules after PyTorch's memory profiler and "
                       "Mosaic, with each allocation's lifetime (gpudash.trace.categories)",
                       cat_rules=cz.rule[idx].astype(np.int64))
    h = trace.holder[rows].astype(np.int64)
    names = list(trace.holders) + [UNNAMED]
    return _Groups(np.where(h >= 0, h, len(trace.holders)), names, names)


def _table(trace: Trace, allocs: Allocations, live: np.ndarray, by: str, rule: Any,
           moment: Moment, limit: int | None) -> HolderTable:
    """Group the live allocations ``live`` (indices into ``allocs``) by ``by``."""
    model = trace_model(trace)
    stack = allocs.stack[live]
    size = allocs.size[live]
    rows = allocs.row[live]
    g = _group(trace, allocs, live, by, rule)
    code, keys, labels, notes = g.code, g.keys, g.labels, list(g.notes)
    total_bytes = int(size.sum())
    missing: dict[str, tuple[int, int]] = {}
    if by in _STACK_BY or by == "category":
        none = stack < 0
        if none.any():
            missing["no stack"] = (int(none.sum()), int(size[none].sum()))
            notes.append(f"{int(none.sum()):,} live {model.chunk}(s) "
                         f"({format_bytes(int(size[none].sum()))}) have no recorded stack")
    reb = _rebuilt(trace, rows)
    if reb.any():
        missing["rebuilt"] = (int(reb.sum()), int(size[reb].sum()))
        notes.append(f"{int(reb.sum()):,} live {model.chunk}(s) "
                     f"({format_bytes(int(size[reb].sum()))}) existed before the trace's "
                     "first event: the importer rebuilt them, so when they were made is not "
                     "known (their stacks, where any, are those the source kept for them)")
    out: list[HolderBytes] = []
    if len(live):
        groups, inv = np.unique(code, return_inverse=True)
        order = np.argsort(inv, kind="stable")
        starts = np.flatnonzero(np.r_[True, np.diff(inv[order]) != 0])
        sums = np.add.reduceat(size[order], starts)
        counts = np.diff(np.r_[starts, len(order)])
        # the largest allocation of each group names its stack
        big = np.lexsort((-size, inv))
        first = np.flatnonzero(np.r_[True, np.diff(inv[big]) != 0])
        rep = stack[big[first]]
        # every distinct stack of each group, most bytes first
        width = len(trace.stacks) + 1
        pair = inv.astype(np.int64) * width + (stack + 1)
        pu, pinv = np.unique(pair, return_inverse=True)
        psum = np.bincount(pinv, weights=size.astype(np.float64), minlength=len(pu))
        pg, ps = pu // width, pu % width - 1
        po = np.lexsort((-psum, pg))
        pbounds = np.searchsorted(pg[po], np.arange(len(groups) + 1))
        rule_parts: dict[int, list[tuple[str, int]]] = {}
        if g.cat_rules is not None:
            rp = inv.astype(np.int64) * len(RULES) + g.cat_rules
            ru, rinv = np.unique(rp, return_inverse=True)
            rsum = np.bincount(rinv, weights=size.astype(np.float64), minlength=len(ru))
            for u, b in zip(ru.tolist(), rsum.tolist()):
                rule_parts.setdefault(u // len(RULES), []).append((RULES[u % len(RULES)][0],
                                                                   int(round(b))))
            for v in rule_parts.values():
                v.sort(key=lambda x: -x[1])
        for k in range(len(groups)):
            cg = int(groups[k])
            sids = tuple(int(s) for s in ps[po[pbounds[k]:pbounds[k + 1]]].tolist() if s >= 0)
            out.append(HolderBytes(labels[cg], int(sums[k]), int(counts[k]), keys[cg],
                                   tuple(trace.stacks.frames_of(int(rep[k]))), sids,
                                   tuple(rule_parts.get(k, ()))))
    out.sort(key=lambda r: (-r.bytes, r.holder))
    left = (0, 0)
    if limit is not None and len(out) > limit:
        rest = out[limit:]
        left = (len(rest), sum(r.bytes for r in rest))
        out = out[:limit]
    return HolderTable(out, by=by, rule=g.rule_text, moment=moment, total_bytes=total_bytes,
                       total_allocations=int(len(live)), left_out=left, missing=missing,
                       notes=notes, chunk=model.chunk, in_use=model.in_use,
                       stacks=trace.stacks, rule_test=g.rule_test)
