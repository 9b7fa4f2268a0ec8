"""Parsing tests: the frameworks' documented dicts and PyTorch's real snapshot segments turned
into gpudash's stats and chunk tables. These test parsing only; the monitors that poll the
frameworks are tested in test_monitors.py (TensorFlow, for real, on its CPU BFC) and in the
``gpu``-marked tests of test_monitors_gpu.py."""

from __future__ import annotations


import numpy as np
import pytest

from gpudash.monitors._parse import (
    TORCH_ALLOCATED_STATES,
    stats_from_jax_memory_stats,
    stats_from_table,
    stats_from_tf_memory_info,
    stats_from_torch_memory_stats,
    torch_chunk_table,
)
from gpudash.live.model import NUM_BINS, bin_of_sizes, heatmap_column

from shared_files import EXTERNAL  # noqa: E402
PICKLES = sorted(EXTERNAL.glob("*.p*")) if EXTERNAL.is_dir() else []
MiB = 1 << 20


def test_tf_memory_info():
    # tf.config.experimental.get_memory_info's documented dict: current and peak only
    stats, missing = stats_from_tf_memory_info({"current": 1024, "peak": 4096})
    assert (stats.bytes_in_use, stats.peak_bytes_in_use, stats.bytes_limit) == (1024, 4096, 0)
    assert missing[0] == "bytes_limit" and "pool_bytes" in missing
    stats, missing = stats_from_tf_memory_info({"current": 1, "peak": 2}, limit=8 << 30)
    assert stats.bytes_limit == 8 << 30 and "bytes_limit" not in missing


def test_jax_memory_stats_keys_of_jaxlib():
    # the keys jaxlib's PyDevice::MemoryStats sets from tsl::AllocatorStats (BFC on a GPU)
    raw = {"num_allocs": 12, "bytes_in_use": 3 * MiB, "peak_bytes_in_use": 5 * MiB,
           "largest_alloc_size": 2 * MiB, "bytes_limit": 12 << 30, "bytes_reserved": 0,
           "peak_bytes_reserved": 0, "largest_free_block_bytes": 4 * MiB,
           "pool_bytes": 8 * MiB, "peak_pool_bytes": 8 * MiB}
    stats, missing = stats_from_jax_memory_stats(raw)
    assert missing == ()
    assert (stats.num_allocs, stats.bytes_in_use, stats.peak_bytes_in_use, stats.bytes_limit,
            stats.pool_bytes, stats.largest_free_block_bytes) == (
        12, 3 * MiB, 5 * MiB, 12 << 30, 8 * MiB, 4 * MiB)
    assert stats.fragmentation == pytest.approx((5 - 4) / 5)  # free 5 MiB, largest 4 MiB
    # an allocator without a pool (cuda_async, platform) leaves the optional keys out
    stats, missing = stats_from_jax_memory_stats({"num_allocs": 1, "bytes_in_use": 256,
                                                  "peak_bytes_in_use": 256,
                                                  "largest_alloc_size": 256,
                                                  "bytes_reserved": 0, "peak_bytes_reserved": 0,
                                                  "largest_free_block_bytes": 0})
    assert set(missing) == {"bytes_limit", "pool_bytes", "peak_pool_bytes"}
    assert stats.pool_bytes == 0 and stats.fragmentation == 0.0


def test_torch_memory_stats_key_names():
    # flat keys of torch.cuda.memory_stats() (torch/csrc/cuda/Module.cpp, flattened by ".")
    raw = {"allocation.all.allocated": 40, "allocation.all.freed": 30,
           "allocated_bytes.all.current": 10 * MiB, "allocated_bytes.all.peak": 12 * MiB,
           "reserved_bytes.all.current": 20 * MiB, "reserved_bytes.all.peak": 22 * MiB,
           "num_ooms": 0}
    stats, missing = stats_from_torch_memory_stats(raw, limit=16 << 30)
    assert (stats.num_allocs, stats.bytes_in_use, stats.peak_bytes_in_use, stats.pool_bytes,
            stats.peak_pool_bytes, stats.bytes_limit) == (
        40, 10 * MiB, 12 * MiB, 20 * MiB, 22 * MiB, 16 << 30)
    assert "largest_free_block_bytes" in missing and "bytes_limit" not in missing


def test_torch_memory_stats_key_names_match_installed_torch():
    """The key names used above are the ones the installed PyTorch's own helpers read."""
    torch = pytest.importorskip("torch")
    import inspect

    src = inspect.getsource(torch.cuda.memory)
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                "reserved_bytes.all.current", "reserved_bytes.all.peak"):
        assert f'"{key}"' in src, key


SEGMENTS = [  # the documented Segment/Block shape of torch.cuda.memory_snapshot()
    {"device": 0, "address": 0x7F0000000000, "total_size": 2 * MiB, "stream": 0,
     "segment_type": "small", "allocated_size": 1536, "active_size": 1536,
     "blocks": [{"address": 0x7F0000000000, "size": 512, "requested_size": 500,
                 "state": "active_allocated"},
                {"address": 0x7F0000000200, "size": 1024, "requested_size": 1000,
                 "state": "active_allocated"},
                {"address": 0x7F0000000600, "size": 2 * MiB - 1536, "requested_size": 0,
                 "state": "inactive"}]},
    {"device": 1, "address": 0x7E0000000000, "total_size": 20 * MiB, "stream": 0,
     "segment_type": "large", "allocated_size": 0, "active_size": 0,
     "blocks": [{"address": 0x7E0000000000, "size": 20 * MiB, "requested_size": 0,
                 "state": "inactive"}]},
]


def test_torch_chunk_table_documented_shape():
    t = torch_chunk_table(SEGMENTS, device=0)
    assert t["ptr"].tolist() == [0x7F0000000000, 0x7F0000000200, 0x7F0000000600]
    assert t["in_use"].tolist() == [True, True, False]
    assert t["requested"].tolist() == [500, 1000, 0]
    assert t["alloc_id"].tolist() == [0, 1, -1]
    assert t["bin"].tolist() == [-1, -1, int(bin_of_sizes(np.array([2 * MiB - 1536]))[0])]
    assert t["regions"].tolist() == [[0x7F0000000000, 2 * MiB]]
    s = stats_from_table(t)
    assert (s.bytes_in_use, s.pool_bytes, s.largest_free_block_bytes) == (1536, 2 * MiB,
                                                                          2 * MiB - 1536)
    both = torch_chunk_table(SEGMENTS)
    assert len(both["ptr"]) == 4 and both["regions"][:, 0].tolist() == sorted(
        [0x7F0000000000, 0x7E0000000000])


@pytest.mark.skipif(not PICKLES, reason="../shared/reference/external is not here")
@pytest.mark.parametrize("path", PICKLES, ids=lambda p: p.name)
def test_torch_chunk_table_real_snapshots(path):
    """Real snapshots written by PyTorch: the table tiles every segment, its in-use bytes are
    the segments' ``allocated_size``, and the views' own functions take it."""
    from gpudash.formats.torch_snapshot import load_torch_snapshot_dict

    segments = load_torch_snapshot_dict(path)["segments"]
    for device in sorted({s.get("device", 0) for s in segments}):
        segs = [s for s in segments if s.get("device", 0) == device]
        t = torch_chunk_table(segments, device=device)
        assert np.all(np.diff(t["ptr"]) > 0)  # address order, no overlap of starts
        # each region is tiled by its chunks, end to end
        for base, size in t["regions"].tolist():
            mine = t["region"] == base
            ptr, sz = t["ptr"][mine], t["size"][mine]
            assert ptr[0] == base and int(sz.sum()) == size
            assert np.array_equal(ptr[1:], (ptr + sz)[:-1])
        in_use = int(t["size"][t["in_use"]].sum())
        allocated = sum(int(b["size"]) for s in segs for b in s["blocks"]
                        if b["state"] in TORCH_ALLOCATED_STATES)
        assert in_use == allocated
        if all("allocated_size" in s for s in segs) and not any(
                b["state"] != "active_allocated" and b["state"] in TORCH_ALLOCATED_STATES
                for s in segs for b in s["blocks"]):
            assert in_use == sum(int(s["allocated_size"]) for s in segs)
        s = stats_from_table(t)
        assert s.pool_bytes == sum(int(x["total_size"]) for x in segs)
        assert 0.0 <= s.fragmentation <= 1.0
        # the heatmap column of the views: every in-use byte is counted once
        row_bytes = max(1, -(-s.pool_bytes // 256))
        col = heatmap_column(t, 256, row_bytes)
        assert col.sum() * row_bytes == pytest.approx(in_use, rel=1e-9)
        assert t["bin"][~t["in_use"]].max(initial=0) < NUM_BINS


def test_stats_from_table_keeps_counts_and_peaks():
    from gpudash.bfc import AllocatorStats

    t = torch_chunk_table(SEGMENTS, device=0)
    base = AllocatorStats(num_allocs=7, bytes_in_use=999, peak_bytes_in_use=10 * MiB,
                          bytes_limit=16 << 30, pool_bytes=1, peak_pool_bytes=30 * MiB)
    s = stats_from_table(t, base)
    assert (s.num_allocs, s.peak_bytes_in_use, s.bytes_limit, s.peak_pool_bytes) == (
        7, 10 * MiB, 16 << 30, 30 * MiB)
    assert (s.bytes_in_use, s.pool_bytes) == (1536, 2 * MiB)  # from the table, not the base
