"""What gpudash's Dask workers send, and how it is packed (no Dask import here).

Every worker publishes dicts on the Dask topic :data:`TOPIC` (``Worker.log_event``; clients
read them with ``Client.subscribe_topic``). A message holds, per device of the worker's
session, a *summary* (allocator statistics, cumulative allocation/free/OOM counts, OOMs and
setting changes since the previous message, the settings in force) and, while a client asks
for them, a *chunk table* (the layout, for the per-worker views) and *events* (the allocator's
journal records, for traces). Tables and events travel as zlib-compressed numpy columns;
everything else is plain msgpack-able Python. A client's first ``ClusterModel`` also publishes
``{"hub": token}`` there until it receives it back: then the scheduler forwards it the topic.

A watched device's layout reaches the client either as a table or as the events since the
previous one (applied to a :class:`Layout` replica): the worker sends whichever it expects to
be smaller. Tables are compact -- chunks tile their regions exactly, in address order, so a
table is the regions plus each chunk's size, requested bytes and allocation id; addresses,
bins, regions and ``in_use`` follow -- and cost nothing per allocation; events cost the
allocator's journal but are cheaper for a large layout that changes slowly.
``benchmarks/bench_dask.py`` measures both.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from .._errors import TraceFormatError
from .._eventsource import code_counts

from ..formats.format import bins_for_sizes
from ..events import ALLOC as _ALLOC, FREE as _FREE, EXTEND as _EXTEND, RELEASE as _RELEASE
__all__ = ["TOPIC", "WIRE_VERSION", "encode_table", "decode_table", "encode_records",
           "decode_records", "table_stats", "Layout"]

#: The Dask event topic gpudash workers publish on.
TOPIC = "gpudash"
#: Bumped when the message layout changes; clients ignore messages of another version.
WIRE_VERSION = 1

_W = 8  # ints per journal record (``BFCAllocator`` journal layout)


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
        "bin": np.where(in_use, -1, bins_for_sizes(size)).astype(np.int8),
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
    """Allocations among journal records (a flat list or the compiled core's journal, 8
    ints per operation)."""
    return code_counts(records)[_ALLOC]


class Layout:
    """A replica of one allocator's chunk layout, kept from a chunk table plus the journal
    records that followed it (what a feed does when the worker sends events instead of a
    new table).

    Parameters
    ----------
    table : dict
        A chunk table (``BFCAllocator.chunk_table()`` or :func:`decode_table`).
    """

    def __init__(self, table: dict) -> None:
        self.chunks: dict[int, list[int]] = {
            int(p): [int(s), int(r), int(a)] for p, s, r, a in zip(
                table["ptr"].tolist(), table["size"].tolist(), table["requested"].tolist(),
                table["alloc_id"].tolist())}
        self.regions: dict[int, int] = {int(p): int(s) for p, s in table["regions"].tolist()}

    def apply(self, records: np.ndarray, aid0: int) -> None:
        """Apply ``(n, 8)`` journal records; ``aid0`` is the id of their first allocation.

        Raises
        ------
        TraceFormatError
            When a record does not fit the layout (the replica is then unusable).
        """
        chunks, regions = self.chunks, self.regions
        aid = aid0
        try:
            for _, code, ptr, size, req, a, b, c in records.tolist():
                if code == _ALLOC:
                    old = chunks[ptr]
                    if old[2] >= 0 or old[0] != size + a:
                        raise KeyError(f"{ptr:#x} (no free chunk of {size + a} bytes there)")
                    chunks[ptr] = [size, req, aid]
                    aid += 1
                    if a:
                        chunks[ptr + size] = [a, 0, -1]
                elif code == _FREE:
                    if chunks[ptr][2] < 0:
                        raise KeyError(f"{ptr:#x} (that chunk is free already)")
                    total = size
                    if b:
                        del chunks[ptr + size]
                        total += b
                    if c:
                        del chunks[ptr]
                        chunks[ptr - c] = [c + total, 0, -1]
                    else:
                        chunks[ptr] = [total, 0, -1]
                elif code == _EXTEND:
                    regions[ptr] = size
                    chunks[ptr] = [size, 0, -1]
                elif code == _RELEASE:
                    regions.pop(ptr)
                    end = ptr + size
                    if chunks.get(ptr, (0,))[0] == size:
                        del chunks[ptr]
                    else:  # a region released with chunks in it (the allocator's close())
                        for p in [p for p in chunks if ptr <= p < end]:
                            del chunks[p]
        except KeyError as exc:
            raise TraceFormatError(f"gpudash Dask message: an event does not fit the layout "
                                   f"(no chunk or region at {exc})") from None

    def table(self) -> dict[str, np.ndarray]:
        """The layout in ``chunk_table()``'s form."""
        ptrs = np.array(sorted(self.chunks), dtype=np.int64)
        rows = np.array([self.chunks[p] for p in ptrs.tolist()], dtype=np.int64).reshape(-1, 3)
        regions = np.array(sorted(self.regions.items()), dtype=np.int64).reshape(-1, 2)
        size, requested, aid = rows[:, 0].copy(), rows[:, 1].copy(), rows[:, 2].copy()
        ri = np.searchsorted(regions[:, 0], ptrs, side="right") - 1
        in_use = aid >= 0
        return {
            "ptr": ptrs, "size": size, "requested": requested, "alloc_id": aid,
            "bin": np.where(in_use, -1, bins_for_sizes(size)).astype(np.int8),
            "region": regions[ri, 0] if len(ptrs) else np.zeros(0, np.int64),
            "in_use": in_use, "regions": regions,
        }
