"""The controls act on the live session; refused values change nothing and snap back."""

from __future__ import annotations

import pytest
import test_widgets_model as shared
from test_widgets_model import GIB, KIB, MIB

import gpudash
from gpudash.widgets import ControlsView, LiveModel

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

comms = shared.comms  # fixtures shared with the model tests (recording comm, a session)
sess = shared.sess


@pytest.fixture
def model(sess):
    m = LiveModel(sess, start=False)
    yield m
    m.close()


def test_widgets_and_their_settings(comms, sess, model):
    c = ControlsView(model)
    assert (c.fraction.min, c.fraction.max, c.fraction.step) == (0.05, 1.0, 0.01)
    assert c.fraction.continuous_update is False and c.deferred.continuous_update is False
    assert 2 ** c.deferred.min == KIB and 2 ** c.deferred.max == GIB
    assert c.device_picker.layout.display == "none"  # one device: no dropdown
    assert "GiB" in c.limit_label.value
    assert c.deferred_label.value == "8.00 MiB"  # TensorFlow's default threshold
    # the buttons are as wide as their labels (none cut off), and say more on hover
    for button in (c.release, c.flush):
        assert button.layout.width == "auto" and button.tooltip
    assert c.release.description == "Release free regions"
    assert c.flush.description == "Flush deferred frees"
    # rows wrap in a narrow output area instead of cutting their last widgets off
    assert all(row.layout.flex_flow == "row wrap" for row in c.children[:3])
    assert repr(c).startswith("ControlsView(device=0")


def test_fraction_slider_changes_the_session_limit(comms, sess, model):
    c = ControlsView(model)
    total = sess.devices[0].total
    c.fraction.value = 0.3
    assert sess.devices[0].memory_limit == int(0.3 * total)
    assert sess.devices[0].options.per_process_gpu_memory_fraction == 0.3
    assert sess.gpu_options.per_process_gpu_memory_fraction == 0.3  # one device: session-wide
    assert c.error.value == ""
    assert "4.80 GiB" in c.limit_label.value
    assert f"{int(0.3 * total):,}" in c.fraction.tooltip
    # the limit event reached the model
    st = model.refresh_now()[0]
    assert st.limit == int(0.3 * total)
    assert any(m.setting == "per_process_gpu_memory_fraction" and m.new == 0.3
               for m in st.settings)
    # the label change was sent to the browser
    assert any("4.80 GiB" in v for v in comms.updates(c.limit_label, "value"))


def test_refused_value_shows_error_and_changes_nothing(comms, sess, model, monkeypatch):
    c = ControlsView(model)
    c.fraction.value = 0.5
    limit = sess.devices[0].memory_limit

    def refuse(**kwargs):
        raise gpudash.ConfigError("per_process_gpu_memory_fraction=0.2 refused for a test")

    monkeypatch.setattr(sess, "configure", refuse)
    c.fraction.value = 0.2
    assert sess.devices[0].memory_limit == limit
    assert "refused for a test" in c.error.value
    assert c.fraction.value == 0.5  # snapped back
    monkeypatch.undo()
    c.fraction.value = 0.4  # a good value clears the error
    assert c.error.value == ""
    assert sess.devices[0].memory_limit == int(0.4 * sess.devices[0].total)


def test_value_the_session_rejects(comms, model):
    """A real refusal: a session whose allocator cannot take a lower limit."""
    c = ControlsView(model)
    model.session.close()  # configure on a closed session raises ConfigError
    before = c.growth.value
    c.growth.value = not before
    assert "closed" in c.error.value
    assert c.growth.value == before


def test_growth_toggle_and_deferred_slider(comms, sess, model):
    c = ControlsView(model)
    assert c.growth.value is False
    c.growth.value = True
    assert sess.devices[0].allocator.allow_growth is True
    assert sess.devices[0].options.allow_growth is True
    c.deferred.value = 64 * KIB
    assert sess.devices[0]._deferred.threshold == 64 * KIB
    assert c.deferred_label.value == "64.00 KiB"


def test_release_button_returns_free_regions(comms):
    with gpudash.Session(simulate="1GiB", config={"allow_growth": True}, poll=False) as sess, \
            LiveModel(sess, start=False) as model:
        c = ControlsView(model)
        ptrs = [sess.allocate(8 * MIB) for _ in range(6)]
        for p in ptrs:
            sess.free_now(p)
        pool = sess.devices[0].allocator.pool_bytes
        assert pool > 0
        c.release.click()
        assert sess.devices[0].allocator.pool_bytes == 0
        assert f"released {gpudash._units.format_bytes(pool)}" in c.status.value


def test_flush_button_hands_deferred_frees_to_the_allocator(comms, sess, model):
    c = ControlsView(model)
    p = sess.allocate(MIB)
    sess.free(p)  # below the 8 MiB threshold: queued
    alloc = sess.devices[0].allocator
    assert alloc.bytes_in_use == MIB
    c.flush.click()
    assert alloc.bytes_in_use == 0
    assert "flushed 1.00 MiB" in c.status.value


def test_device_dropdown_switches_the_controls_device(comms):
    with gpudash.Session(simulate="2x16GiB", poll=False) as sess, \
            LiveModel(sess, start=False) as model:
        c = ControlsView(model)
        assert c.device_picker.layout.display != "none"
        assert [o[1] for o in c.device_picker.options] == [0, 1]
        c.device_picker.value = 1
        assert c.device == 1
        c.fraction.value = 0.25
        assert sess.devices[1].memory_limit == int(0.25 * sess.devices[1].total)
        assert sess.devices[0].memory_limit != sess.devices[1].memory_limit
        c.device = 0  # and back: the slider shows device 0's setting again
        assert c.device_picker.value == 0
        assert c.fraction.value != 0.25


def test_controls_follow_changes_made_elsewhere(comms, sess, model):
    c = ControlsView(model)
    sess.configure(per_process_gpu_memory_fraction=0.6)  # from a cell, not the slider
    model.refresh_now()
    assert c.fraction.value == 0.6
    assert sess.devices[0].memory_limit == int(0.6 * sess.devices[0].total)  # not re-applied


def test_pause_and_rate_are_linked_to_the_model(comms, model):
    c = ControlsView(model)
    c.pause.value = True
    assert model.paused and c.pause.description == "resume"
    model.paused = False
    assert c.pause.value is False and c.pause.description == "pause"
    c.rate.value = 2.0
    assert model.rate_hz == 2.0


def test_controls_without_a_session():
    alloc = gpudash.BFCAllocator(gpudash.SimulatedDevice(GIB), GIB)
    with LiveModel(alloc, start=False) as model:
        c = ControlsView(model)
        assert c.fraction.disabled and c.flush.disabled and not c.release.disabled
        c.release.click()
        assert c.error.value == ""
