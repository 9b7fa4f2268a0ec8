"""Load a trace in any format gpudash knows (sniffed from its first bytes) and save one.

========================  ===================================================  ==============
format                    recognised by                                        loader
========================  ===================================================  ==============
``gdtrace``               the ``GPUDASH-TRACE`` magic line                     read_trace
``torch-pickle``          a pickle (first byte 0x80)                           load_torch_snapshot
``torch-json``            JSON whose first key of interest is ``segments`` or  load_torch_snapshot
                          ``device_traces`` (or a JSON list of segments)
``tf-vectors``            JSON with a ``steps`` list                           load_tf_vectors
``cupy-hook``             JSON lines whose first line has a ``"hook"``         load_cupy_hook
``rmm-csv``               a CSV header with Time, Action, Pointer and Size     load_rmm_csv
``tf-log``                text mentioning ``bfc_allocator`` / ``BFCAllocator``  load_tf_log
                          or an allocator's out-of-memory message
``xplane``                a ``*.xplane.pb`` file, or a directory holding a     load_xplane
                          profile (a TensorBoard log directory, a run)
``torch-profile``         a Chrome trace: JSON with ``traceEvents`` (or a JSON  load_torch_profile
                          list of events with ``"ph"``), gzip-compressed or
                          not (``prof.export_chrome_trace``'s ``.json``,
                          ``.json.gz``)
========================  ===================================================  ==============

A directory is read as a profile (:func:`gpudash.formats.xplane.find_profile`): the newest run
of a TensorBoard log directory, unless ``run=`` names one.
"""

from __future__ import annotations

import csv
import json
import os
import re
import stat
import struct
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import GpudashError, TraceFormatError
from .cupy_hook import load_cupy_hook
from .format import (MAGICS, MAX_DEVICE, Trace, check_meta, check_values, device_entries,
                     file_kind, open_regular, read_trace, write_trace)
from .perfetto import write_chrome_trace
from .rmm_csv import layout_of as rmm_layout
from .rmm_csv import load_rmm_csv
from .tf_log import load_tf_log
from .tf_vectors import load_tf_vectors
from .torch_profile import gunzip_head, load_torch_profile
from .torch_snapshot import load_torch_snapshot, save_torch_snapshot
from .xplane import load_xplane

__all__ = ["load_trace", "load_ranks", "save_trace", "sniff_format", "FORMATS"]

#: Format name -> loader.
FORMATS: dict[str, Callable[..., Trace]] = {
    "gdtrace": read_trace,
    "torch-pickle": load_torch_snapshot,
    "torch-json": load_torch_snapshot,
    "tf-vectors": load_tf_vectors,
    "cupy-hook": load_cupy_hook,
    "rmm-csv": load_rmm_csv,
    "tf-log": load_tf_log,
    "xplane": load_xplane,
    "torch-profile": load_torch_profile,
}

_SAVE_FORMATS = ("gdtrace", "torch-json", "torch-pickle", "perfetto")
_HEAD = 1 << 16
_JSON_KEY = re.compile(rb'"(segments|device_traces|steps)"\s*:')
_TF_WORDS = (b"bfc_allocator", b"BFCAllocator", b"[mem-debug] AllocateRaw,",
             b"ran out of memory trying to allocate", b"Ran out of memory trying to allocate")
# a JSON list starts with "[" then a value; "[ Info: ..." (Julia's logger) does not
_JSON_LIST = re.compile(rb"\[\s*(?:[\[{\]\"]|-?\d|true|false|null)")
# a Chrome trace: an object with "traceEvents", or a list whose first event has "ph"
_TRACE_EVENTS = re.compile(rb'"traceEvents"\s*:')
_EVENT_LIST = re.compile(rb'\[\s*\{[^\[\]{}]*"ph"\s*:\s*"')


def _is_profile_dir(path: str | os.PathLike) -> bool:
    """A TensorBoard log directory, a profile folder or a run folder (xplane files)."""
    from pathlib import Path

    p = Path(path)
    return any(p.glob("*.xplane.pb")) or any(p.glob("plugins/profile/*/*.xplane.pb")) or \
        any(p.glob("profile/*/*.xplane.pb")) or any(p.glob("*/*.xplane.pb"))


def sniff_format(path: str | os.PathLike) -> str | None:
    """The format name of the file (or directory) at ``path`` from its first 64 KiB, or None."""
    if os.path.isdir(path):
        return "xplane" if _is_profile_dir(path) else None
    if os.fspath(path).endswith(".xplane.pb"):
        return "xplane"
    with open_regular(path) as f:
        head = f.read(_HEAD)
    if head[:2] == b"\x1f\x8b":   # gzip: only PyTorch's profiler traces come compressed
        text = gunzip_head(head, _HEAD).lstrip(b"\xef\xbb\xbf \t\r\n")
        return "torch-profile" if _is_chrome_trace(text) else None
    if head.startswith(MAGICS):
        return "gdtrace"
    if head[:1] == b"\x80":
        return "torch-pickle"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text[:1] == b"{":
        first = text.split(b"\n", 1)[0]
        try:
            obj = json.loads(first)
        except (ValueError, RecursionError):   # not JSON, or nested past Python's stack
            obj = None
        if isinstance(obj, dict) and "hook" in obj:
            return "cupy-hook"
        if _is_chrome_trace(text):
            return "torch-profile"
        m = _JSON_KEY.search(text)
        if m is not None:
            return "tf-vectors" if m.group(1) == b"steps" else "torch-json"
        return None
    if text[:1] == b"[" and _JSON_LIST.match(text):
        return "torch-profile" if _is_chrome_trace(text) else "torch-json"
    first_line = text.split(b"\n", 1)[0].decode("utf-8", "replace")
    if rmm_layout(first_line) is not None:  # header, header-less rows, or RMM 0.12
        return "rmm-csv"
    if any(w in head for w in _TF_WORDS):
        return "tf-log"
    return None


def _is_chrome_trace(text: bytes) -> bool:
    """Whether JSON text starts like a Chrome trace (what PyTorch's profiler exports)."""
    if text[:1] == b"{":
        return _TRACE_EVENTS.search(text) is not None
    return text[:1] == b"[" and _EVENT_LIST.match(text) is not None


def load_trace(path: str | os.PathLike, format: str | None = None, **options) -> Trace:
    """Load a trace of any known format.

    Parameters
    ----------
    path : str or os.PathLike
    format : str, optional
        One of :data:`FORMATS`; sniffed from the file's first bytes when omitted.
    **options
        Passed to the loader (``device=`` for RMM, ``strict=`` for CuPy, ``cpu=`` for a
        PyTorch profiler trace...).

    Raises
    ------
    TraceFormatError
        An unknown format (the message lists the known ones), the loader's own errors, an
        event with a negative size, requested size or device, or metadata ``devices`` that
        cannot be used (all naming the file).
    """
    if isinstance(path, (str, os.PathLike)) and not isinstance(path, bool):
        name = os.fspath(path)
        if isinstance(name, str) and _GLOB.search(name) and not os.path.exists(name):
            return load_ranks(name, format, **options)
        if os.path.isdir(name) and not _is_profile_dir(name):
            return load_ranks(name, format, **options)
    path = _check_input(path)
    if format is None:
        try:
            format = sniff_format(path)
        except (ValueError, RecursionError, UnicodeError) as exc:
            raise TraceFormatError(f"{os.fspath(path)}: cannot tell its format "
                                   f"({type(exc).__name__})") from exc
        if format is None:
            raise TraceFormatError(
                f"{os.fspath(path)}: cannot tell its format; known formats: "
                f"{', '.join(FORMATS)} (pass format=... to choose one)")
    loader = FORMATS.get(format)
    if loader is None:
        raise TraceFormatError(
            f"unknown trace format {format!r}; known formats: {', '.join(FORMATS)}")
    try:
        trace = loader(path, **options)
    except (GpudashError, OSError, KeyboardInterrupt):
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            RecursionError, EOFError, UnicodeError, MemoryError, struct.error,
            zlib.error, csv.Error) as exc:
        # a reader met something it does not expect: the input is damaged or not what its
        # format says, and the caller gets one error naming the file
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TraceFormatError(
            f"{os.fspath(path)}: not a readable {format} trace ({type(exc).__name__}"
            f"{': ' + detail[:300] if detail else ''})") from exc
    if isinstance(trace, Trace):
        check_meta(trace.meta, os.fspath(path))
        check_values(trace, os.fspath(path))
    return trace


def _check_input(path: Any) -> Any:
    """A path to read: a str or os.PathLike naming a regular file, or a directory (a
    TensorBoard log dir). Never an int (a file descriptor would be closed) or a bool."""
    if isinstance(path, (bool, int)) or not isinstance(path, (str, bytes, os.PathLike)):
        raise TraceFormatError(f"a trace is read from a path (str or os.PathLike); got "
                               f"{type(path).__name__} {path!r}")
    name = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TraceFormatError(f"{name}: no such file") from None
    except OSError as exc:
        raise TraceFormatError(f"{name}: cannot read it ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        return path  # a TensorBoard log directory; the xplane reader says if it is not one
    if not stat.S_ISREG(st.st_mode):
        raise TraceFormatError(f"{name}: is {file_kind(st.st_mode)}, not a trace file")
    if st.st_size == 0:
        raise TraceFormatError(f"{name}: the file is empty")
    return path


def save_trace(trace: Trace, path: str | os.PathLike, format: str = "gdtrace",
               overwrite: bool = False, **options: Any) -> Any:
    """Save ``trace`` as ``gdtrace`` (lossless), ``torch-json``, ``torch-pickle`` or
    ``perfetto`` (Chrome Trace Event JSON of its memory:
    :func:`gpudash.formats.perfetto.write_chrome_trace`, which takes ``options``: ``merge``,
    ``devices``, ``max_points``, ``offset_ns``).

    Returns
    -------
    None, or for ``perfetto`` what :func:`~gpudash.formats.perfetto.write_chrome_trace` returns.

    Raises
    ------
    TraceFormatError
        ``path`` exists and ``overwrite`` is False, an unknown format, or ``options`` for a
        format that takes none.
    """
    if options and format != "perfetto":
        raise TraceFormatError(f"saving as {format!r} takes no options; got "
                               f"{', '.join(sorted(options))}")
    if format == "gdtrace":
        write_trace(trace, path, overwrite=overwrite)
    elif format in ("torch-json", "torch-pickle"):
        save_torch_snapshot(trace, path, overwrite=overwrite, format=format[6:])
    elif format == "perfetto":
        return write_chrome_trace(trace, path, overwrite=overwrite, **options)
    else:
        raise TraceFormatError(
            f"cannot save as {format!r}; formats gpudash writes: {', '.join(_SAVE_FORMATS)}")
    return None


_GLOB = re.compile(r"[*?\[]")
_RANK = re.compile(r"(?:rank|worker|proc|gpu)[_-]?(\d+)", re.IGNORECASE)


def _natural(path: Any) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(path))]


def _rank_name(path: str, taken: set) -> str:
    base = os.path.basename(path)
    m = _RANK.search(base)
    name = f"rank{m.group(1)}" if m else base.split(".")[0]
    while name in taken:
        name += "'"
    taken.add(name)
    return name


def load_ranks(files: Any, format: str | None = None, **options) -> Trace:
    """Per-rank (or per-worker) files as one trace, one device per file and device.

    Parameters
    ----------
    files : str, os.PathLike or list of them
        A glob (``"snaps/rank*_memory_snapshot.pickle"``), a directory (its files, in natural
        order; hidden files skipped), or a list of paths.
    format : str, optional
        The format of every file (sniffed per file by default).

    Returns
    -------
    Trace
        Devices numbered in file order; each is named after its rank (``rank3`` from
        ``rank3_memory_snapshot.pickle``, ``worker2``...; else the file's name) and the
        device's own name (``rank3 cuda:0``); ``meta["ranks"]`` lists ``{"name", "file"}``.

    Raises
    ------
    TraceFormatError
        No files matched, or a file is not a trace (the message names it).
    """
    import glob as _glob

    if isinstance(files, (str, os.PathLike)):
        name = os.fspath(files)
        if os.path.isdir(name):
            paths = [os.path.join(name, f) for f in os.listdir(name)
                     if not f.startswith(".") and os.path.isfile(os.path.join(name, f))]
        else:
            paths = _glob.glob(name)
        where = name
    else:
        paths = [os.fspath(f) for f in files]
        where = f"{len(paths)} file(s)"
    paths = sorted(paths, key=_natural)
    if not paths:
        raise TraceFormatError(f"{where}: no files to read as ranks")
    parts = []
    ranks = []
    taken: set = set()
    next_dev = 0
    for path in paths:
        t = load_trace(path, format, **options)
        rank = _rank_name(path, taken)
        ranks.append({"name": rank, "file": path})
        known = device_entries(t.meta)
        devs = sorted(set(np.unique(t.columns["device"]).tolist()) | set(known)) or [0]
        if next_dev + len(devs) > MAX_DEVICE + 1:
            raise TraceFormatError(f"{path}: the ranks up to this file hold "
                                   f"{next_dev + len(devs):,} devices; a trace holds at most "
                                   f"{MAX_DEVICE + 1:,} (0 .. {MAX_DEVICE})")
        lut = np.zeros(max(devs) + 1, dtype=np.int64)
        for i, d in enumerate(devs):
            lut[d] = next_dev + i
        cols = dict(t.columns)
        cols["device"] = lut[cols["device"]].astype(cols["device"].dtype) if len(
            cols["device"]) else cols["device"]
        meta = dict(t.meta)
        meta["devices"] = [
            dict(known.get(d, {}), index=int(lut[d]),
                 name=f"{rank} {known.get(d, {}).get('name') or f'device {d}'}", file=path)
            for d in devs]
        settings = [dict(st, device=int(lut[int(st["device"])])) if "device" in st else dict(st)
                    for st in t.settings]
        parts.append(Trace(cols, meta, settings, holder=t.holder, holders=t.holders))
        next_dev += len(devs)
    out = Trace.concat(parts)
    out.meta["source"] = f"{parts[0].meta.get('source', 'trace')} ({len(paths)} ranks)"
    out.meta["ranks"] = ranks
    return out
