"""The dashboard in a real JupyterLab, driven by headless Chromium.

A JupyterLab server on 127.0.0.1 serves a temporary copy of ``notebooks/``; Playwright drives
Debian's Chromium (``/usr/bin/chromium``, never a downloaded browser). The tests run the quick
start notebook through the notebook UI, check that the dashboard's plotly figures render, drag
the fraction slider with the mouse and check that the kernel's live session got the limit the
slider shows. They save screenshots to ``assets/dashboard.png`` and ``assets/whatif.png``.

Skipped, with the reason, where Chromium or Playwright is missing; CI installs both.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from browser_helpers import (
    ASSETS,
    LabServer,
    cell_errors,
    command,
    launch_chromium,
    missing_browser_reason,
    run_code_in_new_cell,
    wait_for_notebook,
    wait_until_all_ran,
)

_MISSING = missing_browser_reason()

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(_MISSING is not None, reason=f"browser tests: {_MISSING}"),
]

GIB = 1 << 30
TOTAL = 16 * GIB  # GPUDASH_SIMULATE=1x16GiB
# A wide window for the screenshots (figures fit their grid cells at any width).
VIEWPORT = {"width": 1640, "height": 1000}


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    """JupyterLab on 127.0.0.1, stopped (with its kernels) however the tests end."""
    server = LabServer(tmp_path_factory.mktemp("lab"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        b = launch_chromium(pw)
        try:
            yield b
        finally:
            b.close()
    finally:
        pw.stop()


@pytest.fixture()
def page(browser, lab):
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
    context.set_default_timeout(30_000)
    pg = context.new_page()
    pg.console_errors = []  # type: ignore[attr-defined]
    pg.on("pageerror", lambda exc: pg.console_errors.append(str(exc)))
    try:
        yield pg
    finally:
        context.close()
        lab.shutdown_kernels()


# ------------------------------------------------------------------------------ helpers
def open_and_run_all(page: Any, lab: LabServer, name: str) -> None:
    # ?reset: a fresh workspace, so tabs of an earlier test are not restored.
    page.goto(lab.url(f"lab/tree/{name}?reset"))
    wait_for_notebook(page)
    command(page, "notebook:run-all-cells")
    # Let the kernel pick the cells up before waiting for it to be idle again.
    page.wait_for_function(
        "() => window.jupyterapp.shell.currentWidget.content.widgets"
        ".some(c => c.model.type === 'code' && c.model.executionCount !== null)",
        timeout=60_000, polling=250)
    wait_until_all_ran(page, timeout_ms=150_000)
    errors = cell_errors(page)
    assert not errors, f"{name}: cells raised {errors}"


def widget_output(page: Any, has_selector: str) -> Any:
    """The output area (of a cell) that holds a widget matching ``has_selector``."""
    return page.locator(".jp-OutputArea-output").filter(has=page.locator(has_selector)).first


def fraction_slider(scope: Any) -> Any:
    return scope.locator(".widget-hslider").filter(
        has=scope.page.locator(".widget-label", has_text=re.compile(r"^\s*fraction\s*$"))).first


def plots_rendered(output: Any) -> list[dict]:
    """For every plotly figure in ``output``: its size, number of traces and of data points
    and whether it drew an SVG."""
    return output.evaluate("""(root) => Array.from(root.querySelectorAll('.js-plotly-plot'))
        .map(gd => {
            const box = gd.getBoundingClientRect();
            let points = 0;
            // _fullData: the traces as plotly.js drew them, typed arrays decoded
            // (gd.data keeps the {dtype, bdata} the widget sent).
            for (const t of (gd._fullData || gd.data || [])) {
                for (const k of ['x', 'y', 'z']) {
                    const v = t[k];
                    if (v && typeof v.length === 'number') points += v.length;
                }
            }
            return {width: box.width, height: box.height, traces: (gd.data || []).length,
                    points: points, svg: !!gd.querySelector('svg.main-svg')};
        })""")


def wait_for_plots(output: Any, n: int, timeout_s: float = 60.0) -> list[dict]:
    """Wait until ``output`` holds at least ``n`` plotly figures with data drawn."""
    deadline = time.monotonic() + timeout_s
    while True:
        plots = plots_rendered(output)
        good = [p for p in plots if p["svg"] and p["traces"] and p["points"]
                and p["width"] > 100 and p["height"] > 100]
        if len(good) >= n:
            return plots
        if time.monotonic() > deadline:
            raise AssertionError(f"expected {n} rendered plotly figures, got {plots}")
        time.sleep(0.5)


def drag_slider_to(page: Any, slider: Any, value: float, lo: float, hi: float) -> None:
    """Drag the noUiSlider handle of an ipywidgets slider to ``value`` with the mouse:
    press, move in steps, release (``continuous_update=False`` acts once, on release)."""
    slider.scroll_into_view_if_needed()
    track = slider.locator(".noUi-base").bounding_box()
    handle = slider.locator(".noUi-handle").bounding_box()
    assert track and handle and track["width"] > 50, (track, handle)
    x0 = handle["x"] + handle["width"] / 2
    y0 = handle["y"] + handle["height"] / 2
    x1 = track["x"] + track["width"] * (value - lo) / (hi - lo)
    page.mouse.move(x0, y0)
    page.mouse.down()
    page.mouse.move(x1, y0, steps=12)
    page.mouse.up()


def page_problems(page: Any) -> list[str]:
    """Error banners on the page: widgets that failed to render, tracebacks on stderr."""
    return page.evaluate("""() => {
        const out = [];
        const text = document.body.innerText;
        for (const s of ['Error displaying widget', 'model not found',
                         'Failed to load model class'])
            if (text.includes(s)) out.push(s);
        for (const e of document.querySelectorAll(
                '[data-mime-type="application/vnd.jupyter.stderr"]'))
            if (e.innerText.includes('Traceback')) out.push(e.innerText.slice(-2000));
        return out;
    }""")


def screenshot(page: Any, target: Any, path: Path) -> None:
    """A screenshot of the page with ``target`` scrolled to the top of the notebook, the
    side bar closed and the viewport tall enough for all of it."""
    target.evaluate("e => e.scrollIntoView({block: 'start'})")
    box = target.bounding_box()
    if box:
        page.set_viewport_size({"width": VIEWPORT["width"],
                                "height": int(min(3000, max(VIEWPORT["height"],
                                                            box["height"] + 220)))})
        target.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(1000)  # plotly relayout after the resize
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)


def collapse_left_sidebar(page: Any) -> None:
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")


# ------------------------------------------------------------------------------ tests
def test_dashboard_slider_changes_the_live_session(page, lab):
    open_and_run_all(page, lab, "01_quickstart.ipynb")
    collapse_left_sidebar(page)

    dash = widget_output(page, ".widget-hslider")
    dash.wait_for(state="attached")
    plots = wait_for_plots(dash, 4)
    assert len(plots) >= 4, plots  # timeline, heatmap, chunk map, bins

    slider = fraction_slider(dash)
    readout = slider.locator(".widget-readout")
    # %gpudash_config fraction=0.3 ran after the dashboard was shown: it follows the session.
    page.wait_for_function("(e) => e.innerText.trim() === '0.30'",
                           arg=readout.element_handle(), timeout=10_000)
    before = run_code_in_new_cell(
        page, "import gpudash\nprint(gpudash.default_session().devices[0].memory_limit)")
    limit_before = int(before.strip().splitlines()[-1])
    assert limit_before == int(0.3 * TOTAL), before

    drag_slider_to(page, slider, 0.75, lo=0.05, hi=1.0)
    # The kernel answers the change: the status line and the limit label follow.
    status = dash.locator(".widget-html", has_text="fraction set to")
    status.wait_for(timeout=20_000)
    shown = float(readout.inner_text().strip())
    assert 0.6 <= shown <= 0.9, f"the handle went to {shown}, not about 0.75"
    assert f"fraction set to {shown:g}" in status.inner_text()

    after = run_code_in_new_cell(
        page, "print(gpudash.default_session().devices[0].memory_limit)")
    limit_after = int(after.strip().splitlines()[-1])
    assert limit_after != limit_before
    # TensorFlow's limit: int(total * fraction) (1 byte of slack for the float the
    # slider sent, e.g. 0.7500000000000001).
    assert abs(limit_after - int(shown * TOTAL)) <= 1, (shown, limit_after)
    # The controls' label shows the exact limit in force.
    label = dash.locator(".widget-html", has_text=re.compile(r"limit .* of "))
    m = re.search(r"\(([\d,]+) B\)", label.inner_text())
    assert m and int(m.group(1).replace(",", "")) == limit_after, label.inner_text()
    # The stats view follows the new limit too (through the model's refresher thread).
    gib = f"{limit_after / GIB:.2f} GiB"
    page.wait_for_function(
        "([e, gib]) => /bytes_limit\\s+/.test(e.innerText) && "
        "e.innerText.split('\\n').some(l => l.includes('bytes_limit') && l.includes(gib))",
        arg=[dash.element_handle(), gib], timeout=15_000)

    wait_for_plots(dash, 4)
    assert not page_problems(page), page_problems(page)
    assert not page.console_errors, page.console_errors
    screenshot(page, dash, ASSETS / "dashboard.png")


def test_whatif_view_replays_at_the_slider_fraction(page, lab):
    open_and_run_all(page, lab, "02_tuning_fraction.ipynb")
    collapse_left_sidebar(page)

    view = widget_output(page, ".widget-hslider")
    view.wait_for(state="attached")
    wait_for_plots(view, 2)
    status = view.locator(".widget-html", has_text=re.compile(r"fits|out of memory"))
    status.first.wait_for(timeout=30_000)
    view.locator(".widget-html", has_text="minimum fraction").first.wait_for()
    page.wait_for_function(
        "(e) => /minimum fraction/.test(e.innerText) && !/minimum fraction: …/.test(e.innerText)",
        arg=view.element_handle(), timeout=60_000)

    # Well below the trace's minimum fraction: the replay runs out of memory.
    slider = fraction_slider(view)
    drag_slider_to(page, slider, 0.10, lo=0.05, hi=1.0)
    shown = slider.locator(".widget-readout").inner_text().strip()
    oom = view.locator(".widget-html", has_text=f"out of memory at {shown}")
    oom.wait_for(timeout=60_000)
    assert "first at call" in oom.inner_text()
    wait_for_plots(view, 2)
    assert not page_problems(page), page_problems(page)
    assert not page.console_errors, page.console_errors
    screenshot(page, view, ASSETS / "whatif.png")
