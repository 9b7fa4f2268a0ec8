"""TensorFlow's BFC ("best-fit with coalescing") allocator, in pure Python.

Given the same calls and the same regions from its sub-allocator, :class:`BFCAllocator`
returns the same addresses, makes the same region requests and reports the same statistics
as TensorFlow's ``BFCAllocator`` (``tensorflow/tsl/framework/bfc_allocator.cc``). It also
numbers its chunk handles as TensorFlow does, so ``dump_memory_log`` is TensorFlow's text.

Layout of the state (all guarded by one lock):

- chunks are :class:`_Chunk` records linked to their physical neighbours (``prev``/``next``);
  ``_by_ptr`` maps each chunk's start address to it (TensorFlow's region handle table);
  deleted chunks go on a LIFO spare list and are reused, which is exactly TensorFlow's
  handle recycling, so handle numbers match;
- each of the 21 bins is a sorted ``list`` of integer keys ``size << 64 | ptr``: sorting the
  ints sorts by (size, address), ``bisect`` finds the best fit, and a bit mask of non-empty
  bins jumps to the next bin that can serve a request;
- regions are kept sorted by address.

Hot paths (``allocate``/``deallocate``) bind attributes to locals and do their event work
only while someone listens; ``benchmarks/bench_allocator.py`` measures them.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass, field
from operator import index as _as_index
from typing import Any

import numpy as np

from ._accel import twin
from ._errors import ConfigError, InvalidPointerError, OutOfMemoryError
from ._eventsource import EventSource, bin_num_for_size
from ._units import human_readable_num_bytes as _hr
from .events import (
    ALLOC as _ALLOC, FREE as _FREE, EXTEND as _EXTEND, RELEASE as _RELEASE, OOM as _OOM,
)

__all__ = [
    "BFCAllocator",
    "AllocatorStats",
    "MemoryDump",
    "MemChunk",
    "BinSummary",
    "RegionInfo",
    "bin_num_for_size",
    "rounded_bytes",
    "K_MIN_ALLOCATION_SIZE",
    "K_NUM_BINS",
]

logger = logging.getLogger("gpudash")

K_MIN_ALLOCATION_BITS = 8
K_MIN_ALLOCATION_SIZE = 1 << K_MIN_ALLOCATION_BITS  # 256
#: The largest request taken as a size at all (TensorFlow's sizes are int64): above it,
#: an out-of-memory error at once.
MAX_ALLOCATION = (1 << 63) - 1 - K_MIN_ALLOCATION_SIZE
K_NUM_BINS = 21
K_MAX_INTERNAL_FRAGMENTATION = 128 << 20
K_BACKPEDAL_FACTOR = np.float32(0.9)  # a C++ float: the product is computed in float32
K_MAX_FAILURE_LOGS = 10
K_INVALID_CHUNK_HANDLE = (1 << 64) - 1  # SIZE_MAX, as DumpMemoryLog prints it
K_FIRST_GROWTH_REGION = 2 << 20

_MASK64 = (1 << 64) - 1

# Event kinds as plain ints for the hot path.

_now = time.time_ns

_GC_MESSAGE = (
    "Garbage collection: deallocate free memory regions (i.e., allocations) so that we can "
    "re-allocate a larger region to avoid OOM due to memory fragmentation. If you see this "
    "message frequently, you are running near the threshold of the available device memory "
    "and re-allocation may incur great performance overhead. You may try smaller batch sizes "
    "to observe the performance impact. Set TF_ENABLE_GPU_GARBAGE_COLLECTION=false if you'd "
    "like to disable this feature."
)


def rounded_bytes(nbytes: int) -> int:
    """TensorFlow's ``RoundedBytes``: ``nbytes`` rounded up to a multiple of 256."""
    return (nbytes + 255) & ~255



# --------------------------------------------------------------------------------------
# Records returned to callers
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllocatorStats:
    """TensorFlow's ``AllocatorStats`` plus pool and fragmentation figures.

    Sizes count rounded chunk bytes, as TensorFlow's do.
    """

    num_allocs: int = 0
    bytes_in_use: int = 0
    peak_bytes_in_use: int = 0
    largest_alloc_size: int = 0
    bytes_limit: int = 0
    pool_bytes: int = 0
    peak_pool_bytes: int = 0
    largest_free_block_bytes: int = 0
    fragmentation: float = 0.0

    def debug_string(self) -> str:
        """TensorFlow's ``AllocatorStats::DebugString`` (``Reserved`` lines are always 0)."""
        rows = [
            ("Limit:", self.bytes_limit),
            ("InUse:", self.bytes_in_use),
            ("MaxInUse:", self.peak_bytes_in_use),
            ("NumAllocs:", self.num_allocs),
            ("MaxAllocSize:", self.largest_alloc_size),
            ("Reserved:", 0),
            ("PeakReserved:", 0),
            ("LargestFreeBlock:", self.largest_free_block_bytes),
        ]
        return "".join(f"{label:<18}{value:>20d}\n" for label, value in rows)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class BinSummary:
    """One bin of TensorFlow's ``MemoryDump`` (chunks bucketed by ``BinNumForSize``)."""

    bin: int
    bin_size: int
    total_bytes_in_use: int = 0
    total_bytes_in_bin: int = 0
    total_chunks_in_use: int = 0
    total_chunks_in_bin: int = 0
    total_requested_bytes_in_use: int = 0
    free_chunks: int = 0
    free_bytes: int = 0


@dataclass(frozen=True)
class MemChunk:
    """One chunk of TensorFlow's ``MemoryDump``; ``bin`` is -1 for a chunk in use.

    ``holder`` names who holds a chunk in use when the source says so (an op name from a
    dump, a label); "" otherwise.
    """

    address: int
    size: int
    requested_size: int
    bin: int
    in_use: bool
    allocation_id: int
    region: int
    handle: int
    holder: str = ""


@dataclass(frozen=True)
class RegionInfo:
    """A region obtained from the sub-allocator."""

    ptr: int
    size: int

    @property
    def end(self) -> int:
        return self.ptr + self.size


@dataclass(frozen=True)
class MemoryDump:
    """The allocator's whole state at one moment (TensorFlow's ``MemoryDump`` proto)."""

    allocator_name: str
    stats: AllocatorStats
    bins: list[BinSummary]
    chunks: list[MemChunk]
    regions: list[RegionInfo]
    memory_limit: int = 0
    seq: int = 0
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------
# Internal records
# --------------------------------------------------------------------------------------


class _Chunk:
    """A contiguous piece of a region; TensorFlow's ``Chunk``.

    ``aid`` is the allocation id (-1 when free); ``bin`` is the bin a free chunk sits in
    (-1 when in use). ``handle`` is fixed for the record's lifetime: records are recycled
    exactly as TensorFlow recycles chunk handles.
    """

    __slots__ = ("handle", "ptr", "size", "requested", "aid", "bin", "prev", "next", "region")

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.ptr = 0
        self.size = 0
        self.requested = 0
        self.aid = -1
        self.bin = -1
        self.prev: _Chunk | None = None
        self.next: _Chunk | None = None
        self.region: _Region | None = None


def _check_disjoint(alloc: Any, ptr: int, nbytes: int, before: Any, after: Any) -> None:
    """Refuse a region the sub-allocator handed out over one it handed out before (the
    regions before and after ``ptr``: objects with ``ptr`` and ``size``, or None); the range
    is given back to the sub-allocator first."""
    clash = before if before is not None and before.ptr + before.size > ptr else \
        after if after is not None and after.ptr < ptr + nbytes else None
    if clash is None:
        return
    alloc._sub.free(ptr, nbytes)
    raise InvalidPointerError(
        f"{alloc._name}: the sub-allocator handed out {ptr:#x}..{ptr + nbytes:#x}, which "
        f"overlaps the region {clash.ptr:#x}..{clash.ptr + clash.size:#x} it handed out "
        "before; a device must hand out disjoint ranges")


class _Region:
    __slots__ = ("ptr", "size", "end", "first")

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr = ptr
        self.size = size
        self.end = ptr + size
        self.first: _Chunk | None = None


def _pointer_or_none(ptr: Any) -> int | None:
    """An address given as another integer type (numpy), else None."""
    if isinstance(ptr, bool):
        return None
    try:
        return _as_index(ptr)
    except TypeError:
        return None


class _ConfigTypeError(ConfigError, TypeError):
    """A setting of the wrong type: a ConfigError naming it, and a TypeError as before."""


def _check_flag(name: str, value: Any) -> bool:
    """A boolean setting: True/False only (``"false"`` would be truthy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise _ConfigTypeError(f"{name} must be True or False; got {value!r}")
    return bool(value)


def _check_number(name: str, value: Any, accepted: str) -> float:
    """A real-number setting as a float; a string, None or a bool is refused by name."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or value is None:
        raise _ConfigTypeError(f"{name} must be {accepted}; got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise _ConfigTypeError(f"{name} must be {accepted}; got {value!r}") from None


def _negative_size(nbytes: int) -> ValueError:
    return ValueError(f"allocation size must be >= 0 bytes; got {nbytes}")


def _coerce_size(nbytes: Any) -> int:
    if isinstance(nbytes, bool) or isinstance(nbytes, float):
        raise TypeError(f"allocation size must be an integer number of bytes; got {nbytes!r}")
    try:
        return _as_index(nbytes)
    except TypeError:
        raise TypeError(
            f"allocation size must be an integer number of bytes; got {type(nbytes).__name__} "
            f"{nbytes!r}"
        ) from None


# --------------------------------------------------------------------------------------
# The allocator
# --------------------------------------------------------------------------------------



class PyBFCAllocator(EventSource):
    """TensorFlow's best-fit-with-coalescing allocator over any sub-allocator.

    Parameters
    ----------
    sub_allocator
        Any object with ``alloc(nbytes) -> int`` (raising ``MemoryError`` when it cannot)
        and ``free(ptr, nbytes)``. It is asked for whole regions, exactly as TensorFlow's
        ``Extend`` asks.
    memory_limit : int
        Most bytes of regions the allocator may hold (TensorFlow's ``total_memory``).
    allow_growth : bool
        Start with a 2 MiB region and double; otherwise take the whole limit at the first
        allocation.
    garbage_collection : bool
        When an allocation would fail, return every wholly free region and extend again.
    fragmentation_fraction : float
        Split a chunk when the waste would reach ``fraction * memory_limit``; 0 means
        TensorFlow's 128 MiB.
    retry_timeout : float
        Seconds a failing ``allocate`` waits for other threads' frees before it raises
        (TensorFlow waits 10 s).
    name : str
        The allocator's name, as in TensorFlow's messages (``GPU_0_bfc``).

    Examples
    --------
    >>> from gpudash import BFCAllocator, SimulatedDevice
    >>> a = BFCAllocator(SimulatedDevice(1 << 30), 1 << 30, name="GPU_0_bfc")
    >>> p = a.allocate(1000)
    >>> a.allocated_size(p), a.requested_size(p)
    (1024, 1000)
    >>> a.deallocate(p)
    >>> a.stats().bytes_in_use
    0
    """

    #: The model this allocator is (:data:`gpudash.models.MODELS`' key).
    allocator_model = "bfc"

    def __init__(self, sub_allocator: Any, memory_limit: int, *, allow_growth: bool = True,
                 garbage_collection: bool = False, fragmentation_fraction: float = 0.0,
                 retry_timeout: float = 0.0, name: str = "bfc") -> None:
        for method in ("alloc", "free"):
            if not callable(getattr(sub_allocator, method, None)):
                raise TypeError(
                    f"sub_allocator must have alloc(nbytes) and free(ptr, nbytes) methods; "
                    f"{type(sub_allocator).__name__} has no {method}()"
                )
        memory_limit = self._check_limit(memory_limit)
        allow_growth = _check_flag("allow_growth", allow_growth)
        garbage_collection = _check_flag("garbage_collection", garbage_collection)
        fragmentation_fraction = _check_number(
            "fragmentation_fraction", fragmentation_fraction,
            "a number in [0, 1] (0 = TensorFlow's 128 MiB rule)")
        if not 0.0 <= fragmentation_fraction <= 1.0:
            raise ConfigError(
                f"fragmentation_fraction must be in [0, 1] (0 = TensorFlow's 128 MiB rule); "
                f"got {fragmentation_fraction}"
            )
        retry_timeout = _check_number("retry_timeout", retry_timeout,
                                      "a finite number of seconds >= 0")
        if not math.isfinite(retry_timeout) or retry_timeout < 0:
            raise ConfigError(f"retry_timeout must be a finite number of seconds >= 0; got "
                              f"{retry_timeout}")

        self._sub = sub_allocator
        self._name = str(name)
        self._allow_growth = bool(allow_growth)
        self._gc = bool(garbage_collection)
        self._frag_fraction = fragmentation_fraction
        self._retry_timeout = retry_timeout
        self._limit = memory_limit
        self._max_frag = self._max_internal_fragmentation()
        if self._allow_growth:
            self._curr_region = rounded_bytes(min(memory_limit, K_FIRST_GROWTH_REGION))
        else:
            self._curr_region = rounded_bytes(memory_limit)
        self._started_backpedal = False
        # The lowest limit at which every decision made on the limit so far goes the same
        # way (see limit_floor); a growth that starts at 2 MiB holds for any limit >= 2 MiB.
        self._limit_floor = (K_FIRST_GROWTH_REGION if allow_growth and fragmentation_fraction
                             == 0.0 and memory_limit >= K_FIRST_GROWTH_REGION else memory_limit)
        # True while the pool is above a limit lowered live (see set_memory_limit): then no
        # allocation may take bytes in use past the limit, chunks are split to the rounded
        # size, and regions are returned as they empty.
        self._capped = False

        self._init_state()

        # Events (gpudash._eventsource): ``_journal`` is None while nobody listens, and the
        # hot paths then skip all event work; else one record of 8 ints per operation:
        #   (time_ns, code, ptr, size, requested, a, b, c)
        # alloc: a = bytes split off into a new free chunk (0: no split)
        # free:  a = allocation id, b = bytes of the next chunk merged, c = bytes of the
        #        previous chunk merged into
        # extend: requested = the rounded request; release/oom/limit: as the event table.
        self._init_events()

    def _init_state(self) -> None:
        """The empty state: the lock, chunks, bins, regions and counters (the compiled core
        keeps them in C and replaces this)."""
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiters = 0

        self._bins: list[list[int]] = [[] for _ in range(K_NUM_BINS)]
        self._mask = 0  # bit b set <=> bins[b] non-empty
        self._by_ptr: dict[int, _Chunk] = {}
        self._spare: list[_Chunk] = []
        self._n_handles = 0
        self._regions: list[_Region] = []
        self._region_ptrs: list[int] = []
        self._pool = 0
        self._next_aid = 1

        self._num_allocs = 0
        self._in_use = 0
        self._peak = 0
        self._largest = 0
        self._peak_pool = 0
        self._failure_logs = 0

    # ------------------------------------------------------------------ properties
    @property
    def name(self) -> str:
        """The allocator's name (``GPU_0_bfc``)."""
        return self._name

    @property
    def memory_limit(self) -> int:
        """Most bytes of regions the allocator may hold."""
        return self._limit

    @property
    def allow_growth(self) -> bool:
        return self._allow_growth

    @property
    def garbage_collection(self) -> bool:
        return self._gc

    @property
    def fragmentation_fraction(self) -> float:
        return self._frag_fraction

    @property
    def retry_timeout(self) -> float:
        return self._retry_timeout

    @property
    def pool_bytes(self) -> int:
        """Bytes of regions held (TensorFlow's ``total_region_allocated_bytes_``)."""
        return self._pool

    @property
    def bytes_in_use(self) -> int:
        return self._in_use

    @property
    def sub_allocator(self) -> Any:
        return self._sub

    @property
    def limit_floor(self) -> int:
        """The lowest limit at which this allocator, given the same calls from the start,
        would have done exactly what it did: every region the same, every allocation the
        same chunk, every refusal the same. It holds for every limit from here up to
        :attr:`memory_limit`. A decision the limit allowed raises the floor to the least
        limit that allows it (an extension of ``n`` bytes on a pool of ``p``: ``p + n``);
        a refusal holds under any lower limit. ``sys.maxsize`` once the limit or growth
        changed live; the limit itself when the first region's size, or the split rule
        (``fragmentation_fraction``), depends on it."""
        return self._limit_floor

    @property
    def curr_region_allocation_bytes(self) -> int:
        """Size of the next region growth would ask for (TensorFlow's member of that name)."""
        return self._curr_region

    @property
    def over_limit(self) -> bool:
        """True while memory in use exceeds the limit (after a lowered limit)."""
        return self._in_use > self._limit

    @property
    def pool_over_limit(self) -> bool:
        """True while the pool is above a limit lowered live: allocations are refused past
        the limit and regions go back as they empty (see :meth:`set_memory_limit`)."""
        return self._capped

    def pending_release(self) -> tuple[int, int]:
        """``(bytes, regions)``: how far the pool is above the limit, and how many regions
        still hold memory in use (each goes back when it empties); ``(0, 0)`` when the pool
        fits."""
        with self._lock:
            excess = self._pool - self._limit
            if excess <= 0:
                return 0, 0
            held = sum(1 for r in self._regions if any(
                c.aid >= 0 for c in self._chunks_of(r)))
            return excess, held

    @staticmethod
    def _chunks_of(region: _Region):
        c = region.first
        while c is not None:
            yield c
            c = c.next

    def __repr__(self) -> str:
        return (f"BFCAllocator(name={self._name!r}, limit={self._limit}, pool={self._pool}, "
                f"in_use={self._in_use}, allow_growth={self._allow_growth})")

    # ------------------------------------------------------------------ allocate
    def allocate(self, nbytes: int) -> int:
        """Allocate ``nbytes`` and return the address; 0 for ``nbytes == 0``.

        Raises
        ------
        OutOfMemoryError
            When no chunk fits and the pool cannot grow; the state is unchanged.
        TypeError, ValueError
            For a non-integer or negative size.
        """
        if type(nbytes) is not int:
            nbytes = _coerce_size(nbytes)
        if nbytes <= 0:
            if nbytes == 0:
                return 0
            raise _negative_size(nbytes)
        if nbytes > MAX_ALLOCATION:
            raise self._too_large(nbytes)
        rounded = (nbytes + 255) & ~255
        b = (rounded >> 8).bit_length() - 1
        if b > 20:
            b = 20
        with self._lock:
            journal = self._journal
            start = len(journal) if journal is not None else 0
            ptr = self._take(nbytes, rounded, b)
            if ptr:
                if journal is not None and start >= self._flush_at:
                    self._after_op(start)
                return ptr
            ptr = self._allocate_slow(nbytes, rounded, b)
            exc = None if ptr or self._retry_timeout else self._oom_locked(nbytes, rounded)
            if journal is not None:
                self._after_op(start)
        if ptr:
            return ptr
        if exc is not None:
            raise exc
        return self._retry(nbytes, rounded, b)

    def _too_large(self, nbytes: int) -> OutOfMemoryError:
        return OutOfMemoryError(
            f"Allocator ({self._name}) ran out of memory trying to allocate {nbytes} bytes: "
            f"more than any device holds (at most {MAX_ALLOCATION} bytes can be asked "
            "for, TensorFlow's int64 sizes)", requested=nbytes, rounded=nbytes,
            allocator=self._name)

    def try_allocate(self, nbytes: int, record_oom: bool = False) -> int:
        """Like :meth:`allocate`, but 0 instead of raising when memory is short, and nothing
        is logged (TensorFlow's first, quiet attempt before its retry loop). Callers that can
        free memory retry with :meth:`allocate`.

        With ``record_oom`` the refusal is still an ``oom`` event (replays, which refuse
        thousands of allocations, use this: no memory log is built)."""
        if type(nbytes) is not int:
            nbytes = _coerce_size(nbytes)
        if nbytes <= 0:
            if nbytes == 0:
                return 0
            raise _negative_size(nbytes)
        if nbytes > MAX_ALLOCATION:
            return 0
        rounded = (nbytes + 255) & ~255
        b = (rounded >> 8).bit_length() - 1  # bin_num_for_size, inlined
        if b > 20:
            b = 20
        with self._lock:
            journal = self._journal
            start = len(journal) if journal is not None else 0
            ptr = self._take(nbytes, rounded, b) or self._allocate_slow(nbytes, rounded, b)
            if journal is not None:
                if not ptr and record_oom:
                    journal.extend((_now(), _OOM, 0, rounded, nbytes, 0, 0, 0))
                self._after_op(start)
        return ptr

    def _take(self, nbytes: int, rounded: int, b: int) -> int:
        """FindChunkPtr (not inlined): best fit from bin ``b`` upwards; 0 if none fits.

        The hot path: SplitChunk (with AllocateChunk and InsertFreeChunkIntoBin) is inlined."""
        if self._capped and self._in_use + rounded > self._limit:
            return 0
        mask = self._mask >> b
        if not mask:
            return 0
        bins = self._bins
        lst = bins[b]
        if mask & 1:
            i = bisect_left(lst, rounded << 64)
            if i < len(lst):
                key = lst.pop(i)
                if not lst:
                    self._mask ^= 1 << b
            else:
                mask ^= 1
                if not mask:
                    return 0
                nb = b + ((mask & -mask).bit_length() - 1)
                lst = bins[nb]
                key = lst.pop(0)
                if not lst:
                    self._mask ^= 1 << nb
        else:
            nb = b + ((mask & -mask).bit_length() - 1)
            lst = bins[nb]
            key = lst.pop(0)
            if not lst:
                self._mask ^= 1 << nb
        ptr = key & _MASK64
        chunk = self._by_ptr[ptr]
        size = key >> 64
        remainder = 0
        if size >= rounded << 1 or size - rounded >= self._max_frag:
            # SplitChunk: the rest becomes a free chunk after this one.
            remainder = size - rounded
            spare = self._spare
            if spare:
                new = spare.pop()
            else:
                new = _Chunk(self._n_handles)
                self._n_handles += 1
            rest = ptr + rounded
            new.ptr = rest
            new.size = remainder
            new.region = chunk.region
            self._by_ptr[rest] = new
            neighbor = chunk.next
            new.prev = chunk
            new.next = neighbor
            chunk.next = new
            if neighbor is not None:
                neighbor.prev = new
            rb = (remainder >> 8).bit_length() - 1
            if rb > 20:
                rb = 20
            new.bin = rb
            insort(bins[rb], remainder << 64 | rest)
            self._mask |= 1 << rb
            chunk.size = size = rounded
        chunk.requested = nbytes
        aid = chunk.aid = self._next_aid
        self._next_aid = aid + 1
        chunk.bin = -1
        self._num_allocs += 1
        in_use = self._in_use = self._in_use + size
        if in_use > self._peak:
            self._peak = in_use
        if size > self._largest:
            self._largest = size
        journal = self._journal
        if journal is not None:
            journal.extend((_now(), _ALLOC, ptr, size, nbytes, remainder, 0, 0))
        return ptr

    def _allocate_slow(self, nbytes: int, rounded: int, b: int) -> int:
        """AllocateRawInternal after the first FindChunkPtr missed (lock held)."""
        if self._extend(rounded):
            ptr = self._take(nbytes, rounded, b)
            if ptr:
                return ptr
        if self._gc and self._deallocate_free_regions(rounded) and self._extend(rounded):
            ptr = self._take(nbytes, rounded, b)
            if ptr:
                return ptr
        return 0

    def _retry(self, nbytes: int, rounded: int, b: int) -> int:
        """TensorFlow's AllocatorRetry: wait for frees until ``retry_timeout`` has passed,
        retrying after each, then make one last attempt and raise OutOfMemoryError."""
        deadline = time.monotonic() + self._retry_timeout
        with self._lock:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._waiters += 1
                try:
                    self._cond.wait(remaining)
                finally:
                    self._waiters -= 1
                journal = self._journal
                start = len(journal) if journal is not None else 0
                ptr = self._take(nbytes, rounded, b) or self._allocate_slow(nbytes, rounded, b)
                if journal is not None:
                    self._after_op(start)
                if ptr:
                    return ptr
            journal = self._journal
            start = len(journal) if journal is not None else 0
            ptr = self._take(nbytes, rounded, b) or self._allocate_slow(nbytes, rounded, b)
            exc = None if ptr else self._oom_locked(nbytes, rounded)
            if journal is not None:
                self._after_op(start)
        if ptr:
            return ptr
        raise exc

    def _oom_locked(self, nbytes: int, rounded: int) -> OutOfMemoryError:
        """Lock held, the allocation has failed: journal the ``oom`` event, log as
        TensorFlow does (at most 10 warnings), and build the error with the memory log."""
        message = (
            f"Allocator ({self._name}) ran out of memory trying to allocate "
            f"{_hr(nbytes)} (rounded to {rounded})requested by op \n"
            "If the cause is memory fragmentation maybe the environment variable "
            "'TF_GPU_ALLOCATOR=cuda_malloc_async' will improve the situation. \n"
            "Current allocation summary follows.\n"
            "Current allocation summary follows."
        )
        if self._capped:
            first, rest = message.split("\n", 1)
            message = (
                f"{first}\nThe memory limit was lowered live to {_hr(self._limit)} while the "
                f"pool held {_hr(self._pool)}: allocations that would take bytes in use above "
                f"the limit are refused until frees bring it down (regions go back as they "
                f"empty). \n{rest}")
        memory_log = self._dump_memory_log(rounded)
        occupancy = self._render_occupancy()
        journal = self._journal
        if journal is not None:
            journal.extend((_now(), _OOM, 0, rounded, nbytes, 0, 0, 0))
        if self._failure_logs < K_MAX_FAILURE_LOGS:
            self._failure_logs += 1
            logger.warning("%s", message.split("\n", 1)[0])
            logger.debug("%s\n%s", memory_log, occupancy)
        return OutOfMemoryError(message + "\n" + memory_log + "\n" + occupancy,
                                requested=nbytes, rounded=rounded, allocator=self._name,
                                memory_log=memory_log)

    # ------------------------------------------------------------------ chunks
    def _new_chunk(self) -> _Chunk:
        """AllocateChunk: reuse the most recently deleted record, else make a new one."""
        if self._spare:
            return self._spare.pop()
        c = _Chunk(self._n_handles)
        self._n_handles += 1
        return c

    def _delete_chunk(self, c: _Chunk) -> None:
        """DeleteChunk: forget the chunk's address and recycle its record."""
        del self._by_ptr[c.ptr]
        c.aid = -1
        c.bin = -1
        c.prev = c.next = None
        c.region = None
        self._spare.append(c)

    def _insert_free(self, c: _Chunk) -> None:
        """InsertFreeChunkIntoBin."""
        size = c.size
        b = (size >> 8).bit_length() - 1
        if b > 20:
            b = 20
        c.bin = b
        insort(self._bins[b], size << 64 | c.ptr)
        self._mask |= 1 << b

    def _remove_free(self, c: _Chunk) -> None:
        """RemoveFreeChunkFromBin."""
        b = c.bin
        lst = self._bins[b]
        del lst[bisect_left(lst, c.size << 64 | c.ptr)]
        if not lst:
            self._mask ^= 1 << b
        c.bin = -1

    # ------------------------------------------------------------------ deallocate
    def deallocate(self, ptr: int) -> None:
        """Free an address returned by :meth:`allocate`; 0 is a no-op.

        Raises
        ------
        InvalidPointerError
            For an address never allocated here, or one already freed.
        """
        if not ptr:
            if not isinstance(ptr, bool) and isinstance(ptr, (int, np.integer)):
                return  # nullptr, as TensorFlow's DeallocateRaw
            # None, False, "", {}: a bug in the caller, never a silent no-op
            raise InvalidPointerError(
                f"{self._name}: deallocate() expects an int address; got {ptr!r}")
        with self._lock:
            c = self._by_ptr.get(ptr) if type(ptr) is int else self._by_ptr.get(
                _pointer_or_none(ptr))
            if c is None or c.aid < 0:
                raise self._invalid_pointer(ptr, "deallocate")
            self._free_locked(ptr, c)
            if self._waiters:
                self._cond.notify_all()

    def _free_locked(self, ptr: int, c: _Chunk) -> None:
        """Lock held, ``c`` the live chunk at ``ptr``: TensorFlow's FreeAndMaybeCoalesce.

        Merge and InsertFreeChunkIntoBin are inlined (the hot path); a merge removes the
        neighbour from its bin and deletes the absorbed chunk with the shared helpers."""
        freed = size = c.size
        self._in_use -= size
        aid = c.aid
        requested = c.requested
        c.aid = -1
        bins = self._bins
        # TryToCoalesce: the next chunk first, then the previous one.
        next_size = prev_size = 0
        n = c.next
        if n is not None and n.aid < 0:
            next_size = n.size
            self._remove_free(n)
            nn = c.next = n.next
            if nn is not None:
                nn.prev = c
            size += next_size
            self._delete_chunk(n)
        p = c.prev
        if p is not None and p.aid < 0:
            prev_size = p.size
            self._remove_free(p)
            nn = p.next = c.next
            if nn is not None:
                nn.prev = p
            size += prev_size
            self._delete_chunk(c)
            c = p
        c.size = size
        b = (size >> 8).bit_length() - 1
        if b > 20:
            b = 20
        c.bin = b
        insort(bins[b], size << 64 | c.ptr)
        self._mask |= 1 << b
        journal = self._journal
        if journal is not None:
            start = len(journal)
            journal.extend((_now(), _FREE, ptr, freed, requested, aid, next_size, prev_size))
            if self._capped and c.prev is None and c.next is None:
                self._deallocate_regions([c.region])
            if start >= self._flush_at:
                self._after_op(start)
        elif self._capped and c.prev is None and c.next is None:
            self._deallocate_regions([c.region])

    def _deallocate_batch(self, ptrs: list) -> list[str]:
        """Deallocate every pointer of ``ptrs`` (a session's completed deferred batch),
        taking the lock once; returns the messages of those refused (the others are freed
        all the same). Event for event the same as calling :meth:`deallocate` on each."""
        failed: list[str] = []
        if (type(self).deallocate is not PyBFCAllocator.deallocate
                or "deallocate" in self.__dict__):  # a subclass's (or a wrapper's) own rules
            for ptr in ptrs:
                try:
                    self.deallocate(ptr)
                except InvalidPointerError as exc:
                    failed.append(str(exc))
            return failed
        by_ptr = self._by_ptr
        free = self._free_locked
        with self._lock:
            for ptr in ptrs:
                if type(ptr) is not int:
                    ptr = _pointer_or_none(ptr)
                c = by_ptr.get(ptr)
                if c is None or c.aid < 0:
                    failed.append(str(self._invalid_pointer(ptr, "deallocate")))
                    continue
                free(ptr, c)
            if self._waiters:
                self._cond.notify_all()
        return failed

    def _invalid_pointer(self, ptr: Any, what: str) -> InvalidPointerError:
        try:
            if isinstance(ptr, bool):
                raise TypeError
            p = int(ptr)
            shown = f"{p:#x}"
        except (TypeError, ValueError, OverflowError):
            return InvalidPointerError(
                f"{self._name}: {what}() expects an int address; got {ptr!r}")
        c = self._by_ptr.get(p)
        if c is not None:
            return InvalidPointerError(
                f"{self._name}: {what}({shown}): this address was already freed "
                f"(double free?)")
        region = self._region_for(p)
        if region is not None:
            return InvalidPointerError(
                f"{self._name}: {what}({shown}): not the start of an allocation (it lies inside "
                f"region {region.ptr:#x}); pass the address allocate() returned")
        return InvalidPointerError(
            f"{self._name}: {what}({shown}): this allocator never allocated that address")

    def requested_size(self, ptr: int) -> int:
        """Bytes the caller asked for at ``ptr`` (TensorFlow's ``RequestedSize``)."""
        with self._lock:
            c = self._by_ptr.get(ptr) if type(ptr) is int else None
            if c is None or c.aid < 0:
                raise self._invalid_pointer(ptr, "requested_size")
            return c.requested

    def allocated_size(self, ptr: int) -> int:
        """Bytes actually given at ``ptr``: the chunk's size (TensorFlow's ``AllocatedSize``)."""
        with self._lock:
            c = self._by_ptr.get(ptr) if type(ptr) is int else None
            if c is None or c.aid < 0:
                raise self._invalid_pointer(ptr, "allocated_size")
            return c.size

    def allocation_id(self, ptr: int) -> int:
        """The allocation's unique id (TensorFlow's ``AllocationId``, from 1)."""
        with self._lock:
            c = self._by_ptr.get(ptr) if type(ptr) is int else None
            if c is None or c.aid < 0:
                raise self._invalid_pointer(ptr, "allocation_id")
            return c.aid

    def owns(self, ptr: int) -> bool:
        """True when ``ptr`` is the address of a live allocation of this allocator."""
        c = self._by_ptr.get(ptr)
        return c is not None and c.aid >= 0

    def _live_size(self, ptr: int) -> int:
        """The size of the live allocation at ``ptr``; 0 when there is none (no lock: a
        caller's quick check, as :meth:`owns`)."""
        c = self._by_ptr.get(ptr)
        return c.size if c is not None and c.aid >= 0 else 0

    # ------------------------------------------------------------------ regions
    def _region_for(self, ptr: int) -> _Region | None:
        i = bisect_right(self._region_ptrs, ptr) - 1
        if i >= 0:
            r = self._regions[i]
            if ptr < r.end:
                return r
        return None

    def _extend(self, rounded: int) -> bool:
        """TensorFlow's ``Extend``: ask the sub-allocator for one more region."""
        available = self._limit - self._pool
        available = (available // 256) * 256 if available > 0 else 0
        if rounded > available:
            return False
        increased = False
        if self._curr_region <= 0:  # the limit was 0 when it was set: start as TF would now
            self._curr_region = rounded_bytes(
                min(self._limit, K_FIRST_GROWTH_REGION) if self._allow_growth else self._limit)
            self._curr_region = max(self._curr_region, K_MIN_ALLOCATION_SIZE)
            self._limit_floor = max(self._limit_floor, self._limit)
        while rounded > self._curr_region:
            self._curr_region *= 2
            increased = True
        nbytes = min(self._curr_region, available)
        # the same region under any limit that leaves nbytes (cut to what is left, the same
        # cut while the limit stays in the same 256 bytes: this limit is at most that)
        if self._pool + nbytes > self._limit_floor:
            self._limit_floor = self._pool + nbytes
        ptr = self._sub_alloc(nbytes)
        if ptr is None and not self._started_backpedal:
            self._started_backpedal = True
            while ptr is None:
                smaller = rounded_bytes(int(np.float32(nbytes) * K_BACKPEDAL_FACTOR))
                # TSL spins forever when rounding undoes the 0.9 (regions below ~2.5 KiB);
                # XLA forces progress by one unit, and so does gpudash.
                nbytes = smaller if smaller < nbytes else nbytes - K_MIN_ALLOCATION_SIZE
                if nbytes < rounded:
                    break
                ptr = self._sub_alloc(nbytes)
        if ptr is None:
            return False
        if not increased:
            self._curr_region *= 2
        self._add_region(ptr, nbytes, rounded)
        return True

    def _sub_alloc(self, nbytes: int) -> int | None:
        try:
            ptr = self._sub.alloc(nbytes)
        except MemoryError:
            return None
        if not ptr:
            return None
        return int(ptr)

    def _add_region(self, ptr: int, nbytes: int, rounded: int) -> None:
        i = bisect_left(self._region_ptrs, ptr)
        _check_disjoint(self, ptr, nbytes,
                        self._regions[i - 1] if i else None,
                        self._regions[i] if i < len(self._regions) else None)
        region = _Region(ptr, nbytes)
        self._region_ptrs.insert(i, ptr)
        self._regions.insert(i, region)
        self._pool += nbytes
        if self._pool > self._peak_pool:
            self._peak_pool = self._pool
        c = self._new_chunk()
        c.ptr = ptr
        c.size = nbytes
        c.aid = -1
        c.prev = c.next = None
        c.region = region
        region.first = c
        self._by_ptr[ptr] = c
        self._insert_free(c)
        journal = self._journal
        if journal is not None:
            journal.extend((_now(), _EXTEND, ptr, nbytes, rounded, 0, 0, 0))

    def _free_regions(self) -> list[_Region]:
        out = []
        for r in self._regions:
            c = r.first
            while c is not None:
                if c.aid >= 0:
                    break
                c = c.next
            else:
                out.append(r)
        return out

    def _deallocate_regions(self, regions: list[_Region]) -> int:
        """DeallocateRegions: return whole free regions to the sub-allocator."""
        freed = 0
        journal = self._journal
        for r in regions:
            c = r.first
            while c is not None:
                nxt = c.next
                if c.bin >= 0:
                    self._remove_free(c)
                self._delete_chunk(c)
                c = nxt
            self._sub.free(r.ptr, r.size)
            self._pool -= r.size
            freed += r.size
            i = bisect_left(self._region_ptrs, r.ptr)
            del self._region_ptrs[i]
            del self._regions[i]
            if journal is not None:
                journal.extend((_now(), _RELEASE, r.ptr, r.size, 0, 0, 0, 0))
        if self._capped and self._pool <= self._limit:
            self._set_cap()
        return freed

    def _set_cap(self) -> None:
        """Lock held: enter or leave the state of a pool above a lowered limit."""
        capped = self._pool > self._limit
        self._capped = capped
        # While capped every chunk is split to the rounded size, so that bytes in use grow
        # by exactly what the cap allowed.
        self._max_frag = 1 if capped else self._max_internal_fragmentation()

    def _deallocate_free_regions(self, rounded: int) -> bool:
        """TensorFlow's ``DeallocateFreeRegions`` (garbage collection before an OOM)."""
        regions = self._free_regions()
        total_free = sum(r.size for r in regions)
        if total_free == 0:
            return False
        if rounded > self._limit - self._pool + total_free:
            return False
        if rounded + self._pool - total_free > self._limit_floor:
            self._limit_floor = rounded + self._pool - total_free
        logger.warning(_GC_MESSAGE)
        self._deallocate_regions(regions)
        return True

    def release_free_regions(self) -> int:
        """Return every wholly free region to the sub-allocator; the bytes returned."""
        with self._lock:
            journal = self._journal
            start = len(journal) if journal is not None else 0
            freed = self._deallocate_regions(self._free_regions())
            if journal is not None:
                self._after_op(start)
            return freed

    def preallocate(self) -> int:
        """Take what the limit leaves as one region now (what ``allow_growth=False`` does at
        the first allocation); returns the bytes added (0 when nothing is left or the
        sub-allocator refuses)."""
        with self._lock:
            available = self._limit - self._pool
            available = (available // 256) * 256 if available > 0 else 0
            if available == 0:
                return 0
            journal = self._journal
            start = len(journal) if journal is not None else 0
            ptr = self._sub_alloc(available)
            if ptr is None:
                return 0
            self._limit_floor = max(self._limit_floor, self._pool + available)
            self._add_region(ptr, available, 0)
            if journal is not None:
                self._after_op(start)
            return available

    # ------------------------------------------------------------------ settings
    @staticmethod
    def _check_limit(nbytes: Any) -> int:
        if isinstance(nbytes, (bool, float)):
            raise _ConfigTypeError(
                f"memory_limit must be an integer number of bytes; got {nbytes!r}")
        try:
            nbytes = _as_index(nbytes)
        except TypeError:
            raise _ConfigTypeError(
                f"memory_limit must be an integer number of bytes; got {nbytes!r}") from None
        if nbytes < 0:
            raise ConfigError(f"memory_limit must be >= 0 bytes; got {nbytes}")
        if nbytes > MAX_ALLOCATION:
            raise ConfigError(f"memory_limit must be at most {MAX_ALLOCATION} bytes (int64); "
                              f"got {nbytes}")
        return nbytes

    def _max_internal_fragmentation(self) -> int:
        if self._frag_fraction > 0.0:
            return int(self._frag_fraction * self._limit)
        return K_MAX_INTERNAL_FRAGMENTATION

    def set_memory_limit(self, nbytes: int) -> None:
        """Change the limit of a live allocator (TensorFlow fixes it at start; gpudash
        defines what a live change does).

        Raising it lets later allocations extend further. Lowering it returns wholly free
        regions (largest first) until the pool fits. Memory in use is never moved or freed,
        so the pool may stay above the new limit; while it does (:attr:`pool_over_limit`):

        - an allocation that would take bytes in use above the limit is refused with
          :class:`~gpudash.OutOfMemoryError` (TensorFlow's message plus a line saying the
          limit was lowered live), and no region is added;
        - the chunk an allocation takes is split to its rounded size, so bytes in use grow
          by exactly what the limit allows;
        - each region is returned to the sub-allocator as soon as it is wholly free, until
          the pool fits the limit again; then the allocator behaves as TensorFlow's.
        """
        nbytes = self._check_limit(nbytes)
        with self._lock:
            journal = self._journal
            start = len(journal) if journal is not None else 0
            old = self._limit
            self._limit = nbytes
            self._limit_floor = sys.maxsize   # what it did no longer follows from one limit
            self._max_frag = self._max_internal_fragmentation()
            if not self._allow_growth and rounded_bytes(nbytes) > self._curr_region:
                self._curr_region = rounded_bytes(nbytes)
            self._log_setting("memory_limit", old, nbytes, nbytes, old)
            if self._pool > nbytes:
                regions = sorted(self._free_regions(), key=lambda r: (-r.size, r.ptr))
                excess = self._pool - nbytes
                chosen = []
                for r in regions:
                    if excess <= 0:
                        break
                    chosen.append(r)
                    excess -= r.size
                chosen.sort(key=lambda r: r.ptr)
                self._deallocate_regions(chosen)
            self._set_cap()
            if nbytes > old and self._waiters:
                self._cond.notify_all()
            if journal is not None:
                self._after_op(start)

    def set_allow_growth(self, allow_growth: bool) -> None:
        """Switch growth on or off on a live allocator.

        On: later regions start again at 2 MiB and double. Off: the next extension asks for
        everything the limit leaves (call :meth:`preallocate` to take it at once).
        """
        if not isinstance(allow_growth, (bool, np.bool_)):
            raise ConfigError(f"allow_growth must be True or False; got {allow_growth!r}")
        allow_growth = bool(allow_growth)
        with self._lock:
            journal = self._journal
            start = len(journal) if journal is not None else 0
            old = self._allow_growth
            if old == allow_growth:
                return
            self._allow_growth = allow_growth
            self._limit_floor = sys.maxsize
            if allow_growth:
                self._curr_region = rounded_bytes(min(self._limit, K_FIRST_GROWTH_REGION))
            else:
                self._curr_region = rounded_bytes(self._limit)
            self._log_setting("allow_growth", old, allow_growth, int(allow_growth), int(old))
            if journal is not None:
                self._after_op(start)

    # ------------------------------------------------------------------ stats
    def _largest_free_chunk(self) -> int:
        mask = self._mask
        if not mask:
            return 0
        return self._bins[mask.bit_length() - 1][-1] >> 64

    def _stats(self) -> AllocatorStats:
        largest_free = self._largest_free_chunk()
        free = self._pool - self._in_use
        frag = (free - largest_free) / free if free > 0 else 0.0
        return AllocatorStats(
            num_allocs=self._num_allocs,
            bytes_in_use=self._in_use,
            peak_bytes_in_use=self._peak,
            largest_alloc_size=self._largest,
            bytes_limit=self._limit,
            pool_bytes=self._pool,
            peak_pool_bytes=self._peak_pool,
            largest_free_block_bytes=largest_free,
            fragmentation=frag,
        )

    def stats(self) -> AllocatorStats:
        """The allocator's statistics now (TensorFlow's ``GetStats``)."""
        with self._lock:
            return self._stats()

    def clear_stats(self) -> None:
        """TensorFlow's ``ClearStats``; the pool peak also restarts from the pool now."""
        with self._lock:
            self._num_allocs = 0
            self._peak = self._in_use
            self._largest = 0
            self._peak_pool = self._pool

    # ------------------------------------------------------------------ introspection
    def _iter_chunks(self):
        for r in self._regions:
            c = r.first
            while c is not None:
                yield r, c
                c = c.next

    def _bin_infos(self) -> list[list[int]]:
        """get_bin_debug_info: [bytes_in_bin, bytes_in_use, requested_in_use, chunks_in_bin,
        chunks_in_use] per bin, chunks bucketed by BinNumForSize (in use included)."""
        infos = [[0, 0, 0, 0, 0] for _ in range(K_NUM_BINS)]
        for _, c in self._iter_chunks():
            info = infos[bin_num_for_size(c.size)]
            info[0] += c.size
            info[3] += 1
            if c.aid >= 0:
                info[1] += c.size
                info[2] += c.requested
                info[4] += 1
        return infos

    def snapshot(self) -> MemoryDump:
        """The whole state: stats, 21 bin summaries, every chunk in address order, regions."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> MemoryDump:
        infos = self._bin_infos()
        bins = []
        for b, (in_bin, in_use, req, n_bin, n_use) in enumerate(infos):
            free_keys = self._bins[b]
            bins.append(BinSummary(
                bin=b, bin_size=256 << b, total_bytes_in_use=in_use, total_bytes_in_bin=in_bin,
                total_chunks_in_use=n_use, total_chunks_in_bin=n_bin,
                total_requested_bytes_in_use=req, free_chunks=len(free_keys),
                free_bytes=sum(k >> 64 for k in free_keys)))
        chunks = [
            MemChunk(address=c.ptr, size=c.size, requested_size=c.requested if c.aid >= 0 else 0,
                     bin=c.bin, in_use=c.aid >= 0, allocation_id=c.aid, region=r.ptr,
                     handle=c.handle)
            for r, c in self._iter_chunks()
        ]
        regions = [RegionInfo(r.ptr, r.size) for r in self._regions]
        return MemoryDump(allocator_name=self._name, stats=self._stats(), bins=bins,
                          chunks=chunks, regions=regions, memory_limit=self._limit,
                          seq=self._seq_now())

    def chunk_table(self) -> dict[str, np.ndarray]:
        """Every chunk as numpy columns, in address order: ``ptr``, ``size``, ``requested``
        (0 when free), ``alloc_id`` (-1 when free), ``bin`` (-1 in use), ``region`` and
        ``in_use`` (bool); plus ``regions`` (an (n, 2) array of region address and size).

        The cheap, columnar form of :meth:`snapshot` for views that redraw often.
        """
        ptrs: list[int] = []
        sizes: list[int] = []
        reqs: list[int] = []
        aids: list[int] = []
        bins: list[int] = []
        regs: list[int] = []
        with self._lock:
            region_rows = [(r.ptr, r.size) for r in self._regions]
            for r in self._regions:
                rp = r.ptr
                c = r.first
                while c is not None:
                    ptrs.append(c.ptr)
                    sizes.append(c.size)
                    reqs.append(c.requested if c.aid >= 0 else 0)
                    aids.append(c.aid)
                    bins.append(c.bin)
                    regs.append(rp)
                    c = c.next
        aid = np.array(aids, dtype=np.int64)
        return {
            "ptr": np.array(ptrs, dtype=np.int64),
            "size": np.array(sizes, dtype=np.int64),
            "requested": np.array(reqs, dtype=np.int64),
            "alloc_id": aid,
            "bin": np.array(bins, dtype=np.int8),
            "region": np.array(regs, dtype=np.int64),
            "in_use": aid >= 0,
            "regions": np.array(region_rows, dtype=np.int64).reshape(-1, 2),
        }

    def _chunk_debug(self, c: _Chunk, recurse: bool) -> str:
        in_use = c.aid >= 0
        s = (f"  Size: {_hr(c.size)} | Requested Size: {_hr(c.requested if in_use else 0)} | "
             f"in_use: {int(in_use)} | bin_num: {c.bin}")
        if recurse and c.prev is not None:
            s += ", prev: " + self._chunk_debug(c.prev, False)
        if recurse and c.next is not None:
            s += ", next: " + self._chunk_debug(c.next, False)
        return s

    def dump_memory_log(self, num_bytes: int = 0) -> str:
        """TensorFlow's ``DumpMemoryLog(num_bytes)``: the lines it logs, joined by newlines."""
        with self._lock:
            return self._dump_memory_log(num_bytes)

    def _dump_memory_log(self, num_bytes: int) -> str:
        lines = [f"BFCAllocator dump for {self._name}"]
        infos = self._bin_infos()
        for b, (in_bin, in_use, req, n_bin, n_use) in enumerate(infos):
            lines.append(
                f"Bin ({256 << b}): \tTotal Chunks: {n_bin}, Chunks in use: {n_use}. "
                f"{_hr(in_bin)} allocated for chunks. {_hr(in_use)} in use in bin. "
                f"{_hr(req)} client-requested in use in bin.")
        b = bin_num_for_size(num_bytes)
        lines.append(f"Bin for {_hr(num_bytes)} was {_hr(256 << b)}, Chunk State: ")
        for key in self._bins[b]:
            lines.append(self._chunk_debug(self._by_ptr[key & _MASK64], True))
        in_use_by_size: dict[int, int] = {}
        for r in self._regions:
            lines.append(f"Next region of size {r.size}")
            c = r.first
            while c is not None:
                if c.aid >= 0:
                    in_use_by_size[c.size] = in_use_by_size.get(c.size, 0) + 1
                nxt = c.next.handle if c.next is not None else K_INVALID_CHUNK_HANDLE
                state = "InUse" if c.aid >= 0 else "Free "
                lines.append(f"{state} at {c.ptr:x} of size {c.size} next {nxt}")
                c = c.next
        lines.append("     Summary of in-use Chunks by size: ")
        total = 0
        for size in sorted(in_use_by_size):
            count = in_use_by_size[size]
            lines.append(f"{count} Chunks of size {size} totalling {_hr(size * count)}")
            total += size * count
        lines.append(f"Sum Total of in-use chunks: {_hr(total)}")
        lines.append(
            f"total_region_allocated_bytes_: {self._pool} memory_limit_: {self._limit} "
            f"available bytes: {self._limit - self._pool} "
            f"curr_region_allocation_bytes_: {self._curr_region}")
        lines.append("Stats: \n" + self._stats().debug_string())
        return "\n".join(lines)

    def render_occupancy(self) -> str:
        """TensorFlow's ``RenderOccupancy``: 100 characters over the regions laid end to end:
        ``_`` free, ``*`` requested bytes, ``x`` rounding and unsplit waste."""
        with self._lock:
            return self._render_occupancy()

    def _render_occupancy(self) -> str:
        resolution = 100
        total = sum(r.size for r in self._regions)
        if total == 0:
            return "<allocator contains no memory>"
        out = ["_"] * resolution

        def render(offset: int, size: int, ch: str) -> None:
            start = offset * resolution // total
            end = (offset + size - 1) * resolution // total
            for i in range(start, end + 1):
                out[i] = ch

        region_offset = 0
        for r in self._regions:
            c = r.first
            while c is not None:
                if c.aid >= 0:
                    wasted = c.size - c.requested
                    if wasted > 0:
                        render(c.ptr - r.ptr + region_offset + c.requested, wasted, "x")
                    render(c.ptr - r.ptr + region_offset, c.requested, "*")
                c = c.next
            region_offset += r.size
        return "".join(out)

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Assert every invariant of the state; the message names the broken one.

        Regions sorted and disjoint, pool bytes = their sum; each region tiled by its chunks
        with consistent links; no two adjacent free chunks; every free chunk in exactly the
        bin its size maps to, bins sorted by (size, address) and the non-empty mask right;
        the address table holds exactly the chunks; stats add up.
        """
        with self._lock:
            try:
                self._check()
            except AssertionError as exc:
                raise AssertionError(f"{self._name}: invariant broken: {exc}\n"
                                     + self._dump_memory_log(0)) from None

    def _check(self) -> None:
        assert self._region_ptrs == [r.ptr for r in self._regions], "region index out of step"
        prev_end = -1
        pool = 0
        seen: set[int] = set()
        in_use = 0
        free_keys: set[int] = set()
        for r in self._regions:
            assert r.ptr >= prev_end, f"regions overlap at {r.ptr:#x}"
            assert r.end == r.ptr + r.size, f"region {r.ptr:#x} end wrong"
            prev_end = r.end
            pool += r.size
            c = r.first
            assert c is not None and c.ptr == r.ptr, f"region {r.ptr:#x} has no first chunk"
            assert c.prev is None, f"first chunk of region {r.ptr:#x} has a prev"
            expect = r.ptr
            while c is not None:
                assert c.ptr == expect, f"gap or overlap at {expect:#x} (chunk at {c.ptr:#x})"
                assert c.size > 0 and c.size % 256 == 0, f"chunk {c.ptr:#x} size {c.size}"
                assert c.region is r, f"chunk {c.ptr:#x} names the wrong region"
                assert self._by_ptr.get(c.ptr) is c, f"chunk {c.ptr:#x} missing from address table"
                assert c.ptr not in seen, f"chunk {c.ptr:#x} seen twice"
                seen.add(c.ptr)
                if c.next is not None:
                    assert c.next.prev is c, f"broken back link after {c.ptr:#x}"
                if c.aid >= 0:
                    assert c.bin == -1, f"chunk in use at {c.ptr:#x} sits in bin {c.bin}"
                    assert 0 < c.requested <= c.size, f"chunk {c.ptr:#x} requested {c.requested}"
                    in_use += c.size
                else:
                    assert c.bin == bin_num_for_size(c.size), (
                        f"free chunk {c.ptr:#x} of size {c.size} in bin {c.bin}")
                    free_keys.add(c.size << 64 | c.ptr)
                    nxt = c.next
                    assert nxt is None or nxt.aid >= 0, (
                        f"adjacent free chunks at {c.ptr:#x} and {nxt.ptr:#x} not coalesced")
                expect += c.size
                c = c.next
            assert expect == r.end, (
                f"chunks of region {r.ptr:#x} end at {expect:#x}, not {r.end:#x}")
        assert len(seen) == len(self._by_ptr), "address table holds chunks outside every region"
        assert pool == self._pool, f"pool bytes {self._pool} != sum of regions {pool}"
        assert in_use == self._in_use, f"bytes_in_use {self._in_use} != sum of chunks {in_use}"
        assert self._peak >= self._in_use, "peak_bytes_in_use below bytes_in_use"
        assert self._peak_pool >= self._pool, "peak_pool_bytes below pool_bytes"
        assert 0 <= self._limit_floor <= self._limit or self._limit_floor == sys.maxsize, (
            f"limit floor {self._limit_floor} above the limit {self._limit}")
        binned: set[int] = set()
        for b, lst in enumerate(self._bins):
            assert lst == sorted(lst), f"bin {b} not in (size, address) order"
            assert bool(lst) == bool(self._mask >> b & 1), f"bin mask wrong for bin {b}"
            for key in lst:
                assert bin_num_for_size(key >> 64) == b, f"size {key >> 64} in bin {b}"
                assert key not in binned, f"chunk {key & _MASK64:#x} binned twice"
                binned.add(key)
        assert binned == free_keys, "bins and free chunks differ"
        assert self._mask >> K_NUM_BINS == 0, "bin mask has bits above bin 20"

    # ------------------------------------------------------------------ events
    # ------------------------------------------------------------------ event hooks
    def _region_table(self) -> tuple[list[int], list[int]]:
        return list(self._region_ptrs), [r.end for r in self._regions]

    def _region_at(self, ptr: int) -> int:
        region = self._region_for(ptr)
        return region.ptr if region is not None else 0

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Return every region to the sub-allocator (TensorFlow's destructor). Memory still
        in use is freed with its region; the allocator is empty afterwards."""
        with self._lock:
            journal = self._journal
            start = len(journal) if journal is not None else 0
            for r in list(self._regions):
                c = r.first
                while c is not None:
                    if c.aid >= 0:
                        self._in_use -= c.size
                        c.aid = -1
                    c = c.next
            self._deallocate_regions(list(self._regions))
            if journal is not None:
                self._after_op(start)
        self.flush_events()


#: The fields of an allocator that :func:`clone` knows how to copy.
_CLONED = frozenset({
    "_sub", "_name", "_allow_growth", "_gc", "_frag_fraction", "_retry_timeout", "_limit",
    "_max_frag", "_curr_region", "_started_backpedal", "_capped", "_lock", "_cond", "_waiters",
    "_bins", "_mask", "_by_ptr", "_spare", "_n_handles", "_regions", "_region_ptrs",
    "_pool", "_next_aid", "_num_allocs", "_in_use", "_peak", "_largest", "_peak_pool",
    "_failure_logs", "_limit_floor", "_journal", "_journal_seq", "_journal_extra",
    "_counted", "_flush_at",
    "_callbacks", "_sinks", "_raw_sinks", "_batch_sinks", "_outbox", "device_index",
})


def clone(a: Any, sub: Any) -> Any:
    """An independent copy of an idle, unobserved BFC allocator over ``sub`` (a replay's
    checkpoints for scrubbing). The compiled core's allocator copies its C state itself
    (``_copy_core``); the Python model's chunks and regions are copied here
    (``copy.deepcopy`` would recurse along the chunk list and cannot copy locks).

    Raises
    ------
    NotImplementedError
        The allocator has fields this copy does not know (a subclass's), or listeners.
    """
    unknown = set(a.__dict__) - _CLONED
    if unknown:
        raise NotImplementedError(f"cannot clone a BFCAllocator with fields {sorted(unknown)}")
    if getattr(a, "compiled", False):
        return a._copy_core(sub)  # the compiled core copies its C state itself
    if a._journal is not None or a._callbacks or a._sinks or a._raw_sinks or a._batch_sinks:
        raise NotImplementedError("cannot clone an allocator that has listeners")
    new = object.__new__(type(a))
    d = new.__dict__
    d.update(a.__dict__)
    d["_sub"] = sub
    d["_lock"] = lock = threading.Lock()
    d["_cond"] = threading.Condition(lock)
    new._reset_listeners()
    d["_bins"] = [list(b) for b in a._bins]
    d["_region_ptrs"] = list(a._region_ptrs)

    def copy_chunk(c: _Chunk) -> _Chunk:
        n = _Chunk(c.handle)
        n.ptr, n.size, n.requested, n.aid, n.bin = c.ptr, c.size, c.requested, c.aid, c.bin
        return n

    by_ptr: dict[int, _Chunk] = {}
    regions = []
    for r in a._regions:
        nr = _Region(r.ptr, r.size)
        c = r.first
        prev = None
        while c is not None:
            n = copy_chunk(c)
            n.region = nr
            n.prev = prev
            if prev is None:
                nr.first = n
            else:
                prev.next = n
            by_ptr[n.ptr] = n
            prev = n
            c = c.next
        regions.append(nr)
    d["_regions"] = regions
    d["_by_ptr"] = by_ptr
    d["_spare"] = [copy_chunk(c) for c in a._spare]
    return new


#: TensorFlow's BFC allocator, the class gpudash uses: where the compiled core runs
#: (gpudash._accel), ``class BFCAllocator(BFCCore, PyBFCAllocator)`` built by
#: ``gpudash._core.bind_bfc_allocator``, whose ``BFCCore`` (``_csrc/bfc.pxi``) replaces the
#: methods that change the state (``gpudash._accel.TWINS`` says where each lives); else
#: :class:`PyBFCAllocator` above, the pure-Python model and readable reference.
BFCAllocator = twin(
    "bind_bfc_allocator", PyBFCAllocator,
    chunk=_Chunk, region=_Region, coerce_size=_coerce_size, negative_size=_negative_size,
    pointer_or_none=_pointer_or_none, logger=logger, gc_message=_GC_MESSAGE,
    constants={"MAX_ALLOCATION": MAX_ALLOCATION, "K_NUM_BINS": K_NUM_BINS,
               "K_FIRST_GROWTH_REGION": K_FIRST_GROWTH_REGION})
