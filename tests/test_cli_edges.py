"""The command's edges: traces with nothing to report, numbers beyond sense, a demo run
twice, and a reader that stops reading."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpudash.cli import main
from gpudash.trace import write_trace
from gpudash.formats.format import EventBuilder
from gpudash.workloads import training_loop

ROOT = Path(__file__).resolve().parent.parent


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def gpudash_cli(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command in a process of its own, run from ``cwd`` with this checkout's gpudash."""
    return subprocess.run([sys.executable, "-m", "gpudash", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=checkout_env())


def checkout_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))


@pytest.fixture()
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "train.gdtrace"
    write_trace(training_loop(steps=2, layers=3, batch=8, hidden=256), path)
    return path


def built(tmp_path: Path, name: str, *allocs: int) -> Path:
    b = EventBuilder()
    b.add_device(0, "GPU_0_bfc")
    for i, n in enumerate(allocs):
        b.alloc(1000 + i, 0, 0x7F0000000000 + (i << 40), n, n)
    path = tmp_path / f"{name}.gdtrace"
    write_trace(b.build({"source": "test"}), path)
    return path


# ---------------------------------------------------------------------------- nothing to draw
def test_replay_html_of_a_trace_without_events_is_a_one_line_error(tmp_path, capsys):
    empty = built(tmp_path, "empty")
    for command in ("replay", "whatif"):
        out = tmp_path / f"{command}.html"
        code, _, err = run(capsys, command, str(empty), "--html", str(out))
        assert code == 1, err
        assert err.strip() == (f"gpudash: error: {empty}: the trace has no events for this "
                               f"device (device 0, GPU_0_bfc); nothing to replay")
        assert not out.exists()


def test_a_replay_that_served_nothing_writes_a_report_that_says_so(tmp_path, capsys):
    lone = built(tmp_path, "lone", (1 << 63) - 1)     # one allocation no device can serve
    out = tmp_path / "lone.html"
    code, stdout, err = run(capsys, "replay", str(lone), "--html", str(out))
    assert code == 3, err                              # it ran out of memory: exit code 3
    html = out.read_text()
    assert "no allocation was served in this replay" in html
    assert 'data-plot="timeline"' in html and 'data-plot="chunkmap"' not in html
    code, _, err = run(capsys, "whatif", str(lone), "--html", str(out), "--overwrite",
                       "--fractions", "0.5", "--jobs", "1")
    assert code == 0, err
    assert "no allocation was served" in out.read_text()


# ---------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("argv, fragment", [
    (["demo", "--steps", "0"], "--steps: must be 1..1,000; got 0"),
    (["demo", "--steps", "12x"], "--steps: expected an integer"),
    (["demo", "--seed", "-1"], "--seed: must be 0.."),
    (["whatif", "TRACE", "--jobs", "100000"], "--jobs: must be 1..256"),
    (["whatif", "TRACE", "--fractions", ",".join(["0.5"] * 101)], "at most 100 fractions"),
    (["replay", "TRACE", "--device-index", "40000"], "--device-index: must be 0..32,767"),
    (["explain", "TRACE", "--dump", "10000000000"], "--dump: must be -1,048,576..1,048,576"),
    (["lab", "--dry-run", "--port", "70000"], "--port: must be 0..65,535"),
])
def test_numeric_arguments_are_bounded(argv, fragment, small_trace, capsys, tmp_path,
                                       monkeypatch):
    monkeypatch.chdir(tmp_path)                        # where a demo would write its report
    argv = [str(small_trace) if a == "TRACE" else a for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 1, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpudash: error:") and fragment in lines[0]


def test_a_demo_of_endless_steps_is_refused_at_once(tmp_path):
    r = gpudash_cli("demo", "--steps", "99999999999999999999", "--no-html", cwd=tmp_path,
                    timeout=60)
    assert r.returncode == 1 and "--steps: must be 1..1,000" in r.stderr
    assert r.stdout == ""                              # refused before any work


# ---------------------------------------------------------------------------- demo, twice
def test_a_demo_replaces_its_own_report_but_not_a_file_named_for_it(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        code, out, err = run(capsys, "demo", "--steps", "1")
        assert code == 0, err
        assert "report: gpudash-demo.html" in out
    assert "<title>gpudash demo: training</title>" in (tmp_path / "gpudash-demo.html").read_text()
    # a file of the user's that has the default name is not the demo's: it stays
    (tmp_path / "gpudash-demo.html").write_text("my notes")
    code, _, err = run(capsys, "demo", "--steps", "1")
    assert code == 1 and "exists; pass --overwrite" in err
    assert (tmp_path / "gpudash-demo.html").read_text() == "my notes"
    # a report named explicitly still needs --overwrite, even the demo's own
    code, _, _ = run(capsys, "demo", "--steps", "1", "--html", "named.html")
    assert code == 0
    code, _, err = run(capsys, "demo", "--steps", "1", "--html", "named.html")
    assert code == 1 and "--overwrite" in err


# ---------------------------------------------------------------------------- a closed pipe
def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path):
    # the fragmentation demo prints 165 kB, more than a pipe holds: it must write after
    # the reader is gone
    proc = subprocess.Popen([sys.executable, "-m", "gpudash", "demo", "--workload",
                             "fragmentation", "--no-html"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=tmp_path, env=checkout_env())
    first = proc.stdout.readline()
    proc.stdout.close()                                # as `| head -1` does
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=120)
    assert first.startswith(b"gpudash demo:")
    assert code == 141, err                            # 128 + SIGPIPE, as the shell shows
    assert err == "", err                              # no "[Errno 32] Broken pipe"
