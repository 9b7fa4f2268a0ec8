"""The views, with real ipywidgets/plotly widgets over a recording comm (no kernel, no
browser): what they draw, what they send, and the dashboard that composes them."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import test_widgets_model as shared
import traitlets
from test_widgets_model import GIB, MIB, fill, wait_for

import gpudash
from gpudash.widgets import (
    BinsView,
    ChunkMapView,
    HeatmapView,
    LiveModel,
    StatsView,
    TimelineView,
)
from gpudash.widgets.model import bin_labels, bin_of_sizes, decode_array
from gpudash.widgets.timeline import setting_label

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

comms = shared.comms  # fixtures shared with the model tests (recording comm, a session)
sess = shared.sess


@pytest.fixture
def model(sess):
    m = LiveModel(sess, start=False)
    yield m
    m.close()


def _wire_json_ok(log) -> None:
    """Every message could be sent by a kernel (the recording comm JSON-encodes them)."""
    assert all(m.nbytes > 0 for m in log)


# --------------------------------------------------------------------------------------
# Chunk map
# --------------------------------------------------------------------------------------


def test_chunk_map_arrays_match_chunk_table(comms, sess, model):
    fill(sess, 20_000)
    view = ChunkMapView(model, max_rate_hz=None)
    model.refresh_now()
    table = sess.devices[0].allocator.chunk_table()
    a = view.arrays
    used = table["in_use"]
    np.testing.assert_array_equal(a["used_ptr"], table["ptr"][used])
    np.testing.assert_array_equal(a["used_size"], table["size"][used])
    np.testing.assert_array_equal(a["used_requested"], table["requested"][used])
    np.testing.assert_array_equal(a["used_alloc_id"], table["alloc_id"][used])
    np.testing.assert_array_equal(a["used_offset"], (table["ptr"] - table["region"])[used])
    np.testing.assert_array_equal(a["free_ptr"], table["ptr"][~used])
    np.testing.assert_array_equal(a["free_size"], table["size"][~used])
    np.testing.assert_array_equal(a["free_bin"], bin_of_sizes(table["size"][~used]))
    assert len(a["used_ptr"]) + len(a["free_ptr"]) == len(table["ptr"]) >= 10_000

    # One bar trace per category, with arrays (not one trace per chunk) ...
    fig = view.figure
    assert [t.name for t in fig.data] == ["in use", "waste", "free"]
    tr_used, tr_waste, tr_free = fig.data
    # ... whose decoded values are the table's.
    custom = decode_array(tr_used.customdata)
    assert custom.shape == (used.sum(), 5)
    np.testing.assert_array_equal(custom[:, 0].astype(np.int64), table["ptr"][used])
    np.testing.assert_array_equal(custom[:, 1].astype(np.int64), table["size"][used])
    np.testing.assert_array_equal(custom[:, 2].astype(np.int64), table["requested"][used])
    np.testing.assert_array_equal(custom[:, 4].astype(np.int64), table["alloc_id"][used])
    np.testing.assert_allclose(decode_array(tr_used.x) * MIB, table["size"][used], rtol=1e-6)
    np.testing.assert_allclose(decode_array(tr_free.base) * MIB,
                               (table["ptr"] - table["region"])[~used], rtol=1e-6, atol=1)
    waste = table["size"][used] - table["requested"][used]
    assert len(decode_array(tr_waste.x)) == int((waste > 0).sum())
    assert "0x%{customdata[0]:x}" in tr_used.hovertemplate
    assert "bin" in tr_used.hovertemplate and "allocation id" in tr_used.hovertemplate
    _wire_json_ok(comms)


def test_chunk_map_regions_are_rows_and_unchanged_state_is_not_resent(comms):
    with gpudash.Session(simulate="1GiB", config={"allow_growth": True}, poll=False) as sess, \
            LiveModel(sess, start=False) as model:
        ptrs = [sess.allocate(3 * MIB) for _ in range(8)]
        view = ChunkMapView(model, max_rate_hz=None)
        model.refresh_now()
        regions = sess.devices[0].allocator.chunk_table()["regions"]
        assert len(regions) > 1
        assert list(view.figure.layout.yaxis.tickvals) == list(range(len(regions)))
        assert view.figure.layout.yaxis.ticktext[0].startswith(hex(int(regions[0, 0])))
        drawn = view.redraws
        sent = comms.nbytes(view.figure)
        # an alloc + free that leaves the same chunks: a refresh, but nothing to send
        sess.free_now(sess.allocate(100))
        model.refresh_now()
        assert view.redraws == drawn and comms.nbytes(view.figure) == sent
        sess.free_now(ptrs[0])
        model.refresh_now()
        assert view.redraws == drawn + 1


def test_chunk_map_rate_cap_draws_the_last_state_later(comms, sess, model):
    view = ChunkMapView(model, max_rate_hz=5.0)
    first = view.redraws
    for _ in range(3):
        sess.allocate(MIB)
        model.refresh_now()
    # the last state arrives within the cap's interval, drawn by a timer
    assert wait_for(lambda: len(view.arrays["used_ptr"]) == 3, timeout=5)
    assert view.redraws <= first + 3
    view.close()


# --------------------------------------------------------------------------------------
# Bins
# --------------------------------------------------------------------------------------


def test_bins_view_shows_the_21_bins(comms, sess, model):
    fill(sess, 2000)
    view = BinsView(model)
    model.refresh_now()
    snap = sess.devices[0].allocator.snapshot()
    free_bytes, used_bytes, free_chunks = view.figure.data
    assert list(free_bytes.x) == bin_labels()
    np.testing.assert_allclose(np.asarray(free_bytes.y) * MIB,
                               [b.free_bytes for b in snap.bins], rtol=1e-9, atol=1)
    np.testing.assert_allclose(np.asarray(used_bytes.y) * MIB,
                               [b.total_bytes_in_use for b in snap.bins], rtol=1e-9, atol=1)
    assert list(free_chunks.y) == [b.free_chunks for b in snap.bins]
    assert free_bytes.text[0].endswith("B")
    # the rows say what they show in their y titles: no subplot titles, which sat where
    # the legend is; the legend is one row above the plot, as in the other figures
    layout = view.figure.layout
    assert not layout.annotations
    assert (layout.yaxis.title.text, layout.yaxis2.title.text) == ("MiB", "free chunks")
    assert layout.legend.orientation == "h" and layout.legend.yanchor == "bottom"
    assert layout.legend.y >= 1
    _wire_json_ok(comms)


# --------------------------------------------------------------------------------------
# Timeline
# --------------------------------------------------------------------------------------


def test_setting_labels():
    assert setting_label("per_process_gpu_memory_fraction", 0.5, 0.3) == "fraction 0.5→0.3"
    assert setting_label("allow_growth", False, True) == "growth off→on"
    assert setting_label("memory_limit", 8 * GIB, 4 * GIB) == "limit 8.00 GiB→4.00 GiB"


def test_timeline_marks_oom_and_setting_change(comms, sess, model):
    view = TimelineView(model)
    sess.configure(per_process_gpu_memory_fraction=0.5)
    model.refresh_now()
    p = sess.allocate(GIB)
    sess.configure(per_process_gpu_memory_fraction=0.3)
    with pytest.raises(gpudash.OutOfMemoryError):
        sess.allocate(8 * GIB)
    st = model.refresh_now()[0]

    in_use, pool, limit, oom = view.figure.data[:4]
    assert len(view.marked_ooms) == 1
    assert view.marked_ooms[0].requested == 8 * GIB
    # x: seconds since the model started
    assert len(oom.x) == 1 and oom.x[0] == pytest.approx(model.seconds(st.ooms[0].time_ms))
    assert "8.00 GiB" in oom.text[0]
    texts = [a.text for a in view.figure.layout.annotations]
    assert any("fraction 0.5→0.3" in t for t in texts), texts
    # one setting a line: the rotated label stays short (the limit moved with the fraction)
    assert any("<br>fraction 0.5→0.3" in t for t in texts) and not any(", " in t for t in texts)
    assert len(view.figure.layout.shapes) == len(texts) == 2
    # the lines: the limit fell to 0.3 of the device
    y_limit = decode_array(limit.y)
    assert y_limit[-1] * MIB == pytest.approx(int(0.3 * sess.devices[0].total), rel=1e-6)
    assert decode_array(in_use.y)[-1] * MIB == pytest.approx(GIB, rel=1e-6)
    # step lines keep the points where the value changes (and the last one)
    x_in = decode_array(in_use.x)
    assert x_in[-1] == model.seconds(st.timeline["time_ms"][-1])
    assert set(x_in) <= set(model.seconds(st.timeline["time_ms"]))
    total = sess.devices[0].total
    assert list(y_limit[1:] * MIB) == pytest.approx([total // 2, int(0.3 * total)], rel=1e-6)
    # the annotation and the marker reached the wire
    updates = comms.updates(view.figure, "_py2js_update")
    assert any("fraction 0.5→0.3" in str(u) for u in updates)
    sess.free_now(p)


def test_timeline_draws_the_latest_state_up_to_the_latest_refresh(comms, sess, model):
    """A new limit with no later events is a line up to the latest refresh, not only a jump
    at the right edge; moving that line's end sends a few bytes, not the lines again."""
    view = TimelineView(model)
    view.tail_interval = 0.0
    fig = view.figure
    p = sess.allocate(GIB)
    model.refresh_now()
    sess.configure(per_process_gpu_memory_fraction=0.75)  # then nothing happens
    st = model.refresh_now()[0]
    limit = fig.data[2]
    tails = fig.data[4:7]
    assert [t.name for t in tails] == ["in use", "pool", "limit"]
    for tail, line in zip(tails, fig.data[:3]):
        assert tail.showlegend is False and tail.legendgroup == line.legendgroup == line.name
        assert tail.line.color == line.line.color
    new_limit = int(0.75 * sess.devices[0].total) / MIB
    t_last = model.seconds(st.timeline["time_ms"][-1])
    assert decode_array(limit.y)[-1] == pytest.approx(new_limit)
    assert list(tails[2].x)[0] == pytest.approx(t_last)
    assert list(tails[2].y) == pytest.approx([new_limit] * 2)

    version, sent = view._version, comms.nbytes(fig)
    time.sleep(0.05)
    model.refresh_now()  # the refresher's next refresh: nothing changed
    assert view._version == version  # no new state drawn...
    end = model.seconds(model.last_refresh_ms)
    assert end > t_last + 0.04
    for tail, key in zip(tails, ("in_use", "pool", "limit")):  # ...the state holds until now
        assert list(tail.x) == pytest.approx([t_last, end])
        assert list(tail.y) == pytest.approx([st.timeline[key][-1] / MIB] * 2)
    assert 0 < comms.nbytes(fig) - sent < 1000
    # at most every tail_interval seconds
    view.tail_interval = 3600.0
    sent = comms.nbytes(fig)
    model.refresh_now()
    assert comms.nbytes(fig) == sent
    # a new state: drawn up to its own time, the tail starts there again
    sess.free_now(p)
    st = model.refresh_now()[0]
    assert list(tails[0].x)[0] == pytest.approx(model.seconds(st.timeline["time_ms"][-1]))
    assert list(tails[0].y) == pytest.approx([0.0, 0.0])
    view.close()
    assert model._tick_listeners == []


# --------------------------------------------------------------------------------------
# Heatmap
# --------------------------------------------------------------------------------------


def test_heatmap_appends_columns_without_recreating_the_figure(comms, sess, model):
    view = HeatmapView(model, max_rate_hz=None)
    fig = view.figure
    n_open = sum(1 for m in comms if m.msg_type == "comm_open")
    first = view.z.shape[1]
    for i in range(5):
        sess.allocate(512 * MIB)
        model.refresh_now()
        assert view.figure is fig
        z = decode_array(fig.data[0].z)
        assert z.shape == (256, first + i + 1)
        assert len(decode_array(fig.data[0].x)) == first + i + 1
    assert view.columns_appended == first + 5
    # later columns show more memory in use: percentages per row, 0..100
    z = decode_array(fig.data[0].z)
    assert z.max() == 100 and z[:, -1].sum() > z[:, 1].sum()
    np.testing.assert_array_equal(z[:, -1], np.rint(model.state(0).heatmap[:, -1] * 100))
    # no figure (or other widget) was created on the way: only updates
    assert sum(1 for m in comms if m.msg_type == "comm_open") == n_open
    assert len(comms.updates(fig, "_py2js_update")) >= 5
    # the pool and limit lines reach the right edge of the last column (half a column past
    # its time), so the latest limit is a line, not a jump at the edge
    sec = model.seconds
    for trace, key in ((fig.data[1], "pool"), (fig.data[2], "limit")):
        lx, ly = decode_array(trace.x), decode_array(trace.y)
        assert lx[-1] == pytest.approx(sec(view.x[-1] + (view.x[-1] - view.x[-2]) / 2))
        assert ly[-1] == ly[-2] == pytest.approx(model.state(0).timeline[key][-1] / MIB)


def test_heatmap_drops_oldest_columns(comms):
    with gpudash.Session(simulate="1GiB", poll=False) as sess, \
            LiveModel(sess, start=False, heatmap_columns=4, heatmap_rows=32) as model:
        view = HeatmapView(model, max_rate_hz=None)
        for _ in range(10):
            sess.allocate(MIB)
            model.refresh_now()
        assert view.z.shape == (32, 4)
        np.testing.assert_array_equal(view.x, model.state(0).heatmap_time_ms)


# --------------------------------------------------------------------------------------
# Stats
# --------------------------------------------------------------------------------------


def test_stats_view_table_and_over_limit(comms, sess, model):
    view = StatsView(model)
    p = sess.allocate(4 * GIB)
    model.refresh_now()
    html = view.html.value
    for label in ("num_allocs", "bytes_in_use", "peak_bytes_in_use", "largest_alloc_size",
                  "bytes_limit", "pool_bytes", "peak_pool_bytes", "largest_free_block_bytes",
                  "external fragmentation", "internal fragmentation", "pool - in use"):
        assert label in html
    assert "4.00 GiB" in html and "OVER LIMIT" not in html
    sess.configure(per_process_gpu_memory_fraction=0.1)  # 1.6 GiB < 4 GiB in use
    model.refresh_now()
    assert "OVER LIMIT" in view.html.value
    sess.free_now(p)
    model.refresh_now()
    assert "OVER LIMIT" not in view.html.value
    assert comms.updates(view.html, "value")


# --------------------------------------------------------------------------------------
# Views in general
# --------------------------------------------------------------------------------------


def test_views_follow_the_device_trait(comms):
    with gpudash.Session(simulate="2x1GiB", poll=False) as sess, \
            LiveModel(sess, start=False) as model:
        sess.allocate(100 * MIB, device=1)
        model.refresh_now()
        view = ChunkMapView(model, max_rate_hz=None)
        assert len(view.arrays["used_ptr"]) == 0
        view.device = 1
        assert len(view.arrays["used_ptr"]) == 1
        assert view.figure.layout.title.text.startswith("/device:GPU:1")
        with pytest.raises(traitlets.TraitError):
            view.device = 2


def test_figures_fit_the_box_they_are_shown_in(comms, model):
    """No fixed width (plotly's default 700 px overflows a narrower dashboard cell): the
    figures autosize, refit on window resizes and on each view attached."""
    for cls in (ChunkMapView, BinsView, TimelineView, HeatmapView):
        view = cls(model)
        fig = view.figure
        assert fig.layout.width is None and fig.layout.autosize is True
        assert fig._config.get("responsive") is True
        assert fig._view_count == 0  # the frontend counts the views it attaches

        def relayouts(fig=fig):
            return [u for u in comms.updates(fig, "_py2js_relayout") if u]

        n = len(relayouts())
        fig.set_state({"_view_count": 1})  # as the frontend does when it attaches a view
        assert len(relayouts()) == n + 1
        assert relayouts()[-1]["relayout_data"] == {"autosize": True}
        fig.set_state({"_view_count": 0})  # a view removed: nothing to fit
        assert len(relayouts()) == n + 1
        view.close()


def test_views_have_cheap_reprs(comms, model):
    for cls in (ChunkMapView, BinsView, TimelineView, HeatmapView):
        view = cls(model)
        assert repr(view).startswith(f"{cls.__name__}(device=0")
        view.close()
    assert repr(StatsView(model)).startswith("StatsView(")


def test_view_close_stops_listening(comms, sess, model):
    view = TimelineView(model)
    view.close()
    sess.allocate(1000)
    model.refresh_now()
    assert not model.errors
    assert model._listeners == []


# --------------------------------------------------------------------------------------
# What-if
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_trace():
    from gpudash.trace.workloads import training_loop

    return training_loop(steps=3, layers=4, hidden=2048)  # peak in use ~270 MiB


def test_whatif_slider_shows_oom_when_too_small_and_none_when_large(comms, small_trace):
    from gpudash.widgets import WhatIfView

    view = WhatIfView(small_trace, device_bytes="1GiB", fraction=0.9)
    try:
        assert view.result.fits and "fits" in view.status.value
        assert len(view.timeline.data[4].x) == 0  # no first-OOM marker
        for fig in (view.timeline, view.heatmap):  # as wide as the output area
            assert fig.layout.width is None and fig.layout.autosize is True
        # drawn by gpudash's plot widgets, which follow the width of their box
        assert [p.figure for p in view.plots] == [view.timeline, view.heatmap]
        assert all(p in view.children and "ResizeObserver" in p._esm for p in view.plots)

        view.slider.value = 0.1  # as the browser would, on release
        assert "replaying" in view.status.value
        assert view.wait(30)
        r = view.result
        assert not r.fits and r.memory_limit == int(0.1 * GIB)
        assert "out of memory" in view.status.value
        assert f"call {r.first_oom[0]}" in view.status.value
        first = view.timeline.data[4]
        assert list(first.x) == [r.first_oom[0]] and "first OOM" in first.text[0]
        assert len(decode_array(view.timeline.data[3].x)) == r.oom_count
        limit_y = view.timeline.data[2].y
        # bytes in a binary unit picked for the range: ticks read "100 MiB", hovers too
        assert view.timeline.layout.yaxis.ticksuffix == " MiB"
        assert "MiB" in view.timeline.data[0].hovertemplate
        assert limit_y[0] * MIB == pytest.approx(r.memory_limit)
        # room above the limit for the OOM markers on it; the first OOM's label below its
        # marker (not above the plot, where it was cut off)
        assert view.timeline.layout.yaxis.range[1] * MIB >= 1.1 * r.memory_limit
        (note,) = view.timeline.layout.annotations
        assert note.ay > 0 and note.yanchor == "top" and "first OOM" in note.text
        # the heatmap of the replay, and the first OOM marked on it
        z = decode_array(view.heatmap.data[0].z)
        assert z.shape == view.heatmap_data["z"].shape and z.max() > 0
        assert list(view.heatmap.data[1].x) == [r.first_oom[0]] * 2

        view.slider.value = 0.8
        assert view.wait(30)
        assert view.result.fits and "fits" in view.status.value
        assert len(view.timeline.data[4].x) == 0
        assert view.replays == 3

        assert view.wait_min_fraction(60)
        assert "minimum fraction that fits" in view.min_fraction_text.value
        assert repr(view).startswith("WhatIfView(fraction=0.80")
    finally:
        view.close()


def _figures_sent(log, plot) -> list[dict]:
    """The figures a plot widget sent to the page, parsed."""
    return [json.loads(m.data["content"]["json"]) for m in log.of(plot)
            if m.msg_type == "comm_msg" and m.data.get("method") == "custom"
            and m.data["content"].get("type") == "figure"]


def _hello(widget) -> None:
    """What a view sends when the page draws it (a first display, a reloaded page)."""
    widget._handle_msg({"content": {"data": {"method": "custom",
                                             "content": {"type": "hello"}}}, "buffers": []})


def test_whatif_figures_are_drawn_whole_for_every_view_that_says_hello(comms, small_trace):
    """Each view of the what-if figures gets the figure of the replay drawn last when it says
    hello (a reloaded page draws it again, not empty axes), and every view that said hello
    gets each new replay; plotly.js goes only to a page that asks for it."""
    from gpudash.widgets import WhatIfView

    view = WhatIfView(small_trace, device_bytes="1GiB", fraction=0.1, min_fraction=False,
                      background=False)
    try:
        tl_plot, hm_plot = view.plots
        assert _figures_sent(comms, tl_plot) == []  # nothing until a view says hello
        r = view.result
        for plot in view.plots:
            _hello(plot)
        (tl,) = _figures_sent(comms, tl_plot)
        assert [t["name"] for t in tl["data"]] == ["in use", "pool", "limit", "OOM",
                                                   "first OOM"]
        in_use = decode_array(tl["data"][0]["y"])
        assert len(in_use) > 10 and in_use.max() > 0
        assert tl["data"][4]["x"] == [r.first_oom[0]]
        assert tl["layout"]["title"]["text"].startswith("replay at fraction 0.10")
        assert tl["layout"]["yaxis"]["ticksuffix"] == " MiB" and tl["layout"]["annotations"]
        assert tl["layout"]["legend"]["orientation"] == "h" and tl["layout"]["autosize"] is True
        (hm,) = _figures_sent(comms, hm_plot)
        heat, line = hm["data"]
        assert decode_array(heat["z"]).shape == view.heatmap_data["z"].shape
        assert decode_array(heat["z"]).max() > 0 and line["x"] == [r.first_oom[0]] * 2
        # a new replay reaches the views that said hello
        view.slider.value = 0.9
        tl = _figures_sent(comms, tl_plot)[-1]
        assert len(_figures_sent(comms, tl_plot)) == 2 and tl["data"][4]["x"] == []
        assert tl["layout"]["title"]["text"].startswith("replay at fraction 0.90")
        # a page reloaded now: its view says hello and gets the same figure again
        _hello(tl_plot)
        assert _figures_sent(comms, tl_plot)[-1] == tl
        assert "lib" not in tl_plot.sent and tl_plot.sent["figure"][0] == 3
    finally:
        view.close()


def test_figure_widgets_answer_a_page_that_asks_for_their_state(comms, sess, model):
    """A reloaded page asks each widget for its state: the views' FigureWidgets answer with
    the traces and layout in force (plotly itself sends those only when a figure is made,
    and every change after as a message a later page never sees)."""
    view = TimelineView(model)
    try:
        sess.allocate(3 * MIB)
        model.refresh_now()
        view.redraw()
        fig = view.figure
        fig._handle_msg({"content": {"data": {"method": "request_state"}}, "buffers": []})
        data = comms.updates(fig, "_widget_data")[-1]
        layout = comms.updates(fig, "_widget_layout")[-1]
        assert [t["name"] for t in data] == [t.name for t in fig.data] and len(data) >= 3
        assert decode_array(data[0]["y"]).max() > 0
        assert layout["title"]["text"] == fig.layout.title.text
        assert layout["yaxis"] == fig.layout.yaxis.to_plotly_json()
        # ipywidgets' request_states (every widget at once) reads the same state
        assert len(fig.get_state(drop_defaults=True)["_widget_data"]) == len(data)
    finally:
        view.close()


def test_replay_heatmap_matches_brute_force(small_trace):
    from gpudash.trace.replay import replay
    from gpudash.widgets.whatif import replay_heatmap

    r = replay(small_trace, device_bytes="1GiB", fraction=0.5, allow_growth=True)
    cols = r.recording.columns
    rows, samples = 32, 17
    hm = replay_heatmap(cols, rows=rows, samples=samples, call_ops=small_trace.calls(0).op)
    lo, rb = hm["lo"], hm["row_bytes"]
    kinds = cols["kind"].tolist()
    live: dict[int, tuple[int, int]] = {}
    ends = set(hm["event"].tolist())
    got_cols = []
    for i, k in enumerate(kinds):
        if k == 1:
            live[int(cols["alloc_id"][i])] = (int(cols["ptr"][i]), int(cols["size"][i]))
        elif k == 2:
            live.pop(int(cols["alloc_id"][i]), None)
        if i in ends:
            col = np.zeros(rows)
            for p, n in live.values():
                s, e = p - lo, p - lo + n
                for row in range(rows):
                    col[row] += max(0, min(e, (row + 1) * rb) - max(s, row * rb))
            got_cols.append(col / rb)
    np.testing.assert_allclose(hm["z"], np.array(got_cols).T, atol=1e-9)
    x = hm["x"]
    assert np.all(np.diff(x) >= 0) and 0 <= x[0] and x[-1] < r.calls


# --------------------------------------------------------------------------------------
# In a real kernel
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dashboard_in_a_kernel_updates_from_its_thread(tmp_path):
    """A real ipykernel: the refresher thread takes in a background workload's events while
    the cells run, a control reconfigures the session, and the widget's state (saved in the
    notebook) carries the module and the plotly.js version, not plotly.js itself."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    cells = [
        "import sys, time\nsys.path.insert(0, %r)\nimport gpudash\n"
        "from gpudash.widgets import Dashboard\nfrom gpudash.background import run_in_background\n"
        "sess = gpudash.Session(simulate='2x4GiB')\ndash = Dashboard(sess)\ndash" % str(root),
        "def work(stop_event):\n    ptrs = []\n    for i in range(20000):\n"
        "        if stop_event.is_set():\n            break\n"
        "        ptrs.append(sess.allocate(4096 + i % 100 * 256))\n"
        "        if len(ptrs) > 500:\n            sess.free(ptrs.pop(0))\n    return len(ptrs)\n"
        "task = run_in_background(work)\ntask.widget()",
        "task.result(timeout=60)\ntime.sleep(1.0)\n"
        "reply = dash._act({'name': 'fraction', 'value': 0.3})\n"
        "print(sess.devices[0].memory_limit == int(0.3 * sess.devices[0].total), "
        "list(dash.model.errors), dash.model.state(0).counters['allocs'])",
        "dash.close(); sess.close(); print(dash.model.running)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     store_widget_state=True,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    texts = [o.get("text", "") for o in outputs if o.get("output_type") == "stream"]
    assert texts[0].strip() == "True [] 20000"  # taken in by the refresher thread
    assert texts[-1].strip() == "False"
    bundle = outputs[0]["data"]
    assert "application/vnd.jupyter.widget-view+json" in bundle
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    dash_state = [m["state"] for m in state.values() if "lib_version" in m["state"]]
    assert len(dash_state) == 1 and "export default" in dash_state[0]["_esm"]
    assert len(json.dumps(state)) < 200_000  # plotly.js (1.5 MB) is not in the notebook
