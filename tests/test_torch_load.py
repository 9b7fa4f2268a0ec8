"""Loading PyTorch snapshots fast and lean: entries read in bulk (and entry by entry where a
chunk has anything unusual, with the same result), released as they are read, the garbage
collector paused and back after, a pickle read from its file."""

from __future__ import annotations

import gc
import json
import pickle

import numpy as np
import pytest

from gpudash import TraceFormatError
from gpudash.trace import load_trace
from gpudash.formats import torch_trace as tt
from gpudash.formats.torch_snapshot import _import, load_torch_snapshot, load_torch_snapshot_dict


from shared_files import EXTERNAL  # noqa: E402
SNAPSHOTS = sorted(p.name for p in EXTERNAL.glob("*.p*k*l*")) if EXTERNAL.is_dir() else []
F1 = {"filename": "train.py", "line": 10, "name": "step"}
F2 = {"filename": "model.py", "line": 20, "name": "forward"}


def _both_ways(lst: list, stacks: bool = True):
    """``lst`` read by read_entries (bulk where it can) and entry by entry."""
    a_st, b_st = (tt.StackInterner(), tt.StackInterner()) if stacks else (None, None)
    fast = tt.read_entries(lst, 0, "x", a_st)
    n = len(lst)
    slow = tt.Entries(np.zeros(n, np.int8), np.zeros(n, np.int64), np.zeros(n, np.int64),
                      np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, -1, np.int64),
                      np.full(n, -1, np.int32), {})
    skipped: dict = {}
    tt._read_slow(lst, 0, 0, "x", slow, b_st, skipped)
    slow.skipped = skipped
    return fast, slow, a_st, b_st


def _same(fast, slow, a_st=None, b_st=None) -> None:
    for f in ("action", "addr", "size", "stream", "time_ns", "requested", "stack"):
        assert np.array_equal(getattr(fast, f), getattr(slow, f)), f
    assert fast.skipped == slow.skipped
    if a_st is not None:
        assert a_st.table == b_st.table


def _odd_entries() -> list:
    """Valid entries that the bulk reader hands to the entry-by-entry one, and plain ones."""
    plain = [{"action": "alloc", "addr": 512 * i, "size": 512, "stream": 0, "time_us": i,
              "frames": [F1, F2] if i % 3 else [F2], "compile_context": "N/A"}
             for i in range(5000)]
    odd = [
        {"action": "alloc", "addr": 1 << 40, "size": 512, "stream": (1 << 64) - 5,
         "time_us": 1, "frames": [F1]},                                  # a u64 stream
        {"action": "oom", "size": 1 << 30, "device_free": 5, "stream": 0, "time_us": 2,
         "frames": [F2]},                                                 # no addr
        {"action": "free_requested", "addr": 1 << 40, "size": 512, "time_us": 3},
        {"action": "free_completed", "addr": 1 << 40, "size": 512, "time_us": 3,
         "requested_size": 500, "frames": [], "user_metadata": "m"},
        {"action": "snapshot", "addr": 0, "size": 77, "time_us": 4},
        {"action": "annotate", "size": "x", "time_us": 5},               # no call: anything
        {"action": "segment_alloc", "addr": 2 << 40, "size": 2 << 20, "stream": None,
         "time_us": 6.0},                                                 # a float time
        {"action": "alloc", "addr": 2 << 40, "size": 512, "stream": 0, "time_us": 7,
         "frames": ({"filename": "a.py", "line": 1, "name": "f"},)},     # a tuple of frames
    ]
    return plain[:2500] + odd + plain[2500:]


def test_bulk_and_entry_by_entry_reading_agree():
    lst = _odd_entries() * 2          # several chunks, one with odd entries in each
    assert len(lst) > tt._CHUNK
    fast, slow, a, b = _both_ways(lst)
    _same(fast, slow, a, b)
    assert fast.skipped == {"snapshot": 2, "annotate": 2}
    oom = lst.index(next(e for e in lst if e["action"] == "oom"))
    assert fast.addr[oom] == 5                       # device_free, as TorchTrace keeps it
    assert fast.stream[2500] == -5                   # the u64 stream, as a signed int64
    assert fast.time_ns[2506] == 6000 and fast.requested[2503] == 500
    assert (fast.stack[[2502, 2504, 2505]] == -1).all()    # no rows
    plain = [e for e in lst[:2500]]
    f2, s2, a2, b2 = _both_ways(plain)                     # bulk only: the same too
    _same(f2, s2, a2, b2)
    f3, s3, _, _ = _both_ways(plain, stacks=False)
    _same(f3, s3)
    assert (f3.stack == -1).all()


@pytest.mark.skipif(not SNAPSHOTS, reason="../shared/reference/external is not here")
@pytest.mark.parametrize("name", SNAPSHOTS)
def test_bulk_and_entry_by_entry_reading_agree_on_real_snapshots(name):
    snap = load_torch_snapshot_dict(EXTERNAL / name)
    for lst in snap.get("device_traces") or []:
        if lst:
            _same(*_both_ways(lst))


def test_an_error_in_a_later_chunk_names_its_entry():
    lst = [{"action": "alloc", "addr": 512 * i, "size": 512, "stream": 0, "time_us": i}
           for i in range(tt._CHUNK + 10)]
    lst[tt._CHUNK + 3] = dict(lst[tt._CHUNK + 3], size=-1)
    with pytest.raises(TraceFormatError,
                       match=rf"device_traces\[0\]\[{tt._CHUNK + 3}\]\.size: expected an "
                             r"integer|a negative size"):
        load_torch_snapshot({"device_traces": [lst]})
    lst[tt._CHUNK + 3] = dict(lst[tt._CHUNK + 3], size=512, frames=[F1, "x"])
    with pytest.raises(TraceFormatError,
                       match=rf"device_traces\[0\]\[{tt._CHUNK + 3}\]\.frames\[1\]"):
        load_torch_snapshot({"device_traces": [lst]})


def test_a_dict_is_never_changed_and_a_loaded_snapshot_is_released():
    snap = {"segments": [], "device_traces": [_odd_entries()[:3000]]}
    before = json.dumps(snap, sort_keys=True, default=str)
    t = load_torch_snapshot(snap)
    assert json.dumps(snap, sort_keys=True, default=str) == before
    mine = pickle.loads(pickle.dumps(snap))
    assert _import(mine, "x", None, True, release=True) == t
    assert mine["device_traces"] == [[]]            # read and dropped
    # a list shared by two devices is read for both, and not dropped under the first
    lst = _odd_entries()[:100]
    shared = pickle.loads(pickle.dumps({"device_traces": [lst, lst]}))
    two = _import(shared, "x", None, True, release=True)
    assert sorted(set(two.columns["device"].tolist())) == [0, 1]
    assert (two.columns["device"] == 0).sum() == (two.columns["device"] == 1).sum()


def test_the_garbage_collector_is_back_as_it_was(tmp_path):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [_odd_entries()[:100]]}, protocol=4))
    assert gc.isenabled()
    load_trace(path)
    assert gc.isenabled()
    with pytest.raises(TraceFormatError):
        load_torch_snapshot({"device_traces": [[{"action": 5}]]})
    assert gc.isenabled()
    gc.disable()
    try:
        load_trace(path)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_pickle_is_read_from_its_file_and_bounded_by_its_size(tmp_path, monkeypatch):
    path = tmp_path / "s.pickle"
    snap = {"device_traces": [_odd_entries()[:100]]}
    path.write_bytes(pickle.dumps(snap, protocol=4))
    from gpudash.formats import torch_snapshot

    reads = []
    real_open = torch_snapshot.open_regular

    class Watched:
        def __init__(self, f):
            self.f = f

        def read(self, *args):
            reads.append(args)
            return self.f.read(*args)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(torch_snapshot, "open_regular", lambda p: Watched(real_open(p)))
    got, nbytes = torch_snapshot._load_snapshot_dict(path)
    assert nbytes == path.stat().st_size
    assert reads and () not in reads and (-1,) not in reads   # never the whole file at once
    assert got == snap


def test_stacks_alike_in_length_and_middle_frame_stay_apart():
    mid = {"filename": "m.py", "line": 5, "name": "mid"}
    a, b = [F1, mid, F2], [F2, mid, F1]           # one bucket guess, two stacks
    lst = [{"action": "alloc", "addr": 512 * i, "size": 512, "stream": 0, "time_us": i,
            "frames": list(a if i % 3 else b)} for i in range(3000)]
    st = tt.StackInterner()
    got = tt.read_entries(lst, 0, "x", st)
    assert len(st.table) == 2
    assert [st.table.frames_of(int(s))[0].filename for s in got.stack[:6]] == \
        ["model.py", "train.py", "train.py", "model.py", "train.py", "train.py"]
    _same(*_both_ways(lst))
