"""gpudash.Session: TensorFlow's ConfigProto/GPUOptions over BFC allocators, on simulated devices.

Every session here passes ``environ`` explicitly (or cleans ``os.environ`` with monkeypatch) so
that the runner's environment cannot change the result, and most use ``poll=False`` with
explicit ``sess.poll()`` calls so that deferred deletion is deterministic.
"""

from __future__ import annotations

import logging
import threading
import time
import types

import pytest

import gpudash
from gpudash import (
    ConfigError,
    ConfigProto,
    GPUOptions,
    GpudashWarning,
    InvalidPointerError,
    OutOfMemoryError,
    Recorder,
    Session,
)
from gpudash.devices import CudaMemory
from gpudash.events import EventKind

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

ENV_VARS = ("GPUDASH_SIMULATE", "TF_FORCE_GPU_ALLOW_GROWTH", "TF_ENABLE_GPU_GARBAGE_COLLECTION",
            "TF_DEVICE_MIN_SYS_MEMORY_IN_MB", "CUDA_VISIBLE_DEVICES")


@pytest.fixture
def make():
    """Session factory: simulated 16 GiB, empty environment, no poller; closes what it made."""
    made: list[Session] = []

    def _make(config=None, **kw):
        kw.setdefault("environ", {})
        kw.setdefault("simulate", "16GiB")
        kw.setdefault("poll", False)
        sess = Session(config, **kw)
        made.append(sess)
        return sess

    yield _make
    for sess in made:
        sess.close()


@pytest.fixture
def no_cuda(monkeypatch):
    """Make the CUDA probe say no (so fallback tests mean the same on a GPU machine) and
    clean the environment variables a Session reads."""
    monkeypatch.setattr(CudaMemory, "available", staticmethod(lambda: (False, "no CUDA (test)")))
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(gpudash.session, "_said_once", set())


def settings_named(rec, name):
    return [(s["old"], s["new"]) for s in rec.settings() if s["setting"] == name]


# ============================================================================ 1. config forms


def test_config_proto_as_the_seed_writes_it(make):
    config = gpudash.ConfigProto()
    config.gpu_options.per_process_gpu_memory_fraction = 0.5
    config.gpu_options.allow_growth = True
    config.gpu_options.allocator_type = "BFC"
    sess = make(config=config, simulate="16GiB")
    dev = sess.devices[0]
    assert len(sess.devices) == 1
    assert dev.total == 16 * GiB
    assert dev.memory_limit == 8 * GiB
    assert dev.allocator.allow_growth is True
    assert dev.allocator.curr_region_allocation_bytes == 2 * MiB
    assert type(dev.allocator) is gpudash.BFCAllocator
    assert dev.allocator.name == "GPU_0_bfc"
    assert sess.gpu_options.per_process_gpu_memory_fraction == 0.5
    # With growth the first allocation takes a 2 MiB region, not the limit.
    p = sess.allocate(MiB)
    assert dev.allocator.pool_bytes == 2 * MiB
    assert dev.allocator.allocated_size(p) == MiB


def test_session_copies_the_config(make):
    config = ConfigProto(gpu_options=GPUOptions(per_process_gpu_memory_fraction=0.5))
    sess = make(config)
    config.gpu_options.per_process_gpu_memory_fraction = 0.25
    assert sess.devices[0].memory_limit == 8 * GiB
    assert sess.gpu_options.per_process_gpu_memory_fraction == 0.5
    # .config / .gpu_options are copies: changing them changes nothing.
    sess.config.gpu_options.per_process_gpu_memory_fraction = 0.1
    sess.gpu_options.allow_growth = True
    assert sess.gpu_options.per_process_gpu_memory_fraction == 0.5
    assert sess.gpu_options.allow_growth is False


def test_session_does_not_share_the_callers_gpu_options(make):
    opts = GPUOptions(per_process_gpu_memory_fraction=0.5, allow_growth=True)
    with pytest.warns(GpudashWarning, match="TF_FORCE_GPU_ALLOW_GROWTH"):
        sess = make(opts, environ={"TF_FORCE_GPU_ALLOW_GROWTH": "false"})
    assert opts.allow_growth is True  # the environment override stays in the session
    assert sess.gpu_options.allow_growth is False
    opts.per_process_gpu_memory_fraction = 0.125
    assert sess.gpu_options.per_process_gpu_memory_fraction == 0.5
    assert sess.devices[0].memory_limit == 8 * GiB


@pytest.mark.parametrize("form", ["gpu_options", "gpu_dict", "config_dict", "tf_config",
                                  "tf_gpu_options"])
def test_config_forms(make, form):
    fields = {"per_process_gpu_memory_fraction": 0.5, "allow_growth": True}
    config = {
        "gpu_options": GPUOptions(**fields),
        "gpu_dict": dict(fields),
        "config_dict": {"gpu_options": dict(fields), "log_device_placement": False},
        "tf_config": types.SimpleNamespace(
            gpu_options=types.SimpleNamespace(**fields), allow_soft_placement=True,
            log_device_placement=False),
        "tf_gpu_options": types.SimpleNamespace(**fields),
    }[form]
    sess = make(config)
    dev = sess.devices[0]
    assert dev.memory_limit == 8 * GiB
    assert dev.allocator.allow_growth is True
    assert dev.options.per_process_gpu_memory_fraction == 0.5
    assert sess.gpu_options == GPUOptions(**fields)


def test_tf_config_soft_placement_carried(make):
    tf_like = types.SimpleNamespace(
        gpu_options=types.SimpleNamespace(allow_growth=True), allow_soft_placement=True,
        log_device_placement=True)
    sess = make(tf_like)
    assert sess.config.allow_soft_placement is True
    assert sess.config.log_device_placement is True


# ============================================================================ 2. bad values


@pytest.mark.parametrize("field, value", [
    ("per_process_gpu_memory_fraction", -0.5),
    ("per_process_gpu_memory_fraction", float("nan")),
    ("allow_growth", "yes"),
    ("deferred_deletion_bytes", -1),
    ("allocator_type", "cuda_malloc_async"),
    ("visible_device_list", "0;1"),
])
def test_bad_field_value_names_field_and_value(field, value):
    config = ConfigProto()
    with pytest.raises(ConfigError) as info:
        setattr(config.gpu_options, field, value)
    assert isinstance(info.value, ValueError)
    assert field in str(info.value)
    assert repr(value) in str(info.value) or str(value) in str(info.value)


@pytest.mark.parametrize("config", [
    {"allow_growth": "yes"},
    {"per_process_gpu_memory_fraction": -1},
    {"gpu_options": {"allow_growth": True}, "bogus": 1},
    {"no_such_field": 1},
    42,
    "allow_growth",
])
def test_bad_config_refused_by_session(config):
    with pytest.raises(ConfigError):
        Session(config, simulate="16GiB", environ={}, poll=False)


def test_bad_simulate_refused():
    with pytest.raises(ConfigError):
        Session(simulate="lots", environ={}, poll=False)
    with pytest.raises(ConfigError):
        Session(environ={"GPUDASH_SIMULATE": "0x16GiB"}, poll=False)


def test_refused_configure_changes_nothing(make):
    sess = make({"per_process_gpu_memory_fraction": 0.5})
    dev = sess.devices[0]
    rec = Recorder(sess)
    p = sess.allocate(MiB)
    before = (dev.memory_limit, dev.allocator.pool_bytes, dev.options, sess.gpu_options,
              dev._deferred.threshold)
    with pytest.raises(ConfigError) as info:
        sess.configure(per_process_gpu_memory_fraction=0.3, deferred_deletion_bytes=-1)
    assert "deferred_deletion_bytes" in str(info.value) and "-1" in str(info.value)
    with pytest.raises(ConfigError) as info:
        sess.configure(per_process_gpu_memory_fraction=0.3, allow_growth="yes")
    assert "allow_growth" in str(info.value) and "yes" in str(info.value)
    with pytest.raises(ConfigError) as info:
        sess.configure(per_process_gpu_memory_fraction=-0.3)
    assert "per_process_gpu_memory_fraction" in str(info.value) and "-0.3" in str(info.value)
    # Oversubscribing needs unified memory, which only a fraction > 1 at creation gives.
    with pytest.raises(ConfigError) as info:
        sess.configure(per_process_gpu_memory_fraction=1.5, deferred_deletion_bytes=1 << 20)
    assert "1.5" in str(info.value)
    after = (dev.memory_limit, dev.allocator.pool_bytes, dev.options, sess.gpu_options,
             dev._deferred.threshold)
    assert after == before
    assert dev.memory_limit == 8 * GiB
    assert rec.settings() == []
    assert dev.allocator.allocated_size(p) == MiB


def test_refused_configure_on_one_device_changes_no_other(make):
    sess = make({"per_process_gpu_memory_fraction": 0.5}, simulate="2x16GiB")
    with pytest.raises(ConfigError):
        sess.configure(per_process_gpu_memory_fraction=2.0)
    assert [d.memory_limit for d in sess.devices] == [8 * GiB, 8 * GiB]
    with pytest.raises(ConfigError):
        sess.configure(per_process_gpu_memory_fraction=0.25, device=7)
    assert [d.memory_limit for d in sess.devices] == [8 * GiB, 8 * GiB]


# ============================================================================ 3. environment


def force_growth_session(env_value, growth):
    environ = {} if env_value is None else {"TF_FORCE_GPU_ALLOW_GROWTH": env_value}
    opts = GPUOptions(per_process_gpu_memory_fraction=0.5, allow_growth=growth)
    return Session(opts, simulate="4GiB", environ=environ, poll=False)


@pytest.mark.parametrize("env_value, growth, expected, warns", [
    (None, True, 2 << 20, False),
    ("unparseable", True, 2 << 20, True),
    ("true", False, 2 << 20, True),
    ("false", True, 1 << 31, True),
])
def test_force_allow_growth(env_value, growth, expected, warns):
    """BFC.md §11.2 ForceAllowGrowth, limit 1 << 31 (fraction 0.5 of a 4 GiB device)."""
    if warns:
        with pytest.warns(GpudashWarning, match="TF_FORCE_GPU_ALLOW_GROWTH"):
            sess = force_growth_session(env_value, growth)
    else:
        sess = force_growth_session(env_value, growth)  # GpudashWarning is an error here
    try:
        alloc = sess.devices[0].allocator
        assert alloc.memory_limit == 1 << 31
        assert alloc.curr_region_allocation_bytes == expected
        effective = expected == 2 << 20
        assert alloc.allow_growth is effective
        assert sess.devices[0].options.allow_growth is effective
        assert sess.gpu_options.allow_growth is effective
    finally:
        sess.close()


@pytest.mark.parametrize("env_value, expected", [(None, True), ("false", False),
                                                 ("true", True)])
def test_garbage_collection_env(make, env_value, expected):
    environ = {} if env_value is None else {"TF_ENABLE_GPU_GARBAGE_COLLECTION": env_value}
    sess = make(environ=environ, simulate="2x1GiB")
    assert [a.garbage_collection for a in sess.allocators] == [expected, expected]


def test_garbage_collection_env_unparseable_warns():
    with pytest.warns(GpudashWarning, match="TF_ENABLE_GPU_GARBAGE_COLLECTION"):
        sess = Session(simulate="1GiB", environ={"TF_ENABLE_GPU_GARBAGE_COLLECTION": "maybe"},
                       poll=False)
    assert sess.devices[0].allocator.garbage_collection is True
    sess.close()


def test_gpudash_simulate_env(make):
    sess = make(simulate=None, environ={"GPUDASH_SIMULATE": "2x16GiB"})
    assert len(sess.devices) == 2
    assert [d.total for d in sess.devices] == [16 * GiB, 16 * GiB]
    assert [d.kind for d in sess.devices] == ["simulated", "simulated"]
    assert sess.simulated
    # An explicit config without soft placement is fine: the environment asked for simulation.
    sess2 = make(ConfigProto(), simulate=None, environ={"GPUDASH_SIMULATE": "8GiB,16GiB"})
    assert [d.total for d in sess2.devices] == [8 * GiB, 16 * GiB]


def test_simulate_argument_forms(make):
    assert [d.total for d in make(simulate=True).devices] == [16 * GiB]
    assert [d.total for d in make(simulate=8 * GiB).devices] == [8 * GiB]
    assert [d.total for d in make(simulate="3x2GiB").devices] == [2 * GiB] * 3
    assert [d.total for d in make(simulate=["1GiB", 2 * GiB]).devices] == [GiB, 2 * GiB]
    # simulate= wins over the environment.
    sess = make(simulate="1GiB", environ={"GPUDASH_SIMULATE": "2x16GiB"})
    assert [d.total for d in sess.devices] == [GiB]


# ============================================================================ 4. devices


def test_default_session_falls_back_and_says_so_once(no_cuda, caplog):
    caplog.set_level(logging.WARNING, logger="gpudash")
    sessions = [Session(), Session(poll=False)]
    try:
        for sess in sessions:
            assert len(sess.devices) == 1
            dev = sess.devices[0]
            assert dev.kind == "simulated" and sess.simulated
            assert dev.total == 16 * GiB
            assert dev.memory_limit == 16 * GiB - 1536 * MiB
        said = [r for r in caplog.records
                if r.name == "gpudash" and "simulated" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        assert said[0].levelno == logging.WARNING
        assert "no CUDA (test)" in said[0].getMessage()
    finally:
        for sess in sessions:
            sess.close()


def test_no_soft_placement_without_gpu_refuses(no_cuda):
    with pytest.raises(ConfigError) as info:
        Session(ConfigProto(allow_soft_placement=False), poll=False)
    msg = str(info.value)
    assert "simulate" in msg and "GPUDASH_SIMULATE" in msg
    with pytest.raises(ConfigError):
        Session(ConfigProto(), poll=False)


def test_soft_placement_without_gpu_falls_back(no_cuda, caplog):
    caplog.set_level(logging.WARNING, logger="gpudash")
    config = ConfigProto(allow_soft_placement=True)
    config.gpu_options.per_process_gpu_memory_fraction = 0.25
    sess = Session(config, poll=False)
    try:
        assert sess.simulated and len(sess.devices) == 1
        assert sess.devices[0].memory_limit == 4 * GiB
        assert any("simulated" in r.getMessage() for r in caplog.records)
    finally:
        sess.close()


def test_visible_device_list_maps_ids(make):
    config = ConfigProto()
    config.gpu_options.visible_device_list = "1,0"
    sess = make(config, simulate="2x16GiB")
    assert [d.index for d in sess.devices] == [0, 1]
    assert [d.visible_id for d in sess.devices] == [1, 0]
    assert [d.backend.index for d in sess.devices] == [1, 0]
    assert [a.name for a in sess.allocators] == ["GPU_0_bfc", "GPU_1_bfc"]
    assert [d.name for d in sess.devices] == ["/device:GPU:0", "/device:GPU:1"]
    # Sizes follow the visible id.
    sess2 = make({"visible_device_list": "1,0"}, simulate=["8GiB", "16GiB"])
    assert [d.total for d in sess2.devices] == [16 * GiB, 8 * GiB]
    # A subset.
    sess3 = make({"visible_device_list": "1"}, simulate="2x16GiB")
    assert [(d.index, d.visible_id) for d in sess3.devices] == [(0, 1)]
    assert [a.name for a in sess3.allocators] == ["GPU_0_bfc"]


@pytest.mark.parametrize("vdl", ["0,0", "5", "0,2", "-1", "a"])
def test_visible_device_list_invalid(vdl):
    with pytest.raises(ConfigError) as info:
        Session({"visible_device_list": vdl}, simulate="2x16GiB", environ={}, poll=False)
    assert "visible_device_list" in str(info.value)


def test_allocate_on_named_devices_and_free_finds_the_owner(make):
    sess = make(simulate="2x1GiB")
    p0 = sess.allocate(4 * KiB)
    p1 = sess.allocate(4 * KiB, device=1)
    p2 = sess.allocate(4 * KiB, device="GPU:1")
    p3 = sess.allocate(4 * KiB, device="/device:GPU:0")
    p4 = sess.allocate(4 * KiB, device=sess.devices[1])
    a0, a1 = sess.allocators
    assert all(a0.owns(p) for p in (p0, p3))
    assert all(a1.owns(p) for p in (p1, p2, p4))
    for p in (p0, p1, p2, p3, p4):
        sess.free(p)  # device found from the pointer
    assert a0.bytes_in_use == 8 * KiB and a1.bytes_in_use == 12 * KiB  # still queued
    sess.flush()
    assert a0.bytes_in_use == 0 and a1.bytes_in_use == 0
    for bad in (2, -1, "GPU:9", "gpu", 1.0, True):
        with pytest.raises(ConfigError):
            sess.allocate(256, device=bad)


def test_allocate_zero_and_free_zero(make):
    sess = make()
    assert sess.allocate(0) == 0
    sess.free(0)
    sess.free_now(0)
    assert sess.devices[0].deferred_bytes == 0


def test_free_of_unknown_pointer_raises(make):
    sess = make()
    p = sess.allocate(4096)
    with pytest.raises(InvalidPointerError):
        sess.free(p + 256)
    with pytest.raises(InvalidPointerError):
        sess.free(12345)
    assert sess.devices[0].deferred_bytes == 0
    sess.free_now(p)
    with pytest.raises(InvalidPointerError):
        sess.free(p)
    with pytest.raises(InvalidPointerError):
        sess.free_now(p)


def test_double_free_through_deferred_queue_is_refused(make):
    """A second sess.free of a pointer still waiting in the deferred queue must be refused
    at once (``free`` "validates the pointer now"); queuing it twice makes a later flush
    raise and drop the rest of the batch."""
    sess = Session(simulate="16GiB", environ={}, poll=False)
    try:
        p = sess.allocate(MiB)
        q = sess.allocate(MiB)
        sess.free(p)
        with pytest.raises(InvalidPointerError):
            sess.free(p)
        sess.free(q)
        sess.flush()  # must not raise
        assert sess.devices[0].allocator.bytes_in_use == 0
        sess.devices[0].allocator.check()
    finally:
        # Whatever happened, leave nothing queued that would make close() raise.
        d = sess.devices[0]._deferred
        d.pending, d.pending_bytes = [], 0
        d.inflight.clear()
        sess.close()


# ============================================================================ 5. memory limit


@pytest.mark.parametrize("fraction, expected", [
    (0.5, 8 * GiB),
    (0.3, int(16 * GiB * 0.3)),
    (1.0, 16 * GiB),
    (0.0, 16 * GiB - 1536 * MiB),
])
def test_memory_limit_from_fraction(make, fraction, expected):
    sess = make({"per_process_gpu_memory_fraction": fraction})
    assert sess.devices[0].memory_limit == expected


def test_fraction_zero_small_device_reserve(make):
    # Below 2 GiB available the reserve is 225 MiB.
    sess = make(simulate="1GiB")
    assert sess.devices[0].memory_limit == GiB - 225 * MiB


def test_fraction_above_one_oversubscribes(make):
    sess = make({"per_process_gpu_memory_fraction": 1.5})
    dev = sess.devices[0]
    assert dev.memory_limit == 24 * GiB
    assert dev.backend.unified is True
    p = sess.allocate(20 * GiB)  # more than the device's 16 GiB
    assert dev.allocator.allocated_size(p) == 20 * GiB
    assert dev.allocator.pool_bytes <= 24 * GiB
    with pytest.raises(OutOfMemoryError):
        sess.allocate(5 * GiB)
    # While it is unified, configure may oversubscribe further.
    sess.configure(per_process_gpu_memory_fraction=1.75)
    assert dev.memory_limit == 28 * GiB
    q = sess.allocate(3 * GiB)
    assert dev.allocator.owns(q)
    dev.allocator.check()


def test_fraction_at_most_one_is_not_unified(make):
    sess = make({"per_process_gpu_memory_fraction": 1.0})
    assert sess.devices[0].backend.unified is False
    with pytest.raises(OutOfMemoryError):
        sess.allocate(17 * GiB)


# ============================================================================ 6. log placement


def test_log_device_placement(make, caplog):
    caplog.set_level(logging.INFO, logger="gpudash")
    sess = make(ConfigProto(log_device_placement=True), simulate="2x1GiB")
    p = sess.allocate(12345, device=1)
    q = sess.allocate(777)
    msgs = [r for r in caplog.records if r.name == "gpudash" and r.levelno == logging.INFO]
    assert len(msgs) == 2
    assert "/device:GPU:1" in msgs[0].getMessage() and "12345" in msgs[0].getMessage()
    assert "/device:GPU:0" in msgs[1].getMessage() and "777" in msgs[1].getMessage()
    assert hex(p) in msgs[0].getMessage() and hex(q) in msgs[1].getMessage()


def test_no_placement_log_by_default(make, caplog):
    caplog.set_level(logging.INFO, logger="gpudash")
    sess = make()
    sess.allocate(12345)
    assert not [r for r in caplog.records
                if r.levelno == logging.INFO and "12345" in r.getMessage()]


# ============================================================================ 7. cuda_malloc


@pytest.mark.parametrize("name", ["cuda_malloc", "CUDA_MALLOC"])
def test_cuda_malloc_one_region_per_allocation(make, name):
    sess = make({"allocator_type": name, "per_process_gpu_memory_fraction": 0.5})
    dev = sess.devices[0]
    alloc = dev.allocator
    assert isinstance(alloc, gpudash.session.CudaMallocAllocator)
    rec = Recorder(sess)
    p = sess.allocate(1000)
    assert alloc.pool_bytes == 1024
    assert [str(k) for k in rec.kinds()] == ["extend", "alloc"]
    q = sess.allocate(3000)
    assert alloc.pool_bytes == 1024 + 3072
    assert len(dev.backend.blocks()) == 2
    assert alloc.allocated_size(p) == 1024 and alloc.allocated_size(q) == 3072
    rec.clear()
    sess.free(p)
    sess.flush()
    assert alloc.pool_bytes == 3072
    assert [str(k) for k in rec.kinds()] == ["free", "release"]
    sess.free_now(q)
    assert alloc.pool_bytes == 0 and alloc.bytes_in_use == 0
    assert dev.backend.used == 0 and dev.backend.blocks() == []
    alloc.check()


def test_cuda_malloc_event_sequence(make):
    sess = make({"allocator_type": "cuda_malloc"})
    rec = Recorder(sess)
    sess.free_now(sess.allocate(5000))
    assert rec.kinds() == [EventKind.EXTEND, EventKind.ALLOC, EventKind.FREE,
                           EventKind.RELEASE]


def test_cuda_malloc_configure_does_not_pool(make):
    """cuda_malloc has no pool: raising the fraction (growth off) must not take a region."""
    sess = make({"allocator_type": "cuda_malloc", "per_process_gpu_memory_fraction": 0.5})
    alloc = sess.devices[0].allocator
    p = sess.allocate(1000)
    sess.configure(per_process_gpu_memory_fraction=0.75)
    assert alloc.memory_limit == 12 * GiB
    assert alloc.pool_bytes == 1024
    sess.free_now(p)
    assert alloc.pool_bytes == 0


# ============================================================================ 8. configure


def test_raise_fraction_without_growth_takes_headroom(make):
    sess = make({"per_process_gpu_memory_fraction": 0.25})
    dev = sess.devices[0]
    p = sess.allocate(MiB)
    assert dev.allocator.pool_bytes == 4 * GiB
    sess.configure(per_process_gpu_memory_fraction=0.5)
    assert dev.memory_limit == 8 * GiB
    assert dev.allocator.pool_bytes == 8 * GiB
    assert dev.backend.used == 8 * GiB
    assert dev.allocator.allocated_size(p) == MiB
    q = sess.allocate(4 * GiB)  # the new region (regions are not contiguous)
    assert dev.allocator.owns(q)
    assert dev.allocator.pool_bytes == 8 * GiB
    dev.allocator.check()


def test_raise_fraction_with_growth_grows_later(make):
    sess = make({"per_process_gpu_memory_fraction": 0.25, "allow_growth": True})
    dev = sess.devices[0]
    sess.allocate(MiB)
    with pytest.raises(OutOfMemoryError):
        sess.allocate(5 * GiB)
    sess.configure(per_process_gpu_memory_fraction=0.5)
    assert dev.memory_limit == 8 * GiB
    assert dev.allocator.pool_bytes == 2 * MiB  # nothing taken at once
    p = sess.allocate(5 * GiB)
    assert dev.allocator.owns(p)


def _four_regions(sess):
    """Growth on, 8 GiB limit: A, B (1 GiB regions), C (a 2 GiB region), D (2 GiB of a 4 GiB
    region); returns the pointers."""
    a = sess.allocate(GiB)
    b = sess.allocate(GiB)
    c = sess.allocate(2 * GiB)
    d = sess.allocate(2 * GiB)
    return a, b, c, d


def test_lower_fraction_returns_free_regions_largest_first(make):
    sess = make({"per_process_gpu_memory_fraction": 0.5, "allow_growth": True})
    dev = sess.devices[0]
    alloc = dev.allocator
    a, b, c, d = _four_regions(sess)
    blocks = dict(dev.backend.blocks())
    assert sorted(blocks.values()) == [GiB, GiB, 2 * GiB, 4 * GiB], blocks
    assert alloc.pool_bytes == 8 * GiB
    region_a, region_c = a, c  # each starts its own region
    assert blocks[region_a] == GiB and blocks[region_c] == 2 * GiB
    sess.free_now(a)
    sess.free_now(c)
    live = {p: alloc.allocated_size(p) for p in (b, d)}
    # 7 GiB: releasing the largest free region (C's, 2 GiB) is enough.
    sess.configure(per_process_gpu_memory_fraction=7 / 16)
    assert alloc.memory_limit == 7 * GiB
    assert alloc.pool_bytes == 6 * GiB
    assert region_c not in dict(dev.backend.blocks())
    assert region_a in dict(dev.backend.blocks())
    # 4 GiB: every wholly free region goes; B's and D's regions (5 GiB) stay.
    sess.configure(per_process_gpu_memory_fraction=0.25)
    assert alloc.memory_limit == 4 * GiB
    assert alloc.pool_bytes == 5 * GiB
    assert dev.backend.used == 5 * GiB
    assert not dev.over_limit  # 3 GiB in use
    assert {p: alloc.allocated_size(p) for p in (b, d)} == live
    alloc.check()
    dev.backend.check()


def test_live_limit_refuses_past_the_limit_and_returns_regions_as_they_empty(make):
    sess = make({"per_process_gpu_memory_fraction": 0.5, "allow_growth": True})
    dev = sess.devices[0]
    alloc = dev.allocator
    a, b, c, d = _four_regions(sess)
    sess.free_now(a)
    sess.free_now(c)
    live = {p: alloc.allocated_size(p) for p in (b, d)}
    sess.configure(per_process_gpu_memory_fraction=0.25)  # 4 GiB; 3 GiB in use, pool 5 GiB
    assert alloc.memory_limit == 4 * GiB
    assert dev.over_limit is False and alloc.pool_over_limit is True
    assert alloc.pool_bytes == 5 * GiB  # only regions with memory in use are left
    assert alloc.pending_release() == (GiB, 2)
    with pytest.raises(OutOfMemoryError):
        sess.allocate(3 * GiB)  # would need a new region
    with pytest.raises(OutOfMemoryError, match="lowered live to 4.00GiB"):
        sess.allocate(2 * GiB)  # fits D's region's free 2 GiB, but 5 GiB > the limit
    e = sess.allocate(GiB)  # 4 GiB in use: exactly the limit
    assert d < e < d + 4 * GiB
    assert alloc.bytes_in_use == 4 * GiB and alloc.pool_bytes == 5 * GiB
    assert {p: alloc.allocated_size(p) for p in (b, d)} == live
    alloc.check()
    sess.free_now(b)  # B's 1 GiB region empties and goes back: the pool fits again
    assert alloc.pool_bytes == 4 * GiB and not alloc.pool_over_limit
    assert b not in dict(dev.backend.blocks())
    for p in (d, e):
        sess.free_now(p)
    assert alloc.pool_bytes == 4 * GiB  # then free regions stay, as in TensorFlow
    sess.configure(per_process_gpu_memory_fraction=0.125)  # the free 4 GiB region goes
    assert alloc.pool_bytes == 0


def test_live_limit_below_in_use_is_over_limit(make):
    sess = make({"per_process_gpu_memory_fraction": 0.5, "allow_growth": True})
    dev = sess.devices[0]
    a, b, c, d = _four_regions(sess)
    sess.configure(per_process_gpu_memory_fraction=0.125)  # 2 GiB < 6 GiB in use
    assert dev.over_limit is True
    with pytest.raises(OutOfMemoryError, match="lowered live"):
        sess.allocate(256)
    for p in (a, b, c):
        sess.free_now(p)
    assert dev.allocator.pool_bytes == 4 * GiB  # A, B, C's regions went back as they emptied
    assert dev.over_limit is False  # 2 GiB in use
    assert dev.allocator.pool_over_limit is True  # D's 4 GiB region still holds 2 GiB
    sess.free_now(d)
    assert dev.allocator.pool_bytes == 0 and not dev.allocator.pool_over_limit
    dev.allocator.check()


def test_growth_off_to_on_releases_free_regions(make):
    sess = make({"per_process_gpu_memory_fraction": 0.25})
    dev = sess.devices[0]
    rec = Recorder(sess)
    sess.free_now(sess.allocate(MiB))
    assert dev.allocator.pool_bytes == 4 * GiB
    sess.configure(allow_growth=True)
    assert dev.allocator.pool_bytes == 0
    assert dev.backend.blocks() == []
    assert dev.allocator.allow_growth is True
    assert dev.allocator.curr_region_allocation_bytes == 2 * MiB
    assert dev.options.allow_growth is True and sess.gpu_options.allow_growth is True
    assert settings_named(rec, "allow_growth") == [(False, True)]
    assert EventKind.RELEASE in rec.kinds()


def test_growth_off_to_on_keeps_regions_in_use(make):
    sess = make({"per_process_gpu_memory_fraction": 0.25})
    dev = sess.devices[0]
    p = sess.allocate(MiB)
    sess.configure(allow_growth=True)
    assert dev.allocator.pool_bytes == 4 * GiB
    assert dev.allocator.allocated_size(p) == MiB


def test_growth_on_to_off_preallocates(make):
    sess = make({"per_process_gpu_memory_fraction": 0.25, "allow_growth": True})
    dev = sess.devices[0]
    rec = Recorder(sess)
    p = sess.allocate(MiB)
    assert dev.allocator.pool_bytes == 2 * MiB
    sess.configure(allow_growth=False)
    assert dev.allocator.pool_bytes == dev.memory_limit == 4 * GiB
    assert dev.backend.used == 4 * GiB
    assert dev.allocator.allow_growth is False
    assert settings_named(rec, "allow_growth") == [(True, False)]
    assert dev.allocator.allocated_size(p) == MiB
    dev.allocator.check()


def test_lower_deferred_bytes_flushes_queue(make):
    sess = make()
    dev = sess.devices[0]
    alloc = dev.allocator
    rec = Recorder(sess)
    ptrs = [sess.allocate(MiB) for _ in range(4)]
    for p in ptrs:
        sess.free(p)
    assert sess.poll() == 0
    assert alloc.bytes_in_use == 4 * MiB and dev.deferred_bytes == 4 * MiB
    sess.configure(deferred_deletion_bytes=2 * MiB)
    assert dev.options.deferred_deletion_bytes == 2 * MiB
    assert dev.deferred_bytes == 4 * MiB  # flushed: in flight until the next poll
    assert sess.poll() == 4 * MiB
    assert alloc.bytes_in_use == 0 and dev.deferred_bytes == 0
    assert settings_named(rec, "deferred_deletion_bytes") == [(8 * MiB, 2 * MiB)]


def test_lower_deferred_bytes_above_queue_keeps_it(make):
    sess = make()
    dev = sess.devices[0]
    sess.free(sess.allocate(MiB))
    sess.configure(deferred_deletion_bytes=4 * MiB)
    assert sess.poll() == 0
    assert dev.deferred_bytes == MiB


def test_configure_records_settings(make):
    sess = make({"per_process_gpu_memory_fraction": 0.5, "allow_growth": True})
    rec = Recorder(sess)
    sess.configure(per_process_gpu_memory_fraction=0.25)
    sess.configure(allow_growth=False)
    sess.configure(deferred_deletion_bytes=MiB)
    sess.configure(per_process_gpu_memory_fraction=0.5, deferred_deletion_bytes=0)
    assert settings_named(rec, "memory_limit") == [(8 * GiB, 4 * GiB), (4 * GiB, 8 * GiB)]
    assert settings_named(rec, "per_process_gpu_memory_fraction") == [(0.5, 0.25), (0.25, 0.5)]
    assert settings_named(rec, "allow_growth") == [(True, False)]
    assert settings_named(rec, "deferred_deletion_bytes") == [(8 * MiB, MiB), (MiB, 8 * MiB)]
    assert all(s["device"] == 0 for s in rec.settings())
    seqs = [s["seq"] for s in rec.settings()]
    assert seqs == sorted(seqs)
    limit_events = [e for e in rec.events() if e.kind == EventKind.LIMIT]
    assert len(limit_events) == len(rec.settings())
    assert sess.gpu_options == GPUOptions(per_process_gpu_memory_fraction=0.5)


def test_configure_one_device(make):
    sess = make({"per_process_gpu_memory_fraction": 0.5, "allow_growth": True},
                simulate="2x16GiB")
    rec = Recorder(sess)
    sess.configure(per_process_gpu_memory_fraction=0.25, device=1)
    assert [d.memory_limit for d in sess.devices] == [8 * GiB, 4 * GiB]
    assert sess.devices[1].options.per_process_gpu_memory_fraction == 0.25
    assert sess.devices[0].options.per_process_gpu_memory_fraction == 0.5
    assert sess.gpu_options.per_process_gpu_memory_fraction == 0.5  # the session-wide value
    assert [(s["device"], s["setting"]) for s in rec.settings()] == [
        (1, "memory_limit"), (1, "per_process_gpu_memory_fraction")]
    sess.configure(per_process_gpu_memory_fraction=0.75)
    assert [d.memory_limit for d in sess.devices] == [12 * GiB, 12 * GiB]
    assert sess.gpu_options.per_process_gpu_memory_fraction == 0.75


def test_configure_nothing_and_closed(make):
    sess = make()
    rec = Recorder(sess)
    sess.configure()
    assert rec.settings() == []
    sess.close()
    with pytest.raises(ConfigError, match="closed"):
        sess.configure(allow_growth=True)
    with pytest.raises(ConfigError, match="closed"):
        sess.allocate(256)


@pytest.mark.parametrize("simulate", ["16GiB", "2x16GiB"])
def test_free_after_close_says_the_session_is_closed(make, simulate):
    """A block allocated before close() and freed after it: the session is closed (as for
    allocate), not "this allocator never allocated that address"."""
    sess = make(simulate=simulate)
    p = sess.allocate(MiB)
    q = sess.allocate(MiB, device=len(sess.devices) - 1)
    sess.free(q)  # queued: close() drains it
    sess.close()
    for free in (sess.free, sess.free_now):
        for ptr in (p, q):
            with pytest.raises(ConfigError, match="this session is closed"):
                free(ptr)
            with pytest.raises(ConfigError, match="this session is closed"):
                free(ptr, device=0)
    sess.free(0)  # nullptr stays a no-op, as in TensorFlow


# ============================================================================ 9. deferred deletion


def test_free_below_threshold_waits(make):
    sess = make()
    dev = sess.devices[0]
    alloc = dev.allocator
    p = sess.allocate(MiB)
    size = alloc.allocated_size(p)
    sess.free(p)
    for _ in range(3):
        assert sess.poll() == 0
    assert alloc.bytes_in_use == size
    assert dev.deferred_bytes == size
    assert alloc.owns(p)  # not yet back in the allocator


def test_threshold_flushes_a_batch_at_next_poll(make):
    sess = make({"deferred_deletion_bytes": 4 * MiB})
    dev = sess.devices[0]
    alloc = dev.allocator
    ptrs = [sess.allocate(MiB) for _ in range(5)]
    for p in ptrs[:3]:
        sess.free(p)
    assert sess.poll() == 0
    sess.free(ptrs[3])  # 4 MiB queued: one batch
    assert alloc.bytes_in_use == 5 * MiB  # not before the poll
    assert dev.deferred_bytes == 4 * MiB
    assert sess.poll() == 4 * MiB
    assert alloc.bytes_in_use == MiB and dev.deferred_bytes == 0
    assert not any(alloc.owns(p) for p in ptrs[:4])
    assert sess.poll() == 0


def test_simulated_batch_returned_when_flushed_with_a_poller(make):
    """With the poller running, a simulated device's batch (no device work to wait for) is
    returned by the free that makes it, in the freeing thread, not after a thread handoff;
    smaller frees stay queued."""
    sess = make({"deferred_deletion_bytes": 4 * MiB}, poll=True)
    dev = sess.devices[0]
    alloc = dev.allocator
    returned_by = []
    real = alloc._deallocate_batch
    alloc._deallocate_batch = lambda ptrs: returned_by.append(threading.current_thread()) or real(ptrs)
    ptrs = [sess.allocate(MiB) for _ in range(5)]
    for p in ptrs[:3]:
        sess.free(p)
    assert alloc.bytes_in_use == 5 * MiB and dev.deferred_bytes == 3 * MiB
    sess.free(ptrs[3])  # 4 MiB queued: one batch, returned now
    assert alloc.bytes_in_use == MiB and dev.deferred_bytes == 0
    assert returned_by == [threading.current_thread()]
    assert dev._deferred.flushes == 1 and not dev._deferred.inflight


def test_flush_large_tensor_immediately(make):
    """EventMgr FlushLargeTensorImmediately: one free at or above the threshold flushes."""
    sess = make()
    dev = sess.devices[0]
    big = sess.allocate(8 * MiB)
    small = sess.allocate(MiB)
    sess.free(small)
    sess.free(big)  # 9 MiB queued, over the 8 MiB threshold
    assert dev.deferred_bytes == 9 * MiB
    assert sess.poll() == 9 * MiB
    assert dev.allocator.bytes_in_use == 0
    huge = sess.allocate(64 * MiB)
    sess.free(huge)
    assert sess.poll() == 64 * MiB


def test_many_small_tensors_flushed(make):
    """EventMgr ManySmallTensorsFlushedImmediately: 1000 x 100 KiB with the 8 MiB default."""
    sess = make({"allow_growth": True})
    dev = sess.devices[0]
    alloc = dev.allocator
    ptrs = [sess.allocate(100 * KiB) for _ in range(1000)]
    sizes = [alloc.allocated_size(p) for p in ptrs]
    # What EventMgr does: batch until the queued bytes reach the threshold.
    expected_batches, queued = [], 0
    for s in sizes:
        queued += s
        if queued >= 8 * MiB:
            expected_batches.append(queued)
            queued = 0
    for p in ptrs:
        sess.free(p)
    assert len(expected_batches) >= 10
    assert dev._deferred.flushes == len(expected_batches)
    assert sess.poll() == sum(expected_batches)
    assert dev.deferred_bytes == queued
    assert alloc.bytes_in_use == queued
    assert sess.flush() == queued
    assert alloc.bytes_in_use == 0
    alloc.check()


def test_poller_thread_returns_batch_within_a_second(make):
    sess = make({"deferred_deletion_bytes": 2 * MiB}, poll=True)
    assert sess._poller is not None and sess._poller.is_alive()
    alloc = sess.devices[0].allocator
    ptrs = [sess.allocate(MiB) for _ in range(3)]
    sess.free(ptrs[0])
    sess.free(ptrs[1])  # a batch
    deadline = time.monotonic() + 1.0
    while alloc.bytes_in_use != MiB and time.monotonic() < deadline:
        time.sleep(0.002)
    assert alloc.bytes_in_use == MiB
    assert sess.devices[0].deferred_bytes == 0
    # Below the threshold it stays queued although the poller keeps polling.
    sess.free(ptrs[2])
    time.sleep(0.05)
    assert alloc.bytes_in_use == MiB
    assert sess.devices[0].deferred_bytes == MiB


class _DoneEvent:
    """A CUDA event that has completed: the batch it marks goes to the poller thread."""
    done = True

    def synchronize(self):
        pass


def _slow_poller_deallocate(monkeypatch, sess, delay=0.05):
    """Make the poller thread return blocks slowly, to open the window in which it has taken
    a batch off the queue but not yet given it back to the allocator. Batches carry an
    event, as on a GPU (a simulated device's batch is returned at once when it is flushed,
    without the poller)."""
    monkeypatch.setattr(sess, "_marker", lambda dev: _DoneEvent())
    alloc = sess.devices[0].allocator
    real = alloc.deallocate

    def slow(ptr):
        if threading.current_thread() is sess._poller:
            time.sleep(delay)
        real(ptr)

    monkeypatch.setattr(alloc, "deallocate", slow)


def _wait_until_poller_took_batch(sess):
    dev = sess.devices[0]
    deadline = time.monotonic() + 1.0
    while dev.deferred_bytes and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert dev.deferred_bytes == 0 and dev.allocator.bytes_in_use > 0


def test_flush_waits_for_the_batch_the_poller_is_returning(make, monkeypatch):
    """flush() "returns every deferred free to its allocator now": also the batch that the
    poller thread has taken off the queue but not yet handed back."""
    sess = make({"deferred_deletion_bytes": 4 * MiB}, simulate="1GiB", poll=True)
    alloc = sess.devices[0].allocator
    _slow_poller_deallocate(monkeypatch, sess)
    for p in [sess.allocate(MiB) for _ in range(4)]:
        sess.free(p)  # the fourth makes a batch
    _wait_until_poller_took_batch(sess)
    sess.flush()
    assert alloc.bytes_in_use == 0


def test_allocation_retry_waits_for_the_batch_the_poller_is_returning(make, monkeypatch):
    """An allocation that fails flushes and retries; memory the poller is returning at that
    moment must count, not end in OutOfMemoryError."""
    sess = make({"per_process_gpu_memory_fraction": 1.0, "deferred_deletion_bytes": GiB},
                simulate="1GiB", poll=True)
    alloc = sess.devices[0].allocator
    ptrs = [sess.allocate(256 * MiB) for _ in range(4)]
    _slow_poller_deallocate(monkeypatch, sess)
    for p in ptrs:
        sess.free(p)  # 1 GiB: one batch
    _wait_until_poller_took_batch(sess)
    q = sess.allocate(512 * MiB)
    assert alloc.owns(q)


def test_failed_allocation_flushes_and_retries(make):
    sess = make({"per_process_gpu_memory_fraction": 1.0, "deferred_deletion_bytes": 2 * GiB},
                simulate="1GiB")
    dev = sess.devices[0]
    alloc = dev.allocator
    ptrs = [sess.allocate(256 * MiB) for _ in range(4)]
    assert alloc.bytes_in_use == GiB == alloc.pool_bytes
    with pytest.raises(OutOfMemoryError):
        alloc.allocate(256 * MiB)  # the allocator alone is full
    for p in ptrs:
        sess.free(p)
    assert dev.deferred_bytes == GiB
    assert sess.poll() == 0  # all below the threshold: still queued
    q = sess.allocate(512 * MiB)  # would fail; the session flushes and retries
    assert alloc.owns(q)
    assert dev.deferred_bytes == 0
    assert alloc.bytes_in_use == 512 * MiB
    with pytest.raises(OutOfMemoryError):
        sess.allocate(768 * MiB)  # nothing left to flush: a real OOM


def test_close_drains_and_returns_everything(make):
    sess = make({"deferred_deletion_bytes": 4 * MiB, "allow_growth": True}, poll=True)
    dev = sess.devices[0]
    poller = sess._poller
    ptrs = [sess.allocate(MiB) for _ in range(10)]
    for p in ptrs[:5]:
        sess.free(p)  # one batch (maybe returned already) and one queued
    assert dev.backend.used > 0
    sess.close()
    assert sess.closed
    assert dev.deferred_bytes == 0
    assert dev.backend.used == 0 and dev.backend.blocks() == []
    assert dev.allocator.pool_bytes == 0
    assert not poller.is_alive()
    sess.close()  # twice is fine


def test_non_empty_shutdown(make):
    """EventMgr NonEmptyShutdown: queued and in-flight frees at close are returned."""
    sess = make(simulate="2x1GiB")
    for index in (0, 1):
        ptrs = [sess.allocate(MiB, device=index) for _ in range(12)]
        for p in ptrs[:10]:
            sess.free(p)  # 8 MiB in flight, 2 MiB queued
        assert sess.devices[index].deferred_bytes == 10 * MiB
    with sess:
        pass
    for dev in sess.devices:
        assert dev.deferred_bytes == 0
        assert dev.backend.used == 0 and dev.backend.blocks() == []


def test_context_manager_closes(caplog):
    with Session(simulate="2x1GiB", environ={}) as sess:
        poller = sess._poller
        assert poller.is_alive()
        p = sess.allocate(3 * MiB)
        sess.free(p)
        sess.allocate(MiB, device=1)
    assert sess.closed and not poller.is_alive()
    assert all(d.backend.used == 0 and d.backend.blocks() == [] for d in sess.devices)


def test_dropped_session_stops_its_poller():
    import gc

    sess = Session(simulate="1GiB", environ={})
    poller = sess._poller
    del sess
    gc.collect()
    poller.join(timeout=2)
    assert not poller.is_alive()


def test_flush_one_device(make):
    sess = make(simulate="2x1GiB")
    p0, p1 = sess.allocate(MiB), sess.allocate(MiB, device=1)
    sess.free(p0)
    sess.free(p1)
    assert sess.flush(device=1) == MiB
    assert sess.devices[0].deferred_bytes == MiB and sess.devices[1].deferred_bytes == 0
    assert sess.flush() == MiB


def test_stats_and_repr(make):
    sess = make(simulate="2x1GiB")
    sess.allocate(MiB, device=1)
    stats = sess.stats()
    assert set(stats) == {0, 1}
    assert stats[1].bytes_in_use == MiB and stats[0].bytes_in_use == 0
    assert sess.stats(1).bytes_in_use == MiB
    assert "simulated" in repr(sess) and "open" in repr(sess)
    assert "GPU_1_bfc" in repr(sess.devices[1])


def test_idle_poller_does_not_spin_and_wakes_for_a_batch():
    """An idle session polls every polling_inactive_delay_msecs (default 100 ms), and a
    queued batch wakes the poller at once rather than after the idle interval."""
    import time as _time

    with gpudash.Session(simulate="1GiB", config={"deferred_deletion_bytes": 1 << 20}) as sess:
        calls = []
        real_poll = sess.poll
        sess.poll = lambda: calls.append(_time.monotonic()) or real_poll()
        _time.sleep(0.55)
        assert len(calls) <= 8, len(calls)  # ~5 at 100 ms, never a busy loop
        p = sess.allocate(2 << 20)
        t0 = _time.monotonic()
        sess.free(p)  # 2 MiB >= 1 MiB: flushed as a batch, the poller is woken
        alloc = sess.devices[0].allocator
        while alloc.bytes_in_use and _time.monotonic() - t0 < 2:
            _time.sleep(0.001)
        assert alloc.bytes_in_use == 0
        assert _time.monotonic() - t0 < 0.09  # well before the next idle poll
