"""The caching-allocator model against PyTorch's own decisions.

Real snapshots from other people's projects (../shared/reference/external, skipped when
absent): every one replays with every segment event, allocation address and OOM of its
trace, and its final layout. And the model against itself under every setting: a random
workload's snapshot, replayed from its trace alone, makes the same decisions."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from gpudash import CachingAllocator, SimulatedDevice
from gpudash.trace.torch_replay import from_snapshot, replay_exact
from gpudash.formats.torch_snapshot import load_torch_snapshot_dict

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

from shared_files import EXTERNAL  # noqa: E402
SNAPSHOTS = sorted(p.name for p in EXTERNAL.glob("*.p*k*l*")) if EXTERNAL.is_dir() else []
MiB = 1 << 20
GiB = 1 << 30

# Which real traces start from an empty allocator (checked by the replay itself).
EMPTY_START = {"DeComFL.memory.pickle", "code_location.memory_snapshot.pickle",
               "cs336_silmont2000.mem_snapshot.pickle"}


@pytest.mark.skipif(not SNAPSHOTS, reason="../shared/reference/external is not here")
@pytest.mark.parametrize("name", SNAPSHOTS)
def test_real_snapshots_replay_exactly(name):
    snap = load_torch_snapshot_dict(EXTERNAL / name)
    for dev, tt in from_snapshot(snap, name).items():
        res = replay_exact(tt)
        assert res.start == ("empty" if name in EMPTY_START else "mid-run"), res.summary()
        assert res.exact, f"{name} device {dev}: {res.summary()}\n{res.final_mismatch}\n" \
                          f"{res.divergence}"
        assert res.final_layout_equal
        res.allocator.check()


@pytest.mark.skipif("code_location.memory_snapshot.pickle" not in SNAPSHOTS,
                    reason="../shared/reference/external is not here")
def test_expandable_trace_with_an_oom_and_unmaps_under_pressure():
    snap = load_torch_snapshot_dict(EXTERNAL / "code_location.memory_snapshot.pickle")
    res = replay_exact(from_snapshot(snap)[1])
    assert (res.ooms, res.ooms_matched, res.segment_events) == (1, 1, 46)
    assert res.pressure_calls == 2 and res.empty_cache_calls == 0
    # the model's own snapshot of the replay has PyTorch's layout and the same trace
    actions = [e["action"] for e in res.snapshot["device_traces"][1]]
    theirs = [e["action"] for e in snap["device_traces"][1]]
    assert [a for a in actions if a.startswith("segment") or a == "oom"] == \
        [a for a in theirs if a.startswith("segment") or a == "oom"]


def _workload(a: CachingAllocator, seed: int, n: int, streams=(0,), empty_every=0,
              sizes=None) -> None:
    rng = random.Random(seed)
    live: list[int] = []
    for i in range(n):
        if empty_every and i and i % empty_every == 0:
            a.empty_cache()
        if live and rng.random() < 0.45:
            a.deallocate(live.pop(rng.randrange(len(live))))
            continue
        r = rng.random()
        if sizes is not None:
            nbytes = rng.choice(sizes)
        elif r < 0.45:
            nbytes = rng.randint(1, MiB)
        elif r < 0.75:
            nbytes = rng.randint(MiB, 10 * MiB)
        elif r < 0.95:
            nbytes = rng.randint(10 * MiB, 200 * MiB)
        else:
            nbytes = rng.randint(200 * MiB, 1200 * MiB)
        p = a.try_allocate(nbytes, True, rng.choice(streams))
        if p:
            live.append(p)


SCENARIOS = {
    "default+empty_cache": dict(conf=None, empty_every=97),
    "max_split_size": dict(conf="max_split_size_mb:128", empty_every=211),
    "roundup list": dict(conf="roundup_power2_divisions:[1:4,64:8,256:2,>:1]"),
    "roundup single": dict(conf="roundup_power2_divisions:4"),
    "expandable": dict(conf="expandable_segments:True", empty_every=131),
    "fraction+gc": dict(conf="garbage_collection_threshold:0.6", fraction=0.04),
    "fraction+gc+mss": dict(conf="garbage_collection_threshold:0.7,max_split_size_mb:100",
                            fraction=0.03),
    "fraction+mss": dict(conf="max_split_size_mb:64", fraction=0.04),
    "two streams": dict(conf=None, streams=(0, 0x55D0C0DE), empty_every=173),
    "expandable+fraction": dict(conf="expandable_segments:True", fraction=0.03),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_model_replays_its_own_snapshots_exactly(scenario):
    """The validation plan's scenarios (A-H of TORCH_ALLOCATOR.md section 12), on the model:
    a snapshot's trace alone, with the fraction and device total beside it, reproduces
    every decision -- releases under pressure, GC, unmaps, OOMs included."""
    sc = SCENARIOS[scenario]
    total = 150_109_880_320      # an H200's cudaMemGetInfo total
    a = CachingAllocator(SimulatedDevice(total), sc["conf"], fraction=sc.get("fraction"))
    a.record_history(True)
    _workload(a, zlib.crc32(scenario.encode()) % 1000, 3000, sc.get("streams", (0,)),
              sc.get("empty_every", 0))
    a.check()
    snap = a.snapshot()
    tt = from_snapshot(snap)[0]
    res = replay_exact(tt, fraction=sc.get("fraction"), device_total=total,
                       conf=a.config)
    assert res.start == "empty"
    assert res.exact, f"{res.summary()}\n{res.final_mismatch}\n{res.divergence}"
    if "fraction" in sc:
        assert res.ooms > 0 and res.segment_events > 50
    else:
        assert res.segment_events > 20


def test_a_mid_run_window_of_the_models_trace_replays_exactly():
    """The ring buffer keeps the last entries only: the rebuilt starting state (sizes of
    blocks the window frees, from their requests and where the trace allocates next to
    them) still gives the same decisions."""
    a = CachingAllocator(SimulatedDevice(80 * GiB))
    a.record_history(True, max_entries=1500)
    _workload(a, 7, 4000, empty_every=500)
    snap = a.snapshot()
    res = replay_exact(from_snapshot(snap)[0])
    assert res.start == "mid-run" and res.rebuilt["guessed"] > 0
    assert res.exact, f"{res.summary()}\n{res.final_mismatch}\n{res.divergence}"


@pytest.mark.parametrize("scenario, seed", [("default+empty_cache", 3), ("expandable", 0),
                                            ("fraction+gc+mss", 5)])
def test_mid_run_windows_that_cannot_be_exact_say_where_they_diverge(scenario, seed):
    """Windows whose starting state is ambiguous (GC ages, a guessed block size) never stop
    the replay: it reports how much matched and where it first differed."""
    sc = SCENARIOS[scenario]
    total = 150_109_880_320
    a = CachingAllocator(SimulatedDevice(total), sc["conf"], fraction=sc.get("fraction"))
    a.record_history(True, max_entries=1500)
    _workload(a, seed, 3000, empty_every=sc.get("empty_every", 0))
    res = replay_exact(from_snapshot(a.snapshot())[0], fraction=sc.get("fraction"),
                       device_total=total, conf=a.config)
    assert res.start == "mid-run"
    assert not res.exact and res.first_divergence is not None and ">>" in res.divergence
    assert 0 < res.segment_events_matched < res.segment_events
    assert res.allocs_matched <= res.allocs
    res.allocator.check()


@pytest.mark.skipif(not SNAPSHOTS, reason="../shared/reference/external is not here")
@pytest.mark.parametrize("name", ["DeComFL.memory.pickle", "code_location.memory_snapshot.pickle",
                                  "cs336_kkaitlyn111.ctx512_fullstep.pickle",
                                  "ftcourse.memory_snapshot.pickle"])
def test_an_imported_trace_replays_as_exactly_as_its_snapshot(name, tmp_path):
    """The importer keeps what exact replay needs (entries after the rebuilt start, streams,
    final segments), also through a .gdtrace file."""
    from gpudash.trace import load_trace
    from gpudash.formats.format import read_trace, write_trace
    from gpudash.trace.torch_replay import from_trace

    trace = load_trace(EXTERNAL / name)
    write_trace(trace, tmp_path / "t.gdtrace")
    again = read_trace(tmp_path / "t.gdtrace")
    snap = load_torch_snapshot_dict(EXTERNAL / name)
    for dev, tt in from_snapshot(snap, name).items():
        raw = replay_exact(tt)
        for t in (trace, again):
            res = replay_exact(from_trace(t, dev))
            assert res.exact and res.final_layout_equal, res.summary()
            assert (res.segment_events, res.allocs, res.ooms, res.start) == \
                (raw.segment_events, raw.allocs, raw.ooms, raw.start)


def test_streams_travel_through_import_and_files(tmp_path):
    from gpudash.trace import load_trace
    from gpudash.formats.format import read_trace, write_trace
    from gpudash.trace.torch_replay import from_trace
    from gpudash.formats.torch_snapshot import save_torch_snapshot  # noqa: F401

    a = CachingAllocator(SimulatedDevice(80 * GiB))
    a.record_history(True)
    _workload(a, 3, 1500, streams=(0, 0x55D0C0DE), empty_every=300)
    import pickle

    path = tmp_path / "two_streams.pickle"
    path.write_bytes(pickle.dumps(a.snapshot(), protocol=4))
    trace = load_trace(path)
    assert trace.stream is not None and set(trace.streams().tolist()) == {0, 0x55D0C0DE}
    write_trace(trace, tmp_path / "t.gdtrace")
    again = read_trace(tmp_path / "t.gdtrace")
    assert np.array_equal(again.streams(), trace.streams())
    res = replay_exact(from_trace(again, 0))
    assert res.exact, res.summary()
    # without the streams the same trace cannot be exact: blocks are cached per stream
    again.stream = None
    assert not replay_exact(from_trace(again, 0)).exact
