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
import io
import os
import re
from typing import IO, Any

from .._errors import TraceFormatError
from .format import (PRE_EXISTING_HOLDER, Trace, EventBuilder, source_name, text_source,
                     round_up_256)
from .tf_dump import read_log_dumps

__all__ = ["load_tf_log"]

_PREFIX = re.compile(r"([IWEF])(\d\d)(\d\d) (\d\d):(\d\d):(\d+)\.(\d{1,9})\s")
# TensorFlow's own format before absl logging: "2021-03-04 12:34:56.789012: I tensorflow/..."
_PREFIX_DATED = re.compile(r"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{1,9}): [IWEF] ")
_CREATE = re.compile(r"Creating new BFCAllocator named: (\S+)")
# Linear on any line (see tf_dump): the amount ("2.00MiB") is one bounded word, an
# allocator's name stops at the next parenthesis and has at most 256 characters.
_EXTENDING = re.compile(r"Extending allocation by \S{1,64} bytes for (\S+?)\.?\s*$")
_ALLOCATED = re.compile(r"Allocated memory at (0x[0-9a-fA-F]+) to (0x[0-9a-fA-F]+)")
_MEMDEBUG = re.compile(r"\[mem-debug\] (AllocateRaw|DeallocateRaw),([^,]*),(\d+),([^,]*)")
_REQUEST = re.compile(r"\] AllocateRaw (\S+)\s+(\d+)\s*$")
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


_CREATED_TF_DEVICE = re.compile(r"Created TensorFlow device \(\S*?device:GPU:(\d+) with "
                                r"(\d+) MB memory\)")
_OOM_ANY = re.compile(r"(?:Allocator \(([^()]{0,256})\) ran|Ran) out of memory trying to allocate "
                      r"(\d+(?:\.\d+)?)([KMGTPE]i)?B(?: \(rounded to (\d+)\))?")
_NOT_A_FAILURE = "The caller indicates that this is not a failure"
_MAX = 1 << 63


def _checked(value: int, what: str) -> int:
    if not 0 <= value < _MAX:
        raise ValueError(f"{what} {value if len(str(value)) <= 30 else str(value)[:24] + '...'}"
                         f" is outside 0 .. 2**63-1")
    return value


def _num(text: str, what: str) -> int:
    if len(text) > 20:
        raise ValueError(f"{what} {text[:24]}... has {len(text)} digits; expected at most 20")
    return _checked(int(text), what)


def load_tf_log(path_or_file: str | os.PathLike | IO) -> Trace:
    """Load a TensorFlow BFC allocator log as a :class:`Trace`.

    Parameters
    ----------
    path_or_file : str, os.PathLike or file object (text or binary)

    Returns
    -------
    Trace
        One device per allocator name (in order of appearance; meta ``devices[i]["name"]``
        is the name; ``memory_limit`` and ``options["memory_limit"]`` hold the limit when the
        log shows it, and :func:`~gpudash.trace.replay.replay` then uses it).
        ``meta["source"] = "tensorflow-log"``; also ``allocator_name`` (the first
        allocator), ``allocator_names``, ``memory_limit`` (when known for a single
        allocator), ``approximate_oom_sizes``, ``unmatched_frees`` (frees of memory
        allocated before the log starts), ``declined_allocations`` (see Notes),
        ``dump_states`` (allocators whose state came from a dump) and ``incomplete_states``
        (allocators that failed with less than their whole state in the trace: see Notes).

    Raises
    ------
    TraceFormatError
        A recognised line whose values do not parse or cannot be right (a size of 400
        digits, a pointer, size or time of 2**63 or more, a device index above 32767): names
        the file and line; or a log with no allocator lines at all.

    Notes
    -----
    *Dumps.* A log without verbose allocator lines (what users paste) still shows the state at
    an out-of-memory error in the allocator's dump (:mod:`gpudash.formats.tf_dump`). When an
    allocator has no events before its first dump, that dump's state becomes events at the
    error's time: one ``extend`` per region and one ``alloc`` per chunk in use (``requested``
    = the chunk's size, holder the chunk's op or "(in use before the profile)"), then the
    error's ``oom`` row (holder: the op that asked). Replaying such a trace at the log's limit
    rebuilds that much memory in use and retries the request. When the dump lacks chunk lines
    (elided, cut off, or absent: JAX prints only the error line), or there is no dump, the
    allocator's first failure is listed in ``meta["incomplete_states"]`` as ``{"allocator",
    "line", "warnings" (the dump's own, as ``gpudash explain`` prints them), "in_use" (bytes
    in use the dump's summary or stats state, None when unknown), "rebuilt" (bytes in use the
    trace holds)}``.

    *Declined allocations.* ``Allocator (X) ran out of memory trying to allocate N with
    freed_by_count=0. The caller indicates that this is not a failure...`` is a warning, not an
    error: an allocation that may fail (a convolution's scratch space) failed and the caller
    used a fallback. These are not ``oom`` events; each is listed in
    ``meta["declined_allocations"]`` as ``{"allocator", "bytes", "approximate", "time_ns",
    "line"}``.
    """
    name = source_name(path_or_file)
    with text_source(path_or_file) as f:
        text = f.read()
    try:
        dumps = read_log_dumps(io.StringIO(text))
    except TraceFormatError as exc:
        raise TraceFormatError(str(exc).replace("<stream>", name, 1)) from None
    dump_at = {d.extra["line"]: d for d in dumps if d.chunks}

    def dump_of_line(lineno: int, alloc: str) -> Any:
        # the dump of an out-of-memory line: the one it opens, else (TF 0.8 prints the line
        # after its dump) the last dump before it of that allocator or of none named
        before = [d for d in dumps if d.extra["line"] <= lineno
                  and d.allocator_name in ("", alloc)]
        return before[-1] if before and (before[-1].extra["line"] == lineno
                                         or before[-1].extra.get("request")) else None
    b = EventBuilder()
    index: dict[str, int] = {}
    limits: dict[str, int] = {}
    gpu_limits: dict[str, int] = {}
    last_request: dict[str, int] = {}
    has_events: set[str] = set()
    from_dump: list[str] = []
    declined: list[dict] = []
    incomplete: list[dict] = []
    noted: set[str] = set()          # allocators in incomplete
    extending: str | None = None     # allocator of the last "Extending allocation" line
    last_name: str | None = None     # allocator named most recently
    stats_owner: str | None = None   # allocator whose memory dump is being printed
    now: int | None = None
    approx = 0

    def dev(n: str) -> int:
        i = index.get(n)
        if i is None:
            i = index[n] = len(index)
            if i >= 1 << 15:
                raise ValueError(f"allocator {n!r} would be device {i}; at most 32768 "
                                 "allocators")
            b.add_device(i, n)
        return i

    def state_from_dump(t: int, alloc: str, dump: Any) -> None:
        # Regions in the order growth made them (sizes double: smallest first), each filled
        # left to right with all its chunks, then the free ones freed: a BFC replay with
        # growth then rebuilds the same layout when the sizes follow TensorFlow's doubling.
        d = dev(alloc)
        by_region: dict[int, list] = {}
        for c in dump.chunks:
            by_region.setdefault(c.region, []).append(c)
        order = sorted(dump.regions, key=lambda r: (r.size, r.ptr))
        for r in order:
            b.extend(t, d, r.ptr, r.size)
        for r in order:
            for c in by_region.get(r.ptr, []):
                b.alloc(t, d, c.address, c.size, c.size, holder=c.holder or PRE_EXISTING_HOLDER)
        for c in dump.chunks:
            if not c.in_use:
                b.free(t, d, c.address)
        from_dump.append(alloc)
        if not dump.extra.get("complete", True):
            stateless(alloc, dump.extra.get("line", 0), dump)

    def stateless(alloc: str, line: int, dump: Any) -> None:
        # a failure replayed without its allocator's whole state: say what is missing
        if alloc in noted:
            return
        noted.add(alloc)
        if dump is None:
            warnings, in_use = ["no allocator dump follows the out-of-memory line"], None
        else:   # bytes in use are known from the in-use summary or the stats, not the chunks
            warnings = list(dump.extra.get("warnings", []))
            known = dump.extra.get("in_use_from") in ("in-use summary", "stats")
            in_use = dump.stats.bytes_in_use if known else None
        rebuilt = sum(c.size for c in dump.chunks if c.in_use) \
            if dump is not None and alloc in from_dump else 0
        incomplete.append({"allocator": alloc, "line": line, "warnings": warnings,
                           "in_use": in_use, "rebuilt": rebuilt})

    for lineno, line in enumerate(io.StringIO(text), 1):
        where = f"{name}, line {lineno}"
        c0 = line[:1]
        if c0 in ("\n", "*", ""):
            continue
        if c0 in ("\t", " "):
            if "out of memory trying to allocate" not in line:
                continue
            line = line.lstrip()           # an indented out-of-memory line
            c0 = line[:1]
        if stats_owner is not None and line.startswith("Limit:"):
            m = _LIMIT.match(line)
            if m:
                try:
                    limits[stats_owner] = _num(m.group(1), "limit")
                except ValueError as exc:
                    raise TraceFormatError(f"{where}: {exc}") from None
                stats_owner = None
            continue
        try:
            m = _PREFIX.match(line)
            if m is not None:
                now = _checked(_prefix_time(m), "time (ns)")
            elif c0.isdigit():
                m = _PREFIX_DATED.match(line)
                if m is not None:
                    with contextlib.suppress(ValueError, OverflowError):   # impossible date
                        now = _checked(_dated_time(m), "time (ns)")
            t = now if now is not None else lineno * 1000
            if "[mem-debug] " in line:
                m = _MEMDEBUG.search(line)
                if m is None:
                    continue
                op, alloc, nbytes, ptr_text = m.groups()
                ptr = _checked(int(ptr_text, 16), "pointer") if ptr_text.startswith("0x") \
                    and len(ptr_text) <= 18 else (0 if not ptr_text.startswith("0x") else
                                                   _checked(int(ptr_text, 16), "pointer"))
                if not ptr:
                    continue
                nbytes = _num(nbytes, "size")
                last_name = alloc
                has_events.add(alloc)
                if op == "AllocateRaw":
                    b.alloc(t, dev(alloc), ptr, nbytes)
                else:
                    b.free(t, dev(alloc), ptr, nbytes)
            elif "] AllocateRaw " in line:
                m = _REQUEST.search(line)
                if m is not None:
                    last_request[m.group(1)] = _num(m.group(2), "size")
            elif "Allocated memory at " in line:
                m = _ALLOCATED.search(line)
                if m is None:
                    continue
                start = _checked(int(m.group(1)[:20], 16), "address")
                end = _checked(int(m.group(2)[:20], 16), "address")
                if end < start:
                    raise ValueError(f"region end {m.group(2)} is below its start")
                owner = extending or last_name
                if owner is None:
                    owner = next(iter(index), "bfc_allocator")
                req = last_request.get(owner)
                has_events.add(owner)
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
            elif "out of memory trying to allocate" in line:
                m = _OOM_ANY.search(line)
                if m is None:
                    continue
                alloc, num, unit, rounded = m.groups()
                if len(num) > 24:
                    raise ValueError(f"size {num[:24]}... is too long a number")
                value = float(num) * _UNITS[unit]
                if not value < _MAX:
                    raise ValueError(f"size {num}{unit or ''}B is 2**63 bytes or more")
                if rounded is not None:
                    size = _num(rounded, "rounded size")
                    requested = int(value) if unit is None else size
                else:
                    requested = round(value)
                    size = round_up_256(requested)
                if alloc is None:                   # TF 0.8: "Ran out of memory ..."
                    alloc = last_name or (dumps[0].allocator_name if dumps and
                                          dumps[0].allocator_name else "bfc_allocator")
                if _NOT_A_FAILURE in line:
                    dev(alloc)
                    declined.append({"allocator": alloc, "bytes": requested,
                                     "approximate": rounded is None and unit is not None,
                                     "time_ns": t, "line": lineno})
                    continue
                last_name = stats_owner = alloc
                dump = dump_at.get(lineno)
                if dump is not None and alloc not in has_events and alloc not in from_dump:
                    state_from_dump(t, alloc, dump)
                elif alloc not in has_events and alloc not in from_dump and alloc not in noted:
                    stateless(alloc, lineno, dump_of_line(lineno, alloc))
                if rounded is None and unit is not None:
                    approx += 1
                req_op = re.search(r"requested by op (\S+)", line)
                b.oom(t, dev(alloc), requested, size,
                      holder=req_op.group(1) if req_op is not None else None)
            elif "Created device " in line:
                m = _CREATED_DEVICE.search(line)
                if m is not None:
                    gpu_limits[f"GPU_{_gpu(m.group(1))}_bfc"] = _num(m.group(2), "MB") << 20
            elif "Created TensorFlow device (" in line:
                m = _CREATED_TF_DEVICE.search(line)
                if m is not None:
                    gpu_limits[f"GPU_{_gpu(m.group(1))}_bfc"] = _num(m.group(2), "MB") << 20
        except (ValueError, OverflowError) as exc:
            raise TraceFormatError(f"{where}: {exc}") from None
    # a dump whose out-of-memory line was not recognised above (a dump pasted alone)
    for d in dumps:
        alloc = d.allocator_name
        if d.chunks and alloc and alloc not in has_events and alloc not in from_dump:
            t = now if now is not None else int(d.extra["line"]) * 1000
            state_from_dump(t, alloc, d)
            req = d.extra.get("request")
            if req:
                b.oom(t, dev(alloc), req["bytes"], req["rounded"], holder=req.get("op"))
    for d in dumps:   # limits printed in dumps (TF 0.8 names no allocator: the only one)
        owner = d.allocator_name or (next(iter(index)) if len(index) == 1 else None)
        if owner in index and d.memory_limit:   # a rounded one ("48.00MiB") is close enough
            limits.setdefault(owner, max(d.memory_limit, d.stats.pool_bytes))
    if not index:
        raise TraceFormatError(
            f"{name}: no BFC allocator lines found; expected a log written with "
            "TF_CPP_VMODULE=bfc_allocator=4 ('[mem-debug] AllocateRaw,...' lines) or an "
            "allocator's out-of-memory message and dump ('Allocator (GPU_0_bfc) ran out of "
            "memory trying to allocate ...')")
    for n, i in index.items():
        limit = limits.get(n, gpu_limits.get(n))
        if limit is not None:
            b.devices[i]["options"] = {"memory_limit": limit}
            b.devices[i]["memory_limit"] = limit
    names = list(index)
    meta = {"source": "tensorflow-log", "allocator_name": names[0], "allocator_names": names,
            "approximate_oom_sizes": approx, "declined_allocations": declined,
            "dump_states": from_dump, "incomplete_states": incomplete}
    if len(names) == 1 and b.devices[0]["options"]:
        meta["memory_limit"] = b.devices[0]["options"]["memory_limit"]
    return b.build(meta)


def _gpu(text: str) -> int:
    i = _num(text, "device index")
    if i >= 1 << 15:
        raise ValueError(f"device index {i} is above 32767")
    return i
