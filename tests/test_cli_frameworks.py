"""The command for all three frameworks: help and errors in PyTorch's, TensorFlow's and JAX's
words, the PyTorch demo, flags named as the command takes them, a snapshot without its
failure summed up, one rule for expandable_segments with max_split_size_mb, and one way to
print the fraction that fits."""

from __future__ import annotations

import pickle
import re
import warnings

import pytest

from gpudash.cli import _parser, main
from gpudash.workloads import caching_snapshot, finetune_calls

from shared_files import EXTERNAL

pytestmark = pytest.mark.core

MIB = 1 << 20
OOM_SNAPSHOT = EXTERNAL / "LLM-inference.oom_snapshot.pickle"


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _help(capsys, *args) -> str:
    with pytest.raises(SystemExit):
        main([*args, "--help"])
    return capsys.readouterr().out


# ------------------------------------------------------------------ help and errors
def test_help_names_every_framework(capsys):
    top = _help(capsys)
    assert all(w in top for w in ("PyTorch", "TensorFlow", "JAX"))
    for command in ("demo", "explain", "replay", "whatif"):
        text = _help(capsys, command)
        assert all(w in text for w in ("PyTorch", "TensorFlow", "JAX")), command
    demo = _help(capsys, "demo")
    assert "--framework" in demo and "set_per_process_memory_fraction" in demo
    explain = " ".join(_help(capsys, "explain").split())
    assert "CUDA out of memory" in explain and "snapshot" in explain


def test_no_subcommand_speaks_of_tensorflow_alone(capsys):
    """Every subcommand whose help names TensorFlow names PyTorch too."""
    sub = next(a for a in _parser()._actions if a.dest == "command")
    for name in sub.choices:
        text = _help(capsys, name)
        if "TensorFlow" in text:
            assert "PyTorch" in text, name


def test_a_bad_fraction_is_refused_in_each_frameworks_words(capsys):
    code, _, err = run(capsys, "replay", "x.pickle", "--fraction", "2")
    assert code == 1
    assert all(w in err for w in ("set_per_process_memory_fraction",
                                  "per_process_gpu_memory_fraction",
                                  "XLA_PYTHON_CLIENT_MEM_FRACTION"))


def test_suggestions_name_the_commands_flags(capsys, tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00\x01not a trace at all")
    code, _, err = run(capsys, "replay", junk)
    assert code == 1 and "--format FORMAT" in err and "format=" not in err
    code, out, _ = run(capsys, "replay", OOM_SNAPSHOT) if OOM_SNAPSHOT.is_file() else \
        (0, "pass --torch-version X.Y", "")
    assert "torch_version=" not in out and "device_bytes=" not in out


# ------------------------------------------------------------------ the PyTorch demo
def test_demo_runs_pytorchs_allocator_and_pastes_the_fraction_it_prints(capsys):
    code, out, _ = run(capsys, "demo", "--framework", "torch", "--steps", "1", "--no-html")
    assert code == 0
    assert "through PyTorch's caching allocator" in out
    assert "PyTorch CUDA memory summary" in out and "TensorFlow" not in out
    printed = re.search(r"set_per_process_memory_fraction that fits: ([0-9.]+)", out)
    pasted = re.search(r"torch\.cuda\.set_per_process_memory_fraction\(([0-9.]+)\)", out)
    assert printed and pasted and printed.group(1) == pasted.group(1)
    code, _, err = run(capsys, "demo", "--framework", "torch", "--growth")
    assert code == 1 and "PYTORCH_CUDA_ALLOC_CONF" in err
    code, _, err = run(capsys, "demo", "--conf", "expandable_segments:True")
    assert code == 1 and "--framework torch" in err


def test_demo_jax_says_whose_log_it_prints(capsys):
    code, out, _ = run(capsys, "demo", "--framework", "jax", "--steps", "1", "--no-html")
    assert code == 0 and "as XLA prints it for JAX" in out


# ------------------------------------------------------------------ a snapshot without its failure
def _state_snapshot() -> dict:
    """Two segments saved without a trace, as an out-of-memory handler without
    _record_memory_history saves them: a 2 MiB small-pool one with a 512 KiB tensor,
    and a 40 MiB large one with 24 MiB allocated from one line and 16 MiB free."""
    frames = [{"filename": "/job/train.py", "name": "forward", "line": 42}]
    return {"segments": [
        {"device": 0, "address": 1 << 32, "total_size": 2 * MIB, "stream": 0,
         "segment_type": "small", "allocated_size": MIB // 2,
         "blocks": [{"size": MIB // 2, "requested_size": MIB // 2, "state": "active_allocated",
                     "frames": frames},
                    {"size": 3 * MIB // 2, "state": "inactive"}]},
        {"device": 0, "address": 1 << 33, "total_size": 40 * MIB, "stream": 0,
         "segment_type": "large", "allocated_size": 24 * MIB,
         "blocks": [{"size": 24 * MIB, "requested_size": 24 * MIB,
                     "state": "active_allocated", "frames": frames},
                    {"size": 16 * MIB, "state": "inactive"}]},
    ], "device_traces": [[]]}


@pytest.fixture()
def state_snapshot(tmp_path):
    path = tmp_path / "oom_state.pickle"
    path.write_bytes(pickle.dumps(_state_snapshot()))
    return path


def test_explain_sums_up_a_snapshot_without_its_failure(capsys, state_snapshot):
    code, out, err = run(capsys, "explain", state_snapshot)
    assert code == 0, err
    assert "nothing failed to explain" not in out + err
    assert "segments          2 (1 small pool, 1 large pool)" in out
    assert "reserved          42.00 MiB" in out and "allocated         24.50 MiB" in out
    assert "17.50 MiB" in out   # reserved but unallocated
    assert "small pool: 1.50 MiB (1 free block(s))" in out
    assert "large pool: 16.00 MiB (1 free block(s))" in out
    assert "train.py:42 forward" in out
    assert "no 'oom' entry" in out and "neither its size nor its pool is known" in out


def test_replay_of_a_snapshot_without_calls_does_not_say_fits(capsys, state_snapshot):
    code, out, _ = run(capsys, "replay", state_snapshot)
    assert code == 0
    assert "\nfits:" not in out and "nothing to replay" in out
    assert "large pool: 16.00 MiB (1 free block(s))" in out


def test_the_state_summary_as_a_function(state_snapshot):
    from gpudash.torch_explain import explain_torch

    e = explain_torch(state_snapshot)
    assert (e.source, e.request, e.cause) == ("state", 0, "unknown")
    assert (e.reserved, e.allocated) == (42 * MIB, 49 * MIB // 2)
    assert e.pools == {"small": (1, 3 * MIB // 2), "large": (1, 16 * MIB)}
    assert e.segments == {"small": 1, "large": 1} and e.missing
    assert e.figures()   # the segment map of the state


@pytest.mark.skipif(not OOM_SNAPSHOT.is_file(), reason="the external snapshot is absent")
def test_the_real_oom_snapshot_without_a_trace(capsys):
    code, out, _ = run(capsys, "explain", OOM_SNAPSHOT)
    assert code == 0 and "176 (2 small pool, 174 large pool)" in out
    assert "pytorch_backend.py:190 allocate" in out and "no 'oom' entry" in out
    code, out, _ = run(capsys, "replay", OOM_SNAPSHOT)
    assert code == 0 and "\nfits:" not in out and "nothing to replay" in out


# ------------------------------------------------------------------ one rule for the combination
def test_one_rule_for_expandable_segments_with_max_split_size():
    from gpudash import CachingAllocatorConfig

    rule = CachingAllocatorConfig("expandable_segments:True,max_split_size_mb:128").unsupported()
    assert rule and "pytorch/pytorch#123548" in rule and "max_split_size_mb:128" in rule
    assert CachingAllocatorConfig("expandable_segments:True").unsupported() is None
    assert CachingAllocatorConfig("max_split_size_mb:128").unsupported() is None


def test_the_dashboards_answer_offers_no_line_for_the_combination():
    from gpudash.models import TORCH

    both = {"conf": "expandable_segments:True,max_split_size_mb:128", "regions": 0}
    answer = TORCH.answer("max_split", 128, None, both)
    assert "_set_allocator_settings" not in answer["text"]
    assert "pytorch/pytorch#123548" in answer["warning"]
    one = TORCH.answer("max_split", 128, None, {"conf": "max_split_size_mb:128", "regions": 0})
    assert "_set_allocator_settings('max_split_size_mb:128')" in one["text"]
    assert "warning" not in one


def test_a_session_warns_of_the_combination():
    import gpudash

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with gpudash.Session(allocator="torch", simulate="1GiB", environ={},
                             config="expandable_segments:True") as sess:
            assert not seen
            sess.configure(max_split_size_mb=128)
    assert any("pytorch/pytorch#123548" in str(w.message) for w in seen)


def test_whatif_answers_the_combination_by_the_rule(capsys, tmp_path):
    from gpudash.trace import load_trace
    from gpudash.trace.whatif import min_fraction, sweep

    path = tmp_path / "ft.pickle"
    path.write_bytes(pickle.dumps(caching_snapshot(finetune_calls(), device_bytes="80GiB")))
    trace = load_trace(path)
    table = sweep(trace, [1.0], device_bytes="80GiB", vary={"max_split_size_mb": [256]})
    rows = {r["expandable_segments"]: r for r in table}
    assert rows[True]["error"] and "pytorch/pytorch#123548" in rows[True]["error"]
    assert not rows[False].get("error") and rows[False]["fits"]
    from gpudash import ConfigError

    with pytest.raises(ConfigError, match="123548"):
        min_fraction(trace, "80GiB", conf="expandable_segments:True,max_split_size_mb:256")
    code, out, _ = run(capsys, "whatif", path, "--conf", "max_split_size_mb:256",
                       "--fractions", "1.0", "--jobs", "1")
    assert code == 0
    assert "with expandable_segments:True: not offered" in out and "123548" in out
    assert "max_split_size_mb:256,expandable" not in out
    assert "expandable_segments:True,max_split_size_mb:256" not in out.split("not offered")[0]


# ------------------------------------------------------------------ the fraction, printed once
def test_the_fraction_that_fits_is_printed_as_it_is_pasted(capsys, tmp_path):
    from gpudash.models import fitting_fraction, fraction_text

    assert fraction_text(0.9531) == "0.954" and fraction_text(0.953) == "0.953"
    assert fraction_text(0.99999) == "1" and fitting_fraction(0.5) == 0.5
    path = tmp_path / "ft.pickle"
    path.write_bytes(pickle.dumps(caching_snapshot(finetune_calls(), device_bytes="80GiB")))
    code, out, _ = run(capsys, "whatif", path, "--fractions", "1.0", "--jobs", "1")
    assert code == 0
    printed = re.findall(r"set_per_process_memory_fraction that fits: ([0-9.]+)|"
                         r"with expandable_segments:True: ([0-9.]+)", out)
    pasted = re.findall(r"torch\.cuda\.set_per_process_memory_fraction\(([0-9.]+)\)", out)
    assert len(printed) == len(pasted) == 2
    assert ["".join(p) for p in printed] == pasted
    assert all(len(p.partition(".")[2]) <= 3 for p in pasted)
