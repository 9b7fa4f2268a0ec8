"""Replay and what-if of an out-of-memory log that is less than the job (an elided or
missing dump, warnings only) say so, with ``explain``'s words, in their text and in their
result objects; and why what-if's smallest limit for a dump is not ``explain``'s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import gpudash
import gpudash.trace as gt
from gpudash.trace.whatif import min_fraction, sweep

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "tests" / "data" / "real"
from shared_files import EXTERNAL  # noqa: E402
needs_external = pytest.mark.skipif(not EXTERNAL.is_dir(), reason="../shared is absent")

JAX_LOG = (
    "2025-03-14 21:29:02.854478: W external/xla/xla/tsl/framework/bfc_allocator.cc:501] "
    "Allocator (GPU_0_bfc) ran out of memory trying to allocate 4.50GiB (rounded to "
    "4831838208)requested by op \n"
    "2025-03-14 21:29:02.854640: W external/xla/xla/tsl/framework/bfc_allocator.cc:512] "
    + "*" * 99 + "_\n"
    "E0314 21:29:02.854727  957629 pjrt_stream_executor_client.cc:3045] Execution of replica 0 "
    "failed: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4831838208 bytes.\n")


def gpudash_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpudash", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.fixture()
def cut_log(tmp_path: Path) -> Path:
    """A TensorFlow log whose dump was cut off inside its chunk lines."""
    lines = (REAL / "tf_oom_mixed.log").read_text().splitlines(keepends=True)
    path = tmp_path / "cut.log"
    path.write_text("".join(lines[:40]))
    return path


@pytest.fixture()
def jax_log(tmp_path: Path) -> Path:
    path = tmp_path / "jax.log"
    path.write_text(JAX_LOG)
    return path


def test_an_elided_dump_is_named_in_the_replay_and_whatif_results(cut_log):
    e = gpudash.explain(cut_log)
    assert any("chunk lines are missing" in w for w in e.warnings)
    t = gt.load_trace(cut_log)
    (rec,) = t.meta["incomplete_states"]
    # the cut dump's in-use summary and stats are lost: what it held is unknown beyond its
    # chunk lines
    assert rec["allocator"] == "bfc_cpu_allocator_for_gpu" and rec["in_use"] is None
    assert rec["rebuilt"] == e.in_use > 0
    assert rec["warnings"] == e.warnings             # explain's own words
    r = gt.replay(t)
    assert r.warnings and e.warnings[0] in r.warnings[0] and "lower bound" in r.warnings[0]
    assert "incomplete trace" in repr(r)
    m = min_fraction(t, "16GiB", tolerance=0.05)
    assert m.warnings == r.warnings and "lower bound" in repr(m)
    s = sweep(t, fractions=[0.5], allow_growth=False)
    assert s.warnings == r.warnings and "warning:" in s.to_text() and "warning" in s.to_html()
    assert "warning:" not in s.to_text(warnings=False)
    # a complete log carries none
    whole = gt.load_trace(REAL / "tf_oom_mixed.log")
    assert whole.meta["incomplete_states"] == [] and gt.replay(whole).warnings == []
    assert min_fraction(whole, "16GiB", tolerance=0.05).warnings == []


def test_the_commands_say_it_too(cut_log, jax_log):
    r = gpudash_cli("replay", str(cut_log), "--fraction", "0.5")
    assert r.returncode == 0, r.stderr
    assert "warning:" in r.stdout and "chunk lines are missing" in r.stdout
    assert "of the calls the trace holds (no answer for the job" in r.stdout
    r = gpudash_cli("replay", str(jax_log))
    assert r.returncode == 0 and "no allocator dump follows the out-of-memory line" in r.stdout
    assert "the memory in use when it failed is unknown" in r.stdout
    # what-if gives no lines to paste from a trace that is less than the job
    r = gpudash_cli("whatif", str(jax_log), "--framework", "jax", "--fractions", "0.5",
                    "--jobs", "1")
    assert r.returncode == 0, r.stderr
    assert "no allocator dump follows" in r.stdout and "a lower bound for the job" in r.stdout
    assert "no lines to paste" in r.stdout and "XLA_PYTHON_CLIENT_MEM_FRACTION=" not in r.stdout
    assert r.stdout.count("warning:") == 1           # once, not again under the table


def test_a_log_of_warnings_only_is_refused_with_the_reason(tmp_path):
    line = ("2021-08-30 02:24:22.499646: W tensorflow/core/common_runtime/bfc_allocator.cc:246]"
            " Allocator (GPU_0_bfc) ran out of memory trying to allocate 546.16MiB with "
            "freed_by_count=0. The caller indicates that this is not a failure, but may mean "
            "that there could be performance gains if more memory were available.\n")
    log = tmp_path / "warnings.log"
    log.write_text(line * 3)
    for command in ("replay", "whatif"):
        r = gpudash_cli(command, str(log))
        assert r.returncode == 1, (command, r.stdout)
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1 and str(log) in err
        assert "the trace has no events for this device" in err and "non-fatal" in err
        assert "its 3 'ran out of memory' line(s)" in err


@needs_external
def test_the_external_logs_that_answered_confidently():
    # JAX: no dump; replay said "fits" and whatif XLA_PYTHON_CLIENT_MEM_FRACTION=0.282
    jax = gt.load_trace(EXTERNAL / "jax_pi0_two_gpu_oom_2025.log")
    for dev in (0, 1):
        (w,) = gt.replay(jax, device=dev).warnings
        assert f"GPU_{dev}_bfc" in w and "no allocator dump follows" in w
    r = gpudash_cli("whatif", str(EXTERNAL / "jax_pi0_two_gpu_oom_2025.log"), "--framework",
                    "jax", "--device-index", "0", "--fractions", "0.5", "--jobs", "1")
    assert r.returncode == 0 and "no lines to paste" in r.stdout
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.282" not in r.stdout
    # the elided Windows dump: a peak of 323.75 KiB, when the job had 542 MiB in use
    elided = gt.replay(gt.load_trace(EXTERNAL / "tf22_windows_oom_elided_2020.log"))
    assert elided.fits and elided.peak_bytes_in_use == 331_520
    (w,) = elided.warnings
    assert "211.25 KiB of the 542.02 MiB in use" in w and "left out of the dump" in w
    # warnings only: "0 calls replayed ... fits" and "smallest fraction 0.004"
    for command in ("replay", "whatif"):
        r = gpudash_cli(command, str(EXTERNAL / "tf2x_gsate_yolo_oom_warnings_2021.log"))
        assert r.returncode == 1 and "its 10 'ran out of memory' line(s)" in r.stderr
        assert "fits" not in r.stdout and "smallest fraction" not in r.stdout


@needs_external
def test_why_whatif_needs_more_than_explains_smallest_limit():
    """tf14_alexnet: explain says 346.41 MiB, whatif 448 MiB. explain keeps the dump's layout
    and adds a region; whatif replays the chunks from an empty allocator, where at 346 MiB the
    last chunk (115.82 MiB, from a free tail less than twice its size) is not split and takes
    the room the request needed; and the bisection stops within 0.005 of 16 GiB."""
    log = EXTERNAL / "tf14_alexnet_oom_2017.log"
    e = gpudash.explain(log, device="16GiB")
    assert e.smallest_limit == 363_237_376 == e.pool + e.rounded
    assert "a replay of the dump from an empty allocator (gpudash whatif) may need more" \
        in str(e)
    t = gt.load_trace(log)
    at_explains = gt.replay(t, memory_limit=e.smallest_limit, allow_growth=False)
    assert not at_explains.fits
    last = max(at_explains.final_snapshot.chunks, key=lambda c: c.address)
    assert last.in_use and last.size == 121_448_704 + (e.smallest_limit - e.pool)
    fine = min_fraction(t, "16GiB", allow_growth=False, tolerance=1e-7)
    assert fine.limit_bytes == 406_924_288          # twice the last chunk, plus what precedes
    assert fine.limit_bytes >= 2 * 121_448_704 + (e.pool - 121_448_704)
    assert gt.replay(t, memory_limit=fine.limit_bytes, allow_growth=False).fits
    coarse = min_fraction(t, "16GiB", allow_growth=False)
    assert coarse.tolerance == 0.005 and coarse.limit_bytes == 448 << 20
    assert coarse.limit_bytes - fine.limit_bytes <= 0.005 * (16 << 30)
    r = gpudash_cli("whatif", str(log), "--fractions", "0.1", "--jobs", "1")
    assert r.returncode == 0, r.stderr
    assert "bisected to within 0.005, 81.92 MiB" in r.stdout
    assert "note: GPU_0_bfc's state is its dump's" in r.stdout and "gpudash explain" in r.stdout
