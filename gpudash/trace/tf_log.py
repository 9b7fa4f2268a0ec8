"""Import TensorFlow's verbose BFC allocator log (``TF_CPP_VMODULE=bfc_allocator=4``).

The lines that become events (everything else, stack traces included, is skipped)::

    I... bfc_allocator.cc:89] Creating new BFCAllocator named: GPU_0_bfc          a device
    I... bfc_allocator.cc:176] Extending allocation by 2.00MiB bytes for GPU_0_bfc.
    I... bfc_allocator.cc:186] Allocated memory at 0x7f72cab1e040 to 0x7f72cad1e040  extend
    I... bfc_allocator.cc:329] [mem-debug] AllocateRaw,GPU_0_bfc,8,0x7f72cab1e040,...  alloc
    I... bfc_allocator.cc:695] [mem-debug] DeallocateRaw,GPU_0_bfc,8,0x7f72cab1e040,... free
    W... bfc_allocator.cc:501] Allocator (GPU_0_bfc) ran out of memory trying to allocate
         1.00GiB (rounded to 1073741824)...                                         oom

An ``extend`` belongs to the allocator named in the nearest preceding "Extending allocation"
line (else the most recently named allocator). Its ``requested`` is the rounded request of the
allocator's last ``AllocateRaw NAME N`` line (VLOG 3), else the region size. An ``alloc``'s
size is its request rounded up to 256 (the log does not say which chunk served it). An OOM's
``requested`` is exact when TensorFlow printed the size in bytes (``"200B"``), else the
rounded size. Times come from the glog prefix: ``I0000 00:00:1796221057.331681`` (absl before
``InitializeLog``: seconds since the epoch), ``I1202 17:04:05.123456`` (day of year and time
of day: the year is not logged) or ``2021-03-04 12:34:56.789012: I`` (older TensorFlow: since
the epoch); lines without one take the last time seen, or their line number * 1000. The
allocator limit is taken from "Created device ... with N MB memory" (GPU allocators) or the
``Limit:`` line of a memory dump.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from typing import IO

from .._errors import TraceFormatError
from .format import Trace, _EventBuilder, _source_name, _text_source, round_up_256

__all__ = ["load_tf_log"]

_PREFIX = re.compile(r"([IWEF])(\d\d)(\d\d) (\d\d):(\d\d):(\d+)\.(\d{1,9})\s")
# TensorFlow's own format before absl logging: "2021-03-04 12:34:56.789012: I tensorflow/..."
_PREFIX_DATED = re.compile(r"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{1,9}): [IWEF] ")
_CREATE = re.compile(r"Creating new BFCAllocator named: (\S+)")
_EXTENDING = re.compile(r"Extending allocation by .*? bytes for (\S+?)\.?\s*$")
_ALLOCATED = re.compile(r"Allocated memory at (0x[0-9a-fA-F]+) to (0x[0-9a-fA-F]+)")
_MEMDEBUG = re.compile(r"\[mem-debug\] (AllocateRaw|DeallocateRaw),([^,]*),(\d+),([^,]*)")
_REQUEST = re.compile(r"\] AllocateRaw (\S+)\s+(\d+)\s*$")
_OOM = re.compile(r"Allocator \(([^)]*)\) ran out of memory trying to allocate "
                  r"([\d.]+)([KMGTPE]i)?B(?: \(rounded to (\d+)\))?")
_CREATED_DEVICE = re.compile(r"Created device \S*?device:GPU:(\d+) with (\d+) MB memory")
_LIMIT = re.compile(r"^\s*Limit:\s+(\d+)\s*$")
_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
          "Ei": 1 << 60}
_JAN1 = datetime.date(2000, 1, 1).toordinal()
_EPOCH = datetime.date(1970, 1, 1).toordinal()


def _prefix_time(m: re.Match) -> int:
    _, mo, dd, hh, mi, ss, frac = m.groups()
    days = 0
    if mo != "00" and dd != "00":
        try:  # a leap year, so Feb 29 is valid
            days = datetime.date(2000, int(mo), int(dd)).toordinal() - _JAN1
        except ValueError:
            days = 0
    seconds = ((days * 24 + int(hh)) * 60 + int(mi)) * 60 + int(ss)
    return seconds * 10**9 + int(frac.ljust(9, "0"))


def _dated_time(m: re.Match) -> int:
    y, mo, dd, hh, mi, ss, frac = m.groups()
    days = datetime.date(int(y), int(mo), int(dd)).toordinal() - _EPOCH
    seconds = ((days * 24 + int(hh)) * 60 + int(mi)) * 60 + int(ss)
    return seconds * 10**9 + int(frac.ljust(9, "0"))


def load_tf_log(path_or_file: str | os.PathLike | IO) -> Trace:
    """Load a TensorFlow BFC allocator log as a :class:`Trace`.

    Parameters
    ----------
    path_or_file : str, os.PathLike or file object (text or binary)

    Returns
    -------
    Trace
        One device per allocator name (in order of appearance; meta ``devices[i]["name"]``
        is the name, ``options`` holds ``memory_limit`` when the log shows it).
        ``meta["source"] = "tensorflow-log"``; also ``allocator_name`` (the first
        allocator), ``allocator_names``, ``memory_limit`` (when known for a single
        allocator), ``approximate_oom_sizes`` and ``unmatched_frees`` (frees of memory
        allocated before the log starts).

    Raises
    ------
    TraceFormatError
        A recognised line whose values do not parse, or a log with no allocator lines at all.
    """
    name = _source_name(path_or_file)
    b = _EventBuilder()
    index: dict[str, int] = {}
    limits: dict[str, int] = {}
    gpu_limits: dict[str, int] = {}
    last_request: dict[str, int] = {}
    extending: str | None = None     # allocator of the last "Extending allocation" line
    last_name: str | None = None     # allocator named most recently
    stats_owner: str | None = None   # allocator whose memory dump is being printed
    now: int | None = None
    approx = 0

    def dev(n: str) -> int:
        i = index.get(n)
        if i is None:
            i = index[n] = len(index)
            b.add_device(i, n)
        return i

    with _text_source(path_or_file) as f:
        for lineno, line in enumerate(f, 1):
            c0 = line[:1]
            if c0 in ("\t", " ", "\n", "*", ""):
                continue
            if stats_owner is not None and line.startswith("Limit:"):
                m = _LIMIT.match(line)
                if m:
                    limits[stats_owner] = int(m.group(1))
                    stats_owner = None
                continue
            m = _PREFIX.match(line)
            if m is not None:
                now = _prefix_time(m)
            elif c0.isdigit():
                m = _PREFIX_DATED.match(line)
                if m is not None:
                    with contextlib.suppress(ValueError):   # an impossible date
                        now = _dated_time(m)
            t = now if now is not None else lineno * 1000
            try:
                if "[mem-debug] " in line:
                    m = _MEMDEBUG.search(line)
                    if m is None:
                        continue
                    op, alloc, nbytes, ptr_text = m.groups()
                    ptr = int(ptr_text, 16) if ptr_text.startswith("0x") else 0
                    if not ptr:
                        continue
                    last_name = alloc
                    if op == "AllocateRaw":
                        b.alloc(t, dev(alloc), ptr, int(nbytes))
                    else:
                        b.free(t, dev(alloc), ptr, int(nbytes))
                elif "] AllocateRaw " in line:
                    m = _REQUEST.search(line)
                    if m is not None:
                        last_request[m.group(1)] = int(m.group(2))
                elif "Allocated memory at " in line:
                    m = _ALLOCATED.search(line)
                    if m is None:
                        continue
                    start, end = int(m.group(1), 16), int(m.group(2), 16)
                    if end < start:
                        raise ValueError(f"region end {m.group(2)} is below its start")
                    owner = extending or last_name
                    if owner is None:
                        owner = next(iter(index), "bfc_allocator")
                    req = last_request.get(owner)
                    b.extend(t, dev(owner), start, end - start,
                             round_up_256(req) if req else None)
                    extending = None
                elif "Extending allocation by " in line:
                    m = _EXTENDING.search(line)
                    if m is not None:
                        extending = last_name = m.group(1)
                        dev(extending)
                elif "Creating new BFCAllocator named: " in line:
                    m = _CREATE.search(line)
                    if m is not None:
                        last_name = m.group(1)
                        dev(last_name)
                elif "ran out of memory trying to allocate" in line:
                    m = _OOM.search(line)
                    if m is None:
                        continue
                    alloc, num, unit, rounded = m.groups()
                    last_name = stats_owner = alloc
                    value = float(num) * _UNITS[unit]
                    if rounded is not None:
                        size = int(rounded)
                        requested = int(value) if unit is None else size
                    else:
                        requested = round(value)
                        size = round_up_256(requested)
                        approx += unit is not None
                    b.oom(t, dev(alloc), requested, size)
                elif "Created device " in line:
                    m = _CREATED_DEVICE.search(line)
                    if m is not None:
                        gpu_limits[f"GPU_{m.group(1)}_bfc"] = int(m.group(2)) << 20
            except ValueError as exc:
                raise TraceFormatError(f"{name}, line {lineno}: {exc}") from None
    if not index:
        raise TraceFormatError(
            f"{name}: no BFC allocator lines found; expected a log written with "
            "TF_CPP_VMODULE=bfc_allocator=4 ('[mem-debug] AllocateRaw,...' lines)")
    for n, i in index.items():
        limit = limits.get(n, gpu_limits.get(n))
        if limit is not None:
            b.devices[i]["options"] = {"memory_limit": limit}
    names = list(index)
    meta = {"source": "tensorflow-log", "allocator_name": names[0], "allocator_names": names,
            "approximate_oom_sizes": approx}
    if len(names) == 1 and b.devices[0]["options"]:
        meta["memory_limit"] = b.devices[0]["options"]["memory_limit"]
    return b.build(meta)
