"""What gpudash's Dask workers send, and how it is packed (no Dask import here).

Every worker publishes dicts on the Dask topic :data:`TOPIC` (``Worker.log_event``; clients
read them with ``Client.subscribe_topic``). A message holds, per device of the worker's
session, a *summary* (allocator statistics, cumulative allocation/free/OOM counts, OOMs and
setting changes since the previous message, the settings in force) and, while a client asks
for them, a *chunk table* (the layout, for the per-worker views) and *events* (the allocator's
journal records, for traces). Tables and events travel as zlib-compressed numpy columns;
everything else is plain msgpack-able Python.

Tables instead of per-event replay for the views: chunks tile their regions exactly, in
address order, so a table is sent as the regions plus each chunk's size, requested bytes and
allocation id; addresses, bins, regions and ``in_use`` follow. ``benchmarks/bench_dask.py``
measures what a table costs on the wire against the events it would replace.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from .._errors import TraceFormatError

__all__ = ["TOPIC", "WIRE_VERSION", "encode_table", "decode_table", "encode_records",
           "decode_records", "table_stats"]

#: The Dask event topic gpudash workers publish on.
TOPIC = "gpudash"
#: Bumped when the message layout changes; clients ignore messages of another version.
WIRE_VERSION = 1

_W = 8  # ints per journal record (``BFCAllocator`` journal layout)
_ALLOC, _FREE = 1, 2


def _pack(arrays: list[np.ndarray]) -> bytes:
    return zlib.compress(b"".join(np.ascontiguousarray(a, dtype="<i8").tobytes()
                                  for a in arrays), 1)


def _unpack(data: bytes, what: str) -> np.ndarray:
    try:
        raw = zlib.decompress(data)
    except (zlib.error, TypeError) as exc:
        raise TraceFormatError(f"gpudash Dask message: the {what} payload is damaged "
                               f"({exc})") from None
    if len(raw) % 8:
        raise TraceFormatError(f"gpudash Dask message: the {what} payload has {len(raw)} "
                               "bytes, not a whole number of int64 values")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


def encode_table(table: dict) -> dict:
    """A chunk table (``BFCAllocator.chunk_table()``) as a small msgpack-able dict.

    Sent: the regions (address, size), then per chunk its size in 256-byte units, requested
    bytes and allocation id. Everything else is implied by the tiling of the regions.
    """
    regions = np.asarray(table["regions"], dtype=np.int64).reshape(-1, 2)
    size = np.asarray(table["size"], dtype=np.int64)
    return {
        "nr": int(len(regions)),
        "nc": int(len(size)),
        "z": _pack([regions[:, 0], regions[:, 1], size >> 8,
                    np.asarray(table["requested"], dtype=np.int64),
                    np.asarray(table["alloc_id"], dtype=np.int64)]),
    }


def _bins(sizes: np.ndarray) -> np.ndarray:
    v = np.maximum(sizes, 256) >> 8
    return np.minimum(np.frexp(v.astype(np.float64))[1] - 1, 20).astype(np.int8)


def decode_table(msg: dict) -> dict[str, np.ndarray]:
    """The chunk table :func:`encode_table` packed, in ``chunk_table()``'s exact form."""
    nr, nc = int(msg["nr"]), int(msg["nc"])
    flat = _unpack(msg["z"], "chunk table")
    if len(flat) != 2 * nr + 3 * nc:
        raise TraceFormatError(f"gpudash Dask message: a chunk table of {nr} regions and {nc} "
                               f"chunks needs {2 * nr + 3 * nc} values; got {len(flat)}")
    reg_ptr, reg_size = flat[:nr], flat[nr:2 * nr]
    o = 2 * nr
    size = flat[o:o + nc] << 8
    requested = flat[o + nc:o + 2 * nc]
    aid = flat[o + 2 * nc:o + 3 * nc]
    # Chunks tile the regions in address order: the region of chunk i is the first region
    # whose cumulative end reaches the chunk's cumulative end.
    reg_end = np.cumsum(reg_size)
    chunk_end = np.cumsum(size)
    if nc and (not nr or chunk_end[-1] != reg_end[-1]):
        raise TraceFormatError("gpudash Dask message: the chunks of a table do not tile its "
                               "regions")
    ri = np.searchsorted(reg_end, chunk_end, side="left")
    reg_start = reg_end - reg_size
    ptr = reg_ptr[ri] + (chunk_end - size - reg_start[ri]) if nc else np.zeros(0, np.int64)
    in_use = aid >= 0
    return {
        "ptr": ptr.astype(np.int64),
        "size": size,
        "requested": requested,
        "alloc_id": aid,
        "bin": np.where(in_use, -1, _bins(size)).astype(np.int8),
        "region": reg_ptr[ri].astype(np.int64) if nc else np.zeros(0, np.int64),
        "in_use": in_use,
        "regions": np.stack([reg_ptr, reg_size], axis=1) if nr else np.zeros((0, 2), np.int64),
    }


def table_stats(table: dict) -> dict:
    """``bytes_in_use``, ``pool_bytes``, ``largest_free_block_bytes`` and ``fragmentation``
    (the allocator's formula: free bytes outside the largest free chunk / free bytes) of a
    chunk table."""
    size = table["size"]
    in_use = table["in_use"]
    used = int(size[in_use].sum())
    pool = int(table["regions"][:, 1].sum()) if len(table["regions"]) else 0
    free_sizes = size[~in_use]
    largest = int(free_sizes.max()) if len(free_sizes) else 0
    free = pool - used
    return {"bytes_in_use": used, "pool_bytes": pool, "largest_free_block_bytes": largest,
            "fragmentation": (free - largest) / free if free > 0 else 0.0}


def encode_records(batches: list[list[int]]) -> tuple[int, bytes]:
    """Journal records (flat lists of ints, 8 per operation) as ``(n_ops, bytes)``: columns,
    times as deltas from the first, zlib-compressed."""
    flat: list[int] = []
    for b in batches:
        flat.extend(b)
    n = len(flat) // _W
    if not n:
        return 0, b""
    rec = np.array(flat, dtype=np.int64).reshape(n, _W)
    cols = rec.T.copy()
    t = cols[0].copy()
    cols[0] = np.diff(t, prepend=t[0])
    cols[0, 0] = t[0]
    return n, _pack([cols])


def decode_records(n: int, data: bytes) -> np.ndarray:
    """The ``(n, 8)`` int64 journal records :func:`encode_records` packed."""
    if not n:
        return np.zeros((0, _W), dtype=np.int64)
    flat = _unpack(data, "events")
    if len(flat) != n * _W:
        raise TraceFormatError(f"gpudash Dask message: {n} event records need {n * _W} values; "
                               f"got {len(flat)}")
    cols = flat.reshape(_W, n).copy()
    cols[0] = np.cumsum(cols[0])
    return np.ascontiguousarray(cols.T)


def count_allocs(records: Any) -> int:
    """Allocations among journal records (a flat list, 8 ints per operation)."""
    return records[1::_W].count(_ALLOC)
