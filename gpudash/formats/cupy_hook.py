"""Import the JSON lines CuPy's ``DebugPrintHook`` prints.

::

    {"hook":"alloc","device_id":0,"mem_size":512,"mem_ptr":150496608256}
    {"hook":"malloc","device_id":0,"size":24,"mem_size":512,"mem_ptr":150496608256,"pmem_id":"0x7f39200c5278"}
    {"hook":"free","device_id":0,"mem_size":512,"mem_ptr":150496608256,"pmem_id":"0x7f39200c5278"}

``alloc`` (memory taken from the device by the pool) becomes an ``extend`` event; ``malloc``
(a pool request) an ``alloc`` with ``requested = size`` and ``size = mem_size``, or an ``oom``
when ``mem_ptr`` is 0 (CuPy reports a failed request with zeros); ``free`` a ``free``. The lines
carry no time: ``time_ns`` is the line number * 1000.
"""

from __future__ import annotations

import json
import os
from typing import IO

from .._errors import TraceFormatError
from .format import Trace, EventBuilder, source_name, text_source

__all__ = ["load_cupy_hook"]

_NEEDS = {"alloc": ("mem_size", "mem_ptr"), "malloc": ("size", "mem_size", "mem_ptr"),
          "free": ("mem_size", "mem_ptr")}


_MAX_DEVICE = (1 << 15) - 1   # the trace's device column is int16


def _out_of_range(rec: dict, fields: tuple[str, ...]) -> str | None:
    """What is wrong with a record's numbers (None when nothing): sizes and pointers are
    0 .. 2**63-1, ``device_id`` 0 .. 32767."""
    for k in fields:
        top = _MAX_DEVICE if k == "device_id" else (1 << 63) - 1
        v = rec[k]
        if not 0 <= v <= top:
            shown = v if v.bit_length() < 100 else f"a {v.bit_length()}-bit number"
            return f"{rec['hook']!r} record with {k} {shown}; expected 0 .. {top:,}"
    return None


def load_cupy_hook(path_or_file: str | os.PathLike | IO, *, strict: bool = True) -> Trace:
    """Load a ``DebugPrintHook`` log as a :class:`Trace`.

    Parameters
    ----------
    path_or_file : str, os.PathLike or file object (text or binary)
    strict : bool, default True
        Raise on a line that is not a hook record (or one whose numbers cannot be right).
        With False such lines (a program's own prints mixed into the same stream) are
        skipped and counted in ``meta["skipped_lines"]``.

    Returns
    -------
    Trace
        One device per ``device_id`` (named ``cuda:N``); ``meta["source"] = "cupy-hook"``.

    Raises
    ------
    TraceFormatError
        A line that is not JSON or not a hook record, or a record with a negative size or
        pointer or a device_id outside 0 .. 32767 (names the file and line number).
    """
    name = source_name(path_or_file)
    b = EventBuilder()
    skipped = failed_device_allocs = 0
    with text_source(path_or_file) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            problem = None
            try:
                rec = json.loads(line)
            except ValueError as exc:
                rec, problem = None, f"not JSON ({exc.args[0] if exc.args else exc})"
            if rec is not None:
                if not isinstance(rec, dict) or rec.get("hook") not in _NEEDS:
                    problem = "not a hook record (expected \"hook\": alloc, malloc or free)"
                else:
                    fields = (*_NEEDS[rec["hook"]], "device_id")
                    missing = [k for k in fields if isinstance(rec.get(k), bool)
                               or not isinstance(rec.get(k), int)]
                    if missing:
                        problem = f"{rec['hook']!r} record without integer {missing}"
                    else:
                        problem = _out_of_range(rec, fields)
            if problem is not None:
                if strict:
                    raise TraceFormatError(
                        f"{name}, line {lineno}: {problem}; expected a DebugPrintHook JSON "
                        "line (pass strict=False to skip such lines)")
                skipped += 1
                continue
            t, dev, hook = lineno * 1000, rec["device_id"], rec["hook"]
            b.add_device(dev, f"cuda:{dev}")
            if hook == "malloc":
                if rec["mem_ptr"]:
                    b.alloc(t, dev, rec["mem_ptr"], rec["size"], rec["mem_size"])
                else:
                    b.oom(t, dev, rec["size"], rec["mem_size"] or None)
            elif hook == "free":
                b.free(t, dev, rec["mem_ptr"], size=rec["mem_size"])
            elif rec["mem_ptr"]:
                b.extend(t, dev, rec["mem_ptr"], rec["mem_size"])
            else:
                failed_device_allocs += 1
    meta = {"source": "cupy-hook", "skipped_lines": skipped,
            "failed_device_allocs": failed_device_allocs}
    return b.build(meta)
