"""The dashboard as a person meets it: JupyterLab 4 in headless Chromium, side by side.

For each checkout (this one, and a baseline ``git worktree`` at ``--baseline``), a fresh
JupyterLab on 127.0.0.1 whose kernels import that checkout's gpudash, a fresh page, and:

1. ``%gpudash`` on a simulated 16 GiB device: seconds from running the cell to all four plots
   drawn (each with its SVG and data), and the bytes the page received over the websocket
   meanwhile (every frame; the largest one too).
2. ``%gpudash`` again: the same, and how many library-sized frames (> 300 kB) came again.
3. A background workload (the quick start's training loop, looped, in
   ``gpudash.run_in_background``) with the dashboard in view:
   - frames per second the page draws (``requestAnimationFrame`` over 5 s) and the longest
     gap between two frames;
   - refreshes per second of the busiest view (plotly redraw events over the same 5 s);
   - ``1+1``: from running the cell to its output shown (median of 3);
   - the fraction slider moved with the mouse: from the mouse to the session's limit
     changing in the kernel (a ``subscribe`` callback stamps ``time.time()``; the page's
     ``Date.now()`` stamps the mouse; one clock);
   - "Connection lost" or "reconnecting" messages in the console.
4. The notebook saved and the page reloaded: seconds until the views are drawn again, and
   whether they show the history (more than two timeline points).

``--segments`` instead measures the segment map at a real size, this checkout against a
baseline (``--baseline-dir``, a checkout on disk, or ``--baseline``), alternating, in one run:
a cell that makes a PyTorch session of 1,000 segments and a 6 GiB expandable one, blocks
labelled with their allocating line (``tests/browser_helpers.py``'s ``MANY_SEGMENTS``), and
shows its dashboard: seconds from running the cell to the four views drawn, bytes the page
received meanwhile, the segment map's draw in the browser (``Plotly.react``, ms), and as
drawn: the map's height, its y labels and how many overlap the next one.

``--holders`` measures the holders view the same way (this checkout against a baseline,
alternating, in one run): a cell makes a session recording stacks
(``record_stacks=True``), builds the small MLP of ``tests/browser_helpers.py``'s
``HOLDERS_TRAIN_PY`` and trains it two steps, then shows its dashboard: seconds from running
the cell to every view drawn (four before the holders view, five with it, shown by default
on such a session), the bytes the page received meanwhile and the largest frame, and the
holders view's own draw (``Plotly.react``, ms). Then, where the view exists, a click on the
timeline at its peak: milliseconds until the view shows that moment, and the bytes of
the message that brought it.

Run: ``python benchmarks/bench_browser.py [--baseline REF] [--only new|baseline]
[--json OUT]``; ``--allocators`` instead compares, in this checkout, the dashboard of a
TensorFlow-style session (``%gpudash``) with a PyTorch one (``%gpudash --allocator torch``);
``--segments [--baseline-dir DIR] [--repeat N]`` and ``--holders [--baseline-dir DIR]
[--repeat N]`` as above.
Needs JupyterLab, Playwright and ``/usr/bin/chromium`` (``pip install -e '.[test]'``;
``apt-get install chromium``). Takes a few minutes. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from browser_helpers import (  # noqa: E402
    HOLDERS_TRAIN_PY,
    MANY_SEGMENTS,
    LabServer,
    command,
    launch_chromium,
    wait_for_notebook,
)

#: main before the dashboard became one anywidget (FigureWidgets, plotly.js per figure)
BASELINE = "446be0c"
VIEWPORT = {"width": 1500, "height": 1100}

# A plotly figure counts as drawn when it has its SVG and its traces (an empty device has
# traces without points: nothing allocated yet is a correct drawing).
_DRAWN_JS = """(root) => {
    if (!root) return 0;
    let n = 0;
    for (const gd of root.querySelectorAll('.js-plotly-plot'))
        if (gd.querySelector('svg.main-svg') && (gd._fullData || []).length) n++;
    return n;
}"""

_CELL_OUTPUT_JS = "(n) => document.querySelectorAll('.jp-Notebook .jp-Cell')[n]"

WORKLOAD = """\
import threading, time
import gpudash
from gpudash.workloads import training_loop_calls, run_workload
sess = gpudash.default_session()
marks = []
sess.devices[0].allocator.subscribe(  # the BFC's new limit, PyTorch's new fraction
    lambda e: marks.append(time.time())
    if getattr(e, 'setting', None) in ('memory_limit', 'fraction') else None)
def workload(stop_event=None):
    runs = 0
    while not stop_event.is_set():
        calls = training_loop_calls(steps=30, layers=12, batch=64, hidden=4096)
        run_workload(calls, sess.allocate, sess.free, sleep=0.002, stop=stop_event.is_set)
        runs += 1
    return runs
task = gpudash.run_in_background(workload)
print('started')"""


def _new_notebook(folder: Path) -> None:
    import nbformat

    folder.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%load_ext gpudash\nimport gpudash\nprint('ready')")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, folder / "bench.ipynb")


def _add_cell(page: Any, source: str) -> int:
    return page.evaluate("""(source) => {
        const nb = window.jupyterapp.shell.currentWidget.content;
        nb.activeCellIndex = nb.widgets.length - 1;
        return window.jupyterapp.commands.execute('notebook:insert-cell-below').then(() => {
            nb.activeCell.model.sharedModel.setSource(source);
            return nb.activeCellIndex; }); }""", source)


def _run_cell(page: Any, source: str, timeout_ms: int = 120_000) -> tuple[int, float]:
    """Run ``source`` in a new cell; (cell index, seconds until its first output shows)."""
    n = _add_cell(page, source)
    t0 = time.monotonic()
    command(page, "notebook:run-cell")
    page.wait_for_function("""(n) => { const c = window.jupyterapp.shell.currentWidget
        .content.widgets[n]; return c && c.model.outputs.length > 0; }""",
                           arg=n, timeout=timeout_ms, polling=10)
    return n, time.monotonic() - t0


def _wait_drawn(page: Any, n: int, want: int = 4, timeout_s: float = 120.0) -> float:
    t0 = time.monotonic()
    page.wait_for_function(f"(n) => ({_DRAWN_JS})(({_CELL_OUTPUT_JS})(n)) >= {want}", arg=n,
                           timeout=timeout_s * 1000, polling=20)
    return time.monotonic() - t0


def _wait_idle(page: Any) -> None:
    page.wait_for_function("""() => { const w = window.jupyterapp.shell.currentWidget;
        return w.sessionContext.session.kernel.status === 'idle'; }""", timeout=120_000)


def _timeline_points(page: Any, n: int) -> int:
    return page.evaluate("""(n) => { const c = document.querySelectorAll('.jp-Notebook .jp-Cell')[n];
        let best = 0;
        for (const gd of c.querySelectorAll('.js-plotly-plot'))
            for (const t of (gd._fullData || []))
                if (t.type === 'scatter' && t.x && t.x.length > best) best = t.x.length;
        return best; }""", n)


def _frames_and_refreshes(page: Any, n: int, seconds: float = 5.0) -> dict:
    """Frames per second and the longest frame gap; redraws per second of the busiest
    plot of cell ``n`` (plotly's afterplot/restyle/relayout events, one per frame at most)."""
    return page.evaluate("""([n, ms]) => new Promise((resolve) => {
        const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[n];
        const plots = Array.from(cell.querySelectorAll('.js-plotly-plot'));
        const counts = plots.map(() => 0);
        let frameNo = 0;
        const seen = plots.map(() => -1);
        plots.forEach((gd, i) => {
            const hit = () => { if (seen[i] !== frameNo) { seen[i] = frameNo; counts[i]++; } };
            if (gd.on) for (const ev of ['plotly_afterplot', 'plotly_restyle', 'plotly_relayout',
                                         'plotly_redraw', 'plotly_react']) gd.on(ev, hit);
        });
        let frames = 0, maxGap = 0;
        const t0 = performance.now();
        let last = t0;
        function tick(t) {
            frames++; frameNo++;
            maxGap = Math.max(maxGap, t - last); last = t;
            if (t - t0 < ms) requestAnimationFrame(tick);
            else resolve({fps: frames * 1000 / (t - t0), max_gap_ms: maxGap,
                          refresh_hz: Math.max(0, ...counts) * 1000 / (t - t0)});
        }
        requestAnimationFrame(tick);
    })""", [n, seconds * 1000])


def _move_fraction(page: Any, n: int, value: float) -> float:
    """Move the fraction slider of cell ``n``'s dashboard to about ``value`` with the mouse;
    returns the page's ``Date.now()`` (ms) just before the mouse acts."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(n)
    native = cell.locator('input[data-ctl="fraction"]')
    if native.count():  # the anywidget dashboard: a range input
        native.scroll_into_view_if_needed()
        box = native.bounding_box()
        x = box["x"] + box["width"] * (value - 0.01) / 0.99
        y = box["y"] + box["height"] / 2
        t = page.evaluate("Date.now()")
        page.mouse.click(x, y)
        return t
    return _drag_float_slider(page, cell.locator(".widget-hslider").first, value, 0.05, 1.0)


def _drag_float_slider(page: Any, slider: Any, value: float, lo: float, hi: float) -> float:
    """Drag an ipywidgets FloatSlider (noUiSlider) to about ``value``: press, move, release
    (it acts on release); returns the page's ``Date.now()`` just before the release."""
    slider.scroll_into_view_if_needed()
    track = slider.locator(".noUi-base").bounding_box()
    handle = slider.locator(".noUi-handle").bounding_box()
    x0 = handle["x"] + handle["width"] / 2
    y0 = handle["y"] + handle["height"] / 2
    page.mouse.move(x0, y0)
    page.mouse.down()
    page.mouse.move(track["x"] + track["width"] * (value - lo) / (hi - lo), y0, steps=8)
    t = page.evaluate("Date.now()")
    page.mouse.up()
    return t


def _kernel_value(page: Any, expr: str) -> Any:
    n, _ = _run_cell(page, f"import json as _j; print(_j.dumps({expr}))")
    text = page.locator(".jp-Notebook .jp-Cell").nth(n).locator(
        ".jp-Cell-outputArea").inner_text()
    return json.loads(text.strip().splitlines()[-1])


def measure(label: str, repo: Path, work: Path, log: Any, magic: str = "%gpudash") -> dict:
    """One variant's figures: ``magic`` opens the dashboard (``%gpudash --allocator torch``
    for PyTorch's caching allocator), ``%gpudash`` shows it again."""
    from playwright.sync_api import sync_playwright

    out: dict[str, Any] = {"variant": label, "repo": str(repo)}
    nbdir = work / "nb"
    _new_notebook(nbdir)
    lab = LabServer(work / "lab", notebooks=nbdir, repo=repo)
    lab.start()
    pw = sync_playwright().start()
    browser = launch_chromium(pw)
    try:
        page = browser.new_context(viewport=VIEWPORT, device_scale_factor=1).new_page()
        console: list[str] = []
        page.on("console", lambda m: console.append(m.text))
        frames: list[tuple[float, int]] = []
        page.on("websocket", lambda ws: ws.on(
            "framereceived", lambda p: frames.append((time.monotonic(), len(p)))))
        page.goto(lab.url("lab/tree/bench.ipynb?reset"))
        wait_for_notebook(page)
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
        command(page, "notebook:run-all-cells")
        _wait_idle(page)
        time.sleep(1.0)

        def wire(since: int) -> dict:
            sizes = [s for _, s in frames[since:]]
            return {"bytes": sum(sizes), "largest": max(sizes, default=0),
                    "library_frames": sum(s > 300_000 for s in sizes)}

        # 1. %gpudash to all views drawn
        log(f"[{label}] %gpudash")
        k = len(frames)
        t0 = time.monotonic()
        n1, _ = _run_cell(page, magic)
        _wait_drawn(page, n1)
        out["open_s"] = time.monotonic() - t0
        time.sleep(1.0)
        out["open_wire"] = wire(k)
        # 2. again
        log(f"[{label}] %gpudash again")
        k = len(frames)
        t0 = time.monotonic()
        n2, _ = _run_cell(page, "%gpudash")
        _wait_drawn(page, n2)
        out["rerun_s"] = time.monotonic() - t0
        time.sleep(1.0)
        out["rerun_wire"] = wire(k)
        out["rerun_history_points"] = _timeline_points(page, n2)
        # 3. under load, the newest dashboard in view
        log(f"[{label}] under load")
        _run_cell(page, WORKLOAD)
        page.locator(".jp-Notebook .jp-Cell").nth(n2).scroll_into_view_if_needed()
        time.sleep(3.0)
        out["load"] = _frames_and_refreshes(page, n2)
        lat = []
        for _ in range(3):
            _, s = _run_cell(page, "1+1")
            lat.append(s)
        out["one_plus_one_s"] = statistics.median(lat)
        out["one_plus_one_all_s"] = lat
        page.locator(".jp-Notebook .jp-Cell").nth(n2).scroll_into_view_if_needed()
        slider_ms = []
        for target in (0.6, 0.4):
            before = _kernel_value(page, "len(marks)")
            t_mouse = _move_fraction(page, n2, target)
            deadline = time.monotonic() + 30
            got = None
            while time.monotonic() < deadline:
                time.sleep(0.5)
                marks = _kernel_value(page, "marks")
                if len(marks) > before:
                    got = marks[before] * 1000 - t_mouse
                    break
            slider_ms.append(got)
        out["slider_ms"] = slider_ms
        _run_cell(page, "task.cancel(); print(task.result(timeout=60))")
        out["connection_lost"] = sum(("Connection lost" in c or "reconnecting" in c.lower())
                                     for c in console)
        # 4. save and reload
        log(f"[{label}] reload")
        _wait_idle(page)
        command(page, "docmanager:save")
        time.sleep(1.0)
        k = len(frames)
        t0 = time.monotonic()
        page.reload()
        wait_for_notebook(page)
        try:
            _wait_drawn(page, n1, timeout_s=60)
            out["reload_s"] = time.monotonic() - t0
        except Exception:  # noqa: BLE001 - a blank view after reload is a result
            out["reload_s"] = None
        out["reload_history_points"] = _timeline_points(page, n1)
        out["reload_wire"] = wire(k)
    finally:
        browser.close()
        pw.stop()
        lab.stop()
    return out


_MAP_JS = """(n) => {
    const c = document.querySelectorAll('.jp-Notebook .jp-Cell')[n];
    const gd = c.querySelector('[data-view=chunkmap] .js-plotly-plot');
    const ticks = Array.from(c.querySelectorAll(
        '[data-view=chunkmap] .yaxislayer-above .ytick text'))
        .map(e => e.getBoundingClientRect()).sort((a, b) => a.top - b.top);
    let overlaps = 0;
    for (let i = 1; i < ticks.length; i++) if (ticks[i].top < ticks[i - 1].bottom - 0.5) overlaps++;
    const views = (globalThis.__gpudash && globalThis.__gpudash.views) || [];
    const v = views[views.length - 1];
    return {height: gd ? gd.offsetHeight : null, labels: ticks.length, overlaps: overlaps,
            draw_ms: v && v.stats && v.stats.ms ? v.stats.ms.chunkmap : null,
            title: (c.querySelector('[data-view=chunkmap] .gd-title') || {}).textContent};
}"""


def measure_segments(label: str, repo: Path, work: Path, log: Any) -> dict:
    """The 1,000-segment dashboard (MANY_SEGMENTS) of one checkout: see the docstring."""
    from playwright.sync_api import sync_playwright

    out: dict[str, Any] = {"variant": label, "repo": str(repo)}
    nbdir = work / "nb"
    _new_notebook(nbdir)
    lab = LabServer(work / "lab", notebooks=nbdir, repo=repo)
    lab.start()
    pw = sync_playwright().start()
    browser = launch_chromium(pw)
    try:
        page = browser.new_context(viewport=VIEWPORT, device_scale_factor=1).new_page()
        frames: list[int] = []
        page.on("websocket", lambda ws: ws.on("framereceived", lambda p: frames.append(len(p))))
        page.goto(lab.url("lab/tree/bench.ipynb?reset"))
        wait_for_notebook(page)
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
        command(page, "notebook:run-all-cells")
        _wait_idle(page)
        # plotly.js reaches the page with a first, small dashboard: not counted below
        n0, _ = _run_cell(page, "import gpudash\ngpudash.Dashboard(gpudash.Session("
                                "allocator='torch', simulate='1GiB'))")
        _wait_drawn(page, n0)
        _wait_idle(page)
        time.sleep(1.0)
        log(f"[{label}] 1,000 segments")
        k = len(frames)
        t0 = time.monotonic()
        n, _ = _run_cell(page, MANY_SEGMENTS)
        # a dashboard draws only in view: keep its cell in view until it has drawn
        cell = page.locator(".jp-Notebook .jp-Cell").nth(n)
        while True:
            cell.locator(".gd-root, .jp-OutputArea-output").last.scroll_into_view_if_needed()
            try:
                _wait_drawn(page, n, timeout_s=0.5)
                break
            except Exception:  # noqa: BLE001 - not yet
                if time.monotonic() - t0 > 120:
                    raise
        out["open_s"] = time.monotonic() - t0
        time.sleep(1.5)
        sizes = frames[k:]
        out["bytes"] = sum(sizes)
        out["largest"] = max(sizes, default=0)
        page.locator(".jp-Notebook .jp-Cell").nth(n).locator(
            '[data-view="chunkmap"]').scroll_into_view_if_needed()
        time.sleep(1.0)
        out["map"] = page.evaluate(_MAP_JS, n)
    finally:
        browser.close()
        pw.stop()
        lab.stop()
    return out


#: The cell of ``--holders``: a session recording stacks, a model trained two steps, its
#: dashboard.
HOLDERS_CELL = """\
import gpudash
from train import MLP, Adam, train_step
sess = gpudash.Session(simulate="16GiB", record_stacks=True)
with sess.label("model"):
    model = MLP(sess, (8192, 8192, 8192, 4096, 1024))
    opt = Adam(sess, model)
dash = gpudash.Dashboard(sess)
for step in range(2):
    with sess.label(f"step {step}"):
        train_step(sess, model, opt, batch=4096)
dash"""

_HOLDERS_JS = """(n) => {
    const c = document.querySelectorAll('.jp-Notebook .jp-Cell')[n];
    const gd = c.querySelector('[data-view=holders] .js-plotly-plot');
    const views = (globalThis.__gpudash && globalThis.__gpudash.views) || [];
    const v = views[views.length - 1];
    return {present: !!c.querySelector('[data-view=holders]'),
            draw_ms: v && v.stats && v.stats.ms ? v.stats.ms.holders : null,
            live: gd ? gd.dataset.live : null, at: gd ? gd.dataset.at : null,
            total: gd ? Number(gd.dataset.total) : null};
}"""


def measure_holders(label: str, repo: Path, work: Path, log: Any) -> dict:
    """The holders view of one checkout: see the docstring."""
    from playwright.sync_api import sync_playwright

    out: dict[str, Any] = {"variant": label, "repo": str(repo)}
    nbdir = work / "nb"
    _new_notebook(nbdir)
    (nbdir / "train.py").write_text(HOLDERS_TRAIN_PY)
    lab = LabServer(work / "lab", notebooks=nbdir, repo=repo)
    lab.start()
    pw = sync_playwright().start()
    browser = launch_chromium(pw)
    try:
        page = browser.new_context(viewport=VIEWPORT, device_scale_factor=1).new_page()
        frames: list[tuple[float, int]] = []
        page.on("websocket", lambda ws: ws.on(
            "framereceived", lambda p: frames.append((time.monotonic(), len(p)))))
        page.goto(lab.url("lab/tree/bench.ipynb?reset"))
        wait_for_notebook(page)
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
        command(page, "notebook:run-all-cells")
        _wait_idle(page)
        # plotly.js reaches the page with a first, small dashboard: not counted below
        n0, _ = _run_cell(page, "import gpudash\ngpudash.Dashboard(gpudash.Session("
                                "simulate='1GiB'))")
        _wait_drawn(page, n0)
        _wait_idle(page)
        time.sleep(1.0)
        log(f"[{label}] holders")
        k = len(frames)
        t0 = time.monotonic()
        n, _ = _run_cell(page, HOLDERS_CELL)
        want = 5 if page.evaluate(
            "(n) => !!document.querySelectorAll('.jp-Notebook .jp-Cell')[n]"
            ".querySelector('[data-view=holders]')", n) else 4
        cell = page.locator(".jp-Notebook .jp-Cell").nth(n)
        while True:
            cell.locator(".gd-root, .jp-OutputArea-output").last.scroll_into_view_if_needed()
            try:
                _wait_drawn(page, n, want=want, timeout_s=0.5)
                break
            except Exception:  # noqa: BLE001 - not yet
                if time.monotonic() - t0 > 120:
                    raise
        out["views"] = want
        out["open_s"] = time.monotonic() - t0
        _wait_idle(page)
        time.sleep(1.5)
        sizes = [b for t, b in frames[k:]]
        out["bytes"] = sum(sizes)
        out["largest"] = max(sizes, default=0)
        info = page.evaluate(_HOLDERS_JS, n)
        out["draw_ms"] = info["draw_ms"]
        if info["present"]:
            timeline = cell.locator('[data-view="timeline"] .js-plotly-plot')
            timeline.scroll_into_view_if_needed()
            peak = timeline.evaluate("""(gd) => { const d = gd._fullData[0]; let best = 0;
                for (let i = 0; i < d.y.length; i++) if (d.y[i] > d.y[best]) best = i;
                const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
                const box = gd.getBoundingClientRect();
                return {px: box.left + xa._offset + xa.d2p(d.x[best]),
                        py: box.top + ya._offset + ya._length * 0.6}; }""")
            k = len(frames)
            t0 = time.monotonic()
            page.mouse.click(peak["px"] + 1, peak["py"])
            page.wait_for_function(f"(n) => ({_HOLDERS_JS})(n).live === '0'", arg=n,
                                   timeout=30_000, polling=10)
            out["moment_ms"] = 1e3 * (time.monotonic() - t0)
            time.sleep(0.5)
            out["moment_bytes"] = max((b for t, b in frames[k:]), default=0)
            out["moment_draw_ms"] = page.evaluate(_HOLDERS_JS, n)["draw_ms"]
    finally:
        browser.close()
        pw.stop()
        lab.stop()
    return out


def holders_table(results: list[dict]) -> str:
    rows = [
        ("views drawn", lambda r: r["views"]),
        ("cell to every view drawn (s)", lambda r: r["open_s"]),
        ("  bytes received", lambda r: r["bytes"]),
        ("  largest frame (B)", lambda r: r["largest"]),
        ("holders view draw (ms)", lambda r: r["draw_ms"]),
        ("click on the timeline to the moment shown (ms)", lambda r: r["moment_ms"]),
        ("  its message (B)", lambda r: r["moment_bytes"]),
        ("  the view's draw (ms)", lambda r: r["moment_draw_ms"]),
    ]
    names = [r["variant"] for r in results]
    width = max(len(n) for n, _ in rows) + 2
    lines = ["holders view".ljust(width) + "".join(n.rjust(24) for n in names)]
    for name, get in rows:
        cells = []
        for r in results:
            try:
                v = get(r)
            except (KeyError, TypeError):
                v = None
            cells.append(_fmt(v).rjust(24))
        lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines)


def segments_table(results: list[dict]) -> str:
    rows = [
        ("cell to 4 views drawn (s)", lambda r: r["open_s"]),
        ("  bytes received", lambda r: r["bytes"]),
        ("  largest frame (B)", lambda r: r["largest"]),
        ("segment map draw (ms)", lambda r: r["map"]["draw_ms"]),
        ("  plot height (px)", lambda r: r["map"]["height"]),
        ("  y labels drawn", lambda r: r["map"]["labels"]),
        ("  labels overlapping the next", lambda r: r["map"]["overlaps"]),
    ]
    names = [r["variant"] for r in results]
    width = max(len(n) for n, _ in rows) + 2
    lines = ["1,000 segments".ljust(width) + "".join(n.rjust(24) for n in names)]
    for name, get in rows:
        cells = []
        for r in results:
            try:
                v = get(r)
            except (KeyError, TypeError):
                v = None
            cells.append(_fmt(v).rjust(24))
        lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines)


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}{unit}"
    return f"{v:,}{unit}"


def table(results: list[dict]) -> str:
    rows = [
        ("%gpudash to 4 views drawn (s)", lambda r: r["open_s"]),
        ("  bytes received", lambda r: r["open_wire"]["bytes"]),
        ("  largest frame (B)", lambda r: r["open_wire"]["largest"]),
        ("  library-sized frames (>300 kB)", lambda r: r["open_wire"]["library_frames"]),
        ("%gpudash again (s)", lambda r: r["rerun_s"]),
        ("  bytes received", lambda r: r["rerun_wire"]["bytes"]),
        ("  library-sized frames", lambda r: r["rerun_wire"]["library_frames"]),
        ("  timeline points shown", lambda r: r["rerun_history_points"]),
        ("under load: frames/s", lambda r: r["load"]["fps"]),
        ("  longest frame gap (ms)", lambda r: r["load"]["max_gap_ms"]),
        ("  busiest view refreshes/s", lambda r: r["load"]["refresh_hz"]),
        ("  1+1 answered (s, median of 3)", lambda r: r["one_plus_one_s"]),
        ("  slider to kernel (ms)", lambda r: ", ".join(_fmt(x) for x in r["slider_ms"])),
        ("  'connection lost' messages", lambda r: r["connection_lost"]),
        ("reload to views drawn (s)", lambda r: r["reload_s"]),
        ("  timeline points shown", lambda r: r["reload_history_points"]),
        ("  bytes received", lambda r: r["reload_wire"]["bytes"]),
    ]
    names = [r["variant"] for r in results]
    width = max(len(n) for n, _ in rows) + 2
    lines = ["".ljust(width) + "".join(n.rjust(22) for n in names)]
    for name, get in rows:
        cells = []
        for r in results:
            try:
                v = get(r)
            except (KeyError, TypeError):
                v = None
            cells.append((v if isinstance(v, str) else _fmt(v)).rjust(22))
        lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE, help=f"git ref to compare (default "
                    f"{BASELINE}: the dashboard of FigureWidgets)")
    ap.add_argument("--only", choices=("new", "baseline"), default=None)
    ap.add_argument("--allocators", action="store_true",
                    help="compare the dashboard of TensorFlow's BFC with PyTorch's caching "
                         "allocator's (%%gpudash --allocator torch), both from this checkout")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--segments", action="store_true",
                    help="the segment map of 1,000 segments, this checkout against a baseline")
    ap.add_argument("--holders", action="store_true",
                    help="the holders view, this checkout against a baseline")
    ap.add_argument("--baseline-dir", type=Path, default=None,
                    help="with --segments or --holders: a baseline checkout on disk (else "
                         "--baseline's commit in a temporary git worktree)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="with --segments or --holders: runs of each, alternating")
    args = ap.parse_args(argv)
    results: list[dict] = []

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.segments or args.holders:
        measure_one = measure_holders if args.holders else measure_segments
        print_table = holders_table if args.holders else segments_table
        with tempfile.TemporaryDirectory(prefix="gpudash-bench-") as tmp:
            tmp = Path(tmp)
            base = args.baseline_dir
            made = base is None
            if made:
                base = tmp / "baseline"
                subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q",
                                str(base), args.baseline], check=True)
            try:
                for i in range(max(1, args.repeat)):
                    for label, repo in (("baseline", base), ("this checkout", REPO)):
                        work = tmp / f"{label.replace(' ', '_')}_{i}"
                        work.mkdir()
                        results.append(measure_one(label, repo, work, log))
            finally:
                if made:
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                    str(base)], check=False)
        print(print_table(results))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return 0

    results = []
    if args.allocators:
        with tempfile.TemporaryDirectory(prefix="gpudash-bench-") as tmp:
            for label, magic in (("BFC session", "%gpudash"),
                                 ("PyTorch session", "%gpudash --allocator torch")):
                work = Path(tmp) / label.replace(" ", "_")
                work.mkdir()
                results.append(measure(label, REPO, work, log, magic=magic))
        print(table(results))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return 0
    with tempfile.TemporaryDirectory(prefix="gpudash-bench-") as tmp:
        tmp = Path(tmp)
        variants = []
        if args.only in (None, "baseline"):
            base = tmp / "baseline"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q",
                            str(base), args.baseline], check=True)
            variants.append((f"baseline {args.baseline}", base))
        if args.only in (None, "new"):
            variants.append(("this checkout", REPO))
        try:
            for label, repo in variants:
                work = tmp / label.replace(" ", "_")
                work.mkdir()
                results.append(measure(label, repo, work, log))
        finally:
            if args.only in (None, "baseline"):
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(tmp / "baseline")], check=False)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
