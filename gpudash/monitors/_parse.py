"""Turning a framework's own memory figures into gpudash's shapes (no framework imported).

Each function takes the dict a framework documents and returns :class:`~gpudash.bfc.AllocatorStats`
(and, for PyTorch's segments, a chunk table in the form of
:meth:`gpudash.BFCAllocator.chunk_table`). Figures a framework does not report are 0 in the
stats and named in the ``missing`` tuple that comes back with them, so views can say so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..bfc import AllocatorStats
from ..live.model import bin_of_sizes

__all__ = ["stats_from_tf_memory_info", "stats_from_jax_memory_stats",
           "stats_from_torch_memory_stats", "torch_chunk_table", "stats_from_table",
           "TORCH_ALLOCATED_STATES"]

#: Block states of ``torch.cuda.memory_snapshot()`` that hold memory for a tensor.
TORCH_ALLOCATED_STATES = frozenset({"active_allocated", "active_pending_free",
                                    "active_awaiting_free"})


def _frag(pool: int, in_use: int, largest_free: int) -> float:
    free = pool - in_use
    return (free - largest_free) / free if free > 0 and largest_free else 0.0


def stats_from_tf_memory_info(info: Mapping[str, Any], limit: int = 0
                              ) -> tuple[AllocatorStats, tuple[str, ...]]:
    """``tf.config.experimental.get_memory_info(device)``: ``{"current": ..., "peak": ...}``.

    TensorFlow reports only bytes in use and their peak; the limit comes from the logical
    device configuration when one was set (``limit``, 0 when unknown).
    """
    current = int(info["current"])
    peak = int(info["peak"])
    missing = ["num_allocs", "pool_bytes", "largest_free_block_bytes", "largest_alloc_size"]
    if not limit:
        missing.insert(0, "bytes_limit")
    return (AllocatorStats(bytes_in_use=current, peak_bytes_in_use=peak,
                           bytes_limit=int(limit or 0)), tuple(missing))


def stats_from_jax_memory_stats(stats: Mapping[str, Any]
                                ) -> tuple[AllocatorStats, tuple[str, ...]]:
    """``jax.Device.memory_stats()``: jaxlib's dict of ``tsl::AllocatorStats``.

    Keys (``jaxlib/py_device.cc``): ``num_allocs``, ``bytes_in_use``,
    ``peak_bytes_in_use``, ``largest_alloc_size``, ``bytes_limit`` (when set),
    ``bytes_reserved``, ``peak_bytes_reserved``, ``bytes_reservable_limit`` (when set),
    ``largest_free_block_bytes``, ``pool_bytes`` and ``peak_pool_bytes`` (when the allocator
    keeps them: the BFC does).
    """
    def get(key: str) -> int:
        return int(stats.get(key, 0) or 0)

    missing = tuple(k for k in ("bytes_limit", "pool_bytes", "peak_pool_bytes")
                    if k not in stats)
    in_use, pool, largest_free = get("bytes_in_use"), get("pool_bytes"), get(
        "largest_free_block_bytes")
    return (AllocatorStats(
        num_allocs=get("num_allocs"), bytes_in_use=in_use,
        peak_bytes_in_use=get("peak_bytes_in_use"), largest_alloc_size=get("largest_alloc_size"),
        bytes_limit=get("bytes_limit"), pool_bytes=pool, peak_pool_bytes=get("peak_pool_bytes"),
        largest_free_block_bytes=largest_free,
        fragmentation=_frag(pool, in_use, largest_free)), missing)


def stats_from_torch_memory_stats(stats: Mapping[str, Any], limit: int = 0
                                  ) -> tuple[AllocatorStats, tuple[str, ...]]:
    """``torch.cuda.memory_stats(device)``: the caching allocator's flat dict.

    ``allocated_bytes.all.current``/``.peak`` are bytes in use (rounded block sizes, as
    TensorFlow counts), ``reserved_bytes.all.current``/``.peak`` the pool (segments from
    ``cudaMalloc``), ``allocation.all.allocated`` the allocations so far. PyTorch has no
    limit of its own: ``limit`` is ``set_per_process_memory_fraction`` x total (0 when
    unknown). The largest free block needs the layout (:func:`torch_chunk_table`).
    """
    def get(key: str) -> int:
        return int(stats.get(key, 0) or 0)

    missing = ["largest_free_block_bytes", "largest_alloc_size"]
    if not limit:
        missing.insert(0, "bytes_limit")
    return (AllocatorStats(
        num_allocs=get("allocation.all.allocated"),
        bytes_in_use=get("allocated_bytes.all.current"),
        peak_bytes_in_use=get("allocated_bytes.all.peak"),
        bytes_limit=int(limit or 0),
        pool_bytes=get("reserved_bytes.all.current"),
        peak_pool_bytes=get("reserved_bytes.all.peak")), tuple(missing))


def torch_chunk_table(segments: Iterable[Mapping[str, Any]], device: int | None = None
                      ) -> dict[str, np.ndarray]:
    """The chunk table of ``torch.cuda.memory_snapshot()`` segments (one device's).

    Each segment (a ``cudaMalloc``) is a region; each block a chunk, in address order.
    A block is in use when its state is ``active_allocated``, ``active_pending_free`` or
    ``active_awaiting_free``. ``requested`` is the block's ``requested_size`` (its size
    when absent); ``alloc_id`` numbers the blocks in use in address order (PyTorch gives
    blocks no id); ``bin`` is TensorFlow's bin of a free block's size (-1 in use), so the bin
    view sorts PyTorch's free blocks by the same size classes. Blocks without an
    ``address`` (older snapshots) are placed end to end from the segment's address.
    Expandable segments are regions of their mapped size.

    Parameters
    ----------
    segments : iterable of dict
        ``memory_snapshot()`` or ``_snapshot()["segments"]``.
    device : int, optional
        Keep only this device's segments (``segment["device"]``).
    """
    regions: list[tuple[int, int]] = []
    ptrs: list[int] = []
    sizes: list[int] = []
    reqs: list[int] = []
    used: list[bool] = []
    regs: list[int] = []
    for seg in sorted((s for s in segments if device is None or s.get("device", 0) == device),
                      key=lambda s: int(s["address"])):
        base = int(seg["address"])
        regions.append((base, int(seg["total_size"])))
        offset = base
        for block in seg.get("blocks", ()):
            size = int(block["size"])
            addr = int(block.get("address", offset))
            in_use = block.get("state") in TORCH_ALLOCATED_STATES
            ptrs.append(addr)
            sizes.append(size)
            reqs.append(int(block.get("requested_size", size)) if in_use else 0)
            used.append(in_use)
            regs.append(base)
            offset = addr + size
    size_a = np.array(sizes, dtype=np.int64)
    in_use_a = np.array(used, dtype=bool)
    aid = np.full(len(sizes), -1, dtype=np.int64)
    aid[in_use_a] = np.arange(int(in_use_a.sum()), dtype=np.int64)
    bins = np.where(in_use_a, -1, bin_of_sizes(size_a) if len(size_a) else size_a).astype(np.int8)
    order = np.argsort(np.array(ptrs, dtype=np.int64), kind="stable")
    table = {
        "ptr": np.array(ptrs, dtype=np.int64)[order],
        "size": size_a[order],
        "requested": np.array(reqs, dtype=np.int64)[order],
        "alloc_id": aid[order],
        "bin": bins[order],
        "region": np.array(regs, dtype=np.int64)[order],
        "in_use": in_use_a[order],
        "regions": np.array(regions, dtype=np.int64).reshape(-1, 2),
    }
    return table


def stats_from_table(table: Mapping[str, np.ndarray], base: AllocatorStats | None = None
                     ) -> AllocatorStats:
    """Stats made consistent with a chunk table: in use, pool, largest free block and
    fragmentation from the table; counts, peaks and the limit from ``base``."""
    sizes = table["size"]
    in_use_mask = table["in_use"]
    in_use = int(sizes[in_use_mask].sum())
    pool = int(table["regions"][:, 1].sum()) if len(table["regions"]) else 0
    free_sizes = sizes[~in_use_mask]
    largest_free = int(free_sizes.max()) if len(free_sizes) else 0
    largest_alloc = int(sizes[in_use_mask].max()) if in_use_mask.any() else 0
    b = base or AllocatorStats()
    return AllocatorStats(
        num_allocs=b.num_allocs, bytes_in_use=in_use,
        peak_bytes_in_use=max(b.peak_bytes_in_use, in_use),
        largest_alloc_size=max(b.largest_alloc_size, largest_alloc),
        bytes_limit=b.bytes_limit, pool_bytes=pool,
        peak_pool_bytes=max(b.peak_pool_bytes, pool), largest_free_block_bytes=largest_free,
        fragmentation=_frag(pool, in_use, largest_free))
