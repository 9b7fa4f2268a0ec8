"""Many ranks at once: a glob or a directory of per-rank files is one trace, one device per
file, named after its rank."""

from __future__ import annotations

import numpy as np
import pytest

from gpudash import TraceFormatError
from gpudash.trace import load_ranks, load_trace, replay_devices, save_trace
from gpudash.workloads import training_loop

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)


@pytest.fixture
def rank_dir(tmp_path):
    folder = tmp_path / "snaps"
    folder.mkdir()
    sizes = {}
    for r, hidden in ((0, 512), (1, 1024), (10, 256)):
        t = training_loop(steps=2, layers=2, hidden=hidden, seed=r)
        save_trace(t, folder / f"rank{r}_memory_snapshot.pickle", format="torch-pickle")
        sizes[r] = t.summary()["peak_allocated_bytes"]
    return folder, sizes


def test_a_glob_of_rank_files_is_one_trace_with_a_device_per_rank(rank_dir):
    folder, sizes = rank_dir
    t = load_trace(str(folder / "rank*_memory_snapshot.pickle"))
    names = [(d["index"], d["name"]) for d in t.meta["devices"]]
    # natural order: rank0, rank1, rank10
    assert names == [(0, "rank0 cuda:0"), (1, "rank1 cuda:0"), (2, "rank10 cuda:0")]
    assert [r["name"] for r in t.meta["ranks"]] == ["rank0", "rank1", "rank10"]
    assert sorted(np.unique(t.columns["device"]).tolist()) == [0, 1, 2]
    # each device is its file, unchanged
    for dev, r in enumerate((0, 1, 10)):
        one = load_trace(folder / f"rank{r}_memory_snapshot.pickle")
        assert int((t.columns["device"] == dev).sum()) == len(one)
    results = replay_devices(t, device_bytes="16GiB")
    assert len(results) == 3 and all(x.fits for x in results.values())


def test_a_directory_of_rank_files_reads_the_same(rank_dir):
    folder, _ = rank_dir
    a = load_trace(folder)
    b = load_ranks([folder / "rank0_memory_snapshot.pickle",
                    folder / "rank1_memory_snapshot.pickle",
                    folder / "rank10_memory_snapshot.pickle"])
    assert len(a) == len(b) and a.meta["devices"] == b.meta["devices"]


def test_nothing_to_read_and_a_bad_rank_file_name_themselves(tmp_path, rank_dir):
    with pytest.raises(TraceFormatError, match="no files to read as ranks"):
        load_trace(str(tmp_path / "none*.pickle"))
    folder, _ = rank_dir
    (folder / "rank2_memory_snapshot.pickle").write_text("not a snapshot")
    with pytest.raises(TraceFormatError, match="rank2_memory_snapshot.pickle"):
        load_trace(str(folder / "rank*"))
