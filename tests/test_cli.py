"""The ``gpudash`` command: every subcommand, its exit codes and its one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpudash.cli import main
from gpudash.trace import load_trace, write_trace
from gpudash.workloads import training_loop

DATA = Path(__file__).parent / "data"


@pytest.fixture()
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "train.gdtrace"
    write_trace(training_loop(steps=2, layers=3, batch=8, hidden=256), path)
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_every_command(capsys):
    code, out, _ = run(capsys)
    assert code == 0
    for cmd in ("demo", "replay", "whatif", "info", "convert", "lab"):
        assert cmd in out


@pytest.mark.parametrize("cmd", ["demo", "replay", "whatif", "info", "convert", "lab"])
def test_every_subcommand_has_help(cmd):
    proc = subprocess.run([sys.executable, "-m", "gpudash", cmd, "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "usage: gpudash " + cmd in proc.stdout


@pytest.mark.core
def test_demo_prints_the_memory_log_and_writes_the_report(tmp_path, capsys):
    out_html = tmp_path / "demo.html"
    code, out, err = run(capsys, "demo", "--steps", "2", "--html", str(out_html))
    assert code == 0, err
    assert "BFCAllocator dump for GPU_0_bfc" in out
    assert "Sum Total of in-use chunks:" in out
    assert "Limit:" in out and "MaxInUse:" in out
    text = out_html.read_text()
    for plot in ("timeline", "heatmap", "bins", "chunkmap"):
        assert f'data-plot="{plot}"' in text
    assert "What if" in text
    # offline: plotly.js is inline; no script is loaded from elsewhere
    assert re.search(r"<script[^>]*\bsrc=", text) is None
    assert "plotly" in text.lower() and len(text) > 1_000_000  # the library itself is in


def test_demo_refuses_to_overwrite_without_being_asked(tmp_path, capsys):
    out_html = tmp_path / "demo.html"
    out_html.write_text("keep me")
    code, _, err = run(capsys, "demo", "--steps", "1", "--html", str(out_html))
    assert code == 1
    assert "exists" in err and "--overwrite" in err
    assert out_html.read_text() == "keep me"
    assert len(err.strip().splitlines()) == 1


@pytest.mark.core
def test_replay_reports_fit_and_oom(small_trace, capsys):
    code, out, _ = run(capsys, "replay", str(small_trace), "--device", "16GiB", "--fraction", "0.5")
    assert code == 0
    assert "fits" in out
    code, out, _ = run(capsys, "replay", str(small_trace), "--device", "16GiB",
                       "--fraction", "0.00001", "--no-growth")
    assert code == 3  # replay's documented code for "ran out of memory", for CI
    assert "OUT OF MEMORY" in out


@pytest.mark.core
def test_replay_defaults_are_tensorflows(small_trace, tmp_path, capsys):
    """No --growth: the trace's recorded setting, else TensorFlow's default (off: the whole
    limit is one region). --deferred reads as deferred_deletion_bytes does (0 = 8 MiB);
    without it frees apply at once, as recorded."""
    code, out, _ = run(capsys, "replay", str(small_trace), "--device", "1GiB",
                       "--fraction", "0.5")
    assert code == 0
    assert "allow_growth=False" in out and "deferred deletion" not in out
    assert re.search(r"peak pool 512\.00 MiB, 1 region\(s\)", out), out
    code, out, _ = run(capsys, "replay", str(small_trace), "--device", "1GiB",
                       "--fraction", "0.5", "--growth", "--deferred", "0")
    assert code == 0
    assert "allow_growth=True, deferred deletion 8.00 MiB" in out
    assert "peak pool 512.00 MiB" not in out
    # a trace that says it was recorded with growth on replays with growth on
    trace = load_trace(small_trace)
    trace.meta["devices"] = [{"index": 0, "options": {"allow_growth": True}}]
    grown = tmp_path / "grown.gdtrace"
    write_trace(trace, grown)
    code, out, _ = run(capsys, "replay", str(grown), "--device", "1GiB", "--fraction", "0.5")
    assert code == 0 and "allow_growth=True" in out
    code, out, _ = run(capsys, "whatif", str(grown), "--device", "1GiB", "--no-growth",
                       "--fractions", "0.5", "--jobs", "1")
    assert code == 0 and "allow_growth=False" in out


@pytest.mark.core
def test_replay_imports_a_tensorflow_log(capsys):
    code, out, _ = run(capsys, "replay", str(DATA / "fragment_202.log"), "--fraction", "0.5")
    assert code == 0, out
    assert "calls replayed" in out


@pytest.mark.core
def test_whatif_prints_the_smallest_fraction_and_a_sweep(small_trace, capsys):
    code, out, err = run(capsys, "whatif", str(small_trace), "--device", "1GiB",
                         "--fractions", "0.1,0.5,1.0", "--jobs", "1")
    assert code == 0, err
    assert "smallest fraction that fits" in out
    assert "fraction" in out and "peak pool" in out


@pytest.mark.core
def test_convert_round_trips_to_pytorch_json(small_trace, tmp_path, capsys):
    out_json = tmp_path / "snap.json"
    code, out, _ = run(capsys, "convert", str(small_trace), str(out_json))
    assert code == 0
    data = json.loads(out_json.read_text())
    assert "device_traces" in data and "segments" in data
    back = load_trace(out_json)
    orig = load_trace(small_trace)
    assert back.summary()["allocations"] == orig.summary()["allocations"]
    code, _, err = run(capsys, "convert", str(small_trace), str(out_json))
    assert code == 1 and "--overwrite" in err


def test_info_reports_devices_without_a_driver(capsys):
    code, out, _ = run(capsys, "info")
    assert code == 0
    assert "NVML" in out and "CUDA" in out


@pytest.mark.parametrize("pure", ["", "1"])
def test_info_says_which_allocator_core_runs(pure, monkeypatch):
    from gpudash import _accel

    monkeypatch.setenv(_accel.ENV, pure)
    proc = subprocess.run([sys.executable, "-m", "gpudash.cli", "info"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("allocator core:"))
    if pure:
        assert "pure Python (GPUDASH_PURE_PYTHON is set)" in line
    elif _accel._load()[0] is not None:   # the core loads here
        assert "compiled (gpudash._core" in line and "GPUDASH_PURE_PYTHON=1" in proc.stdout
        from gpudash import _core

        times = next(ln for ln in proc.stdout.splitlines() if "event times:" in ln)
        assert _core.JOURNAL_CLOCK_REASON in times
        assert ("time-stamp counter" in times) == (_core.JOURNAL_CLOCK == "tsc")
    else:
        assert "pure Python (the compiled core is not built here" in line


def test_lab_dry_run_names_the_quickstart(capsys):
    code, out, _ = run(capsys, "lab", "--dry-run", "--no-browser")
    assert code == 0
    assert "01_quickstart.ipynb" in out


@pytest.mark.parametrize("argv, fragment", [
    (["replay", "missing.gdtrace"], "no such file"),
    (["replay", "x", "--fraction", "abc"], "must be a number"),
    (["replay", "x", "--fraction", "-1"], "must be in 0..1"),
    (["replay", "x", "--fraction", "2"], "must be in 0..1"),
    (["replay", "x", "--device", "lots"], "byte count"),
    (["replay", "x", "--device", "10PB"], "at most 1 PiB"),
    (["replay", "x", "--device", "1.5"], "at least 1 MiB"),
    (["demo", "--html", "/nonexistent/x.html"], "the folder /nonexistent does not exist"),
    (["convert", "in.gdtrace", "x.csv"], "cannot tell what to write from .csv"),
    (["whatif", "x", "--jobs", "0"], None),
    (["frobnicate"], "invalid choice"),
])
def test_user_errors_are_one_line_and_exit_1(argv, fragment, capsys, tmp_path):
    code, out, err = run(capsys, *argv)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpudash: error:")
    assert "Traceback" not in err
    if fragment:
        assert fragment in err


def test_odd_inputs_are_named_in_one_line(tmp_path, capsys):
    import os

    empty = tmp_path / "empty.gdtrace"
    empty.write_bytes(b"")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path, fragment in ((empty, "the file is empty"), (fifo, "is a FIFO"),
                           (tmp_path, "")):
        code, _, err = run(capsys, "replay", str(path))
        assert code == 1, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and fragment in lines[0], err


@pytest.mark.core
def test_format_forces_the_reader(small_trace, capsys):
    code, out, err = run(capsys, "replay", str(small_trace), "--format", "gdtrace")
    assert code == 0, err
    code, _, err = run(capsys, "replay", str(small_trace), "--format", "rmm-csv")
    assert code == 1 and str(small_trace) in err and len(err.strip().splitlines()) == 1


def test_an_internal_error_is_one_line_with_its_own_code(capsys, monkeypatch):
    from gpudash import cli

    def boom(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setitem(cli.COMMANDS, "info", boom)
    monkeypatch.delenv("GPUDASH_DEBUG", raising=False)
    code, _, err = run(capsys, "info")
    assert code == 70
    assert err.strip() == ("gpudash: internal error: ZeroDivisionError: division by zero (set "
                           "GPUDASH_DEBUG=1 for the traceback, and please report it)")


def test_help_lists_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "3 replay ran out of memory" in " ".join(capsys.readouterr().out.split())


def test_bad_trace_file_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run(capsys, "replay", str(bad))
    assert code == 1
    assert "bad.json" in err
    assert len(err.strip().splitlines()) == 1


def test_console_script_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "gpudash", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.startswith("gpudash ")
