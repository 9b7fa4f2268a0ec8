"""Session's compiled fast paths against its Python methods: the same results, always.

Where the compiled core is built, ``Session.allocate`` and ``Session.free`` are the core's
functions, which run the common case in C and hand every other case to the Python methods
(``gpudash.session.PY_SESSION_METHODS``). Here the same random sequence of session
operations (allocations of every kind of size and device, frees good and bad, double frees,
``free_now``, ``flush``, ``poll``, live ``configure`` of the deferred-deletion threshold, the
fraction and growth, labels, ``close`` and what follows it) runs through a compiled session
and through a reference session that runs the Python methods on the pure-Python parts (the
queue's Python set, ``threading.RLock``; the pure BFC model too, where asked). Every return
value, every error (type and message), the statistics, the deferred queues, the holders and
the allocators' events must agree. Skipped where the core is not built
(``GPUDASH_REQUIRE_COMPILED=1`` makes that a failure).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gpudash import _accel
from gpudash import session as session_mod
from gpudash.bfc import PyBFCAllocator
from gpudash.session import PY_SESSION_METHODS, Session

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from fuzz_core import Listener, Mismatch  # noqa: E402

REQUIRE = os.environ.get("GPUDASH_REQUIRE_COMPILED", "") not in ("", "0")

if not _accel.COMPILED:
    if REQUIRE and not _accel.REASON.startswith(_accel.ENV):  # not built, or stale
        pytest.fail(f"the compiled core must run here: {_accel.REASON}", pytrace=False)
    pytest.skip(f"the compiled core does not run here ({_accel.REASON})",
                allow_module_level=True)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
OPS = int(os.environ.get("GPUDASH_SESSION_FUZZ_OPS", "2500"))


class _Reference(Session):
    """A session that runs Session's Python methods (the reference)."""

    allocate = PY_SESSION_METHODS["allocate"]
    free = PY_SESSION_METHODS["free"]


def _reference_session(pure_allocator: bool, **kwargs) -> Session:
    """A :class:`_Reference` built on the pure-Python parts: ``threading.RLock``, a Python
    set of queued addresses (and the pure BFC model when ``pure_allocator``)."""
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(session_mod, "_SessionLock", threading.RLock)
        if pure_allocator:
            mp.setattr(session_mod, "BFCAllocator", PyBFCAllocator)
        sess = _Reference(**kwargs)
    finally:
        mp.undo()
    for dev in sess.devices:
        assert not dev._deferred.queued
        dev._deferred.queued = set()
    return sess


def _outcome(f, *args, **kwargs) -> tuple:
    try:
        return ("ok", f(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - every error is part of the outcome
        return ("error", type(exc).__name__, str(exc))


def _queue_state(dev) -> tuple:
    d = dev._deferred
    return (d.threshold, list(d.pending), set(d.queued), d.pending_bytes,
            [(marker is None, list(ptrs), nbytes) for marker, ptrs, nbytes in d.inflight],
            d.flushes, d.completed_bytes, dev.deferred_bytes)


class Twin:
    """A reference session and a compiled one, driven together."""

    def __init__(self, pure_allocator: bool, **kwargs) -> None:
        kwargs.setdefault("environ", {})
        self.ref = _reference_session(pure_allocator, **kwargs)
        self.fast = Session(**kwargs)
        assert type(self.fast) is Session and type(self.fast._lock) is not type(self.ref._lock)
        assert type(self.fast.devices[0]._deferred.queued) is not set
        self.listeners: list[tuple[Listener, Listener]] = []
        self.ops = 0
        self.log: list[str] = []

    def same(self, label: str, a, b) -> None:
        if a != b:
            tail = "\n".join(self.log[-12:])
            raise Mismatch(f"after {self.ops} operations, {label} differs:\n"
                           f"  reference: {a!r}\n  compiled:  {b!r}\nlast operations:\n{tail}")

    def call(self, name: str, *args, **kwargs) -> tuple:
        self.ops += 1
        self.log.append(f"{name}{args!r}{kwargs!r}"[:200])
        a = _outcome(getattr(self.ref, name), *args, **kwargs)
        b = _outcome(getattr(self.fast, name), *args, **kwargs)
        self.same(f"{name}{args!r}{kwargs!r}"[:120], a, b)
        return a

    def labelled(self, label: str, name: str, *args) -> tuple:
        """``name(*args)`` inside ``with sess.label(label)`` on both."""
        with self.ref.label(label), self.fast.label(label):
            return self.call(name, *args)

    def listen(self) -> None:
        for ra, fa in zip(self.ref.allocators, self.fast.allocators):
            pair = (Listener(ra), Listener(fa))
            for listener in pair:
                listener.listen(raw=True, columns=False, callback=True)
            self.listeners.append(pair)

    def compare(self) -> None:
        ref, fast = self.ref, self.fast
        self.same("closed", ref.closed, fast.closed)
        for rd, fd in zip(ref.devices, fast.devices):
            self.same(f"stats of {rd.name}", rd.allocator.stats(), fd.allocator.stats())
            self.same(f"deferred queue of {rd.name}", _queue_state(rd), _queue_state(fd))
            self.same(f"holders of {rd.name}", dict(rd._holders), dict(fd._holders))
            self.same(f"settings of {rd.name}", rd.settings(), fd.settings())
        for rl, fl in self.listeners:
            rl.alloc.flush_events()
            fl.alloc.flush_events()
            ra, _, ea = rl.take()
            rb, _, eb = fl.take()
            self.same("journal records", ra, rb)
            self.same("subscribed events", ea, eb)

    def close(self) -> None:
        for rl, fl in self.listeners:
            rl.stop()
            fl.stop()
        self.ref.close()
        self.fast.close()


def _size(rng: random.Random):
    r = rng.random()
    if r < 0.80:
        return int(2 ** rng.uniform(0, 24))
    if r < 0.85:
        return 0
    if r < 0.89:
        return rng.choice([GiB, 3 * GiB, 1 << 62, 1 << 70])  # past the limit: OOM
    if r < 0.93:
        return np.int64(int(2 ** rng.uniform(8, 20)))
    return rng.choice([-1, 1.5, "1KiB", None, True])


def _device(rng: random.Random, n: int):
    r = rng.random()
    if r < 0.85:
        return rng.randrange(n)
    return rng.choice(["GPU:0", f"/device:GPU:{n - 1}", n, -1, True, None, 1 << 70, 2.0])


def drive(twin: Twin, seed: int, ops: int, n_devices: int) -> None:
    """``ops`` random operations on both sessions, compared after each."""
    rng = random.Random(seed)
    live: list[tuple[int, int]] = []  # (ptr, device) allocated and not freed
    freed: list[tuple[int, int]] = []  # freed (queued or returned) recently
    listen_at = rng.randrange(ops // 2)
    close_at = ops - max(10, ops // 20)
    for i in range(ops):
        if i == listen_at:
            twin.listen()
        if i == close_at:
            twin.call("close")
        r = rng.random()
        if (r < 0.40 and len(live) < 60) or not live:
            if rng.random() < 0.85:
                out = twin.call("allocate", _size(rng))
                dev = 0
            else:
                dev = _device(rng, n_devices)
                out = twin.call("allocate", _size(rng), dev)
            if out[0] == "ok" and out[1]:
                live.append((out[1], dev if isinstance(dev, int) and
                             not isinstance(dev, bool) and 0 <= dev < n_devices else 0))
        elif r < 0.72:
            ptr, dev = live.pop(rng.randrange(len(live)))
            how = rng.random()
            if how < 0.8:
                twin.call("free", ptr)
            elif how < 0.9:
                twin.call("free", ptr, dev)
            else:
                twin.call("free", np.int64(ptr))
            freed.append((ptr, dev))
            del freed[:-40]
        elif r < 0.78 and freed:
            ptr, dev = rng.choice(freed)  # a double free (queued or already returned)
            twin.call("free", ptr) if rng.random() < 0.7 else twin.call("free_now", ptr)
        elif r < 0.82:
            bad = rng.choice([live[0][0] + 256, live[0][0] + 1, 12345, -4096, 0, 1 << 70,
                              None, True, 1.5, "0x1000"])
            twin.call("free", bad) if rng.random() < 0.8 else twin.call("free_now", bad)
        elif r < 0.86:
            ptr, dev = live.pop(rng.randrange(len(live)))
            twin.call("free_now", ptr)
        elif r < 0.89:
            twin.call("flush")
        elif r < 0.91:
            twin.call("poll")
        elif r < 0.945:
            value = rng.choice([0, 1, 256 * KiB, 2 * MiB, 8 * MiB, 64 * MiB, 1 << 62, -1,
                                "8MiB", 1.5])
            twin.call("configure", deferred_deletion_bytes=value)
        elif r < 0.96:
            twin.call("configure", per_process_gpu_memory_fraction=rng.choice(
                [0.25, 0.5, 0.8, 1.0, 1.5, -0.5]))
        elif r < 0.97:
            twin.call("configure", allow_growth=rng.choice([True, False]))
        elif r < 0.985:
            # large blocks freed at once: each may need the one before back from the
            # queue (flush and retry)
            for _ in range(2):
                out = twin.call("allocate", rng.randrange(32, 300) * MiB)
                if out[0] == "ok" and out[1]:
                    twin.call("free", out[1])
        else:
            out = twin.labelled(rng.choice(["fwd", "bwd"]), "allocate", _size(rng))
            if out[0] == "ok" and out[1]:
                live.append((out[1], 0))
        if i % 50 == 0 or i >= close_at:
            twin.compare()
    twin.compare()


SETTINGS = [
    ("one device", {"simulate": "1GiB", "poll": False}, 1),
    ("one device, poller", {"simulate": "1GiB", "poll": True}, 1),
    ("one device, growth", {"simulate": "1GiB", "poll": True,
                            "config": {"allow_growth": True}}, 1),
    ("one device, 1 MiB batches", {"simulate": "1GiB", "poll": False,
                                   "config": {"deferred_deletion_bytes": MiB}}, 1),
    ("frees wait for memory", {"simulate": "1GiB", "poll": True, "config": {
        "deferred_deletion_bytes": 1 << 40, "per_process_gpu_memory_fraction": 0.3}}, 1),
    ("two devices", {"simulate": "2x1GiB", "poll": True}, 2),
    ("recorded stacks", {"simulate": "1GiB", "poll": False, "record_stacks": True}, 1),
]


@pytest.mark.parametrize("pure_allocator", [False, True], ids=["compiled BFC", "pure BFC"])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s[0])
def test_the_fast_paths_match_the_python_methods(setting, pure_allocator):
    _, kwargs, n = setting
    twin = Twin(pure_allocator, **kwargs)
    try:
        drive(twin, seed=SETTINGS.index(setting) * 2 + pure_allocator, ops=OPS, n_devices=n)
    finally:
        twin.close()


def test_the_comparison_catches_a_fast_path_that_diverges(monkeypatch):
    """Not vacuous: a fast free that lets double frees pass is caught."""
    fast_free = Session.free

    def lenient(self, ptr, device=None):
        try:
            return fast_free(self, ptr, device)
        except Exception as exc:  # noqa: BLE001
            if "double free" not in str(exc):
                raise

    monkeypatch.setattr(Session, "free", lenient)
    twin = Twin(False, simulate="1GiB", poll=False)
    try:
        with pytest.raises(Mismatch, match="double free"):
            drive(twin, seed=3, ops=OPS, n_devices=1)
    finally:
        twin.close()


def test_the_common_case_runs_no_python_frame():
    """allocate and free of the common case run in C: the only Python frames are those of
    the flushes (none here: the queue's threshold is out of reach)."""
    sess = Session(simulate="1GiB", poll=False, environ={},
                   config={"deferred_deletion_bytes": 1 << 62})
    frames: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            frames.append(frame.f_code.co_name)

    try:
        sess.free(sess.allocate(4096))  # the first extends the pool (the device, in Python)
        sys.setprofile(profile)
        try:
            for _ in range(99):
                sess.free(sess.allocate(4096))
        finally:
            sys.setprofile(None)
        assert frames == []
        assert sess.devices[0]._deferred.pending_bytes == 100 * 4096
    finally:
        sess.close()


def test_the_methods_keep_their_names_documents_and_signatures():
    import inspect

    for name, py in PY_SESSION_METHODS.items():
        fast = getattr(Session, name)
        assert fast is not py and fast.__wrapped__ is py
        assert (fast.__name__, fast.__qualname__, fast.__doc__, fast.__module__) == (
            py.__name__, py.__qualname__, py.__doc__, py.__module__)
        assert inspect.signature(fast) == inspect.signature(py)


def test_the_session_lock_is_a_reentrant_lock_for_conditions():
    """The compiled session lock behaves as threading.RLock where the session uses it: as a
    context manager, reentrant, with a Condition, released by its owner only, and excluding
    other threads."""
    lock = session_mod._SessionLock()
    assert lock.acquire() and lock.acquire(blocking=False)
    assert lock._is_owned()
    lock.release()
    lock.release()
    with pytest.raises(RuntimeError, match="cannot release un-acquired lock"):
        lock.release()
    with pytest.raises(ValueError, match="can't specify a timeout"):
        lock.acquire(False, 1)
    with pytest.raises(ValueError, match="non-negative"):
        lock.acquire(True, -2)
    cond = threading.Condition(lock)
    probed, got = threading.Event(), []

    def other():
        got.append(lock.acquire(blocking=False))  # held by the main thread
        got.append(lock.acquire(timeout=0.01))
        probed.set()
        with cond:  # once the main thread waits (wait() releases every level)
            cond.notify()
        got.append("notified")

    with cond:
        with lock:  # reentrant
            t = threading.Thread(target=other)
            t.start()
            assert probed.wait(timeout=10)
            assert cond.wait(timeout=10)
            assert lock._is_owned()
    t.join()
    assert got == [False, False, "notified"]
    assert not lock._is_owned() and "unlocked" in repr(lock)
    counter = [0]

    def bump():
        for _ in range(2000):
            with lock:
                v = counter[0]
                if v % 97 == 0:
                    time.sleep(0)  # let the GIL go while holding the lock
                counter[0] = v + 1

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter[0] == 8000


def test_the_queued_set_behaves_as_a_set_of_addresses():
    """The compiled queue's set of queued addresses against a Python set, for what the
    session's Python code does with it."""
    queued, ref = session_mod._AddressSet(), set()
    assert type(queued) is not set
    rng = random.Random(5)
    values = [0, 1, (1 << 64) - 1] + [0x7F0000000000 + 256 * rng.randrange(4096)
                                      for _ in range(3000)]
    for v in values:
        n = len(queued)
        queued.add(v if rng.random() < 0.8 else np.uint64(v))
        ref.add(v)
        assert (len(queued) == n) == (len(ref) == n)
        if rng.random() < 0.3:
            gone = rng.sample(values, 5)
            queued.difference_update(gone)
            ref.difference_update(gone)
        if rng.random() < 0.1:
            w = rng.choice(values)
            queued.discard(w)
            ref.discard(w)
    assert queued == ref and set(queued) == ref and len(queued) == len(ref)
    assert all((v in queued) == (v in ref) for v in values + [-1, 1 << 64, None, "x", 2.5])
    assert bool(queued) and np.int64(next(iter(ref))) in queued
    with pytest.raises(ValueError, match="an address"):
        queued.add(-1)
    with pytest.raises(TypeError):
        queued.add(1.5)
    queued.clear()
    assert not queued and repr(queued) == "AddressSet()"
