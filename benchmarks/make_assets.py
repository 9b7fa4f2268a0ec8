"""Make the README's screenshots in ``assets/``, on purpose (tests never write there).

Drives JupyterLab 4 in headless Chromium on a simulated 16 GiB device:

- ``dashboard.png``: the quick start run top to bottom, its dashboard idle afterwards;
- ``dashboard-load.png``: the same dashboard while a background training loop runs;
- ``dashboard-reload.png``: after saving the notebook and reloading the page;
- ``whatif.png``: the what-if view of ``02_tuning_fraction.ipynb``, below the smallest
  fraction that fits;
- ``report.png``: the HTML report of a fragmentation stress trace (``gpudash.report``);
- ``explain-torch.png``: ``gpudash explain`` of a PyTorch snapshot that ends at its
  out-of-memory error (``notebooks/07_pytorch.ipynb``'s 24 GiB fine-tuning job), top of the
  page: the summary with the fix proven, the segment map at the failure;
- ``watch-tensorflow.png``: ``05_frameworks.ipynb``'s dashboard watching TensorFlow's CPU BFC
  while a Keras model trains (only where TensorFlow is installed: ``pip install -e '.[tf]'``);
- ``dashboard_torch.png``: ``%gpudash --allocator torch`` (PyTorch's caching allocator) after
  a fine-tuning loop, with expandable segments turned on, ``max_split_size_mb`` typed in and
  the cache emptied from its controls;
- ``segments-118.png``: the segment map of ``07_pytorch.ipynb``'s fine-tuning job on the live
  PyTorch dashboard (24 GiB), expandable segments turned on and the cache emptied near its
  end: 117 segments and one of 9.9 GiB;
- ``segments-1000.png``: the same dashboard over 1,000 segments and a 6 GiB expandable one
  (``tests/browser_helpers.py``'s ``MANY_SEGMENTS``), a block hovered;
- ``report-segments-1000.png``: the segment map of a report of a 1,000-segment snapshot;
- ``dashboard-holders.png``: the dashboard of a session recording stacks
  (``record_stacks=True``) while a small MLP (``tests/browser_helpers.py``'s
  ``HOLDERS_TRAIN_PY``) is built in one ``%%gpudash_track`` cell and trained in the next;
  the timeline clicked at its peak, so the holders view shows who held the memory then, the
  node of a layer's weights hovered.

Run: ``python benchmarks/make_assets.py [--out DIR]
[--only report|explain-torch|torch|segments|holders]`` (default ``assets/``). Look at them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_browser import WORKLOAD, _run_cell, _wait_idle  # noqa: E402
from browser_helpers import (  # noqa: E402
    HOLDERS_CELLS,
    HOLDERS_TRAIN_PY,
    MANY_SEGMENTS,
    LabServer,
    command,
    launch_chromium,
    wait_for_notebook,
)

VIEWPORT = {"width": 1400, "height": 1000}
DRAWN = '.gd-plot[data-drawn="1"]'


def _views_drawn(page, root, n: int = 4) -> None:
    root.scroll_into_view_if_needed()
    page.wait_for_function("([r, sel, n]) => r.querySelectorAll(sel).length >= n",
                           arg=[root.element_handle(), DRAWN, n], timeout=120_000)


def _shot(page, root, path: Path) -> None:
    root.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(800)
    path.parent.mkdir(parents=True, exist_ok=True)
    root.screenshot(path=str(path))
    print(f"wrote {path} ({path.stat().st_size:,} B)")


def _run_all(page, lab, name: str) -> None:
    page.goto(lab.url(f"lab/tree/{name}?reset"))
    wait_for_notebook(page)
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
    command(page, "notebook:run-all-cells")
    page.wait_for_function("() => window.jupyterapp.shell.currentWidget.content.widgets"
                           ".every(c => c.model.type !== 'code' || c.model.executionCount "
                           "!== null)", timeout=300_000, polling=250)
    _wait_idle(page)


def _page_shot(page_path: Path, target: Path, plots: int, viewport: dict,
               full_page: bool) -> None:
    """A screenshot of a self-contained HTML page once ``plots`` plotly figures are drawn."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page(viewport=viewport)
            page.goto(page_path.as_uri())
            page.wait_for_function(
                f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {plots}",
                timeout=60_000)
            page.wait_for_timeout(500)
            page.screenshot(path=str(target), full_page=full_page)
            print(f"wrote {target} ({target.stat().st_size:,} B)")
        finally:
            browser.close()


def _report(out: Path) -> int:
    from gpudash.report import write_report
    from gpudash.workloads import fragmentation_stress

    with tempfile.TemporaryDirectory(prefix="gpudash-report-") as tmp:
        path = write_report(fragmentation_stress(rounds=600, seed=3), Path(tmp) / "r.html",
                            title="gpudash report", device_bytes=4 << 30,
                            replay_options={"fraction": 0.5})
        _page_shot(path, out / "report.png", 8, {"width": 1300, "height": 900}, True)
    return 0


def _explain_torch(out: Path) -> int:
    import pickle

    from gpudash.postmortem import explain
    from gpudash.workloads import caching_snapshot, finetune_calls

    with tempfile.TemporaryDirectory(prefix="gpudash-explain-") as tmp:
        snap = Path(tmp) / "finetune_24gib.pickle"
        snap.write_bytes(pickle.dumps(caching_snapshot(finetune_calls(), device_bytes="24GiB")))
        path = explain(snap).write_html(Path(tmp) / "e.html")
        _page_shot(path, out / "explain-torch.png", 2, {"width": 1300, "height": 1100}, False)
    return 0


#: The PyTorch dashboard's notebook: a session with PyTorch's caching allocator at a fraction,
#: weights and a fine-tuning loop of varying sequence lengths (its cache left behind), a batch
#: still held.
TORCH_CELLS = (
    "%load_ext gpudash\nimport gpudash\n"
    "from gpudash.workloads import finetune_calls, run_workload",
    "%gpudash --allocator torch --fraction 0.75",
    "s = gpudash.default_session()\n"
    "run_workload(finetune_calls(steps=8, layers=2), s.allocate, s.free, sleep=0.01)\n"
    "batch = [s.allocate(n << 20) for n in (90, 40, 7, 1)]\nprint(s)",
)


def _torch_notebook(root: Path) -> str:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in TORCH_CELLS]
    nbformat.write(nb, root / "torch_dashboard.ipynb")
    return "torch_dashboard.ipynb"


def _torch_dashboard(page, lab, out: Path) -> None:
    """The PyTorch session's dashboard, after its controls were used with the mouse."""
    _run_all(page, lab, _torch_notebook(lab.root))
    root = page.locator(".gd-root").first
    _views_drawn(page, root)
    root.locator('button[data-ctl="expandable"]').click()
    root.locator(".gd-status", has_text="expandable_segments: on").wait_for(timeout=30_000)
    _run_cell(page, "more = [s.allocate(n << 20) for n in (300, 120, 3)]\nprint('ok')")
    field = root.locator('input[data-ctl="max_split"]')
    field.fill("256")
    field.press("Enter")
    root.locator(".gd-status", has_text="max_split_size_mb: 256").wait_for(timeout=30_000)
    root.locator('button[data-ctl="empty_cache"]').click()
    root.locator(".gd-status", has_text="empty_cache(): returned").wait_for(timeout=30_000)
    _views_drawn(page, root)
    time.sleep(1.5)
    target = page.locator(".jp-OutputArea-output").filter(has=root).first
    _shot(page, target, out / "dashboard_torch.png")


#: ``07_pytorch.ipynb``'s fine-tuning job on the live PyTorch dashboard, expandable segments
#: turned on and the cache emptied near its end (as a user did): 117 segments, one of 9.9 GiB.
SEGMENTS_118 = (
    "%load_ext gpudash\nimport gpudash\n"
    "from gpudash.workloads import finetune_calls, run_workload",
    "%gpudash --allocator torch --simulate 24GiB",
    "s = gpudash.default_session()\n"
    "calls = list(finetune_calls(steps=60))\n"
    "k = int(0.9 * len(calls))\n"
    "run = run_workload(calls[:k], s.allocate, s.free, sleep=0.0002)\n"
    "s.configure(expandable_segments=True)\n"
    "s.empty_cache()\n"
    "live = dict(run.live)\n"
    "for c in calls[k:]:\n"
    "    if c[0] == 'alloc':\n"
    "        live[c[1]] = s.allocate(c[2])\n"
    "    elif c[1] in live:\n"
    "        s.free(live.pop(c[1]))\n"
    "print(len(s.devices[0].allocator.chunk_table()['regions']), 'segments')",
)


def _notebook(root: Path, name: str, cells: tuple) -> str:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, root / name)
    return name


def _segments(page, lab, out: Path) -> None:
    """The segment map at 118 and at 1,000 segments on the live dashboard."""
    page.set_viewport_size({"width": VIEWPORT["width"], "height": 1500})  # the whole output
    _run_all(page, lab, _notebook(lab.root, "segments_118.ipynb", SEGMENTS_118))
    root = page.locator(".gd-root").first
    _views_drawn(page, root)
    time.sleep(2.0)
    target = page.locator(".jp-OutputArea-output").filter(has=root).first
    _shot(page, target, out / "segments-118.png")
    lab.shutdown_kernels()

    _run_all(page, lab, _notebook(lab.root, "segments_1000.ipynb", (MANY_SEGMENTS,)))
    root = page.locator(".gd-root").first
    _views_drawn(page, root)
    time.sleep(1.5)
    cell = root.locator('[data-view="chunkmap"]')
    cell.scroll_into_view_if_needed()
    # hover a block
    drag = cell.locator(".nsewdrag").first.bounding_box()
    page.mouse.move(drag["x"] + 40, drag["y"] + drag["height"] * 0.35 + 8)
    page.wait_for_timeout(600)
    target = page.locator(".jp-OutputArea-output").filter(has=root).first
    target.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(300)
    target.screenshot(path=str(out / "segments-1000.png"))
    print(f"wrote {out / 'segments-1000.png'}")
    lab.shutdown_kernels()


def _holders(page, lab, out: Path) -> None:
    """The holders view at the timeline's peak, the node of a layer's weights hovered."""
    page.set_viewport_size({"width": VIEWPORT["width"], "height": 1400})  # the whole output
    (lab.root / "train.py").write_text(HOLDERS_TRAIN_PY)
    _run_all(page, lab, _notebook(lab.root, "holders.ipynb", HOLDERS_CELLS))
    root = page.locator(".gd-root").first
    _views_drawn(page, root, 5)
    time.sleep(1.5)
    target = page.locator(".jp-OutputArea-output").filter(has=root).first
    target.evaluate("e => e.scrollIntoView({block: 'start'})")
    timeline = root.locator('[data-view="timeline"] .js-plotly-plot')
    peak = timeline.evaluate("""(gd) => { const d = gd._fullData[0]; let best = 0;
        for (let i = 0; i < d.y.length; i++) if (d.y[i] > d.y[best]) best = i;
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        const box = gd.getBoundingClientRect();
        return {px: box.left + xa._offset + xa.d2p(d.x[best]),
                py: box.top + ya._offset + ya._length * 0.6}; }""")
    page.mouse.click(peak["px"] + 1, peak["py"])
    root.locator(".gd-status", has_text="holders at ").wait_for(timeout=30_000)
    page.wait_for_timeout(800)
    cell = root.locator('[data-view="holders"] .js-plotly-plot')
    node = cell.evaluate("""(gd) => {
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        const box = gd.getBoundingClientRect();
        let best = null;   // the deepest layer's weights: its hover clear of the step's
        for (const t of gd._fullData) {
            Array.from(t.text || []).forEach((s, i) => {
                if (/^train\\.py:\\d+ __init__$/.test(s) && (!best || t.y[i] > best.y))
                    best = {px: box.left + xa._offset + xa.d2p(t.base[i] + t.x[i] / 2),
                            py: box.top + ya._offset + ya.d2p(t.y[i]), y: t.y[i]};
            });
        }
        return best; }""")
    if node:
        page.mouse.move(node["px"], node["py"])
        page.wait_for_timeout(600)
    target.screenshot(path=str(out / "dashboard-holders.png"))
    print(f"wrote {out / 'dashboard-holders.png'}")
    lab.shutdown_kernels()


def _report_segments(out: Path) -> int:
    """The segment map of a report of a 1,000-segment PyTorch snapshot."""
    import numpy as np
    from playwright.sync_api import sync_playwright

    from gpudash.report import write_report
    from gpudash.formats.torch_snapshot import load_torch_snapshot
    from gpudash.workloads import caching_snapshot

    rng = np.random.default_rng(0)
    calls = [("alloc", k, int(rng.integers(12, 60)) * (1 << 20)) for k in range(1000)]
    calls += [("free", k) for k in range(0, 1000, 3)]
    trace = load_torch_snapshot(caching_snapshot(calls, device_bytes="80GiB"))
    with tempfile.TemporaryDirectory(prefix="gpudash-report-") as tmp:
        path = write_report(trace, Path(tmp) / "r.html", title="gpudash report",
                            fractions=(1.0,))
        with sync_playwright() as pw:
            browser = launch_chromium(pw)
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 900})
                page.goto(path.as_uri())
                section = page.locator('section[data-plot="chunkmap"]')
                section.locator(".main-svg").first.wait_for(timeout=60_000)
                section.scroll_into_view_if_needed()
                page.wait_for_timeout(800)
                section.screenshot(path=str(out / "report-segments-1000.png"))
                print(f"wrote {out / 'report-segments-1000.png'}")
            finally:
                browser.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "assets")
    ap.add_argument("--only", choices=("report", "explain-torch", "torch", "segments",
                                       "holders"),
                    default=None,
                    help="make only this screenshot")
    args = ap.parse_args(argv)
    if args.only == "report":
        return _report(args.out)
    if args.only == "explain-torch":
        return _explain_torch(args.out)

    code = _in_lab(args)
    if code != -1:
        return code
    if args.only == "segments":
        return _report_segments(args.out)
    return _report(args.out) or _explain_torch(args.out) or _report_segments(args.out)


def _in_lab(args: argparse.Namespace) -> int:
    """The screenshots taken in JupyterLab; -1 when the ones after it are to be made."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="gpudash-assets-") as tmp:
        lab = LabServer(Path(tmp))
        lab.start()
        pw = sync_playwright().start()
        browser = launch_chromium(pw)
        try:
            page = browser.new_context(viewport=VIEWPORT, device_scale_factor=1).new_page()
            if args.only == "torch":
                _torch_dashboard(page, lab, args.out)
                return 0
            if args.only == "holders":
                _holders(page, lab, args.out)
                return 0
            if args.only == "segments":
                _segments(page, lab, args.out)
                return -1   # then the report's map, once this browser is closed
            _run_all(page, lab, "01_quickstart.ipynb")
            root = page.locator(".gd-root").first
            _views_drawn(page, root)
            time.sleep(1.0)
            out = page.locator(".jp-OutputArea-output").filter(has=root).first
            _shot(page, out, args.out / "dashboard.png")

            n, _ = _run_cell(page, WORKLOAD)
            _views_drawn(page, root)
            time.sleep(6.0)
            _shot(page, out, args.out / "dashboard-load.png")
            _run_cell(page, "task.cancel(); print(task.result(timeout=60))")
            _wait_idle(page)

            command(page, "docmanager:save")
            time.sleep(1.0)
            page.reload()
            wait_for_notebook(page)
            page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
            root = page.locator(".gd-root").first
            root.wait_for(state="attached", timeout=60_000)
            _views_drawn(page, root)
            time.sleep(1.0)
            out = page.locator(".jp-OutputArea-output").filter(has=root).first
            _shot(page, out, args.out / "dashboard-reload.png")
            lab.shutdown_kernels()

            _run_all(page, lab, "02_tuning_fraction.ipynb")
            view = page.locator(".jp-OutputArea-output").filter(
                has=page.locator(".widget-hslider")).first
            view.wait_for(state="attached")
            page.wait_for_function("(e) => /minimum fraction/.test(e.innerText) && "
                                   "!/minimum fraction: …/.test(e.innerText)",
                                   arg=view.element_handle(), timeout=120_000)
            # below the smallest fraction that fits: the first out-of-memory is marked
            from bench_browser import _drag_float_slider
            _drag_float_slider(page, view.locator(".widget-hslider").first, 0.15, 0.05, 1.0)
            view.locator(".widget-html", has_text="out of memory at").first.wait_for(
                timeout=120_000)
            time.sleep(2.0)
            _shot(page, view, args.out / "whatif.png")
            lab.shutdown_kernels()

            import importlib.util

            if importlib.util.find_spec("tensorflow") is not None:
                _run_all(page, lab, "05_frameworks.ipynb")
                root = page.locator(".gd-root").first
                _views_drawn(page, root, 1)
                time.sleep(1.5)
                out = page.locator(".jp-OutputArea-output").filter(has=root).first
                _shot(page, out, args.out / "watch-tensorflow.png")
            else:
                print("tensorflow is not installed: no watch-tensorflow.png")
            lab.shutdown_kernels()
            _torch_dashboard(page, lab, args.out)
            lab.shutdown_kernels()
            _holders(page, lab, args.out)
            page.set_viewport_size(VIEWPORT)
            _segments(page, lab, args.out)
        finally:
            browser.close()
            pw.stop()
            lab.stop()
    return -1


if __name__ == "__main__":
    raise SystemExit(main())
