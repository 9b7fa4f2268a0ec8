"""PyTorch's caching allocator model: the rules of PyTorch's CUDACachingAllocator.cpp as
TORCH_ALLOCATOR.md gives them (sizes, pools, best fit, splits, oversize rules, releases on
pressure, garbage collection, expandable segments, statistics, snapshot, OOM message)."""

from __future__ import annotations

import threading

import pytest

from gpudash import CachingAllocator, ConfigError, OutOfMemoryError, SimulatedDevice
from gpudash._errors import InvalidPointerError
from gpudash.caching import allocation_size, format_size, round_size
from gpudash._torch_conf import CachingAllocatorConfig

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

MiB = 1 << 20
GiB = 1 << 30


def make(conf: str | None = None, capacity: int = 16 * GiB, **kw) -> CachingAllocator:
    a = CachingAllocator(SimulatedDevice(capacity), conf, **kw)
    a.record_history(True)
    return a


def seg_events(a: CachingAllocator) -> list[tuple[str, int]]:
    snap = a.snapshot()
    return [(e["action"], e["size"]) for e in snap["device_traces"][a.device]
            if e["action"].startswith("segment")]


# ------------------------------------------------------------------ sizes
def test_round_size_512_and_its_guard():
    c = CachingAllocatorConfig()
    assert round_size(1, c) == 512
    assert round_size(512, c) == 512
    assert round_size(513, c) == 1024
    # the code comment's "1200 with 4 divisions -> 1280" never happens: the division path
    # needs size > 512 * divisions, so 1200 is 512-rounded
    c4 = CachingAllocatorConfig("roundup_power2_divisions:4")
    assert round_size(1200, c4) == 1536
    assert round_size(1_500_000, c4) == 1_572_864      # 1 MiB + 2 x 256 KiB
    assert round_size(1 << 21, c4) == 1 << 21          # powers of two stay
    assert round_size(3 * MiB + 1, c4) == 3 * MiB + 512 * 1024  # step 512 KiB in [2, 4) MiB


def test_divisions_of_one_leave_sizes_unrounded_before_2_4():
    old = CachingAllocatorConfig("roundup_power2_divisions:[1:1]", version="2.3")
    new = CachingAllocatorConfig("roundup_power2_divisions:[1:1]", version="2.4")
    assert round_size(1_000_001, old) == 1_000_001
    assert round_size(1_000_001, new) == 1_000_448


def test_allocation_size_table():
    assert allocation_size(512) == 2 * MiB
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB                  # not 20 MiB
    c = CachingAllocatorConfig()
    assert allocation_size(round_size(10 * MiB - 511, c)) == 10 * MiB
    assert allocation_size(round_size(10485247, c)) == 20 * MiB   # 10 MiB - 513
    assert allocation_size(11 * MiB + 1) == 12 * MiB


def test_format_size_is_pytorchs():
    assert format_size(1024) == "1024 bytes"
    assert format_size(1025) == "1.00 KiB"
    assert format_size(2 * MiB) == "2.00 MiB"
    assert format_size(int(2.5 * GiB)) == "2.50 GiB"


# ------------------------------------------------------------------ settings
def test_roundup_list_form_and_the_greater_key_by_version():
    conf = "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"
    old = CachingAllocatorConfig(conf, version="2.7").roundup_power2_divisions
    assert old == (1,) * 9 + (2, 8) + (8,) * 5          # '>' overwrites the last key
    new = CachingAllocatorConfig(conf, version="2.11").roundup_power2_divisions
    assert new == (1,) * 9 + (2, 4) + (8,) * 5
    # PyTorch 2.11's snapshot of [1:4,64:8,256:2,>:1]: gaps stay 0
    got = CachingAllocatorConfig("roundup_power2_divisions:[1:4,64:8,256:2,>:1]"
                                 ).snapshot_settings()["roundup_power2_divisions"]
    assert got == {"1": 4, "2": 0, "4": 0, "8": 0, "16": 0, "32": 0, "64": 8, "128": 0,
                   "256": 2, "512": 1, "1024": 1, "2048": 1, "4096": 1, "8192": 1,
                   "16384": 1, "32768": 1}
    # PyTorch 2.8's unit test
    c = CachingAllocatorConfig("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]")
    assert c.divisions_for(1024 * MiB) == 4 and c.divisions_for(2048 * MiB) == 1


@pytest.mark.parametrize("conf, words", [
    ("max_split_size_mb:20", "too small"),
    ("max_split_size_mb:abc", "integer number of MiB"),
    ("expandable_segments:true", "True or False"),
    ("garbage_collection_threshold:1.0", "(0.0, 1.0)"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[100:2]", "not a power of 2"),
    ("bogus_key:1", "unrecognized key 'bogus_key'"),
    ("max_split_size_mb 128", "unrecognized key"),
    ("max_split_size_mb:", "needs a value"),
    ("expandable_segments:True;max_split_size_mb:200", "takes True or False"),
    ("backend:cudaMallocAsync", "not the caching allocator"),
])
def test_bad_conf_strings_name_the_key(conf, words):
    with pytest.raises(ConfigError) as exc:
        CachingAllocatorConfig(conf, version="2.7")
    assert words in str(exc.value)
    assert "PYTORCH_CUDA_ALLOC_CONF" in str(exc.value)


def test_conf_versions_know_their_keys():
    assert CachingAllocatorConfig("max_split_size_mb:20", version="2.8").max_split_size == \
        20 * MiB
    with pytest.raises(ConfigError, match="came in 2.1"):
        CachingAllocatorConfig("expandable_segments:True", version="2.0")
    with pytest.raises(ConfigError, match="came in 2.6"):
        CachingAllocatorConfig("max_non_split_rounding_mb:64", version="2.5")
    c = CachingAllocatorConfig(" max_split_size_mb : 128 , expandable_segments:True ")
    assert (c.max_split_size, c.expandable_segments) == (128 * MiB, True)
    assert CachingAllocatorConfig.from_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:"
                                            "True"}).expandable_segments


def test_settings_strings_reset_three_keys_as_pytorch_does():
    a = make("max_split_size_mb:128,expandable_segments:True,garbage_collection_threshold:0.5")
    a.set_allocator_settings("roundup_power2_divisions:4")
    c = a.config
    assert c.max_split_size is None and c.garbage_collection_threshold == 0.0
    assert c.expandable_segments is True and c.roundup_power2_divisions == (4,) * 16
    with pytest.raises(ConfigError):
        a.set_allocator_settings("max_split_size_mb:5")
    assert a.config == c   # nothing applied


def test_snapshot_settings_round_trip():
    c = CachingAllocatorConfig("max_split_size_mb:256,garbage_collection_threshold:0.7,"
                               "expandable_segments:True,roundup_power2_divisions:[1:4,>:2]")
    back = CachingAllocatorConfig.from_snapshot_settings(c.snapshot_settings())
    assert back == c
    assert CachingAllocatorConfig(c.as_conf()) == c


# ------------------------------------------------------------------ pools and best fit
def test_small_requests_share_a_2mib_segment_and_best_fit_takes_the_lowest_address():
    a = make()
    ps = [a.allocate(4096) for _ in range(4)]
    assert seg_events(a) == [("segment_alloc", 2 * MiB)]
    assert ps == sorted(ps) and ps[1] - ps[0] == 4096
    a.deallocate(ps[0])
    a.deallocate(ps[2])            # two free 4 KiB holes; the lower one wins
    assert a.allocate(4096) == ps[0]
    a.check()


def test_a_large_block_with_exactly_1mib_left_is_not_split():
    a = make()
    p = a.allocate(19 * MiB)           # a 20 MiB segment; 1 MiB left: not split
    assert a.allocated_size(p) == 20 * MiB
    assert a.memory_stats()["allocated_bytes.all.current"] == 20 * MiB
    a.deallocate(p)
    q = a.allocate(19 * MiB - 512)     # 1 MiB + 512 left: split
    assert a.allocated_size(q) == 19 * MiB - 512
    a.check()


def test_small_blocks_split_down_to_512_bytes():
    a = make()
    p1 = a.allocate(MiB)               # a 2 MiB small segment, 1 MiB left: split
    p2 = a.allocate(MiB - 1000)        # rounds to 1 MiB - 512: 512 bytes left, split
    assert a.allocated_size(p2) == MiB - 512 and p2 == p1 + MiB
    q = a.allocate(1)
    assert q == p2 + MiB - 512 and a.allocated_size(q) == 512
    assert len(a.segments()) == 1
    a.check()


def test_oversize_rules():
    a = make("max_split_size_mb:128")
    big = a.allocate(200 * MiB)
    a.deallocate(big)
    p = a.allocate(100 * MiB)                    # < MSS may not take the 200 MiB block
    assert p != big and len(a.segments()) == 2
    a.deallocate(p)
    a.empty_cache()
    a.allocate(160 * MiB)
    q = a.allocate(164 * MiB)
    r = a.allocate(180 * MiB)
    a.deallocate(q)
    a.deallocate(r)
    # 150 MiB takes a cached oversize block below 150 + 20 MiB, unsplit
    s = a.allocate(150 * MiB)
    assert s == q and a.allocated_size(s) == 164 * MiB
    assert a.memory_stats()["oversize_allocations.current"] == 2
    # 160 MiB + 20 MiB = 180 MiB: the 180 MiB block is one byte too far (strictly below)
    t = a.allocate(160 * MiB)
    assert t != r
    a.check()


def test_max_non_split_rounding_widens_the_tolerance():
    a = make("max_split_size_mb:100,max_non_split_rounding_mb:600")
    b = a.allocate(1024 * MiB)
    a.deallocate(b)
    assert a.allocate(500 * MiB) == b           # 500 + 600 > 1024 (PR #136174's example)
    c = make("max_split_size_mb:100")
    b = c.allocate(1024 * MiB)
    c.deallocate(b)
    assert c.allocate(500 * MiB) != b


def test_empty_cache_frees_whole_segments_large_first_in_size_order():
    a = make()
    keep = a.allocate(4096)
    small = a.allocate(1 << 20)       # a second small block in the same segment
    l2 = a.allocate(30 * MiB)
    l1 = a.allocate(12 * MiB)
    l3 = a.allocate(12 * MiB)
    for p in (l2, l1, l3, small):
        a.deallocate(p)
    a.snapshot()
    a.record_history(True)
    a.empty_cache()
    events = [(e["action"], e["size"], e["addr"]) for e in a.snapshot()["device_traces"][0]
              if e["action"] == "segment_free"]
    assert [s for _, s, _ in events] == [12 * MiB, 12 * MiB, 30 * MiB]  # the split small
    assert events[0][2] < events[1][2]                                  # segment stays
    assert a.memory_stats()["num_sync_all_streams"] == 1
    a.deallocate(keep)
    a.check()


def test_fraction_refuses_segments_and_pressure_releases_cached_ones():
    a = make(capacity=GiB, fraction=0.5)              # 512 MiB allowed
    assert a.memory_limit == GiB // 2
    p = a.allocate(300 * MiB)
    q = a.allocate(100 * MiB)
    a.deallocate(p)
    r = a.allocate(350 * MiB)         # 100 + 350 fits only once the 300 MiB segment goes
    traces = [e["action"] for e in a.snapshot()["device_traces"][0]]
    assert traces[-4:-1] == ["segment_free", "segment_alloc", "alloc"]
    st = a.memory_stats()
    assert st["num_alloc_retries"] == 1 and st["reserved_bytes.all.current"] == 450 * MiB
    with pytest.raises(OutOfMemoryError) as exc:
        a.allocate(100 * MiB)
    msg = str(exc.value)
    assert msg.startswith("CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a total "
                          "capacity of 1024.00 MiB of which ")
    assert "512.00 MiB allowed; Of the allocated memory 450.00 MiB is allocated by PyTorch, and" \
           " 0 bytes is reserved by PyTorch but unallocated." in msg
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in msg
    assert a.memory_stats()["num_ooms"] == 1
    a.deallocate(q)
    a.deallocate(r)
    a.check()


def test_oom_message_wording_by_version():
    for version, words in (("1.13", "reserved in total by PyTorch)"),
                           ("2.1", "total capacty of"),
                           ("2.4", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
                           ("1.3", "cached)")):
        a = make(capacity=64 * MiB, version=version)
        with pytest.raises(OutOfMemoryError) as exc:
            a.allocate(100 * MiB)
        assert words in str(exc.value), version
    with pytest.raises(OutOfMemoryError, match="more than 1EB"):
        make().allocate(1 << 60)


def test_release_available_cached_blocks_frees_oversize_blocks_before_everything():
    a = make("max_split_size_mb:64", capacity=GiB, fraction=1.0)
    blocks = [a.allocate(n * MiB) for n in (100, 120, 140)]
    small = a.allocate(10 * MiB)
    for p in blocks:
        a.deallocate(p)
    a.deallocate(small)
    a.record_history(False)
    a.record_history(True)
    # 700 MiB: 370 + 700 > 1 GiB. No single oversize block covers it, so oversize blocks go
    # from the largest down (360 MiB < 700: not enough, and they stay released), then
    # everything else; the retry fits
    p = a.allocate(700 * MiB)
    events = [(e["action"], e["size"] >> 20) for e in a.snapshot()["device_traces"][0]]
    assert events[:6] == [("segment_free", 140), ("segment_free", 120), ("segment_free", 100),
                          ("segment_free", 10), ("segment_alloc", 700), ("alloc", 700)]
    assert a.memory_stats()["num_alloc_retries"] == 1
    a.deallocate(p)
    q = a.allocate(200 * MiB)          # may not take the 700 MiB block (>= 200 + 20 MiB)
    a.deallocate(q)
    # the smallest oversize block that covers 300 MiB goes (700), nothing else, no retry
    a.allocate(300 * MiB)
    frees = [e["size"] >> 20 for e in a.snapshot()["device_traces"][0]
             if e["action"] == "segment_free"]
    assert frees[4:] == [700] and a.memory_stats()["num_alloc_retries"] == 1
    assert sorted(s["total_size"] >> 20 for s in a.segments()) == [200, 300]
    a.check()


def test_garbage_collection_frees_aged_blocks_only_with_a_fraction():
    def run(**kw):
        a = make("garbage_collection_threshold:0.5", capacity=GiB, **kw)
        first = a.allocate(150 * MiB)
        a.allocate(100 * MiB)
        a.deallocate(first)            # cached whole: GC may free it once it has aged
        a.allocate(200 * MiB)          # a large-pool lookup that misses it: age 1
        a.allocate(160 * MiB)          # age 2; reserved 450 MiB > 0.5 x 512 MiB: GC
        return a

    a = run(fraction=0.5)
    events = [(e["action"], e["size"] >> 20) for e in a.snapshot()["device_traces"][0]]
    assert events[-4:-1] == [("segment_free", 150), ("segment_alloc", 160), ("alloc", 160)]
    assert a.memory_stats()["num_alloc_retries"] == 0      # no refusal: GC came first
    b = run()                                               # no fraction: no GC
    assert b.memory_stats()["segment.all.current"] == 4
    a.check()
    b.check()


# ------------------------------------------------------------------ expandable segments
def test_expandable_segments_map_20mib_pages():
    a = make("expandable_segments:True")
    ps = [a.allocate(16 * MiB) for _ in range(8)]
    st = a.memory_stats()
    assert st["reserved_bytes.all.current"] == 140 * MiB          # 7 pages for 128 MiB
    assert st["segment.all.current"] == 0                         # maps do not count
    assert len(a.segments()) == 1 and a.segments()[0]["is_expandable"]
    plain = make()
    for _ in range(8):
        plain.allocate(16 * MiB)
    assert plain.memory_stats()["reserved_bytes.all.current"] == 128 * MiB
    for p in ps:
        a.deallocate(p)
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0
    assert a.segments() == []
    a.check()


def test_expandable_unmaps_whole_pages_only_and_leaves_slivers():
    a = make("expandable_segments:True")
    p1 = a.allocate(30 * MiB)
    p2 = a.allocate(30 * MiB)       # 60 MiB mapped (3 pages)
    a.deallocate(p1)                # [0, 30) free: only page 0 is whole inside it
    a.record_history(True)
    a.empty_cache()
    unmaps = [(e["addr"], e["size"]) for e in a.snapshot()["device_traces"][0]
              if e["action"] == "segment_unmap"]
    assert unmaps == [(p1, 20 * MiB)]
    segs = a.segments()
    assert [s["total_size"] for s in segs] == [40 * MiB]          # one mapped range left
    assert [b["size"] for b in segs[0]["blocks"]] == [10 * MiB, 30 * MiB]
    a.deallocate(p2)
    a.check()


def test_max_split_with_expandable_fails_as_pytorch_does():
    a = make("expandable_segments:True,max_split_size_mb:100", capacity=GiB, fraction=0.5)
    p = a.allocate(200 * MiB)
    a.deallocate(p)
    with pytest.raises(Exception, match="123548"):
        a.allocate(400 * MiB)


# ------------------------------------------------------------------ streams
def test_streams_do_not_share_cached_blocks():
    a = make()
    p = a.allocate(4096, stream=0)
    a.deallocate(p)
    q = a.allocate(4096, stream=7)
    assert q != p and len(a.segments()) == 2
    assert {s["stream"] for s in a.segments()} == {0, 7}
    r = a.allocate(4096, stream=0)
    assert r == p
    a.check()


# ------------------------------------------------------------------ statistics and layout
def test_memory_stats_have_pytorchs_keys_and_meanings():
    a = make()
    p = a.allocate(1000)
    q = a.allocate(5 * MiB)
    st = a.memory_stats()
    assert st["allocated_bytes.all.current"] == 1024 + 5 * MiB
    assert st["allocated_bytes.small_pool.current"] == 1024
    assert st["reserved_bytes.large_pool.current"] == 20 * MiB
    assert st["requested_bytes.all.current"] == 1000 + 5 * MiB
    assert st["inactive_split_bytes.all.current"] == (2 * MiB - 1024) + 15 * MiB
    assert st["max_split_size"] == -1
    assert list(st) == sorted(st)
    a.deallocate(p)
    a.deallocate(q)
    st = a.memory_stats()
    assert st["allocated_bytes.all.peak"] == 1024 + 5 * MiB
    assert st["allocation.all.allocated"] == 2 and st["allocation.all.freed"] == 2
    assert st["inactive_split_bytes.all.current"] == 0
    assert "Non-releasable memory" in a.memory_summary()


def test_snapshot_is_pytorchs_layout_with_device_traces():
    a = make(device=1)
    a.record_history(True)
    p = a.allocate(1000)
    a.deallocate(p)
    a.empty_cache()
    q = a.allocate(3 * MiB)
    snap = a.snapshot()
    assert set(snap) == {"segments", "device_traces", "allocator_settings",
                         "external_annotations"}
    actions = [e["action"] for e in snap["device_traces"][1]]
    assert actions == ["segment_alloc", "alloc", "free_requested", "free_completed",
                       "segment_free", "segment_alloc", "alloc", "snapshot"]
    seg = snap["segments"][0]
    assert (seg["device"], seg["segment_type"], seg["total_size"]) == (1, "large", 20 * MiB)
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [
        (3 * MiB, "active_allocated"), (17 * MiB, "inactive")]
    assert seg["blocks"][0]["address"] == q
    assert snap["allocator_settings"]["max_split_size"] == -1


def test_invalid_pointers():
    a = make()
    p = a.allocate(1000)
    with pytest.raises(InvalidPointerError, match="not the start"):
        a.deallocate(p + 512)
    with pytest.raises(InvalidPointerError, match="invalid device pointer"):
        a.deallocate(12345)
    a.deallocate(p)
    with pytest.raises(InvalidPointerError, match="already freed"):
        a.deallocate(p)
    a.deallocate(0)
    with pytest.raises(InvalidPointerError):
        a.deallocate(None)


def test_check_finds_a_broken_state():
    a = make()
    p = a.allocate(1000)
    a._blocks[p].size += 512
    with pytest.raises(AssertionError, match="invariant broken"):
        a.check()


def test_threads_keep_the_state_consistent():
    a = make(capacity=4 * GiB)
    errors = []

    def work(seed: int) -> None:
        import random

        rng = random.Random(seed)
        live = []
        try:
            for _ in range(2000):
                if live and rng.random() < 0.5:
                    a.deallocate(live.pop(rng.randrange(len(live))))
                else:
                    live.append(a.allocate(rng.choice((512, 4096, 2 * MiB, 12 * MiB))))
            for p in live:
                a.deallocate(p)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    a.check()
    assert a.memory_stats()["allocated_bytes.all.current"] == 0


def test_events_and_recorder():
    from gpudash import Recorder
    from gpudash.events import EventKind

    a = make()
    seen = []
    a.subscribe(lambda ev: seen.append((ev.kind, ev.size)))
    rec = Recorder(a)
    p = a.allocate(5 * MiB)
    a.deallocate(p)
    a.empty_cache()
    kinds = [k for k, _ in seen]
    assert kinds == [EventKind.EXTEND, EventKind.SPLIT, EventKind.ALLOC, EventKind.FREE,
                     EventKind.MERGE, EventKind.RELEASE]
    assert seen[0][1] == 20 * MiB and seen[2][1] == 5 * MiB
    trace = rec.to_trace()
    assert [str(k) for k in trace.columns["kind"].tolist()] == [str(int(k)) for k in kinds]
