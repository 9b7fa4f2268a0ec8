"""replay() through PyTorch's caching-allocator model: exact by default for a PyTorch
snapshot, what-if under other settings or devices, and either model for either framework's
trace (each answer saying what it assumed)."""

from __future__ import annotations

import pytest

from gpudash import ConfigError
from gpudash.trace.replay import replay
from gpudash.formats.torch_snapshot import load_torch_snapshot
from gpudash.workloads import caching_snapshot, finetune_calls, training_loop

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

GiB = 1 << 30


@pytest.fixture(scope="module")
def at24():
    """The fine-tuning job on a 24 GiB GPU: PyTorch's defaults run out of memory."""
    return load_torch_snapshot(caching_snapshot(finetune_calls(), device_bytes="24GiB"))


@pytest.fixture(scope="module")
def at80():
    """The same job on an 80 GiB GPU: it fits, and the trace does not say the GPU's size."""
    return load_torch_snapshot(caching_snapshot(finetune_calls(), device_bytes="80GiB"))


def test_a_snapshot_replays_exactly_by_default_in_pytorchs_words(at24):
    r = replay(at24)
    assert r.allocator == "torch" and r.options["exact"] is True
    assert r.fidelity.exact, r.fidelity.summary()
    assert r.oom_count == 1 and r.fidelity.ooms == r.fidelity.ooms_matched == 1
    assert r.memory_limit == 24 * GiB
    device_notes = [a for a in r.assumed if a.startswith("device ")]
    assert len(device_notes) == 1 and "from the oom entry" in device_notes[0]
    # snapshots do not record PyTorch's version: the rules used are said, unless given
    assert any("does not record the version" in a for a in r.assumed)
    assert not any("version" in a for a in replay(at24, torch_version="2.4").assumed)
    assert "peak_reserved=" in repr(r) and "peak_pool" not in repr(r)
    # the model's own snapshot at the end has the final segments of the trace
    reserved = sum(s["total_size"] for s in r.snapshot["segments"])
    assert reserved == sum(s["total_size"] for s in
                           caching_snapshot(finetune_calls(), device_bytes="24GiB")["segments"])


def test_the_bigger_gpus_trace_on_the_smaller_gpu_fails_where_that_run_failed(at24, at80):
    exact = replay(at24)
    whatif = replay(at80, device_bytes="24GiB")
    assert whatif.options["exact"] is False and whatif.fidelity is None
    assert whatif.first_oom == exact.first_oom
    assert not any(a.startswith("device ") for a in whatif.assumed)


def test_expandable_segments_fit_what_the_defaults_could_not(at24, at80):
    fixed = replay(at24, expandable_segments=True)
    assert fixed.fits and fixed.options["conf"] == "expandable_segments:True"
    moved = replay(at80, device_bytes="24GiB", conf="expandable_segments:True")
    default = replay(at80, device_bytes="24GiB")
    assert moved.fits and not default.fits
    assert moved.peak_bytes_in_use > default.peak_bytes_in_use  # it ran the whole job


def test_exact_only_when_the_device_could_be_the_recorded_one(at24, at80):
    assert replay(at24, device_bytes=24 * GiB).options["exact"] is True
    assert replay(at24, device_bytes=25 * GiB).options["exact"] is False
    r80 = replay(at80)  # no OOM entry: the size is assumed, and said so
    assert r80.options["exact"] is True and r80.fidelity.exact
    assert any(a.startswith("device ") and "does not say" in a and "device_bytes=" in a
               for a in r80.assumed)
    assert replay(at80, device_bytes="80GiB").options["exact"] is True
    assert replay(at80, device_bytes="20GiB").options["exact"] is False
    with pytest.raises(ConfigError, match="exact=False"):
        replay(training_loop(steps=1, layers=2, hidden=256), allocator="torch", exact=True)


def test_either_model_for_either_trace_and_each_settings_own_model(at80):
    bfc = replay(at80, allocator="bfc")
    assert bfc.allocator == "bfc" and "peak_pool=" in repr(bfc)
    assert any(a.startswith("device ") for a in bfc.assumed)
    tf = training_loop(steps=2, layers=2, hidden=512)
    r = replay(tf, allocator="torch", device_bytes="4GiB")
    assert r.allocator == "torch" and r.fits and r.fidelity is None
    assert r.peak_pool_bytes % (2 * (1 << 20)) == 0  # PyTorch's segments: 2 MiB multiples
    with pytest.raises(ConfigError, match="allocator='torch'"):
        replay(tf, expandable_segments=True)
    with pytest.raises(ConfigError, match="not a setting of PyTorch"):
        replay(at80, allow_growth=False)
    with pytest.raises(ConfigError, match="allocator must be one of"):
        replay(at80, allocator="tpu")


def test_knobs_and_conf_strings_reach_the_model(at80):
    r = replay(at80, device_bytes="24GiB", max_split_size_mb=200,
               garbage_collection_threshold=0.8)
    assert r.options["conf"] == "max_split_size_mb:200,garbage_collection_threshold:0.8"
    assert r.options["exact"] is False
    half = replay(at80, fraction=0.5, device_bytes="48GiB")
    assert half.memory_limit == 24 * GiB
    assert half.first_oom == replay(at80, device_bytes="24GiB").first_oom
    with pytest.raises(ConfigError, match="max_split_size_mb"):
        replay(at80, conf="max_split_size_mb:1")


# ------------------------------------------------------------------------------ what-if
def test_min_fraction_speaks_pytorch_and_expandable_segments_need_less(at80):
    from gpudash.trace.whatif import min_fraction

    default = min_fraction(at80, "40GiB", tolerance=0.002)
    expandable = min_fraction(at80, "40GiB", tolerance=0.002, expandable_segments=True)
    assert default.allocator == expandable.allocator == "torch"
    assert expandable.fraction < default.fraction
    # the boundary is real: the answer fits and a tolerance below it does not
    assert replay(at80, device_bytes="40GiB", fraction=default.fraction).fits
    assert not replay(at80, device_bytes="40GiB",
                      fraction=default.fraction - 0.002).fits
    assert default.limit_bytes == int(default.fraction * 40 * GiB)  # PyTorch's rule
    lines = expandable.paste_lines()
    assert lines[0] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert lines[1].startswith("torch.cuda.set_per_process_memory_fraction(0.")
    assert all("gpu_options" not in line for line in default.paste_lines())
    # the BFC answer for a PyTorch trace, in TensorFlow's words, says what it assumed
    bfc = min_fraction(at80, tolerance=0.01, allocator="bfc")
    assert bfc.allocator == "bfc" and any("does not say" in a for a in bfc.assumed)
    assert bfc.paste_lines()[0].startswith(
        "config.gpu_options.per_process_gpu_memory_fraction")


def test_sweep_varies_expandable_segments_in_processes_too(at80):
    from gpudash.trace.whatif import sweep

    kw = dict(fractions=[0.58, 0.62], device_bytes="40GiB")
    local = sweep(at80, **kw)
    assert [(r["fraction"], r["expandable_segments"], r["fits"]) for r in local] == [
        (0.58, False, False), (0.58, True, True), (0.62, False, True), (0.62, True, True)]
    assert "allow_growth" not in local[0]
    assert sweep(at80, jobs=2, **kw) == local
    text = local.to_text()
    assert text.split()[:2] == ["fraction", "expandable"] and "peak reserved" in text
    assert "PyTorch's caching allocator" in text
    assert local.best()["fraction"] == 0.58 and local.best()["expandable_segments"]
    with pytest.raises(ConfigError, match="not a setting of PyTorch's caching allocator"):
        sweep(at80, allow_growth=True)
    with pytest.raises(ConfigError, match="set_per_process_memory_fraction"):
        sweep(at80, [1.5])
    bfc = sweep(at80, [0.6], allocator="bfc", **{"device_bytes": "40GiB"})
    assert "allow_growth" in bfc[0] and bfc.allocator == "bfc"


def test_the_report_and_state_views_speak_pytorch(at24):
    from gpudash.analysis import chunk_map_at_peak, state_at
    from gpudash.report import build_report

    page = build_report(at24, title="t")
    for words in ("PYTORCH_CUDA_ALLOC_CONF", "set_per_process_memory_fraction",
                  "peak reserved", "peak allocated", "Segment map at the peak",
                  "Pool occupancy", "<th>expandable</th>", "replayed exactly"):
        assert words in page, words
    assert "allow_growth" not in page and "Chunk map" not in page
    # the state views replay the trace through PyTorch's model: pools, not bins
    peak = chunk_map_at_peak(at24)
    assert peak.extra["layout"] == "pools" and len(peak.bins) == 2
    end = state_at(at24, -1)
    assert end.stats.pool_bytes == sum(
        s["total_size"] for s in caching_snapshot(finetune_calls(),
                                                  device_bytes="24GiB")["segments"])


def test_sweep_crosses_more_of_pytorchs_knobs(at80):
    from gpudash.trace.whatif import sweep

    table = sweep(at80, [0.6], device_bytes="40GiB",
                  vary={"max_split_size_mb": [None, 256],
                        "garbage_collection_threshold": [None, 0.8]})
    assert len(table) == 8 and table.varied == ["max_split_size_mb",
                                                "garbage_collection_threshold"]
    cols = table.columns()
    assert list(cols)[:4] == ["fraction", "expandable_segments", "max_split_size_mb",
                              "garbage_collection_threshold"]
    # max_split_size_mb with expandable segments: PyTorch's own internal assert, not a fit
    failing = [r for r in table if r.get("error")]
    assert failing and all(r["expandable_segments"] and r["max_split_size_mb"] == 256
                           for r in failing)
    assert all("pytorch/pytorch#123548" in r["error"] for r in failing)
    mss = [r for r in table if r["max_split_size_mb"] == 256 and not r["expandable_segments"]
           and r["garbage_collection_threshold"] is None]
    assert mss[0]["fits"] and mss[0]["extensions"] > 300   # fits, with many more segments
    assert not table.best().get("error")
    with pytest.raises(ConfigError, match="not a knob a sweep varies"):
        sweep(at80, [0.6], vary={"expandable_segments": [True]})
