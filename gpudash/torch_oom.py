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
from fractions import Fraction

from ._errors import TraceFormatError
from ._units import format_bytes

__all__ = ["TorchOOM", "Cause", "read_torch_ooms", "looks_like_torch_oom"]

_UNITS = {"bytes": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "tib": 1 << 40, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
_SIZE = r"(?<![0-9])([0-9]+(?:\.[0-9]+)?)\s*(bytes|KiB|MiB|GiB|TiB|KB|MB|GB|B)\b"

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


_NVML_NA = 1 << 64       # NVML's "not available" (ULLONG_MAX + 1 as printed: 17179869184.00 GiB)
_HUGE = 1 << 63          # no GPU figure reaches this
_CONTEXT = 1 << 30       # allowance for a process's own memory outside PyTorch's allocator
_MiB = 1 << 20
_SMALL_SEGMENT = 2 * _MiB     # what a small-pool request (<= 1 MiB) asks the driver for (1.1 on)
_LARGE_BUFFER = 20 * _MiB     # what a 1-10 MiB request asks for; max_split_size_mb must exceed it


@dataclass
class _Fig:
    """A printed figure: bytes, and half a unit of its last printed digit."""

    value: int
    tol: int

    def __str__(self) -> str:
        return format_bytes(self.value)

    @property
    def lo(self) -> int:
        return max(0, self.value - self.tol)

    @property
    def hi(self) -> int:
        return self.value + self.tol


def _fig(num: str, unit: str) -> _Fig:
    """A printed figure, read exactly (a 400-digit figure is a number, not an overflow)."""
    mult = _UNITS[unit.lower()]
    whole, _, frac = num.partition(".")
    decimals = len(frac)
    if len(whole.lstrip("0")) > 30 or decimals > 30:    # beyond any GPU, or no printed figure
        return _Fig(_HUGE << 20, 0)
    value = round(Fraction(f"{int(whole)}.{int(frac) if frac else 0:0{max(decimals, 1)}d}")
                  * mult)
    tol = 0 if mult == 1 else -(-mult // (2 * 10 ** decimals))
    return _Fig(int(value), int(tol))


def _is_nvml_na(f: _Fig) -> bool:
    """NVML's "not available" (2**64 bytes, printed 17179869184.00 GiB on Windows and WSL)."""
    return abs(f.value - _NVML_NA) <= f.tol


def _clean(text: str) -> str:
    """The text as one line: prefixes dropped, hard-wrapped lines joined (after a hyphen
    without a space: "non-" / "PyTorch"), runs of spaces squeezed. Linear in the text."""
    groups: list[list[str]] = []
    joined = False                      # whether the last line ended with a hyphen
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw).strip()
        if joined and groups:
            groups[-1].append(line)
        else:
            groups.append([line])
        joined = line.endswith("-")
    return re.sub(r"\s+", " ", " ".join("".join(g) for g in groups))


def looks_like_torch_oom(text: str) -> bool:
    """Whether a text holds a PyTorch out-of-memory message (cheap check)."""
    return bool(_HEAD.search(_clean(text[:2_000_000])))


@dataclass
class Cause:
    """Why a PyTorch request failed, from its message's figures (:meth:`TorchOOM.cause`).

    Attributes
    ----------
    name : str
        ``"fragmentation"``, ``"limit"``, ``"another process"``, ``"device full"`` or
        ``"unknown"``.
    why : str
        The reason, with the figures behind it.
    settings : list of str
        Lines to paste that would have served the request (PyTorch's settings); empty when
        none would.
    advice : list of str
        What else to do (find the other process, upgrade PyTorch, ...).
    figures : list of str
        The figures the answer used, each with what it is known to (printed figures have two
        decimals: each is known to half a unit of its last digit).
    """

    name: str
    why: str
    settings: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)


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
    unknown_processes : list of int
        Processes listed with NVML's "not available" figure.
    this_pid : int or None
        A listed "Process N" taken for this process (in a container, PyTorch lists itself
        that way): its figure is ``this_process``, and it is not in ``processes``.
    private_pools : _Fig or None
        Allocated in private pools (CUDA graphs) (2.5 on).
    wording : str
        ``"1.0-1.3"``, ``"1.4-2.0"``, ``"2.1"``, ``"2.2-2.8"``, ``"2.9+"``: which PyTorch
        printed it.
    text : str
        The message as read.
    assumed : list of str
        What the reading assumed (a listed process taken for this one, NVML's figures).
    warnings : list of str
        Figures that contradict each other, and parts of the message that were not read.
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
    unknown_processes: list[int] = field(default_factory=list)
    this_pid: int | None = None
    private_pools: _Fig | None = None
    wording: str = ""
    text: str = ""
    assumed: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ reading
    @property
    def others(self) -> int:
        """Bytes other processes hold on the GPU (those the message lists with a figure)."""
        return sum(f.value for _, f in self.processes)

    @property
    def conf_variable(self) -> str:
        return "PYTORCH_ALLOC_CONF" if self.wording == "2.9+" else "PYTORCH_CUDA_ALLOC_CONF"

    @property
    def small_pool(self) -> bool:
        """Whether the request was a small-pool block (<= 1 MiB): its segment is 2 MiB
        (PyTorch 1.1 on) or 1 MiB (1.0)."""
        r = self.request
        if abs(r.value - _SMALL_SEGMENT) <= r.tol:
            return True
        return self.wording == "1.0-1.3" and r.value <= _MiB + r.tol

    def _check(self) -> None:
        w = self.warnings
        cap = self.capacity
        if cap is not None:
            for name in ("free", "allocated", "reserved", "this_process", "allowed"):
                f = getattr(self, name)
                if f is not None and f.lo > cap.hi:
                    w.append(f"the message says {name.replace('_', ' ')} {f} but the GPU has "
                             f"{cap} in all: the figures contradict each other (on Windows, "
                             "the WDDM driver lets a process hold more than the GPU by paging "
                             "to host memory)")
            if self.free is not None:
                held = self.others + (self.this_process.value if self.this_process else 0)
                tol = cap.tol + self.free.tol + sum(f.tol for _, f in self.processes) + (
                    self.this_process.tol if self.this_process else 0)
                if held + self.free.value > cap.value + tol:
                    w.append(f"free ({self.free}) plus what the processes hold "
                             f"({format_bytes(held)}) exceeds the capacity ({cap})")
        if self.this_process is not None and self.reserved is not None and \
                self.reserved.lo > self.this_process.hi:
            w.append(f"PyTorch reserved {self.reserved} but the process has only "
                     f"{self.this_process} in use")
        if self.allocated is not None and self.reserved is not None and \
                self.allocated.lo > self.reserved.hi:
            w.append(f"allocated ({self.allocated}) exceeds reserved ({self.reserved})")

    def _find_this_process(self) -> None:
        """In a container PyTorch does not recognise itself in NVML's list and prints
        "Process N has X" for itself: the listed process whose X covers PyTorch's reserved
        memory by no more than a CUDA context's worth is taken for this one."""
        if self.this_process is not None or self.reserved is None or not self.processes:
            return
        r = self.reserved
        fits = [(f.value, pid, f) for pid, f in self.processes
                if f.hi >= r.lo and f.lo <= r.hi + _CONTEXT]
        if not fits:
            return
        _, pid, f = min(fits)
        self.this_pid, self.this_process = pid, f
        self.processes = [(p, g) for p, g in self.processes if p != pid]
        self.assumed.append(
            f"process {pid} ({f}) is this process: the message has no \"this process\" "
            f"clause (PyTorch in a container sees other process ids than NVML) and {f} is "
            f"PyTorch's {r} reserved plus at most {format_bytes(_CONTEXT)} (the CUDA context "
            "and libraries)")

    # ------------------------------------------------------------------ explaining
    def _tol_text(self, *figs: _Fig | None) -> str:
        tol = max((f.tol for f in figs if f is not None), default=0)
        return format_bytes(tol)

    def cause(self) -> Cause:
        """Why the request failed, following PyTorch's allocator (see :class:`Cause`).

        PyTorch fails a request only when no cached block fits it *and* it cannot get a new
        segment: the "Tried to allocate" figure is that segment. The segment is refused by
        ``set_per_process_memory_fraction`` (reserved + segment over the "allowed" limit;
        the driver is not asked) or by the driver (not that much free). So: the device and
        the limit had room -> unknown (something the message does not show refused it);
        else reserved-but-unallocated plus that room covers the segment -> fragmentation;
        else the limit refused -> limit; else what other processes hold would have served
        it -> another process; else device full.
        """
        r, f, u, res, a, cap = (self.request, self.free, self.unallocated, self.reserved,
                                self.allowed, self.capacity)
        seg = r.value
        figs = [f"segment asked for {r} (\"Tried to allocate\", the {'small' if self.small_pool else 'large'} pool)"]
        if f is None or cap is None:
            return Cause("unknown", "the message does not say how much the GPU had free",
                         figures=figs)
        figs.append(f"GPU {cap} in all, {f} free")
        tol_dev = r.tol + f.tol
        limit_room = None              # what the limit left (None: no limit printed)
        tol_lim = 0
        if a is not None and res is not None:
            limit_room = a.value - res.value
            tol_lim = a.tol + res.tol + r.tol
            figs.append(f"{a} allowed, {res} reserved by PyTorch")
        elif res is not None:
            figs.append(f"{res} reserved by PyTorch")
        if u is not None:
            figs.append(f"{u} reserved but unallocated")
        this = self.this_process
        if this is not None:
            figs.append(f"this process {this} on the GPU")
        figs.append(f"printed with two decimals: each known to within "
                    f"{self._tol_text(r, f, u, res, a, cap, this)} at most")
        device_room = f.value - seg > tol_dev
        limit_ok = limit_room is None or limit_room - seg > tol_lim
        if device_room and limit_ok:
            return self._unknown(figs)
        room = f.value if limit_room is None else min(f.value, max(0, limit_room))
        limit_refused = limit_room is not None and seg > limit_room
        # fragmentation: the memory was there, in PyTorch's segments
        if u is not None and u.value > 0 and u.value + room >= seg:
            return self._fragmentation(figs, room, limit_refused)
        if limit_refused:
            return self._limit(figs)
        # what else holds the GPU
        outside, known = self._outside()
        if outside is not None and outside > 0 and f.value + outside >= seg:
            return self._another(figs, outside, known)
        return self._device_full(figs, outside, known)

    def _outside(self) -> tuple[int | None, bool]:
        """Bytes held on the GPU by others than this process: ``(bytes, exact)``; exact is
        False when this process's own memory outside PyTorch is not in the message (then a
        CUDA context's worth is left to this process)."""
        cap, f = self.capacity, self.free
        if cap is None or f is None:
            return None, False
        if self.this_process is not None:
            return max(0, cap.value - f.value - self.this_process.value), True
        if self.reserved is not None:
            return max(0, cap.value - f.value - self.reserved.value - _CONTEXT), False
        if self.processes:
            return self.others, True
        return None, False

    def _unknown(self, figs: list[str]) -> Cause:
        r, f = self.request, self.free
        limit = "" if self.allowed is None else f" and the {self.allowed} limit left room"
        why = (f"the GPU had {f} free, more than the {r} segment PyTorch asked for{limit}: by "
               "the message's figures the driver should have given it, so something the "
               "message does not show refused it")
        advice = []
        if self.wording == "2.1":
            advice.append("PyTorch 2.1 does not print a set_per_process_memory_fraction limit "
                          "(its message has no 'allowed'): look for a "
                          "torch.cuda.set_per_process_memory_fraction call in your code and "
                          "its libraries, and raise it")
        elif self.allowed is None and self.wording in ("1.0-1.3", "1.4-2.0", ""):
            advice.append("a set_per_process_memory_fraction limit prints 'allowed' from "
                          "PyTorch 1.8; if yours is older or the message was cut, check for one")
        advice += [
            "CUDA MPS: a client's limit (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) refuses memory the "
            "GPU has free",
            "the driver: on Windows (WDDM) the free figure is not what cudaMalloc can get, "
            "and a segment needs contiguous virtual memory",
            "other processes: the free figure is read after the failure, when another job "
            "may have released memory; watch nvidia-smi while it runs"]
        return Cause("unknown", why, [], advice, figs)

    def _fragmentation(self, figs: list[str], room: int, limit_refused: bool) -> Cause:
        r, u = self.request, self.unallocated
        tol = r.tol + u.tol + (self.free.tol if self.free else 0)
        by = (f"the {self.allowed} limit left {format_bytes(max(0, room))}" if limit_refused
              else f"the driver had {format_bytes(room)} free")
        total = u.value + room
        borderline = total < r.value + tol
        why = (f"{u} is reserved by PyTorch but unallocated (free blocks inside segments that "
               f"still hold tensors) and {by}: {format_bytes(total)} in all, "
               f"{'about as much as' if borderline else 'more than'} the {r} segment asked "
               "for, but no free block is that large and no new segment could be made")
        if borderline:
            why += f" (the printed figures are known to within {format_bytes(tol)})"
        settings, advice = self._fragmentation_settings()
        if limit_refused:
            line = self._fraction_line()
            if line:
                settings.append(line)
        return Cause("fragmentation", why, settings, advice, figs)

    def _fragmentation_settings(self) -> tuple[list[str], list[str]]:
        """The settings that apply to this PyTorch and this pool."""
        var = self.conf_variable
        if self.small_pool:
            return [], [
                f"a small-pool request (a block of at most 1 MiB, in a {self.request} "
                "segment): max_split_size_mb acts on large blocks only, and expandable "
                "segments (PyTorch 2.1 on) map the small pool in 2 MiB pages, so no allocator "
                "setting serves it; the GPU itself was full: free memory (smaller batches, "
                "fewer tensors kept) or another GPU"]
        if self.wording in ("2.1", "2.2-2.8", "2.9+"):
            return [f"{var}=expandable_segments:True"], [
                "expandable segments (PyTorch 2.1 on) grow one segment instead of leaving "
                "tails that fit nothing; they do not help when live tensors pin the holes"]
        upgrade = ("PyTorch 1.10 brought max_split_size_mb and 2.1 expandable_segments: "
                   "upgrade to use them")
        if self.wording == "1.4-2.0" and "max_split_size_mb" in self.text:
            mib = self.request.value >> 20
            if self.request.value <= _LARGE_BUFFER + self.request.tol:
                return [], ["max_split_size_mb must be above 20 (MiB) before PyTorch 2.8, so "
                            "it cannot keep blocks this small whole; PyTorch 2.1's "
                            "expandable_segments can: upgrade"]
            mss = min(1024, max(21, 1 << (mib.bit_length() - 1)))
            return [f"{var}=max_split_size_mb:{mss}"], [
                "max_split_size_mb (PyTorch 1.10 on) keeps cached blocks of that size and "
                "larger whole, so they can serve large requests (expandable segments need "
                "PyTorch 2.1)"]
        return [], [upgrade + " (this message's PyTorch has neither"
                    + (", or it would print the max_split_size_mb hint" if
                       self.wording == "1.4-2.0" else "") + ")"]

    def _fraction_line(self) -> str | None:
        """``torch.cuda.set_per_process_memory_fraction(F)`` that would allow reserved + the
        segment, with every figure at its least favourable rounding, or None when the GPU
        could not give it anyway."""
        res, cap, r, f = self.reserved, self.capacity, self.request, self.free
        if res is None or cap is None:
            return None
        need = res.hi + r.hi
        frac = math.ceil(need * 1000 / max(1, cap.lo)) / 1000
        if frac > 1.0:
            return None
        if f is not None and f.value + r.tol < r.value:
            return None
        return (f"torch.cuda.set_per_process_memory_fraction({frac:.3f})  # allows "
                f"{format_bytes(int(frac * cap.lo))} of {cap}: {res} reserved + the {r} "
                "segment")

    def _limit(self, figs: list[str]) -> Cause:
        r, a, res, f = self.request, self.allowed, self.reserved, self.free
        why = (f"{res} reserved + the {r} segment is more than the {a} that "
               "set_per_process_memory_fraction allows: PyTorch refused it without asking "
               "the driver")
        advice = ["garbage_collection_threshold would not serve it: PyTorch already frees "
                  "every cached segment without tensors before it raises (and the threshold "
                  "acts only with a fraction set, from PyTorch 1.12)"]
        line = self._fraction_line()
        if line is None:
            if f is not None and f.value + r.tol < r.value:
                why += f"; the GPU had only {f} free, so a larger fraction alone would not do"
                outside, known = self._outside()
                if outside:
                    advice.append(self._find_process_advice())
            else:
                why += "; even the whole GPU would not hold it"
            return Cause("limit", why, [], advice, figs)
        return Cause("limit", why, [line], advice, figs)

    def _find_process_advice(self) -> str:
        pids = [str(p) for p, _ in self.processes] + [str(p) for p in self.unknown_processes]
        dev = f" {self.device}" if self.device is not None else ""
        named = f" (the message names process {', '.join(pids)})" if pids else ""
        return (f"find who holds GPU{dev}: nvidia-smi (or nvidia-smi --query-compute-apps="
                f"pid,used_memory --format=csv){named}; stop it, wait for it, or run on "
                "another GPU (CUDA_VISIBLE_DEVICES); in a container nvidia-smi shows the "
                "host's process ids")

    def _another(self, figs: list[str], outside: int, known: bool) -> Cause:
        r, f = self.request, self.free
        if known and self.processes:
            who = ", ".join(f"process {pid} ({g})" for pid, g in self.processes)
            held = f"{who} hold{'s' if len(self.processes) == 1 else ''}"
        elif known:
            held = f"other processes hold {format_bytes(outside)}"
        else:
            held = (f"{format_bytes(outside)} is held outside PyTorch's allocator beyond a "
                    f"{format_bytes(_CONTEXT)} CUDA context: another process, or other "
                    "libraries in this one (this PyTorch's message does not separate them)")
        why = (f"only {f} was free for the {r} segment; {held}: without it the "
               "segment would have fit")
        if known:
            figs.append(f"others {format_bytes(outside)} = capacity - free - this process")
        else:
            figs.append(f"outside PyTorch {format_bytes(outside)} = capacity - free - "
                        f"reserved - {format_bytes(_CONTEXT)} for the CUDA context (assumed)")
        return Cause("another process", why, [], [self._find_process_advice()], figs)

    def _device_full(self, figs: list[str], outside: int | None, known: bool) -> Cause:
        r, f = self.request, self.free
        u = self.unallocated.value if self.unallocated is not None else 0
        short = r.value - f.value - u
        if short <= 0:          # cannot happen (that is fragmentation); never say "0 B short"
            return self._unknown(figs)
        held = ""
        if self.this_process is not None:
            held = f"; this process holds {self.this_process}"
        elif self.reserved is not None:
            held = f"; PyTorch holds {self.reserved}"
        why = (f"the GPU had {f} free and PyTorch {format_bytes(u)} reserved but unallocated: "
               f"{format_bytes(short)} short of the {r} segment asked for{held}; no "
               "allocator setting makes room")
        advice = ["smaller batches, activation checkpointing, mixed precision, or a larger "
                  "GPU"]
        if outside:
            advice.append(f"{format_bytes(outside)} is held outside this process's "
                          "PyTorch: " + self._find_process_advice())
        return Cause("device full", why, [], advice, figs)

    def diagnosis(self) -> tuple[str, str, list[str]]:
        """``(cause, why, settings)`` of :meth:`cause`."""
        c = self.cause()
        return c.name, c.why, c.settings

    def lines(self) -> list[tuple[str, str]]:
        """The summary as (label, text) rows."""
        pool = "small" if self.small_pool else "large"
        out = [("request", f"{self.request} (the segment PyTorch asked the driver for; the "
                           f"{pool} pool)")]
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
            pid = f", listed as process {self.this_pid}" if self.this_pid is not None else ""
            out.append(("this process", f"{self.this_process} on the GPU in all (CUDA "
                        f"context and other libraries included{pid})"))
        for pid, f in self.processes:
            out.append(("other process", f"{pid}: {f}"))
        for pid in self.unknown_processes:
            out.append(("other process", f"{pid}: not available (NVML)"))
        c = self.cause()
        out.append(("cause", f"{c.name}: {c.why}"))
        for s in c.settings:
            out.append(("would serve it", s))
        for s in c.advice:
            out.append(("what to do", s))
        out.append(("figures used", "; ".join(c.figures)))
        if self.wording:
            out.append(("PyTorch", f"{self.wording} (from the message's wording)"))
        for a in self.assumed:
            out.append(("assumed", a))
        for w in self.warnings:
            out.append(("warning", w))
        return out

    def explain(self) -> str:
        rows = self.lines()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


# parts of a message: a clause with a size in it that no pattern read is reported
_CLAUSE_SPLIT = re.compile(r"(?<=[.;])\s+|\s+(?=\()")
_ANY_SIZE = re.compile(_SIZE, re.IGNORECASE)
_CLAUSE_SHOWN = 120


def _unread(body: str, start: int, spans: list[tuple[int, int]]) -> list[str]:
    """Clauses of the message after ``start`` with a size figure that no pattern read, up to
    the first long clause without a figure (the hint, or the text after the message)."""
    out = []
    pos = start
    for part in _CLAUSE_SPLIT.split(body[start:]):
        lo = body.find(part, pos)
        hi = lo + len(part)
        pos = hi
        if not part.strip():
            continue
        if not _ANY_SIZE.search(part):
            if len(part) > 20:
                break
            continue
        if not any(a < hi and lo < b for a, b in spans):
            shown = part if len(part) <= _CLAUSE_SHOWN else part[:_CLAUSE_SHOWN] + "..."
            out.append(f"a part of the message was not read (a misspelling, or a wording "
                       f"gpudash does not know): {shown!r}; its figures are left out")
    return out


def _checked(oom: TorchOOM, name: str, f: _Fig) -> _Fig | None:
    """``f``, or None with a note when it is NVML's "not available" or beyond any GPU."""
    if _is_nvml_na(f):
        oom.assumed.append(f"{name}: printed as 17179869184.00 GiB, NVML's 'not available' "
                           "(2**64 bytes; Windows and WSL do not report per-process memory): "
                           "not known")
        return None
    if f.value >= _HUGE:
        oom.warnings.append(f"{name}: a figure of 2**63 bytes or more, beyond any GPU: left out")
        return None
    return f


def read_torch_ooms(text: str) -> list[TorchOOM]:
    """Every PyTorch out-of-memory message in ``text``, in order (see the module
    docstring); [] when there is none.

    Raises
    ------
    TraceFormatError
        A message whose request is 2**63 bytes or more (not a figure PyTorch prints).
    """
    flat = _clean(text)
    heads = list(_HEAD.finditer(flat))
    out = []
    for k, m in enumerate(heads):
        end = heads[k + 1].start() if k + 1 < len(heads) else len(flat)
        body = flat[m.start():min(end, m.start() + _WINDOW)]
        request = _fig(m.group(1), m.group(2))
        if request.value >= _HUGE:
            raise TraceFormatError(f"message {k + 1}: the request 'Tried to allocate "
                                   f"{m.group(1)[:30]}{'...' if len(m.group(1)) > 30 else ''}"
                                   f" {m.group(2)}' is 2**63 bytes or more: not a figure "
                                   "PyTorch prints")
        oom = TorchOOM(request=request, text=body)
        spans = [(0, m.end() - m.start())]
        old = _OLD.search(body)
        new = _NEW_CAP.search(body)
        if old is not None and (new is None or old.start() < new.start()):
            spans.append(old.span())
            g = old.groups()
            oom.device = int(g[0])
            oom.capacity = _checked(oom, "total capacity", _fig(g[1], g[2]))
            oom.allocated = _checked(oom, "already allocated", _fig(g[3], g[4]))
            oom.free = _checked(oom, "free", _fig(g[5], g[6]))
            if g[7] is not None:
                oom.allowed = _checked(oom, "allowed", _fig(g[7], g[8]))
            last = _checked(oom, g[11], _fig(g[9], g[10]))
            if g[11].lower() == "cached":
                oom.wording = "1.0-1.3"
                if last is not None and oom.allocated is not None:
                    oom.unallocated = last
                    oom.reserved = _Fig(oom.allocated.value + last.value,
                                        oom.allocated.tol + last.tol)
            else:
                oom.wording = "1.4-2.0"
                if last is not None:
                    oom.reserved = last
                    if oom.allocated is not None:
                        oom.unallocated = _Fig(max(0, last.value - oom.allocated.value),
                                               last.tol + oom.allocated.tol)
        elif new is not None:
            spans.append(new.span())
            oom.device = int(new.group(1))
            oom.capacity = _checked(oom, "total capacity", _fig(new.group(2), new.group(3)))
            oom.free = _checked(oom, "free", _fig(new.group(4), new.group(5)))
            for p in _PROCESS.finditer(body):
                spans.append(p.span())
                pid = int(p.group(1))
                f = _checked(oom, f"process {pid}", _fig(p.group(2), p.group(3)))
                if f is None:
                    oom.unknown_processes.append(pid)
                else:
                    oom.processes.append((pid, f))
            this = _THIS.search(body)
            if this is not None:
                spans.append(this.span())
                oom.this_process = _checked(oom, "this process",
                                            _fig(this.group(1), this.group(2)))
            allowed = _ALLOWED.search(body)
            if allowed is not None:
                spans.append(allowed.span())
                oom.allowed = _checked(oom, "allowed", _fig(allowed.group(1), allowed.group(2)))
            of = _OF_ALLOCATED.search(body)
            if of is not None:
                spans.append(of.span())
                g = of.groups()
                oom.allocated = _checked(oom, "allocated by PyTorch", _fig(g[0], g[1]))
                if g[2] is not None:
                    oom.private_pools = _checked(oom, "private pools", _fig(g[2], g[3]))
                oom.unallocated = _checked(oom, "reserved but unallocated", _fig(g[4], g[5]))
                if oom.allocated is not None and oom.unallocated is not None:
                    oom.reserved = _Fig(oom.allocated.value + oom.unallocated.value,
                                        oom.allocated.tol + oom.unallocated.tol)
            low = body.lower()
            if "capacty" in low:
                oom.wording = "2.1"
            elif "pytorch_alloc_conf" in low:
                oom.wording = "2.9+"
            else:
                oom.wording = "2.2-2.8"
            oom._find_this_process()
        oom.warnings.extend(_unread(body, m.end() - m.start(), spans))
        oom._check()
        out.append(oom)
    return out


# ------------------------------------------------------------------ other texts
#: What an out-of-memory text looks like, in each framework's words.
EXPECTED = ("expected an out-of-memory message: PyTorch's 'CUDA out of memory. Tried to "
            "allocate ...' (or a memory snapshot, or torch.cuda.memory_summary()), "
            "TensorFlow's 'Allocator (GPU_0_bfc) ran out of memory trying to allocate ...' "
            "with its allocator dump, or JAX's 'RESOURCE_EXHAUSTED: Out of memory while trying "
            "to allocate ...' with XLA's allocator dump")

_NOT_OOM = [
    (re.compile(r"illegal memory access|CUDA_ERROR_ILLEGAL_ADDRESS|illegal address", re.I),
     "a CUDA illegal-memory-access error: a kernel read or wrote outside its memory (a bug "
     "or a bad index, not a lack of memory); rerun with CUDA_LAUNCH_BLOCKING=1 to find the "
     "kernel"),
    (re.compile(r"device-side assert", re.I),
     "a CUDA device-side assert (an index out of range, most often), not a lack of memory; "
     "rerun with CUDA_LAUNCH_BLOCKING=1 to find the operation"),
    (re.compile(r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDA error: out of "
                r"memory|CUDA_ERROR_OUT_OF_MEMORY", re.I),
     "an out-of-memory error from CUDA or a library outside PyTorch's caching allocator (a "
     "CUDA context, cuBLAS or cuDNN handle, NCCL): it prints no figures to explain; "
     "nvidia-smi shows who holds the GPU"),
    (re.compile(r"CUDA error:|CUDA_ERROR_\w+|cudaError\w*", re.I),
     "a CUDA error that is not an out-of-memory"),
]


def describe_non_oom(text: str) -> str | None:
    """What a text without an out-of-memory message is, when it is a CUDA error gpudash
    recognises (an illegal memory access, a device-side assert, ...); None otherwise."""
    head = text[:2_000_000]
    for pattern, what in _NOT_OOM:
        if pattern.search(head):
            return what
    return None


_SUMMARY_HEAD = re.compile(r"PyTorch CUDA memory summary, device ID (\d+)")
_SUMMARY_UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
                 "PiB": 1 << 50}
_SUMMARY_CELL = r"\s*(\d+)\s*(B|KiB|MiB|GiB|TiB|PiB)\s*\|"
_SUMMARY_ROW = re.compile(r"^\|\s*(Allocated memory|Active memory|Requested memory|GPU reserved "
                          r"memory|Non-releasable memory|from large pool|from small pool)\s*\|"
                          + _SUMMARY_CELL * 4, re.M)


@dataclass
class MemorySummary:
    """``torch.cuda.memory_summary()``'s table, read (:func:`read_memory_summary`).

    Sizes are what the table prints: whole units rounded down, so each is known to within
    one unit of its own (``tol``). ``rows`` maps a metric (``"GPU reserved memory"``) to
    ``{"all" | "large pool" | "small pool": (current, peak, allocated, freed)}`` in bytes.
    """

    device: int
    ooms: int | None = None
    retries: int | None = None
    rows: dict = field(default_factory=dict)
    tol: dict = field(default_factory=dict)

    def current(self, metric: str, pool: str = "all") -> int | None:
        got = self.rows.get(metric, {}).get(pool)
        return None if got is None else got[0]

    def lines(self) -> list[tuple[str, str]]:
        rows = []

        def fig(metric: str, i: int, pool: str = "all") -> str:
            got = self.rows.get(metric, {}).get(pool)
            return "?" if got is None else format_bytes(got[i])

        if self.ooms is not None:
            rows.append(("CUDA OOMs", f"{self.ooms} (out-of-memory errors raised)"))
        if self.retries is not None:
            rows.append(("cudaMalloc retries", f"{self.retries} (times PyTorch freed its cache "
                         "and asked the driver again: the GPU was near full)"))
        rows.append(("allocated", f"{fig('Allocated memory', 0)} now, {fig('Allocated memory', 1)}"
                                  " at the peak (in tensors)"))
        rows.append(("reserved", f"{fig('GPU reserved memory', 0)} now, "
                                 f"{fig('GPU reserved memory', 1)} at the peak (in segments)"))
        nr = self.current("Non-releasable memory")
        res = self.current("GPU reserved memory")
        if nr is not None:
            share = f", {100.0 * nr / res:.0f} % of reserved" if res else ""
            rows.append(("non-releasable", f"{format_bytes(nr)}{share}: free blocks in "
                         "segments that still hold tensors (reserved but unallocated, "
                         "kept by fragmentation)"))
            if res and nr * 5 >= res and nr >= 64 << 20:
                rows.append(("what to do", "much of reserved is free blocks that fit "
                             "nothing: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                             "(PyTorch 2.1 on) or max_split_size_mb (1.10 on)"))
        unit = max(self.tol.values(), default=0)
        rows.append(("figures", f"as the table prints them: whole units rounded down (known "
                                f"to within {format_bytes(unit)})"))
        return rows


def read_memory_summary(text: str) -> MemorySummary | None:
    """``torch.cuda.memory_summary()``'s table in ``text``, or None."""
    head = _SUMMARY_HEAD.search(text[:2_000_000])
    if head is None:
        return None
    out = MemorySummary(device=int(head.group(1)))
    body = text[head.start():head.start() + 20_000]
    m = re.search(r"CUDA OOMs:\s*(\d+)", body)
    if m:
        out.ooms = int(m.group(1))
    m = re.search(r"cudaMalloc retries:\s*(\d+)", body)
    if m:
        out.retries = int(m.group(1))
    metric = None
    for row in _SUMMARY_ROW.finditer(body):
        name = row.group(1)
        g = row.groups()[1:]
        vals, tol = [], 0
        for i in range(4):
            unit = _SUMMARY_UNIT[g[2 * i + 1]]
            n = int(g[2 * i][:30])
            if n * unit >= _HUGE:
                return None
            vals.append(n * unit)
            tol = max(tol, unit)
        if name.startswith("from "):
            if metric is None:
                continue
            out.rows[metric][name[5:]] = tuple(vals)
        else:
            metric = name
            out.rows[metric] = {"all": tuple(vals)}
        out.tol[name] = tol
    return out if out.rows else None
