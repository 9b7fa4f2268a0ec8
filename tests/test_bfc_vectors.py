"""Replay TensorFlow 2.21's recorded BFC runs (tests/data/*.json) and require the same
addresses, the same refusals, the same stats and the same region requests.

Format: tests/data/README of the vectors (``region`` steps are the sub-allocator's answers,
not calls to make; they appear just before the allocation that obtained them).
"""

from __future__ import annotations

import pytest

import gpudash
from bfc_helpers import VectorSubAllocator, check_snapshot, fingerprint, load_vector, vector_names

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

NAMES = vector_names()


def test_vectors_present():
    assert {"random_101", "training_102", "fragment_103", "pressure_104"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_replay_vector(name):
    vector = load_vector(name)
    steps = vector["steps"]
    regions = [(s[1], s[2]) for s in steps if s[0] == "region"]
    sub = VectorSubAllocator(regions)
    alloc = gpudash.BFCAllocator(sub, vector["memory_limit"],
                                 allow_growth=vector["allow_growth"],
                                 garbage_collection=vector["garbage_collection"])
    regions_seen = 0
    live: dict[int, int] = {}
    n_oom = 0
    for i, step in enumerate(steps):
        kind = step[0]
        where = f"{name} step {i} {step}"
        if kind == "region":
            regions_seen += 1
            continue
        if kind == "alloc":
            _, nbytes, ptr = step
            got = alloc.allocate(nbytes)
            assert not sub.errors, f"{where}: {sub.errors}"
            assert got == ptr, f"{where}: got {got:#x}, TensorFlow gave {ptr:#x}"
            assert ptr not in live
            live[ptr] = nbytes
            assert alloc.requested_size(ptr) == nbytes
        elif kind == "free":
            _, ptr = step
            assert ptr in live, f"{where}: the vector frees a pointer it never allocated"
            alloc.deallocate(ptr)
            del live[ptr]
        elif kind == "oom":
            _, nbytes = step
            before = fingerprint(alloc)
            with pytest.raises(gpudash.OutOfMemoryError):
                alloc.allocate(nbytes)
            assert fingerprint(alloc) == before, f"{where}: a refused allocation changed state"
            n_oom += 1
        elif kind == "stats":
            _, in_use, peak = step
            s = alloc.stats()
            assert (s.bytes_in_use, s.peak_bytes_in_use) == (in_use, peak), where
        else:
            raise AssertionError(f"unknown step kind {kind!r}")
        # each recorded region was requested by the allocation that followed it, in order
        assert sub.index == regions_seen, (
            f"{where}: {sub.index} regions requested, TensorFlow had {regions_seen} by now")
        if i % 50 == 0:
            alloc.check()
    assert not sub.errors, sub.errors
    assert sub.asked == [n for _, n in regions]
    assert sub.index == len(regions)
    assert alloc.pool_bytes == sum(n for _, n in regions)
    assert sub.freed == []
    alloc.check()
    check_snapshot(alloc.snapshot())
    assert alloc.stats().bytes_in_use == sum(alloc.allocated_size(p) for p in live)
    assert n_oom == sum(1 for s in steps if s[0] == "oom")
