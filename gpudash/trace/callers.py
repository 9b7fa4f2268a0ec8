"""Who called: the user's own frame of each recorded stack, and the annotation open at a time.

The building blocks of attribution (:mod:`gpudash.trace.holders`,
:mod:`gpudash.trace.categories`, :mod:`gpudash.trace.diff`), computed once per distinct frame
and stack of a trace's :class:`~gpudash.formats.stacks.StackTable` and mapped to rows by stack id
(a million events cost a gather, not a million Python calls).

The user's code
---------------
:class:`UserCode` decides which frames are the user's. The default rule: a Python file
(``.py``) that is neither PyTorch's (a ``torch/`` folder, or code that ``torch.compile``
generated under ``torchinductor_*``), nor an installed package (``site-packages``,
``dist-packages``), nor the standard library (``lib/python3.X/``, Windows' ``PythonXY/Lib/``);
C++ frames (no ``.py`` filename: ``??``, ``memory_snapshot.cpp``) are never the user's. A
regular expression (searched in the filename) or a callable on the filename replaces the whole
rule.

A stack's *call site* is its innermost user frame (PyTorch lists frames innermost first). A
stack without one is named by what it has instead (:func:`call_sites`): its innermost Python
frame, ``"(outside user code) module.py:1357 convert"``; for a stack of C++ frames only, the
autograd node that ran it, ``"(autograd) BmmBackward0"``, or ``"(no Python frame)"``; a row with
no stack is ``"(no stack recorded)"``.

Annotations
-----------
PyTorch's snapshot keeps the ``record_function`` ranges its profiler saw
(``external_annotations``: ``{"name", "stage": "START"|"END", "device", "time_us"}``), which the
importer keeps in ``meta["annotations"]`` as ranges (each END closes the latest open START of
its name and device). :func:`annotation_ranges` reads them (a range still open at the end runs
to the end, one closed without a START began before the trace), and :func:`annotations_at`
finds the innermost range open at each row's time, on the row's device.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._cells import cell_name
from .._errors import ConfigError
from ..formats.stacks import Frame, StackTable

__all__ = ["UserCode", "user_code_rule", "call_sites", "CallSites", "short_paths",
           "annotation_ranges", "annotations_at", "NO_STACK", "NO_ANNOTATION",
           "is_python_frame", "below_user_code", "frame_text", "stack_lines"]

#: The name of rows whose source recorded no stack.
NO_STACK = "(no stack recorded)"
#: The name of rows no annotation range was open for.
NO_ANNOTATION = "(no annotation)"
_NO_PYTHON = "(no Python frame)"

_SITE = re.compile(r"/(?:site|dist)-packages/", re.IGNORECASE)
_STDLIB = re.compile(r"/lib/python\d+(?:\.\d+)*t?/|/python\d*/lib/|^<frozen ", re.IGNORECASE)
_TORCH = re.compile(r"(?:^|/)torch/|/torchinductor_[^/]*/")
_AUTOGRAD_NODE = re.compile(r"(?:^|::)(\w*(?:Backward\w*|AccumulateGrad))::apply\b")
_DEFAULT_TEXT = ("default: the innermost .py frame outside torch (and torch.compile's generated "
                 "code), site-packages/dist-packages and the standard library; C++ frames are "
                 "never the user's")


def is_python_frame(filename: str) -> bool:
    """Whether a frame is Python code (its file ends in ``.py``)."""
    return filename.lower().endswith(".py")


def _default_is_user(filename: str) -> bool:
    if not is_python_frame(filename):
        return False
    path = filename.replace("\\", "/")
    return not (_SITE.search(path) or _STDLIB.search(path) or _TORCH.search(path))


@dataclass(frozen=True)
class UserCode:
    """Which frames are the user's own code.

    Attributes
    ----------
    description : str
        The rule in words (what results say as their ``rule``).
    test : callable
        ``test(filename) -> bool``.
    """

    description: str
    test: Callable[[str], bool]

    def __call__(self, filename: str) -> bool:
        return bool(self.test(filename))


#: The default rule (see the module docstring).
DEFAULT_USER_CODE = UserCode(_DEFAULT_TEXT, _default_is_user)


def user_code_rule(user_code: Any = None) -> UserCode:
    """The :class:`UserCode` a ``user_code=`` argument means.

    Parameters
    ----------
    user_code : None, str, re.Pattern, callable or UserCode
        None: the default rule. A string or compiled pattern: a frame is the user's when the
        pattern is found in its filename (``re.search``). A callable: called with the filename.

    Raises
    ------
    ConfigError
        A string that is not a regular expression, or a value of another type.
    """
    if user_code is None:
        return DEFAULT_USER_CODE
    if isinstance(user_code, UserCode):
        return user_code
    if isinstance(user_code, str):
        try:
            pattern = re.compile(user_code)
        except re.error as exc:
            raise ConfigError(f"user_code: {user_code!r:.80} is not a regular expression "
                              f"({exc}); give a Python regex searched in each frame's "
                              "filename, e.g. 'my_project/'") from None
        user_code = pattern
    if isinstance(user_code, re.Pattern):
        pat = user_code
        return UserCode(f"user_code={pat.pattern!r}: frames whose filename matches it",
                        lambda f: pat.search(f) is not None)
    if callable(user_code):
        name = getattr(user_code, "__qualname__", None) or type(user_code).__name__
        return UserCode(f"user_code={name}(filename): frames it accepts", user_code)
    raise ConfigError(f"user_code must be a regular expression (str or re.Pattern) or a "
                      f"callable on the filename; got {type(user_code).__name__}")


def short_paths(filenames: list[str]) -> dict[str, str]:
    """Each filename shortened to its last path components, as few as keep them distinct
    (``train.py``; ``a/models.py`` and ``b/models.py``); a notebook cell's code by the
    cell's name (``Cell In[5]``, :func:`gpudash._cells.cell_name`)."""
    cells = {f: c for f in filenames if (c := cell_name(f)) is not None}
    filenames = [f for f in filenames if f not in cells]
    parts = {f: [p for p in f.replace("\\", "/").split("/") if p] or [f] for f in filenames}
    depth = {f: 1 for f in filenames}
    for _ in range(64):
        shown: dict[str, list[str]] = {}
        for f in filenames:
            shown.setdefault("/".join(parts[f][-depth[f]:]), []).append(f)
        clash = [fs for fs in shown.values() if len(fs) > 1]
        grew = False
        for fs in clash:
            for f in fs:
                if depth[f] < len(parts[f]):
                    depth[f] += 1
                    grew = True
        if not grew:
            break
    return {**{f: "/".join(parts[f][-depth[f]:]) for f in filenames}, **cells}


@dataclass
class CallSites:
    """The call site of every stack of a table, by stack id.

    Attributes
    ----------
    frame : numpy.ndarray of int64
        Per stack id, the frame id of its innermost user frame, or -1.
    fallback : list of str
        Per stack id, what names a stack without a user frame (see the module docstring);
        "" where it has one.
    fallback_frame : numpy.ndarray of int64
        Per stack id, the innermost Python frame of a stack without a user frame (-1: none).
    is_user : numpy.ndarray of bool
        Per frame id, whether the frame is the user's.
    rule : UserCode
    """

    frame: np.ndarray
    fallback: list[str]
    fallback_frame: np.ndarray
    is_user: np.ndarray
    rule: UserCode


def call_sites(stacks: StackTable, rule: UserCode) -> CallSites:
    """The innermost user frame of every stack in ``stacks`` (each frame tested once)."""
    frames = stacks.frames
    is_user = np.fromiter((rule(f.filename) for f in frames), dtype=bool, count=len(frames))
    is_py = np.fromiter((is_python_frame(f.filename) for f in frames), dtype=bool,
                        count=len(frames))
    offsets, ids = stacks.frame_arrays()
    n = len(stacks)
    first_user = _first_in_segments(is_user[ids] if len(ids) else np.zeros(0, bool), offsets)
    first_py = _first_in_segments(is_py[ids] if len(ids) else np.zeros(0, bool), offsets)
    frame = np.where(first_user >= 0, ids[np.maximum(first_user, 0)] if len(ids) else -1, -1)
    fb_frame = np.where((first_user < 0) & (first_py >= 0),
                        ids[np.maximum(first_py, 0)] if len(ids) else -1, -1)
    fallback = [""] * n
    for s in np.flatnonzero(frame < 0).tolist():
        f = int(fb_frame[s])
        if f >= 0:
            fallback[s] = "(outside user code)"
            continue
        node = None
        for fid in stacks.stacks[s].frames:
            m = _AUTOGRAD_NODE.search(frames[fid].name)
            if m:
                node = m.group(1)
                break
        fallback[s] = f"(autograd) {node}" if node else _NO_PYTHON
    return CallSites(frame.astype(np.int64), fallback, fb_frame.astype(np.int64), is_user, rule)


def _first_in_segments(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per CSR segment, the position (into the flat array) of its first True, or -1."""
    n = len(offsets) - 1
    out = np.full(n, -1, dtype=np.int64)
    if not len(flags) or n <= 0:
        return out
    big = len(flags)
    pos = np.where(flags, np.arange(len(flags)), big)
    lengths = np.diff(offsets)
    nonempty = np.flatnonzero(lengths > 0)
    if len(nonempty):
        first = np.minimum.reduceat(pos, offsets[nonempty])
        out[nonempty] = np.where(first < big, first, -1)
    return out


_ATEN_OP = re.compile(r"at::_ops::(\w+)::")


def below_user_code(frames: list, test: Any, short: dict[str, str] | None = None) -> str:
    """What a stack ran below its innermost user frame (``frames`` innermost first):
    ``"(in libraries) functional.py:1701 relu"`` (the innermost Python frame there),
    ``"(C++) aten::mm"`` (the innermost ATen operator, when only C++ frames are there),
    ``"(C++)"``; "" when the user frame is the innermost or the stack has none."""
    first = next((i for i, f in enumerate(frames) if test(f.filename)), None)
    if not first:
        return ""
    below = frames[:first]
    py = next((f for f in below if is_python_frame(f.filename)), None)
    if py is not None:
        return f"(in libraries) {frame_text(py, short)}"
    op = next((m.group(1) for f in below for m in [_ATEN_OP.search(f.name)] if m), None)
    return f"(C++) aten::{op}" if op else "(C++)"


def frame_text(frame: Frame, short: dict[str, str] | None = None) -> str:
    """``file.py:LINE function`` with the filename shortened by ``short``."""
    name = short.get(frame.filename, frame.filename) if short else frame.filename
    return f"{name}:{frame.line} {frame.name}" if frame.line else f"{name} {frame.name}"


# ----------------------------------------------------------------------------- annotations
@dataclass
class AnnotationRanges:
    """Ranges of ``record_function`` annotations, sorted by start.

    Attributes
    ----------
    names : list of str
        The distinct names; ``name`` indexes it.
    device : numpy.ndarray of int64
        The device of each range (-1: every device).
    start, end : numpy.ndarray of int64
        Times in ns (int64 min / max where the trace has no START / END).
    name : numpy.ndarray of int64
    """

    names: list[str]
    device: np.ndarray
    start: np.ndarray
    end: np.ndarray
    name: np.ndarray

    def __len__(self) -> int:
        return len(self.start)


_MIN, _MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max


def _mark_time(entry: dict) -> int | None:
    for key, scale in (("time_ns", 1), ("time_us", 1000)):
        v = entry.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v):
            return int(round(v * scale))
    return None


def _int_or(v: Any, default: int) -> int:
    return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else default


def annotation_ranges(meta: dict) -> AnnotationRanges:
    """The ranges of ``meta["annotations"]``.

    Two forms are read: the importer's, ``{"names": [...], "ranges": [[device, name index,
    start_ns, end_ns], ...]}`` (``None`` for a start or end the trace did not see), and
    PyTorch's own list of marks, ``[{"name", "stage": "START"|"END", "device", "time_us"},
    ...]``, paired here. Entries of neither shape are left out.
    """
    marks = meta.get("annotations") if isinstance(meta, dict) else None
    out: list[tuple[int, int, int, int]] = []   # start, end, device, name
    names: dict[str, int] = {}
    if isinstance(marks, dict):
        table = marks.get("names")
        table = [str(x) for x in table] if isinstance(table, list) else []
        for r in marks.get("ranges") or []:
            if not isinstance(r, (list, tuple)) or len(r) != 4:
                continue
            dev, nid, start, end = r
            nid = _int_or(nid, -1)
            if not 0 <= nid < len(table):
                continue
            out.append((_int_or(start, _MIN), _int_or(end, _MAX), _int_or(dev, -1),
                        names.setdefault(table[nid], len(names))))
    elif isinstance(marks, list):
        rows: list[tuple[int, int, str, int]] = []
        for e in marks:
            if not isinstance(e, dict) or not isinstance(e.get("name"), str):
                continue
            stage = str(e.get("stage", "")).upper()
            t = _mark_time(e)
            if stage not in ("START", "END") or t is None:
                continue
            rows.append((t, 0 if stage == "START" else 1, e["name"],
                         _int_or(e.get("device"), -1)))
        rows.sort(key=lambda r: (r[0], -r[1]))   # at one instant, END before START
        open_: dict[tuple[str, int], list[int]] = {}
        for t, is_end, name, dev in rows:
            key = (name, dev)
            nid = names.setdefault(name, len(names))
            if not is_end:
                open_.setdefault(key, []).append(t)
            elif open_.get(key):
                out.append((open_[key].pop(), t, dev, nid))
            else:
                out.append((_MIN, t, dev, nid))
        for (name, dev), starts in open_.items():
            out.extend((s, _MAX, dev, names[name]) for s in starts)
    out.sort()
    arr = np.array(out, dtype=np.int64).reshape(-1, 4)
    return AnnotationRanges(list(names), arr[:, 2].copy(), arr[:, 0].copy(), arr[:, 1].copy(),
                            arr[:, 3].copy())


def annotations_at(ranges: AnnotationRanges, time_ns: np.ndarray,
                   device: np.ndarray) -> np.ndarray:
    """The innermost range open at each time, on each device: an index into the ranges
    (``ranges.name[i]`` names it), or -1. Ranges are laid over the times in the order they
    began, so a range opened later (inside another) wins where both are open."""
    out = np.full(len(time_ns), -1, dtype=np.int64)
    if not len(ranges) or not len(time_ns):
        return out
    time_ns = np.asarray(time_ns, dtype=np.int64)
    device = np.asarray(device, dtype=np.int64)
    devs = np.unique(device)
    for d in devs.tolist():
        sel = np.flatnonzero(device == d) if len(devs) > 1 else np.arange(len(time_ns))
        times = time_ns[sel]
        if len(times) > 1 and bool((times[1:] < times[:-1]).any()):
            order = np.argsort(times, kind="stable")
            times = times[order]
        else:                       # in time order already (a trace's rows are)
            order = np.arange(len(times))
        local = np.full(len(sel), -1, dtype=np.int64)
        pick = np.flatnonzero((ranges.device == d) | (ranges.device == -1))
        lo = np.searchsorted(times, ranges.start[pick], side="left")
        hi = np.searchsorted(times, ranges.end[pick], side="right")
        for a, b, r in zip(lo.tolist(), hi.tolist(), pick.tolist()):
            if b > a:
                local[a:b] = r
        out[sel[order]] = local
    return out


def stack_lines(frames: list, test: Any, limit: int = 40, full: bool = False) -> list[str]:
    """A stack (innermost first) for people, the user's own code first: the user's frames,
    what they called into (:func:`below_user_code`), then the other frames, counted or, with
    ``full``, listed (the libraries' Python frames, then C++'s); at most ``limit`` lines of
    at most 240 characters."""
    if test is None:
        lines = [str(f) for f in frames]
    else:
        mine = [f for f in frames if test(f.filename)]
        others = [f for f in frames if not test(f.filename)]
        py = [f for f in others if is_python_frame(f.filename)]
        cpp = [f for f in others if not is_python_frame(f.filename)]
        lines = [str(f) for f in mine]
        below = below_user_code(frames, test)
        if below:
            lines.append(f"called into {below}")
        if full or not mine:
            if py:
                lines.append("-- in libraries:" if mine else "-- no frame of your code; "
                             "in libraries:")
                lines.extend(str(f) for f in py)
            if cpp and (full or not py):
                lines.append("-- C++:")
                lines.extend(f.name or str(f) for f in cpp)
        elif others:
            lines.append(f"({len(others)} more frame(s) in libraries and C++)")
    if len(lines) > limit:
        lines = lines[:limit - 1] + [f"... {len(lines) - limit + 1} more line(s)"]
    return [x if len(x) <= _LINE else x[:_LINE - 3] + "..." for x in lines]


_LINE = 240   # a C++ frame's name can run to thousands of characters
