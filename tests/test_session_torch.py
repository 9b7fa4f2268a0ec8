"""A session with PyTorch's semantics (TorchSession): PyTorch's caching allocator on every
device, configured from PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, frees at once, the
settings PyTorch takes live changed as it takes them, and what it records replayed and
reported through the same model.

Every test checks the session against a bare CachingAllocator given the same calls: the
session adds no decisions of its own.
"""

from __future__ import annotations

import random
from html import unescape

import pytest

import gpudash
from gpudash import BackendUnavailableError, CachingAllocator, ConfigError, SimulatedDevice
from gpudash.models import TORCH, trace_model
from gpudash.session import TorchDevice, TorchSession

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

MIB = 1 << 20
GIB = 1 << 30


@pytest.fixture
def sess():
    s = gpudash.Session("expandable_segments:True", allocator="torch", simulate="16GiB")
    yield s
    s.close()


def _layout(alloc) -> list:
    return [(s["address"], s["total_size"], s["segment_type"], s["is_expandable"],
             [(b["size"], b["state"]) for b in s["blocks"]]) for s in alloc.segments()]


def _churn(allocate, free, n: int = 300, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    live: list[int] = []
    for _ in range(n):
        if live and rng.random() < 0.45:
            free(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(allocate(rng.choice([700, 4000, 2 * MIB, 5 * MIB, 30 * MIB,
                                                 90 * MIB, 300 * MIB])))
            except gpudash.OutOfMemoryError:
                pass
    return live


# ------------------------------------------------------------------------------ making one
def test_session_with_allocator_torch_is_a_torch_session(sess):
    assert isinstance(sess, TorchSession) and isinstance(sess, gpudash.Session)
    assert sess.framework == "torch" and sess.model is TORCH
    dev = sess.devices[0]
    assert isinstance(dev, TorchDevice) and dev.name == "cuda:0"
    alloc = dev.allocator
    assert isinstance(alloc, CachingAllocator) and alloc.name == "cuda:0"
    assert alloc.config.expandable_segments and alloc.fraction is None
    assert dev.memory_limit == 16 * GIB  # no fraction: the whole device, as in PyTorch
    assert sess.config.as_conf() == "expandable_segments:True"
    assert repr(sess) == ("TorchSession(1 simulated device(s), open, "
                          "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True')")
    # the aliases, a CachingAllocatorConfig, a dict of settings
    for config in (gpudash.CachingAllocatorConfig("max_split_size_mb:128"),
                   {"max_split_size_mb": 128}, "max_split_size_mb:128"):
        with gpudash.Session(config, allocator="pytorch", simulate="1GiB") as s:
            assert s.devices[0].allocator.config.max_split_size == 128 * MIB
    # a plain session is TensorFlow's, as before
    with gpudash.Session(simulate="1GiB", allocator="bfc") as s:
        assert type(s) is gpudash.Session and s.model.name == "bfc"


def test_from_env_reads_pytorch_s_variables_and_the_newer_name_wins():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "GPUDASH_SIMULATE": "2x4GiB",
           "TF_FORCE_GPU_ALLOW_GROWTH": "false"}  # TensorFlow's: ignored, as PyTorch does
    with gpudash.Session.from_env("torch", environ=env) as s:
        assert isinstance(s, TorchSession) and len(s.devices) == 2
        assert s.config.as_conf() == "max_split_size_mb:64"
        assert [d.total for d in s.devices] == [4 * GIB] * 2
    env["PYTORCH_ALLOC_CONF"] = "garbage_collection_threshold:0.5"  # PyTorch 2.9's name
    with gpudash.Session.from_env("pytorch", environ=env, simulate="1GiB",
                                  torch_version="2.9") as s:
        assert s.config.as_conf() == "garbage_collection_threshold:0.5"
        assert s.config.version == (2, 9)
    # PyTorch with no variable: its defaults
    with gpudash.Session.from_env("torch", environ={}, simulate="1GiB") as s:
        assert s.config.as_conf() == ""


def test_bad_settings_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="max_split_size_mb"):
        gpudash.Session.from_env("torch", environ={"PYTORCH_CUDA_ALLOC_CONF":
                                                   "max_split_size_mb:10"}, simulate="1GiB")
    with pytest.raises(ConfigError, match="bogus"):
        gpudash.Session("bogus:1", allocator="torch", simulate="1GiB")
    with pytest.raises(ConfigError, match="ConfigProto and GPUOptions are TensorFlow's"):
        gpudash.Session(gpudash.ConfigProto(), allocator="torch", simulate="1GiB")
    with pytest.raises(ConfigError, match="config= is for TensorFlow sessions"):
        gpudash.Session.from_env("torch", config=gpudash.ConfigProto())
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        gpudash.Session(allocator="torch", simulate="1GiB", fraction=1.5)
    with pytest.raises(ConfigError, match="allocator must be one of"):
        gpudash.Session(allocator="cupy", simulate="1GiB")


# ------------------------------------------------------------------------------ using one
def test_frees_reach_the_allocator_at_once_and_decisions_are_the_model_s(sess):
    """No deferred deletion: a freed block serves the next request at once, as in PyTorch;
    the same calls on a bare allocator end in the same layout."""
    bare = CachingAllocator(SimulatedDevice("16GiB"), "expandable_segments:True")
    for allocate, free in ((sess.allocate, sess.free), (bare.allocate, bare.deallocate)):
        p = allocate(30 * MIB)
        free(p)
        assert allocate(30 * MIB) == p  # the cached block, at once
        free(p)
        _churn(allocate, free)
    alloc = sess.devices[0].allocator
    assert _layout(alloc) == _layout(bare) and len(_layout(alloc)) > 1
    assert alloc.memory_stats() == bare.memory_stats()
    with pytest.raises(gpudash.InvalidPointerError):
        sess.free(p + 1)
    assert sess.flush() == 0 and sess.devices[0].deferred_bytes == 0


def test_out_of_memory_is_pytorch_s_and_counted_once():
    with gpudash.Session(allocator="torch", simulate="1GiB", fraction=0.5) as s:
        s.allocate(400 * MIB)
        with pytest.raises(gpudash.OutOfMemoryError, match="CUDA out of memory"):
            s.allocate(200 * MIB)
        st = s.devices[0].allocator.memory_stats()
        assert st["num_ooms"] == 1 and st["num_alloc_retries"] == 1


def test_configure_applies_settings_as_pytorch_takes_them_live():
    with gpudash.Session(allocator="torch", simulate="2x8GiB") as s:
        a0, a1 = (d.allocator for d in s.devices)
        old = s.allocate(50 * MIB)  # a plain cudaMalloc segment
        # the fraction: per device
        s.configure(fraction=0.25, device=1)
        assert a1.fraction == 0.25 and a1.memory_limit == 2 * GIB and a0.fraction is None
        s.configure(per_process_gpu_memory_fraction=0.5)
        assert a0.memory_limit == a1.memory_limit == 4 * GIB
        # the settings: process-wide, whatever device says; held segments stay as they are
        # PyTorch takes the two together, but does not support them: said, as it is said
        # by what-if and the dashboard
        with pytest.warns(gpudash.GpudashWarning, match="pytorch/pytorch#123548"):
            s.configure(expandable_segments=True, max_split_size_mb=256, device=0)
        for a in (a0, a1):
            assert a.config.as_conf() == "expandable_segments:True,max_split_size_mb:256"
        assert s.config.as_conf() == "expandable_segments:True,max_split_size_mb:256"
        new = s.allocate(50 * MIB)
        kinds = {seg["address"]: seg["is_expandable"] for seg in a0.segments()}
        assert kinds[old] is False and kinds[new] is True
        s.configure(max_split_size_mb=None)  # unset, the others kept
        assert a0.config.as_conf() == "expandable_segments:True"
        # conf= is _set_allocator_settings itself: what it leaves out goes back to its
        # default, except expandable segments (PyTorch's parseArgs)
        with pytest.warns(gpudash.GpudashWarning, match="123548"):
            s.configure(max_split_size_mb=128, garbage_collection_threshold=0.7)
        s.configure(conf="roundup_power2_divisions:4")
        assert a0.config.as_conf() == "expandable_segments:True,roundup_power2_divisions:4"
        # each change is an event the live views mark
        with gpudash.Recorder(a0) as rec:
            s.configure(garbage_collection_threshold=0.6)
        assert [x["setting"] for x in rec.settings()] == ["garbage_collection_threshold"]


def test_tensorflow_settings_and_bad_values_are_refused_and_change_nothing():
    with gpudash.Session(allocator="torch", simulate="8GiB", fraction=0.5) as s:
        a = s.devices[0].allocator
        with pytest.raises(ConfigError, match="allow_growth is TensorFlow's setting: PyTorch's "
                                              "caching allocator always grows on demand"):
            s.configure(allow_growth=True)
        with pytest.raises(ConfigError, match="deferred_deletion_bytes is TensorFlow's setting"
                                              ": PyTorch frees a block at once"):
            s.configure(deferred_deletion_bytes=1 << 20)
        # one bad value among good ones: nothing changes
        with pytest.raises(ConfigError, match="max_split_size_mb"):
            s.configure(fraction=0.25, expandable_segments=True, max_split_size_mb=5)
        with pytest.raises(ConfigError, match="garbage_collection_threshold"):
            s.configure(garbage_collection_threshold=1.5)
        with pytest.raises(ConfigError, match="not a setting of PyTorch's"):
            s.configure(bogus=1)
        with pytest.raises(ConfigError, match="disagree"):
            s.configure(fraction=0.2, per_process_gpu_memory_fraction=0.3)
        assert a.fraction == 0.5 and a.config.as_conf() == ""
        with pytest.raises(ConfigError, match="no GPUOptions"):
            s.gpu_options  # noqa: B018


def test_empty_cache_returns_wholly_free_segments_of_every_device():
    with gpudash.Session(allocator="torch", simulate="2x8GiB") as s:
        keep = s.allocate(30 * MIB)
        s.free(s.allocate(100 * MIB))
        s.free(s.allocate(20 * MIB, device=1))
        assert s.empty_cache() == 120 * MIB  # the 100 MiB and the 20 MiB segments
        assert [d.allocator.pool_bytes for d in s.devices] == [30 * MIB, 0]
        assert s.release_free_regions() == 0  # the BFC's name does the same
        s.free(keep)
        assert s.empty_cache(device=0) == 30 * MIB


def test_cupy_routing_is_refused_saying_why(sess):
    with pytest.raises(BackendUnavailableError, match="virtual addresses no CUDA mapping "
                                                      "backs"):
        sess.install()
    assert not sess.installed


def test_over_limit_and_settings_of_a_device():
    with gpudash.Session(allocator="torch", simulate="8GiB") as s:
        dev = s.devices[0]
        keep = s.allocate(3 * GIB)
        s.configure(fraction=0.25)  # 2 GiB: what is held stays
        assert dev.over_limit and dev.allocator.pool_bytes > dev.memory_limit
        assert dev.settings() == {"limit": 2 * GIB, "total": 8 * GIB, "fraction": 0.25,
                                  "allow_growth": None, "deferred_deletion_bytes": None,
                                  "expandable_segments": False, "max_split_size_mb": None,
                                  "garbage_collection_threshold": 0.0, "conf": ""}
        assert TORCH.pending_release(dev.allocator) == (3 * GIB - 2 * GIB + 0, 1)
        assert dev.settings_text() == ("cuda:0 fraction 0.25, limit 2.00 GiB, "
                                       "PYTORCH_CUDA_ALLOC_CONF='' (the defaults)")
        s.free(keep)
        assert not dev.over_limit


def test_a_closed_session_refuses_work(sess):
    p = sess.allocate(MIB)
    sess.close()
    with pytest.raises(ConfigError, match="closed"):
        sess.free(p)
    with pytest.raises(ConfigError, match="closed"):
        sess.configure(fraction=0.5)
    with pytest.raises(ConfigError, match="closed"):
        sess.empty_cache()
    assert sess.devices[0].allocator.pool_bytes == 0


# ------------------------------------------------------------------------------ recorded
def test_a_recording_replays_through_the_same_model_and_settings():
    """What a PyTorch session records is a PyTorch trace: replayed with the session's
    conf, fraction and device, it ends in the session's own layout (empty_cache included).

    (A release the allocator makes by itself under a fraction, before a request, is
    replayed as an empty_cache() call where it stands: a recording carries no marks of
    empty_cache() calls, so the replay is exact where none of those happen.)"""
    with gpudash.Session("max_split_size_mb:64", allocator="torch", simulate="16GiB",
                         fraction=0.9) as s:
        rec = gpudash.Recorder(s)
        _churn(s.allocate, s.free, n=400, seed=4)
        s.empty_cache()
        _churn(s.allocate, s.free, n=200, seed=5)
        rec.detach()  # as %%gpudash_track does, before it makes the trace
        trace = rec.to_trace()
        alloc = s.devices[0].allocator
        assert trace_model(trace) is TORCH
        result = gpudash.replay(trace)
        assert result.allocator == "torch" and result.assumed == []
        assert result.options["conf"] == "max_split_size_mb:64"
        assert result.options["fraction"] == 0.9 and result.memory_limit == alloc.memory_limit
        assert result.peak_pool_bytes == alloc.stats().peak_pool_bytes
        assert result.oom_count == alloc.memory_stats()["num_ooms"]
        replayed = [(x["address"], x["total_size"], [(b["size"], b["state"])
                                                     for b in x["blocks"]])
                    for x in result.snapshot["segments"]]
        assert replayed == [(a, t, blocks) for a, t, _, _, blocks in _layout(alloc)]


def test_the_report_of_a_session_is_in_pytorch_s_words(tmp_path):
    from gpudash.report import write_report

    with gpudash.Session("expandable_segments:True", allocator="torch",
                         simulate="4GiB") as s:
        rec = gpudash.Recorder(s)
        _churn(s.allocate, s.free, n=200, seed=6)
        s.configure(fraction=0.5)
        _churn(s.allocate, s.free, n=50, seed=7)
        rec.detach()
        path = write_report(rec.to_trace(), tmp_path / "r.html")
    html = unescape(path.read_text())
    for words in ("PyTorch's caching allocator", "PYTORCH_CUDA_ALLOC_CONF",
                  "expandable_segments:True", "peak reserved", "Segment map at the peak",
                  "Pool occupancy", "settings changed live", "fraction None\u21920.5"):
        assert words in html, words


def test_the_default_session_can_be_pytorch_s():
    from gpudash.session import default_session, set_default_session

    set_default_session(None)
    try:
        s = default_session(allocator="torch", simulate="1GiB")
        assert isinstance(s, TorchSession) and default_session() is s
    finally:
        s.close()
        set_default_session(None)


def test_a_live_max_split_that_would_free_a_segment_in_use_is_refused():
    """PyTorch releases oversize cached blocks with cudaFree without checking they are whole
    segments (release_available_cached_blocks relies on oversize blocks never being split).
    A max_split_size_mb lowered live below a split segment's free run breaks that: the
    model, as PyTorch, would free the segment while its other block is in use (the
    simulated device catches it). The session refuses that change, saying why; raising
    it, or a setting no split segment reaches, is taken."""
    MiB = 1 << 20
    with gpudash.Session(allocator="torch", simulate="1GiB", poll=False) as sess:
        a = sess.allocate(int(30.5 * MiB))      # a 32 MiB segment, 1.5 MiB left: split
        sess.allocate(int(1.2 * MiB))           # takes the rest: the segment stays split
        sess.free(a)
        dev = sess.devices[0]
        assert TORCH.split_hazard(dev.allocator.chunk_table(), None, 21 * MiB) == \
            [(dev.allocator.chunk_table()["regions"][0][0], 32 * MiB)]
        with pytest.raises(ConfigError, match=r"max_split_size_mb:21 live is not safe now: 1 "
                                               r"split segment\(s\) \(0x[0-9a-f]+ \(32.00 MiB\)"):
            sess.configure(max_split_size_mb=21)
        with pytest.raises(ConfigError, match="release_available_cached_blocks"):
            sess.configure(conf="max_split_size_mb:25")
        assert dev.allocator.config.max_split_size is None       # nothing changed
        sess.configure(max_split_size_mb=40)    # no split segment reaches 40 MiB: taken
        assert dev.allocator.config.max_split_size == 40 * MiB
        with pytest.raises(ConfigError, match="not safe now"):
            sess.configure(max_split_size_mb=30)
        sess.configure(max_split_size_mb=100)   # raised: always safe
        # what PyTorch itself does once it is taken (the model, directly): under pressure it
        # frees the split segment, and the device sees a free of a range still in use
        dev.allocator.set_memory_fraction(34 * MiB / dev.total)
        dev.allocator.set_allocator_settings("max_split_size_mb:21")
        with pytest.raises(ValueError, match="allocated with 33554432 bytes"):
            dev.allocator.try_allocate(5 * MiB)
