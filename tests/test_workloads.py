"""Synthetic workloads (gpudash.workloads) and the sample traces built from them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import gpudash
from gpudash import BFCAllocator, OutOfMemoryError, SimulatedDevice
from gpudash.events import EventKind
from gpudash.trace import read_trace
from gpudash.trace.replay import replay
from gpudash.workloads import (
    WORKLOADS,
    fragmentation_stress,
    fragmentation_stress_calls,
    inference_server,
    inference_server_calls,
    iter_calls,
    run_workload,
    trace_from_calls,
    training_loop,
    training_loop_calls,
)

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "gpudash" / "samples"
A, F = int(EventKind.ALLOC), int(EventKind.FREE)
MIB, GIB = 1 << 20, 1 << 30

SMALL = {
    "training_loop": dict(steps=3, layers=3, hidden=512),
    "inference_server": dict(requests=40, max_batch=16),
    "fragmentation_stress": dict(rounds=300, high="200MiB", low="50MiB"),
    "finetune": dict(steps=3, layers=2, hidden=256, max_len=512),
}


def check_consistent(trace) -> None:
    """Every free matches a live alloc (id, address, size, requested); addresses are 256-aligned;
    live blocks never overlap; times increase; ids count from 1."""
    c = trace.columns
    kind, ptr, size, req, aid = (c[k].tolist() for k in
                                 ("kind", "ptr", "size", "requested", "alloc_id"))
    assert set(kind) <= {A, F}
    assert np.all(np.diff(c["time_ns"]) > 0)
    assert np.all(c["ptr"] % 256 == 0) and np.all(c["ptr"] > 0)
    assert np.array_equal(c["size"], np.maximum(256, (c["requested"] + 255) // 256 * 256))
    assert np.array_equal(c["alloc_id"][c["kind"] == A],
                          np.arange(1, int((c["kind"] == A).sum()) + 1))
    live: dict[int, tuple[int, int, int]] = {}
    by_ptr: dict[int, int] = {}
    for k, p, s, r, a in zip(kind, ptr, size, req, aid):
        if k == A:
            assert a not in live and p not in by_ptr
            live[a] = (p, s, r)
            by_ptr[p] = p + s
        else:
            assert live.pop(a) == (p, s, r)
            del by_ptr[p]
    # no two live blocks overlap at the end either (checked at every step in small traces)
    ends = sorted(by_ptr.items())
    assert all(e1 <= p2 for (_, e1), (p2, _) in zip(ends, ends[1:]))


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workload_traces_are_consistent_and_deterministic(name):
    fn, calls_fn = WORKLOADS[name]
    t = fn(**SMALL[name], seed=3)
    check_consistent(t)
    assert t == fn(**SMALL[name], seed=3)
    other = fn(**SMALL[name], seed=4)
    assert not np.array_equal(other.columns["requested"][:len(t)],
                              t.columns["requested"][:len(other)]) or len(other) != len(t)
    assert t.meta["source"] == "synthetic"
    assert t.meta["workload"] == name
    params = t.meta["parameters"]
    assert params["seed"] == 3 and {k: params[k] for k in SMALL[name]} == SMALL[name]
    # the trace holds exactly the generator's calls
    calls = list(calls_fn(**SMALL[name], seed=3))
    assert len(calls) == len(t)
    assert [c[0] for c in calls] == ["alloc" if k == A else "free" for k in t.columns["kind"]]
    assert [c[2] for c in calls if c[0] == "alloc"] == \
        t.columns["requested"][t.columns["kind"] == A].tolist()


def test_no_overlap_at_any_time():
    t = fragmentation_stress(rounds=200, high="100MiB", low="30MiB")
    c = t.columns
    live: dict[int, int] = {}
    for k, p, s in zip(c["kind"].tolist(), c["ptr"].tolist(), c["size"].tolist()):
        if k == A:
            for q, e in live.items():
                assert p + s <= q or e <= p
            live[p] = p + s
        else:
            del live[p]
    assert not live


def test_training_loop_structure():
    calls = list(training_loop_calls(steps=2, layers=3, batch=8, hidden=128, seed=0))
    allocs = {k: n for op, k, *rest in calls if op == "alloc" for n in rest}
    frees = [k for op, k, *_ in calls if op == "free"]
    weights = [k for k, n in allocs.items() if n == 128 * 128 * 4]
    # 3 weights + 6 Adam slots stay; per step 3 weight gradients and 3 optimizer temps go
    assert len(set(weights) - set(frees)) == 3 + 3 * 2
    assert len(allocs) - len(frees) == 3 * 2 + 3 * 4  # weights, biases, 4 slots per layer
    # step 0: the forward pass allocates (pre-activation, activation) per layer, between the
    # input batch and the loss; the backward pass frees them layer by layer in reverse
    act = 8 * 128 * 4
    start = next(i for i, c in enumerate(calls) if c[0] == "alloc" and c[2] == act)
    loss = next(i for i, c in enumerate(calls) if c[0] == "alloc" and c[2] == 256)
    fwd = [c[1] for c in calls[start + 1:loss] if c[0] == "alloc" and c[2] == act]
    assert len(fwd) == 2 * 3
    layer = {k: i // 2 for i, k in enumerate(fwd)}
    freed = [layer[k] for k in frees if k in layer]
    assert freed == [2, 2, 1, 1, 0, 0]


def test_inference_server_frees_everything():
    t = inference_server(requests=30, seed=1)
    assert t.meta["live_at_end"] == 7  # the model's weights
    assert int((t.columns["kind"] == A).sum()) - int((t.columns["kind"] == F).sum()) == 7


def test_fragmentation_stress_is_more_fragmented_than_training():
    train = replay(training_loop(), record=False).per_call["fragmentation"]
    stress = replay(fragmentation_stress(), record=False).per_call["fragmentation"]
    assert stress.mean() > train.mean() + 0.25
    assert np.median(stress) > 0.7 > np.median(train) + 0.3
    with pytest.raises(ValueError, match="low < high"):
        list(fragmentation_stress_calls(10, low="2GiB", high="1GiB"))


def test_trace_from_calls_rejects_bad_streams():
    with pytest.raises(ValueError, match="not live"):
        trace_from_calls([("free", 1)])
    with pytest.raises(ValueError, match="still live"):
        trace_from_calls([("alloc", 1, 10), ("alloc", 1, 10)])
    with pytest.raises(ValueError, match="unknown call"):
        trace_from_calls([("realloc", 1, 10)])
    with pytest.raises(ValueError, match="steps"):
        training_loop(steps=0)


# ------------------------------------------------------------------------- live use
def test_run_workload_drives_an_allocator_and_survives_oom():
    a = BFCAllocator(SimulatedDevice("1GiB"), 256 * MIB, allow_growth=False)
    calls = [("alloc", "x", 100 * MIB), ("alloc", "y", 200 * MIB), ("free", "y"),
             ("alloc", "z", MIB), ("free", "x")]
    out = run_workload(calls, a.allocate, a.deallocate)
    assert (out.allocs, out.frees, out.ooms, out.skipped_frees) == (3, 1, 1, 1)
    assert list(out.live) == ["z"]
    assert a.stats().bytes_in_use == MIB
    with pytest.raises(ValueError, match="never allocated"):
        run_workload([("free", "nope")], a.allocate, a.deallocate)
    stopped = run_workload(inference_server_calls(5), a.allocate, a.deallocate,
                           stop=lambda: True)
    assert stopped.allocs == 0
    assert "ooms=1" in repr(out)


def test_run_workload_of_iter_calls_reproduces_the_replay():
    t = training_loop(steps=2, layers=3, hidden=1024)
    a = BFCAllocator(SimulatedDevice("16GiB"), 15569256448, allow_growth=True)
    out = run_workload(iter_calls(t), a.allocate, a.deallocate)
    r = replay(t)
    assert out.ooms == 0 and a.stats().peak_bytes_in_use == r.peak_bytes_in_use
    assert a.snapshot().chunks == r.final_snapshot.chunks


def test_run_workload_catches_gpudash_oom():
    a = BFCAllocator(SimulatedDevice("64MiB"), 32 * MIB)
    out = run_workload(training_loop_calls(steps=1, layers=2, hidden=4096), a.allocate,
                       a.deallocate)
    assert out.ooms > 0
    assert issubclass(OutOfMemoryError, MemoryError)


# ------------------------------------------------------------------------- samples
@pytest.mark.parametrize("name", ["training", "inference", "fragmentation"])
def test_sample_traces_are_small_and_readable(name):
    path = SAMPLES / f"{name}.gdtrace"
    assert path.stat().st_size < 300_000
    t = read_trace(path)
    check_consistent(t)
    assert t.meta["source"] == "synthetic"
    assert replay(t, record=False).fits


def test_make_samples_regenerates_the_same_traces(tmp_path):
    spec = importlib.util.spec_from_file_location("make_samples",
                                                  ROOT / "benchmarks" / "make_samples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sizes = mod.make_samples(tmp_path)
    assert set(sizes) == {"training.gdtrace", "inference.gdtrace", "fragmentation.gdtrace"}
    for name in sizes:
        new, old = read_trace(tmp_path / name), read_trace(SAMPLES / name)
        for col in new.columns:
            assert np.array_equal(new.columns[col], old.columns[col]), (name, col)
        # the committed files may come from an older gpudash version
        new.meta.pop("gpudash_version")
        old.meta.pop("gpudash_version")
        assert new.meta == old.meta


def test_the_samples_ship_in_the_package():
    """``gpudash.samples`` finds its traces through the package (a wheel carries them)."""
    from gpudash import samples

    assert samples.names() == ["fragmentation.gdtrace", "inference.gdtrace",
                               "training.gdtrace"]
    assert samples.path("training") == samples.path("training.gdtrace")
    assert samples.path("training").parent == Path(gpudash.__file__).parent / "samples"
    trace = samples.load("training")
    assert "events=2072" in repr(trace)  # what make_samples.py wrote
    with pytest.raises(gpudash.ConfigError, match="no sample trace 'nope.gdtrace'"):
        samples.path("nope")


def test_caching_snapshot_is_pytorchs_snapshot_and_stops_at_the_first_oom():
    from gpudash.formats.torch_snapshot import load_torch_snapshot
    from gpudash.workloads import caching_snapshot, finetune_calls

    small = dict(steps=4, layers=4, hidden=1024, max_len=1024)
    fits = caching_snapshot(finetune_calls(**small), device_bytes="4GiB")
    actions = [e["action"] for e in fits["device_traces"][0]]
    assert "oom" not in actions and actions[0] == "segment_alloc"
    n_alloc = sum(1 for c in finetune_calls(**small) if c[0] == "alloc")
    assert actions.count("alloc") == n_alloc
    tight = caching_snapshot(finetune_calls(**small), device_bytes="400MiB",
                             conf="expandable_segments:True")
    assert [e["action"] for e in tight["device_traces"][0][-2:]] == ["oom", "snapshot"]
    assert tight["allocator_settings"]["expandable_segments"] is True
    assert load_torch_snapshot(tight).meta["source"] == "pytorch-snapshot"
