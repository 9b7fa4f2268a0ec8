"""Sub-allocators: where the BFC allocator gets its regions from.

A sub-allocator is any object with two methods (:class:`SubAllocator`)::

    alloc(nbytes) -> int        # an address; raises MemoryError when it cannot
    free(ptr, nbytes) -> None   # the same ptr and nbytes that alloc saw

The BFC allocator calls them for whole regions (MiB to GiB), never for single tensors. Three
come with gpudash:

- :class:`SimulatedDevice`: virtual addresses with no memory behind them, a capacity that is
  enforced, deterministic placement. The default backend when there is no GPU.
- :class:`HostMemory`: real host memory (numpy buffers), so BFC allocations can be viewed as
  numpy arrays.
- :class:`CudaMemory`: device memory through CuPy (``cudaMalloc``, managed or pinned host).

:func:`cuda_device_count` and :meth:`CudaMemory.available` probe CUDA once and never raise.
"""

from __future__ import annotations

import bisect
import math
import os
import threading
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._accel import twin
from ._errors import BackendUnavailableError, ConfigError, InvalidPointerError
from ._units import format_bytes, parse_bytes

__all__ = [
    "CudaMemory",
    "HostMemory",
    "SimulatedDevice",
    "SubAllocator",
    "cuda_device_count",
]


@runtime_checkable
class SubAllocator(Protocol):
    """What the BFC allocator needs from a memory source."""

    def alloc(self, nbytes: int) -> int:
        """Return the address of ``nbytes`` new bytes; raise ``MemoryError`` when impossible."""
        ...

    def free(self, ptr: int, nbytes: int) -> None:
        """Give back a block that :meth:`alloc` returned, with the same size."""
        ...


def _check_nbytes(nbytes: object) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive integer; got {nbytes!r}")
    return int(nbytes)


def _check_cc(cc: object) -> tuple[int, int]:
    """``compute_capability`` as ``(major, minor)`` of small non-negative ints."""
    try:
        major, minor = cc  # type: ignore[misc]
        ok = all(not isinstance(v, bool) and isinstance(v, (int, np.integer)) and 0 <= v < 1000
                 for v in (major, minor))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"SimulatedDevice compute_capability must be (major, minor) integers "
                          f"such as (8, 0); got {cc!r}")
    return int(major), int(minor)


def _align_up(x: int, alignment: int) -> int:
    return (x + alignment - 1) & -alignment


class _BlockTable:
    """Live blocks of one sub-allocator: ptr -> size, with the pointers kept sorted.
    ``version`` counts the changes (a reader's cache of the layout is good while it is
    the same)."""

    __slots__ = ("ptrs", "sizes", "used", "version")

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.ptrs: list[int] = []
        self.used = 0
        self.version = 0

    def add(self, ptr: int, nbytes: int) -> None:
        self.sizes[ptr] = nbytes
        bisect.insort(self.ptrs, ptr)
        self.used += nbytes
        self.version += 1

    def remove(self, owner: str, ptr: int, nbytes: int) -> None:
        try:
            size = self.sizes.get(ptr)
        except TypeError:  # unhashable
            size = None
        if size is None:
            shown = f"{ptr:#x}" if isinstance(ptr, (int, np.integer)) else repr(ptr)
            raise InvalidPointerError(
                f"{owner}: free of {shown}, which is not a live block of this device "
                "(never allocated here, or already freed)"
            )
        if size != nbytes:
            raise ValueError(
                f"{owner}: free of {ptr:#x} with nbytes={nbytes}, but the block was "
                f"allocated with {size} bytes"
            )
        del self.sizes[ptr]
        del self.ptrs[bisect.bisect_left(self.ptrs, ptr)]
        self.used -= size
        self.version += 1

    def containing(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """The block (ptr, size) holding ``[addr, addr + nbytes)``, or None."""
        i = bisect.bisect_right(self.ptrs, addr) - 1
        if i < 0:
            return None
        ptr = self.ptrs[i]
        size = self.sizes[ptr]
        if addr + nbytes <= ptr + size:
            return ptr, size
        return None

    def items(self) -> list[tuple[int, int]]:
        sizes = self.sizes
        return [(p, sizes[p]) for p in self.ptrs]

    def clear(self) -> None:
        self.sizes.clear()
        self.ptrs.clear()
        self.used = 0
        self.version += 1

    def __len__(self) -> int:
        return len(self.ptrs)


#: Addresses a simulated device hands out stay below this (a placement that would pass it
#: is refused, as if the address space were full): both tables keep addresses in int64.
ADDRESS_END = 1 << 62


class _FirstFitTable(_BlockTable):
    """A :class:`SimulatedDevice`'s live blocks and where the next one goes: first fit from
    ``first``, every block on an ``alignment`` boundary, refused when the live blocks plus
    ``extra`` plus the request would pass ``limit``.

    This is the readable reference. The compiled core's ``FirstFit`` places blocks the same
    way, block for block (``tests/test_core_diff.py``), and the compiled PyTorch model calls
    it without Python for each new segment. ``placed`` and ``removed`` count the blocks that
    :meth:`place` made and :meth:`remove` took back (not :meth:`add`'s copies)."""

    __slots__ = ("first", "alignment", "limit", "extra", "placed", "removed", "_fit")

    def __init__(self, first: int, alignment: int, limit: int) -> None:
        super().__init__()
        self.first = first
        self.alignment = alignment
        self.limit = limit
        self.extra = 0     # bytes held outside the blocks that count against the limit
        self.placed = 0
        self.removed = 0
        # (version, widest gap, end): the first-fit scan's summary of the blocks while
        # they stay as they were: no request wider than the widest gap between them fits
        # before the end, the cursor after the last block
        self._fit: tuple[int, int, int] | None = None

    def place(self, nbytes: int) -> int:
        """The address of a new block of ``nbytes`` (> 0), now live; 0 when it does not fit
        under the limit (or the address space)."""
        if self.used + self.extra + nbytes > self.limit:
            return 0
        align = self.alignment
        fit = self._fit
        if fit is None or fit[0] != self.version:
            fit = self._survey()
        if nbytes > fit[1]:
            # no gap is wide enough: the first fit is past the last block, and a block
            # there leaves no gap before it
            cursor = fit[2]
            if cursor + nbytes > ADDRESS_END:
                return 0
            self.add(cursor, nbytes)
            self._fit = (self.version, fit[1], _align_up(cursor + nbytes, align))
        else:
            cursor = self.first
            sizes = self.sizes
            for ptr in self.ptrs:
                if ptr - cursor >= nbytes:
                    break
                cursor = max(cursor, _align_up(ptr + sizes[ptr], align))
            self.add(cursor, nbytes)
        self.placed += 1
        return cursor

    def remove(self, owner: str, ptr: int, nbytes: int) -> None:
        super().remove(owner, ptr, nbytes)
        self.removed += 1

    def _survey(self) -> tuple[int, int, int]:
        """The first-fit scan over every block: (version, widest gap, end)."""
        align = self.alignment
        cursor = self.first
        sizes = self.sizes
        widest = 0
        for ptr in self.ptrs:
            if ptr - cursor > widest:
                widest = ptr - cursor
            cursor = max(cursor, _align_up(ptr + sizes[ptr], align))
        self._fit = (self.version, widest, cursor)
        return self._fit


# --------------------------------------------------------------------------------------------


class SimulatedDevice:
    """A GPU that exists only as an address space: no memory behind the addresses.

    Placement is first fit from ``base``: every block starts on an ``alignment`` boundary at
    the lowest address where it fits between the live blocks, so the same sequence of calls
    always gives the same addresses, and freeing a block and allocating the same size again
    gives the same address back. Addresses are never 0.

    The exact bytes requested count toward :attr:`used` (alignment gaps do not), and the sum of
    live blocks may not exceed :attr:`total`.

    Parameters
    ----------
    capacity : int or str
        Device memory in bytes (``16 << 30`` or ``"16GiB"``); must be > 0.
    name : str, optional
        Name in messages; default ``"sim<index>"``.
    index : int, default 0
        Device index; also spreads default bases 1 TiB apart.
    base : int, optional
        First address; default ``0x7F0000000000 + index * (1 << 40)``. Must be > 0; blocks
        start at the first aligned address at or above it.
    alignment : int, default 2 MiB
        Alignment of every block address (a power of two).
    unified : bool, default False
        Simulate CUDA unified (managed) memory: live blocks may add up to twice the capacity,
        as TensorFlow's ``per_process_gpu_memory_fraction > 1`` oversubscribes. The real limit
        of managed memory is host RAM; 2x is gpudash's fixed stand-in.
    compute_capability : tuple of int, default (8, 0)
        Reported compute capability (TensorFlow's memory limit depends on the major).

    Examples
    --------
    >>> dev = SimulatedDevice("1GiB")
    >>> p = dev.alloc(1000)
    >>> hex(p), dev.used
    ('0x7f0000000000', 1000)
    >>> hex(dev.alloc(1000))
    '0x7f0000200000'
    >>> dev.free(p, 1000); dev.alloc(1000) == p
    True
    """

    kind = "simulated"

    def __init__(self, capacity: int | str, name: str | None = None, *, index: int = 0,
                 base: int | None = None, alignment: int = 2 << 20, unified: bool = False,
                 compute_capability: tuple[int, int] = (8, 0)) -> None:
        capacity = parse_bytes(capacity, name="SimulatedDevice capacity")
        if capacity <= 0:
            raise ConfigError(f"SimulatedDevice capacity must be > 0 bytes; got {capacity}")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ConfigError(f"SimulatedDevice index must be an integer >= 0; got {index!r}")
        if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0
                or alignment & (alignment - 1)):
            raise ConfigError(
                f"SimulatedDevice alignment must be a power of two; got {alignment!r}"
            )
        if base is None:
            base = 0x7F0000000000 + index * (1 << 40)
        if isinstance(base, bool) or not isinstance(base, int) or base <= 0:
            raise ConfigError(f"SimulatedDevice base must be an integer > 0; got {base!r}")
        self.capacity = capacity
        self.name = f"sim{index}" if name is None else str(name)
        self.index = index
        self.base = base
        self.alignment = alignment
        self.unified = bool(unified)
        self.compute_capability = _check_cc(compute_capability)
        self._first = _align_up(base, alignment)
        limit = capacity * 2 if self.unified else capacity
        table = _FirstFitTable
        if self._first < ADDRESS_END and limit < ADDRESS_END:
            table = twin("FirstFit", _FirstFitTable)
        self._blocks = table(self._first, alignment, limit)
        self._lock = threading.Lock()

    # -- the sub-allocator interface ----------------------------------------------------------

    def alloc(self, nbytes: int) -> int:
        """Reserve ``nbytes`` and return the block's address.

        Raises
        ------
        MemoryError
            When the live blocks plus ``nbytes`` would exceed the capacity (twice it when
            ``unified``). The message names the device, the request, the bytes used and the
            capacity. (Also when the block would end past address ``1 << 62``, which no
            realistic sequence of calls reaches.)
        ValueError
            If ``nbytes`` is not a positive integer.
        """
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = _check_nbytes(nbytes)
        with self._lock:
            ptr = self._blocks.place(nbytes)
            if ptr:
                return ptr
            raise MemoryError(self._refusal(nbytes))

    def _refusal(self, nbytes: int) -> str:
        """Why a request of ``nbytes`` was refused, by the state now."""
        blocks = self._blocks
        limit = blocks.limit
        used = blocks.used + blocks.extra
        if used + nbytes > limit:
            extra = " (unified memory: up to 2x capacity)" if self.unified else ""
            return (f"{self.name}: cannot allocate {format_bytes(nbytes)} ({nbytes} bytes): "
                    f"{used} bytes used of {self.capacity} bytes capacity"
                    f"{extra}, {limit - used} bytes left")
        return (f"{self.name}: cannot allocate {format_bytes(nbytes)} ({nbytes} bytes) "
                f"past the end of its address space ({ADDRESS_END:#x})")

    @property
    def _placement(self) -> Any:
        """The compiled block table, for the compiled allocators to place and free blocks
        without Python; None on the pure-Python path, or when a subclass places blocks its
        own way."""
        cls = type(self)
        if (type(self._blocks) is _FirstFitTable or cls.alloc is not SimulatedDevice.alloc
                or cls.free is not SimulatedDevice.free):
            return None
        return self._blocks

    def free(self, ptr: int, nbytes: int) -> None:
        """Release a block returned by :meth:`alloc`.

        Raises
        ------
        InvalidPointerError
            (a ``ValueError``) if ``ptr`` is not a live block.
        ValueError
            If ``nbytes`` differs from the size it was allocated with.
        """
        with self._lock:
            self._blocks.remove(self.name, ptr, nbytes)

    # -- introspection ------------------------------------------------------------------------

    @property
    def total(self) -> int:
        """Capacity in bytes."""
        return self.capacity

    @property
    def used(self) -> int:
        """Bytes in live blocks (exact requested sizes)."""
        return self._blocks.used

    @property
    def available(self) -> int:
        """Bytes left before the capacity (0 when unified memory oversubscribes)."""
        return max(0, self.capacity - self._blocks.used)

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)``, like ``cudaMemGetInfo``."""
        with self._lock:
            return max(0, self.capacity - self._blocks.used), self.capacity

    def blocks(self) -> list[tuple[int, int]]:
        """Live blocks as ``(ptr, size)``, by address."""
        with self._lock:
            return self._blocks.items()

    def reset(self) -> None:
        """Forget every block (as if the process restarted)."""
        with self._lock:
            self._blocks.clear()

    def check(self) -> None:
        """Assert the invariants: aligned, in order, non-overlapping, totals add up."""
        with self._lock:
            items = self._blocks.items()
            end = self._first
            total = 0
            for ptr, size in items:
                assert ptr % self.alignment == 0, (hex(ptr), items)
                assert ptr >= end, ("overlap", hex(ptr), items)
                assert size > 0, items
                end = ptr + size
                total += size
            assert total == self._blocks.used, (total, self._blocks.used)
            assert total <= self.capacity * (2 if self.unified else 1), (total, self.capacity)

    def __repr__(self) -> str:
        unified = ", unified" if self.unified else ""
        return (f"SimulatedDevice({self.name!r}, {format_bytes(self.capacity)}, "
                f"used={format_bytes(self.used)}, blocks={len(self._blocks)}{unified})")


# --------------------------------------------------------------------------------------------


def _host_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 0


def _host_available() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class HostMemory:
    """Real host memory: every block is a zero-filled numpy buffer, 256-byte aligned.

    Use it to run the BFC allocator over memory that exists, and to look at allocations as
    numpy arrays with :meth:`view` / :meth:`array` (a BFC chunk pointer lies inside one of the
    regions this object handed out).

    Parameters
    ----------
    capacity : int or str, optional
        Most bytes live at once; None (default) for no limit but the machine's.
    name : str, default "host"
        Name in messages.

    Notes
    -----
    Arrays returned by :meth:`view` keep their buffer alive: after :meth:`free` they still
    read valid (stale) memory rather than crashing.

    Examples
    --------
    >>> host = HostMemory()
    >>> p = host.alloc(4096)
    >>> a = host.array(p + 256, (4,), np.float32)
    >>> a[:] = 1.5
    >>> float(host.view(p + 256, 16, np.float32).sum())
    6.0
    """

    kind = "host"
    ALIGNMENT = 256
    index = 0
    compute_capability = None

    def __init__(self, capacity: int | str | None = None, name: str = "host") -> None:
        if capacity is not None:
            capacity = parse_bytes(capacity, name="HostMemory capacity")
        self.capacity = capacity
        self.name = name
        self._blocks = _BlockTable()
        self._buffers: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` of zeroed host memory; return its address.

        Raises
        ------
        MemoryError
            Beyond ``capacity``, or when the machine has no memory left.
        """
        nbytes = _check_nbytes(nbytes)
        with self._lock:
            used = self._blocks.used
            if self.capacity is not None and used + nbytes > self.capacity:
                raise MemoryError(
                    f"{self.name}: cannot allocate {format_bytes(nbytes)} ({nbytes} bytes): "
                    f"{used} bytes used of {self.capacity} bytes capacity"
                )
            try:
                raw = np.zeros(nbytes + self.ALIGNMENT - 1, dtype=np.uint8)
            except MemoryError as exc:
                raise MemoryError(
                    f"{self.name}: cannot allocate {format_bytes(nbytes)} ({nbytes} bytes) "
                    f"of host memory: {exc}"
                ) from exc
            offset = -raw.ctypes.data % self.ALIGNMENT
            buf = raw[offset:offset + nbytes]
            ptr = buf.ctypes.data
            self._blocks.add(ptr, nbytes)
            self._buffers[ptr] = buf
            return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        """Release a block (its buffer is dropped; views of it stay valid)."""
        with self._lock:
            self._blocks.remove(self.name, ptr, nbytes)
            del self._buffers[ptr]

    def view(self, ptr: int, nbytes: int, dtype: Any = np.uint8, offset: int = 0) -> np.ndarray:
        """A 1-D numpy array over ``nbytes`` at ``ptr + offset``, inside one live block.

        Parameters
        ----------
        ptr : int
            Any address inside a live block (a BFC chunk pointer, say).
        nbytes : int
            Length in bytes; a multiple of ``dtype``'s item size.
        dtype : numpy dtype, default uint8
        offset : int, default 0
            Added to ``ptr``.

        Raises
        ------
        ValueError
            If the range is not inside one live block, or ``nbytes`` is not a multiple of the
            item size.
        """
        dtype = np.dtype(dtype)
        addr = int(ptr) + int(offset)
        if nbytes < 0 or nbytes % dtype.itemsize:
            raise ValueError(
                f"{self.name}: nbytes={nbytes} is not a non-negative multiple of "
                f"{dtype} item size {dtype.itemsize}"
            )
        with self._lock:
            found = self._blocks.containing(addr, nbytes)
            if found is None:
                raise ValueError(
                    f"{self.name}: [{addr:#x}, {addr + nbytes:#x}) is not inside a live block"
                )
            base = self._buffers[found[0]]
        start = addr - found[0]
        return base[start:start + nbytes].view(dtype)

    def array(self, ptr: int, shape: int | tuple[int, ...], dtype: Any = np.float32,
              offset: int = 0) -> np.ndarray:
        """A numpy array of ``shape`` and ``dtype`` over memory at ``ptr + offset``."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        return self.view(ptr, nbytes, dtype, offset).reshape(shape)

    @property
    def total(self) -> int:
        """``capacity``, or the machine's physical memory when unlimited."""
        return self.capacity if self.capacity is not None else _host_total()

    @property
    def used(self) -> int:
        """Bytes in live blocks."""
        return self._blocks.used

    @property
    def available(self) -> int:
        """Bytes left under ``capacity``, or the machine's available memory when unlimited."""
        if self.capacity is not None:
            return max(0, self.capacity - self._blocks.used)
        return _host_available()

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)``."""
        return self.available, self.total

    def blocks(self) -> list[tuple[int, int]]:
        """Live blocks as ``(ptr, size)``, by address."""
        with self._lock:
            return self._blocks.items()

    def reset(self) -> None:
        """Drop every block."""
        with self._lock:
            self._blocks.clear()
            self._buffers.clear()

    def __repr__(self) -> str:
        cap = "unlimited" if self.capacity is None else format_bytes(self.capacity)
        return (f"HostMemory({self.name!r}, {cap}, used={format_bytes(self.used)}, "
                f"blocks={len(self._blocks)})")


# --------------------------------------------------------------------------------------------

_probe_lock = threading.Lock()
_probe_result: tuple[bool, str, int] | None = None

_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
_NO_DRIVER = ("cudaErrorInsufficientDriver", "cudaErrorNoDevice", "cudaErrorInitializationError")


def _cuda_error_name(exc: BaseException) -> str:
    text = str(exc)
    return text.split(":", 1)[0].strip() or type(exc).__name__


def _probe() -> tuple[bool, str, int]:
    """Probe CuPy and CUDA once: (usable, reason, device count). Never raises."""
    global _probe_result
    with _probe_lock:
        if _probe_result is None:
            _probe_result = _probe_uncached()
        return _probe_result


def _probe_uncached() -> tuple[bool, str, int]:
    try:
        import cupy  # noqa: F401
        from cupy.cuda import runtime
    except ImportError as exc:
        return False, f"CuPy is not installed ({exc}); pip install 'gpudash[cuda12]'", 0
    except Exception as exc:  # noqa: BLE001 - the probe never raises, whatever is broken
        return False, f"CuPy could not be imported: {type(exc).__name__}: {exc}", 0
    try:
        count = int(runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError, or libcuda failing to load
        name = _cuda_error_name(exc)
        if name == "cudaErrorInsufficientDriver":
            return False, f"no CUDA driver: {name}", 0
        if name == "cudaErrorNoDevice":
            return False, f"no CUDA device: {name}", 0
        return False, f"CUDA is not usable: {exc}", 0
    if count == 0:
        return False, "no CUDA device", 0
    return True, "", count


def _reset_probe() -> None:
    """Forget the cached probe (tests)."""
    global _probe_result
    with _probe_lock:
        _probe_result = None


def cuda_device_count() -> int:
    """Number of CUDA devices CuPy can use; 0 when CuPy or CUDA is unavailable. Never raises."""
    return _probe()[2]


class CudaMemory:
    """Device memory through CuPy's runtime API (``cudaMalloc`` / ``cudaFree``).

    Parameters
    ----------
    device_id : int, default 0
        CUDA device (as numbered after ``CUDA_VISIBLE_DEVICES``).
    managed : bool, default False
        Use ``cudaMallocManaged`` (unified memory, which TensorFlow uses when
        ``per_process_gpu_memory_fraction > 1``).
    pinned_host : bool, default False
        Use ``cudaHostAlloc`` / ``cudaFreeHost`` (page-locked host memory, TensorFlow's
        ``gpu_host_bfc``).

    Raises
    ------
    BackendUnavailableError
        When CuPy or CUDA cannot be used here (the reason from :meth:`available`, and a hint to
        use :class:`SimulatedDevice`).
    ConfigError
        For a device id out of range, or ``managed`` and ``pinned_host`` together.

    Notes
    -----
    CuPy is imported only when this class is used. CUDA out-of-memory errors become
    ``MemoryError``. ``CudaMemory.available()`` is the CUDA probe, so unlike
    :class:`SimulatedDevice` there is no ``available`` byte count: the device's free bytes
    are ``memory_info()[0]``.
    """

    kind = "cuda"

    def __init__(self, device_id: int = 0, *, managed: bool = False,
                 pinned_host: bool = False) -> None:
        ok, reason = self.available()
        if not ok:
            raise BackendUnavailableError(
                f"CudaMemory cannot be used on this machine: {reason}. Use "
                "gpudash.SimulatedDevice(capacity) to simulate a GPU instead."
            )
        count = cuda_device_count()
        if (isinstance(device_id, bool) or not isinstance(device_id, int)
                or not 0 <= device_id < count):
            raise ConfigError(
                f"CudaMemory device_id must be an integer in [0, {count}) ({count} CUDA "
                f"device(s) visible); got {device_id!r}"
            )
        if managed and pinned_host:
            raise ConfigError("CudaMemory: managed and pinned_host cannot both be True")
        import cupy

        self._cupy = cupy
        self._runtime = cupy.cuda.runtime
        self.device_id = device_id
        self.index = device_id
        self.managed = bool(managed)
        self.pinned_host = bool(pinned_host)
        suffix = ":managed" if managed else ":pinned_host" if pinned_host else ""
        self.name = f"cuda{device_id}{suffix}"
        self._blocks = _BlockTable()
        self._lock = threading.Lock()

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether CUDA can be used through CuPy here, and why not.

        Probed once per process and cached; never raises.

        Returns
        -------
        (bool, str)
            ``(True, "")``, or ``(False, reason)`` with a reason such as
            ``"CuPy is not installed ..."``, ``"no CUDA driver: cudaErrorInsufficientDriver"``
            or ``"no CUDA device"``.
        """
        ok, reason, _ = _probe()
        return ok, reason

    def _device(self) -> Any:
        return self._cupy.cuda.Device(self.device_id)

    def alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` on the device; ``MemoryError`` when CUDA is out of memory."""
        nbytes = _check_nbytes(nbytes)
        runtime = self._runtime
        try:
            with self._device():
                if self.managed:
                    ptr = runtime.mallocManaged(nbytes)
                elif self.pinned_host:
                    ptr = runtime.hostAlloc(nbytes, 0)
                else:
                    ptr = runtime.malloc(nbytes)
        except self._cupy.cuda.memory.OutOfMemoryError as exc:
            raise MemoryError(
                f"{self.name}: CUDA out of memory allocating {format_bytes(nbytes)} "
                f"({nbytes} bytes): {exc}"
            ) from exc
        except runtime.CUDARuntimeError as exc:
            if getattr(exc, "status", None) == _CUDA_ERROR_MEMORY_ALLOCATION:
                raise MemoryError(
                    f"{self.name}: CUDA out of memory allocating {format_bytes(nbytes)} "
                    f"({nbytes} bytes): {exc}"
                ) from exc
            raise
        with self._lock:
            self._blocks.add(int(ptr), nbytes)
        return int(ptr)

    def free(self, ptr: int, nbytes: int) -> None:
        """Release a block returned by :meth:`alloc`."""
        with self._lock:
            self._blocks.remove(self.name, ptr, nbytes)
        with self._device():
            if self.pinned_host:
                self._runtime.freeHost(ptr)
            else:
                self._runtime.free(ptr)

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)`` of the device, from ``cudaMemGetInfo``."""
        with self._device():
            free, total = self._runtime.memGetInfo()
        return int(free), int(total)

    @property
    def total(self) -> int:
        """The device's total memory in bytes."""
        return self.memory_info()[1]

    @property
    def used(self) -> int:
        """Bytes this object holds."""
        return self._blocks.used

    @property
    def compute_capability(self) -> tuple[int, int]:
        """``(major, minor)``."""
        cc = str(self._device().compute_capability)
        return int(cc[:-1]), int(cc[-1])

    def blocks(self) -> list[tuple[int, int]]:
        """Live blocks as ``(ptr, size)``, by address."""
        with self._lock:
            return self._blocks.items()

    def reset(self) -> None:
        """Free every live block."""
        for ptr, size in self.blocks():
            self.free(ptr, size)

    def __repr__(self) -> str:
        return (f"CudaMemory(device_id={self.device_id}, name={self.name!r}, "
                f"used={format_bytes(self.used)}, blocks={len(self._blocks)})")
