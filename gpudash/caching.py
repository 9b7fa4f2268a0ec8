"""PyTorch's CUDA caching allocator, in pure Python.

Given the same calls, settings and segment addresses, :class:`CachingAllocator` makes the
decisions of PyTorch's ``DeviceCachingAllocator`` (``c10/cuda/CUDACachingAllocator.cpp``,
2.x, with the 1.x differences that change decisions): the same rounding, pool, best fit,
splits, merges, segment requests (``cudaMalloc`` sizes), releases on pressure, garbage
collection, expandable-segment maps and unmaps, out-of-memory points and statistics.

Layout of the state (all guarded by one lock):

- blocks are :class:`_Block` records linked to their physical neighbours (``prev``/``next``)
  inside one segment (a ``cudaMalloc`` allocation) or one expandable segment (a reserved
  virtual range whose pages are mapped as needed); ``_blocks`` maps each block's address to
  it;
- each pool (small: requests up to 1 MiB, packed in 2 MiB segments; large: the rest) keeps
  its free, mapped blocks as a sorted ``list`` of integer keys
  ``stream << 128 | size << 64 | address``: sorting the ints sorts by (stream, size,
  address) as PyTorch's ``BlockComparatorSize`` does, and ``bisect`` is its ``lower_bound``;
  unmapped stretches of expandable segments sit in a second list keyed
  ``stream << 64 | address`` (``BlockComparatorAddress``);
- ``_segments`` maps each segment's base to its size; expandable segments are
  :class:`_ExpandableSegment` records with one physical page handle per mapped page.

The device underneath is any sub-allocator (``alloc(nbytes) -> ptr``, raising
``MemoryError`` when it cannot, and ``free(ptr, nbytes)``): ``alloc`` is ``cudaMalloc`` of a
whole segment, or ``cuMemCreate`` of one page of an expandable segment. Its ``total`` (or
``memory_info()``) is the device's total memory, which ``set_memory_fraction`` and the
out-of-memory message use.

Events use gpudash's event kinds (:mod:`gpudash.events`): ``extend`` is PyTorch's
``segment_alloc`` or ``segment_map``, ``release`` its ``segment_free`` or ``segment_unmap``.
With :meth:`CachingAllocator.record_history` on, the allocator also keeps PyTorch's own
trace entries, which :meth:`CachingAllocator.snapshot` returns in the layout of
``torch.cuda.memory._snapshot()`` (MemoryViz opens it).

Not modelled: CUDA-graph and ``MemPool`` private pools, ``record_stream`` (cross-stream
frees complete at once), ``release_lock_on_cudamalloc`` (single lock), and
``backend:cudaMallocAsync``. The reference is ``TORCH_ALLOCATOR.md``'s specification,
checked against PyTorch 2.11 on a GPU.
"""

from __future__ import annotations

import sys
import threading
from bisect import bisect_left, insort
from collections import deque
from typing import Any

from ._accel import twin
from ._errors import (
    BackendUnavailableError,
    ConfigError,
    GpudashError,
    InvalidPointerError,
    OutOfMemoryError,
)
from ._eventsource import EventSource, now_ns
from ._torch_conf import CachingAllocatorConfig, parse_torch_version
from .bfc import AllocatorStats
from .events import (
    ALLOC as _ALLOC, FREE as _FREE, MERGE as _MERGE, EXTEND as _EXTEND, RELEASE as _RELEASE,
    OOM as _OOM,
)
from .bfc import BinSummary, MemChunk, MemoryDump, RegionInfo

__all__ = [
    "CachingAllocator",
    "CachingAllocatorConfig",
    "round_size",
    "allocation_size",
    "format_size",
    "K_MIN_BLOCK_SIZE",
    "K_SMALL_SIZE",
    "K_SMALL_BUFFER",
    "K_LARGE_BUFFER",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
]

K_MIN_BLOCK_SIZE = 512          # every size is rounded to at least 512 bytes
K_SMALL_SIZE = 1 << 20          # the largest "small" allocation: 1 MiB
K_SMALL_BUFFER = 2 << 20        # small allocations are packed in 2 MiB segments
K_LARGE_BUFFER = 20 << 20       # 1-10 MiB allocations get 20 MiB segments
K_MIN_LARGE_ALLOC = 10 << 20    # from 10 MiB, segments are the request rounded to 2 MiB
K_ROUND_LARGE = 2 << 20
#: PyTorch refuses requests of 1 EiB and more before the allocator sees them.
K_ONE_EXA = 1 << 60
_MASK64 = (1 << 64) - 1


# DeviceStats: the per-pool statistics, each an [current, peak, allocated, freed] for the
# aggregate (0), the small pool (1) and the large pool (2).
_POOL_STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
               "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
_STAT_TYPES = ("all", "small_pool", "large_pool")


# ------------------------------------------------------------------------------ size rules
def round_size(nbytes: int, conf: CachingAllocatorConfig) -> int:
    """PyTorch's ``round_size``: at least 512 bytes, a multiple of 512, or the next power-of-2
    division when ``roundup_power2_divisions`` applies to the size's interval (only above
    ``512 * divisions`` bytes). PyTorch 1.12-2.3 leave a size unrounded when the interval's
    divisions are 1."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    d = conf.divisions_for(nbytes)
    old = conf.version < (2, 4)
    if (d > 0 if old else d > 1) and nbytes > K_MIN_BLOCK_SIZE * d:
        if old and d <= 1:
            return nbytes
        if nbytes & (nbytes - 1) == 0:
            return nbytes
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (d.bit_length() - 1)
        if step == 0:
            return floor << 1
        f = nbytes & ~(step - 1)
        return nbytes if f == nbytes else f + step
    return (nbytes + 511) & ~511


def allocation_size(size: int) -> int:
    """PyTorch's ``get_allocation_size``: the segment asked of the driver for a rounded
    size (2 MiB up to 1 MiB, 20 MiB below 10 MiB, else rounded up to 2 MiB)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


def format_size(size: int) -> str:
    """PyTorch's ``format_size`` (the figures of its out-of-memory message): ``"512 bytes"``,
    ``"2.00 MiB"``, two decimals, binary units."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


# ------------------------------------------------------------------------------ records
class _Pool:
    """A ``BlockPool``: free mapped blocks by (stream, size, address), unmapped stretches of
    expandable segments by (stream, address), and the lookup counter GC ages count."""

    __slots__ = ("is_small", "keys", "unmapped", "calls", "index")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.keys: list[int] = []
        self.unmapped: list[int] = []
        self.calls = 0  # get_free_blocks_call_count
        self.index = 1 if is_small else 2  # stat type


class _Block:
    """A block of a segment. ``es`` is its expandable segment (None for a cudaMalloc
    segment); ``mapped`` is False only for unmapped stretches of an expandable segment."""

    __slots__ = ("ptr", "size", "requested", "stream", "pool", "allocated", "prev", "next",
                 "mapped", "es", "gc_base", "aid")

    def __init__(self, ptr: int, size: int, stream: int, pool: _Pool,
                 es: _ExpandableSegment | None = None, mapped: bool = True) -> None:
        self.ptr = ptr
        self.size = size
        self.requested = 0
        self.stream = stream
        self.pool = pool
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.mapped = mapped
        self.es = es
        self.gc_base = 0
        self.aid = -1

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"_Block({self.ptr:#x}, {self.size}, {state})"


class _ExpandableSegment:
    """PyTorch's ``ExpandableSegment``: a reserved virtual range of ``max_pages`` pages of
    ``page`` bytes (2 MiB for the small pool, 20 MiB for the large one), each mapped to a
    physical page of its own (``handles``) as needed."""

    __slots__ = ("base", "page", "max_pages", "stream", "pool", "handles")

    def __init__(self, base: int, page: int, max_pages: int, stream: int, pool: _Pool) -> None:
        self.base = base
        self.page = page
        self.max_pages = max_pages
        self.stream = stream
        self.pool = pool
        self.handles: list[int | None] = []

    @property
    def size(self) -> int:
        return self.page * self.max_pages

    def mapped_bytes(self) -> int:
        return self.page * sum(1 for h in self.handles if h is not None)


def _key(b: _Block) -> int:
    return (b.stream << 128) | (b.size << 64) | b.ptr


def _stream_of(stream: Any) -> int:
    if isinstance(stream, bool) or not isinstance(stream, int):
        try:
            import operator

            stream = operator.index(stream)
        except TypeError:
            raise ConfigError(f"stream must be an integer (a cudaStream_t value, 0 for the "
                              f"default stream); got {stream!r}") from None
    if not -(1 << 63) <= stream <= _MASK64:
        raise ConfigError(f"stream must be a cudaStream_t value, from -2**63 to 2**64 - 1; "
                          f"got a {stream.bit_length()}-bit "
                          f"{'negative ' if stream < 0 else ''}integer")
    return stream & _MASK64


class _Stats:
    """PyTorch's ``DeviceStats``. Each per-pool statistic is a flat list of 12 ints:
    ``[current, peak, allocated, freed]`` for the aggregate, the small pool and the large
    pool (index ``4 * stat_type + field``). ``active``/``active_bytes`` are not kept: with
    every free completing at once (no cross-stream uses), they equal
    ``allocation``/``allocated_bytes`` at every moment."""

    __slots__ = ("pool", "oversize_allocations", "oversize_segments", "num_alloc_retries",
                 "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")

    def __init__(self) -> None:
        self.pool = {name: [0] * 12 for name in _POOL_STATS if not name.startswith("active")}
        self.oversize_allocations = [0, 0, 0, 0]
        self.oversize_segments = [0, 0, 0, 0]
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_sync_all_streams = 0
        self.num_device_alloc = 0
        self.num_device_free = 0

    def get(self, name: str, stat_type: int) -> list[int]:
        """``[current, peak, allocated, freed]`` of a statistic and stat type."""
        flat = self.pool[{"active": "allocation", "active_bytes": "allocated_bytes"}.get(
            name, name)]
        return flat[4 * stat_type:4 * stat_type + 4]


def _inc(stat: list[int], t: int, n: int) -> None:
    """Increase a statistic by ``n`` for the aggregate and stat type ``t``."""
    c = stat[0] + n
    stat[0] = c
    if c > stat[1]:
        stat[1] = c
    stat[2] += n
    j = t << 2
    c = stat[j] + n
    stat[j] = c
    if c > stat[j + 1]:
        stat[j + 1] = c
    stat[j + 2] += n


def _dec(stat: list[int], t: int, n: int) -> None:
    stat[0] -= n
    stat[3] += n
    j = t << 2
    stat[j] -= n
    stat[j + 3] += n


def _inc1(stat: list[int], n: int) -> None:
    """Increase a statistic kept without stat types (``oversize_*``)."""
    c = stat[0] = stat[0] + n
    if c > stat[1]:
        stat[1] = c
    stat[2] += n


def _dec1(stat: list[int], n: int) -> None:
    stat[0] -= n
    stat[3] += n


# ------------------------------------------------------------------------------ allocator
class PyCachingAllocator(EventSource):
    """PyTorch's CUDA caching allocator over any sub-allocator.

    Parameters
    ----------
    sub_allocator
        Any object with ``alloc(nbytes) -> int`` (raising ``MemoryError`` when it cannot)
        and ``free(ptr, nbytes)``: gpudash's ``SimulatedDevice``, ``HostMemory`` or
        ``CudaMemory``. Its ``total`` (or ``memory_info()[1]``) is the device's total memory.
        Expandable segments reserve virtual ranges with its ``reserve(nbytes)`` (and
        ``unreserve(base, nbytes)``) when it has them, else from an address range of their
        own, and make each physical page with its ``create_page(nbytes)`` /
        ``release_page(handle, nbytes)``, else with ``alloc`` / ``free``.
    conf : str or CachingAllocatorConfig, optional
        ``PYTORCH_CUDA_ALLOC_CONF`` (``"expandable_segments:True,max_split_size_mb:128"``).
    fraction : float, optional
        ``torch.cuda.set_per_process_memory_fraction``: segments may total at most
        ``int(fraction * total)`` bytes, and garbage collection can run.
    version : str or tuple, optional
        The PyTorch version whose rules apply (default 2.11): the conf parser, the
        ``roundup_power2_divisions`` quirks, the out-of-memory message.
    name : str
        The allocator's name in gpudash's views (``cuda:0``).
    device : int
        The CUDA device index, as PyTorch's messages and snapshots name it.
    **parts
        Settings by name (``expandable_segments=True``, ``max_split_size_mb=128``...), applied
        after ``conf``.

    Examples
    --------
    >>> from gpudash import CachingAllocator, SimulatedDevice
    >>> a = CachingAllocator(SimulatedDevice("16GiB"))
    >>> p = a.allocate(1000)                   # a 2 MiB small-pool segment, 1024 bytes used
    >>> a.memory_stats()["reserved_bytes.all.current"], a.allocated_size(p)
    (2097152, 1024)
    >>> a.deallocate(p); a.empty_cache()
    >>> a.memory_stats()["reserved_bytes.all.current"]
    0
    """

    #: The model this allocator is (:data:`gpudash.models.MODELS`' key).
    allocator_model = "torch"
    kind = "torch"
    framework = "torch"

    def __init__(self, sub_allocator: Any, conf: str | CachingAllocatorConfig | None = None, *,
                 fraction: float | None = None, version: Any = None, name: str | None = None,
                 device: int = 0, **parts: Any) -> None:
        for method in ("alloc", "free"):
            if not callable(getattr(sub_allocator, method, None)):
                raise TypeError(
                    f"sub_allocator must have alloc(nbytes) and free(ptr, nbytes) methods; "
                    f"{type(sub_allocator).__name__} has no {method}()")
        if isinstance(conf, CachingAllocatorConfig):
            if version is not None and parse_torch_version(version) != conf.version:
                raise ConfigError(f"version={version!r} differs from the conf's version "
                                  f"{conf.version}")
            self._conf = conf.copy()
            if parts:
                self._conf.update(**parts)
        else:
            self._conf = CachingAllocatorConfig(conf, version=version, **parts)
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ConfigError(f"device must be an integer >= 0; got {device!r}")
        self._sub = sub_allocator
        self._device = device
        self._name = f"cuda:{device}" if name is None else str(name)
        self._init_state()
        self._set_fraction = False
        self._fraction: float | None = None
        self._va_next = 0x600000000000 + (device << 42)
        self._gc_on = False  # a fraction is set and garbage_collection_threshold > 0
        self._settings_changed()
        self._history: deque | None = None
        self._history_max = 0
        self._init_events()
        self.device_index = device
        if fraction is not None:
            self.set_memory_fraction(fraction)
        self._limit_floor = 0   # see limit_floor; a fraction set here holds from the start

    def _init_state(self) -> None:
        """The empty state: the lock, pools, blocks, segments and statistics (the compiled
        core keeps them in C and replaces this)."""
        self._lock = threading.Lock()
        self._small = _Pool(True)
        self._large = _Pool(False)
        self._blocks: dict[int, _Block] = {}
        self._spare: list[_Block] = []                 # records of merged blocks, reused
        self._segments: dict[int, int] = {}            # cudaMalloc base -> size
        self._seg_starts: list[int] = []               # its bases, sorted
        self._expandable: list[_ExpandableSegment] = []
        self._reserved = 0                             # total_allocated_memory
        self._allowed = 0                              # allowed_memory_maximum
        self._stats = _Stats()
        self._next_aid = 1
        self._peak_reserved = 0
        self._largest = 0                              # the largest block ever allocated

    # ------------------------------------------------------------------ properties
    @property
    def name(self) -> str:
        return self._name

    @property
    def config(self) -> CachingAllocatorConfig:
        """A copy of the settings in force."""
        return self._conf.copy()

    @property
    def version(self) -> tuple[int, int]:
        return self._conf.version

    @property
    def sub_allocator(self) -> Any:
        return self._sub

    @property
    def device(self) -> int:
        return self._device

    @property
    def fraction(self) -> float | None:
        """The ``set_per_process_memory_fraction`` in force, or None."""
        return self._fraction

    @property
    def device_total(self) -> int:
        """The device's total memory (``cudaMemGetInfo``'s total)."""
        total = getattr(self._sub, "total", None)
        if isinstance(total, int) and total > 0:
            return total
        info = getattr(self._sub, "memory_info", None)
        if callable(info):
            return int(info()[1])
        return 0

    def _device_free(self) -> int:
        info = getattr(self._sub, "memory_info", None)
        if callable(info):
            return int(info()[0])
        return max(0, self.device_total - self._reserved)

    @property
    def memory_limit(self) -> int:
        """What segments may total: the fraction's ``allowed_memory_maximum``, else the
        device's total memory."""
        return self._allowed if self._set_fraction else self.device_total

    @property
    def limit_floor(self) -> int:
        """The lowest limit (``allowed_memory_maximum``) at which this allocator, given the
        same calls from the start, would have done exactly what it did: every segment the
        same, every block, every refusal. It holds for every limit from here up to
        :attr:`memory_limit`. A segment the limit allowed raises the floor to the least
        limit that allows it (``reserved + size``); a refusal holds under any lower limit.
        The limit itself once garbage collection (``garbage_collection_threshold``, which
        scales with the limit) has looked; ``sys.maxsize`` once the fraction changed after
        construction; without a fraction, :attr:`memory_limit` (the device)."""
        return self._limit_floor if self._set_fraction else self.memory_limit

    @property
    def pool_bytes(self) -> int:
        """Bytes of segments held (``reserved_bytes.all.current``)."""
        return self._reserved

    @property
    def bytes_in_use(self) -> int:
        """Bytes of blocks allocated (``allocated_bytes.all.current``)."""
        return self._stats.pool["allocated_bytes"][0]

    @property
    def allow_growth(self) -> None:
        """TensorFlow's setting; PyTorch's allocator always grows on demand (None)."""
        return None

    @property
    def garbage_collection(self) -> bool:
        return self._conf.garbage_collection_threshold > 0.0

    def __repr__(self) -> str:
        conf = self._conf.as_conf()
        frac = f", fraction={self._fraction:g}" if self._set_fraction else ""
        return (f"CachingAllocator(name={self._name!r}, conf={conf!r}{frac}, "
                f"reserved={self._reserved}, allocated={self.bytes_in_use})")

    # ------------------------------------------------------------------ settings
    def set_memory_fraction(self, fraction: float) -> None:
        """``torch.cuda.set_per_process_memory_fraction``: segments may total at most
        ``int(fraction * total)`` bytes (memory already held stays), and garbage collection
        may run. A fraction cannot be unset (as in PyTorch; set 1.0)."""
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ConfigError(f"fraction must be a number in [0, 1]; got {fraction!r}")
        fraction = float(fraction)
        if not (0.0 <= fraction <= 1.0):
            raise ConfigError(f"fraction must be in [0, 1] (torch.cuda."
                              f"set_per_process_memory_fraction); got {fraction}")
        total = self.device_total
        with self._lock:
            journal = self._journal
            start = len(journal) if journal is not None else 0
            old = self._fraction
            self._allowed = int(fraction * total)
            self._limit_floor = sys.maxsize   # what it did no longer follows from one limit
            self._set_fraction = True
            self._fraction = fraction
            self._gc_on = self._conf.garbage_collection_threshold > 0.0
            self._log_setting("fraction", old, fraction, self._allowed, 0)
            if journal is not None:
                self._after_op(start)

    def set_allocator_settings(self, conf: str) -> None:
        """``torch.cuda.memory._set_allocator_settings(conf)``: parse a settings string onto
        the live allocator, as PyTorch does (``max_split_size_mb``,
        ``roundup_power2_divisions`` and ``garbage_collection_threshold`` return to their
        defaults unless the string sets them). Blocks already split or cached stay."""
        with self._lock:
            new = self._conf.copy()
            new.apply(conf)
            self._replace_conf(new, conf)

    def configure(self, **parts: Any) -> None:
        """Change settings by name on the live allocator (``expandable_segments=False``,
        ``max_split_size_mb=256``, ``garbage_collection_threshold=0.8``...), the others
        kept. Nothing changes when a value is refused."""
        with self._lock:
            new = self._conf.copy()
            new.update(**parts)
            self._replace_conf(new, ",".join(f"{k}:{v}" for k, v in parts.items()))

    def _settings_changed(self) -> None:
        """The settings the hot paths read, as plain attributes: no roundup divisions
        (512-byte rounding inline), max_split_size as an int (beyond any size when unset),
        whether every block splits down to 512 bytes (expandable segments), GC on."""
        conf = self._conf
        self._plain_round = not any(conf.roundup_power2_divisions)
        mss = conf.max_split_size
        self._mss = (1 << 64) if mss is None else mss
        self._split_any = conf.expandable_segments and conf.version >= (2, 1)
        self._gc_on = self._set_fraction and conf.garbage_collection_threshold > 0.0

    def _replace_conf(self, new: CachingAllocatorConfig, said: str) -> None:
        old = self._conf
        journal = self._journal
        start = len(journal) if journal is not None else 0
        self._conf = new  # oversize counts follow the new threshold, as PyTorch's do
        try:
            self._settings_changed()
        except BaseException:       # a setting the model cannot hold: nothing changes
            self._conf = old
            self._settings_changed()
            raise
        for key, a, b in (("expandable_segments", old.expandable_segments,
                           new.expandable_segments),
                          ("max_split_size_mb", old.as_dict()["max_split_size_mb"],
                           new.as_dict()["max_split_size_mb"]),
                          ("garbage_collection_threshold", old.garbage_collection_threshold,
                           new.garbage_collection_threshold),
                          ("roundup_power2_divisions", old.roundup_power2_divisions,
                           new.roundup_power2_divisions),
                          ("max_non_split_rounding_mb", old.max_non_split_rounding_size >> 20,
                           new.max_non_split_rounding_size >> 20)):
            if a != b:
                self._log_setting(key, a, b, 0, 0)
        if journal is not None:
            self._after_op(start)

    # ------------------------------------------------------------------ history
    def record_history(self, enabled: bool = True, max_entries: int = 1_000_000) -> None:
        """``torch.cuda.memory._record_memory_history``: keep PyTorch's trace entries (the
        last ``max_entries``) for :meth:`snapshot`'s ``device_traces``. Turning it off
        clears them, as PyTorch does."""
        if not isinstance(enabled, bool):
            raise ConfigError(f"enabled must be True or False; got {enabled!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or \
                max_entries < 1:
            raise ConfigError(f"max_entries must be an integer >= 1; got {max_entries!r}")
        with self._lock:
            if not enabled:
                self._history = None
                return
            old = list(self._history) if self._history is not None else []
            self._history = deque(old[-max_entries:], maxlen=max_entries)
            self._history_max = max_entries

    def _trace(self, action: str, addr: int, size: int, stream: int) -> None:
        self._history.append((action, addr, size, stream, now_ns() // 1000))

    # ------------------------------------------------------------------ allocate
    def allocate(self, nbytes: int, stream: int = 0) -> int:
        """``malloc``: a block of at least ``nbytes`` on ``stream``; its address. 0 bytes
        returns 0 with no call, as PyTorch returns nullptr.

        Raises
        ------
        OutOfMemoryError
            With PyTorch's message (``CUDA out of memory. Tried to allocate ...``). As in
            PyTorch, the failed call has already returned cached segments to the device.
        """
        ptr = self._malloc(nbytes, stream, True)
        return ptr

    def try_allocate(self, nbytes: int, record_oom: bool = True, stream: int = 0) -> int:
        """Like :meth:`allocate`, but 0 instead of raising (the out-of-memory path, its
        releases, trace entry and statistics happen all the same)."""
        return self._malloc(nbytes, stream, False)

    def _check_request(self, nbytes: Any) -> int:
        if type(nbytes) is not int:
            if isinstance(nbytes, bool):
                raise TypeError(f"allocation size must be an integer; got {nbytes!r}")
            import operator

            try:
                nbytes = operator.index(nbytes)
            except TypeError:
                raise TypeError(f"allocation size must be an integer; got {nbytes!r}") from None
        if nbytes < 0:
            raise ValueError(f"allocation size must be >= 0 bytes; got {nbytes}")
        return nbytes

    def _malloc(self, nbytes: int, stream: Any, raise_oom: bool) -> int:
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = self._check_request(nbytes)
            if not nbytes:
                return 0
        if type(stream) is not int or not 0 <= stream <= _MASK64:
            stream = _stream_of(stream)
        if nbytes >= K_ONE_EXA:
            if raise_oom:
                raise OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate more than 1EB memory.",
                    requested=nbytes, rounded=nbytes, allocator=self._name)
            return 0
        with self._lock:
            journal = self._journal
            start = len(journal) if journal is not None else 0
            size = (nbytes + 511) & ~511 if self._plain_round else round_size(nbytes,
                                                                                self._conf)
            pool = self._small if size <= K_SMALL_SIZE else self._large
            block = self._get_free_block(pool, stream, size)
            if block is None:
                alloc_size = allocation_size(size)
                if self._gc_on:
                    self._garbage_collect()
                block = self._alloc_block(pool, stream, size, alloc_size, False)
                if block is None:
                    if self._release_available_cached_blocks(pool, stream, size):
                        block = self._alloc_block(pool, stream, size, alloc_size, False)
                    if block is None:
                        self._release_cached_blocks()
                        block = self._alloc_block(pool, stream, size, alloc_size, True)
                if block is None:
                    exc = self._oom(nbytes, size, alloc_size, stream, raise_oom)
                    if journal is not None:
                        self._after_op(start)
                    if exc is not None:
                        raise exc
                    return 0
            ptr = self._alloc_found_block(block, pool, size, nbytes, stream)
            if journal is not None and start >= self._flush_at:
                self._after_op(start)
            return ptr

    def _get_free_block(self, pool: _Pool, stream: int, size: int,
                        take: bool = True) -> _Block | None:
        """``get_free_block``: the one best-fit candidate, or None. With ``take=False``
        only says which block a malloc would take now (no GC ageing, nothing removed)."""
        if take and self._gc_on:
            pool.calls += 1
        keys = pool.keys
        i = bisect_left(keys, (stream << 128) | (size << 64))
        if i == len(keys):
            return None
        key = keys[i]
        if key >> 128 != stream:
            return None
        blocks = self._blocks
        b = blocks[key & _MASK64]
        conf = self._conf
        if b.es is not None:
            if conf.expandable_segments:
                n = len(keys)
                cur_exp = b.size + (b.next.size if b.next is not None and not b.next.mapped
                                    else 0)
                j = i + 1
                while b.es is not None and j < n:
                    nk = keys[j]
                    if nk >> 128 != stream:
                        break
                    nb = blocks[nk & _MASK64]
                    nexp = nb.size + (nb.next.size if nb.next is not None and not nb.next.mapped
                                      else 0)
                    if not nexp < cur_exp:
                        break
                    b, i, cur_exp = nb, j, nexp
                    j += 1
            else:
                j = i + 1
                n = len(keys)
                while j < n and (keys[j] >> 128) == stream and \
                        blocks[keys[j] & _MASK64].es is not None:
                    j += 1
                if j == n or keys[j] >> 128 != stream:
                    return None
                i = j
                b = blocks[keys[j] & _MASK64]
        mss = self._mss
        if b.size >= mss or size >= mss:   # never true while max_split_size is unset
            if size < mss and b.size >= mss:
                return None
            if size >= mss and b.size >= size + self._non_split_tolerance():
                return None
        if take:
            del keys[i]
        return b

    def cached_block_for(self, nbytes: int, stream: int = 0) -> int:
        """The address of the cached free block a request of ``nbytes`` would take now, or
        0 when it would need new memory from the device (nothing changes)."""
        nbytes = self._check_request(nbytes)
        if not nbytes:
            return 0
        stream = _stream_of(stream)
        with self._lock:
            size = round_size(nbytes, self._conf)
            pool = self._small if size <= K_SMALL_SIZE else self._large
            b = self._get_free_block(pool, stream, size, take=False)
            return b.ptr if b is not None else 0

    def _non_split_tolerance(self) -> int:
        if self._conf.version >= (2, 6):
            return self._conf.max_non_split_rounding_size
        return K_LARGE_BUFFER

    def _should_split(self, block: _Block, size: int) -> bool:
        """``should_split``: small blocks (and every block while expandable segments are
        on, 2.1+) split when 512 bytes remain; large ones when more than 1 MiB remains and
        the request is below max_split_size."""
        remaining = block.size - size
        if block.pool.is_small or self._split_any:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._mss and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block: _Block, pool: _Pool, size: int, orig: int,
                           stream: int) -> int:
        """``alloc_found_block``: split the block if it should be (the allocation takes the
        front), mark it allocated, count it. The hot path: the statistics updates of
        :func:`_inc`/:func:`_dec` are written out."""
        stats = self._stats.pool
        t = pool.index
        j = t << 2
        prev = block.prev
        already_split = prev is not None or block.next is not None
        remainder = 0
        rem = block.size - size
        if pool.is_small or self._split_any:
            split = rem >= K_MIN_BLOCK_SIZE
        else:
            split = size < self._mss and rem > K_SMALL_SIZE
        if split:
            # the allocation takes the front; the old record becomes the free remainder
            remaining = block
            spare = self._spare
            if spare:
                block = spare.pop()
                block.ptr = remaining.ptr
                block.size = size
                block.stream = stream
                block.pool = pool
                block.es = remaining.es
                block.mapped = True
            else:
                block = _Block(remaining.ptr, size, stream, pool, remaining.es)
            block.prev = prev
            if prev is not None:
                prev.next = block
            block.next = remaining
            remaining.prev = block
            rptr = remaining.ptr = remaining.ptr + size
            remainder = remaining.size = remaining.size - size
            blocks = self._blocks
            blocks[block.ptr] = block
            blocks[rptr] = remaining
            remaining.gc_base = pool.calls
            insort(pool.keys, (stream << 128) | (remainder << 64) | rptr)
            if block.es is None:
                sb = stats["inactive_split_bytes"]
                if already_split:
                    # an already-split inactive block shrinks by `size` bytes
                    sb[0] -= size
                    sb[3] += size
                    sb[j] -= size
                    sb[j + 3] += size
                else:
                    # a new split inactive block of `remainder` bytes
                    c = sb[0] = sb[0] + remainder
                    if c > sb[1]:
                        sb[1] = c
                    sb[2] += remainder
                    c = sb[j] = sb[j] + remainder
                    if c > sb[j + 1]:
                        sb[j + 1] = c
                    sb[j + 2] += remainder
                    _inc(stats["inactive_split"], t, 1)
        elif already_split and block.es is None:
            _dec(stats["inactive_split_bytes"], t, block.size)
            _dec(stats["inactive_split"], t, 1)
        block.allocated = True
        block.requested = orig
        aid = block.aid = self._next_aid
        self._next_aid = aid + 1
        bsize = block.size
        if bsize > self._largest:
            self._largest = bsize
        # allocation += 1, allocated_bytes += bsize, requested_bytes += orig, for the
        # aggregate ([0:4]) and the pool ([j:j+4]): [current, peak, allocated, freed]
        st = stats["allocation"]
        c = st[0] = st[0] + 1
        if c > st[1]:
            st[1] = c
        st[2] += 1
        c = st[j] = st[j] + 1
        if c > st[j + 1]:
            st[j + 1] = c
        st[j + 2] += 1
        st = stats["allocated_bytes"]
        c = st[0] = st[0] + bsize
        if c > st[1]:
            st[1] = c
        st[2] += bsize
        c = st[j] = st[j] + bsize
        if c > st[j + 1]:
            st[j + 1] = c
        st[j + 2] += bsize
        st = stats["requested_bytes"]
        c = st[0] = st[0] + orig
        if c > st[1]:
            st[1] = c
        st[2] += orig
        c = st[j] = st[j] + orig
        if c > st[j + 1]:
            st[j + 1] = c
        st[j + 2] += orig
        if bsize >= self._mss:
            _inc1(self._stats.oversize_allocations, 1)
        if self._history is not None:
            self._trace("alloc", block.ptr, orig, stream)
        journal = self._journal
        if journal is not None:
            journal.extend((now_ns(), _ALLOC, block.ptr, bsize, orig, remainder, 0, 0))
        return block.ptr

    # ------------------------------------------------------------------ new memory
    def _alloc_block(self, pool: _Pool, stream: int, size: int, alloc_size: int,
                     is_retry: bool) -> _Block | None:
        """``alloc_block``: a new segment (or mapped pages); None when the device refuses."""
        st = self._stats
        if is_retry:
            st.num_alloc_retries += 1
        if self._set_fraction:
            if self._reserved + alloc_size > self._allowed:
                return None
            if self._reserved + alloc_size > self._limit_floor:
                self._limit_floor = self._reserved + alloc_size
        if self._conf.expandable_segments and self._conf.version >= (2, 1):
            return self._try_allocate_expandable(pool, stream, size)
        try:
            ptr = self._sub.alloc(alloc_size)
        except MemoryError:
            return None
        if not ptr:
            return None
        ptr = int(ptr)
        clash = self._clash(ptr, alloc_size)
        if clash is not None:
            self._sub.free(ptr, alloc_size)
            raise self._overlap_error("handed out", ptr, alloc_size, clash)
        insort(self._seg_starts, ptr)
        self._reserved += alloc_size
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        block = _Block(ptr, alloc_size, stream, pool)
        self._blocks[ptr] = block
        self._segments[ptr] = alloc_size
        _inc(st.pool["segment"], pool.index, 1)
        _inc(st.pool["reserved_bytes"], pool.index, alloc_size)
        mss = self._conf.max_split_size
        if mss is not None and alloc_size >= mss:
            _inc1(st.oversize_segments, 1)
        st.num_device_alloc += 1
        if self._history is not None:
            self._trace("segment_alloc", ptr, alloc_size, stream)
        journal = self._journal
        if journal is not None:
            journal.extend((now_ns(), _EXTEND, ptr, alloc_size, size, 0, 0, 0))
        return block

    def _clash(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """The segment or expandable reservation that [ptr, ptr + nbytes) overlaps, as
        (base, size); None when the range is disjoint from all of them."""
        segs = self._segments
        starts = self._seg_starts
        if len(starts) != len(segs):   # segments put in from outside (a rebuilt start)
            starts[:] = sorted(segs)
        i = bisect_left(starts, ptr)
        if i < len(starts) and starts[i] - ptr < nbytes:
            return starts[i], segs[starts[i]]
        if i and ptr - starts[i - 1] < segs[starts[i - 1]]:
            return starts[i - 1], segs[starts[i - 1]]
        if getattr(self._sub, "recorded_addresses", False):
            return None   # a replay's reservations are sized by an assumed device
        for es in self._expandable:
            if (0 <= ptr - es.base < es.size) or (0 <= es.base - ptr < nbytes):
                return es.base, es.size
        return None

    def _overlap_error(self, how: str, ptr: int, nbytes: int,
                       clash: tuple[int, int]) -> InvalidPointerError:
        return InvalidPointerError(
            f"{self._name}: the sub-allocator {how} {ptr:#x}..{ptr + nbytes:#x}, which "
            f"overlaps the range {clash[0]:#x}..{clash[0] + clash[1]:#x} it gave this "
            "allocator before; a device must hand out disjoint ranges (the new range went "
            "back to it)")

    def _release_block(self, block: _Block) -> None:
        """``release_block``: cudaFree of a whole free segment."""
        if block.es is not None:
            raise GpudashError(
                f"{self._name}: PyTorch fails here with an internal assert "
                "(TORCH_INTERNAL_ASSERT(!block->expandable_segment_) in release_block, "
                "pytorch/pytorch#123548): max_split_size_mb with expandable_segments:True "
                "released an expandable block under memory pressure. PyTorch does not "
                "support this combination; drop one of the two settings")
        st = self._stats
        st.num_device_free += 1
        pool = block.pool
        if self._history is not None:
            self._trace("segment_free", block.ptr, block.size, block.stream)
        journal = self._journal
        if journal is not None:
            journal.extend((now_ns(), _RELEASE, block.ptr, block.size, 0, 0, 0, 0))
        self._sub.free(block.ptr, block.size)
        self._reserved -= block.size
        _dec(st.pool["segment"], pool.index, 1)
        _dec(st.pool["reserved_bytes"], pool.index, block.size)
        mss = self._conf.max_split_size
        if mss is not None and block.size >= mss:
            _dec1(st.oversize_segments, 1)
        keys = pool.keys
        del keys[bisect_left(keys, _key(block))]
        del self._blocks[block.ptr]
        del self._segments[block.ptr]
        starts = self._seg_starts
        i = bisect_left(starts, block.ptr)
        if i < len(starts) and starts[i] == block.ptr:
            del starts[i]

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: release aged whole free large segments until
        ``total - threshold * allowed`` bytes are reclaimed (full passes)."""
        gc_threshold = int(self._conf.garbage_collection_threshold * self._allowed)
        if self._allowed > self._limit_floor:   # a threshold that scales with the limit
            self._limit_floor = self._allowed
        if self._reserved <= gc_threshold:
            return
        target = self._reserved - gc_threshold
        reclaimed = 0
        pool = self._large
        blocks = self._blocks
        total_age = 0.0
        freeable = 0
        for key in pool.keys:
            b = blocks[key & _MASK64]
            if b.prev is None and b.next is None:
                total_age += pool.calls - b.gc_base
                freeable += 1
        if freeable == 0:
            return
        freed = True
        while reclaimed < target and freed and freeable > 0:
            threshold = total_age / freeable
            freed = False
            for key in list(pool.keys):
                b = blocks.get(key & _MASK64)
                if b is None or b.prev is not None or b.next is not None or b.allocated:
                    continue
                age = pool.calls - b.gc_base
                if age >= threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    freeable -= 1
                    self._release_block(b)

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        """``release_available_cached_blocks``: free oversize cached blocks of this pool and
        stream, the smallest that covers the request, else from the largest down."""
        mss = self._conf.max_split_size
        if mss is None:
            return False
        target = max(size, mss)
        keys = pool.keys
        blocks = self._blocks
        i = bisect_left(keys, (stream << 128) | (target << 64))
        if i == len(keys) or keys[i] >> 128 != stream:
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < target:
                b = blocks[keys[i] & _MASK64]
                if b.size < mss or b.stream != stream:
                    break
                released += b.size
                self._release_block(b)   # removes keys[i]; the next one down is keys[i-1]
                if i == 0:
                    break
                i -= 1
            return released >= target
        self._release_block(blocks[keys[i] & _MASK64])
        return True

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks`` (``empty_cache``): every whole free segment back to the
        device, large pool first, then small; free pages of expandable segments unmapped."""
        self._stats.num_sync_all_streams += 1
        self._release_blocks(self._large)
        self._release_blocks(self._small)

    def _release_blocks(self, pool: _Pool) -> None:
        blocks = self._blocks
        to_unmap = []
        for key in list(pool.keys):
            b = blocks.get(key & _MASK64)
            if b is None:
                continue
            if b.es is not None:
                to_unmap.append(b)
            elif b.prev is None and b.next is None:
                self._release_block(b)
        for b in to_unmap:
            self._unmap_block(b)
            if b.prev is None and b.next is None:
                self._release_expandable_segment(b)

    def cached_releases(self) -> list[tuple[str, int, int]]:
        """What :meth:`empty_cache` would give back now, in its order, as PyTorch's trace
        entries ``(action, address, bytes)``: whole free segments (``segment_free``) and the
        whole free pages of expandable segments (``segment_unmap``), large pool first.
        Nothing changes."""
        out: list[tuple[str, int, int]] = []
        with self._lock:
            blocks = self._blocks
            for pool in (self._large, self._small):
                unmaps = []
                for key in pool.keys:
                    b = blocks[key & _MASK64]
                    if b.es is not None:
                        es = b.es
                        page = es.page
                        begin = (b.ptr - es.base + page - 1) // page
                        end = (b.ptr + b.size - es.base) // page
                        if begin < end:
                            unmaps.append(("segment_unmap", es.base + begin * page,
                                           (end - begin) * page))
                    elif b.prev is None and b.next is None:
                        out.append(("segment_free", b.ptr, b.size))
                out.extend(unmaps)
        return out

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: return every wholly free cached segment (and the free
        pages of expandable segments) to the device."""
        with self._lock:
            journal = self._journal
            start = len(journal) if journal is not None else 0
            self._release_cached_blocks()
            if journal is not None:
                self._after_op(start)

    def release_free_regions(self) -> int:
        """:meth:`empty_cache` under the name gpudash's views use; the bytes returned."""
        before = self._reserved
        self.empty_cache()
        return before - self._reserved

    # ------------------------------------------------------------------ expandable segments
    def _new_expandable(self, pool: _Pool, stream: int) -> _ExpandableSegment:
        page = K_SMALL_BUFFER if pool.is_small else K_LARGE_BUFFER
        total = self.device_total
        if total <= 0:
            raise BackendUnavailableError(
                f"{self._name}: expandable segments reserve 1 1/8 x the device's total memory, "
                "and this device does not say how much it has")
        max_pages = (total + total // 8 + page - 1) // page
        nbytes = max_pages * page
        reserve = getattr(self._sub, "reserve", None)
        if callable(reserve):
            base = int(reserve(nbytes))
            clash = self._clash(base, nbytes)
            if clash is not None:
                unreserve = getattr(self._sub, "unreserve", None)
                if callable(unreserve):
                    unreserve(base, nbytes)
                raise self._overlap_error("reserved", base, nbytes, clash)
        else:
            if getattr(self._sub, "kind", "") == "cuda":
                raise BackendUnavailableError(
                    f"{self._name}: expandable segments map pages with CUDA's virtual "
                    "memory API, which gpudash does not drive through CuPy; use "
                    "expandable_segments:False here, or a simulated device")
            base = self._va_next
            self._va_next += nbytes + (1 << 30)
        es = _ExpandableSegment(base, page, max_pages, stream, pool)
        self._expandable.append(es)
        return es

    def _map_pages(self, es: _ExpandableSegment, ptr: int, size: int) -> tuple[int, int]:
        """``ExpandableSegment::map``: whole pages over [ptr, ptr+size); (0, 0) when the
        device has no memory for them (the pages made by this call are given back)."""
        page = es.page
        begin = (ptr - es.base) // page
        end = (ptr + size - es.base + page - 1) // page
        handles = es.handles
        while len(handles) < end:
            handles.append(None)
        made = []
        create, release = self._page_calls()
        for i in range(begin, end):
            try:
                h = create(page)
            except MemoryError:
                h = None
            if not h:
                for j in made:
                    hj = handles[j]
                    handles[j] = None
                    release(hj, page)
                while handles and handles[-1] is None:
                    handles.pop()
                return 0, 0
            handles[i] = int(h)
            made.append(i)
        return es.base + begin * page, (end - begin) * page

    def _page_calls(self) -> tuple[Any, Any]:
        """cuMemCreate / cuMemRelease of one page: the sub-allocator's ``create_page`` /
        ``release_page`` when it has them, else its ``alloc`` / ``free``."""
        sub = self._sub
        create = getattr(sub, "create_page", None)
        release = getattr(sub, "release_page", None)
        if callable(create) and callable(release):
            return create, release
        return sub.alloc, sub.free

    def _unmap_pages(self, es: _ExpandableSegment, ptr: int, size: int) -> tuple[int, int]:
        """``ExpandableSegment::unmap``: the whole pages inside [ptr, ptr+size)."""
        page = es.page
        begin = (ptr - es.base + page - 1) // page
        end = (ptr + size - es.base) // page
        if begin >= end:
            return ptr, 0
        handles = es.handles
        release = self._page_calls()[1]
        for i in range(begin, end):
            h = handles[i]
            handles[i] = None
            release(h, page)
        while handles and handles[-1] is None:
            handles.pop()
        return es.base + begin * page, (end - begin) * page

    def _find_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block:
        blocks = self._blocks
        for key in pool.unmapped[bisect_left(pool.unmapped, stream << 64):]:
            if key >> 64 != stream:
                break
            c = blocks[key & _MASK64]
            p = c.prev
            if p is not None and not p.allocated:
                c = p
            b: _Block | None = c
            got = 0
            while got < size and b is not None and not b.allocated:
                got += b.size
                b = b.next
            if got >= size:
                return c
        es = self._new_expandable(pool, stream)
        cand = _Block(es.base, es.size, stream, pool, es, mapped=False)
        blocks[cand.ptr] = cand
        insort(pool.unmapped, (stream << 64) | cand.ptr)
        return cand

    def _map_block(self, to_map: _Block, size: int, rounded: int) -> bool:
        es = to_map.es
        mptr, msize = self._map_pages(es, to_map.ptr, size)
        if msize == 0:
            return False
        pool = to_map.pool
        un = pool.unmapped
        del un[bisect_left(un, (to_map.stream << 64) | to_map.ptr)]
        to_map.mapped = True
        journal = self._journal
        if msize < to_map.size:
            rest = _Block(to_map.ptr + msize, to_map.size - msize, to_map.stream, pool, es,
                          mapped=False)
            nxt = to_map.next
            rest.prev = to_map
            rest.next = nxt
            to_map.next = rest
            if nxt is not None:
                nxt.prev = rest
            self._blocks[rest.ptr] = rest
            insort(un, (rest.stream << 64) | rest.ptr)
            to_map.size = msize
        self._reserved += msize
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        st = self._stats
        _inc(st.pool["reserved_bytes"], pool.index, msize)
        st.num_device_alloc += 1
        if self._history is not None:
            self._trace("segment_map", mptr, msize, to_map.stream)
        if journal is not None:
            journal.extend((now_ns(), _EXTEND, mptr, msize, rounded, 0, 0, 0))
        # the new pages join free mapped neighbours (merge events say so)
        for merged in (self._try_merge(to_map, to_map.prev),
                       self._try_merge(to_map, to_map.next)):
            if merged and journal is not None:
                journal.extend((now_ns(), _MERGE, to_map.ptr, to_map.size, merged, 0, 0, 0))
        to_map.gc_base = pool.calls
        insort(pool.keys, _key(to_map))
        return True

    def _try_allocate_expandable(self, pool: _Pool, stream: int, size: int) -> _Block | None:
        cand = self._find_expandable_block(pool, stream, size)
        if not cand.mapped and not self._map_block(cand, min(cand.size, size), size):
            return None
        while cand.size < size:
            remaining = size - cand.size
            new = cand.next
            if not self._map_block(new, min(remaining, new.size), size):
                return None
            cand = new
        keys = pool.keys
        del keys[bisect_left(keys, _key(cand))]
        return cand

    def _unmap_block(self, block: _Block) -> None:
        es = block.es
        uptr, usize = self._unmap_pages(es, block.ptr, block.size)
        if usize == 0:
            return
        pool = block.pool
        keys = pool.keys
        blocks = self._blocks
        del keys[bisect_left(keys, _key(block))]
        del blocks[block.ptr]
        journal = self._journal
        before = uptr - block.ptr
        if before > 0:
            bf = _Block(block.ptr, before, block.stream, pool, es)
            bf.prev = block.prev
            if bf.prev is not None:
                bf.prev.next = bf
            bf.next = block
            block.prev = bf
            blocks[bf.ptr] = bf
            bf.gc_base = pool.calls
            insort(keys, _key(bf))
        after = block.size - (before + usize)
        if after > 0:
            af = _Block(uptr + usize, after, block.stream, pool, es)
            af.next = block.next
            if af.next is not None:
                af.next.prev = af
            af.prev = block
            block.next = af
            blocks[af.ptr] = af
            af.gc_base = pool.calls
            insort(keys, _key(af))
        block.ptr = uptr
        block.size = usize
        block.mapped = False
        blocks[uptr] = block
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        insort(pool.unmapped, (block.stream << 64) | block.ptr)
        self._reserved -= usize
        st = self._stats
        _dec(st.pool["reserved_bytes"], pool.index, usize)
        st.num_device_free += 1
        if self._history is not None:
            self._trace("segment_unmap", uptr, usize, block.stream)
        if journal is not None:
            journal.extend((now_ns(), _RELEASE, uptr, usize, 0, 0, 0, 0))

    def _release_expandable_segment(self, block: _Block) -> None:
        es = block.es
        assert block.size == es.size and not block.mapped, "block disagrees with segment"
        self._expandable.remove(es)
        un = block.pool.unmapped
        del un[bisect_left(un, (block.stream << 64) | block.ptr)]
        del self._blocks[block.ptr]
        unreserve = getattr(self._sub, "unreserve", None)
        if callable(unreserve):
            unreserve(es.base, es.size)

    # ------------------------------------------------------------------ merging
    def _try_merge(self, dst: _Block, src: _Block | None) -> int:
        """``try_merge_blocks``: absorb a free neighbour of the same mapped state."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        blocks = self._blocks
        pool = dst.pool
        if src.mapped:
            keys = pool.keys
            del keys[bisect_left(keys, _key(src))]
        else:
            un = pool.unmapped
            del un[bisect_left(un, (src.stream << 64) | src.ptr)]
        del blocks[src.ptr]
        if dst.prev is src:
            del blocks[dst.ptr]
            dst.ptr = src.ptr
            blocks[dst.ptr] = dst
            p = dst.prev = src.prev
            if p is not None:
                p.next = dst
        else:
            n = dst.next = src.next
            if n is not None:
                n.prev = dst
        size = src.size
        dst.size += size
        src.prev = src.next = src.es = None
        self._spare.append(src)
        return size

    # ------------------------------------------------------------------ free
    def deallocate(self, ptr: int) -> None:
        """``free``: the block goes back to its pool, merged with free neighbours (no memory
        returns to the device: that is :meth:`empty_cache`'s job, or pressure's). 0 is a
        no-op.

        Raises
        ------
        InvalidPointerError
            An address never allocated here, or already freed (PyTorch: "invalid device
            pointer").
        """
        if type(ptr) is not int or not ptr:
            if not ptr:
                import numbers

                if isinstance(ptr, numbers.Integral) and not isinstance(ptr, bool):
                    return  # nullptr: nothing to free, as in PyTorch
                raise InvalidPointerError(f"{self._name}: deallocate() expects an int "
                                          f"address; got {ptr!r}")
        with self._lock:
            b = self._blocks.get(ptr) if type(ptr) is int else self._lookup(ptr)
            if b is None or not b.allocated:
                raise self._invalid_pointer(ptr, "deallocate")
            journal = self._journal
            if journal is None:
                self._free(b)
                return
            start = len(journal)
            self._free(b)
            if start >= self._flush_at:
                self._after_op(start)

    def _lookup(self, ptr: Any) -> _Block | None:
        try:
            if isinstance(ptr, bool):
                return None
            import operator

            return self._blocks.get(operator.index(ptr))
        except TypeError:
            return None

    def _free(self, block: _Block) -> None:
        """``free`` then ``free_block``: uncount the block, merge it with free neighbours
        (the previous one first), cache it. The hot path: statistics written out."""
        stats = self._stats.pool
        pool = block.pool
        t = pool.index
        j = t << 2
        bsize = block.size
        ptr = block.ptr
        req = block.requested
        aid = block.aid
        block.allocated = False
        block.aid = -1
        # allocation -= 1, allocated_bytes -= bsize (free_requested)
        st = stats["allocation"]
        st[0] -= 1
        st[3] += 1
        st[j] -= 1
        st[j + 3] += 1
        st = stats["allocated_bytes"]
        st[0] -= bsize
        st[3] += bsize
        st[j] -= bsize
        st[j + 3] += bsize
        hist = self._history
        if hist is not None:
            self._trace("free_requested", ptr, req, block.stream)
        if bsize >= self._mss:
            _dec1(self._stats.oversize_allocations, 1)
        # free_block
        if hist is not None:
            self._trace("free_completed", ptr, req, block.stream)
        p, n = block.prev, block.next
        prev_size = next_size = 0
        if p is not None and not p.allocated and p.mapped:
            # try_merge_blocks(block, prev), written out: block takes prev's start
            keys = pool.keys
            del keys[bisect_left(keys, (p.stream << 128) | (p.size << 64) | p.ptr)]
            blocks = self._blocks
            del blocks[ptr]
            block.ptr = p.ptr
            blocks[p.ptr] = block
            pp = block.prev = p.prev
            if pp is not None:
                pp.next = block
            prev_size = p.size
            block.size += prev_size
            p.prev = p.next = p.es = None
            self._spare.append(p)
        if n is not None and not n.allocated and n.mapped:
            keys = pool.keys
            del keys[bisect_left(keys, (n.stream << 128) | (n.size << 64) | n.ptr)]
            del self._blocks[n.ptr]
            nn = block.next = n.next
            if nn is not None:
                nn.prev = block
            next_size = n.size
            block.size += next_size
            n.prev = n.next = n.es = None
            self._spare.append(n)
        block.gc_base = pool.calls
        insort(pool.keys, (block.stream << 128) | (block.size << 64) | block.ptr)
        if block.es is None:
            # inactive_split: free blocks of split segments (merged ones leave, this one
            # joins while the segment stays split)
            net_blocks = -(prev_size > 0) - (next_size > 0)
            net_bytes = -prev_size - next_size
            if block.prev is not None or block.next is not None:
                net_blocks += 1
                net_bytes += block.size
            if net_blocks > 0:
                _inc(stats["inactive_split"], t, net_blocks)
            elif net_blocks < 0:
                _dec(stats["inactive_split"], t, -net_blocks)
            if net_bytes > 0:
                _inc(stats["inactive_split_bytes"], t, net_bytes)
            elif net_bytes < 0:
                sb = stats["inactive_split_bytes"]
                sb[0] += net_bytes
                sb[3] -= net_bytes
                sb[j] += net_bytes
                sb[j + 3] -= net_bytes
        st = stats["requested_bytes"]  # requested_bytes -= req (free_completed)
        st[0] -= req
        st[3] += req
        st[j] -= req
        st[j + 3] += req
        journal = self._journal
        if journal is not None:
            journal.extend((now_ns(), _FREE, ptr, bsize, req, aid, next_size, prev_size))

    def _invalid_pointer(self, ptr: Any, what: str) -> InvalidPointerError:
        try:
            if isinstance(ptr, bool):
                raise TypeError
            import operator

            p = operator.index(ptr)
            shown = f"{p:#x}"
        except TypeError:
            return InvalidPointerError(f"{self._name}: {what}() expects an int address; "
                                       f"got {ptr!r}")
        b = self._blocks.get(p)
        if b is not None and not b.allocated:
            return InvalidPointerError(f"{self._name}: {what}({shown}): this address was "
                                       "already freed (double free?)")
        for base, size in self._segments.items():
            if base <= p < base + size:
                return InvalidPointerError(
                    f"{self._name}: {what}({shown}): not the start of an allocation (it lies "
                    f"inside segment {base:#x}); pass the address allocate() returned")
        return InvalidPointerError(f"{self._name}: {what}({shown}): invalid device pointer "
                                   "(this allocator never allocated that address)")

    # ------------------------------------------------------------------ queries
    def owns(self, ptr: int) -> bool:
        b = self._blocks.get(ptr)
        return b is not None and b.allocated

    def allocated_size(self, ptr: int) -> int:
        """The block's size (what ``allocated_bytes`` counts for it)."""
        with self._lock:
            b = self._blocks.get(ptr) if type(ptr) is int else self._lookup(ptr)
            if b is None or not b.allocated:
                raise self._invalid_pointer(ptr, "allocated_size")
            return b.size

    def requested_size(self, ptr: int) -> int:
        with self._lock:
            b = self._blocks.get(ptr) if type(ptr) is int else self._lookup(ptr)
            if b is None or not b.allocated:
                raise self._invalid_pointer(ptr, "requested_size")
            return b.requested

    def allocation_id(self, ptr: int) -> int:
        """gpudash's id of the allocation (from 1; PyTorch keeps none)."""
        with self._lock:
            b = self._blocks.get(ptr) if type(ptr) is int else self._lookup(ptr)
            if b is None or not b.allocated:
                raise self._invalid_pointer(ptr, "allocation_id")
            return b.aid

    # ------------------------------------------------------------------ out of memory
    def _oom(self, nbytes: int, size: int, alloc_size: int, stream: int,
             build: bool) -> OutOfMemoryError | None:
        st = self._stats
        device_free = self._device_free()
        if self._history is not None:
            self._history.append(("oom", device_free, size, stream, now_ns() // 1000))
        st.num_ooms += 1
        journal = self._journal
        if journal is not None:
            journal.extend((now_ns(), _OOM, 0, size, nbytes, 0, 0, 0))
        if not build:
            return None
        message = self.oom_message(alloc_size, device_free)
        return OutOfMemoryError(message, requested=nbytes, rounded=size,
                                allocator=self._name, memory_log=self._memory_summary())

    def oom_message(self, alloc_size: int, device_free: int | None = None) -> str:
        """PyTorch's out-of-memory message for a request of ``alloc_size`` (its segment size)
        now, in the wording of this allocator's PyTorch version."""
        allocated = self._stats.pool["allocated_bytes"][0]
        reserved = self._reserved
        total = self.device_total
        free = self._device_free() if device_free is None else device_free
        v = self._conf.version
        allowed = f"{format_size(self._allowed)} allowed; " if self._set_fraction else ""
        dev = self._device
        if v < (2, 1):
            head = (f"CUDA out of memory. Tried to allocate {format_size(alloc_size)} (GPU "
                    f"{dev}; {format_size(total)} total capacity; {format_size(allocated)} "
                    f"already allocated; {format_size(free)} free; {allowed}")
            if v < (1, 5):
                return head + f"{format_size(reserved - allocated)} cached)"
            text = head + f"{format_size(reserved)} reserved in total by PyTorch)"
            if v >= (1, 10):
                text += (" If reserved memory is >> allocated memory try setting "
                         "max_split_size_mb to avoid fragmentation.  See documentation for "
                         "Memory Management and PYTORCH_CUDA_ALLOC_CONF")
            return text
        capacity = "capacty" if v < (2, 2) else "capacity"
        text = (f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU {dev} "
                f"has a total {capacity} of {format_size(total)} of which {format_size(free)} "
                f"is free. {allowed if v >= (2, 4) else ''}Of the allocated memory "
                f"{format_size(allocated)} is allocated by PyTorch, and "
                f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated.")
        if v < (2, 2):
            return text + (" If reserved but unallocated memory is large try setting "
                           "max_split_size_mb to avoid fragmentation.  See documentation for "
                           "Memory Management and PYTORCH_CUDA_ALLOC_CONF")
        var = "PYTORCH_ALLOC_CONF" if v >= (2, 9) else "PYTORCH_CUDA_ALLOC_CONF"
        return text + (f" If reserved but unallocated memory is large try setting {var}="
                       "expandable_segments:True to avoid fragmentation.  See documentation "
                       "for Memory Management  (https://pytorch.org/docs/stable/notes/"
                       "cuda.html#environment-variables)")

    # ------------------------------------------------------------------ statistics
    def memory_stats(self) -> dict[str, int | float]:
        """``torch.cuda.memory_stats()``: PyTorch's keys and meanings
        (``allocated_bytes.all.current``, ``reserved_bytes.large_pool.peak``,
        ``num_alloc_retries``, ``num_ooms``...), sorted by key as PyTorch returns them."""
        with self._lock:
            return self._memory_stats()

    def _memory_stats(self) -> dict[str, int | float]:
        st = self._stats
        out: dict[str, int | float] = {}
        for name in _POOL_STATS:
            for ti, tname in enumerate(_STAT_TYPES):
                cur, peak, alloc, freed = st.get(name, ti)
                prefix = f"{name}.{tname}."
                out[prefix + "current"] = cur
                out[prefix + "peak"] = peak
                out[prefix + "allocated"] = alloc
                out[prefix + "freed"] = freed
        for name in ("oversize_allocations", "oversize_segments"):
            cur, peak, alloc, freed = getattr(st, name)
            out[f"{name}.current"] = cur
            out[f"{name}.peak"] = peak
            out[f"{name}.allocated"] = alloc
            out[f"{name}.freed"] = freed
        for name in ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                     "num_device_alloc", "num_device_free"):
            out[name] = getattr(st, name)
        mss = self._conf.max_split_size
        out["max_split_size"] = -1 if mss is None else mss
        return dict(sorted(out.items()))

    def reset_peak_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: every peak back to its current value."""
        with self._lock:
            st = self._stats
            for flat in (*st.pool.values(), st.oversize_allocations, st.oversize_segments):
                for j in range(0, len(flat), 4):
                    flat[j + 1] = flat[j]
            self._peak_reserved = self._reserved

    def reset_accumulated_stats(self) -> None:
        """``torch.cuda.reset_accumulated_memory_stats()``: the allocated/freed totals and
        the counters back to 0."""
        with self._lock:
            st = self._stats
            for flat in (*st.pool.values(), st.oversize_allocations, st.oversize_segments):
                for j in range(0, len(flat), 4):
                    flat[j + 2] = flat[j + 3] = 0
            st.num_alloc_retries = st.num_ooms = st.num_sync_all_streams = 0
            st.num_device_alloc = st.num_device_free = 0

    def _largest_free_block(self) -> int:
        """The largest free mapped block (keys sort by stream first: the last key of each
        stream's run is its largest; one stream is the common case)."""
        best = 0
        for pool in (self._small, self._large):
            keys = pool.keys
            if not keys:
                continue
            if keys[0] >> 128 == keys[-1] >> 128:
                s = (keys[-1] >> 64) & _MASK64
            else:
                s = max((k >> 64) & _MASK64 for k in keys)
            if s > best:
                best = s
        return best

    def stats(self) -> AllocatorStats:
        """gpudash's common figures, in the allocator-neutral names the views use:
        ``bytes_in_use`` = allocated bytes, ``pool_bytes`` = reserved bytes,
        ``bytes_limit`` = :attr:`memory_limit`, ``num_allocs`` = allocations made."""
        with self._lock:
            return self._stats_locked()

    def _stats_locked(self) -> AllocatorStats:
        st = self._stats.pool
        in_use = st["allocated_bytes"][0]
        largest_free = self._largest_free_block()
        free = self._reserved - in_use
        frag = (free - largest_free) / free if free > 0 else 0.0
        return AllocatorStats(
            num_allocs=st["allocation"][2], bytes_in_use=in_use,
            peak_bytes_in_use=st["allocated_bytes"][1],
            largest_alloc_size=self._largest, bytes_limit=self.memory_limit,
            pool_bytes=self._reserved, peak_pool_bytes=self._peak_reserved,
            largest_free_block_bytes=largest_free, fragmentation=frag)


    def clear_stats(self) -> None:
        """Peaks back to current values (gpudash's name for ``reset_peak_memory_stats``)."""
        self.reset_peak_stats()

    # ------------------------------------------------------------------ layout
    def _segment_heads(self) -> list[_Block]:
        """Lock held: the first block of every snapshot segment (a cudaMalloc segment, or a
        contiguous mapped range of an expandable one), by address."""
        blocks = self._blocks
        heads = [blocks[base] for base in self._segments]
        for es in self._expandable:
            b = blocks.get(es.base)
            while b is not None:
                if b.mapped and (b.prev is None or not b.prev.mapped):
                    heads.append(b)
                b = b.next
        heads.sort(key=lambda b: b.ptr)
        return heads

    def _region_table(self) -> tuple[list[int], list[int]]:
        ptrs, ends = [], []
        for h in self._segment_heads():
            end = h.ptr
            b: _Block | None = h
            while b is not None and b.mapped:
                end = b.ptr + b.size
                b = b.next
            ptrs.append(h.ptr)
            ends.append(end)
        return ptrs, ends

    def _region_at(self, ptr: int) -> int:
        for base, size in self._segments.items():
            if base <= ptr < base + size:
                return base
        for es in self._expandable:
            if es.base <= ptr < es.base + es.size:
                b = self._blocks.get(ptr)
                while b is not None and b.prev is not None and b.prev.mapped:
                    b = b.prev
                return b.ptr if b is not None else es.base
        return 0

    def segments(self) -> list[dict[str, Any]]:
        """The segments as PyTorch's snapshot lists them (``torch.cuda.memory_snapshot()``),
        by address: one per cudaMalloc segment, one per contiguous mapped range of an
        expandable segment."""
        with self._lock:
            return self._segment_dicts()

    def _segment_dicts(self) -> list[dict[str, Any]]:
        out = []
        for h in self._segment_heads():
            blocks = []
            total = allocated = active = requested = 0
            b: _Block | None = h
            addr = h.ptr
            while b is not None and b.mapped:
                state = "active_allocated" if b.allocated else "inactive"
                blocks.append({"address": addr, "size": b.size, "requested_size": b.requested,
                               "state": state, "frames": []})
                total += b.size
                if b.allocated:
                    allocated += b.size
                    active += b.size
                    requested += b.requested
                addr += b.size
                b = b.next
            out.append({
                "device": self._device, "address": h.ptr, "total_size": total,
                "allocated_size": allocated, "active_size": active,
                "requested_size": requested, "stream": h.stream,
                "segment_type": "small" if h.pool.is_small else "large",
                "segment_pool_id": (0, 0), "is_expandable": h.es is not None,
                "frames": [], "blocks": blocks})
        return out

    def snapshot(self) -> dict[str, Any]:
        """``torch.cuda.memory._snapshot()``: ``segments``, ``device_traces`` (PyTorch's
        trace entries while :meth:`record_history` is on; taking a snapshot adds a
        ``snapshot`` entry, as in PyTorch), ``allocator_settings`` and
        ``external_annotations``. Pickle it (protocol 4) or save it as JSON and MemoryViz
        (pytorch.org/memory_viz) opens it."""
        with self._lock:
            segs = self._segment_dicts()
            if self._history is not None:
                active = sum(s["active_size"] for s in segs)
                self._history.append(("snapshot", 0, active, 0, now_ns() // 1000))
            traces: list[list[dict]] = [[] for _ in range(self._device + 1)]
            for action, addr, size, stream, t_us in (self._history or ()):
                entry = {"action": action, "size": size, "stream": stream, "time_us": t_us,
                         "frames": [], "compile_context": "N/A", "user_metadata": ""}
                entry["device_free" if action == "oom" else "addr"] = addr
                traces[self._device].append(entry)
            return {"segments": segs, "device_traces": traces,
                    "allocator_settings": self._conf.snapshot_settings(),
                    "external_annotations": []}

    def chunk_table(self) -> dict[str, Any]:
        """Every mapped block as numpy columns, by address (the layout gpudash's views draw):
        ``ptr``, ``size``, ``requested``, ``alloc_id``, ``bin`` (the pool: 0 small, 1
        large), ``region`` (the segment's address), ``in_use``, ``expandable``, and
        ``regions`` ((ptr, size) of every segment, as :meth:`segments` lists them)."""
        import numpy as np

        with self._lock:
            ptr, size, req, aid, pool, region, used, exp = [], [], [], [], [], [], [], []
            regions = []
            for h in self._segment_heads():
                b: _Block | None = h
                start = h.ptr
                while b is not None and b.mapped:
                    ptr.append(b.ptr)
                    size.append(b.size)
                    req.append(b.requested if b.allocated else 0)
                    aid.append(b.aid if b.allocated else -1)
                    pool.append(0 if b.pool.is_small else 1)
                    region.append(start)
                    used.append(b.allocated)
                    exp.append(b.es is not None)
                    end = b.ptr + b.size
                    b = b.next
                regions.append((start, end - start))
        i64 = np.int64
        return {"ptr": np.array(ptr, dtype=i64), "size": np.array(size, dtype=i64),
                "requested": np.array(req, dtype=i64), "alloc_id": np.array(aid, dtype=i64),
                "bin": np.array(pool, dtype=np.int8), "region": np.array(region, dtype=i64),
                "in_use": np.array(used, dtype=bool), "expandable": np.array(exp, dtype=bool),
                "regions": np.array(regions, dtype=i64).reshape(-1, 2)}

    def memory_dump(self) -> Any:
        """The state as gpudash's neutral :class:`~gpudash.MemoryDump` (what the report and
        the views draw for either allocator): every mapped block as a chunk (``bin``: its
        pool, 0 small, 1 large; -1 in use), every snapshot segment as a region, and two
        summaries in place of TensorFlow's bins, the small and the large pool
        (``extra["layout"] == "pools"``)."""
        with self._lock:
            chunks = []
            regions = []
            pools = [[0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]]
            handle = 0
            for h in self._segment_heads():
                b: _Block | None = h
                start = h.ptr
                end = start
                while b is not None and b.mapped:
                    p = 0 if b.pool.is_small else 1
                    agg = pools[p]
                    agg[1] += b.size
                    agg[3] += 1
                    if b.allocated:
                        agg[0] += b.size
                        agg[2] += 1
                        agg[4] += b.requested
                    else:
                        agg[5] += 1
                        agg[6] += b.size
                    chunks.append(MemChunk(address=b.ptr, size=b.size,
                                           requested_size=b.requested if b.allocated else 0,
                                           bin=-1 if b.allocated else p, in_use=b.allocated,
                                           allocation_id=b.aid if b.allocated else -1,
                                           region=start, handle=handle))
                    handle += 1
                    end = b.ptr + b.size
                    b = b.next
                regions.append(RegionInfo(start, end - start))
            bins = [BinSummary(bin=p, bin_size=K_SMALL_SIZE if p == 0 else K_SMALL_SIZE + 1,
                               total_bytes_in_use=a[0], total_bytes_in_bin=a[1],
                               total_chunks_in_use=a[2], total_chunks_in_bin=a[3],
                               total_requested_bytes_in_use=a[4], free_chunks=a[5],
                               free_bytes=a[6]) for p, a in enumerate(pools)]
            stats = self._stats_locked()
            return MemoryDump(self._name, stats, bins, chunks, regions,
                              memory_limit=self.memory_limit, seq=self._seq_now(),
                              extra={"layout": "pools", "allocator": "torch",
                                     "pools": ["small pool (requests up to 1 MiB)",
                                               "large pool"]})

    def memory_summary(self) -> str:
        """``torch.cuda.memory_summary()``'s table of these statistics."""
        with self._lock:
            return self._memory_summary()

    def _memory_summary(self) -> str:
        stats = self._memory_stats()

        def fmt_size(sz: int, pref: float) -> str:
            prefixes = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"]
            prefix = prefixes[0]
            for new in prefixes[1:]:
                if pref < 768 * 1024:
                    break
                prefix = new
                sz //= 1024
                pref /= 1024
            return f"{sz:6d} {prefix}"

        def fmt_count(cnt: int, pref: float) -> str:
            prefixes = [" ", "K", "M"]
            prefix = prefixes[0]
            for new in prefixes[1:]:
                if pref < 750 * 1000:
                    break
                prefix = new
                cnt //= 1000
                pref /= 1000
            return f"{cnt:7d} {prefix} "

        lines = ["=" * 75,
                 f" {'':16} PyTorch CUDA memory summary, device ID {self._device:<17d} ",
                 "-" * 75,
                 f"  {'':9} CUDA OOMs: {stats['num_ooms']:<12d} | {'':6} cudaMalloc retries: "
                 f"{stats['num_alloc_retries']:<8d}  ",
                 "=" * 75,
                 "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
        rows = [("allocated_bytes", "Allocated memory", fmt_size),
                ("active_bytes", "Active memory", fmt_size),
                ("requested_bytes", "Requested memory", fmt_size),
                ("reserved_bytes", "GPU reserved memory", fmt_size),
                ("inactive_split_bytes", "Non-releasable memory", fmt_size),
                ("allocation", "Allocations", fmt_count),
                ("active", "Active allocs", fmt_count),
                ("segment", "GPU reserved segments", fmt_count),
                ("inactive_split", "Non-releasable allocs", fmt_count)]
        for key, label, fmt in rows:
            lines.append("-" * 75)
            prefs = None
            for sub, sub_label in (("all", label), ("large_pool", "      from large pool"),
                                   ("small_pool", "      from small pool")):
                vals = [stats[f"{key}.{sub}.{m}"] for m in ("current", "peak", "allocated",
                                                            "freed")]
                if prefs is None:
                    prefs = vals
                lines.append(f" {sub_label:<21} | " + " | ".join(
                    fmt(v, p) for v, p in zip(vals, prefs)) + " ")
        for key, label in (("oversize_allocations", "Oversize allocations"),
                           ("oversize_segments", "Oversize GPU segments")):
            lines.append("-" * 75)
            vals = [stats[f"{key}.{m}"] for m in ("current", "peak", "allocated", "freed")]
            lines.append(f" {label:<21} | " + " | ".join(fmt_count(v, v) for v in vals) + " ")
        lines.append("=" * 75)
        return "|" + "|\n|".join(lines) + "|\n"

    def dump_memory_log(self, num_bytes: int = 0) -> str:
        """The text a person reads at an out-of-memory error: PyTorch's memory summary."""
        return self.memory_summary()

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Assert every invariant of the state; the message names the broken one.

        Segments tiled by their blocks with consistent links; no two adjacent free blocks of
        the same mapped state; every free mapped block in its pool's sorted key list exactly
        once, every unmapped stretch in the unmapped list; the address table holds exactly
        the blocks; expandable pages mapped exactly under mapped blocks; reserved bytes and
        the statistics add up."""
        with self._lock:
            try:
                self._check()
            except AssertionError as exc:
                raise AssertionError(f"{self._name}: invariant broken: {exc}") from None

    def _check(self) -> None:
        blocks = self._blocks
        seen: set[int] = set()
        keys = {True: set(), False: set()}
        unmapped = {True: set(), False: set()}
        alloc_bytes = [0, 0, 0]
        alloc_count = [0, 0, 0]
        requested = [0, 0, 0]
        reserved = [0, 0, 0]
        split_bytes = [0, 0, 0]
        split_count = [0, 0, 0]
        n_segments = [0, 0, 0]

        def walk(head: _Block, end: int, es: _ExpandableSegment | None) -> None:
            assert head.prev is None, f"first block {head.ptr:#x} has a prev"
            b: _Block | None = head
            expect = head.ptr
            prev = None
            while b is not None:
                assert b.ptr == expect, f"gap or overlap at {expect:#x} (block at {b.ptr:#x})"
                assert b.size > 0, f"block {b.ptr:#x} has size {b.size}"
                assert blocks.get(b.ptr) is b, f"block {b.ptr:#x} missing from the table"
                assert b.ptr not in seen, f"block {b.ptr:#x} seen twice"
                assert b.es is es, f"block {b.ptr:#x} names the wrong expandable segment"
                seen.add(b.ptr)
                if b.next is not None:
                    assert b.next.prev is b, f"broken back link after {b.ptr:#x}"
                t = b.pool.index
                if b.allocated:
                    assert b.mapped, f"allocated block {b.ptr:#x} is unmapped"
                    assert 0 < b.requested <= b.size, f"block {b.ptr:#x} requested " \
                                                      f"{b.requested}"
                    for k in (0, t):
                        alloc_bytes[k] += b.size
                        alloc_count[k] += 1
                        requested[k] += b.requested
                elif b.mapped:
                    keys[b.pool.is_small].add(_key(b))
                    if es is None and (b.prev is not None or b.next is not None):
                        for k in (0, t):
                            split_bytes[k] += b.size
                            split_count[k] += 1
                else:
                    unmapped[b.pool.is_small].add((b.stream << 64) | b.ptr)
                if prev is not None and not prev.allocated and not b.allocated:
                    assert prev.mapped != b.mapped, (
                        f"adjacent free blocks at {prev.ptr:#x} and {b.ptr:#x} not merged")
                if b.mapped:
                    for k in (0, t):
                        reserved[k] += b.size
                    if es is not None:
                        first = (b.ptr - es.base) // es.page
                        last = (b.ptr + b.size - es.base) // es.page
                        for i in range(first, last):
                            assert i < len(es.handles) and es.handles[i] is not None, (
                                f"block {b.ptr:#x} covers an unmapped page {i}")
                elif es is not None:
                    assert (b.ptr - es.base) % es.page == 0 and b.size % es.page == 0, (
                        f"unmapped stretch {b.ptr:#x}+{b.size} is not whole pages")
                    for i in range((b.ptr - es.base) // es.page,
                                   min(len(es.handles), (b.ptr + b.size - es.base) // es.page)):
                        assert es.handles[i] is None, (
                            f"unmapped stretch {b.ptr:#x} has a mapped page {i}")
                expect += b.size
                prev = b
                b = b.next
            assert expect == end, f"blocks of segment {head.ptr:#x} end at {expect:#x}, " \
                                  f"not {end:#x}"

        for base, size in self._segments.items():
            head = blocks.get(base)
            assert head is not None, f"segment {base:#x} has no first block"
            assert head.es is None, f"segment {base:#x} starts with an expandable block"
            walk(head, base + size, None)
            n_segments[0] += 1
            n_segments[head.pool.index] += 1
        for es in self._expandable:
            head = blocks.get(es.base)
            assert head is not None, f"expandable segment {es.base:#x} has no first block"
            walk(head, es.base + es.size, es)
        assert len(seen) == len(blocks), "the address table holds blocks outside every segment"
        for pool in (self._small, self._large):
            assert pool.keys == sorted(pool.keys), "a pool is not in (stream, size, address) " \
                                                   "order"
            assert len(set(pool.keys)) == len(pool.keys), "a block is in its pool twice"
            assert set(pool.keys) == keys[pool.is_small], (
                f"the {'small' if pool.is_small else 'large'} pool and its free blocks differ")
            assert pool.unmapped == sorted(pool.unmapped), "unmapped list out of order"
            assert set(pool.unmapped) == unmapped[pool.is_small], (
                "unmapped list and unmapped stretches differ")
        st = self._stats.pool
        assert reserved[0] == self._reserved, f"reserved bytes {self._reserved} != sum of " \
                                              f"segments {reserved[0]}"
        for k in range(3):
            j = 4 * k
            assert st["reserved_bytes"][j] == reserved[k], f"reserved_bytes[{k}]"
            assert st["allocated_bytes"][j] == alloc_bytes[k], f"allocated_bytes[{k}]"
            assert st["allocation"][j] == alloc_count[k], f"allocation[{k}]"
            assert st["requested_bytes"][j] == requested[k], f"requested_bytes[{k}]"
            assert st["inactive_split_bytes"][j] == split_bytes[k], (
                f"inactive_split_bytes[{k}] {st['inactive_split_bytes'][j]} != "
                f"{split_bytes[k]}")
            assert st["inactive_split"][j] == split_count[k], f"inactive_split[{k}]"
            assert st["segment"][j] == n_segments[k], f"segment[{k}]"
            for name, flat in st.items():
                assert flat[j + 1] >= flat[j], f"{name} peak below current"
        assert not self._set_fraction or self._allowed >= 0
        assert (not self._set_fraction or 0 <= self._limit_floor <= self._allowed
                or self._limit_floor == sys.maxsize), (
            f"limit floor {self._limit_floor} above the limit {self._allowed}")

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Return every segment and page to the device; the allocator is empty afterwards
        (memory still allocated is dropped with its segment)."""
        with self._lock:
            for b in list(self._blocks.values()):
                if b.allocated:
                    self._free(b)
            self._release_cached_blocks()
        self.flush_events()


#: PyTorch's caching allocator, the class gpudash uses: where the compiled core runs
#: (gpudash._accel), ``class CachingAllocator(CachingCore, PyCachingAllocator)`` built by
#: ``gpudash._core.bind_caching_allocator``, whose ``CachingCore`` (``_csrc/caching.pxi``)
#: replaces the methods that change the state (``gpudash._accel.TWINS`` says where each
#: lives); else :class:`PyCachingAllocator` above, the pure-Python model and readable
#: reference.
CachingAllocator = twin(
    "bind_caching_allocator", PyCachingAllocator,
    stats=_Stats, block=_Block, pool=_Pool, expandable_segment=_ExpandableSegment,
    stream_of=_stream_of, stat_types=_STAT_TYPES,
    constants={"K_MIN_BLOCK_SIZE": K_MIN_BLOCK_SIZE, "K_SMALL_SIZE": K_SMALL_SIZE,
               "K_SMALL_BUFFER": K_SMALL_BUFFER, "K_LARGE_BUFFER": K_LARGE_BUFFER,
               "K_MIN_LARGE_ALLOC": K_MIN_LARGE_ALLOC, "K_ROUND_LARGE": K_ROUND_LARGE,
               "K_ONE_EXA": K_ONE_EXA})
