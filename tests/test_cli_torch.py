"""The command on PyTorch snapshots: PyTorch's allocator, PyTorch's settings and words, and
the other framework's model on request."""

from __future__ import annotations

import pickle

import pytest

from gpudash.cli import main
from gpudash.workloads import caching_snapshot, finetune_calls


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    """The fine-tuning job's snapshot on a 24 GiB GPU (dumped at its OOM) and on 80 GiB."""
    out = {}
    for gib in (24, 80):
        path = tmp_path_factory.mktemp("snap") / f"ft{gib}.pickle"
        path.write_bytes(pickle.dumps(caching_snapshot(finetune_calls(),
                                                       device_bytes=f"{gib}GiB")))
        out[gib] = path
    return out


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_replay_is_exact_and_speaks_pytorch(snapshots, capsys, tmp_path):
    code, out, _ = run(capsys, "replay", snapshots[24])
    assert code == 3
    assert "through PyTorch's caching allocator on a 24.00 GiB device" in out
    assert "PYTORCH_CUDA_ALLOC_CONF unset, no set_per_process_memory_fraction" in out
    assert "exact: device 0 (empty start): segment events 303/303" in out
    assert "assumed: device 24.00 GiB: from the oom entry" in out
    assert "peak allocated" in out and "segment(s) from cudaMalloc" in out
    assert "allow_growth" not in out and "region" not in out
    code, out, _ = run(capsys, "replay", snapshots[24], "--conf", "expandable_segments:True",
                       "--html", tmp_path / "r.html")
    assert code == 0 and "exact:" not in out
    assert "warning: cuda:0's trace ends at its out-of-memory error" in out
    assert "fits: no allocation ran out of memory, of the calls the trace holds" in out
    page = (tmp_path / "r.html").read_text()
    assert "expandable_segments:True" in page and "Segment map" in page


def test_each_models_settings_are_refused_under_the_other(snapshots, capsys):
    code, _, err = run(capsys, "replay", snapshots[24], "--growth")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "--growth/--no-growth is a setting of TensorFlow's BFC allocator" in err
    code, _, err = run(capsys, "replay", snapshots[24], "--framework", "tensorflow",
                       "--conf", "expandable_segments:True")
    assert code == 1 and "--conf is PyTorch's" in err
    code, _, err = run(capsys, "replay", snapshots[24], "--conf", "max_split_size_mb:5")
    assert code == 1 and "max_split_size_mb" in err and len(err.strip().splitlines()) == 1
    code, out, _ = run(capsys, "replay", snapshots[24], "--framework", "tensorflow")
    assert "allow_growth=" in out and "PyTorch's caching allocator" not in out


def test_whatif_answers_with_set_per_process_memory_fraction_and_expandable_segments(
        snapshots, capsys):
    code, out, _ = run(capsys, "whatif", snapshots[80], "--device", "40GiB", "--fractions",
                       "0.58,0.62", "--jobs", "1")
    assert code == 0
    # the fraction that fits, printed as it is pasted: rounded up to three decimals
    assert "smallest torch.cuda.set_per_process_memory_fraction that fits: 0.61 " in out
    assert "with expandable_segments:True: 0.579 " in out
    assert "  torch.cuda.set_per_process_memory_fraction(0.61)" in out
    assert "    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
    table = out[out.index("fraction  expandable"):]
    assert "peak reserved" in table and "(device 40.00 GiB, PyTorch's caching allocator)" in table
    # the same trace answered in JAX's words replays JAX's BFC
    code, out, _ = run(capsys, "whatif", snapshots[80], "--device", "40GiB", "--fractions",
                       "0.6", "--framework", "jax", "--jobs", "1")
    assert code == 0 and "XLA_PYTHON_CLIENT_MEM_FRACTION=" in out
    assert "set_per_process_memory_fraction" not in out
    # the OOM snapshot: the defaults never fit its 24 GiB, expandable segments do, for the
    # calls up to the failure: no lines to paste from a trace that is less than the job
    code, out, _ = run(capsys, "whatif", snapshots[24], "--fractions", "0.9", "--jobs", "1")
    assert code == 0 and "does not fit on a 24.00 GiB device even at fraction 1.0" in out
    assert "with expandable_segments:True: 0.9" in out
    assert "where the other setting does not fit at all" in out
    assert "no lines to paste" in out and "torch.cuda.set_per" not in out


def test_whatif_varies_more_knobs_and_marks_what_pytorch_itself_refuses(snapshots, capsys):
    code, out, _ = run(capsys, "whatif", snapshots[80], "--device", "40GiB", "--fractions",
                       "0.6", "--vary", "max_split_size_mb=none,256", "--jobs", "1")
    assert code == 0
    table = out[out.index("fraction  expandable"):]
    rows = [line.split() for line in table.splitlines()[2:6]]
    assert [r[:4] for r in rows] == [["0.6", "no", "trace's", "24.00"],
                                     ["0.6", "no", "256", "24.00"],
                                     ["0.6", "yes", "trace's", "24.00"],
                                     ["0.6", "yes", "256", "-"]]
    assert rows[3][3:5] == ["-", "FAILS"] and "pytorch/pytorch#123548" in table
    code, _, err = run(capsys, "whatif", snapshots[80], "--vary", "max_split_size_mb=x")
    assert code == 1 and "not a number" in err
    code, _, err = run(capsys, "whatif", snapshots[80], "--framework", "tensorflow",
                       "--vary", "max_split_size_mb=128")
    assert code == 1 and "--vary is PyTorch's" in err
