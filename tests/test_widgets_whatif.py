"""The what-if view, with real widgets over a recording comm (no kernel, no browser): what it
draws and sends; its replay heatmap against brute force; and the dashboard in a real
kernel."""

from __future__ import annotations

import json

import numpy as np
import pytest
import test_widgets_model as shared
from test_widgets_model import GIB, MIB

from gpudash.widgets.plot import decode_array

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

comms = shared.comms  # fixtures shared with the model tests (recording comm)


# --------------------------------------------------------------------------------------
# What-if
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_trace():
    from gpudash.workloads import training_loop

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
