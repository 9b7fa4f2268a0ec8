"""PyTorch's out-of-memory errors explained, in PyTorch's own terms.

Two sources, both read by :func:`explain_torch` (and by :func:`gpudash.explain` /
``gpudash explain PATH``, which send PyTorch's files here):

- **the message** PyTorch printed (``torch.OutOfMemoryError: CUDA out of memory. Tried to
  allocate ...``), pasted or in a log, in any wording since 1.0 (:mod:`gpudash.torch_oom`):
  the figures it gives, the cause they show and the setting that would have served the
  request;
- **a memory snapshot** with its ``oom`` entry (``torch.cuda.memory._dump_snapshot`` in the
  job's out-of-memory handler, with ``_record_memory_history`` on): the trace is replayed
  exactly through gpudash's model of PyTorch's caching allocator up to the failure, so the
  explanation has the allocator's whole state at that moment (every segment and block, the
  largest free block of the pool the request needed), the message PyTorch printed (rebuilt
  from that state), and each suggested setting **proven** by replaying the recorded calls
  under it on the same device.

The causes, from the state at the failure (PyTorch has already released its unused cached
segments when it raises):

- **fragmentation**: the free blocks inside segments that still hold tensors ("reserved but
  unallocated") plus what the driver has free would hold the request, but no single free
  block and not the driver can: ``expandable_segments:True`` (PyTorch 2.1 on) lets one
  segment grow instead, ``max_split_size_mb`` keeps large blocks whole (older PyTorch);
- **limit**: ``set_per_process_memory_fraction`` caps what PyTorch may hold;
- **device full**: even all the free memory would not hold it: no allocator setting helps
  (smaller batches, activation checkpointing or a larger GPU do).

A message adds **another process** (what others hold would have served the request) and
**unknown** (the device and the limit had room for the segment: something the message does not
show refused it); see :meth:`gpudash.torch_oom.TorchOOM.cause`. ``torch.cuda.memory_summary()``'s
table is read and summarised (``source="memory_summary"``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from ._errors import ConfigError, TraceFormatError
from ._explanation import _ExplanationViews
from ._units import format_bytes, parse_bytes
from .events import EventKind
from .formats.format import open_regular
from .formats.io import sniff_format
from .formats.torch_snapshot import load_torch_snapshot
from .models import TORCH
from .report import bins_figure, chunk_holders, chunkmap_figure
from .torch_oom import (describe_non_oom, EXPECTED, looks_like_torch_oom, read_memory_summary,
    read_torch_ooms)
from .trace.callers import stack_lines, user_code_rule
from .trace.holders import top_holders
from .trace.replay import replay, torch_capacity
from .trace.torch_replay import from_trace, replay_exact

__all__ = ["explain_torch", "TorchExplanation", "is_torch_file", "snapshot_state"]

_SMALL = 1 << 20          # PyTorch's kSmallSize: requests up to 1 MiB use the small pool
_TEXT_LIMIT = 64 << 20    # a log larger than this is read as its first 64 MiB


@dataclass
class TorchExplanation(_ExplanationViews):
    """One PyTorch out-of-memory error explained (see the module docstring).

    Attributes
    ----------
    path : str
    source : str
        ``"message"`` (PyTorch's printed message), ``"snapshot"`` (a memory snapshot
        replayed to the failure) or ``"memory_summary"`` (``torch.cuda.memory_summary()``'s
        table, summarised: no failure, ``cause`` is ``"none"``).
    device : int or None
        The GPU index.
    request : int
        The bytes PyTorch asked for: the block size (a snapshot's ``oom`` entry) or "Tried to
        allocate" (the message: the segment PyTorch asked the driver for).
    allocated, reserved, unallocated : int or None
        PyTorch's memory in tensors, in its segments, and the difference (free blocks in
        segments that still hold tensors).
    largest_free : int or None
        The largest free block of the pool the request needed (a snapshot only).
    free_blocks : int or None
        Free blocks in that pool (a snapshot only).
    device_total, device_free : int or None
        The GPU's memory, and what the driver had free when PyTorch gave up.
    total_known : bool
        ``device_total`` is the GPU's (given, or in the message); False when it was read
        off a snapshot's ``oom`` entry as free plus PyTorch's segments (what PyTorch could
        use: memory held outside PyTorch's allocator is then not known).
    cause : str
        ``"fragmentation"``, ``"limit"``, ``"another process"``, ``"device full"`` or
        ``"unknown"``.
    why : str
        The cause with the figures behind it.
    settings : list of str
        Lines that would have served the request (PyTorch's settings).
    proofs : list of (str, bool, str)
        A snapshot only: ``(setting, fits, detail)`` for each setting replayed over the
        recorded calls on the same device.
    message : str
        The message PyTorch printed (as read, or rebuilt from the replayed state).
    dump : MemoryDump or None
        A snapshot only: the allocator's state at the failure, for the figures.
    assumed, warnings : list of str
    index, count : int
        Which error of the file (from 0) and how many it has.
    holders : HolderTable or None
        A snapshot with call stacks: the blocks allocated at the failure, grouped by the line
        of the user's code that allocated them (:func:`gpudash.trace.holders.top_holders`).
    request_stack : list of Frame
        A snapshot: the refused request's own stack, innermost first ([] when not recorded).
    segments : dict
        ``source="state"``: segments held, ``{"small": n, "large": n}``.
    pools : dict
        ``source="state"``: per pool, ``(free blocks, largest free block)``.
    missing : list of str
        ``source="state"``: what the snapshot lacks to say more (the request, the cause).

    A snapshot without an ``oom`` entry (taken in an out-of-memory handler without
    ``_record_memory_history``, or a trace that ends before the failure) gives
    ``source="state"``: the allocator's state the snapshot holds, summed up, with
    ``cause="unknown"`` and ``request=0``, and :attr:`missing` saying why no more is said.
    """

    path: str
    source: str
    device: int | None
    request: int
    allocated: int | None = None
    reserved: int | None = None
    unallocated: int | None = None
    largest_free: int | None = None
    free_blocks: int | None = None
    device_total: int | None = None
    device_free: int | None = None
    total_known: bool = True
    cause: str = "unknown"
    why: str = ""
    settings: list[str] = field(default_factory=list)
    proofs: list[tuple[str, bool, str]] = field(default_factory=list)
    message: str = ""
    dump: Any = None
    assumed: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    index: int = 0
    count: int = 1
    holders: Any = None
    request_stack: list = field(default_factory=list)
    segments: dict = field(default_factory=dict)
    pools: dict = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    _oom: Any = field(default=None, repr=False)
    _summary: Any = field(default=None, repr=False)
    #: who holds each block at the failure (address -> lines), for the map's hover
    _holders: dict = field(default_factory=dict, repr=False)

    #: Rows of the holders the summary shows.
    HOLDER_ROWS = 8

    def _holder_lines(self) -> list[tuple[str, str]]:
        """Who held the memory at the failure, and the refused request's stack."""
        rows: list[tuple[str, str]] = []
        table = self.holders
        if table is not None and len(table):
            rows.append(("held at the OOM" if self.source != "state" else "held",
                         f"{format_bytes(table.total_bytes)} in {table.total_allocations:,} "
                         f"block(s), by the line of your code that allocated them (the "
                         f"largest {min(len(table), self.HOLDER_ROWS)} of "
                         f"{len(table) + table.left_out[0]})"))
            for r in list(table)[:self.HOLDER_ROWS]:
                rows.append(("", f"{format_bytes(r.bytes):>10} in {r.allocations:,} "
                                 f"block(s) at {r.holder}"))
            rows.extend(("", f"note: {n}") for n in table.notes)
        if self.request_stack:
            for i, line in enumerate(stack_lines(self.request_stack, user_code_rule(None), 16)):
                rows.append(("request's stack" if i == 0 else "", line))
        return rows

    def _state_lines(self) -> list[tuple[str, str]]:
        """``source="state"``: the allocator's state the snapshot holds, and what it lacks."""
        small, large = self.segments.get("small", 0), self.segments.get("large", 0)
        rows = [("state", "the segments and blocks the snapshot holds: the state at the "
                          "failure where it was taken in the job's out-of-memory handler"),
                ("segments", f"{small + large:,} ({small:,} small pool, {large:,} large "
                             "pool)"),
                ("reserved", f"{format_bytes(self.reserved or 0)} held in segments"),
                ("allocated", f"{format_bytes(self.allocated or 0)} in tensors"),
                ("reserved, unused", f"{self._unused_text()}: free blocks in segments that "
                                     "still hold tensors")]
        for pool in ("small", "large"):
            count, largest = self.pools.get(pool, (0, 0))
            rows.append(("largest free" if pool == "small" else "",
                         f"{pool} pool: {format_bytes(largest)} "
                         f"({count:,} free block(s))"))
        rows.extend(self._holder_lines())
        rows.extend(("not known", m) for m in self.missing)
        return rows

    def lines(self) -> list[tuple[str, str]]:
        """The summary as (label, text) rows."""
        if self.source == "state":
            return self._state_lines() + [("assumed", a) for a in self.assumed]
        if self._summary is not None:     # memory_summary()'s table
            rows = self._summary.lines()
        elif self._oom is not None:       # the message's own reading
            rows = [r for r in self._oom.lines() if r[0] not in ("warning", "assumed")]
        else:
            pool = "small" if self.request <= _SMALL else "large"
            rows = [("request", f"{format_bytes(self.request)} (a block of the {pool} pool)"),
                    ("allocated", f"{format_bytes(self.allocated or 0)} in tensors"),
                    ("reserved", f"{format_bytes(self.reserved or 0)} held in segments"),
                    ("reserved, unused",
                     f"{self._unused_text()}: free blocks in segments that "
                     f"still hold tensors; the {pool} pool has {self.free_blocks or 0:,} "
                     f"free block(s), the largest {format_bytes(self.largest_free or 0)}")]
            if self.device_total and self.total_known:
                other = self.device_total - (self.reserved or 0) - (self.device_free or 0)
                rows.append(("GPU", f"{format_bytes(self.device_total)} in all, "
                                    f"{format_bytes(self.device_free or 0)} free; "
                                    f"{format_bytes(max(other, 0))} held outside PyTorch's "
                                    "allocator (CUDA context, libraries, other processes)"))
            elif self.device_total:
                rows.append(("GPU", f"{format_bytes(self.device_free or 0)} free when it "
                                    f"failed; {format_bytes(self.device_total)} usable by "
                                    "PyTorch (free plus its segments; what else held the GPU "
                                    "is not in the snapshot)"))
            rows.append(("cause", f"{self.cause}: {self.why}"))
            for setting, fits, detail in self.proofs:
                rows.append(("fits with" if fits else "still fails with",
                             f"{setting}: {detail}"))
            if not self.proofs:
                rows.extend(("would serve it", s) for s in self.settings)
            rows.extend(self._holder_lines())
        rows.extend(("assumed", a) for a in self.assumed)
        return rows

    def __str__(self) -> str:
        which = f" (error {self.index + 1} of {self.count})" if self.count > 1 else ""
        dev = f"GPU {self.device}" if self.device is not None else "the GPU"
        how = ("replayed from the snapshot" if self.source == "snapshot"
               else "from PyTorch's message")
        head = f"{self.path}: PyTorch ran out of memory on {dev}{which}, {how}"
        if self.source == "state":
            head = (f"{self.path}: PyTorch's memory on {dev} as the snapshot holds it (no "
                    "out-of-memory entry: the failure itself is not in the snapshot)")
        if self.source == "memory_summary":
            head = (f"{self.path}: torch.cuda.memory_summary() of {dev}, read (a table of "
                    "the allocator's figures, not an out-of-memory message: no request to "
                    "explain)")
        rows = self.lines()
        width = max(len(k) for k, _ in rows)
        body = [f"  {k:<{width}}  {v}" for k, v in rows]
        tail = [f"  warning: {w}" for w in self.warnings]
        if self.source == "snapshot" and self.message:
            tail.append("  PyTorch's message at that moment (rebuilt from the replayed state):")
            tail.append("    " + self.message)
        return "\n".join([head, *body, *tail])

    def _unused_text(self) -> str:
        """Reserved but unallocated and its share of reserved, ``"1.57 GiB, 6.6 % of
        reserved"`` (PyTorch's fragmentation figure,
        :meth:`gpudash.models.AllocatorModel.fragmentation`)."""
        f = TORCH.fragmentation(self.allocated or 0, self.reserved or 0, 0)
        return f"{format_bytes(f.bytes or 0)}, {100.0 * f.ratio:.1f} % of reserved"

    def figures(self) -> list:
        """The segment map and pool occupancy at the failure (a snapshot only); hovering a
        block names who holds it where the snapshot recorded its stack."""
        if self.dump is None:
            return []

        title = (f"Segments of cuda:{self.device} when PyTorch ran out of memory "
                 f"({format_bytes(self.allocated or 0)} allocated; reserved but unallocated "
                 f"{self._unused_text()})")
        return [chunkmap_figure(self.dump, title=title, holders=self._holders),
                bins_figure(self.dump)]


# ------------------------------------------------------------------------------ reading
def is_torch_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is PyTorch's: a memory snapshot (pickle or JSON) or a text with
    PyTorch's out-of-memory message."""
    try:
        fmt = sniff_format(path)
    except (OSError, TraceFormatError):
        return False
    if fmt in ("torch-pickle", "torch-json"):
        return True
    if fmt not in (None, "tf-log"):
        return False

    ends = _read_ends(path, 2 << 20)
    if any(looks_like_torch_oom(t) or read_memory_summary(t) is not None for t in ends):
        return True
    # a CUDA error that is no out-of-memory, in a text with no TensorFlow or JAX dump
    return any(describe_non_oom(t) is not None for t in ends) and not any(
        mark in t for t in ends for mark in _OTHER_FRAMEWORKS)


#: What TensorFlow's and JAX's out-of-memory texts hold (they are explained there).
_OTHER_FRAMEWORKS = ("ran out of memory trying to allocate", "BFCAllocator dump",
                     "Out of memory while trying to allocate", "RESOURCE_EXHAUSTED")


def _read_ends(path: str | os.PathLike, each: int) -> tuple[str, ...]:
    """The first and the last ``each`` bytes of a text (a long log ends in its error)."""
    with open_regular(path) as f:
        head = f.read(each)
        tail = b""
        if len(head) == each:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(each, size - each))
            tail = f.read(each)
    return tuple(b.decode("utf-8", "replace") for b in (head, tail) if b)


def _read_text(path: str | os.PathLike, limit: int = _TEXT_LIMIT) -> str:
    with open_regular(path) as f:
        data = f.read(limit)
    return data.decode("utf-8", "replace")


def explain_torch(path: str | os.PathLike, *, index: int | None = None,
                  device: int | str | None = None, gpu: int | None = None,
                  conf: str | None = None, torch_version: str | None = None,
                  prove: bool = True) -> TorchExplanation:
    """Explain a PyTorch out-of-memory error from its message or its memory snapshot.

    Parameters
    ----------
    path : str or os.PathLike
        A log or text with PyTorch's message, or a snapshot (``.pickle`` / ``.json``).
    index : int, optional
        Which error (from 0; negative from the end). Default: the last.
    device : int or str, optional
        The GPU's total memory (``"24GiB"``), for a snapshot whose ``oom`` entry does not
        give it.
    gpu : int, optional
        A snapshot's GPU index whose errors to explain (default: every GPU's, in order).
    conf : str, optional
        The job's ``PYTORCH_CUDA_ALLOC_CONF`` (default: the snapshot's
        ``allocator_settings``, else PyTorch's defaults).
    torch_version : str, optional
        The PyTorch whose rules to follow (default: as the snapshot's fields suggest).
    prove : bool, default True
        Replay the recorded calls under each suggested setting (a snapshot only).

    Returns
    -------
    TorchExplanation

    Raises
    ------
    TraceFormatError
        No PyTorch out-of-memory error in the file (one line naming the file).
    """
    fmt = sniff_format(path)
    if fmt in ("torch-pickle", "torch-json"):
        return _from_snapshot(path, index=index, device=device, gpu=gpu, conf=conf,
                              torch_version=torch_version, prove=prove)

    text = _read_text(path)
    try:
        ooms = read_torch_ooms(text)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{path}: {exc}") from None
    if not ooms:
        summary = read_memory_summary(text)
        if summary is not None:
            return _from_summary(path, summary)
        what = describe_non_oom(text)
        if what is not None:
            raise TraceFormatError(f"{path}: not an out-of-memory error but {what}; "
                                   f"{EXPECTED}")
        raise TraceFormatError(f"{path}: no out-of-memory message in the file; {EXPECTED}")
    pick = _pick(index, len(ooms), path, "message")
    oom = ooms[pick]
    cause, why, settings = oom.diagnosis()
    return TorchExplanation(
        path=os.fspath(path), source="message", device=oom.device, request=oom.request.value,
        allocated=_v(oom.allocated), reserved=_v(oom.reserved),
        unallocated=_v(oom.unallocated), device_total=_v(oom.capacity),
        device_free=_v(oom.free), cause=cause, why=why, settings=settings, message=oom.text,
        assumed=list(oom.assumed), warnings=list(oom.warnings), index=pick, count=len(ooms),
        _oom=oom)


def _from_summary(path: Any, summary: Any) -> TorchExplanation:
    """``torch.cuda.memory_summary()``'s table, summarised (no failure to explain)."""
    alloc = summary.current("Allocated memory")
    res = summary.current("GPU reserved memory")
    nr = summary.current("Non-releasable memory")
    return TorchExplanation(
        path=os.fspath(path), source="memory_summary", device=summary.device, request=0,
        allocated=alloc, reserved=res, unallocated=nr, cause="none",
        why="a memory_summary() table holds no failed request", _summary=summary)


def _v(fig: Any) -> int | None:
    return None if fig is None else int(fig.value)


def _pick(index: int | None, count: int, path: Any, what: str) -> int:
    if index is None:
        return count - 1
    i = index + count if index < 0 else index
    if not 0 <= i < count:
        raise TraceFormatError(f"{path}: no {what} {index}: it has {count}")
    return i


def _from_snapshot(path: Any, *, index: int | None, device: Any, gpu: int | None,
                   conf: str | None, torch_version: str | None,
                   prove: bool) -> TorchExplanation:
    import numpy as np

    trace = load_torch_snapshot(path)
    col = trace.columns
    is_oom = col["kind"] == int(EventKind.OOM)
    if gpu is not None:
        is_oom &= col["device"] == int(gpu)
    rows = np.flatnonzero(is_oom)
    if not len(rows):
        where = f" of GPU {gpu}" if gpu is not None else ""
        rebuilt = sum((trace.meta.get("torch", {}).get("prefix") or {}).values())
        devices = sorted(set(np.unique(col["device"]).tolist()))
        if len(col["kind"]) > rebuilt or (gpu is not None and int(gpu) not in devices):
            raise TraceFormatError(
                f"{path}: the snapshot has no out-of-memory entry{where} (its trace has no "
                "'oom'): nothing failed to explain; 'gpudash replay' and 'gpudash whatif' "
                "answer what it needs")
        # only the segments were saved (an out-of-memory handler without
        # _record_memory_history): the state they hold, and what it lacks
        dev = int(gpu) if gpu is not None else (devices[-1] if devices else 0)
        return snapshot_state(trace, dev, path=path, conf=conf,
                              torch_version=torch_version)
    order = rows[np.lexsort((rows, col["device"][rows]))]
    pick = _pick(index, len(order), path, "out-of-memory entry")
    row = int(order[pick])
    dev = int(col["device"][row])
    nth = int(np.count_nonzero(is_oom[:row + 1] & (col["device"][:row + 1] == dev)))
    assumed: list[str] = []
    known = device is not None
    if known:
        total = parse_bytes(device, name="device")
    else:
        cap = torch_capacity(trace, dev)
        if cap is None:
            raise ConfigError(f"{path}: the snapshot does not show the GPU's size (an old "
                              "oom entry without device_free); pass device= (--device SIZE)")
        total, how = cap
        assumed.append(f"device {format_bytes(total)}: {how}")
    tt = from_trace(trace, dev)
    if torch_version is None and trace.meta.get("torch", {}).get("version"):
        v = tt.version
        assumed.append(f"PyTorch {v[0]}.{v[1]}'s rules: the oldest PyTorch whose snapshot has "
                       "the fields this one has (pass torch_version= or --torch-version)")
    if conf is None and not tt.settings:
        assumed.append("PYTORCH_CUDA_ALLOC_CONF: PyTorch's defaults (the snapshot records no "
                       "allocator_settings; pass conf= or --conf)")
    assumed.append("no set_per_process_memory_fraction (a snapshot does not record it)")
    res = replay_exact(tt, conf=conf, device_total=total, version=torch_version,
                       stop_at_oom=nth)
    alloc = res.allocator
    warnings = []
    if not res.exact:
        warnings.append(f"the replay did not follow the snapshot exactly ({res.summary()}); "
                        "the state shown is the model's")
    request = int(res.oom_calls[-1][1]) if res.oom_calls else int(col["size"][row])
    device_free = int(tt.addr[np.flatnonzero(tt.action == 8)[nth - 1]])
    st = alloc.memory_stats()
    allocated = int(st["allocated_bytes.all.current"])
    reserved = int(st["reserved_bytes.all.current"])
    unallocated = reserved - allocated
    small = request <= _SMALL
    pool = alloc._small if small else alloc._large
    sizes = [(k >> 64) & ((1 << 64) - 1) for k in pool.keys]
    largest = max(sizes, default=0)
    cause, why, settings = _diagnose(request, unallocated, largest, device_free,
                                     total if known else None, reserved, alloc.config)

    dump = alloc.memory_dump()
    proofs = []
    if prove and settings:
        proofs = _prove(trace, dev, total, alloc.config, settings, nth)
    holders = _holders_at(trace, row, dev)
    return TorchExplanation(
        path=os.fspath(path), source="snapshot", device=dev, request=request,
        allocated=allocated, reserved=reserved, unallocated=unallocated, largest_free=largest,
        free_blocks=len(sizes), device_total=total, device_free=device_free,
        total_known=known, cause=cause,
        why=why, settings=settings, proofs=proofs,
        message=alloc.oom_message(request, device_free), dump=dump,
        assumed=assumed, warnings=warnings, index=pick, count=len(order), holders=holders,
        request_stack=list(trace.frames_of(row)),
        _holders=chunk_holders(trace, dump, device=dev, before_row=row))


def snapshot_state(trace: Any, device: int = 0, *, path: Any = "<snapshot>",
                   conf: str | None = None, torch_version: str | None = None
                   ) -> TorchExplanation:
    """The allocator's state a PyTorch snapshot holds on ``device`` at its end, summed up:
    segments by pool, reserved, allocated, reserved but unallocated, the largest free
    block of each pool, the holders by line where the snapshot kept stacks, and what it
    lacks to say more (``source="state"``, see :class:`TorchExplanation`).

    For a snapshot without an ``oom`` entry: one taken in an out-of-memory handler
    without ``_record_memory_history`` holds the state at the failure, but not the
    request that failed.
    """
    import numpy as np

    col = trace.columns
    mine = col["device"] == int(device)
    tt = from_trace(trace, int(device))
    res = replay_exact(tt, conf=conf, version=torch_version)
    alloc = res.allocator
    st = alloc.memory_stats()
    allocated = int(st["allocated_bytes.all.current"])
    reserved = int(st["reserved_bytes.all.current"])
    pools = {}
    for name, pool in (("small", alloc._small), ("large", alloc._large)):
        sizes = [(k >> 64) & ((1 << 64) - 1) for k in pool.keys]
        pools[name] = (len(sizes), max(sizes, default=0))
    rebuilt = int((trace.meta.get("torch", {}).get("prefix") or {}).get(str(device), 0))
    calls = int(np.count_nonzero(mine)) - rebuilt   # the trace's own entries
    ooms = int(np.count_nonzero(mine & (col["kind"] == int(EventKind.OOM))))
    missing = []
    if not ooms:
        missing.append("the request that failed: the snapshot has no 'oom' entry"
                       + (" (its trace records no allocation: only the segments were saved)"
                          if calls == 0 else "")
                       + ", so neither its size nor its pool is known, and no cause or "
                       "setting can be given; record with "
                       "torch.cuda.memory._record_memory_history() before the failure "
                       "(the trace's 'oom' entry holds the request and the driver's free "
                       "memory), or paste PyTorch's out-of-memory message to gpudash "
                       "explain")
        missing.append("the GPU's size and free memory, and what other processes held "
                       "(only an 'oom' entry or the message gives them)")
    assumed = [n for n in res.notes if "rebuilt" not in n]
    warnings = []
    if not res.exact:
        warnings.append(f"the replay did not follow the snapshot exactly ({res.summary()}); "
                        "the state shown is the model's")
    last = np.flatnonzero(mine)
    holders = _holders_at(trace, int(last[-1]), int(device)) if len(last) else None
    if holders is not None and holders.moment is not None:
        import dataclasses

        holders.moment = dataclasses.replace(holders.moment,
                                             text=f"the snapshot's end on cuda:{device}")
    return TorchExplanation(
        path=os.fspath(path), source="state", device=int(device), request=0,
        allocated=allocated, reserved=reserved, unallocated=reserved - allocated,
        largest_free=max(p[1] for p in pools.values()),
        free_blocks=sum(p[0] for p in pools.values()), total_known=False,
        cause="unknown", why="the snapshot does not hold the failure", dump=alloc.memory_dump(),
        assumed=assumed, warnings=warnings, holders=holders,
        segments={"small": int(st.get("segment.small_pool.current", 0)),
                  "large": int(st.get("segment.large_pool.current", 0))},
        pools=pools, missing=missing)


def _holders_at(trace: Any, row: int, dev: int) -> Any:
    """The blocks live at the failure at ``row`` by line, when the snapshot kept stacks."""
    import dataclasses

    if trace.stack is None or not (trace.stack >= 0).any():
        return None
    table = top_holders(trace, at=row, by="line", device=dev, limit=20)
    if table.moment is not None:
        table.moment = dataclasses.replace(
            table.moment, text=f"the out-of-memory error on cuda:{dev} (event {row:,})",
            oom_row=row)
    return table


def _diagnose(request: int, unallocated: int, largest: int, device_free: int,
              total: int | None, reserved: int, conf: Any) -> tuple[str, str, list[str]]:
    r = format_bytes(request)
    if largest >= request:
        return ("unknown", f"a free block of {format_bytes(largest)} would have served the "
                           f"{r}: the replayed state does not fail here", [])
    if unallocated + device_free >= request:
        why = (f"{format_bytes(unallocated)} is reserved but unallocated (free blocks inside "
               f"segments that still hold tensors; the largest that fits this request's pool "
               f"is {format_bytes(largest)}) and the driver had {format_bytes(device_free)} "
               f"free: {format_bytes(unallocated + device_free)} in all, enough for the {r} "
               "asked for, but not in one piece")
        lines = []
        if conf.version >= (2, 1) and not conf.expandable_segments:
            lines.append("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        if request > _SMALL:
            mss = max(32, min(1 << 14, 1 << max(5, math.ceil(math.log2(max(request, 1) /
                                                                         (1 << 20))))))
            if conf.max_split_size is None or conf.max_split_size > mss << 20:
                lines.append(f"PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:{mss}")
        return ("fragmentation", why, lines)
    short = request - unallocated - device_free
    outside = ""
    if total is not None:
        outside = (f" ({format_bytes(max(total - reserved - device_free, 0))} of the GPU is "
                   "held outside PyTorch's allocator)")
    return ("device full",
            f"the driver had {format_bytes(device_free)} free and PyTorch "
            f"{format_bytes(unallocated)} unallocated: {format_bytes(short)} short of the {r} "
            f"asked for{outside}; no allocator setting makes room (smaller batches, activation "
            "checkpointing, or a larger GPU do)", [])


def _prove(trace: Any, dev: int, total: int, conf: Any, settings: list[str],
           nth: int) -> list[tuple[str, bool, str]]:
    """Replay the recorded calls under each setting on the same device."""
    out = []
    base = conf.as_conf()
    for line in settings:
        extra = line.split("=", 1)[1]
        text = f"{base},{extra}" if base else extra
        try:
            r = replay(trace, device=dev, device_bytes=total, conf=text,
                       torch_version=".".join(map(str, conf.version)), record=False,
                       per_call=False)
        except ConfigError as exc:
            out.append((line, False, f"not applicable: {exc}"))
            continue
        if r.fits:
            detail = (f"every recorded call is served (peak reserved "
                      f"{format_bytes(r.peak_pool_bytes)} of {format_bytes(total)}), the "
                      f"failed one included")
        else:
            detail = (f"{r.oom_count} call(s) still refused, the first at call "
                      f"{r.first_oom[0]:,} ({format_bytes(r.first_oom[1])})")
        out.append((line, r.fits, detail))
    return out
