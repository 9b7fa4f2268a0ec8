"""Session under concurrency: worker threads allocate and free (through deferred deletion)
while the main thread reconfigures the session and the poller thread returns batches."""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest

from gpudash import OutOfMemoryError, Session

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

KiB = 1 << 10
MiB = 1 << 20

N_WORKERS = 4
OPS_PER_WORKER = 6000
MAX_HELD = 24


def _worker(sess, seed, n_devices, live, live_lock, errors, counters, start):
    rng = random.Random(seed)
    held: list[tuple[int, int, int]] = []  # (device, ptr, size)
    start.wait()
    try:
        for _ in range(OPS_PER_WORKER):
            if held and (len(held) >= MAX_HELD or rng.random() < 0.45):
                dev, ptr, size = held.pop(rng.randrange(len(held)))
                assert sess.allocator(dev).allocated_size(ptr) >= size
                with live_lock:
                    live.remove((dev, ptr))
                sess.free(ptr, device=dev) if rng.random() < 0.5 else sess.free(ptr)
                continue
            dev = rng.randrange(n_devices)
            size = int(2 ** rng.uniform(8, 22))  # 256 B .. 4 MiB
            try:
                ptr = sess.allocate(size, device=dev)
            except OutOfMemoryError:
                counters["oom"] += 1
                continue
            assert ptr
            with live_lock:
                key = (dev, ptr)
                if key in live:
                    errors.append(AssertionError(f"pointer {ptr:#x} on device {dev} handed out "
                                                 "twice while live"))
                    return
                live.add(key)
            counters["allocs"] += 1
            held.append((dev, ptr, size))
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)
    finally:
        for dev, ptr, _ in held:
            try:
                with live_lock:
                    live.discard((dev, ptr))
                sess.free(ptr, device=dev)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)


@pytest.fixture
def fast_switching():
    """Switch threads often, so that more interleavings are tried."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def test_workers_with_live_reconfiguration(fast_switching):
    config = {"per_process_gpu_memory_fraction": 0.5, "allow_growth": True,
              "deferred_deletion_bytes": MiB}
    sess = Session(config, simulate="2x512MiB", environ={}, poll=True)
    n_devices = len(sess.devices)
    live: set[tuple[int, int]] = set()
    live_lock = threading.Lock()
    errors: list[BaseException] = []
    counters = [{"oom": 0, "allocs": 0} for _ in range(N_WORKERS)]
    start = threading.Barrier(N_WORKERS + 1)
    threads = [
        threading.Thread(target=_worker, name=f"worker-{i}",
                         args=(sess, 1000 + i, n_devices, live, live_lock, errors, counters[i],
                               start))
        for i in range(N_WORKERS)
    ]
    for t in threads:
        t.start()
    rng = random.Random(7)
    configures = 0
    t0 = time.monotonic()
    try:
        start.wait(timeout=10)
        while any(t.is_alive() for t in threads):
            assert time.monotonic() - t0 < 12, "workers did not finish in time"
            kind = rng.randrange(4)
            device = rng.choice([None, None, 0, 1])
            if kind == 0:
                sess.configure(per_process_gpu_memory_fraction=rng.uniform(0.02, 0.8),
                               device=device)
            elif kind == 1:
                sess.configure(allow_growth=rng.random() < 0.5, device=device)
            elif kind == 2:
                sess.configure(deferred_deletion_bytes=rng.choice([0, 64 * KiB, MiB, 16 * MiB]),
                               device=device)
            else:
                sess.configure(per_process_gpu_memory_fraction=rng.uniform(0.02, 0.8),
                               allow_growth=rng.random() < 0.5,
                               deferred_deletion_bytes=rng.choice([0, 256 * KiB, 4 * MiB]))
            configures += 1
            time.sleep(0.0002)
    finally:
        for t in threads:
            t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert errors == [], errors[:3]
    assert live == set()
    assert configures > 10
    assert sum(c["allocs"] for c in counters) > N_WORKERS * OPS_PER_WORKER // 4
    assert sess._poller.is_alive()  # the poller survived
    print(f"configures={configures}, counters={counters}")

    sess.flush()
    for dev in sess.devices:
        dev.allocator.check()
        dev.backend.check()
        assert dev.allocator.bytes_in_use == 0
        assert dev.deferred_bytes == 0
        assert dev.allocator.pool_bytes == dev.backend.used
        if dev.allocator.pool_bytes <= dev.memory_limit:
            assert not dev.over_limit
    # A final configure applies cleanly to the quiet session: the pool fits the new limit
    # (wholly free regions released, largest first), and the rest can be released.
    sess.configure(per_process_gpu_memory_fraction=0.25, allow_growth=True)
    for dev in sess.devices:
        assert dev.memory_limit == 128 * MiB
        assert dev.allocator.pool_bytes <= 128 * MiB
        assert dev.allocator.allow_growth is True
    sess.release_free_regions()
    for dev in sess.devices:
        assert dev.allocator.pool_bytes == 0 and dev.backend.used == 0
    sess.close()
    for dev in sess.devices:
        assert dev.backend.used == 0 and dev.backend.blocks() == []
    assert not sess._poller.is_alive()


@pytest.mark.parametrize("poll", [False, True])
def test_concurrent_free_and_flush(poll, fast_switching):
    """Frees from several threads while another thread flushes: every block comes back once."""
    sess = Session({"deferred_deletion_bytes": 256 * KiB}, simulate="1GiB", environ={},
                   poll=poll)
    ptrs = [sess.allocate(4 * KiB) for _ in range(4000)]
    errors: list[BaseException] = []
    done = threading.Event()

    def freer(chunk):
        try:
            for p in chunk:
                sess.free(p)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def flusher():
        try:
            while not done.is_set():
                sess.flush()
                sess.poll()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=freer, args=(ptrs[i::4],)) for i in range(4)]
    f = threading.Thread(target=flusher)
    f.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=10)
    done.set()
    f.join(timeout=10)
    assert errors == []
    sess.flush()
    alloc = sess.devices[0].allocator
    assert alloc.bytes_in_use == 0 and sess.devices[0].deferred_bytes == 0
    alloc.check()
    sess.close()
