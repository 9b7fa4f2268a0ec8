"""``gpudash holders`` and ``gpudash diff``: what they print, and their one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpudash.cli import main
from gpudash.trace import write_trace

from attrib_helpers import CPP_ALLOC, TORCH_LINEAR, make_trace, user

MiB = 1 << 20
REAL = Path(__file__).parent / "data" / "real"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def traces(tmp_path: Path) -> dict[str, Path]:
    def step(batch: int, oom: bool = False):
        calls = [("alloc", "w", 100 * MiB, [CPP_ALLOC, user(30, "main")]),
                 *[("alloc", i, batch * MiB, [CPP_ALLOC, TORCH_LINEAR, user(88, "forward")])
                   for i in range(3)],
                 ("free", 0),
                 ("alloc", "x", MiB, [user(99, "tail")])]
        if oom:
            calls.append(("oom", 1 << 40, [CPP_ALLOC, user(91, "forward")]))
        return make_trace(calls)

    out = {}
    for name, t in (("small", step(2)), ("large", step(50, oom=True)),
                    ("empty", make_trace([("oom", MiB, None)]))):
        out[name] = tmp_path / f"{name}.gdtrace"
        write_trace(t, out[name])
    return out


def test_holders_prints_lines_largest_first_with_what_it_rests_on(traces, capsys):
    code, out, err = run(capsys, "holders", traces["large"])
    assert code == 0, err
    lines = out.splitlines()
    assert "at the peak on device 0" in lines[0] and "by line" in lines[0]
    assert "150.00 MiB" in lines[1] and "train.py:88 forward" in lines[1]
    assert "train.py:30 main" in lines[2]
    assert any(line.startswith("user code: default") for line in lines)
    code, out, _ = run(capsys, "holders", traces["large"], "--at", "oom", "--stacks",
                       "--limit", "1")
    assert code == 0 and "out-of-memory error" in out
    assert "| /home/u/proj/train.py:30 main" in out and "2 more row(s)" in out
    code, out, _ = run(capsys, "holders", traces["large"], "--at", "end", "--by", "file")
    assert code == 0 and "train.py" in out and "by file" in out
    code, out, _ = run(capsys, "holders", traces["large"], "--user-code", "linear")
    assert "linear.py:125 forward" in out and "user_code='linear'" in out
    code, out, _ = run(capsys, "holders", traces["large"], "--at", "3")
    assert code == 0 and "event 3" in out


def test_holders_reads_any_trace_and_answers_by_holder_without_stacks(capsys):
    code, out, err = run(capsys, "holders", REAL / "tf_mlp_training.xplane.pb", "--limit", "3")
    assert code == 0, err
    assert "by holder" in out and "chunk(s)" in out and "StatefulPartitionedCall" in out


@pytest.mark.parametrize("argv,message", [
    (("holders", "missing.gdtrace"), "no such file: missing.gdtrace"),
    (("holders", "{empty}"), "has no allocations"),
    (("holders", "{small}", "--at", "oom"), "no refused allocation"),
    (("holders", "{small}", "--user-code", "(unclosed"), "not a regular expression"),
    (("holders", "{small}", "--at", "soon"), "at must be"),
    (("holders", "{small}", "--at", "999"), "out of range"),
    (("holders", "{small}", "--device", "3"), "no device 3; its devices are 0"),
    (("holders", "{small}", "--by", "colour"), "invalid choice"),
    (("diff", "{small}"), "needs --to MOMENT"),
    (("diff", "{small}", "--iterations"), "no iteration boundaries"),
    (("diff", "{small}", "{large}", "--iterations"), "drop B"),
    (("diff", "{small}", "missing.gdtrace"), "no such file"),
])
def test_errors_are_one_line_and_exit_1(traces, capsys, argv, message):
    argv = [a.format(**{k: str(v) for k, v in traces.items()}) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 1
    assert message in err and err.startswith("gpudash: error:")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_diff_of_two_traces_and_of_two_moments(traces, capsys):
    code, out, err = run(capsys, "diff", traces["small"], traces["large"])
    assert code == 0, err
    assert "+144.00 MiB at train.py:88 forward (3 blocks, 3 before)" in out
    code, out, _ = run(capsys, "diff", traces["large"], "--at", "peak", "--to", "end")
    assert code == 0 and "-50.00 MiB at train.py:88 forward (2 blocks, 3 before)" in out
    code, out, _ = run(capsys, "diff", traces["large"], "--at", "end", "--to", "end")
    assert code == 0 and "no change" in out


def test_diff_iterations_with_boundaries(traces, capsys):
    code, out, err = run(capsys, "diff", traces["large"], "--iterations",
                         "--boundaries", "1,2")
    assert code == 0, err
    assert "2 boundary(ies) given" in out and "kept into the next iteration" in out


@pytest.mark.parametrize("cmd", ["holders", "diff"])
def test_the_new_subcommands_have_help(cmd):
    proc = subprocess.run([sys.executable, "-m", "gpudash", cmd, "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and f"usage: gpudash {cmd}" in proc.stdout
    assert "--user-code" in proc.stdout and "--by" in proc.stdout
