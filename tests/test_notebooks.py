"""First use: every notebook in ``notebooks/`` runs top to bottom in a real kernel and shows
what it says, every Python block of the README and of ``docs/*.md`` runs as written, and every
console block's commands print what the block shows.

The notebooks are executed with nbclient in a temporary copy of ``notebooks/`` (the repository's
notebooks stay without outputs, and nothing is written beside them), with
``GPUDASH_SIMULATE=1x16GiB`` so the kernel never looks for a GPU, and with a copy of this
checkout's ``gpudash`` package alone first on the kernel's path, as a wheel installs it (a
notebook that reads files beside the package fails). Each notebook runs once per test
session, as *Run All* runs it; then the code in :data:`AFTER_RUN_ALL` runs in the same kernel,
as a person would type it next (what is still live when *Run All* is done), and the tests
read the outputs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from nbclient.exceptions import CellExecutionError  # noqa: E402
from nbformat.v4 import new_code_cell  # noqa: E402

pytestmark = pytest.mark.slow  # a few minutes in all (each Dask example runs twice)

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
        self.after: dict[str, str] = {}  # AFTER_RUN_ALL's code -> what it showed

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


#: Run in a notebook's kernel when *Run All* is done (after its last cell), in order: code, or
#: ``("again", MARKER)`` to run the code cell with MARKER again. ``Executed.after[code]`` (or
#: ``[MARKER]``) is what it showed. A workload that runs in the background is still running
#: then (so the dashboard is live while it runs; a cell that waited for it would have held the
#: kernel, and the dashboard's messages, until it ended): it is stopped, and the cell that
#: shows its result is run again.
AFTER_RUN_ALL: dict[str, list[Any]] = {
    "01_quickstart.ipynb": [
        "print('running:', task.running)",
        "task.join(timeout=0.5); task.cancel(); print('ended:', task.join(timeout=120))",
        ("again", "if task.done:"),
    ],
    "03_fragmentation.ipynb": [
        "print('running:', task.running)",
        "task.join(timeout=0.5); task.cancel(); print('ended:', task.join(timeout=120))",
        ("again", "if task.done:"),
    ],
    "05_frameworks.ipynb": [
        "print('running:', task.running)",
        "print('ended:', task.join(timeout=600))",
        ("again", "if task.done:"),
    ],
    "07_pytorch.ipynb": [
        "print('running:', task.running)",
        "task.join(timeout=0.5); task.cancel(); print('ended:', task.join(timeout=120))",
        ("again", "if task.done:"),
    ],
    "04_cluster.ipynb": [
        "print('open:', dash.comm is not None, not dash.model.closed, client.status)",
        "dash.close(); model.close(); client.close(); cluster.close(); print('closed')",
    ],
}


def cell_text(cell: Any) -> str:
    parts = []
    last_stream = None
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            # one print may reach the notebook as several stream outputs (the kernel flushes
            # on a timer): consecutive ones of the same stream are one text
            if last_stream == out.name:
                parts[-1] += out.text
            else:
                parts.append(out.text)
            last_stream = out.name
            continue
        last_stream = None
        if out.output_type in ("execute_result", "display_data"):
            parts.append(str(out.get("data", {}).get("text/plain", "")))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
    return "\n".join(parts)


def test_cell_text_joins_one_print_split_across_stream_outputs():
    cell = new_code_cell("print('same as local:', True)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="same as local:"),
                    nbformat.v4.new_output("stream", name="stdout", text=" True\n"),
                    nbformat.v4.new_output("stream", name="stderr", text="warning\n"),
                    nbformat.v4.new_output("execute_result", data={"text/plain": "1"})]
    assert cell_text(cell) == "same as local: True\n\nwarning\n\n1"


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts
            and ".ipynb_checkpoints" not in p.parts}


#: The repository's ``notebooks/`` before any notebook ran (names and contents).
REPO_NOTEBOOKS = _digests(NOTEBOOK_DIR)


@pytest.fixture(scope="session")
def notebook_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway copy of ``notebooks/`` to run the notebooks in."""
    dest = tmp_path_factory.mktemp("nb") / "notebooks"
    shutil.copytree(NOTEBOOK_DIR, dest,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    return dest


@pytest.fixture(scope="session")
def installed_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a copy of this checkout's ``gpudash`` package and nothing else, as a
    wheel installs it: no ``tests/`` or ``notebooks/`` beside it."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(REPO / "gpudash", site / "gpudash",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _execute_after(client: Any, nb: Any, ex: Executed, name: str) -> None:
    """Run AFTER_RUN_ALL[name] in the notebook's kernel; the notebook's cells stay as run."""
    cells = list(nb.cells)
    try:
        for item in AFTER_RUN_ALL.get(name, []):
            if isinstance(item, tuple):
                key = item[1]
                source = next((c.source for c in cells
                               if c.cell_type == "code" and key in c.source), None)
                if source is None:
                    ex.after[key] = f"no code cell contains {key!r}"
                    continue
            else:
                key = source = item
            cell = new_code_cell(source)
            nb.cells.append(cell)
            try:
                client.execute_cell(cell, len(nb.cells) - 1)
            except CellExecutionError as exc:
                ex.after[key] = f"error: {exc}"
            else:
                ex.after[key] = cell_text(cell)
    finally:
        nb.cells = cells


@pytest.fixture(scope="session")
def run_notebook(notebook_copy: Path, installed_package: Path):
    """``run_notebook(name) -> Executed``, each notebook executed once per session, as *Run
    All* runs it, then AFTER_RUN_ALL[name]."""
    cache: dict[str, Executed] = {}
    env = dict(os.environ)
    env["GPUDASH_SIMULATE"] = "1x16GiB"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(installed_package), env.get("PYTHONPATH")) if p)
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
            with client.setup_kernel(env=env, cwd=str(notebook_copy)):
                try:
                    for index, cell in enumerate(nb.cells):
                        client.execute_cell(cell, index)
                except CellExecutionError as exc:
                    error = exc
                seconds = time.perf_counter() - t0
                ex = cache[name] = Executed(nb, error, seconds)
                if error is None:
                    _execute_after(client, nb, ex, name)
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

    # the loop, stopped when Run All was done (AFTER_RUN_ALL), then its result cell again
    run_text = ex.after["if task.done:"]
    m = re.search(r"WorkloadRun\(allocs=(\d+), frees=(\d+), ooms=(\d+)", run_text)
    assert m, run_text
    assert int(m.group(1)) > 0 and int(m.group(3)) == 0, run_text
    assert "AllocatorStats(num_allocs=" in run_text, run_text  # sess.stats(0)


def test_quickstart_prints_a_memory_log_a_person_reads(run_notebook):
    """TensorFlow's memory log, not 2,000 characters of empty bins cut mid-line: the bins that
    hold chunks, the chunks, the summary and the statistics, each line whole."""
    ex = run_notebook("01_quickstart.ipynb")
    text = ex.text("dump_memory_log")
    lines = text.splitlines()
    assert lines[0] == "BFCAllocator dump for GPU_0_bfc", lines[:3]
    assert "Total Chunks: 0," not in text, text[:500]
    assert len(lines) <= 41, text
    # the %%gpudash_track cell left 8 blocks of 8 MiB in use, 8 freed between them
    assert ("Bin (8388608): \tTotal Chunks: 16, Chunks in use: 8. 128.00MiB allocated for "
            "chunks. 64.00MiB in use in bin. 64.00MiB client-requested in use in bin.") in lines
    assert "Sum Total of in-use chunks: 64.00MiB" in lines, text
    assert re.search(r"^InUse: +67108864$", text, re.M), text
    assert lines[-1].startswith("LargestFreeBlock:"), lines[-3:]


@pytest.mark.parametrize("name", ["01_quickstart.ipynb", "03_fragmentation.ipynb",
                                  "05_frameworks.ipynb", "07_pytorch.ipynb"])
def test_the_workload_is_live_when_run_all_is_done(run_notebook, name):
    """Under Run All no cell waits for the background workload, so the dashboard draws and
    answers while it runs (a cell that waited would hold the kernel until the workload ended:
    no widget message is handled meanwhile). The result cell says so, then shows the result."""
    _skip_without_requirement(name)
    ex = run_notebook(name)
    assert ex.error is None, ex.error_summary()
    assert ex.after["print('running:', task.running)"].strip() == "running: True", ex.after
    assert "still running; run this cell again when it is done" in ex.text("if task.done:")
    assert [ln for ln in ex.after["if task.done:"].splitlines() if ln.strip()], ex.after
    assert "still running" not in ex.after["if task.done:"], ex.after
    # the workload shows its status (and Cancel) in the notebook
    start = ex.cell("run_in_background(")
    assert any(WIDGET_VIEW in o.get("data", {}) for o in start.outputs), cell_text(start)


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
    done = ex.after["if task.done:"]  # the workload stopped when Run All was done
    m = re.search(r"WorkloadRun\(allocs=(\d+)", done)
    assert m and int(m.group(1)) > 0, done


def test_frameworks_notebook_watches_tensorflow_live(run_notebook):
    _skip_without_requirement("05_frameworks.ipynb")
    ex = run_notebook("05_frameworks.ipynb")
    jax_text = ex.text("Session.from_env")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 XLA_PYTHON_CLIENT_PREALLOCATE=false" in jax_text
    dash = ex.cell("mon.dashboard()")
    assert any(WIDGET_VIEW in o.get("data", {}) for o in dash.outputs), cell_text(dash)
    text = ex.after["if task.done:"]  # once the training ended
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

    # Run All leaves the dashboard open and drawing (closing it is the reader's choice)
    assert ex.after["print('open:', dash.comm is not None, not dash.model.closed, "
                    "client.status)"].split() == ["open:", "True", "True", "running"], ex.after
    assert "closed" in ex.after["dash.close(); model.close(); client.close(); cluster.close(); "
                                "print('closed')"], ex.after


def test_pytorch_notebook_replays_explains_and_answers_in_pytorchs_words(run_notebook):
    ex = run_notebook("07_pytorch.ipynb")
    exact = ex.text("r = replay(oom)")
    assert "segment events 303/303, addresses 6123/6123, OOMs 1/1, final layout equal" in exact
    assert "device 24.00 GiB: from the oom entry" in exact
    explained = ex.text("e = gpudash.explain(")
    assert "fits with         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in explained
    answer = ex.text("default = min_fraction(")
    assert "defaults: MinFractionResult(no fit" in answer, answer
    m = re.search(r"expandable segments: MinFractionResult\(fraction=([0-9.]+)", answer)
    assert m and 0.9 < float(m.group(1)) < 1.0, answer
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in answer
    assert "torch.cuda.set_per_process_memory_fraction(" in answer
    table = ex.text("table = sweep(")
    assert table.split()[:3] == ["fraction", "expandable", "max_split_size_mb"], table
    assert "FAILS" in table and "pytorch/pytorch#123548" in table
    jax = ex.text("allocator='bfc'")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=" in jax and "set_per_process" not in jax
    # the live dashboard on a PyTorch session, and the job's figures in PyTorch's keys
    dash = ex.cell("%gpudash --allocator torch")
    assert any(WIDGET_VIEW in o.get("data", {}) for o in dash.outputs), cell_text(dash)
    done = ex.after["if task.done:"]
    assert "TorchSession(1 simulated device(s)" in done, done
    assert "'reserved_bytes.all.peak':" in done and "WorkloadRun(allocs=" in done, done


def test_who_holds_it_notebook_finds_the_lines_the_leak_and_the_holders_at_an_oom(run_notebook):
    """Notebook 08 on PyTorch's real profile: the peak by the script's lines, the validation
    pass's activations kept step after step, and who held the memory when a replay on a
    smaller GPU failed."""
    ex = run_notebook("08_who_holds_it.ipynb")
    first = ex.text("trace = load_trace(PROFILE)")
    assert "peak allocated: 8,479,928 bytes" in first, first
    by_line = ex.text("print(gpudash.top_holders(trace))")
    rows = [line.split()[-2:] for line in by_line.splitlines()[1:4]]
    assert rows == [["record_torch_profile.py:38", "train_step"],
                    ["record_torch_profile.py:32", "forward"],
                    ["record_torch_profile.py:46", "validate"]], by_line
    assert "user code: default" in by_line
    cats = ex.text("by='category'")
    assert "optimizer state" in cats and "activations" in cats, cats
    kept = ex.text("leaks(trace")
    first_row = kept.splitlines()[1]
    assert "validate" in first_row and "in 3 of 4 iterations" in first_row, kept
    assert "+1.50 MiB" in first_row, kept
    oom = ex.text("r = replay(snap")
    assert "OOMs (first at call" in oom and "at the out-of-memory error" in oom, oom
    assert "record_torch_profile.py:38 train_step" in oom, oom
    merged = ex.text("write_chrome_trace(")
    assert re.search(r"merged\.json\.gz: [\d,]+ bytes", merged), merged


def test_live_pytorch_notebook_follows_the_job_predicts_the_failure_and_explains_the_oom(
        run_notebook):
    ex = run_notebook("09_live_pytorch.ipynb")
    assert "the stand-in gpudash.testing.ModelTorch (no GPU here)" in ex.text("cuda = False")
    outputs = ex.cell("dash = shadow.dashboard()").get("outputs", [])
    assert any(WIDGET_VIEW in o.get("data", {}) for o in outputs)
    assert re.search(r"addresses (\d+)/\1", ex.text("print(shadow.devices[0].summary())"))
    what_if = ex.text("wi = shadow.what_if(fraction=0.2)")
    assert re.search(r"at fraction 0.2 this run would have failed at call [\d,]+ \(step \d+",
                     what_if) and " train:" in what_if
    assert "as predicted" in ex.text("again = ModelTorch(")
    preview = ex.text("print(shadow.preview(")
    assert preview.startswith("what-if, not applied: cuda:0: at fraction 0.2 this run would "
                              "have failed at call") and " train:" in preview
    answer = ex.text("print(shadow.configure(fraction=0.2))")
    assert "torch.cuda.set_per_process_memory_fraction(0.2, 0)" in answer
    assert "reserved" in answer and "would have failed at call" in answer
    oom = ex.text("job = threading.Thread(target=more)")
    assert "the job: OutOfMemoryError" in oom and "PyTorch ran out of memory at" in oom
    assert "would have served it" in oom
    assert "torch.cuda.empty_cache(): reserved" in ex.text("shadow.empty_cache()")


def test_running_the_notebooks_leaves_nothing_behind(run_notebook, notebook_copy):
    """Notebooks write what they make to a temporary folder, not beside themselves (where a
    clone would show it as an untracked file), and the repository's notebooks are never
    executed in place (they stay as the generator wrote them)."""
    ran = []
    for name in NOTEBOOKS:
        need = REQUIRES.get(name)
        if need and importlib.util.find_spec(need) is None:
            continue
        assert run_notebook(name).error is None, name
        ran.append(name)
    assert "02_tuning_fraction.ipynb" in ran
    left = sorted(set(_digests(notebook_copy)) - set(REPO_NOTEBOOKS))
    assert left == [], f"running {', '.join(ran)} left {left} beside the notebooks"
    assert _digests(NOTEBOOK_DIR) == REPO_NOTEBOOKS, "a notebook in notebooks/ was changed"


def test_the_stored_notebooks_are_what_the_generator_writes(tmp_path):
    """``make_notebooks.py`` is the notebooks' source: run on a copy, it writes them byte for
    byte (cell ids come from the cells' text, so an unchanged notebook stays unchanged)."""
    shutil.copy(NOTEBOOK_DIR / "make_notebooks.py", tmp_path)
    proc = subprocess.run([sys.executable, str(tmp_path / "make_notebooks.py")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in NOTEBOOKS:
        assert (tmp_path / name).read_bytes() == (NOTEBOOK_DIR / name).read_bytes(), \
            f"{name} differs from what make_notebooks.py writes; regenerate it"


# ------------------------------------------------------------------------------ packaging
def test_the_samples_carry_the_real_files_the_postmortem_notebook_reads():
    """Notebooks 06 and 08 read TensorFlow's and PyTorch's files through ``gpudash.samples``
    (package data, so a wheel has them): the same bytes as ``tests/data/real/``, whose README
    says how they were made."""
    import gpudash
    from gpudash import samples

    real = REPO / "tests" / "data" / "real"
    for name in samples.TENSORFLOW_FILES + samples.TORCH_FILES:
        assert name in samples.files()
        assert samples.path(name).read_bytes() == (real / name).read_bytes(), name
    with pytest.raises(gpudash.ConfigError, match="no sample file 'nope.log'"):
        samples.path("nope.log")


# ----------------------------------------------------------------------- README and docs/
README = REPO / "README.md"
DOCS = REPO / "docs"
#: Words that mark a block as needing a CUDA GPU (skipped without one). Comments do not count:
#: ``# torch.cuda.set_per_process_memory_fraction`` in a comment needs no GPU.
GPU_WORDS = ("import cupy", "CudaMemory(", "LocalCUDACluster(", "torch.cuda", 'watch("torch")')
#: The line before a ```console block that makes it run after the ```python block above it,
#: in the same folder (the commands read what that block wrote).
AFTER_BLOCK_ABOVE = "<!-- runs after the python block above -->"


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _fenced_blocks(path: Path, lang: str) -> list[tuple[int, str, int]]:
    """Every ```LANG block of a Markdown file: (line of the fence, code, offset of the fence)."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1), m.start())
            for m in re.finditer(rf"^```{lang}\n(.*?)^```", text, re.DOTALL | re.MULTILINE)]


def python_blocks(path: Path) -> list[Any]:
    """Every ```python block of ``path``, as a parameter whose id is ``FILE:LINE``."""
    return [pytest.param(code, id=f"{_rel(path)}:{line}")
            for line, code, _ in _fenced_blocks(path, "python")]


def readme_python_blocks() -> list[Any]:
    """Every ```python block of the README, with the line it starts on."""
    return python_blocks(README)


def docs_python_blocks() -> list[Any]:
    """Every ```python block of ``docs/*.md``, ids like ``docs/sessions.md:42``."""
    return [b for page in sorted(DOCS.glob("*.md")) for b in python_blocks(page)]


def code_without_comments(code: str) -> str:
    """``code`` with its comments cut off (a ``#`` inside a string stays)."""
    import io
    import tokenize

    lines = code.splitlines()
    try:
        comments = [tok.start for tok in tokenize.generate_tokens(io.StringIO(code).readline)
                    if tok.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        return "\n".join(line.split("#", 1)[0] for line in lines)
    for row, col in comments:
        lines[row - 1] = lines[row - 1][:col]
    return "\n".join(lines)


def needs_gpu(code: str) -> bool:
    """Whether a block's code (not its comments) uses a CUDA GPU."""
    bare = code_without_comments(code)
    return any(word in bare for word in GPU_WORDS)


def _block_env(code: str) -> dict[str, str]:
    """The environment a block runs in: this checkout first on the path, and a simulated
    device unless the block needs a GPU (skipped when there is none)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if "dask" in code:
        pytest.importorskip("distributed")
    if 'watch("torch")' in code_without_comments(code):
        pytest.importorskip("torch")
    if needs_gpu(code):
        from gpudash.devices import CudaMemory

        ok, reason = CudaMemory.available()
        if not ok:
            pytest.skip(f"the block needs a CUDA GPU: {reason}")
    else:
        env["GPUDASH_SIMULATE"] = "1x16GiB"
    return env


def _run_python_block(code: str, folder: Path, env: dict[str, str], attempt: str) -> None:
    script = folder / "doc_block.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run([sys.executable, script.name], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, \
        f"the {attempt} run failed:\n{code}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def _runs_alone_as_a_script(code: str, tmp_path: Path) -> None:
    """Each block runs as written, in a fresh process, as a script (Dask's worker processes
    import a script again), twice in the same folder (what it writes the first time does not
    stop the second), on a simulated device unless it needs a GPU."""
    env = _block_env(code)
    for attempt in ("first", "second"):
        _run_python_block(code, tmp_path, env, attempt)


def test_the_readme_has_python_blocks():
    assert len(readme_python_blocks()) >= 4


def test_the_docs_have_python_blocks():
    ids = {p.id.split(":")[0] for p in docs_python_blocks()}
    assert {"docs/allocators.md", "docs/sessions.md", "docs/traces.md",
            "docs/frameworks.md", "docs/dask.md"} <= ids, ids


def test_a_gpu_word_in_a_comment_does_not_make_a_block_need_a_gpu():
    assert not needs_gpu("x = 1  # torch.cuda.set_per_process_memory_fraction(0.5)\n")
    assert not needs_gpu("# import cupy\nprint('#')\n")
    assert needs_gpu("import cupy\n")
    assert needs_gpu("print(1); torch.cuda.memory_stats()  # a GPU\n")
    assert needs_gpu('mon = gpudash.watch("torch")\n')


@pytest.mark.parametrize("code", readme_python_blocks())
def test_a_readme_python_block_runs_alone_as_a_script(code, tmp_path):
    """Each ```python block of the README, as :func:`_runs_alone_as_a_script` says."""
    _runs_alone_as_a_script(code, tmp_path)


@pytest.mark.parametrize("code", docs_python_blocks())
def test_a_docs_python_block_runs_alone_as_a_script(code, tmp_path):
    """Each ```python block of ``docs/*.md``, as :func:`_runs_alone_as_a_script` says."""
    _runs_alone_as_a_script(code, tmp_path)


# ----------------------------------------------------------------- ```console blocks, run
def console_blocks(path: Path) -> list[Any]:
    """Every ```console block of ``path`` as a parameter ``(setup, commands)``, id
    ``FILE:LINE``. ``commands`` is a list of ``(argv, expected lines)``: a line ``$ gpudash
    ...`` is a command, the lines below it (to the next ``$``) what it prints. ``setup`` is the
    ```python block above, when the line before the fence is :data:`AFTER_BLOCK_ABOVE`."""
    import shlex

    text = path.read_text(encoding="utf-8")
    pythons = _fenced_blocks(path, "python")
    params = []
    for line, body, offset in _fenced_blocks(path, "console"):
        before = text[:offset].rstrip("\n").rsplit("\n", 1)[-1].strip()
        setup = None
        if before == AFTER_BLOCK_ABOVE:
            above = [code for _, code, off in pythons if off < offset]
            assert above, f"{_rel(path)}:{line}: no python block above it"
            setup = above[-1]
        commands: list[tuple[list[str], list[str]]] = []
        for row in body.splitlines():
            if row.startswith("$ "):
                argv = shlex.split(row[2:], comments=True)
                assert argv[:1] == ["gpudash"], \
                    f"{_rel(path)}:{line}: a console block runs gpudash only: {row}"
                commands.append(([sys.executable, "-m", "gpudash", *argv[1:]], []))
            else:
                assert commands, f"{_rel(path)}:{line}: output before any command: {row}"
                commands[-1][1].append(row)
        params.append(pytest.param(setup, commands, id=f"{_rel(path)}:{line}"))
    return params


def _squash(line: str) -> str:
    return " ".join(line.split())


def output_matches(expected: list[str], output: str) -> str | None:
    """None when every expected line appears in ``output``, in order (lines in between may be
    left out); else the first line that does not. Runs of spaces count as one; ``...`` in an
    expected line stands for any text there, the spaces around it included (at its end: a
    prefix); a line that is only ``...`` stands for lines left out."""
    lines = [_squash(line) for line in output.splitlines()]
    pos = 0
    for want in expected:
        want = _squash(want)
        if want in ("", "..."):
            continue
        pattern = re.compile(".*".join(re.escape(part.strip()) for part in want.split("...")))
        while pos < len(lines) and not pattern.fullmatch(lines[pos]):
            pos += 1
        if pos == len(lines):
            return want
        pos += 1
    return None


def test_output_matching_takes_lines_in_order_and_can_fail():
    out = "head line\n  request   3.00 MiB (3,145,728 B), by op Empty\nother\nlast  line\n"
    assert output_matches(["request 3.00 MiB (3,145,728 B), by op Empty", "last line"],
                          out) is None
    assert output_matches(["head ...", "...", "last line"], out) is None
    assert output_matches(["request 3.00 MiB (...), by op Empty"], out) is None
    assert output_matches(["request 3.00 MiB (...), by op Full"], out) is not None
    assert output_matches(["last line", "head line"], out) == "head line"  # order counts
    assert output_matches(["request 4.00 MiB ..."], out) == "request 4.00 MiB ..."
    assert output_matches(["head"], out) == "head"  # whole lines unless '...'


def _doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def all_console_blocks() -> list[Any]:
    return [b for path in _doc_files() for b in console_blocks(path)]


def _checkout_view(folder: Path) -> None:
    """``folder`` made to look like the checkout (each top-level entry linked), so that a
    command reads ``gpudash/samples/...`` and writes its files in ``folder``."""
    for entry in REPO.iterdir():
        if entry.name not in (".git",) and not (folder / entry.name).exists():
            (folder / entry.name).symlink_to(entry)


def test_the_readme_has_console_blocks_that_run_after_a_python_block():
    blocks = console_blocks(README)
    assert blocks and any(b.values[0] is not None for b in blocks)


@pytest.mark.parametrize("setup, commands", all_console_blocks())
def test_a_console_block_prints_what_it_shows(setup, commands, tmp_path):
    """Each ```console block's commands run in a copy of the checkout's view (after the python
    block above, when it says so), exit 0 and print the lines the block shows."""
    env = _block_env(setup or "")
    _checkout_view(tmp_path)
    if setup is not None:
        _run_python_block(setup, tmp_path, env, "setup")
    for argv, expected in commands:
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        shown = " ".join(argv[2:])
        assert proc.returncode == 0, f"{shown} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        missing = output_matches(expected, proc.stdout + "\n" + proc.stderr)
        assert missing is None, \
            f"{shown} did not print {missing!r}; it printed:\n{proc.stdout[-4000:]}"
