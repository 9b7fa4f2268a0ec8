"""Defects found by attacking the allocator and the session: each test failed before its fix."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

import gpudash
from gpudash import BFCAllocator, ConfigError, InvalidPointerError, OutOfMemoryError
from gpudash import SimulatedDevice

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

MIB = 1 << 20
GIB = 1 << 30


def _in_thread(fn, timeout: float = 10.0):
    """Run ``fn`` in a thread; its result, or fail if it does not end (a hang)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} did not end in {timeout} s (hang)"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_a_limit_raised_from_zero_extends_instead_of_hanging():
    a = BFCAllocator(SimulatedDevice("16GiB"), 0)
    with pytest.raises(OutOfMemoryError):
        a.allocate(1000)
    a.set_memory_limit(GIB)
    ptr = _in_thread(lambda: a.allocate(1000))
    assert ptr and a.stats().pool_bytes == 2 * MIB  # growth starts again at 2 MiB
    a.check_invariants() if hasattr(a, "check_invariants") else None


def test_a_tiny_fraction_then_a_larger_one_on_a_session():
    with gpudash.Session(simulate="16GiB", poll=False,
                         config={"allow_growth": True}) as sess:
        sess.configure(per_process_gpu_memory_fraction=1e-12)
        assert sess.devices[0].memory_limit == 0
        sess.configure(per_process_gpu_memory_fraction=0.5)
        assert _in_thread(lambda: sess.allocate(1000))


def test_growth_off_from_a_zero_limit_preallocates_the_new_limit():
    a = BFCAllocator(SimulatedDevice("16GiB"), 0, allow_growth=False)
    a.set_memory_limit(GIB)
    assert _in_thread(lambda: a.allocate(1000))
    assert a.stats().pool_bytes == GIB


def test_concurrent_configures_of_different_fields_lose_nothing():
    """Three threads, each changing its own field: after every call, its field holds what it
    set (a configure built from stale options would put another thread's old value back),
    and the allocator's growth always matches the options at the end."""
    sess = gpudash.Session(simulate="16GiB", poll=False)
    dev = sess.devices[0]
    lost = {"fraction": 0, "deferred": 0, "growth": 0}
    rounds = 300

    def fractions():
        for i in range(rounds):
            f = 0.3 + (i % 5) / 10
            sess.configure(per_process_gpu_memory_fraction=f)
            lost["fraction"] += dev.options.per_process_gpu_memory_fraction != f

    def deferred():
        for i in range(rounds):
            n = (1 + i % 7) * MIB
            sess.configure(deferred_deletion_bytes=n)
            lost["deferred"] += dev.options.deferred_deletion_bytes != n

    def growth():
        for i in range(rounds):
            g = bool(i % 2)
            sess.configure(allow_growth=g)
            lost["growth"] += dev.options.allow_growth != g

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=f) for f in (fractions, deferred, growth)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
        sess.close()
    assert lost == {"fraction": 0, "deferred": 0, "growth": 0}
    assert dev.allocator.allow_growth == dev.options.allow_growth


def _queueing_session() -> gpudash.Session:
    """A session whose frees stay queued until flush(): no poller, a 1 GiB threshold."""
    return gpudash.Session(simulate="16GiB", poll=False,
                           config={"allow_growth": True, "deferred_deletion_bytes": GIB})


def test_free_then_free_now_is_refused_and_the_flush_loses_nothing():
    with _queueing_session() as sess:
        ptrs = [sess.allocate(MIB) for _ in range(4)]
        for p in ptrs:
            sess.free(p)
        with pytest.raises(InvalidPointerError, match="already queued for deletion"):
            sess.free_now(ptrs[0])
        assert sess.flush() == 4 * MIB
        assert sess.stats(0).bytes_in_use == 0
        assert not sess.devices[0]._deferred.queued


def test_a_bad_pointer_in_a_deferred_batch_does_not_keep_the_others():
    """A block freed behind the session's back (on the allocator itself) while queued: the
    flush warns about it and still returns the rest of the batch."""
    with _queueing_session() as sess:
        ptrs = [sess.allocate(MIB) for _ in range(3)]
        for p in ptrs:
            sess.free(p)
        sess.devices[0].allocator.deallocate(ptrs[1])
        with pytest.warns(gpudash.GpudashWarning, match="deferred free"):
            sess.flush()
        assert sess.stats(0).bytes_in_use == 0
        assert not sess.devices[0]._deferred.queued


def test_an_allocation_beyond_int64_is_an_out_of_memory_error():
    a = BFCAllocator(SimulatedDevice("16GiB"), GIB)
    for n in (2 ** 63, 2 ** 64, 10 ** 30):
        with pytest.raises(OutOfMemoryError, match="more than any device holds"):
            a.allocate(n)
    assert a.stats().bytes_in_use == 0


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None, 0.0])
def test_allow_growth_takes_booleans_only(value):
    a = BFCAllocator(SimulatedDevice("16GiB"), GIB, allow_growth=False)
    with pytest.raises(ConfigError, match="allow_growth must be True or False"):
        a.set_allow_growth(value)
    assert a.allow_growth is False


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_retry_timeout_must_be_finite(value):
    with pytest.raises(ConfigError, match="retry_timeout"):
        BFCAllocator(SimulatedDevice("16GiB"), GIB, retry_timeout=value)


@pytest.mark.parametrize("bad", [None, False, {}, "", [], 0.0])
def test_freeing_a_non_address_is_an_error_not_a_silent_no_op(bad):
    a = BFCAllocator(SimulatedDevice("16GiB"), GIB)
    with pytest.raises(InvalidPointerError, match="expects an int address"):
        a.deallocate(bad)
    with gpudash.Session(simulate="16GiB", poll=False) as sess:
        for free in (sess.free, sess.free_now):
            with pytest.raises(InvalidPointerError, match="expects an int address"):
                free(bad)


def test_null_stays_a_no_op():
    a = BFCAllocator(SimulatedDevice("16GiB"), GIB)
    a.deallocate(0)  # TensorFlow's DeallocateRaw(nullptr)
    with gpudash.Session(simulate="16GiB", poll=False) as sess:
        sess.free(0)
        sess.free_now(0)


def test_a_stats_call_is_not_blocked_while_another_thread_allocates():
    a = BFCAllocator(SimulatedDevice("16GiB"), 0)
    a.set_memory_limit(GIB)
    t0 = time.monotonic()
    _in_thread(lambda: a.allocate(1000))
    assert _in_thread(a.stats, timeout=5).bytes_in_use == 1024
    assert time.monotonic() - t0 < 10


def test_recorder_flush_interval_must_be_finite(tmp_path):
    with gpudash.Session(simulate="16GiB", poll=False) as sess:
        for bad in (float("inf"), float("nan"), 0, -1, "soon"):
            with pytest.raises(ConfigError, match="flush_interval"):
                gpudash.Recorder(sess, path=tmp_path / f"r{bad}.gdtrace", flush_interval=bad)


def test_a_failing_recorder_stream_is_raised_not_silent(tmp_path, monkeypatch):
    with gpudash.Session(simulate="16GiB", poll=False) as sess:
        rec = gpudash.Recorder(sess, path=tmp_path / "r.gdtrace", flush_interval=0.01)

        def broken():
            raise OSError("disk full")

        monkeypatch.setattr(rec, "_write_batch", broken)
        sess.allocate(MIB)
        deadline = time.monotonic() + 5
        while rec.stream_error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(rec.stream_error, OSError)
        with pytest.raises(gpudash.GpudashError, match="disk full"):
            rec.detach()


@pytest.mark.parametrize("tolerance", [1e-18, 0.0, float("nan"), -0.1])
def test_min_fraction_refuses_a_tolerance_finer_than_a_byte(tolerance):
    from gpudash.trace.whatif import min_fraction
    from gpudash.workloads import training_loop

    trace = training_loop(steps=1, layers=2, hidden=256)
    with pytest.raises(ConfigError, match="tolerance must be a fraction"):
        min_fraction(trace, "1GiB", tolerance=tolerance)


def test_min_fraction_at_the_finest_tolerance_ends():
    from gpudash.trace.whatif import MIN_TOLERANCE, min_fraction
    from gpudash.workloads import training_loop

    trace = training_loop(steps=1, layers=2, hidden=256)
    r = _in_thread(lambda: min_fraction(trace, "1GiB", tolerance=MIN_TOLERANCE), timeout=60)
    assert r.fits and r.replays <= 60


def test_objects_dropped_without_close_end_their_threads(tmp_path):
    """A session (its deferred-deletion poller), a recorder streaming to a file and a live
    model (its refresher), dropped without close(): collected, and their threads end."""
    import gc

    from gpudash.widgets import LiveModel

    before = {t.ident for t in threading.enumerate()}
    sess = gpudash.Session(simulate="16GiB", poll=True)
    rec = gpudash.Recorder(sess, path=tmp_path / "r.gdtrace", flush_interval=0.05)
    model = LiveModel(sess, rate_hz=20)
    sess.allocate(MIB)
    started = {t.ident for t in threading.enumerate()} - before
    assert len(started) >= 3
    del sess, rec, model
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        gc.collect()
        if not started & {t.ident for t in threading.enumerate()}:
            break
        time.sleep(0.05)
    left = [t.name for t in threading.enumerate() if t.ident in started]
    assert not left, left


@pytest.mark.parametrize("make, fragment", [
    (lambda s: gpudash.Recorder(s, capacity=float("inf")), "capacity must be a positive"),
    (lambda s: gpudash.Recorder(s, capacity=0), "capacity must be a positive"),
    (lambda s: gpudash.LiveModel(s, history=float("inf"), start=False), "history must be"),
    (lambda s: gpudash.LiveModel(s, heatmap_rows=10 ** 9, start=False), "heatmap_rows must"),
    (lambda s: gpudash.LiveModel(s, rate_hz=float("nan"), start=False), "rate"),
    (lambda s: s.configure(per_process_gpu_memory_fraction=float("inf")), "fraction"),
    (lambda s: s.configure(deferred_deletion_bytes=float("inf")), "deferred"),
])
def test_infinite_and_absurd_settings_are_config_errors(make, fragment):
    with gpudash.Session(simulate="1GiB", poll=False) as sess:
        with pytest.raises(ConfigError, match=fragment):
            make(sess)


def test_a_limit_beyond_int64_is_refused():
    a = BFCAllocator(SimulatedDevice("16GiB"), GIB)
    with pytest.raises(ValueError, match="at most"):
        a.set_memory_limit(2 ** 70)
    assert a.memory_limit == GIB


# --------------------------------------------------------------------- constructor settings


@pytest.mark.parametrize("field,value", [
    ("allow_growth", "false"), ("allow_growth", 0), ("allow_growth", None),
    ("garbage_collection", "false"), ("garbage_collection", 1),
    ("fragmentation_fraction", float("nan")), ("fragmentation_fraction", float("inf")),
    ("fragmentation_fraction", "0.5"), ("fragmentation_fraction", -0.1),
    ("retry_timeout", float("inf")), ("retry_timeout", "1"), ("retry_timeout", None),
])
def test_allocator_constructor_settings_are_config_errors(field, value):
    with pytest.raises(gpudash.ConfigError, match=field):
        BFCAllocator(SimulatedDevice("1GiB"), 1 << 30, **{field: value})


def test_allocator_constructor_string_false_is_not_growth():
    # "false" was truthy: growth silently on
    with pytest.raises(gpudash.ConfigError):
        BFCAllocator(SimulatedDevice("1GiB"), 1 << 30, allow_growth="false")
    a = BFCAllocator(SimulatedDevice("1GiB"), 1 << 30, allow_growth=np.bool_(False))
    assert a.allow_growth is False


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1, 1 << 64, "1GiB", None])
def test_memory_limit_is_a_config_error_naming_it(value):
    with pytest.raises(gpudash.ConfigError, match="memory_limit"):
        BFCAllocator(SimulatedDevice("1GiB"), value)
    a = BFCAllocator(SimulatedDevice("1GiB"), 1 << 30)
    with pytest.raises(gpudash.ConfigError, match="memory_limit"):
        a.set_memory_limit(value)
    assert a.memory_limit == 1 << 30


# --------------------------------------------------------------------- background tasks


@pytest.mark.parametrize("timeout", [float("nan"), -1, "1", True])
def test_background_timeouts_refuse_nonsense(timeout):
    from gpudash.background import run_in_background

    gate = threading.Event()
    task = run_in_background(gate.wait, 10)
    try:
        for wait in (task.join, task.result, task.exception):
            with pytest.raises(gpudash.ConfigError, match="timeout"):
                wait(timeout=timeout)
    finally:
        gate.set()
    assert task.result(timeout=10) is True


@pytest.mark.parametrize("timeout", [float("inf"), 1e300])
def test_background_infinite_timeout_waits_without_limit(timeout):
    from gpudash.background import run_in_background

    gate = threading.Event()
    task = run_in_background(gate.wait, 10)
    threading.Timer(0.05, gate.set).start()
    assert task.result(timeout=timeout) is True  # was OverflowError
    assert task.join(timeout=timeout) is True
    assert task.exception(timeout=timeout) is None


# --------------------------------------------------------------------- recorder stream


@pytest.mark.parametrize("interval", [True, 1e300, float("inf"), "often", None])
def test_recorder_flush_interval_refused_by_name(tmp_path, interval):
    path = tmp_path / "r.gdtrace"
    with pytest.raises(ConfigError, match="flush_interval"):
        gpudash.Recorder(path=path, flush_interval=interval)
    assert not path.exists()


def test_a_dropped_recorder_closes_its_file(tmp_path):
    import gc
    import warnings

    from gpudash.trace import read_trace

    path = tmp_path / "r.gdtrace"
    a = BFCAllocator(SimulatedDevice("1GiB"), 1 << 30)
    rec = gpudash.Recorder(a, path=path, flush_interval=0.02)
    for _ in range(100):
        a.deallocate(a.allocate(1000))
    n = len(rec)  # takes in everything the allocator buffered
    assert n > 300
    thread = rec._streamer
    time.sleep(0.1)  # a streamed batch or two
    del rec, a
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "no end record" would be a warning
        trace = read_trace(path)
    assert len(trace.columns["seq"]) == n


# --------------------------------------------------------------------- odd values elsewhere


@pytest.mark.parametrize("ptr", [float("inf"), float("nan"), 1.5, True, [1]])
def test_pointer_queries_refuse_non_addresses_by_name(ptr):
    a = BFCAllocator(SimulatedDevice("1GiB"), 1 << 30)
    for query in (a.allocated_size, a.requested_size, a.allocation_id, a.deallocate):
        with pytest.raises(InvalidPointerError):  # was OverflowError for inf
            query(ptr)


@pytest.mark.parametrize("ptr", [float("inf"), float("nan"), 1.5, "x", [1]])
def test_simulated_device_free_of_non_address(ptr):
    dev = SimulatedDevice("1GiB")
    with pytest.raises(InvalidPointerError):  # was a ValueError from the message's format
        dev.free(ptr, 256)


@pytest.mark.parametrize("cc", [(float("inf"), 0), (float("nan"), 0), ("x", 0), (-1, 0),
                                (8,), None, (True, 0)])
def test_simulated_device_compute_capability_checked(cc):
    with pytest.raises(ConfigError, match="compute_capability"):
        SimulatedDevice("1GiB", compute_capability=cc)


def test_format_bytes_of_non_finite_values_does_not_raise():
    from gpudash._units import format_bytes

    assert format_bytes(float("inf")) == "inf B"
    assert format_bytes(float("nan")) == "nan B"
    assert format_bytes(-float("inf")) == "-inf B"


def test_a_huge_fraction_is_a_config_error_naming_it():
    from gpudash.options import memory_limit

    with pytest.raises(ConfigError, match="per_process_gpu_memory_fraction"):
        memory_limit(1 << 30, 1 << 30, 1e300, 8, environ={})  # was OverflowError
    with pytest.raises(ConfigError, match="per_process_gpu_memory_fraction"):
        memory_limit(1 << 62, 1 << 62, 4.0, 8, environ={})  # beyond int64
    assert memory_limit(1 << 30, 1 << 30, 2.0, 8, environ={}) == 2 << 30


# --------------------------------------------------------------------- batched deferred frees


def test_batched_deallocation_matches_one_by_one():
    import random

    from gpudash import Recorder
    from gpudash.events import COLUMNS

    def churn(free_batch):
        a = BFCAllocator(SimulatedDevice("1GiB"), 1 << 30)
        rec = Recorder(a)
        rng = random.Random(3)
        live = []
        for _ in range(400):
            live.append(a.allocate(rng.randrange(1, 1 << 20)))
            if len(live) > 20:
                rng.shuffle(live)
                batch, live = live[:10], live[10:]
                free_batch(a, batch + [0x1234])  # one bad pointer in each batch
        a.check()
        cols = rec.columns()
        return a.stats(), {k: cols[k] for k in COLUMNS if k != "time_ns"}

    failures = []

    def one_by_one(a, ptrs):
        for p in ptrs:
            try:
                a.deallocate(p)
            except InvalidPointerError as exc:
                failures.append(str(exc))

    def batched(a, ptrs):
        failures.extend(a._deallocate_batch(ptrs))

    s1, c1 = churn(one_by_one)
    n1 = len(failures)
    s2, c2 = churn(batched)
    assert n1 == 38 and len(failures) == 2 * n1
    assert s1 == s2
    for k in c1:
        assert (c1[k] == c2[k]).all(), k


def test_cuda_malloc_sessions_still_return_regions_on_deferred_frees():
    from gpudash import Session

    sess = Session(simulate="1GiB", poll=False, config={"allocator_type": "cuda_malloc"})
    ptrs = [sess.allocate(1 << 20) for _ in range(4)]
    for p in ptrs:
        sess.free(p)
    sess.flush()
    assert sess.allocator(0).pool_bytes == 0
    sess.close()


def test_batched_deallocation_takes_numpy_addresses():
    a = BFCAllocator(SimulatedDevice("1GiB"), 1 << 30)
    ptrs = [np.int64(a.allocate(1000)), np.uint64(a.allocate(2000)), a.allocate(3000)]
    assert a._deallocate_batch(ptrs) == []
    assert a.bytes_in_use == 0
    a.check()


# --------------------------------------------------------------------- what-if arguments


def _small_trace():
    from gpudash import Recorder

    a = BFCAllocator(SimulatedDevice("1GiB"), 1 << 30)
    with Recorder(a) as rec:
        ptrs = [a.allocate(1 << 20) for _ in range(8)]
        for p in ptrs:
            a.deallocate(p)
    return rec.to_trace()


@pytest.mark.parametrize("kwargs", [
    {"tolerance": "x"}, {"tolerance": True}, {"hi": float("inf")}, {"lo": float("nan")},
    {"hi": "1"},
])
def test_min_fraction_arguments_refused_by_name(kwargs):
    from gpudash.trace.whatif import min_fraction

    name = next(iter(kwargs))
    with pytest.raises(ConfigError, match=name if name != "lo" else "lo"):
        min_fraction(_small_trace(), "1GiB", **kwargs)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"fractions": ["x"]}, "fraction"), ({"fractions": [True]}, "fraction"),
    ({"fractions": []}, "at least one"), ({"fractions": "0.5"}, "fractions"),
    ({"allow_growth": "false"}, "allow_growth"), ({"allow_growth": [None]}, "allow_growth"),
    ({"allow_growth": ["false"]}, "allow_growth"), ({"jobs": float("inf")}, "jobs"),
    ({"jobs": 0}, "jobs"),
])
def test_sweep_arguments_refused_by_name(kwargs, fragment):
    from gpudash.trace.whatif import sweep

    kwargs = {"fractions": [0.5], **kwargs}
    with pytest.raises(ConfigError, match=fragment):
        sweep(_small_trace(), device_bytes="1GiB", **kwargs)


def test_sweep_takes_one_fraction():
    from gpudash.trace.whatif import sweep

    table = sweep(_small_trace(), 0.5, allow_growth=False, device_bytes="1GiB")
    assert len(table.rows) == 1
