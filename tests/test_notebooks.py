"""Every notebook in ``notebooks/`` runs top to bottom in a real kernel and shows what it says.

The notebooks are executed with nbclient in a temporary copy of ``notebooks/`` (the repository's
notebooks stay without outputs), with ``GPUDASH_SIMULATE=1x16GiB`` so the kernel never looks
for a GPU, and with this checkout's ``gpudash`` first on the kernel's path. Each notebook runs
once per test session; the tests then read its outputs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from nbclient.exceptions import CellExecutionError  # noqa: E402

pytestmark = pytest.mark.slow  # about 25 s in all (the quick start runs a 13 s workload)

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
GIB = 1 << 30


class Executed:
    """One executed notebook: the notebook with its outputs, the error (if a cell raised)
    and the run time."""

    def __init__(self, nb: Any, error: BaseException | None, seconds: float) -> None:
        self.nb = nb
        self.error = error
        self.seconds = seconds

    def code_cells(self) -> list[Any]:
        return [c for c in self.nb.cells if c.cell_type == "code"]

    def cell(self, marker: str) -> Any:
        """The first code cell whose source contains ``marker``; fails (naming the error
        that stopped the notebook, if any) when it has not run."""
        for c in self.code_cells():
            if marker in c.source:
                if c.get("execution_count") is None:
                    pytest.fail(f"the cell with {marker!r} did not run; "
                                f"the notebook stopped at: {self.error_summary()}")
                return c
        pytest.fail(f"no code cell contains {marker!r}; was the notebook changed?")

    def text(self, marker: str) -> str:
        """Everything the cell with ``marker`` showed as text: streams and text/plain."""
        return cell_text(self.cell(marker))

    def error_summary(self) -> str:
        if self.error is None:
            return "no error"
        text = str(self.error)
        # nbclient puts the traceback (with ANSI colours) first and the error line last.
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)
        return text[-3000:]


def cell_text(cell: Any) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(str(out.get("data", {}).get("text/plain", "")))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
    return "\n".join(parts)


@pytest.fixture(scope="session")
def notebook_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway copy of ``notebooks/`` to run the notebooks in."""
    dest = tmp_path_factory.mktemp("nb") / "notebooks"
    shutil.copytree(NOTEBOOK_DIR, dest,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    return dest


@pytest.fixture(scope="session")
def run_notebook(notebook_copy: Path):
    """``run_notebook(name) -> Executed``, each notebook executed once per session."""
    cache: dict[str, Executed] = {}
    env = dict(os.environ)
    env["GPUDASH_SIMULATE"] = "1x16GiB"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"

    def run(name: str) -> Executed:
        if name not in cache:
            path = notebook_copy / name
            nb = nbformat.read(path, as_version=4)
            client = nbclient.NotebookClient(
                nb, timeout=600, kernel_name="python3",
                resources={"metadata": {"path": str(notebook_copy)}})
            error = None
            t0 = time.perf_counter()
            try:
                client.execute(env=env, cwd=str(notebook_copy))
            except CellExecutionError as exc:
                error = exc
            cache[name] = Executed(nb, error, time.perf_counter() - t0)
        return cache[name]

    return run


def test_there_are_notebooks():
    assert {"01_quickstart.ipynb", "02_tuning_fraction.ipynb",
            "03_fragmentation.ipynb"} <= set(NOTEBOOKS)


def test_repository_notebooks_are_stored_without_outputs():
    for name in NOTEBOOKS:
        nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
        for c in nb.cells:
            if c.cell_type == "code":
                assert not c.outputs and c.execution_count is None, \
                    f"{name} is stored with outputs; regenerate it (make_notebooks.py)"


#: Notebooks that need an optional package (skipped, saying so, without it).
REQUIRES = {"04_cluster.ipynb": "distributed", "05_frameworks.ipynb": "tensorflow"}


def _skip_without_requirement(name: str) -> None:
    need = REQUIRES.get(name)
    if need and importlib.util.find_spec(need) is None:
        pytest.skip(f"{name} needs {need} (pip install -e '.[tf]' for tensorflow-cpu)")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(run_notebook, name):
    _skip_without_requirement(name)
    ex = run_notebook(name)
    assert ex.error is None, f"{name} raised:\n{ex.error_summary()}"
    cells = ex.code_cells()
    assert cells and all(c.execution_count is not None for c in cells)
    for i, c in enumerate(cells):
        for out in c.outputs:
            assert out.output_type != "error", \
                f"{name} code cell {i} errored: {out.ename}: {out.evalue}"
            # A traceback on stderr is an exception in a background thread (the model's
            # refresher, a workload): the cell "worked" but something broke.
            if out.output_type == "stream" and out.name == "stderr":
                assert "Traceback" not in out.text, \
                    f"{name} code cell {i} printed a traceback:\n{out.text[-3000:]}"


def test_quickstart_shows_the_session_dashboard_and_settings(run_notebook):
    ex = run_notebook("01_quickstart.ipynb")

    dash = ex.cell("%gpudash --fraction")
    views = [o for o in dash.outputs
             if o.output_type in ("execute_result", "display_data") and WIDGET_VIEW in o.data]
    assert views, f"%gpudash showed no widget: {cell_text(dash)!r}"
    model_id = views[0].data[WIDGET_VIEW].get("model_id")
    assert model_id and isinstance(model_id, str)
    assert "Dashboard" in views[0].data.get("text/plain", "")

    dev_text = ex.text("dev = sess.devices[0]")
    assert "GPU_0_bfc" in dev_text, dev_text
    assert "simulated" in dev_text and "total=16.00 GiB" in dev_text, dev_text
    assert "limit=8.00 GiB" in dev_text, dev_text  # --fraction 0.5 of 16 GiB

    run_text = ex.text("task.result(")
    m = re.search(r"WorkloadRun\(allocs=(\d+), frees=(\d+), ooms=(\d+)", run_text)
    assert m, run_text
    assert int(m.group(1)) > 0 and int(m.group(3)) == 0, run_text

    config_text = ex.text("%gpudash_config fraction=0.3")
    assert "limit 4.80 GiB" in config_text, config_text  # 0.3 x 16 GiB
    assert "GPU:0" in config_text, config_text

    limit_text = ex.text("dev.memory_limit:,")
    m = re.search(r"limit ([\d,]+) bytes", limit_text)
    assert m, limit_text
    assert int(m.group(1).replace(",", "")) == int(0.3 * 16 * GIB), limit_text

    track_text = ex.text("%%gpudash_track")
    assert "gpudash_track" in track_text and "allocation(s)" in track_text, track_text
    # 16 x 8 MiB, half freed and flushed: 8 blocks stay, each a chunk of at least 8 MiB
    # (BFC hands out a whole free chunk when splitting would waste less than it keeps)
    m = re.search(r"in use \+([\d.]+) MiB", track_text)
    assert m and 64 <= float(m.group(1)) < 128, track_text

    log_text = ex.text("dump_memory_log")
    assert "GPU_0_bfc" in log_text and "Bin (" in log_text, log_text[:500]


def test_quickstart_track_counts_only_the_cells_allocations(run_notebook):
    """The ``%%gpudash_track`` cell allocates 16 blocks: its summary must count 16, not
    events of earlier cells (the background workload) that reach the recorder late."""
    ex = run_notebook("01_quickstart.ipynb")
    track_text = ex.text("%%gpudash_track")
    m = re.search(r"(\d+) allocation\(s\)", track_text)
    assert m, track_text
    assert int(m.group(1)) == 16, track_text


def test_tuning_fraction_finds_the_smallest_fraction_and_sweeps(run_notebook):
    ex = run_notebook("02_tuning_fraction.ipynb")

    trace_text = ex.text("load_trace(")
    assert "Trace(" in trace_text, trace_text

    best_text = ex.text("min_fraction(")
    m = re.search(r"smallest fraction: ([0-9.]+) \(([\d,]+) bytes\)", best_text)
    assert m, best_text
    fraction, limit = float(m.group(1)), int(m.group(2).replace(",", ""))
    assert 0.0 < fraction <= 1.0, best_text
    assert abs(limit - fraction * 16 * GIB) <= 0.005 * 16 * GIB, best_text

    table = ex.text("sweep(")
    lines = [ln for ln in table.splitlines() if ln.strip()]
    header = lines[0].split()
    assert header[:2] == ["fraction", "growth"] and "fits" in header, table
    rows = [ln.split() for ln in lines if re.match(r"\s*0\.\d+\s+(yes|no)\b", ln)]
    # 5 fractions x growth on/off
    assert len(rows) == 10, table
    assert sorted({float(r[0]) for r in rows}) == [0.02, 0.05, 0.1, 0.2, 0.5], table
    fits_col = header.index("fits")
    # "limit" is a value and a unit ("327.68 MiB"), so every later column shifts by one.
    fits = {(float(r[0]), r[1]): r[fits_col + 1] for r in rows}
    assert set(fits.values()) <= {"yes", "NO"}, table
    # With growth, the smallest fraction that fits is consistent with min_fraction.
    for (f, growth), ok in fits.items():
        if growth == "yes":
            assert (ok == "yes") == (f >= fraction - 1e-9), (f, ok, best_text, table)

    view = ex.cell("WhatIfView(")
    assert any(o.output_type in ("execute_result", "display_data") and WIDGET_VIEW in o.data
               for o in view.outputs), cell_text(view)


def test_fragmentation_stress_is_worse_than_training(run_notebook):
    ex = run_notebook("03_fragmentation.ipynb")

    text = ex.text("worst_fragmentation")
    m = re.search(r"stress ([0-9.]+)%, training ([0-9.]+)%", text)
    assert m, text
    stress, training = float(m.group(1)), float(m.group(2))
    assert 0.0 <= training < stress <= 100.0, text

    for marker in ("heatmap_figure(", "chunkmap_figure(", "bins_figure("):
        cell = ex.cell(marker)
        assert any("application/vnd.plotly.v1+json" in o.get("data", {})
                   for o in cell.outputs), f"{marker} showed no plotly figure"

    dash = ex.cell("Dashboard(sess")
    assert any(WIDGET_VIEW in o.get("data", {}) for o in dash.outputs), cell_text(dash)
    done = ex.text("print(task.result(")
    assert re.search(r"WorkloadRun\(allocs=\d+", done), done


def test_frameworks_notebook_watches_tensorflow_live(run_notebook):
    _skip_without_requirement("05_frameworks.ipynb")
    ex = run_notebook("05_frameworks.ipynb")
    jax_text = ex.text("Session.from_env")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 XLA_PYTHON_CLIENT_PREALLOCATE=false" in jax_text
    dash = ex.cell("mon.dashboard()")
    assert any(WIDGET_VIEW in o.get("data", {}) for o in dash.outputs), cell_text(dash)
    text = ex.text("task.result(")
    m = re.search(r"peak in use ([\d,]+) bytes over (\d+) samples", text)
    assert m, text
    # the MLP's weights alone are ~6 MB: TensorFlow's own peak, polled while it trained
    assert int(m.group(1).replace(",", "")) > 4_000_000 and int(m.group(2)) >= 3, text
    lines = ex.text("restart_lines(")
    assert "config.gpu_options.per_process_gpu_memory_fraction = 0.5" in lines, lines


def test_cluster_notebook_streams_configures_traces_and_sweeps(run_notebook):
    pytest.importorskip("distributed")
    ex = run_notebook("04_cluster.ipynb")
    workers = re.findall(r"tcp://[\d.]+:\d+", ex.text("LocalCluster("))
    assert len(workers) == 2, ex.text("LocalCluster(")

    rows = ex.text("model.workers.items()")
    for w in workers:
        m = re.search(re.escape(w) + r": in use ([\d,]+) / pool ([\d,]+) / limit ([\d,]+), "
                      r"peak ([\d,]+), (\d+) events, (\d+) OOMs, live", rows)
        assert m, rows
        in_use, pool, limit, peak, events, ooms = (int(g.replace(",", "")) for g in m.groups())
        assert 0 < in_use <= peak <= pool <= limit and events > 0 and ooms == 0, rows

    dash = ex.cell("ClusterDashboard(client)")
    assert any(WIDGET_VIEW in o.get("data", {}) for o in dash.outputs), cell_text(dash)

    limits = ex.text("per_process_gpu_memory_fraction=0.5")
    assert limits.count("limit 8,589,934,592 bytes") == 2, limits  # 0.5 x 16 GiB each
    refused = ex.text("per_process_gpu_memory_fraction=1.5")
    assert refused.startswith("refused:") and all(w in refused for w in workers), refused

    traced = ex.text("collect_traces(")
    found = re.findall(r"^\d+ (tcp://\S+) (\d+) events", traced, re.M)
    assert sorted(w for w, _ in found) == sorted(workers), traced
    assert all(int(n) > 0 for _, n in found), traced
    table = ex.text("sweep(trace, client=client")
    assert "same as local: True" in table, table
    assert len([ln for ln in table.splitlines() if re.match(r"\s*0\.\d+\s+(yes|no)\b", ln)]) \
        == 8, table
