"""PyTorch's CUDA out-of-memory message, read in every wording since 1.0 and explained.

PyTorch prints its allocator's figures when a request fails. The wording changed over the
years; all of these are read:

- 1.0 to 1.3: ``CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 11.17 GiB total
  capacity; 10.57 GiB already allocated; 22.81 MiB free; 275.01 MiB cached)``, where
  "cached" is reserved minus allocated;
- 1.4 to 2.0: ``... 22.81 MiB free; [1.00 GiB allowed; ]10.85 GiB reserved in total by
  PyTorch)``, from 1.10 with the hint "If reserved memory is >> allocated memory try setting
  max_split_size_mb to avoid fragmentation";
- 2.1 on: ``CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of
  23.65 GiB of which 1.12 GiB is free. Process 1234 has 3.00 GiB memory in use. Including
  non-PyTorch memory, this process has 19.52 GiB memory in use. [8.00 GiB allowed; ]Of the
  allocated memory 15.21 GiB is allocated by PyTorch, [with 1.00 GiB allocated in private
  pools (e.g., CUDA Graphs), ]and 4.26 GiB is reserved by PyTorch but unallocated.`` (2.1
  spells "capacty"; 2.9 names ``PYTORCH_ALLOC_CONF`` in the hint).

The text may come with a traceback around it, ``[rank0]:`` or glog prefixes, markdown
quotes, hard-wrapped lines, or "Pytorch" in lower case. "Tried to allocate" is the segment
PyTorch asked the driver for (``format_size(alloc_size)``), and every figure is printed with
two decimals: each is known to half a unit of its last digit, and the explanation says so.

:func:`read_torch_ooms` finds every message in a text; :meth:`TorchOOM.explain` says what
failed and which setting would have served it, in PyTorch's own terms.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ._units import format_bytes

__all__ = ["TorchOOM", "read_torch_ooms", "looks_like_torch_oom"]

_UNITS = {"bytes": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "tib": 1 << 40, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|KiB|MiB|GiB|TiB|KB|MB|GB|B)\b"

# line prefixes to drop before the text is joined: [rank0]:, glog, markdown quotes, "E   "
_PREFIX = re.compile(
    r"^\s*(?:(?:\[(?:rank|default)\d*\]:?\s*)|(?:[IWEF]\d{4}\s+\d\d:\d\d:\d\d\.\d+\s+\d+\s+"
    r"\S+:\d+\]\s*)|(?:>\s?)+|(?:E\s{2,}))*", re.IGNORECASE)
_HEAD = re.compile(r"(?:CUDA|HIP|XPU)?\s*out of memory\.\s*Tried to allocate\s+" + _SIZE,
                   re.IGNORECASE)
_NEW_CAP = re.compile(r"GPU\s+(\d+)\s+has\s+a\s+total\s+capac(?:i)?ty\s+of\s+" + _SIZE +
                      r"\s+of\s+which\s+" + _SIZE + r"\s+is\s+free", re.IGNORECASE)
_PROCESS = re.compile(r"Process\s+(\d+)\s+has\s+" + _SIZE + r"\s+memory\s+in\s+use",
                      re.IGNORECASE)
_THIS = re.compile(r"Including\s+non-PyTorch\s+memory,\s+this\s+process\s+has\s+" + _SIZE +
                   r"\s+memory\s+in\s+use", re.IGNORECASE)
_ALLOWED = re.compile(_SIZE + r"\s+allowed;", re.IGNORECASE)
_OF_ALLOCATED = re.compile(
    r"Of\s+the\s+allocated\s+memory\s+" + _SIZE + r"\s+is\s+allocated\s+by\s+PyTorch,\s*"
    r"(?:with\s+" + _SIZE + r"\s+allocated\s+in\s+private\s+pools[^,]*,\s*(?:\([^)]*\),?\s*)?)?"
    r"and\s+" + _SIZE + r"\s+is\s+reserved\s+by\s+PyTorch\s+but\s+unallocated",
    re.IGNORECASE)
_OLD = re.compile(
    r"\(\s*GPU\s+(\d+);\s*" + _SIZE + r"\s+total\s+capacity;\s*" + _SIZE +
    r"\s+already\s+allocated;\s*" + _SIZE + r"\s+free;\s*(?:" + _SIZE + r"\s+allowed;\s*)?" +
    _SIZE + r"\s+(reserved\s+in\s+total\s+by\s+PyTorch|cached)\s*\)", re.IGNORECASE)
_WINDOW = 4000  # characters after "Tried to allocate" that belong to one message


@dataclass
class _Fig:
    """A printed figure: bytes, and half a unit of its last printed digit."""

    value: int
    tol: int

    def __str__(self) -> str:
        return format_bytes(self.value)


def _fig(num: str, unit: str) -> _Fig:
    mult = _UNITS[unit.lower()]
    decimals = len(num.split(".")[1]) if "." in num else 0
    value = int(round(float(num) * mult))
    tol = 0 if mult == 1 else int(math.ceil(0.5 * mult / 10 ** decimals))
    return _Fig(value, tol)


def _clean(text: str) -> str:
    lines = [_PREFIX.sub("", line).strip() for line in text.splitlines()]
    # hard-wrapped lines: joined with a space, except after a hyphen a wrap broke at
    # ("non-" / "PyTorch"); then runs of spaces squeezed
    parts = []
    for line in lines:
        if parts and parts[-1].endswith("-"):
            parts[-1] += line
        else:
            parts.append(line)
    return re.sub(r"\s+", " ", " ".join(parts))


def looks_like_torch_oom(text: str) -> bool:
    """Whether a text holds a PyTorch out-of-memory message (cheap check)."""
    return bool(_HEAD.search(_clean(text[:2_000_000])))


@dataclass
class TorchOOM:
    """One PyTorch out-of-memory message, read.

    Attributes
    ----------
    request : _Fig
        "Tried to allocate": the segment PyTorch asked the driver for (not the tensor's
        size: a request up to 1 MiB asks for 2 MiB, up to 10 MiB for 20 MiB).
    device : int or None
        The GPU index.
    capacity, free : _Fig or None
        The device's total memory, and what the driver had free after PyTorch released
        its cache.
    allocated : _Fig or None
        Memory in tensors (blocks allocated by PyTorch).
    reserved : _Fig or None
        Memory PyTorch's allocator holds in segments (allocated + reserved-but-unallocated).
    unallocated : _Fig or None
        Reserved but unallocated: free blocks inside segments that still hold tensors.
    allowed : _Fig or None
        ``set_per_process_memory_fraction``'s limit, when one was set.
    this_process : _Fig or None
        All this process has on the GPU (PyTorch's memory, the CUDA context, libraries).
    processes : list of (int, _Fig)
        Other processes on the GPU and what they hold.
    private_pools : _Fig or None
        Allocated in private pools (CUDA graphs) (2.5 on).
    wording : str
        ``"1.0-1.3"``, ``"1.4-2.0"``, ``"2.1"``, ``"2.2-2.8"``, ``"2.9+"``: which PyTorch
        printed it.
    text : str
        The message as read.
    warnings : list of str
        Figures that contradict each other.
    """

    request: _Fig
    device: int | None = None
    capacity: _Fig | None = None
    free: _Fig | None = None
    allocated: _Fig | None = None
    reserved: _Fig | None = None
    unallocated: _Fig | None = None
    allowed: _Fig | None = None
    this_process: _Fig | None = None
    processes: list[tuple[int, _Fig]] = field(default_factory=list)
    private_pools: _Fig | None = None
    wording: str = ""
    text: str = ""
    warnings: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ reading
    @property
    def others(self) -> int:
        """Bytes other processes hold on the GPU."""
        return sum(f.value for _, f in self.processes)

    @property
    def conf_variable(self) -> str:
        return "PYTORCH_ALLOC_CONF" if self.wording == "2.9+" else "PYTORCH_CUDA_ALLOC_CONF"

    def _check(self) -> None:
        w = self.warnings
        cap = self.capacity
        if cap is not None:
            for name in ("free", "allocated", "reserved", "this_process", "allowed"):
                f = getattr(self, name)
                if f is not None and f.value - f.tol > cap.value + cap.tol:
                    w.append(f"the message says {name.replace('_', ' ')} {f} but the GPU has "
                             f"{cap} in all: the figures contradict each other")
            if self.free is not None:
                held = self.others + (self.this_process.value if self.this_process else 0)
                tol = cap.tol + self.free.tol + sum(f.tol for _, f in self.processes) + (
                    self.this_process.tol if self.this_process else 0)
                if held + self.free.value > cap.value + tol:
                    w.append(f"free ({self.free}) plus what the processes hold "
                             f"({format_bytes(held)}) exceeds the capacity ({cap})")
        if self.this_process is not None and self.reserved is not None and \
                self.reserved.value - self.reserved.tol > \
                self.this_process.value + self.this_process.tol:
            w.append(f"PyTorch reserved {self.reserved} but the process has only "
                     f"{self.this_process} in use")
        if self.allocated is not None and self.reserved is not None and \
                self.allocated.value - self.allocated.tol > \
                self.reserved.value + self.reserved.tol:
            w.append(f"allocated ({self.allocated}) exceeds reserved ({self.reserved})")

    # ------------------------------------------------------------------ explaining
    def diagnosis(self) -> tuple[str, str, list[str]]:
        """``(cause, why, settings)``: the cause (``"fragmentation"``, ``"limit"``,
        ``"another process"``, ``"device full"`` or ``"unknown"``), a sentence with the
        figures, and the lines to paste that would have served the request (empty when no
        setting would)."""
        r = self.request
        u = self.unallocated
        if u is None:
            return ("unknown", "the message does not say how much PyTorch held", [])
        if self.allowed is not None and self.reserved is not None and self.capacity:
            need = self.reserved.value + r.value
            if need > self.allowed.value + self.allowed.tol and not (
                    u.value - u.tol >= r.value + r.tol):
                frac = min(1.0, math.ceil(need / self.capacity.value * 1000) / 1000)
                why = (f"{self.reserved} reserved + {r} asked for exceeds the {self.allowed} "
                       f"set_per_process_memory_fraction allows")
                if frac >= 1.0 and need > self.capacity.value:
                    return ("limit", why + "; even the whole GPU would not serve it", [])
                return ("limit", why, [f"torch.cuda.set_per_process_memory_fraction({frac:g})"
                                       f"  # at least {format_bytes(need)} of "
                                       f"{self.capacity}"])
        tol = u.tol + r.tol
        if u.value >= r.value - tol and u.value > 0:
            borderline = u.value < r.value + tol
            why = (f"{u} is reserved by PyTorch but unallocated (free blocks inside segments "
                   f"that still hold tensors), {'about as much as' if borderline else 'more than'}"
                   f" the {r} asked for, but no free block is that large")
            if self.wording in ("1.0-1.3", "1.4-2.0"):
                mib = max(1, r.value >> 20)
                lines = [f"{self.conf_variable}=max_split_size_mb:"
                         f"{min(1024, max(32, 1 << (mib.bit_length() - 1)))}"]
                why += ("; max_split_size_mb keeps large cached blocks whole so they can "
                        "serve large requests (expandable segments need PyTorch 2.1)")
            else:
                lines = [f"{self.conf_variable}=expandable_segments:True"]
                why += ("; expandable segments grow one segment instead of leaving unusable "
                        "tails (they do not help when live tensors pin the holes)")
            if borderline:
                why += f" (the printed figures are known to within {format_bytes(tol)})"
            return ("fragmentation", why, lines)
        if self.free is not None and self.others and \
                self.free.value + self.others + u.value >= r.value:
            pids = ", ".join(f"process {pid} ({f})" for pid, f in self.processes)
            return ("another process",
                    f"only {self.free} was free; {pids} "
                    f"hold{'s' if len(self.processes) == 1 else ''}"
                    f" the rest the request needed", [])
        if self.free is not None:
            short = r.value - self.free.value - u.value
            return ("device full",
                    f"the GPU had {self.free} free and PyTorch {u} unallocated: "
                    f"{format_bytes(max(0, short))} short of the {r} asked for; no allocator "
                    "setting makes room (smaller batches, activation checkpointing, or a "
                    "larger GPU do)", [])
        return ("unknown", "the message does not say how much was free", [])

    def lines(self) -> list[tuple[str, str]]:
        """The summary as (label, text) rows."""
        out = [("request", f"{self.request} (a segment PyTorch asked the driver for)")]
        if self.capacity is not None:
            out.append(("GPU", f"{self.device}: {self.capacity} in all, {self.free} free"))
        if self.allocated is not None:
            out.append(("allocated", f"{self.allocated} in tensors"))
        if self.reserved is not None:
            out.append(("reserved", f"{self.reserved} held by PyTorch's allocator"))
        if self.unallocated is not None:
            out.append(("reserved, unused", f"{self.unallocated} (free blocks in segments "
                        "that still hold tensors)"))
        if self.allowed is not None:
            out.append(("allowed", f"{self.allowed} (set_per_process_memory_fraction)"))
        if self.this_process is not None:
            out.append(("this process", f"{self.this_process} on the GPU in all (CUDA "
                        "context and other libraries included)"))
        for pid, f in self.processes:
            out.append(("other process", f"{pid}: {f}"))
        cause, why, settings = self.diagnosis()
        out.append(("cause", f"{cause}: {why}"))
        for s in settings:
            out.append(("would serve it", s))
        if self.wording:
            out.append(("PyTorch", f"{self.wording} (from the message's wording)"))
        for w in self.warnings:
            out.append(("warning", w))
        return out

    def explain(self) -> str:
        rows = self.lines()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def read_torch_ooms(text: str) -> list[TorchOOM]:
    """Every PyTorch out-of-memory message in ``text``, in order (see the module
    docstring); [] when there is none."""
    flat = _clean(text)
    heads = list(_HEAD.finditer(flat))
    out = []
    for k, m in enumerate(heads):
        end = heads[k + 1].start() if k + 1 < len(heads) else len(flat)
        body = flat[m.start():min(end, m.start() + _WINDOW)]
        oom = TorchOOM(request=_fig(m.group(1), m.group(2)), text=body)
        old = _OLD.search(body)
        new = _NEW_CAP.search(body)
        if old is not None and (new is None or old.start() < new.start()):
            g = old.groups()
            oom.device = int(g[0])
            oom.capacity = _fig(g[1], g[2])
            oom.allocated = _fig(g[3], g[4])
            oom.free = _fig(g[5], g[6])
            if g[7] is not None:
                oom.allowed = _fig(g[7], g[8])
            last = _fig(g[9], g[10])
            if g[11].lower() == "cached":
                oom.unallocated = last
                oom.reserved = _Fig(oom.allocated.value + last.value,
                                    oom.allocated.tol + last.tol)
                oom.wording = "1.0-1.3"
            else:
                oom.reserved = last
                oom.unallocated = _Fig(max(0, last.value - oom.allocated.value),
                                       last.tol + oom.allocated.tol)
                oom.wording = "1.4-2.0"
        elif new is not None:
            oom.device = int(new.group(1))
            oom.capacity = _fig(new.group(2), new.group(3))
            oom.free = _fig(new.group(4), new.group(5))
            oom.processes = [(int(p.group(1)), _fig(p.group(2), p.group(3)))
                             for p in _PROCESS.finditer(body)]
            this = _THIS.search(body)
            if this is not None:
                oom.this_process = _fig(this.group(1), this.group(2))
            allowed = _ALLOWED.search(body)
            if allowed is not None:
                oom.allowed = _fig(allowed.group(1), allowed.group(2))
            of = _OF_ALLOCATED.search(body)
            if of is not None:
                g = of.groups()
                oom.allocated = _fig(g[0], g[1])
                if g[2] is not None:
                    oom.private_pools = _fig(g[2], g[3])
                oom.unallocated = _fig(g[4], g[5])
                oom.reserved = _Fig(oom.allocated.value + oom.unallocated.value,
                                    oom.allocated.tol + oom.unallocated.tol)
            low = body.lower()
            if "capacty" in low:
                oom.wording = "2.1"
            elif "pytorch_alloc_conf" in low:
                oom.wording = "2.9+"
            else:
                oom.wording = "2.2-2.8"
        oom._check()
        out.append(oom)
    return out
