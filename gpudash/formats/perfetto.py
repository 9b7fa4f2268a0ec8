"""A trace's memory as Chrome Trace Event Format JSON, for Perfetto and ``chrome://tracing``,
alone or merged into a PyTorch profiler trace.

:func:`to_chrome_trace` turns a :class:`~gpudash.trace.Trace` into the JSON object form of the
Trace Event Format (``{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}``),
which ui.perfetto.dev and ``chrome://tracing`` open. :func:`write_chrome_trace` writes it (gzip
when the name ends in ``.gz``), or appends its events to a PyTorch profiler trace
(``torch.profiler``'s ``export_chrome_trace``), aligned on that trace's clock, so memory lines
up with the kernels and ops around it.

What is written
---------------
One process per device of the trace (``pid`` = :data:`PID_BASE` + the device index: above any
Linux process id, so never one of a profiler's own processes), named by a ``process_name``
metadata event after the device and its allocator (``"cuda:0 memory (PyTorch's caching
allocator)"``). In it:

- two counters (``"ph": "C"``, one ``"bytes"`` value each), named in the words of the
  allocator that made the trace (:func:`gpudash.models.trace_model`): the bytes handed to the
  program (PyTorch: ``allocated``; TensorFlow and JAX: ``in use``), the running sum of
  ``size`` over alloc (+) and free (-) events; and the bytes held from the device (PyTorch:
  ``reserved``; TensorFlow and JAX: ``pool``), the running sum over extend (+) and release (-)
  events. Perfetto names the tracks ``"allocated bytes"``, ``"reserved bytes"``... A device
  whose trace holds no extend or release event gets no second counter (the trace does not
  say what was held; ``otherData`` says so). A counter point is written only where its value
  changes.
- each out-of-memory event as an instant (``"ph": "i"``, ``"s": "p"``) named
  ``"out of memory"``, with the bytes requested, the rounded request and both counters' values
  at that moment in ``args``;
- the ``record_function`` ranges of ``meta["annotations"]`` (``{"names": [...], "ranges":
  [[device, name index or name, start_ns, end_ns], ...]}``) as complete slices (``"ph":
  "X"``) on threads of the device's process named ``annotations``: ranges that overlap
  without nesting go to a further thread (``annotations 2``...), as a viewer requires of the
  slices of one thread. Entries that cannot be read (not a list of four, a name index outside
  ``names``, times that are not integers, an end before the start) are skipped and counted.

Times
-----
The Trace Event Format's ``ts`` and ``dur`` are microseconds (floating point: ns precision is
kept) from an origin. A trace's ``time_ns`` are read as nanoseconds since the Unix epoch when
they look like it (every one from 2000 to 2100, and the trace is neither a synthetic workload
nor a replay's recording: :func:`wall_clock_problem`). Alone, ``ts`` counts from
``baseTimeNanoseconds``, the first event's time floored to a whole second, written at the top
level as PyTorch's profiler does; for a trace whose times are not wall-clock there is no such
field and ``ts`` counts from the first event (``otherData`` says which).

Merged into a profiler trace, ``ts`` = (``time_ns`` + ``offset_ns`` - the profiler's
``baseTimeNanoseconds``) / 1000, the profiler's own convention: its ``ts`` are microseconds
after ``baseTimeNanoseconds``, ns since the Unix epoch (Kineto's ``ChromeTraceBaseTime``:
``system_clock`` floored to three months). PyTorch's memory snapshots stamp ``time_us`` on the
same clock, and so does a gpudash session (``time.time_ns()``). A trace whose times are not
wall-clock (a synthetic workload, a replay's recording, a snapshot without ``time_us``, whose
entries are numbered 1 us apart, a log whose lines carry no date) is refused with a
:class:`~gpudash.TraceFormatError` naming the problem, unless ``offset_ns`` says how to place
it: then ``time_ns + offset_ns`` must be wall-clock nanoseconds. A profiler trace without
``baseTimeNanoseconds`` is refused too (its ``ts`` cannot be placed on a clock).

Decimation
----------
A trace of millions of events would give millions of counter points. After dropping the points
that do not change a counter, a counter with more than ``max_points`` points is cut into
``max_points // 3`` equal spans of time, and in each only the points holding its highest
value, its lowest value and its last value are kept, at their own times: every peak and trough
is exact, and the value at the end of each span is right. ``otherData["gpudash"]`` and the
process's ``process_labels`` say which counters were decimated and from how many points.
OOM instants and annotation slices are never dropped.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import stat
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._errors import ConfigError, TraceFormatError
from .._version import __version__
from ..events import (
    ALLOC as _ALLOC, FREE as _FREE, EXTEND as _EXTEND, RELEASE as _RELEASE, OOM as _OOM,
)
from ..models import trace_model
from .format import Trace, device_entries, file_kind

__all__ = ["DEFAULT_MAX_POINTS", "PID_BASE", "read_profiler_trace", "to_chrome_trace",
           "wall_clock_problem", "write_chrome_trace"]

#: Counter points kept per counter and device at most (see the module's Decimation section).
DEFAULT_MAX_POINTS = 50_000
#: The fewest points ``max_points`` may ask for: one span's highest, lowest and last value.
MIN_MAX_POINTS = 3
#: The first device's ``pid``: above Linux's largest process id (``pid_max`` <= 2**22), so
#: memory processes are never one of a profiler's own (Kineto uses process ids, and device
#: indices for GPUs).
PID_BASE = 1 << 22
#: Times gpudash reads as nanoseconds since the Unix epoch: from 2000-01-01 to 2100-01-01.
WALL_CLOCK_NS = (946_684_800 * 10**9, 4_102_444_800 * 10**9)

_CAT = "gpudash.memory"
_CAT_ANNOTATION = "gpudash.annotation"
_INT64 = (-(1 << 63), (1 << 63) - 1)


# ---------------------------------------------------------------------------- times
def wall_clock_problem(trace: Trace, offset_ns: int | None = None) -> str | None:
    """Why ``trace``'s times are not nanoseconds since the Unix epoch, or None when they are
    (or when the trace has no events).

    Without ``offset_ns``, times are read as wall-clock when every one falls from 2000 to
    2100 and the trace is neither a synthetic workload (``meta["source"] == "synthetic"``)
    nor a replay's recording (``meta["replay_of"]``). With ``offset_ns`` (the caller's word
    for how to place the times), only ``time_ns + offset_ns`` is checked against that range.
    """
    t = trace.columns["time_ns"]
    if not len(t):
        return None
    source = trace.meta.get("source") or "this"
    if offset_ns is None:
        if trace.meta.get("source") == "synthetic":
            return "a synthetic workload: its times count from 1 s, on no clock"
        if "replay_of" in trace.meta:
            return ("a replay's recording: its times are when the replay ran, not when the "
                    "job did")
    shift = int(offset_ns or 0)
    lo, hi = int(t.min()) + shift, int(t.max()) + shift
    if lo >= WALL_CLOCK_NS[0] and hi < WALL_CLOCK_NS[1]:
        return None
    what = f"plus offset_ns {shift:,} " if offset_ns is not None else ""
    where = lo if lo < WALL_CLOCK_NS[0] else hi
    hint = ""
    if trace.meta.get("source") == "pytorch-snapshot" and offset_ns is None:
        hint = ("; a snapshot whose entries have no time_us (PyTorch before 2.2) numbers them "
                "1 us apart from 0")
    return (f"the {source} trace's times {what}are not nanoseconds since the Unix epoch "
            f"(one is {where:,} ns, outside 2000..2100){hint}")


def _check_int(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer number of nanoseconds; got "
                          f"{type(value).__name__} {value!r}")
    value = int(value)
    if not _INT64[0] < value < _INT64[1]:
        raise ConfigError(f"{name} {value} does not fit in 64 bits")
    return value


def _ts(t: np.ndarray, shift: int) -> list:
    """``(t - shift) / 1000`` as Python floats (microseconds, ns kept to 2**53 ns)."""
    return ((t - np.int64(shift)).astype(np.float64) / 1000.0).tolist()


# ---------------------------------------------------------------------------- series
def _changes(t: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The points where ``v`` changes (the first point always)."""
    if len(v) < 2:
        return t, v
    keep = np.empty(len(v), dtype=bool)
    keep[0] = True
    np.not_equal(v[1:], v[:-1], out=keep[1:])
    return t[keep], v[keep]


def _first_per_group(rows: np.ndarray, gid: np.ndarray) -> np.ndarray:
    """Of ``rows`` (ascending), the first of each group ``gid[rows]`` (nondecreasing)."""
    g = gid[rows]
    return rows[np.r_[True, g[1:] != g[:-1]]] if len(rows) else rows


def _decimate(t: np.ndarray, v: np.ndarray, max_points: int, in_order: bool | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` of the points (t, v): in each of ``max_points // 3`` equal spans
    of time, those with the highest, the lowest and the last value (the first such point where
    several tie), in their original order; consecutive equal values then once.

    Points in time order (the usual case: ``in_order`` None checks) take an O(n) path over
    runs of rows; others are grouped by sorting, with the same result."""
    n = len(v)
    if n <= max_points:
        return t, v
    spans = max(1, max_points // 3)
    t0, t1 = int(t.min()), int(t.max())
    width = float(t1 - t0) + 1.0
    b = np.minimum(((t - t0).astype(np.float64) * (spans / width)).astype(np.int64), spans - 1)
    if in_order is None:
        in_order = bool(np.all(b[1:] >= b[:-1]))
    if in_order:
        starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
        gid = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))
        highest = _first_per_group(np.flatnonzero(v == np.maximum.reduceat(v, starts)[gid]), gid)
        lowest = _first_per_group(np.flatnonzero(v == np.minimum.reduceat(v, starts)[gid]), gid)
        last = np.r_[starts[1:], n] - 1
    else:
        idx = np.arange(n)
        by_span = np.argsort(b, kind="stable")       # rows of each span, in original order
        bs = b[by_span]
        starts = np.flatnonzero(np.r_[True, bs[1:] != bs[:-1]])
        highest = np.lexsort((idx, -v, b))[starts]
        lowest = np.lexsort((idx, v, b))[starts]
        last = by_span[np.r_[starts[1:], n] - 1]
    keep = np.unique(np.concatenate([highest, lowest, last]))
    return _changes(t[keep], v[keep])


def _running(t: np.ndarray, kind: np.ndarray, size: np.ndarray, plus: int, minus: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The running sum of +size at ``plus`` rows and -size at ``minus`` rows: (its value after
    every row, the times of the rows that change it, the values there)."""
    delta = np.where(kind == plus, size, 0) - np.where(kind == minus, size, 0)
    total = np.cumsum(delta)
    rows = (kind == plus) | (kind == minus)
    return total, t[rows], total[rows]


# ---------------------------------------------------------------------------- annotations
def _annotations(meta: dict, wanted: set[int]) -> tuple[dict[int, list], dict[str, int]]:
    """``meta["annotations"]`` read defensively: ``{device: [(start, end, name), ...]}`` for the
    devices in ``wanted``, and the counts of the entries left out, by reason."""
    ann = meta.get("annotations")
    skipped: dict[str, int] = {}
    out: dict[int, list] = {}
    if ann is None:
        return out, skipped

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    if not isinstance(ann, dict):
        skip(f"meta['annotations'] is a {type(ann).__name__}, not an object")
        return out, skipped
    names = ann.get("names")
    if names is None:
        names = []
    if not isinstance(names, list):
        skip("'names' is not a list")
        names = []
    ranges = ann.get("ranges")
    if ranges is None:
        return out, skipped
    if not isinstance(ranges, list):
        skip("'ranges' is not a list")
        return out, skipped
    for r in ranges:
        if not isinstance(r, (list, tuple)) or len(r) != 4:
            skip("not a list [device, name, start_ns, end_ns]")
            continue
        dev, name, start, end = r
        if not _is_int(dev):
            skip("a device that is not an integer")
            continue
        if _is_int(name):
            if not 0 <= int(name) < len(names) or not isinstance(names[int(name)], str):
                skip("a name index outside 'names'")
                continue
            name = names[int(name)]
        elif not isinstance(name, str):
            skip("a name that is neither a string nor an index")
            continue
        if not (_is_int(start) and _is_int(end)) or not (
                _INT64[0] < int(start) < _INT64[1] and _INT64[0] < int(end) < _INT64[1]):
            skip("times that are not 64-bit integers (ns)")
            continue
        if int(end) < int(start):
            skip("an end before its start")
            continue
        if int(dev) not in wanted:
            continue  # another device's, or one not exported: not an error
        out.setdefault(int(dev), []).append((int(start), int(end), name))
    return out, skipped


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _lanes(ranges: list) -> list[tuple[int, int, str, int]]:
    """Each range with the lane (thread) it goes on: a range goes on the first lane where it
    nests inside the innermost open range, or where none is open."""
    stacks: list[list[int]] = []
    out = []
    for start, end, name in sorted(ranges, key=lambda r: (r[0], -r[1])):
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                break
        else:
            lane = len(stacks)
            stacks.append([end])
        out.append((start, end, name, lane))
    return out


# ---------------------------------------------------------------------------- the export
def _device_list(trace: Trace, devices: Any) -> list[tuple[int, str]]:
    """``[(index, name)]`` of the devices to export, in index order."""
    known = {int(d["index"]): d for d in trace.devices}
    names = {i: (str(d.get("name")) if d.get("name") else f"device {i}")
             for i, d in known.items()}
    for i in np.unique(trace.columns["device"]).tolist():
        names.setdefault(int(i), device_entries(trace.meta).get(int(i), {}).get("name")
                         or f"device {int(i)}")
    if devices is None:
        return sorted(names.items())
    wanted = [devices] if _is_int(devices) else devices
    if isinstance(wanted, (str, bytes)) or not isinstance(wanted, Iterable):
        raise ConfigError(f"devices must be a device index or a list of them; got "
                          f"{type(devices).__name__} {devices!r}")
    wanted = list(wanted)
    for d in wanted:
        if not _is_int(d) or int(d) not in names:
            raise ConfigError(f"device {d!r} is not in the trace; its devices: "
                              f"{', '.join(str(i) for i in sorted(names)) or 'none'}")
    return sorted((int(d), names[int(d)]) for d in {int(d) for d in wanted})


def _meta_event(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def to_chrome_trace(trace: Trace, *, devices: Any = None,
                    max_points: int | None = DEFAULT_MAX_POINTS, offset_ns: int | None = None,
                    base_ns: int | None = None, pid_base: int = PID_BASE) -> dict:
    """The memory of ``trace`` as a Chrome Trace Event Format object (see the module's
    docstring for what it holds).

    Parameters
    ----------
    trace : Trace
    devices : int or iterable of int, optional
        The device indices to export (default: every device of the trace).
    max_points : int or None, default DEFAULT_MAX_POINTS
        The most points written per counter and device (at least 3); None writes every
        point where a value changes.
    offset_ns : int, optional
        Added to every time of the trace (and of its annotations) first; given, the times
        plus it are taken as wall-clock when they fall from 2000 to 2100
        (:func:`wall_clock_problem`).
    base_ns : int, optional
        The time (after ``offset_ns``) that ``ts`` counts from. Default: the first event's
        time floored to a whole second when the times are wall-clock (then written as
        ``baseTimeNanoseconds``), else the first event's time.
    pid_base : int, default PID_BASE
        The ``pid`` of device 0; device ``d`` is ``pid_base + d``.

    Returns
    -------
    dict
        ``traceEvents``, ``displayTimeUnit`` (``"ns"``), ``otherData`` (``{"gpudash": {...}}``:
        the source, the allocator, the clock, each device's pid and counter points, what was
        decimated or skipped, and ``notes``, sentences for a person) and, for a wall-clock
        trace with no ``base_ns`` given, ``baseTimeNanoseconds``.

    Raises
    ------
    ConfigError
        A device that is not in the trace, ``max_points`` below 3, or an ``offset_ns``,
        ``base_ns`` or ``pid_base`` that is not an integer.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"to_chrome_trace needs a gpudash.trace.Trace; got "
                        f"{type(trace).__name__}")
    if max_points is not None and (not _is_int(max_points) or max_points < MIN_MAX_POINTS):
        raise ConfigError(f"max_points must be an integer of at least {MIN_MAX_POINTS} (or "
                          f"None for no bound); got {max_points!r}")
    given = offset_ns
    offset_ns = 0 if offset_ns is None else _check_int(offset_ns, "offset_ns")
    pid_base = _check_int(pid_base, "pid_base")
    model = trace_model(trace)
    words = model.words()
    in_use, pool = words["in_use"], words["pool"]
    devs = _device_list(trace, devices)
    if devs and not (0 <= pid_base and pid_base + devs[-1][0] < 1 << 31):
        raise ConfigError(f"pid_base {pid_base} puts device pids outside 0 .. 2**31-1")

    c = trace.columns
    t_all = c["time_ns"]
    problem = wall_clock_problem(trace, None if given is None else offset_ns)
    wall = problem is None and len(t_all) > 0
    first = int(t_all.min()) + offset_ns if len(t_all) else 0
    write_base = base_ns is None and wall
    if base_ns is None:
        base_ns = (first // 10**9) * 10**9 if wall else first
    base_ns = _check_int(base_ns, "base_ns")
    shift = base_ns - offset_ns       # ts = (time_ns - shift) / 1000
    if not _INT64[0] < shift < _INT64[1] or (len(t_all) and not (
            _INT64[0] < int(t_all.min()) - shift and int(t_all.max()) - shift < _INT64[1])):
        raise ConfigError(f"offset_ns {offset_ns} and base_ns {base_ns} move the trace's times "
                          "past 64 bits")

    # rows grouped by device, each device's rows in trace order
    dev_col = c["device"]
    if len(dev_col) and int(dev_col.min()) != int(dev_col.max()):
        order = np.argsort(dev_col, kind="stable")
    else:
        order = None
    sorted_dev = dev_col[order] if order is not None else dev_col
    wanted = {d for d, _ in devs}
    ann, ann_skipped = _annotations(trace.meta, wanted)

    events: list[dict] = []
    dev_info = []
    notes: list[str] = []
    decimated_any = []
    negative = []
    ann_count = 0
    for d, name in devs:
        pid = pid_base + d
        lo = int(np.searchsorted(sorted_dev, d, side="left"))
        hi = int(np.searchsorted(sorted_dev, d, side="right"))
        rows = order[lo:hi] if order is not None else slice(lo, hi)
        kind, size, t = c["kind"][rows], c["size"][rows], t_all[rows]
        events.append(_meta_event("process_name", pid, 0,
                                  {"name": f"{name} memory ({model.title})"}))
        own: list[dict] = []
        info: dict[str, Any] = {"index": d, "name": name, "pid": pid, "events": len(kind)}
        labels = []
        totals = {}
        counters = [(in_use, _ALLOC, _FREE)]
        has_pool = bool(np.any((kind == _EXTEND) | (kind == _RELEASE)))
        if has_pool:
            counters.append((pool, _EXTEND, _RELEASE))
        points: dict[str, int] = {}
        for cname, plus, minus in counters:
            total, ct, cv = _running(t, kind, size, plus, minus)
            totals[cname] = total
            ct, cv = _changes(ct, cv)
            n_changes = len(cv)
            if max_points is not None and n_changes > max_points:
                ct, cv = _decimate(ct, cv, max_points)
                decimated_any.append(f"{name} {cname}: {n_changes:,} -> {len(cv):,} points")
                labels.append(f"{cname} decimated: {n_changes:,} -> {len(cv):,} points")
            if len(cv) and int(cv.min()) < 0:
                negative.append(f"{name} {cname}")
            points[cname] = len(cv)
            for ts, value in zip(_ts(ct, shift), cv.tolist()):
                own.append({"name": cname, "ph": "C", "cat": _CAT, "ts": ts, "pid": pid,
                            "tid": 0, "args": {"bytes": value}})
        info["points"] = points
        if not has_pool:
            info["no_pool"] = True
        # out-of-memory instants, with both counters' values at that moment
        oom_rows = np.flatnonzero(kind == _OOM)
        if len(oom_rows):
            req, rounded = c["requested"][rows][oom_rows], size[oom_rows]
            for j, ts in enumerate(_ts(t[oom_rows], shift)):
                r = int(oom_rows[j])
                args = {"requested bytes": int(req[j]), "rounded bytes": int(rounded[j]),
                        f"{in_use} bytes": int(totals[in_use][r])}
                if has_pool:
                    args[f"{pool} bytes"] = int(totals[pool][r])
                own.append({"name": "out of memory", "ph": "i", "s": "p", "cat": _CAT,
                            "ts": ts, "pid": pid, "tid": 0, "args": args})
        info["ooms"] = len(oom_rows)
        # record_function ranges as slices, on as many threads as their nesting needs
        placed = _lanes(ann.get(d, []))
        lanes = 1 + max((p[3] for p in placed), default=-1)
        for lane in range(lanes):
            events.append(_meta_event("thread_name", pid, 1 + lane, {
                "name": "annotations" if lane == 0 else f"annotations {lane + 1}"}))
        if placed:
            starts = np.array([p[0] for p in placed], dtype=np.int64)
            durs = np.array([p[1] - p[0] for p in placed], dtype=np.int64)
            for (s, e, aname, lane), ts, dur in zip(
                    placed, _ts(starts, shift), _ts(durs, 0)):
                own.append({"name": aname, "ph": "X", "cat": _CAT_ANNOTATION, "ts": ts,
                            "dur": dur, "pid": pid, "tid": 1 + lane})
        info["annotations"] = len(placed)
        ann_count += len(placed)
        if labels:
            events.append(_meta_event("process_labels", pid, 0, {"labels": "; ".join(labels)}))
        own.sort(key=lambda e: e["ts"])
        events.extend(own)
        dev_info.append(info)

    # what a person should know, in words
    if problem is not None and len(t_all):
        notes.append(f"times: {problem}; ts counts from the first event")
    if decimated_any:
        notes.append(f"counters decimated to at most {max_points:,} points each (the highest, "
                     "lowest and last value of each span of time kept): "
                     + "; ".join(decimated_any))
    no_pool = [i["name"] for i in dev_info if i.get("no_pool")]
    if no_pool:
        regions = words["regions"]
        notes.append(f"no {pool} counter for {', '.join(no_pool)}: the trace records no "
                     f"{regions} obtained or released")
    if negative:
        notes.append(f"below 0 bytes at times: {', '.join(negative)} (frees or releases of "
                     "memory the trace never saw obtained: the values are relative to its "
                     "start)")
    if ann_skipped:
        notes.append("annotations skipped: " + "; ".join(
            f"{n} x {why}" for why, n in sorted(ann_skipped.items())))
    gd: dict[str, Any] = {
        "writer": f"gpudash {__version__}",
        "source": trace.meta.get("source"),
        "allocator": model.title,
        "counters": {"in_use": in_use, "pool": pool, "unit": "bytes"},
        "clock": "unix_ns" if problem is None else "not wall-clock",
        "base_ns": base_ns,
        "offset_ns": offset_ns,
        "max_points": max_points,
        "devices": dev_info,
        "annotations": ann_count,
        "annotations_skipped": ann_skipped,
        "decimated": decimated_any,
        "notes": notes,
    }
    out: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ns"}
    if write_base:
        out["baseTimeNanoseconds"] = base_ns
    out["otherData"] = {"gpudash": gd}
    return out


# ---------------------------------------------------------------------------- files
def _regular_input(path: Any, what: str) -> str:
    if isinstance(path, (bool, int)) or not isinstance(path, (str, bytes, os.PathLike)):
        raise TraceFormatError(f"a {what} is read from a path; got {type(path).__name__} "
                               f"{path!r}")
    name = os.fsdecode(os.fspath(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TraceFormatError(f"{name}: no such file") from None
    except OSError as exc:
        raise TraceFormatError(f"{name}: cannot read it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise TraceFormatError(f"{name}: is {file_kind(st.st_mode)}, not a {what} file")
    if st.st_size == 0:
        raise TraceFormatError(f"{name}: the file is empty")
    return name


def read_profiler_trace(path: str | os.PathLike) -> dict:
    """A PyTorch profiler trace (``export_chrome_trace``'s JSON, or gzipped JSON), checked for
    what a merge needs.

    Returns
    -------
    dict
        The JSON object as read: ``traceEvents`` (a list) and ``baseTimeNanoseconds`` (an
        integer, ns since the Unix epoch), with whatever else it holds.

    Raises
    ------
    TraceFormatError
        The file is missing, empty, not a regular file, not (gzipped) JSON, a JSON array of
        events or another value rather than an object, without a ``traceEvents`` list, or
        without an integer ``baseTimeNanoseconds`` (each naming the file).
    """
    name = _regular_input(path, "profiler trace")
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        opener = gzip.open if gz else open
        with opener(path, "rb") as f:
            obj = json.load(f)
    except (ValueError, RecursionError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceFormatError(f"{name}: not a {'gzipped ' if gz else ''}JSON profiler trace "
                               f"({detail[:200]})") from None
    if isinstance(obj, list):
        raise TraceFormatError(f"{name}: a JSON array of events, with no baseTimeNanoseconds: "
                               "its ts cannot be placed on a clock (PyTorch's profiler writes "
                               "a JSON object with baseTimeNanoseconds and traceEvents)")
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{name}: a JSON {type(obj).__name__}, not a profiler trace (an "
                               "object with traceEvents and baseTimeNanoseconds)")
    if not isinstance(obj.get("traceEvents"), list):
        found = "none" if "traceEvents" not in obj else type(obj["traceEvents"]).__name__
        raise TraceFormatError(f"{name}: no traceEvents list (found {found}); not a profiler "
                               "trace")
    base = obj.get("baseTimeNanoseconds")
    if base is None:
        raise TraceFormatError(f"{name}: no baseTimeNanoseconds at its top level: its ts "
                               "cannot be placed on a clock, so memory cannot be aligned with "
                               "it (PyTorch's profiler writes it with export_chrome_trace)")
    if not _is_int(base) or not WALL_CLOCK_NS[0] <= base < WALL_CLOCK_NS[1]:
        raise TraceFormatError(f"{name}: baseTimeNanoseconds {str(base)[:40]!s} is not an "
                               "integer count of nanoseconds since the Unix epoch (2000..2100)")
    return obj


def _free_pid_base(events: list, n: int) -> int:
    """A pid base above Linux's process ids and every numeric pid of ``events``, when
    ``[base, base + n)`` would meet one of them."""
    used = {int(e["pid"]) for e in events
            if isinstance(e, dict) and _is_int(e.get("pid"))}
    base = PID_BASE
    if any(base <= p < base + n for p in used):
        base = max(used) + 1
    return base


def _span_us(events: list) -> tuple[float, float] | None:
    lo, hi = math.inf, -math.inf
    for e in events:
        if not isinstance(e, dict) or e.get("ph") == "M":
            continue
        ts = e.get("ts")
        if isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts):
            lo = min(lo, ts)
            end = ts + e["dur"] if isinstance(e.get("dur"), (int, float)) and not isinstance(
                e.get("dur"), bool) else ts
            hi = max(hi, end)
    return (lo, hi) if lo <= hi else None


def _check_target(path: Any, overwrite: bool) -> str:
    if isinstance(path, (bool, int)) or not isinstance(path, (str, bytes, os.PathLike)):
        raise TraceFormatError(f"a Chrome trace is written to a path; got "
                               f"{type(path).__name__} {path!r}")
    name = os.fsdecode(os.fspath(path))
    try:
        st = os.stat(path)
    except OSError:
        return name
    if not stat.S_ISREG(st.st_mode):
        raise TraceFormatError(f"{name}: is {file_kind(st.st_mode)}; a Chrome trace is "
                               "written to a regular file")
    if not overwrite:
        raise TraceFormatError(f"{name} already exists; pass overwrite=True to replace it")
    return name


def _dump(obj: dict, f: Any) -> None:
    """``obj`` as JSON, one trace event a line (so a file can be read and diffed by eye)."""
    events = obj.get("traceEvents", [])
    encode = json.JSONEncoder(separators=(",", ":")).encode   # one encoder, not one per event
    f.write("{")
    for key, value in obj.items():
        if key != "traceEvents":
            f.write(f"{json.dumps(key)}: {json.dumps(value)},\n")
    f.write('"traceEvents": [\n')
    for i in range(0, len(events), 10_000):
        if i:
            f.write(",\n")
        f.write(",\n".join(map(encode, events[i:i + 10_000])))
    f.write("\n]}\n")


def write_chrome_trace(trace: Trace, path: str | os.PathLike, *,
                       merge: str | os.PathLike | None = None, overwrite: bool = False,
                       devices: Any = None, max_points: int | None = DEFAULT_MAX_POINTS,
                       offset_ns: int | None = None) -> dict:
    """Write the memory of ``trace`` as Chrome Trace Event Format JSON (Perfetto opens it),
    alone or appended to a PyTorch profiler trace.

    Parameters
    ----------
    trace : Trace
    path : str or os.PathLike
        The file to write; gzipped when its name ends in ``.gz``. Written whole to a
        temporary file beside it, then renamed: a failed write leaves no half file.
    merge : str or os.PathLike, optional
        A PyTorch profiler trace (``export_chrome_trace``'s ``.json``, or ``.json.gz``). The
        output is that trace with the memory events appended to its ``traceEvents``, on its
        clock: ``ts`` = (``time_ns`` + ``offset_ns`` - its ``baseTimeNanoseconds``) / 1000,
        and ``otherData["gpudash"]`` added. ``path`` may be the same file (with
        ``overwrite``).
    overwrite : bool, default False
        Replace an existing ``path``.
    devices, max_points
        As for :func:`to_chrome_trace`.
    offset_ns : int, optional
        Nanoseconds added to the trace's times to put them on the Unix-epoch clock. Needed to
        merge a trace whose times are not wall-clock (:func:`wall_clock_problem`); also a way
        to correct a clock that was off.

    Returns
    -------
    dict
        What ``otherData["gpudash"]`` holds (``notes``, ``devices``, ``decimated``...), plus
        ``events`` (memory events written) and, when merged, ``merged_into`` and
        ``profiler_events``.

    Raises
    ------
    TraceFormatError
        ``path`` exists and ``overwrite`` is False, or is not a regular file; the merge file
        cannot be used (:func:`read_profiler_trace`); the trace is merged, its times are not
        wall-clock and no ``offset_ns`` is given (the message says why they are not).
    ConfigError
        As for :func:`to_chrome_trace`.

    Notes
    -----
    Memory events that fall before the profiler's ``baseTimeNanoseconds`` get a negative
    ``ts`` (the profiler's base is floored to three months, so this needs a trace from before
    the quarter the profile began in); memory wholly outside the profiler's events is written
    as it is. Both are said in ``notes``.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"write_chrome_trace needs a gpudash.trace.Trace; got "
                        f"{type(trace).__name__}")
    name = _check_target(path, overwrite)
    if offset_ns is not None:
        offset_ns = _check_int(offset_ns, "offset_ns")
    if merge is None:
        out = to_chrome_trace(trace, devices=devices, max_points=max_points,
                              offset_ns=offset_ns)
        gd = out["otherData"]["gpudash"]
    else:
        prof = read_profiler_trace(merge)
        merge_name = os.fsdecode(os.fspath(merge))
        problem = wall_clock_problem(trace, offset_ns)
        if problem is not None:
            raise TraceFormatError(
                f"cannot align with {merge_name}: {problem}. Pass offset_ns (--offset-ns), the "
                "nanoseconds to add to its times to reach Unix-epoch time, to place it anyway")
        base = int(prof["baseTimeNanoseconds"])
        n_dev = 1 + max((d for d, _ in _device_list(trace, devices)), default=0)
        mem = to_chrome_trace(trace, devices=devices, max_points=max_points, offset_ns=offset_ns,
                              base_ns=base, pid_base=_free_pid_base(prof["traceEvents"], n_dev))
        gd = mem["otherData"]["gpudash"]
        gd["merged_into"] = merge_name
        gd["profiler_base_ns"] = base
        prof_events = prof["traceEvents"]
        gd["profiler_events"] = len(prof_events)
        prof_span, mem_span = _span_us(prof_events), _span_us(mem["traceEvents"])
        if mem_span is not None and mem_span[0] < 0:
            gd["notes"].append("some memory events come before the profiler's "
                               "baseTimeNanoseconds: their ts is negative")
        if prof_span is not None and mem_span is not None:
            if mem_span[1] < prof_span[0]:
                gd["notes"].append(f"the memory events end {(prof_span[0] - mem_span[1]) / 1e6:,.3f}"
                                   " s before the profiler's events begin: check that both "
                                   "come from the same run")
            elif mem_span[0] > prof_span[1]:
                gd["notes"].append(f"the memory events begin {(mem_span[0] - prof_span[1]) / 1e6:,.3f}"
                                   " s after the profiler's events end: check that both come "
                                   "from the same run")
        prof_events.extend(mem["traceEvents"])
        other = prof.get("otherData")
        if isinstance(other, dict):
            other["gpudash"] = gd
        elif other is None:
            prof["otherData"] = {"gpudash": gd}
        else:
            prof["gpudash"] = gd
        out = prof
        mem_events = len(mem["traceEvents"])
    tmp = f"{name}.tmp{os.getpid()}"
    try:
        if name.endswith(".gz"):
            with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as f:
                _dump(out, f)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                _dump(out, f)
        os.replace(tmp, name)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    result = dict(gd)
    result["events"] = mem_events if merge is not None else len(out["traceEvents"])
    return result
