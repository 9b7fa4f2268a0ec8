"""Exact replays run through the compiled core where it is built: from an empty start
directly, from a mid-run start after making the starting state by calls (and through the
pure-Python model's rebuilt records where calls cannot make it), with the same decisions,
samples and recording either way."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest

from gpudash import CachingAllocator, SimulatedDevice
from gpudash.caching import PyCachingAllocator
from gpudash.trace import load_torch_snapshot, replay
from gpudash.trace import torch_replay as trp
from gpudash.formats.torch_trace import (
    ACTIONS,
    TorchTrace,
    _blocks_of,
    _Ranges,
    _starts_empty,
    _state,
    from_snapshot,
)

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)


from shared_files import EXTERNAL  # noqa: E402
MID_RUN = ["cs336_notHanmin.memory_snapshot.pickle", "ftcourse.memory_snapshot.pickle",
           "LayoutEditing.memory_snapshot.pkl", "cs336_MAGMA27.memory_snapshot.pickle"]


def _workload_snapshot(seed: int, mid_run: bool) -> dict:
    """A training-like run through the model, its history switched on after a warm-up when
    ``mid_run``: the model's own snapshot."""
    rng = random.Random(seed)
    a = CachingAllocator(SimulatedDevice(40 << 30))
    live: list[int] = []

    def run(n: int) -> None:
        for _ in range(n):
            if live and rng.random() < 0.45:
                a.deallocate(live.pop(rng.randrange(len(live))))
            else:
                live.append(a.allocate(rng.choice((512, 3000, 70_000, 900_000, 1 << 21,
                                                   5 << 20, 12 << 20, 30 << 20))))
            if rng.random() < 0.003:
                a.empty_cache()

    if mid_run:
        run(400)
    a.record_history(True, max_entries=1 << 20)
    run(3000)
    return a.snapshot()


def _without_construct(monkeypatch):
    monkeypatch.setattr(trp, "_construct", lambda *args: None)


def _same_replays(a, b) -> None:
    assert a.fidelity.summary() == b.fidelity.summary()
    for f in ("oom_count", "peak_pool_bytes", "peak_bytes_in_use", "extensions", "releases",
              "calls", "events"):
        assert getattr(a, f) == getattr(b, f), f
    for k in a.per_call:
        assert np.array_equal(a.per_call[k], b.per_call[k]), k
    ra, rb = a.recording, b.recording
    for col in ra.columns:       # allocation ids count the calls that made the start
        if col not in ("alloc_id", "time_ns"):
            assert np.array_equal(ra.columns[col], rb.columns[col]), col
    assert np.array_equal(ra.stack_ids(), rb.stack_ids())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_mid_run_start_made_by_calls_replays_as_the_rebuilt_one(seed, monkeypatch):
    t = load_torch_snapshot(_workload_snapshot(seed, mid_run=True))
    fast = replay(t)
    assert fast.fidelity.start == "mid-run" and fast.fidelity.exact
    assert type(fast.fidelity.allocator) is CachingAllocator    # made by calls
    _without_construct(monkeypatch)
    slow = replay(t)
    assert type(slow.fidelity.allocator) is PyCachingAllocator
    assert slow.fidelity.exact
    _same_replays(fast, slow)


@pytest.mark.skipif(not EXTERNAL.is_dir(), reason="../shared/reference/external is not here")
@pytest.mark.parametrize("name", MID_RUN)
def test_real_mid_run_snapshots_replay_alike_both_ways(name, monkeypatch):
    t = load_torch_snapshot(EXTERNAL / name)
    dev = int(t.columns["device"][0])
    fast = replay(t, device=dev)
    assert fast.fidelity.start == "mid-run" and fast.fidelity.exact
    assert type(fast.fidelity.allocator) is CachingAllocator
    _without_construct(monkeypatch)
    _same_replays(fast, replay(t, device=dev))


def test_a_start_calls_cannot_make_is_rebuilt_in_the_pure_model():
    # a large segment holding a 1 KiB block: a request that size goes to the small pool,
    # so no call puts it there; the rebuilt records do
    seg = {"device": 0, "address": 1 << 40, "total_size": 20 << 20, "stream": 0,
           "segment_type": "large", "is_expandable": False, "blocks": [
               {"address": 1 << 40, "size": 1024, "requested_size": 1000,
                "state": "active_allocated"},
               {"address": (1 << 40) + 1024, "size": (20 << 20) - 1024, "state": "inactive"}]}
    entries = [{"action": "alloc", "addr": (1 << 40) + 1024, "size": 4 << 20, "stream": 0},
               {"action": "free_requested", "addr": (1 << 40) + 1024, "size": 4 << 20},
               {"action": "free_completed", "addr": (1 << 40) + 1024, "size": 4 << 20}]
    tt = from_snapshot({"segments": [seg], "device_traces": [entries]})[0]
    res = trp.replay_exact(tt)
    assert res.start == "mid-run" and type(res.allocator) is PyCachingAllocator
    assert res.allocs_matched == 1


def test_an_empty_start_runs_in_the_compiled_core_and_the_collector_comes_back():
    t = load_torch_snapshot(_workload_snapshot(4, mid_run=False))
    assert gc.isenabled()
    r = replay(t)
    assert gc.isenabled()
    assert r.fidelity.start == "empty" and r.fidelity.exact
    assert type(r.fidelity.allocator) is CachingAllocator


def _starts_empty_reference(tt: TorchTrace) -> bool:
    """The entry-by-entry walk that ``_starts_empty`` does in numpy."""
    live: set[int] = set()
    segs: set[int] = set()
    mapped = _Ranges()
    A = ACTIONS
    for a, addr, size in zip(tt.action.tolist(), tt.addr.tolist(), tt.size.tolist()):
        if a == A["alloc"]:
            live.add(addr)
        elif a == A["free_completed"]:
            if addr not in live:
                return False
            live.discard(addr)
        elif a == A["segment_alloc"]:
            segs.add(addr)
        elif a == A["segment_free"]:
            if addr not in segs:
                return False
            segs.discard(addr)
        elif a == A["segment_map"]:
            mapped.add(addr, addr + size)
        elif a == A["segment_unmap"]:
            if not mapped.covers(addr, addr + size):
                return False
            mapped.sub(addr, addr + size)
    for seg in tt.final or ():
        base = seg["address"]
        if seg.get("is_expandable"):
            if not mapped.covers(base, base + seg["total_size"]):
                return False
        elif base not in segs:
            return False
        for blk, baddr in _blocks_of(seg):
            if _state(blk).startswith("active") and baddr not in live:
                return False
    return True


def test_starts_empty_in_numpy_agrees_with_the_walk():
    rng = random.Random(5)
    names = ["alloc", "free_completed", "segment_alloc", "segment_free", "free_requested"]
    seen = set()
    for _ in range(400):
        n = rng.randrange(1, 12)
        acts = [ACTIONS[rng.choice(names)] for _ in range(n)]
        addrs = [rng.randrange(4) * 512 for _ in range(n)]
        final = [{"address": rng.randrange(4) * 512, "total_size": 512, "blocks": [
            {"size": 512, "state": rng.choice(["active_allocated", "inactive"])}]}
            for _ in range(rng.randrange(2))]
        tt = TorchTrace(0, np.array(acts, np.int8), np.array(addrs, np.int64),
                        np.full(n, 512, np.int64), np.zeros(n, np.int64), final=final)
        want = _starts_empty_reference(tt)
        assert _starts_empty(tt) == want, (acts, addrs, final)
        seen.add(want)
    assert seen == {True, False}
