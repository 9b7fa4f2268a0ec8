"""The live views on a PyTorch session, over real widgets and a recording comm: the dashboard
takes the allocator model's controls, words, pools and stats, and every control acts on the
session as PyTorch would and answers in words.

The same dashboard on a BFC session (test_widgets_dashboard.py) keeps TensorFlow's controls
and words; the browser side is in test_browser.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_widgets_model as shared
from test_widgets_dashboard import act, decode, say, sent
from test_widgets_model import GIB, MIB

import gpudash
from gpudash.models import BFC, TORCH
from gpudash.widgets import Dashboard, LiveModel

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

comms = shared.comms


@pytest.fixture
def tsess():
    s = gpudash.Session(allocator="torch", simulate="16GiB")
    yield s
    s.close()


@pytest.fixture
def model(tsess):
    m = LiveModel(tsess, start=False)
    yield m
    m.close()


@pytest.fixture
def dash(model):
    d = Dashboard(model=model)
    yield d
    d.close()


def _work(sess) -> list[int]:
    """A small pool and a large one, a free block in each, an expandable-less layout."""
    keep = [sess.allocate(n) for n in (1000, 3000, 5 * MIB, 30 * MIB, 200 * MIB)]
    sess.free(keep.pop(1))
    sess.free(keep.pop(2))  # the 30 MiB segment is wholly free
    return keep


# ------------------------------------------------------------------------------ the model
def test_states_count_pools_and_carry_pytorch_s_figures(tsess, model):
    _work(tsess)
    st = model.refresh_now()[0]
    assert st.model is TORCH and model.model(0) is TORCH
    alloc = tsess.devices[0].allocator
    table = alloc.chunk_table()
    # two bars, the pools: bytes per pool as the allocator's own pool statistics
    assert len(st.bins.free_bytes) == 2
    stats = alloc.memory_stats()
    used = st.bins.in_use_bytes
    assert used[0] == stats["allocated_bytes.small_pool.current"]
    assert used[1] == stats["allocated_bytes.large_pool.current"]
    assert used.sum() + st.bins.free_bytes.sum() == stats["reserved_bytes.all.current"]
    assert st.figures["num_alloc_retries"] == 0 and st.figures["segment.all.current"] == 4
    assert st.in_force["fraction"] is None and st.in_force["conf"] == ""
    assert TORCH.region_kinds(table) == ["small", "large", "large", "large"]
    # a BFC state keeps its 21 bins and no figures
    with gpudash.Session(simulate="1GiB", poll=False) as bsess, LiveModel(
            bsess, start=False) as bmodel:
        bsess.allocate(MIB)
        bst = bmodel.refresh_now()[0]
        assert bst.model is BFC and len(bst.bins.free_bytes) == 21 and bst.figures == {}


def test_stats_rows_are_pytorch_s_names(tsess, model):
    _work(tsess)
    tsess.configure(fraction=0.5)
    state = model.refresh_now()[0]
    rows = {label: (value, exact) for label, value, exact in state.model.stats_rows(state)}
    alloc = tsess.devices[0].allocator
    stats = alloc.memory_stats()
    assert rows["allocated_bytes.all.current"][1] == \
        f"{stats['allocated_bytes.all.current']:,} B"
    assert rows["reserved_bytes.all.current"][1] == f"{stats['reserved_bytes.all.current']:,} B"
    assert rows["limit"] == ("8.00 GiB", "set_per_process_memory_fraction(0.5)")
    assert rows["segment.all.current"] == ("4", "1 small pool, 3 large pool")
    for key in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
                "reserved - allocated", "inactive_split_bytes.all.current"):
        assert key in rows, key
    assert "bytes_in_use" not in rows and "pool_bytes" not in rows  # TensorFlow's names


# ------------------------------------------------------------------------------ dashboard
def test_the_snapshot_carries_the_model_its_pools_and_segment_kinds(comms, tsess, dash):
    _work(tsess)
    dash.model.refresh_now()
    say(dash, {"type": "hello"})
    (content, buffers), = sent(comms, dash, "snapshot")
    info = content["controls"]["model"]
    assert info["name"] == "torch"
    assert [c["name"] for c in info["controls"]] == ["fraction", "expandable", "max_split",
                                                     "gc", "empty_cache"]
    assert info["words"]["in_use"] == "allocated" and info["words"]["pool"] == "reserved"
    assert info["words"]["map"] == "segment map" and info["bin_labels"][1] == "large pool"
    assert content["controls"]["settings"]["expandable_segments"] is False
    chunks = content["chunks"]
    assert chunks["n_bins"] == 2 and chunks["region_kinds"] == ["small", "large", "large",
                                                                 "large"]
    d = decode(dict(content, chunks=None), buffers)  # the timeline and heatmap as drawn
    assert d["in_use"][-1] == tsess.devices[0].allocator.bytes_in_use
    bins = np.frombuffer(buffers[4], dtype=np.float64).reshape(5, 2)
    assert bins[1].sum() == tsess.devices[0].allocator.bytes_in_use  # in use, by pool
    head = content["headline"]
    assert ["segments", "4 (1 small, 3 large)"] in head["extra"]
    assert ["num_alloc_retries", "0"] in head["extra"] and head["banner"] == ""
    assert ["segments", "4 (1 small, 3 large)"] == head["extra"][0]


def test_each_control_acts_as_pytorch_does_and_answers_in_words(comms, tsess, dash):
    alloc = tsess.devices[0].allocator
    _work(tsess)
    reply = act(comms, dash, "fraction", 0.25)
    assert reply["ok"] and alloc.fraction == 0.25 and alloc.memory_limit == 4 * GIB
    assert reply["text"] == ("fraction 0.250: limit 4.00 GiB "
                             "(torch.cuda.set_per_process_memory_fraction(0.25); segments "
                             "held stay)")
    assert reply["controls"]["settings"]["fraction"] == 0.25
    reply = act(comms, dash, "expandable", True)
    assert reply["ok"] and alloc.config.expandable_segments
    assert reply["text"].startswith("expandable_segments: on: segments made from now on are "
                                    "expandable")
    assert "the 4 segment(s) held stay as they are" in reply["text"]
    assert reply["text"].endswith("torch.cuda.memory._set_allocator_settings("
                                  "'expandable_segments:True')")
    p = tsess.allocate(50 * MIB)
    assert {s["address"]: s["is_expandable"] for s in alloc.segments()}[p] is True
    with pytest.warns(gpudash.GpudashWarning, match="pytorch/pytorch#123548"):   # the session's
        reply = act(comms, dash, "max_split", 128)
    assert reply["ok"] and alloc.config.max_split_size == 128 * MIB
    assert "blocks of 128 MiB or more are not split" in reply["text"]
    # with expandable segments on: PyTorch's rule for the two, and no line to paste
    assert "_set_allocator_settings" not in reply["text"]
    assert "pytorch/pytorch#123548" in reply["warning"]
    reply = act(comms, dash, "max_split", None)  # an empty field: unset
    assert reply["ok"] and alloc.config.max_split_size is None
    reply = act(comms, dash, "gc", 0.6)
    assert reply["ok"] and alloc.config.garbage_collection_threshold == 0.6
    assert "above 60% of the limit (2.40 GiB)" in reply["text"]
    tsess.free(p)
    reserved = alloc.pool_bytes
    reply = act(comms, dash, "empty_cache")
    assert reply["ok"] and alloc.pool_bytes < reserved
    freed = reserved - alloc.pool_bytes
    assert reply["text"].startswith(f"empty_cache(): returned {gpudash._units.format_bytes(freed)}")
    assert "segment(s)" in reply["text"] and "each holds an allocated block" in reply["text"]


def test_refused_values_change_nothing_and_say_why(comms, tsess, dash):
    alloc = tsess.devices[0].allocator
    for name, value, why in (("fraction", 1.5, "set_per_process_memory_fraction"),
                             ("fraction", True, "set_per_process_memory_fraction"),
                             ("max_split", 10, "max_split_size_mb must be >= 20"),
                             ("max_split", 64.5, "max_split_size_mb must be an integer"),
                             ("gc", 1.2, "garbage_collection_threshold must be in"),
                             ("expandable", "yes", "expandable_segments must be True"),
                             ("growth", True, "unknown control 'growth'"),
                             ("deferred", MIB, "unknown control 'deferred'")):
        reply = act(comms, dash, name, value)
        assert not reply["ok"] and why in reply["text"], (name, reply["text"])
    assert alloc.fraction is None and alloc.config.as_conf() == ""


def test_a_fraction_below_what_is_reserved_says_what_pytorch_does(comms, tsess, dash):
    keep = tsess.allocate(3 * GIB)
    reply = act(comms, dash, "fraction", 0.125)  # 2 GiB below the 3 GiB reserved
    assert reply["warning"].startswith("reserved 3.00 GiB is 1.00 GiB above the new limit: "
                                       "PyTorch gives nothing back by itself")
    dash.model.refresh_now()
    say(dash, {"type": "hello"})
    head = sent(comms, dash, "snapshot")[-1][0]["headline"]
    assert head["pending_release"] == GIB and head["regions_holding"] == 1
    assert head["banner"].startswith("reserved above limit: 3.00 GiB held against a 2.00 GiB "
                                     "limit. PyTorch gives nothing back by itself")
    tsess.free(keep)
    reply = act(comms, dash, "empty_cache")
    assert reply["text"] == "empty_cache(): returned 3.00 GiB"


# ------------------------------------------------------------------------------ what-if
def test_the_what_if_view_of_a_pytorch_trace_speaks_pytorch_s_settings(comms):
    """A PyTorch snapshot replays through PyTorch's model: allocated and reserved lines, an
    expandable_segments toggle, and the minimum fraction with the line that sets it."""
    from gpudash.formats.torch_snapshot import load_torch_snapshot
    from gpudash.workloads import caching_snapshot, finetune_calls
    from gpudash.widgets import WhatIfView

    trace = load_torch_snapshot(caching_snapshot(finetune_calls(steps=12, layers=8),
                                                 device_bytes="8GiB"))
    view = WhatIfView(trace, background=False, min_fraction_delay=0)
    try:
        assert view.allocator_model is TORCH
        assert [t.name for t in view.timeline.data[:3]] == ["allocated", "reserved", "limit"]
        assert view.slider.tooltip == "torch.cuda.set_per_process_memory_fraction"
        # the device the replay took (the snapshot's when it shows one, else assumed)
        assert view.device_bytes == view.result.options["device_bytes"]
        toggle = view.toggles["expandable_segments"]
        assert toggle.value is False  # the snapshot's own setting
        assert view.wait_min_fraction(120)
        text = view.min_fraction_text.value
        assert "minimum fraction that fits" in text
        assert "torch.cuda.set_per_process_memory_fraction(" in text
        toggle.value = True  # a what-if: the same calls with expandable segments
        assert view.result.options["conf"] == "expandable_segments:True"
        assert view.result.fidelity is None and "peak reserved" in view.status.value
        assert view.wait_min_fraction(120)
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in \
            view.min_fraction_text.value
    finally:
        view.close()
    # a TensorFlow trace keeps its view: no toggles, its words
    from gpudash.workloads import fragmentation_stress

    bfc = WhatIfView(fragmentation_stress(rounds=50, seed=1), background=False,
                     min_fraction=False)
    try:
        assert bfc.toggles == {} and bfc.timeline.data[0].name == "in use"
    finally:
        bfc.close()
