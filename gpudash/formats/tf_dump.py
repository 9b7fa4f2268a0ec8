"""Rebuild a BFC allocator's state from what TensorFlow, JAX or XLA printed or wrote at an
out-of-memory error, as the :class:`~gpudash.MemoryDump` that
:meth:`gpudash.BFCAllocator.snapshot` returns.

Two sources:

- **a text log** with the allocator's dump (what a user pastes into a bug report), with or
  without glog prefixes, among other lines, one dump or several (several allocators,
  repeated errors): :func:`read_log_dumps`;
- **the ``MemoryDump`` protobuf** that TensorFlow writes when ``TF_BFC_MEMORY_DUMP`` is set
  (``<prefix>_<allocator>.<micros>``), read with the protobuf runtime and gpudash's own message
  definition (:mod:`gpudash.proto`): :func:`read_memory_dump_pb`.

:func:`read_dumps` takes either. What a log's dump holds, in the order TensorFlow prints it
(every version from 0.8 to 2.21 and XLA's newest; lines may be missing)::

    Allocator (GPU_0_bfc) ran out of memory trying to allocate 3.00MiB (rounded to 3145728)
        requested by op Empty                                      the request
    BFCAllocator dump for GPU_0_bfc
    Bin (256): Total Chunks: 1, Chunks in use: 1. 256B allocated ... 4B client-requested ...
    Next region of size 18874368                                   a region
    InUse at 7fd01adff040 of size 3145728 next 31                  a chunk (also "Free  at",
    InUse at 7f.. of size 256 tag lower by op X ... next 5         TF 1.x "Chunk at", XLA's
                                                                   "tag", MEM_DEBUG "by op")
    3 Chunks of size 1024 totalling 3.0KiB                         the in-use summary
    Sum Total of in-use chunks: 45.89MiB
    Total size in pool: 48.00MiB memory_limit_: 48.00MiB available size: 0B ...
    Stats: Limit: / InUse: / MaxInUse: / NumAllocs: / MaxAllocSize: ...
    ***************x***_____****                                   the occupancy line

**Bytes come from the chunk lines**, which are exact; the rounded figures the dump prints
(``45.89MiB``) are checked against them, and each check is recorded in
``extra["checks"]``. When chunk lines are missing (a dump cut off, or elided by the person
who pasted it), the in-use summary (exact counts and sizes) gives the bytes in use, and the
dump is marked incomplete with a warning saying what is missing. TensorFlow 1.x dumps have
no region lines: regions are then the runs of adjacent chunks (``extra["regions_inferred"]``).

Fields of the result that a log does not give: a chunk's ``requested_size`` (0 = unknown;
``extra["requested_known"]`` is False), ``allocation_id`` (0 for chunks in use, unknown) and
``handle`` (-1 where unknown). ``extra`` also holds ``request`` (the failed allocation:
``bytes``, ``rounded``, ``exact``, ``op``; None when the dump names none), ``source``,
``file``, ``line``, ``complete``, ``warnings``, ``reported`` (the dump's own figures) and
``occupancy``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .._errors import TraceFormatError
from ..bfc import AllocatorStats, BinSummary, MemChunk, MemoryDump, RegionInfo
from .format import open_regular, source_name, text_source, bin_for_size, round_up_256

__all__ = ["read_dumps", "read_log_dumps", "read_memory_dump_pb", "parse_human_bytes",
           "is_memory_dump_pb"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50,
          "E": 1 << 60}
_MAX_DIGITS = 20   # no byte count or address TensorFlow prints has more


def parse_human_bytes(text: str) -> tuple[int, bool]:
    """``(bytes, exact)`` from TensorFlow's ``HumanReadableNumBytes`` text or a plain integer.

    ``"256B"`` and ``"1234"`` are exact; ``"45.89MiB"`` is rounded (the value returned is the
    nearest integer to 45.89 MiB).

    Raises
    ------
    ValueError
        Not such a number.
    """
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)(?:([KMGTPE])iB|B)?", text.strip())
    if m is None or len(m.group(1)) > _MAX_DIGITS + 3:
        raise ValueError(f"not a byte count: {text!r}")
    num, unit = m.group(1), m.group(2) or ""
    if unit == "" and "." not in num:
        return int(num), True
    return int(round(float(num) * _UNITS[unit])), False


# ---------------------------------------------------------------------------- line patterns
# Every pattern below is linear in the length of the line it is tried on, however hostile
# the line: no unbounded repetition that a failed attempt could rescan from each of many
# starting points (a name stops at the next parenthesis and has at most 256 characters).
# glog/absl prefixes: "I0000 00:00:1796282022.689252   12639 bfc_allocator.cc:1049] ",
# "2017-11-06 08:55:24.919712: I tensorflow/core/.../bfc_allocator.cc:627] ",
# "I tensorflow/core/common_runtime/bfc_allocator.cc:685] " (TF 0.8, no time)
_SOURCE_TAG = re.compile(r"(?<=\S)\.(?:cc|h|cpp|py):\d+\]")
_SPACE = re.compile(r"\s")
_TAG_SPAN = 512
_OOM_TEXT = "out of memory trying to allocate"
_OOM = re.compile(
    r"Allocator \((?P<name>[^()]{0,256})\) ran out of memory trying to allocate "
    r"(?P<num>\d+(?:\.\d+)?)(?P<unit>[KMGTPE]i)?B"
    r"(?: \(rounded to (?P<rounded>\d+)\))?"
    r"(?: from the \w+ end)?"
    r"(?P<rest>.*)$")
_OOM_OLD = re.compile(r"Ran out of memory trying to allocate (?P<num>\d+(?:\.\d+)?)"
                      r"(?P<unit>[KMGTPE]i)?B")
_NOT_A_FAILURE = "The caller indicates that this is not a failure"
_DUMP_FOR = re.compile(r"BFCAllocator dump for (\S+)")
_BIN = re.compile(r"Bin \((\d+)\):\s*Total Chunks: (\d+), Chunks in use: (\d+)\. (\S+) allocated "
                  r"for chunks\. (\S+) in use in bin\. (\S+) client-requested in use in bin\.")
_REGION = re.compile(r"Next region of size (\d+)")
_CHUNK = re.compile(r"^(InUse|Free|Chunk)\s+at\s+(?:0x)?([0-9a-fA-F]+)\b(.*)$")
_SIZE = re.compile(r"\bof size (\d+)")
_NEXT = re.compile(r"\bnext (\d+)")
_TAG = re.compile(r"\btag (\S+)")
_BY_OP = re.compile(r"\bby op (\S+) action_count (\d+) step (\d+)")
_SUMMARY = re.compile(r"^(\d+) Chunks of size (\d+) totalling (\S+)")
_SUM_TOTAL = re.compile(r"Sum Total of in-use chunks: (\S+)")
_POOL = re.compile(r"(?:total_region_allocated_bytes_|Total (?:size|bytes) in pool):\s*(\S+)\s+"
                   r"memory_limit_:\s*(\S+)\s+available (?:bytes|size):\s*(\S+)"
                   r"(?:\s+curr_region_allocation_bytes_:\s*(\S+))?")
_XLA_SUMMARY = re.compile(r"Allocator memory summary: rounded request (\S+), total free in pool "
                          r"(\S+), largest free chunk usable by \w+ end (\S+), unallocated bytes "
                          r"(\S+), pool size (\S+), pool limit (\S+)")
_STAT = re.compile(r"^(Limit|InUse|MaxInUse|NumAllocs|MaxAllocSize|Reserved|PeakReserved|"
                   r"LargestFreeBlock):\s+(\S+)\s*$")
_OCCUPANCY = re.compile(r"^[*x_]{20,}$")
_INVALID_HANDLE = (1 << 64) - 1


@dataclass
class _Raw:
    """What one dump printed, as read."""

    line: int
    name: str = ""
    request: dict | None = None
    bins: dict[int, tuple] = field(default_factory=dict)
    regions: list[list] = field(default_factory=list)   # [size, [chunks]]
    loose: list[tuple] = field(default_factory=list)    # chunks outside any region (TF 1.x)
    summary: list[tuple[int, int]] = field(default_factory=list)
    sum_total: tuple[int, bool] | None = None
    pool: dict[str, tuple[int, bool]] = field(default_factory=dict)
    stats: dict[str, tuple[int, bool]] = field(default_factory=dict)
    occupancy: str = ""
    elided: bool = False
    content: bool = False


def _body(line: str) -> str:
    """The line after its glog/absl source tag (``bfc_allocator.cc:1049] ``), if any.

    The tag is the last ``.cc:N]`` (``.h``, ``.cpp``, ``.py``) of the first run of
    non-space characters that holds one, among the line's first 512 characters; it is
    found with one linear scan (a pattern starting with ``\\S+`` would rescan the run from
    each of its characters: time quadratic in its length).
    """
    head = line[:_TAG_SPAN]
    m = _SOURCE_TAG.search(head)
    if m is None:
        return line.strip()
    space = _SPACE.search(head, m.end())
    end = m.end()
    for later in _SOURCE_TAG.finditer(head, end, space.start() if space else len(head)):
        end = later.end()
    if end < len(head) and head[end].isspace():
        end += 1
    return line[end:].rstrip("\r\n")


def _int(text: str, where: str, what: str) -> int:
    if len(text) > _MAX_DIGITS:
        raise TraceFormatError(f"{where}: {what} {text[:24]}... has {len(text)} digits; "
                               f"expected at most {_MAX_DIGITS}")
    value = int(text)
    if value >= 1 << 63:
        raise TraceFormatError(f"{where}: {what} {value} is 2**63 or more; expected a value "
                               "below 2**63")
    return value


def _hex(text: str, where: str) -> int:
    if len(text) > 16:
        raise TraceFormatError(f"{where}: address {text[:24]} has {len(text)} hex digits; "
                               "expected at most 16")
    value = int(text, 16)
    if value >= 1 << 63:
        raise TraceFormatError(f"{where}: address 0x{text} is 2**63 or more; expected an "
                               "address below 2**63")
    return value


def _human(text: str, where: str, what: str) -> tuple[int, bool]:
    try:
        value, exact = parse_human_bytes(text)
    except ValueError:
        raise TraceFormatError(f"{where}: {what} {text!r} is not a byte count") from None
    if abs(value) >= 1 << 63:
        raise TraceFormatError(f"{where}: {what} {text} is 2**63 bytes or more")
    return value, exact


def read_log_dumps(path_or_file: str | os.PathLike | IO) -> list[MemoryDump]:
    """Every allocator dump in a text log, in the order they appear.

    Parameters
    ----------
    path_or_file : str, os.PathLike or file object

    Returns
    -------
    list of MemoryDump
        See the module docstring for what ``extra`` holds. Empty when the log has no dump
        and no out-of-memory line. An out-of-memory line without a dump after it (JAX prints
        only the line) gives a dump with no chunks, ``extra["complete"] = False``.

    Raises
    ------
    TraceFormatError
        A dump line whose numbers cannot be right (a size of 400 digits, an address of
        2**63 or more): names the file and line.
    """
    name = source_name(path_or_file)
    raws: list[_Raw] = []
    cur: _Raw | None = None
    with text_source(path_or_file) as f:
        for lineno, line in enumerate(f, 1):
            where = f"{name}, line {lineno}"
            body = _body(line)
            if not body:
                continue
            if _NOT_A_FAILURE in body:
                continue
            m = _OOM.search(body) if _OOM_TEXT in body else None
            if m is not None:
                cur = _Raw(lineno, name=m.group("name"))
                raws.append(cur)
                cur.request = _request(m, where)
                rest = m.group("rest")
                op = re.search(r"requested by op (\S*)", rest)
                if op is not None:
                    cur.request["op"] = op.group(1)
                continue
            m = _OOM_OLD.search(body) if _OOM_TEXT in body else None
            if m is not None:
                req = _request(m, where)
                if cur is not None and cur.request is None and cur.content:
                    cur.request = req          # TF 0.8 prints the line after its dump
                else:
                    cur = _Raw(lineno, request=req)
                    raws.append(cur)
                continue
            m = _DUMP_FOR.search(body)
            if m is not None:
                if cur is None or cur.content or (cur.name and cur.name != m.group(1)):
                    cur = _Raw(lineno)
                    raws.append(cur)
                cur.name = m.group(1)
                continue
            m = _BIN.search(body)
            if m is not None:
                b = _int(m.group(1), where, "bin size")
                if cur is None or (cur.content and (b in cur.bins or cur.regions)):
                    cur = _Raw(lineno)
                    raws.append(cur)
                cur.content = True
                cur.bins[b] = (_int(m.group(2), where, "chunk count"),
                               _int(m.group(3), where, "chunk count"),
                               _human(m.group(4), where, "bin bytes"),
                               _human(m.group(5), where, "bin bytes"),
                               _human(m.group(6), where, "bin bytes"))
                continue
            if cur is None:
                if _CHUNK.match(body) or _SUMMARY.match(body) or _REGION.search(body):
                    cur = _Raw(lineno)         # a dump pasted without its first lines
                    raws.append(cur)
                else:
                    continue
            m = _REGION.search(body)
            if m is not None:
                cur.regions.append([_int(m.group(1), where, "region size"), []])
                cur.content = True
                continue
            m = _CHUNK.match(body)
            if m is not None:
                kind, addr, rest = m.groups()
                size = _SIZE.search(rest)
                if size is None:
                    raise TraceFormatError(f"{where}: a chunk line without 'of size N': "
                                           f"{body[:80]!r}")
                nxt = _NEXT.search(rest)
                op = _BY_OP.search(rest)
                tag = _TAG.search(rest)
                chunk = (_hex(addr, where), _int(size.group(1), where, "chunk size"),
                         kind != "Free",
                         int(nxt.group(1)) if nxt is not None and len(nxt.group(1)) <= 20
                         else None,
                         op.group(1) if op is not None else "",
                         tag.group(1) if tag is not None else "")
                if cur.regions and kind != "Chunk":
                    cur.regions[-1][1].append(chunk)
                else:
                    cur.loose.append(chunk)
                cur.content = True
                continue
            m = _SUMMARY.match(body)
            if m is not None:
                cur.summary.append((_int(m.group(1), where, "chunk count"),
                                    _int(m.group(2), where, "chunk size")))
                cur.content = True
                continue
            m = _SUM_TOTAL.search(body)
            if m is not None:
                cur.sum_total = _human(m.group(1), where, "in-use total")
                continue
            m = _POOL.search(body)
            if m is not None:
                cur.pool["pool"] = _human(m.group(1), where, "pool size")
                cur.pool["limit"] = _human(m.group(2), where, "memory limit")
                cur.pool["available"] = _human(m.group(3), where, "available bytes")
                if m.group(4):
                    cur.pool["curr_region"] = _human(m.group(4), where, "region size")
                continue
            m = _XLA_SUMMARY.search(body)
            if m is not None:
                cur.pool["free"] = _human(m.group(2), where, "free bytes")
                cur.pool["largest_free"] = _human(m.group(3), where, "free chunk")
                cur.pool["available"] = _human(m.group(4), where, "unallocated bytes")
                cur.pool["pool"] = _human(m.group(5), where, "pool size")
                cur.pool["limit"] = _human(m.group(6), where, "pool limit")
                continue
            if body.startswith("Stats:"):
                continue
            m = _STAT.match(body)
            if m is not None:
                cur.stats[m.group(1)] = _human(m.group(2), where, m.group(1))
                cur.content = True
                continue
            if _OCCUPANCY.match(body) and (cur.stats or cur.request is not None):
                cur.occupancy = body
                continue
            if "A very long repetition" in body or body.startswith("...."):
                cur.elided = True
    return [_to_dump(r, name) for r in raws]


def _request(m: re.Match, where: str) -> dict:
    num, unit = m.group("num"), m.group("unit")
    if len(num) > _MAX_DIGITS + 3:
        raise TraceFormatError(f"{where}: request size {num[:24]}... is too long a number")
    value = float(num) * (_UNITS[unit[0]] if unit else 1)
    rounded = m.groupdict().get("rounded")
    if rounded is not None:
        r = _int(rounded, where, "rounded request")
        exact = unit is None
        return {"bytes": int(value) if exact else r, "rounded": r, "exact": exact, "op": ""}
    nbytes = int(round(value))
    return {"bytes": nbytes, "rounded": round_up_256(nbytes), "exact": unit is None, "op": ""}


def _to_dump(r: _Raw, name: str) -> MemoryDump:
    warnings: list[str] = []
    checks: list[dict] = []
    # chunks and regions
    regions: list[RegionInfo] = []
    chunks_by_region: list[tuple[int, list[tuple]]] = []
    inferred = False
    if r.regions:
        for size, chunks in r.regions:
            if not chunks:
                warnings.append(f"a region of {size} bytes lists no chunks")
                continue
            start = min(c[0] for c in chunks)
            regions.append(RegionInfo(start, size))
            chunks_by_region.append((start, sorted(chunks)))
            listed = sum(c[1] for c in chunks)
            if listed != size:
                warnings.append(f"the region at {start:#x} is {size} bytes but its chunk lines "
                                f"add up to {listed}: chunk lines are missing")
    if r.loose:
        inferred = True
        run: list[tuple] = []
        for c in sorted(r.loose):
            if run and run[-1][0] + run[-1][1] != c[0]:
                chunks_by_region.append((run[0][0], run))
                run = []
            run.append(c)
        if run:
            chunks_by_region.append((run[0][0], run))
        regions.extend(RegionInfo(rc[0][0], sum(c[1] for c in rc)) for _, rc in
                       chunks_by_region[len(regions):])
    chunks: list[MemChunk] = []
    for region_ptr, rc in chunks_by_region:
        prev_next: int | None = None
        for c in rc:
            addr, size, in_use, nxt, op, _tag = c
            handle = prev_next if prev_next is not None and prev_next != _INVALID_HANDLE else -1
            chunks.append(MemChunk(address=addr, size=size, requested_size=0,
                                   bin=-1 if in_use else bin_for_size(size), in_use=in_use,
                                   allocation_id=0 if in_use else -1, region=region_ptr,
                                   handle=handle, holder=op if in_use else ""))
            prev_next = nxt
    order = sorted(range(len(regions)), key=lambda i: regions[i].ptr)
    regions = [regions[i] for i in order]
    chunks.sort(key=lambda c: c.address)
    # bytes in use: the chunk lines, else the in-use summary, else the stats
    listed_in_use = sum(c.size for c in chunks if c.in_use)
    n_in_use = sum(1 for c in chunks if c.in_use)
    summary_bytes = sum(n * s for n, s in r.summary)
    summary_count = sum(n for n, _ in r.summary)
    complete = bool(chunks)
    if r.summary and (summary_count != n_in_use or summary_bytes != listed_in_use):
        complete = False
        warnings.append(f"the dump lists {n_in_use} chunk(s) in use ({listed_in_use} bytes) but "
                        f"its in-use summary counts {summary_count} ({summary_bytes} bytes): "
                        "chunk lines are missing (cut off or elided); bytes in use are taken "
                        "from the summary")
    if any("missing" in w for w in warnings):
        complete = False
    if r.elided:
        complete = False
        warnings.append("the log says lines were left out of the dump")
    if complete and r.summary:
        in_use, in_use_src = listed_in_use, "chunk lines"
    elif r.summary:
        in_use, in_use_src = summary_bytes, "in-use summary"
    elif chunks:
        in_use, in_use_src = listed_in_use, "chunk lines"
    elif "InUse" in r.stats:
        in_use, in_use_src = r.stats["InUse"][0], "stats"
    else:
        in_use, in_use_src = 0, "none"
    if not chunks:
        complete = False
        warnings.append("the dump has no chunk lines" if r.content else
                        "no allocator dump follows the out-of-memory line")
    pool_listed = sum(g.size for g in regions)
    if regions and complete and not inferred:
        pool, pool_src = pool_listed, "region lines"
    elif "pool" in r.pool and r.pool["pool"][1]:
        pool, pool_src = r.pool["pool"][0], "pool line"
    elif regions:
        pool, pool_src = pool_listed, "chunk lines"
    elif "pool" in r.pool:
        pool, pool_src = r.pool["pool"][0], "pool line (rounded)"
    else:
        pool, pool_src = in_use, "bytes in use (no pool figure)"
    # the limit: exact when printed in bytes, or pool + an exact small "available"
    limit, limit_exact = 0, False
    if "limit" in r.pool and r.pool["limit"][1]:
        limit, limit_exact = r.pool["limit"][0], True
    elif "Limit" in r.stats and r.stats["Limit"][1]:
        limit, limit_exact = r.stats["Limit"][0], True
    elif "available" in r.pool and r.pool["available"][1] and pool_src != "bytes in use":
        limit, limit_exact = pool + r.pool["available"][0], True
    elif "limit" in r.pool:
        limit = r.pool["limit"][0]
    elif "Limit" in r.stats:
        limit = r.stats["Limit"][0]
    if limit and not limit_exact:
        warnings.append(f"the memory limit is printed rounded ({limit} bytes, approximately)")
    # checks of every rounded figure against the exact ones
    free_chunks = [c for c in chunks if not c.in_use]

    def check(what: str, reported: tuple[int, bool] | None, computed: int) -> None:
        if reported is None:
            return
        value, exact = reported
        ok = value == computed if exact else _close(value, computed)
        checks.append({"what": what, "reported": value, "exact": exact, "computed": computed,
                       "agrees": ok})
        if not ok and complete:
            warnings.append(f"{what}: the dump says {value}{'' if exact else ' (rounded)'}, "
                            f"its chunk lines give {computed}")

    by_bin = _by_bin(chunks)
    if complete:
        check("InUse", r.stats.get("InUse"), in_use)
        check("Sum Total of in-use chunks", r.sum_total, in_use)
        check("pool", r.pool.get("pool"), pool)
        if "free" in r.pool:
            check("free in pool", r.pool["free"], pool - in_use)
        for b, (n_bin, n_use, in_bin, used, _req) in sorted(r.bins.items()):
            idx = bin_for_size(b)
            got = by_bin[idx]
            check(f"Bin ({b}) chunks", (n_bin, True), len(got))
            check(f"Bin ({b}) chunks in use", (n_use, True), sum(c.in_use for c in got))
            check(f"Bin ({b}) bytes", in_bin, sum(c.size for c in got))
            check(f"Bin ({b}) bytes in use", used, sum(c.size for c in got if c.in_use))
    elif r.sum_total is not None and r.summary:
        check("Sum Total of in-use chunks", r.sum_total, summary_bytes)
    largest_free = max((c.size for c in free_chunks), default=0)
    if not complete and "largest_free" in r.pool:
        largest_free = max(largest_free, r.pool["largest_free"][0])
    free = pool - in_use
    frag = 1.0 - largest_free / free if free > 0 and largest_free <= free else 0.0

    def stat(key: str, default: int) -> int:
        return r.stats[key][0] if key in r.stats else default

    stats = AllocatorStats(
        num_allocs=stat("NumAllocs", 0), bytes_in_use=in_use,
        peak_bytes_in_use=max(stat("MaxInUse", in_use), in_use),
        largest_alloc_size=stat("MaxAllocSize", max((c.size for c in chunks if c.in_use),
                                                   default=0)),
        bytes_limit=limit, pool_bytes=pool, peak_pool_bytes=pool,
        largest_free_block_bytes=largest_free, fragmentation=frag)
    bins = []
    for b in range(21):
        in_bin = by_bin[b]
        reported = r.bins.get(256 << b)
        bins.append(BinSummary(
            bin=b, bin_size=256 << b,
            total_bytes_in_use=sum(c.size for c in in_bin if c.in_use),
            total_bytes_in_bin=sum(c.size for c in in_bin),
            total_chunks_in_use=sum(1 for c in in_bin if c.in_use),
            total_chunks_in_bin=len(in_bin),
            total_requested_bytes_in_use=reported[4][0] if reported else 0,
            free_chunks=sum(1 for c in in_bin if not c.in_use),
            free_bytes=sum(c.size for c in in_bin if not c.in_use)))
    reported = {k: v[0] for k, v in r.stats.items()}
    reported.update({f"pool line {k}": v[0] for k, v in r.pool.items()})
    if r.sum_total is not None:
        reported["Sum Total of in-use chunks"] = r.sum_total[0]
    extra = {
        "source": "tensorflow-log", "file": name, "line": r.line, "request": r.request,
        "complete": complete, "warnings": warnings, "checks": checks, "reported": reported,
        "regions_inferred": inferred, "requested_known": False, "occupancy": r.occupancy,
        "in_use_from": in_use_src, "pool_from": pool_src, "limit_exact": limit_exact,
        "in_use_chunks": summary_count if not complete and r.summary else n_in_use,
    }
    if "curr_region" in r.pool:
        extra["curr_region_allocation_bytes"] = r.pool["curr_region"][0]
    return MemoryDump(allocator_name=r.name, stats=stats, bins=bins, chunks=chunks,
                      regions=regions, memory_limit=limit, seq=0, extra=extra)


def _by_bin(chunks: list[MemChunk]) -> list[list[MemChunk]]:
    """The chunks of each of the 21 bins (by size), in one pass."""
    out: list[list[MemChunk]] = [[] for _ in range(21)]
    for c in chunks:
        out[bin_for_size(c.size)].append(c)
    return out


def _close(rounded: int, exact: int) -> bool:
    """Does a figure printed by HumanReadableNumBytes (2 decimals of its unit, 1 for KiB)
    match an exact byte count?"""
    if exact < 1024:
        return rounded == exact
    unit = 1 << 10
    while exact >= unit << 10 and unit < 1 << 60:
        unit <<= 10
    step = unit / (10 if unit == 1 << 10 else 100)
    return abs(rounded - exact) <= step / 2 + 1


# ---------------------------------------------------------------------------- protobuf
def is_memory_dump_pb(head: bytes) -> bool:
    """Whether bytes look like the start of a serialised ``MemoryDump`` (field 1, the
    allocator's name: a short printable string)."""
    if len(head) < 3 or head[0] != 0x0A or head[1] == 0 or head[1] > 100:
        return False
    name = head[2:2 + head[1]]
    return len(name) == head[1] and all(32 < c < 127 for c in name) and (
        len(head) == 2 + head[1] or head[2 + head[1]] in (0x12, 0x1A, 0x22, 0x2A))


def read_memory_dump_pb(path: str | os.PathLike) -> MemoryDump:
    """Read the ``MemoryDump`` protobuf that ``TF_BFC_MEMORY_DUMP`` makes TensorFlow write.

    The protobuf has every chunk (address, size, requested size, bin, in use, op name under
    MEM_DEBUG builds), the bin summaries and the stats, but neither the regions (they are
    the runs of adjacent chunks: ``extra["regions_inferred"]``), the memory limit
    (``memory_limit`` 0: unknown) nor the request that failed (``extra["request"]`` None).

    Raises
    ------
    TraceFormatError
        Not a MemoryDump protobuf (damaged, truncated, another file).
    """
    from google.protobuf.message import DecodeError

    from ..proto import bfc_memory_map_pb2  # late: its descriptors cost ~40 ms; profiles only

    p = Path(path)
    with open_regular(p) as f:
        data = f.read()
    try:
        md = bfc_memory_map_pb2.MemoryDump.FromString(data)
    except DecodeError as exc:
        raise TraceFormatError(f"{p}: not a MemoryDump protobuf ({exc}); the file may be "
                               "truncated or of another kind") from None
    if not md.allocator_name or not md.chunk:
        raise TraceFormatError(f"{p}: not a MemoryDump protobuf with chunks (allocator name "
                               f"{md.allocator_name!r}, {len(md.chunk)} chunks)")
    raw = sorted(((c.address, c.size, c.requested_size, c.in_use, c.op_name, c.bin)
                  for c in md.chunk), key=lambda c: c[0])
    for c in raw:
        if c[1] <= 0 or c[0] >= 1 << 63:
            raise TraceFormatError(f"{p}: a chunk at {c[0]:#x} of size {c[1]}: not a valid "
                                   "chunk")
    regions: list[RegionInfo] = []
    run_start = None
    end = None
    for addr, size, *_ in raw:
        if end is None or addr != end:
            if run_start is not None:
                regions.append(RegionInfo(run_start, end - run_start))
            run_start = addr
        end = addr + size
    regions.append(RegionInfo(run_start, end - run_start))
    starts = [g.ptr for g in regions]
    chunks = []
    ri = 0
    for addr, size, req, in_use, op, b in raw:
        while ri + 1 < len(starts) and addr >= starts[ri + 1]:
            ri += 1
        op = "" if op == "UNKNOWN" else op
        chunks.append(MemChunk(address=addr, size=size, requested_size=req if in_use else 0,
                               bin=-1 if in_use else bin_for_size(size), in_use=in_use,
                               allocation_id=0 if in_use else -1, region=starts[ri],
                               handle=-1, holder=op if in_use else ""))
    in_use = sum(c.size for c in chunks if c.in_use)
    pool = sum(g.size for g in regions)
    largest = max((c.size for c in chunks if not c.in_use), default=0)
    free = pool - in_use
    st = md.stats
    stats = AllocatorStats(num_allocs=st.num_allocs, bytes_in_use=in_use,
                           peak_bytes_in_use=max(st.peak_bytes_in_use, in_use),
                           largest_alloc_size=st.largest_alloc_size, bytes_limit=0,
                           pool_bytes=pool, peak_pool_bytes=pool,
                           largest_free_block_bytes=largest,
                           fragmentation=1.0 - largest / free if free > 0 else 0.0)
    bins = []
    by_bin = _by_bin(chunks)
    for b in range(21):
        in_bin = by_bin[b]
        bins.append(BinSummary(
            bin=b, bin_size=256 << b,
            total_bytes_in_use=sum(c.size for c in in_bin if c.in_use),
            total_bytes_in_bin=sum(c.size for c in in_bin),
            total_chunks_in_use=sum(1 for c in in_bin if c.in_use),
            total_chunks_in_bin=len(in_bin),
            total_requested_bytes_in_use=sum(c.requested_size for c in in_bin if c.in_use),
            free_chunks=sum(1 for c in in_bin if not c.in_use),
            free_bytes=sum(c.size for c in in_bin if not c.in_use)))
    checks = [{"what": "bytes_in_use", "reported": st.bytes_in_use, "exact": True,
               "computed": in_use, "agrees": st.bytes_in_use == in_use}]
    for bs in md.bin_summary:
        mine = bins[bs.bin] if 0 <= bs.bin < 21 else None
        if mine is not None:
            checks.append({"what": f"bin {bs.bin} bytes", "reported": bs.total_bytes_in_bin,
                           "exact": True, "computed": mine.total_bytes_in_bin,
                           "agrees": bs.total_bytes_in_bin == mine.total_bytes_in_bin})
    warnings = [f"{c['what']}: the protobuf says {c['reported']}, its chunks give "
                f"{c['computed']}" for c in checks if not c["agrees"]]
    warnings.append("a MemoryDump protobuf records neither the memory limit nor the request "
                    "that failed")
    extra = {"source": "memory-dump-protobuf", "file": str(p), "line": 0, "request": None,
             "complete": True, "warnings": warnings, "checks": checks,
             "reported": {"bytes_in_use": st.bytes_in_use,
                          "peak_bytes_in_use": st.peak_bytes_in_use,
                          "fragmentation_metric": st.fragmentation_metric},
             "regions_inferred": True, "requested_known": True, "occupancy": "",
             "in_use_from": "chunks", "pool_from": "chunks", "limit_exact": False,
             "in_use_chunks": sum(1 for c in chunks if c.in_use)}
    return MemoryDump(allocator_name=md.allocator_name, stats=stats, bins=bins, chunks=chunks,
                      regions=regions, memory_limit=0, seq=0, extra=extra)


def read_dumps(path: str | os.PathLike) -> list[MemoryDump]:
    """The allocator dumps of a file: a text log (every dump in it) or a ``MemoryDump``
    protobuf (one).

    Raises
    ------
    TraceFormatError
        The file has no dump and no out-of-memory line, or cannot be read as either kind.
    """
    p = Path(path)
    try:
        with open_regular(p) as f:
            head = f.read(4096)
    except OSError as exc:
        raise TraceFormatError(f"{p}: cannot read it ({exc.strerror or exc})") from None
    if is_memory_dump_pb(head):
        return [read_memory_dump_pb(p)]
    if b"\x00" in head:
        raise TraceFormatError(f"{p}: a binary file that is not a MemoryDump protobuf; "
                               "expected a log with an allocator dump or a TF_BFC_MEMORY_DUMP "
                               "file")
    dumps = read_log_dumps(p)
    if not dumps:
        raise TraceFormatError(
            f"{p}: no allocator dump found: expected an out-of-memory message ('Allocator "
            "(NAME) ran out of memory trying to allocate ...') or a dump ('BFCAllocator dump "
            "for NAME', 'Bin (256): ...', 'InUse at ...')")
    return dumps

