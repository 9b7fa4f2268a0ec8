"""Test sub-allocators and small reference formulas shared by the BFC test files.

Everything here is written from TensorFlow's BFC allocator (``/work/shared/reference/BFC.md``),
independently of ``gpudash/bfc.py``, so that the tests check the implementation rather than
mirror it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).parent / "data"

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

#: TensorFlow's kInvalidChunkHandle (SIZE_MAX), printed as the last chunk's ``next``.
INVALID_HANDLE = (1 << 64) - 1

STAT_FIELDS = (
    "num_allocs",
    "bytes_in_use",
    "peak_bytes_in_use",
    "largest_alloc_size",
    "bytes_limit",
    "pool_bytes",
    "peak_pool_bytes",
    "largest_free_block_bytes",
    "fragmentation",
)


# --------------------------------------------------------------------------------------------
# Sub-allocators
# --------------------------------------------------------------------------------------------


class BumpSubAllocator:
    """TensorFlow/XLA's ``FakeSubAllocator``: a bump pointer from ``base`` (default ``1 << 40``).

    Every call is recorded in ``calls`` as ``(op, ptr, size)``: ``("alloc", ptr, n)`` for a
    region handed out, ``("refuse", 0, n)`` for a refused request, ``("free", ptr, n)``.
    Addresses are 256-aligned (each region's start is rounded up to 256). By default regions
    are adjacent, as with the XLA fake; ``gap`` leaves that many bytes between them.

    Refusals (``MemoryError``):
    - ``capacity``: refuse when outstanding bytes + n would exceed it;
    - ``fail_sizes``: refuse any request of exactly one of these sizes;
    - ``fail_next``: refuse the next that many requests;
    - ``fail_always``: refuse everything.

    ``fuse``: after that many calls (an allocator stuck retrying), every request succeeds
    and an error is recorded, so a stalled loop ends and the test fails instead of hanging.
    """

    def __init__(self, base: int = 1 << 40, *, capacity: int | None = None,
                 fail_sizes=(), fail_next: int = 0, fail_always: bool = False,
                 gap: int = 0, fuse: int = 10_000) -> None:
        self.base = base
        self.fuse = fuse
        self.next = base
        self.capacity = capacity
        self.fail_sizes = set(fail_sizes)
        self.fail_next = fail_next
        self.fail_always = fail_always
        self.gap = gap
        self.calls: list[tuple[str, int, int]] = []
        self.outstanding: dict[int, int] = {}
        self.errors: list[str] = []

    # the sub-allocator protocol -------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        nbytes = int(nbytes)
        if nbytes <= 0:
            self.errors.append(f"alloc({nbytes}) asked for a non-positive size")
        blown = len(self.calls) >= self.fuse
        if blown:
            self.errors.append(f"fuse: {len(self.calls)} calls, the allocator keeps retrying")
        refuse = not blown and (
            self.fail_always
            or nbytes in self.fail_sizes
            or self.fail_next > 0
            or (self.capacity is not None and self.outstanding_bytes + nbytes > self.capacity)
        )
        if refuse:
            if self.fail_next > 0:
                self.fail_next -= 1
            self.calls.append(("refuse", 0, nbytes))
            raise MemoryError(f"BumpSubAllocator refuses {nbytes} bytes")
        ptr = (self.next + 255) // 256 * 256
        self.next = ptr + nbytes + self.gap
        self.outstanding[ptr] = nbytes
        self.calls.append(("alloc", ptr, nbytes))
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        self.calls.append(("free", ptr, nbytes))
        size = self.outstanding.pop(ptr, None)
        if size is None:
            self.errors.append(f"free({ptr:#x}, {nbytes}) of a region never handed out")
        elif size != nbytes:
            self.errors.append(f"free({ptr:#x}, {nbytes}) but the region has {size} bytes")

    # views ------------------------------------------------------------------------------------
    @property
    def outstanding_bytes(self) -> int:
        return sum(self.outstanding.values())

    @property
    def asked(self) -> list[int]:
        """Sizes of every alloc request, refused or not, in order."""
        return [n for op, _, n in self.calls if op in ("alloc", "refuse")]

    @property
    def granted(self) -> list[int]:
        """Sizes of the regions handed out, in order."""
        return [n for op, _, n in self.calls if op == "alloc"]

    @property
    def freed(self) -> list[tuple[int, int]]:
        return [(p, n) for op, p, n in self.calls if op == "free"]


class VectorSubAllocator:
    """Hands out exactly the regions TensorFlow obtained, in order, checking each size asked."""

    def __init__(self, regions) -> None:
        self.regions = [(int(p), int(n)) for p, n in regions]
        self.index = 0
        self.asked: list[int] = []
        self.freed: list[tuple[int, int]] = []
        self.errors: list[str] = []

    def alloc(self, nbytes: int) -> int:
        nbytes = int(nbytes)
        self.asked.append(nbytes)
        if self.index >= len(self.regions):
            msg = (f"region #{self.index} of {nbytes} bytes requested, but TensorFlow "
                   f"obtained only {len(self.regions)} regions")
            self.errors.append(msg)
            raise AssertionError(msg)
        ptr, size = self.regions[self.index]
        if nbytes != size:
            msg = (f"region #{self.index}: asked for {nbytes} bytes, TensorFlow asked for "
                   f"{size}")
            self.errors.append(msg)
            raise AssertionError(msg)
        self.index += 1
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        self.freed.append((int(ptr), int(nbytes)))


def load_vector(name: str) -> dict:
    """Read ``tests/data/NAME.json`` (``NAME`` with or without ``.json``)."""
    if not name.endswith(".json"):
        name += ".json"
    with open(DATA_DIR / name, encoding="utf-8") as f:
        return json.load(f)


def vector_names() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.json"))


# --------------------------------------------------------------------------------------------
# TensorFlow formulas (BFC.md §1, §2.2, §5, §6, §9.4)
# --------------------------------------------------------------------------------------------


def rounded_bytes(n: int) -> int:
    """``RoundedBytes``: up to a multiple of 256."""
    return 256 * ((n + 255) // 256)


def bin_for_size(nbytes: int) -> int:
    """``BinNumForSize``: ``min(20, Log2FloorNonZero(max(n, 256) >> 8))``."""
    v = max(nbytes, 256) >> 8
    return min(20, v.bit_length() - 1)


def log2_floor_nonzero_slow(n: int) -> int:
    """TensorFlow's ``Log2FloorNonZeroSlow`` (0 gives -1)."""
    return n.bit_length() - 1


def human_readable(num_bytes: int) -> str:
    """``strings::HumanReadableNumBytes``, with its integer division between units."""
    if num_bytes < 0:
        return "-" + human_readable(-num_bytes)
    if num_bytes < 1024:
        return f"{num_bytes}B"
    units = "KMGTPE"
    i = 0
    while num_bytes >= 1024 * 1024:
        num_bytes //= 1024
        i += 1
    if units[i] == "K":
        return "%.1f%ciB" % (num_bytes / 1024.0, units[i])
    return "%.2f%ciB" % (num_bytes / 1024.0, units[i])


def backpedal(nbytes: int) -> int:
    """One back-off step: ``RoundedBytes(bytes * kBackpedalFactor)``.

    ``kBackpedalFactor`` is a C++ ``float`` (0.9f): ``size_t * float`` is computed in single
    precision and truncated back to ``size_t``.
    """
    return rounded_bytes(int(np.float32(nbytes) * np.float32(0.9)))


def split_threshold(fragmentation_fraction: float, memory_limit: int) -> int:
    """``max_internal_fragmentation_bytes`` (TSL): fraction * limit, or 128 MiB."""
    if fragmentation_fraction > 0.0:
        return int(fragmentation_fraction * memory_limit)
    return 128 << 20


def expected_occupancy(regions, chunks) -> str:
    """``RenderOccupancy`` computed from a snapshot (BFC.md §9.3), 100 characters.

    ``regions``: (ptr, size) in the allocator's order; ``chunks``: objects with address,
    size, requested_size, in_use.
    """
    resolution = 100
    total = sum(size for _, size in regions)
    if total == 0:
        return "<allocator contains no memory>"
    rendered = ["_"] * resolution

    def render(offset, base, ptr, size, ch):
        start = ((ptr - base + offset) * resolution) // total
        end = ((ptr + size - 1 - base + offset) * resolution) // total
        assert 0 <= start < resolution and 0 <= end < resolution
        for i in range(start, end + 1):
            rendered[i] = ch

    region_offset = 0
    for rptr, rsize in regions:
        for c in chunks:
            if not (rptr <= c.address < rptr + rsize) or not c.in_use:
                continue
            wasted = c.size - c.requested_size
            if wasted > 0:
                render(region_offset + c.requested_size, rptr, c.address, wasted, "x")
            render(region_offset, rptr, c.address, c.requested_size, "*")
        region_offset += rsize
    return "".join(rendered)


# --------------------------------------------------------------------------------------------
# Snapshots of allocator state
# --------------------------------------------------------------------------------------------


def stats_tuple(stats) -> tuple:
    return tuple(getattr(stats, f) for f in STAT_FIELDS)


def chunk_tuple(c) -> tuple:
    return (c.address, c.size, c.requested_size, c.bin, c.in_use, c.allocation_id, c.region)


def bin_tuple(b) -> tuple:
    return (b.bin, b.total_bytes_in_use, b.total_bytes_in_bin, b.total_chunks_in_use,
            b.total_chunks_in_bin, b.total_requested_bytes_in_use)


def fingerprint(alloc) -> tuple:
    """Everything observable about an allocator's state: stats and snapshot."""
    dump = alloc.snapshot()
    return (
        stats_tuple(alloc.stats()),
        stats_tuple(dump.stats) if hasattr(dump.stats, "num_allocs") else None,
        tuple(chunk_tuple(c) for c in dump.chunks),
        tuple((r.ptr, r.size) for r in dump.regions),
        tuple(bin_tuple(b) for b in dump.bins),
        alloc.pool_bytes,
    )


def check_snapshot(dump) -> None:
    """Structural checks on a MemoryDump that need no model (BFC.md §2, §9.5)."""
    regions = [(r.ptr, r.size) for r in dump.regions]
    chunks = list(dump.chunks)
    assert [c.address for c in chunks] == sorted(c.address for c in chunks), \
        "chunks not in address order"
    by_region: dict[int, list] = {p: [] for p, _ in regions}
    for c in chunks:
        assert c.region in by_region, f"chunk {c.address:#x} names unknown region {c.region:#x}"
        by_region[c.region].append(c)
    for rptr, rsize in regions:
        cs = by_region[rptr]
        assert cs, f"region {rptr:#x} has no chunks"
        pos = rptr
        prev_free = False
        for c in cs:
            assert c.address == pos, f"gap or overlap at {pos:#x} in region {rptr:#x}"
            assert c.size > 0 and c.size % 256 == 0, f"chunk size {c.size}"
            pos += c.size
            if c.in_use:
                assert c.bin == -1, f"in-use chunk {c.address:#x} has bin {c.bin}"
                assert 0 < c.requested_size <= c.size
                assert c.allocation_id >= 1
            else:
                assert c.bin == bin_for_size(c.size), \
                    f"free chunk of {c.size} in bin {c.bin}, expected {bin_for_size(c.size)}"
                assert not prev_free, f"two adjacent free chunks at {c.address:#x}"
            prev_free = not c.in_use
        assert pos == rptr + rsize, f"region {rptr:#x} not covered: ends at {pos:#x}"
    ids = [c.allocation_id for c in chunks if c.in_use]
    assert len(ids) == len(set(ids)), "duplicate allocation ids"
    # bin summaries: every chunk bucketed by BinNumForSize(size), in use included (§9.2)
    assert len(dump.bins) == 21
    expect = {b: [0, 0, 0, 0, 0] for b in range(21)}
    for c in chunks:
        e = expect[bin_for_size(c.size)]
        e[1] += c.size
        e[3] += 1
        if c.in_use:
            e[0] += c.size
            e[2] += 1
            e[4] += c.requested_size
    for b in dump.bins:
        e = expect[b.bin]
        got = [b.total_bytes_in_use, b.total_bytes_in_bin, b.total_chunks_in_use,
               b.total_chunks_in_bin, b.total_requested_bytes_in_use]
        assert got == e, f"bin {b.bin} summary {got} != {e}"
    assert [b.bin for b in dump.bins] == list(range(21))
