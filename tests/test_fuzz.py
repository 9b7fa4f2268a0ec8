"""The input fuzzer (benchmarks/fuzz_inputs.py), run for a bounded number of cases."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gpudash import TraceFormatError

FUZZ = Path(__file__).resolve().parent.parent / "benchmarks" / "fuzz_inputs.py"


@pytest.fixture(scope="module")
def fuzz_inputs():
    spec = importlib.util.spec_from_file_location("fuzz_inputs", FUZZ)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mutant_is_a_trace_or_a_trace_format_error(fuzz_inputs, tmp_path):
    outcomes, failures = fuzz_inputs.fuzz(cases=300, seed=7, seconds=20, workdir=tmp_path)
    assert not failures, "\n".join(failures)
    seen = {(fmt, outcome) for fmt, _kind, outcome in outcomes}
    formats = {fmt for fmt, _ in seen}
    assert {"gdtrace", "torch-json", "torch-pickle", "rmm-csv", "cupy-hook", "tf-log"} <= formats
    # both outcomes occur: the mutations reach the readers and do break them
    assert {o for _, o in seen} == {"trace", "TraceFormatError"}


def test_the_fuzzer_reports_an_exception_that_is_not_a_trace_format_error(
        fuzz_inputs, tmp_path, monkeypatch):
    calls = []

    def flaky(path, format=None):
        calls.append(path)
        if len(calls) % 2:
            raise TraceFormatError("fine")
        raise KeyError("a bug")
    monkeypatch.setattr(fuzz_inputs, "load_trace", flaky)
    _, failures = fuzz_inputs.fuzz(cases=4, seed=0, workdir=tmp_path)
    assert len(failures) == 4 and all("KeyError" in f for f in failures)


def test_every_hostile_family_is_a_trace_or_a_trace_format_error(fuzz_inputs, tmp_path):
    """FIFOs, hostile long lines, pickles that repeat by reference, odd metadata, thousands
    of devices, odd floats and damaged .npy headers (items of the hostile-input review)."""
    outcomes, failures = fuzz_inputs.fuzz(cases=60, seed=3, seconds=60, workdir=tmp_path,
                                          hostile_share=1.0)
    assert not failures, "\n".join(failures)
    families = {kind for _fmt, kind, _outcome in outcomes}
    assert families == set(fuzz_inputs.FAMILIES)


def test_the_fuzzer_reports_a_load_that_hangs(fuzz_inputs, tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(fuzz_inputs, "HANG_S", 0.2)
    monkeypatch.setattr(fuzz_inputs, "load_trace", lambda path, format=None: time.sleep(1))
    _, failures = fuzz_inputs.fuzz(cases=1, seed=0, workdir=tmp_path, hostile_share=0.0)
    assert len(failures) == 2 and all("TimeoutError" in f and "hang" in f for f in failures)
