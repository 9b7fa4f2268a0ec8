"""Import the CSV log of RAPIDS RMM's ``logging_resource_adaptor``.

::

    Thread,Time,Action,Pointer,Size,Stream
    140215557785344,23:59:59.999812,allocate,0x7f8b6a000000,1024,0x0
    140215557785344,00:00:00.000101,free,0x7f8b6a000000,1024,0x0
    140215557785344,00:00:00.000350,allocate failure,(nil),68719476736,0x0

Columns are read by name (``csv.DictReader``), so their order and extra columns do not
matter. Two other layouts are read too:

- rows without the header line, as spark-rapids prints them to stderr
  (``spark.rapids.memory.gpu.debug``): the six columns above, in that order;
- RMM 0.12's ``rmm.csv_log()``: ``Event Type,Device ID,Address,Stream,Size (bytes),...,
  Start,End,Elapsed,Location`` (``Alloc``/``Free``, times in seconds from ``Start``, the
  device from ``Device ID``).
 ``allocate`` becomes an ``alloc`` event, ``free`` a ``free``, ``allocate failure`` an
``oom``. Times have no date: a time more than 12 hours earlier than the previous one is taken
as the next day (the log crossed midnight). ``time_ns`` counts from midnight of the first
day. A ``.dev{N}`` suffix in the file name (``rmm_log.dev1.csv``, as
``rmm.reinitialize(logging=True)`` names per-device logs) gives the device index.
"""

from __future__ import annotations

import csv
import os
import re
from typing import IO

from .._errors import ConfigError, TraceFormatError
from .format import MAX_DEVICE, Trace, EventBuilder, source_name, text_source

__all__ = ["load_rmm_csv", "device_from_filename"]

_REQUIRED = ("Time", "Action", "Pointer", "Size")
#: The header of the current log, for header-less rows.
HEADER = ("Thread", "Time", "Action", "Pointer", "Size", "Stream")
#: RMM <= 0.12 (``rmm.csv_log()``).
OLD_REQUIRED = ("Event Type", "Address", "Size (bytes)", "Start")
_ROW = re.compile(r"\s*\d+\s*,\s*\d{1,2}:\d{2}:\d{2}(\.\d+)?\s*,\s*(allocate|free|allocate failure)"
                  r"\s*,")


def layout_of(first_line: str) -> str | None:
    """``"header"``, ``"rows"`` (no header), ``"rmm012"`` or None for a first line."""
    cols = {c.strip() for c in first_line.split(",")}
    if set(_REQUIRED) <= cols:
        return "header"
    if set(OLD_REQUIRED) <= cols:
        return "rmm012"
    if _ROW.match(first_line):
        return "rows"
    return None
_TIME = re.compile(r"\s*(\d{1,2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?\s*$")
_DEV = re.compile(r"\.dev(\d+)(?:\.[^.]*)?$")
_DAY_NS = 86_400 * 10**9
_HALF_DAY_NS = _DAY_NS // 2


def device_from_filename(name: str) -> int | None:
    """The device index of a per-device RMM log name (``log.dev1.csv`` -> 1), else None."""
    m = _DEV.search(os.path.basename(name))
    return int(m.group(1)) if m else None


def _pointer(text: str) -> int:
    text = text.strip()
    if text in ("(nil)", "0", "nullptr"):
        return 0
    try:
        value = int(text, 16)
    except ValueError:
        raise ValueError(f"Pointer {text[:40]!r} is neither 0x... nor (nil)") from None
    if not 0 <= value < 1 << 63:
        raise ValueError(f"Pointer {text[:40]!r} is outside 0 .. 2**63-1")
    return value


def _device(text: str) -> int:
    text = text.strip()
    if len(text) > 6 or not text.lstrip("-").isdigit() or not 0 <= int(text) <= MAX_DEVICE:
        raise ValueError(f"Device ID {text[:24]!r} is not a device index 0 .. {MAX_DEVICE}")
    return int(text)


def _size(text: str) -> int:
    text = text.strip()
    try:
        value = int(text) if len(text) <= 20 else None
    except ValueError:
        value = None
    if value is None:
        raise ValueError(f"Size {text[:40]!r} is not a byte count")
    if value < 0:
        raise ValueError(f"Size {text!r} is negative")
    if value >= 1 << 63:
        raise ValueError(f"Size {text!r} is 2**63 bytes or more")
    return value


def load_rmm_csv(path_or_file: str | os.PathLike | IO, *, device: int | None = None) -> Trace:
    """Load an RMM logging CSV as a :class:`Trace`.

    Parameters
    ----------
    path_or_file : str, os.PathLike or file object
    device : int, optional
        Device index (0 .. 32767); by default from a ``.dev{N}`` file-name suffix, else 0
        (RMM 0.12 logs: each row's ``Device ID``).

    Returns
    -------
    Trace
        ``meta["source"] = "rmm-csv"``; meta also counts ``threads``, ``streams``,
        ``null_frees`` (frees of ``(nil)``, skipped), ``null_allocs`` (0-byte allocations that
        returned ``(nil)``, skipped) and ``days`` crossed.

    Raises
    ------
    TraceFormatError
        No ``Time``/``Action``/``Pointer``/``Size`` column, or a row whose values do not parse
        or cannot be right (a negative size, a device outside 0 .. 32767; names the file,
        line and column).
    ConfigError
        ``device`` is not an integer 0 .. 32767.
    """
    name = source_name(path_or_file)
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, int) \
                or not 0 <= device <= MAX_DEVICE:
            raise ConfigError(f"device must be an integer 0 .. {MAX_DEVICE}; got {device!r}")
    else:
        device = device_from_filename(name)
        if device is not None and device > MAX_DEVICE:
            raise TraceFormatError(f"{name}: the file name's .dev{device} is above device "
                                   f"{MAX_DEVICE}")
    given = device
    device = device or 0
    b = EventBuilder()
    b.add_device(device, f"cuda:{device}")
    threads: set[str] = set()
    streams: set[str] = set()
    null_frees = null_allocs = 0
    day = 0
    prev = None
    with text_source(path_or_file, newline="") as f:
        first = f.readline()
        f.seek(0)
        kind = layout_of(first)
        if kind == "rmm012":
            return _load_rmm012(f, name, given)
        if kind == "rows":
            reader = csv.DictReader(f, fieldnames=list(HEADER), skipinitialspace=True)
        else:
            reader = csv.DictReader(f, skipinitialspace=True)
            fields = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in _REQUIRED if c not in fields]
            if missing:
                raise TraceFormatError(
                    f"{name}, line 1: expected an RMM log header with columns "
                    f"Thread,Time,Action,Pointer,Size,Stream (or rows in that order, or RMM "
                    f"0.12's Event Type,...); missing {missing} (found {fields})")
            reader.fieldnames = fields
        for row in reader:
            line = reader.line_num
            try:
                m = _TIME.match(row["Time"] or "")
                if m is None:
                    raise ValueError(f"Time {row['Time']!r} is not HH:MM:SS.ffffff")
                h, mi, s, frac = m.groups()
                t = ((int(h) * 60 + int(mi)) * 60 + int(s)) * 10**9 + int(
                    (frac or "0").ljust(9, "0"))
                if prev is not None and t + day * _DAY_NS < prev - _HALF_DAY_NS:
                    day += 1
                t += day * _DAY_NS
                prev = t
                action = (row["Action"] or "").strip()
                ptr = _pointer(row["Pointer"] or "")
                size = _size(row["Size"] or "")
            except (ValueError, TypeError, AttributeError) as exc:
                raise TraceFormatError(f"{name}, line {line}: {exc}") from None
            if row.get("Thread"):
                threads.add(row["Thread"])
            if row.get("Stream"):
                streams.add(row["Stream"].strip())
            if action == "allocate":
                if ptr:
                    b.alloc(t, device, ptr, size)
                else:
                    null_allocs += 1
            elif action == "free":
                if ptr:
                    b.free(t, device, ptr, size)
                else:
                    null_frees += 1
            elif action == "allocate failure":
                b.oom(t, device, size)
            else:
                raise TraceFormatError(
                    f"{name}, line {line}: Action {action!r}; expected 'allocate', 'free' or "
                    "'allocate failure'")
    meta = {"source": "rmm-csv", "threads": len(threads), "streams": len(streams),
            "null_frees": null_frees, "null_allocs": null_allocs, "days": day}
    return b.build(meta)


def _load_rmm012(f: IO, name: str, device: int | None) -> Trace:
    """RMM <= 0.12's ``rmm.csv_log()`` layout."""
    reader = csv.DictReader(f, skipinitialspace=True)
    reader.fieldnames = [h.strip() for h in (reader.fieldnames or [])]
    b = EventBuilder()
    devices: set[int] = set()
    streams: set[str] = set()
    null = 0
    for row in reader:
        line = reader.line_num
        try:
            kind = (row["Event Type"] or "").strip().lower()
            dev = device if device is not None else _device(row.get("Device ID") or "0")
            t = round(float(row["Start"]) * 1e9)
            if not (0 <= t < 1 << 62):
                raise ValueError(f"Start {row['Start']!r} is not a time in seconds")
            ptr = _pointer(row["Address"] or "")
            size = _size(row["Size (bytes)"] or "")
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            raise TraceFormatError(f"{name}, line {line}: {exc}") from None
        if dev not in devices:
            b.add_device(dev, f"cuda:{dev}")
            devices.add(dev)
        if row.get("Stream"):
            streams.add(row["Stream"].strip())
        if not ptr:
            null += 1
            continue
        if kind == "alloc":
            b.alloc(t, dev, ptr, size)
        elif kind == "free":
            b.free(t, dev, ptr, size)
        else:
            raise TraceFormatError(f"{name}, line {line}: Event Type {row['Event Type']!r}; "
                                   "expected 'Alloc' or 'Free'")
    if not devices:
        b.add_device(device or 0, f"cuda:{device or 0}")
    return b.build({"source": "rmm-csv", "layout": "rmm-0.12", "streams": len(streams),
                    "null_pointers": null, "threads": 0, "days": 0})
