"""The HTML report: content checks, and a real headless Chromium that renders its plots."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from gpudash import GpudashError
from gpudash.report import build_report, write_report
from gpudash.workloads import fragmentation_stress, training_loop

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

CHROMIUM = os.environ.get("GPUDASH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ASSETS = Path(__file__).resolve().parent.parent / "assets"


def test_report_shows_oom_when_the_fraction_is_too_small():
    trace = training_loop(steps=2, layers=4, batch=16, hidden=1024)
    text = build_report(trace, device_bytes=1 << 30,
                        replay_options={"fraction": 0.01, "allow_growth": True})
    assert "OUT OF MEMORY" in text
    assert "out of memory" in text  # the OOM markers' legend entry
    text = build_report(trace, device_bytes=1 << 30, replay_options={"fraction": 1.0})
    assert "fits: no allocation ran out of memory" in text


def test_write_report_never_overwrites_unasked(tmp_path):
    path = tmp_path / "r.html"
    path.write_text("mine")
    with pytest.raises(GpudashError, match="overwrite=True"):
        write_report(training_loop(steps=1, layers=1, hidden=64), path)
    assert path.read_text() == "mine"


@pytest.mark.browser
def test_report_renders_every_plot_in_headless_chromium(tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    trace = fragmentation_stress(rounds=600, seed=3)
    path = write_report(trace, tmp_path / "report.html", title="gpudash report",
                        device_bytes=4 << 30, replay_options={"fraction": 0.5})
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(path.as_uri())
            page.wait_for_function(
                "document.querySelectorAll('.js-plotly-plot .main-svg').length >= 8",
                timeout=30_000)
            plots = page.locator("section.plot")
            assert plots.count() == 4
            # every figure drew its data: bars, heatmap image or lines are present
            for name, selector in (("timeline", ".scatterlayer .trace"),
                                   ("heatmap", ".heatmaplayer image, .hm image"),
                                   ("bins", ".barlayer .trace"),
                                   ("chunkmap", ".barlayer .trace")):
                section = page.locator(f'section[data-plot="{name}"]')
                assert section.locator(selector).count() > 0, name
            assert page.locator("#whatif table tr").count() >= 2
            assert errors == []
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
            assert (tmp_path / "report.png").stat().st_size > 20_000
        finally:
            browser.close()


def test_report_says_who_holds_memory_at_the_peak_when_the_trace_names_holders():
    from gpudash.trace import load_trace, top_holders

    profile = Path(__file__).resolve().parent / "data" / "real" / "tf_mlp_training.xplane.pb"
    trace = load_trace(profile)
    text = build_report(trace, device_bytes=1 << 30, fractions=(0.5,),
                        replay_options={"device": 0})
    assert "Who holds memory at the peak" in text
    first = top_holders(trace, at="peak", device=0, limit=1)[0]
    assert first.holder.split(" ")[0] in text
    # a trace without holders has no such section
    plain = build_report(training_loop(steps=2, layers=2, hidden=256), fractions=(0.5,))
    assert "Who holds memory" not in plain


def test_report_figures_speak_binary_units_and_the_shared_colours():
    from gpudash import style
    from gpudash.report import timeline_figure

    fig = timeline_figure({"in_use": [0, 3 << 30], "pool": [0, 4 << 30]}, limit=8 << 30)
    assert fig.layout.yaxis.ticksuffix == " GiB"
    by_name = {t.name: t for t in fig.data}
    assert by_name["in use"].line.color == style.COLORS["in use"]
    assert by_name["pool"].line.color == style.COLORS["pool"]
    assert list(by_name["pool"].y) == [0, 4]


def test_the_heatmap_shares_the_timelines_call_axis():
    from gpudash.analysis import heatmap
    from gpudash.report import calls_at_events
    from gpudash.trace.replay import replay

    r = replay(training_loop(steps=2, layers=2, hidden=256), record=True, per_call=True)
    hm = heatmap(r.recording, rows=32, cols=50)
    edges = calls_at_events(r.recording, hm.col_edges)
    assert edges[0] == 0 and edges[-1] == r.calls == len(r.per_call["in_use"])
    assert np.all(np.diff(edges) >= 0)
