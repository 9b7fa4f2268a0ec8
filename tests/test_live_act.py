"""The live layer without a UI: ``LiveModel.act``, the one path by which a control acts (the
dashboard's and a Dask worker's views alike), and the layers below the views importing no UI
library."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_widgets_model import GIB, MIB

import gpudash
from gpudash import ConfigError
from gpudash.live import DeviceFeed, FeedSample, LiveModel
from gpudash.live.feeds import CONTROL_NAMES

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)


@pytest.fixture
def sess():
    with gpudash.Session(simulate="2x4GiB", poll=False) as s:
        yield s


@pytest.fixture
def model(sess):
    with LiveModel(sess, start=False) as m:
        yield m


@pytest.mark.parametrize("module", ["gpudash.live", "gpudash.live.model", "gpudash.monitors",
                                    "gpudash.monitors._base", "gpudash.monitors._parse",
                                    "gpudash.dask.model", "gpudash.dask.control"])
def test_the_layers_below_the_views_import_no_ui_library(module):
    if module.startswith("gpudash.dask"):
        pytest.importorskip("distributed")
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            "from gpudash.live import LiveModel, DeviceFeed; "
            "print([m for m in ('ipywidgets', 'anywidget', 'plotly') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_live_model_acts_and_answers_without_a_ui_library():
    """A session watched and steered with no widget anywhere: the live layer alone."""
    code = ("import sys, gpudash\nfrom gpudash.live import LiveModel\n"
            "with gpudash.Session(simulate='1GiB', poll=False) as s, "
            "LiveModel(s, start=False) as m:\n"
            "    print(m.act(0, 'fraction', 0.5)['text'])\n"
            "print([n for n in ('ipywidgets', 'anywidget', 'plotly') if n in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    answer, loaded = out.stdout.strip().splitlines()
    assert answer.startswith("fraction 0.500: limit 512.00 MiB") and loaded == "[]"


def test_a_setting_reaches_the_session_of_that_device_only_and_is_answered(sess, model):
    dev0, dev1 = sess.devices
    before = dev0.memory_limit
    answer = model.act(1, "fraction", 0.25)
    assert answer["ok"] and answer["text"].startswith("fraction 0.250: limit 1.00 GiB")
    assert dev1.memory_limit == GIB and dev1.options.per_process_gpu_memory_fraction == 0.25
    assert dev0.memory_limit == before
    # the limit event reached the model: the next state shows the new limit and the change
    st = model.refresh_now()[1]
    assert st.limit == GIB
    assert any(m.setting == "per_process_gpu_memory_fraction" and m.new == 0.25
               for m in st.settings)
    assert model.act(0, "growth", True) == {"ok": True, "text": "growth: on"}
    assert dev0.allocator.allow_growth and not dev1.allocator.allow_growth
    assert model.act(0, "deferred", 64 * MIB)["text"] == "deferred deletion: 64.00 MiB"
    assert dev0._deferred.threshold == 64 * MIB


@pytest.mark.parametrize("name, value, words", [
    ("growth", "false", "allow_growth"),        # no coercion: a string is not a bool
    ("fraction", None, "per_process_gpu_memory_fraction"),
    ("fraction", True, "per_process_gpu_memory_fraction"),
    ("fraction", 1.5, "per_process_gpu_memory_fraction"),  # the session refuses it
    ("deferred", -1, "deferred_deletion_bytes"),
    ("bogus", 1, "unknown control 'bogus'"),
])
def test_a_refused_value_changes_nothing_and_says_why(sess, model, name, value, words):
    dev = sess.devices[0]
    before = (dev.memory_limit, dev.allocator.allow_growth, dev._deferred.threshold,
              dev.options)
    with pytest.raises(ConfigError, match=words):
        model.act(0, name, value)
    assert (dev.memory_limit, dev.allocator.allow_growth, dev._deferred.threshold,
            dev.options) == before


def test_buttons_release_and_flush(sess, model):
    alloc = sess.devices[0].allocator
    sess.free_now(sess.allocate(GIB))  # a wholly free region stays in the pool
    pool = alloc.pool_bytes
    answer = model.act(0, "release")
    assert answer["ok"] and alloc.pool_bytes < pool and answer["text"].startswith("released ")
    p = sess.allocate(MIB)
    sess.free(p)  # below the 8 MiB threshold: queued
    assert alloc.bytes_in_use == MIB
    answer = model.act(0, "flush")
    assert alloc.bytes_in_use == 0 and "1.00 MiB" in answer["text"]


def test_a_bare_allocator_releases_but_has_no_session_to_configure():
    alloc = gpudash.BFCAllocator(gpudash.SimulatedDevice(GIB), GIB, allow_growth=True)
    with LiveModel(alloc, start=False) as model:
        alloc.deallocate(alloc.allocate(64 * MIB))
        assert model.act(0, "release")["ok"] and alloc.pool_bytes == 0
        with pytest.raises(ConfigError, match="needs a gpudash.Session"):
            model.act(0, "flush")
        with pytest.raises(ConfigError, match="needs a gpudash.Session"):
            model.act(0, "fraction", 0.5)
        assert alloc.memory_limit == GIB


def test_pytorch_s_controls_act_through_the_same_path():
    with gpudash.Session(allocator="torch", simulate="16GiB") as tsess, \
            LiveModel(tsess, start=False) as model:
        alloc = tsess.devices[0].allocator
        answer = model.act(0, "expandable", True)
        assert alloc.config.expandable_segments
        assert answer["text"].startswith("expandable_segments: on")
        with pytest.raises(ConfigError, match="max_split_size_mb"):
            model.act(0, "max_split", 12)  # below PyTorch's 20 MiB
        assert alloc.config.max_split_size is None
        with pytest.raises(ConfigError, match="unknown control 'growth'"):
            model.act(0, "growth", True)  # TensorFlow's control, not PyTorch's


class _Feed(DeviceFeed):
    """A controllable feed that keeps what it was asked to do."""

    name = "remote GPU_0_bfc"
    kind = "dask"
    capacity = 4 * GIB

    def __init__(self, controls=None):
        self.controls = controls
        self.calls = []
        self.limit = 4 * GIB

    def sample(self):
        from gpudash.bfc import AllocatorStats

        return FeedSample(time_ms=0.0, stats=AllocatorStats(bytes_limit=self.limit))

    def settings(self):
        return {"fraction": self.limit / self.capacity, "allow_growth": False,
                "deferred_deletion_bytes": 8 * MIB, "limit": self.limit,
                "total": self.capacity}

    def configure(self, **changes):
        assert set(changes) <= set(CONTROL_NAMES)
        self.calls.append(("configure", changes))
        if "per_process_gpu_memory_fraction" in changes:
            self.limit = int(changes["per_process_gpu_memory_fraction"] * self.capacity)

    def release_free_regions(self):
        self.calls.append(("release", None))
        return 2 * MIB


def test_a_feed_is_acted_on_by_its_own_control_methods():
    feed = _Feed()
    with LiveModel(feeds=[feed], start=False) as model:
        answer = model.act(0, "fraction", 0.5)
        assert feed.calls == [("configure", {"per_process_gpu_memory_fraction": 0.5})]
        assert answer["text"].startswith("fraction 0.500: limit 2.00 GiB")
        assert model.act(0, "release")["text"].startswith("released 2.00 MiB")
        with pytest.raises(ConfigError, match="allow_growth"):
            model.act(0, "growth", "yes")  # checked before the feed is asked
        assert len(feed.calls) == 2


def test_a_read_only_feed_refuses_with_its_reason():
    feed = _Feed(controls="TensorFlow fixes its allocator's settings at start")
    with LiveModel(feeds=[feed], start=False) as model:
        with pytest.raises(ConfigError, match="TensorFlow fixes"):
            model.act(0, "fraction", 0.5)
        assert feed.calls == []


def test_the_dashboard_acts_through_the_live_model(sess, monkeypatch):
    """The dashboard's controls take the live layer's path, not one of their own."""
    pytest.importorskip("anywidget")
    from gpudash.widgets import Dashboard

    seen = []
    real = LiveModel.act

    def spy(self, device, name, value=None):
        seen.append((device, name, value))
        return real(self, device, name, value)

    monkeypatch.setattr(LiveModel, "act", spy)
    with LiveModel(sess, start=False) as model:
        dash = Dashboard(model=model, device=1)
        try:
            assert dash._act({"name": "fraction", "value": 0.5})["ok"]
            assert dash._act({"name": "pause", "value": True})["ok"]  # the view's own
        finally:
            dash.close()
    assert seen == [(1, "fraction", 0.5)]
    assert sess.devices[1].options.per_process_gpu_memory_fraction == 0.5
