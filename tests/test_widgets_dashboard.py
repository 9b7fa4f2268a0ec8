"""The dashboard widget's protocol, over a recording comm (no kernel, no browser): what it
sends (plotly.js once, on request; a snapshot per hello; increments after), how it answers
the controls, and that closing it leaves nothing behind.

The browser's side of the same protocol (drawing, reloads, frames per second) is tested in
``test_browser.py`` and measured in ``benchmarks/bench_browser.py``.
"""

from __future__ import annotations

import gc
import gzip
import threading
import time

from ipywidgets.widgets.widget import _instances
import numpy as np
import pytest
import test_widgets_model as shared
from test_widgets_model import GIB, MIB, fill, wait_for

import gpudash
from gpudash.widgets import Dashboard, LiveModel
from gpudash.widgets.dashboard import VIEWS, plotly_bundle
from gpudash.live.feeds import DeviceFeed, FeedSample
from gpudash._units import format_bytes
from gpudash.bfc import AllocatorStats

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

comms = shared.comms
sess = shared.sess


# ----------------------------------------------------------------------------- helpers
def sent(log, dash, kind=None) -> list[tuple[dict, list[bytes]]]:
    """The custom messages the kernel sent to ``dash``'s front end: ``(content, buffers)``."""
    out = []
    for m in log.of(dash):
        if m.msg_type == "comm_msg" and m.data.get("method") == "custom":
            content = m.data["content"]
            if kind is None or content.get("type") == kind:
                out.append((content, m.buffers))
    return out


def say(dash, content: dict) -> None:
    """What the front end sends: a custom message through the widget's comm handler."""
    dash._handle_msg({"content": {"data": {"method": "custom", "content": content}},
                      "buffers": []})


def act(log, dash, name, value=None) -> dict:
    n = len(sent(log, dash, "reply"))
    say(dash, {"type": "action", "name": name, "value": value, "id": 7})
    replies = sent(log, dash, "reply")
    assert len(replies) == n + 1, "every action is answered once"
    reply = replies[-1][0]
    assert reply["id"] == 7 and reply["name"] == name
    return reply


def decode(content: dict, buffers: list[bytes]) -> dict:
    """The arrays of a snapshot or update, as the browser reads them."""
    n = content["timeline_n"]
    tl = np.frombuffer(buffers[0], dtype=np.float64).reshape(4, n)
    heat = content["heat"]
    cols = np.frombuffer(buffers[1], dtype=np.uint8).reshape(heat["n"], heat["rows"])
    ht = np.frombuffer(buffers[2], dtype=np.float64)
    out = {"t": tl[0], "in_use": tl[1], "pool": tl[2], "limit": tl[3], "heat": cols,
           "heat_t": ht}
    if content["chunks"] is not None:
        k = content["chunks"]["n"]
        out["chunks"] = np.frombuffer(buffers[3], dtype=np.float64).reshape(6, k)
        out["bins"] = np.frombuffer(buffers[4], dtype=np.float64).reshape(5, 21)
    return out


@pytest.fixture
def manual(sess):
    """A dashboard over a model without a refresher: the test drives the refreshes."""
    model = LiveModel(sess, start=False)
    dash = Dashboard(model=model)
    yield dash
    dash.close()
    model.close()


# ----------------------------------------------------------------------------- plotly.js
def test_plotly_is_sent_only_when_the_page_asks_and_is_the_real_bundle(comms, manual):
    assert sent(comms, manual) == []  # nothing until a front end speaks
    version, data = plotly_bundle()
    assert manual.lib_version == version
    say(manual, {"type": "lib"})
    (content, buffers), = sent(comms, manual, "lib")
    assert content == {"type": "lib", "version": version, "encoding": "gzip"}
    assert buffers == [data] and len(data) < 700_000
    text = gzip.decompress(buffers[0])
    assert b"plotly.js" in text[:200] and len(text) > 1_000_000
    say(manual, {"type": "lib-raw"})  # for browsers without DecompressionStream
    content, buffers = sent(comms, manual, "lib")[-1]
    assert content["encoding"] == "none" and buffers == [text]
    # a hello (a view drawn again, a reloaded page) never resends the library
    say(manual, {"type": "hello"})
    assert len(sent(comms, manual, "lib")) == 2


# ----------------------------------------------------------------------------- snapshot
def test_hello_gets_a_snapshot_that_matches_the_allocator(comms, sess, manual):
    ptrs = fill(sess, 40)
    manual.model.refresh_now()
    say(manual, {"type": "hello"})
    (content, buffers), = sent(comms, manual, "snapshot")
    d = decode(content, buffers)
    alloc = sess.devices[0].allocator
    stats = alloc.stats()
    head = content["headline"]
    assert head["in_use"] == stats.bytes_in_use and head["pool"] == stats.pool_bytes
    assert head["limit"] == stats.bytes_limit and head["name"] == "/device:GPU:0"
    assert d["in_use"][-1] == stats.bytes_in_use and d["limit"][-1] == stats.bytes_limit
    assert np.all(d["t"] >= 0) and np.all(np.diff(d["t"]) >= 0)  # seconds since the start
    table = alloc.chunk_table()
    ch = d["chunks"]
    assert content["chunks"]["n"] == len(table["size"])
    assert np.array_equal(ch[5].astype(np.int64), table["ptr"])  # addresses
    assert np.array_equal(ch[2].astype(np.int64), table["size"])
    assert np.array_equal(ch[4].astype(bool), table["in_use"])
    assert int(ch[4].sum()) == len(ptrs)
    assert d["bins"][1].sum() == table["size"][table["in_use"]].sum()  # in-use bytes by bin
    # the heatmap's newest column: the share of each row in use, 0..255
    heat = content["heat"]
    assert d["heat"].shape == (heat["n"], heat["rows"]) and heat["n"] >= 1
    used_rows = np.nonzero(d["heat"][-1])[0]
    assert used_rows.size and used_rows.max() * heat["row_bytes"] < stats.pool_bytes
    assert content["controls"]["settings"]["limit"] == stats.bytes_limit
    assert content["controls"]["disabled"] is None


def test_heatmap_columns_are_stamped_when_the_memory_was_in_use(comms, sess, manual):
    """A column is the state at its time; nothing in use shows before it was allocated."""
    manual.model.refresh_now(force=True)
    time.sleep(0.3)
    t_alloc = (time.time_ns() / 1e6 - manual.model.start_ms) / 1e3
    sess.allocate(512 * MIB)
    manual.model.refresh_now()
    say(manual, {"type": "hello"})
    d = decode(*sent(comms, manual, "snapshot")[-1])
    busy = d["heat"].sum(axis=1) > 0
    assert busy.any() and not busy.all()
    assert d["heat_t"][busy].min() >= t_alloc - 1e-3
    assert d["heat_t"][~busy].max() < t_alloc
    assert np.all(d["heat_t"] >= 0)
    # the timeline uses the same time base
    assert d["t"][d["in_use"] > 0].min() >= t_alloc - 1e-3


# ----------------------------------------------------------------------------- increments
def test_updates_carry_only_what_is_new(comms, sess, manual):
    fill(sess, 200)
    manual.model.refresh_now()
    say(manual, {"type": "hello"})
    snap = decode(*sent(comms, manual, "snapshot")[-1])
    sess.allocate(3 * MIB)
    manual.model.refresh_now()
    content, buffers = sent(comms, manual, "update")[-1]
    d = decode(content, buffers)
    assert content["timeline_n"] == 1 and d["t"][0] > snap["t"][-1]
    assert content["heat"]["n"] == 1 and not content["heat"]["full"]
    assert content["chunks"] is not None  # the layout changed
    n_updates = len(sent(comms, manual, "update"))
    manual.model.refresh_now(force=True)  # nothing changed: no chunk table again
    content, _ = sent(comms, manual, "update")[-1]
    assert len(sent(comms, manual, "update")) == n_updates + 1
    assert content["chunks"] is None and "controls" not in content
    # settings changed from code (%gpudash_config) reach the controls with the next update
    sess.configure(per_process_gpu_memory_fraction=0.5)
    manual.model.refresh_now()
    content, _ = sent(comms, manual, "update")[-1]
    assert content["controls"]["settings"]["fraction"] == 0.5


def test_no_updates_before_a_front_end_says_hello(comms, sess, manual):
    sess.allocate(MIB)
    manual.model.refresh_now()
    assert sent(comms, manual) == []


def test_a_large_table_is_sent_at_most_once_a_second(comms, sess, manual):
    fill(sess, 6000)  # 3000 chunks in use and as many free: above LARGE_TABLE
    manual.model.refresh_now()
    say(manual, {"type": "hello"})
    snapshot_bytes = sum(len(b) for b in sent(comms, manual, "snapshot")[-1][1])
    with_table = 0
    for _ in range(5):
        sess.allocate(1000)
        manual.model.refresh_now()
        content, buffers = sent(comms, manual, "update")[-1]
        with_table += content["chunks"] is not None
        if content["chunks"] is None:
            assert sum(len(b) for b in buffers) < 20_000  # a few points and one column
    assert with_table <= 1
    assert snapshot_bytes < 2_000_000


# ----------------------------------------------------------------------------- controls
def test_fraction_growth_and_deferred_act_on_the_session_and_answer_in_words(comms, sess,
                                                                              manual):
    dev = sess.devices[0]
    reply = act(comms, manual, "fraction", 0.25)
    assert reply["ok"] and dev.memory_limit == int(0.25 * dev.total)
    assert reply["text"].startswith("fraction 0.250: limit ")
    assert reply["controls"]["settings"]["fraction"] == 0.25
    reply = act(comms, manual, "growth", True)
    assert reply["ok"] and reply["text"] == "growth: on" and dev.allocator.allow_growth
    reply = act(comms, manual, "deferred", 64 * MIB)
    assert reply["ok"] and reply["text"] == "deferred deletion: 64.00 MiB"
    assert dev._deferred.threshold == 64 * MIB
    # a refused value changes nothing and says why
    reply = act(comms, manual, "fraction", 1.5)
    assert not reply["ok"] and "per_process_gpu_memory_fraction" in reply["text"]
    assert dev.memory_limit == int(0.25 * dev.total)
    reply = act(comms, manual, "bogus", 1)
    assert not reply["ok"] and "unknown control 'bogus'" in reply["text"]
    # a session applies a value at once (the slider acts while dragged): no preview
    assert reply["controls"]["preview"] is False
    reply = act(comms, manual, "preview", {"name": "fraction", "value": 0.5})
    assert not reply["ok"] and "no preview" in reply["text"]
    assert dev.memory_limit == int(0.25 * dev.total)


def test_release_and_lowering_the_fraction_below_the_pool_say_what_happens(comms, sess,
                                                                          manual):
    alloc = sess.devices[0].allocator
    sess.free_now(sess.allocate(GIB))  # a wholly free region stays in the pool
    pool = alloc.stats().pool_bytes
    reply = act(comms, manual, "release")
    assert reply["ok"] and reply["text"] == f"released {format_bytes(pool)}"
    assert alloc.stats().pool_bytes == 0
    keep = sess.allocate(GIB)
    reply = act(comms, manual, "fraction", 0.01)
    assert reply["ok"] and "above the new limit" in reply["warning"]
    reply = act(comms, manual, "release")
    assert reply["text"].startswith("released 0 B: no region is wholly free; ")
    assert "wait in 1 region(s) that still hold memory in use" in reply["text"]
    sess.free_now(keep)  # the region above the limit goes back as it empties
    assert alloc.stats().pool_bytes == 0
    assert act(comms, manual, "release")["text"] == "released 0 B: no region is wholly free"


def test_flush_pause_rate_and_device(comms):
    with gpudash.Session(simulate="2x1GiB", poll=False) as sess:
        model = LiveModel(sess, start=False)
        dash = Dashboard(model=model)
        try:
            reply = act(comms, dash, "flush")
            assert reply["text"] == "flushed 0 B: no frees were waiting"
            assert act(comms, dash, "pause", True)["text"] == "paused" and model.paused
            assert act(comms, dash, "pause", False)["text"] == "live" and not model.paused
            assert act(comms, dash, "rate", 10)["text"] == "10 refreshes/s"
            assert model.rate_hz == 10
            assert not act(comms, dash, "rate", -1)["ok"] and model.rate_hz == 10
            say(dash, {"type": "hello"})
            sess.allocate(10 * MIB, device=1)
            model.refresh_now()
            reply = act(comms, dash, "device", 1)
            assert reply["text"] == "showing /device:GPU:1" and dash.device == 1
            content, buffers = sent(comms, dash, "snapshot")[-1]  # the new device, whole
            assert content["device"] == 1 and content["headline"]["in_use"] == 10 * MIB
        finally:
            dash.close()
            model.close()


def test_views_option_and_bad_arguments(comms, sess):
    with Dashboard(sess, views=("stats", "timeline"), rate_hz=20) as dash:
        assert dash.views == ("stats", "timeline")
        assert dash.setup["devices"] == ["/device:GPU:0"]
    with pytest.raises(ValueError, match="unknown view"):
        Dashboard(sess, views=("nope",))
    with pytest.raises(ValueError, match="device must be an index in 0..0"):
        Dashboard(sess, device=3)
    assert set(VIEWS) == {"stats", "timeline", "heatmap", "chunkmap", "bins"}


# ----------------------------------------------------------------------------- live
def test_the_refresher_pushes_updates_while_work_runs(comms, sess):
    with Dashboard(sess, rate_hz=20) as dash:
        say(dash, {"type": "hello"})
        for _ in range(20):
            sess.allocate(MIB)
            time.sleep(0.01)
        assert wait_for(lambda: sent(comms, dash, "update") and
                        sent(comms, dash, "update")[-1][0]["headline"]["in_use"] == 20 * MIB)
        n = len(sent(comms, dash, "update"))
        assert 1 <= n <= 20  # coalesced: at most rate_hz a second, not one per event
        assert not dash.model.errors
        assert dash.sent["update"][0] == n


# ----------------------------------------------------------------------------- feeds
class _TotalsFeed(DeviceFeed):
    """A source with totals only and no controls, like a framework watched read-only."""

    kind = "torch"
    has_layout = False
    missing = ("pool_bytes", "largest_free_block_bytes")
    controls = "PyTorch's allocator is watched read-only: set PYTORCH_CUDA_ALLOC_CONF"

    def __init__(self):
        self.name = "cuda:0"
        self.capacity = 8 * GIB
        self.in_use = 0
        self.started = self.stopped = 0
        self.wake = None

    def start(self, wake):
        self.started += 1
        self.wake = wake

    def sample(self):
        return FeedSample(time.time_ns() / 1e6, AllocatorStats(
            bytes_in_use=self.in_use, pool_bytes=2 * self.in_use, bytes_limit=self.capacity))

    def stop(self):
        self.stopped += 1

    def restart_lines(self):
        return ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]


def test_a_read_only_feed_shows_totals_and_disabled_controls_that_say_why(comms, capsys):
    feed = _TotalsFeed()
    dash = Dashboard(feeds=[feed], rate_hz=20)
    try:
        assert feed.started == 1
        feed.in_use = 300 * MIB
        feed.wake()
        say(dash, {"type": "hello"})
        assert wait_for(lambda: sent(comms, dash, "snapshot") and any(
            c["headline"]["in_use"] == 300 * MIB for c, _ in sent(comms, dash)
            if c["type"] in ("snapshot", "update")))
        content, _ = sent(comms, dash, "snapshot")[-1]
        assert content["controls"]["disabled"] == feed.controls
        # what the source does not report is shown as unknown, not as 0
        assert content["headline"]["missing"] == ["largest_free_block_bytes", "pool_bytes"]
        assert content["controls"]["has_layout"] is False
        assert content["controls"]["restart"] is True
        reply = act(comms, dash, "fraction", 0.5)
        assert not reply["ok"] and reply["text"] == feed.controls
        reply = act(comms, dash, "restart")
        assert reply["ok"] and "expandable_segments" in reply["text"]
        assert "PYTORCH_CUDA_ALLOC_CONF" in capsys.readouterr().out
    finally:
        dash.close()
    assert feed.stopped == 1


# ----------------------------------------------------------------------------- close
def test_close_leaves_no_widget_thread_or_listener_behind(comms, sess):
    gc.collect()
    widgets_before = len(_instances)
    threads_before = {t.ident for t in threading.enumerate()}
    dash = Dashboard(sess, rate_hz=50)
    say(dash, {"type": "hello"})
    sess.allocate(MIB)
    assert wait_for(lambda: sent(comms, dash, "update"))
    model = dash.model
    dash.close()
    assert model.closed and not model.running and model._tick_listeners == []
    assert all(d.allocator._sinks == [] == d.allocator._raw_sinks for d in sess.devices)
    assert wait_for(lambda: {t.ident for t in threading.enumerate()} <= threads_before)
    gc.collect()
    assert len(_instances) == widgets_before
    n = len(comms)
    sess.allocate(MIB)  # nothing more is sent
    time.sleep(0.1)
    assert len(comms) == n
    assert sess.devices[0].allocator.stats().bytes_in_use == 2 * MIB  # the session lives


def test_a_model_passed_in_stays_open(comms, sess):
    model = LiveModel(sess, start=False)
    dash = Dashboard(model=model)
    dash.close()
    assert not model.closed
    model.close()


# ----------------------------------------------------------------------------- bad messages
@pytest.mark.parametrize("bad", [2, -1, 1e308, 1.0, True, "1", None, [1]])
def test_a_bad_device_message_is_refused_and_the_dashboard_keeps_working(comms, bad):
    """A device the source does not have is answered with an error in the status line; the
    device shown does not change and the next message acts."""
    with gpudash.Session(simulate="2x1GiB", poll=False) as sess:
        model = LiveModel(sess, start=False)
        dash = Dashboard(model=model)
        try:
            say(dash, {"type": "hello"})
            n_snapshots = len(sent(comms, dash, "snapshot"))
            reply = act(comms, dash, "device", bad)
            assert not reply["ok"]
            assert reply["text"] == (f"device must be an index in 0..1 (the source has 2 "
                                     f"device(s)); got {bad!r}")
            assert dash.device == 0 and reply["device"] == 0
            assert reply["controls"]["settings"]["total"] == GIB
            assert len(sent(comms, dash, "snapshot")) == n_snapshots  # nothing redrawn
            # the next message acts
            sess.allocate(10 * MIB, device=1)
            model.refresh_now()
            reply = act(comms, dash, "device", 1)
            assert reply["ok"] and reply["text"] == "showing /device:GPU:1" and dash.device == 1
            content, _ = sent(comms, dash, "snapshot")[-1]
            assert content["device"] == 1 and content["headline"]["in_use"] == 10 * MIB
            reply = act(comms, dash, "fraction", 0.5)
            assert reply["ok"] and sess.devices[1].memory_limit == GIB // 2
            # from Python, too, a device out of range is refused before it is set
            with pytest.raises(Exception, match=r"device must be an index in 0\.\.1"):
                dash.device = 2
            assert dash.device == 1
        finally:
            dash.close()
            model.close()


@pytest.mark.parametrize("name, value, field", [
    ("growth", "false", "allow_growth"),
    ("growth", 0, "allow_growth"),
    ("growth", None, "allow_growth"),
    ("fraction", True, "per_process_gpu_memory_fraction"),
    ("fraction", "0.5", "per_process_gpu_memory_fraction"),
    ("fraction", None, "per_process_gpu_memory_fraction"),
    ("deferred", 1.5, "deferred_deletion_bytes"),
    ("deferred", True, "deferred_deletion_bytes"),
    ("deferred", "8MiB", "deferred_deletion_bytes"),
    ("deferred", -1, "deferred_deletion_bytes"),
    ("pause", "false", "pause"),
    ("pause", 1, "pause"),
    ("rate", True, "rate"),
    ("rate", "4", "rate"),
])
def test_control_values_are_checked_as_configure_checks_them(comms, sess, manual, name,
                                                             value, field):
    """No coercion: growth "false" does not turn growth on, a fraction of true is not 1.0,
    deferred 1.5 is not 1 B. The answer names the setting and the value; nothing changes."""
    dev = sess.devices[0]
    model = manual.model

    def state():
        return (dev.memory_limit, dev.options.per_process_gpu_memory_fraction,
                dev.allocator.allow_growth, dev._deferred.threshold, model.paused,
                model.rate_hz)

    before = state()
    reply = act(comms, manual, name, value)
    assert not reply["ok"], reply
    assert field in reply["text"] and repr(value) in reply["text"], reply["text"]
    assert state() == before
    # the same control with a good value acts
    good = {"growth": True, "fraction": 0.5, "deferred": 2 * MIB, "pause": True,
            "rate": 2}[name]
    assert act(comms, manual, name, good)["ok"]
    assert state() != before
