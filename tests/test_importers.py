"""Importers: TensorFlow log and vectors, PyTorch snapshots, RMM CSV, CuPy DebugPrintHook."""

from __future__ import annotations

import datetime
import io
import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

import gpudash.trace as gt
from gpudash import TraceFormatError
from gpudash.events import EventKind

DATA = Path(__file__).parent / "data"
TRACES = DATA / "traces"
LOG = DATA / "fragment_202.log"
VECTORS = ["random_101", "training_102", "fragment_103", "pressure_104"]

A, F, E, R = EventKind.ALLOC, EventKind.FREE, EventKind.EXTEND, EventKind.RELEASE
O = EventKind.OOM  # noqa: E741 - one letter like its neighbours, for long lists of kinds


def kinds(trace):
    return [EventKind(k) for k in trace.kind.tolist()]


# ---------------------------------------------------------------------------- TensorFlow log
def test_tf_log_fragment_202_matches_independent_counts():
    text = LOG.read_text()
    lines = text.splitlines()
    alloc_lines = [ln for ln in lines if "[mem-debug] AllocateRaw," in ln]
    free_lines = [ln for ln in lines if "[mem-debug] DeallocateRaw," in ln]
    regions = re.findall(r"Allocated memory at (0x[0-9a-f]+) to (0x[0-9a-f]+)", text)
    assert len(alloc_lines) == 606 and len(free_lines) == 606 and len(regions) == 7

    t = gt.load_tf_log(LOG)
    assert t.meta["source"] == "tensorflow-log"
    assert t.meta["allocator_name"] == "bfc_cpu_allocator_for_gpu"
    assert [d["name"] for d in t.devices] == ["bfc_cpu_allocator_for_gpu"]
    assert len(t.select("alloc")) == len(alloc_lines)
    assert len(t.select("free")) == len(free_lines)
    ext = t.select("extend")
    assert ext.ptr.tolist() == [int(a, 16) for a, _ in regions]
    assert ext.size.tolist() == [int(b, 16) - int(a, 16) for a, b in regions]
    assert len(t) == len(alloc_lines) + len(free_lines) + len(regions)

    allocs = t.select("alloc")
    assert allocs.ptr.tolist() == [int(ln.split(",")[3], 16) for ln in alloc_lines]
    assert allocs.requested.tolist() == [int(ln.split(",")[2]) for ln in alloc_lines]
    assert (allocs.size % 256 == 0).all() and (allocs.size >= allocs.requested).all()
    assert allocs.alloc_id.tolist() == list(range(1, 607))
    assert (allocs.region != 0).all()            # every allocation lies in a logged region
    frees = t.select("free")
    assert frees.requested.tolist() == [int(ln.split(",")[2]) for ln in free_lines]

    calls = t.calls()
    assert calls.unmatched_frees == 0
    assert (calls.op == 1).sum() == 606 and (calls.op == 2).sum() == 606
    assert np.all(np.diff(t.time_ns) >= 0)
    first = next(ln for ln in lines if "Allocated memory at" in ln)
    seconds, micros = re.match(r"I0000 00:00:(\d+)\.(\d{6})", first).groups()
    assert int(t.time_ns[0]) == int(seconds) * 10**9 + int(micros) * 1000
    assert t.summary()["peak_requested_bytes"] > 0


def test_tf_log_two_allocators_ooms_and_limits():
    t = gt.load_tf_log(TRACES / "tf_gpu_two_allocators.log")
    assert [d["name"] for d in t.devices] == ["GPU_0_bfc", "gpu_host_bfc"]
    assert t.devices[0]["options"] == {"memory_limit": 15336603648}   # from "Limit:"
    assert t.meta["allocator_names"] == ["GPU_0_bfc", "gpu_host_bfc"]
    # the two "not a failure" warnings are declined allocations, not OOM events
    assert kinds(t) == [E, A, E, A, F, O, F, F]
    assert t.device.tolist() == [0, 0, 1, 1, 0, 0, 0, 1]
    # regions belong to the allocator of the preceding "Extending allocation" line
    assert t[0].size == 0x200000 and t[0].requested == 1024
    assert t[2].size == 0x100000 and t[2].device == 1
    # OOM: rounded size given; its op is the holder
    assert (t[5].size, t[5].requested) == (21474836480, 21474836480)
    assert t.holder_of(5) == "Fill"
    declined = t.meta["declined_allocations"]
    assert [(d["allocator"], d["bytes"], d["approximate"], d["line"]) for d in declined] == [
        ("GPU_0_bfc", 200, False, 47), ("gpu_host_bfc", 1536, True, 48)]
    assert t.meta["approximate_oom_sizes"] == 0
    # a free of memory allocated before the log began is kept but not replayable
    assert t[4].alloc_id == -1 and t.meta["unmatched_frees"] == 1
    assert t.calls().unmatched_frees == 1
    start = datetime.datetime(2000, 1, 1)
    when = datetime.datetime(2000, 12, 2, 17, 4, 5, 200030)
    assert int(t.time_ns[0]) == (when - start) // datetime.timedelta(microseconds=1) * 1000


def test_tf_log_older_prefix_and_no_prefix():
    text = ("2021-03-04 12:34:56.789012: I tensorflow/core/common_runtime/bfc_allocator.cc:"
            "329] [mem-debug] AllocateRaw,GPU_0_bfc,300,0x7f0000000000,*** Begin\n"
            "[mem-debug] AllocateRaw,GPU_0_bfc,10,0x7f0000000200,\n")
    t = gt.load_tf_log(io.StringIO(text))
    when = datetime.datetime(2021, 3, 4, 12, 34, 56, 789012) - datetime.datetime(1970, 1, 1)
    assert t.time_ns.tolist() == [when // datetime.timedelta(microseconds=1) * 1000] * 2
    assert t.requested.tolist() == [300, 10] and t.size.tolist() == [512, 256]
    t = gt.load_tf_log(io.StringIO(text.split("\n", 1)[1]))
    assert t.time_ns.tolist() == [1000]


def test_tf_log_from_file_object_and_not_a_log():
    with open(TRACES / "tf_gpu_two_allocators.log", "rb") as f:
        assert len(gt.load_tf_log(f)) == 8
    with pytest.raises(TraceFormatError, match="no BFC allocator lines"):
        gt.load_tf_log(io.StringIO("hello\nI0101 00:00:00.000000 1 x.cc:1] nothing\n"))


# ---------------------------------------------------------------------------- TF vectors
@pytest.mark.parametrize("name", VECTORS)
def test_tf_vectors(name):
    raw = gt.load_vector_json(DATA / f"{name}.json")
    steps = raw["steps"]
    t = gt.load_tf_vectors(DATA / f"{name}.json")
    count = {k: sum(s[0] == k for s in steps) for k in ("region", "alloc", "free", "oom",
                                                        "stats")}
    assert len(t.select("extend")) == count["region"]
    assert len(t.select("alloc")) == count["alloc"]
    assert len(t.select("free")) == count["free"]
    assert len(t.select("oom")) == count["oom"]
    assert len(t.meta["stats"]) == count["stats"]
    assert t.meta["memory_limit"] == raw["memory_limit"] == t.devices[0]["capacity"]
    assert t.meta["workload"] == raw["workload"] and t.meta["source"] == "tf-vectors"
    assert t.select("alloc").ptr.tolist() == [s[2] for s in steps if s[0] == "alloc"]
    assert t.select("alloc").requested.tolist() == [s[1] for s in steps if s[0] == "alloc"]
    assert t.select("oom").requested.tolist() == [s[1] for s in steps if s[0] == "oom"]
    assert (t.select(["alloc", "free"]).region != 0).all()
    calls = t.calls()
    assert calls.unmatched_frees == 0
    # time = step index * 1000; stats rows point at the event just before them
    idx = [i for i, s in enumerate(steps) if s[0] != "stats"]
    assert t.time_ns.tolist() == [i * 1000 for i in idx]
    for row, in_use, peak in t.meta["stats"][:50]:
        assert in_use <= peak
        if row >= 0:
            step_of_row = idx[row]
            assert steps[step_of_row + 1][0] == "stats" or steps[step_of_row][0] != "stats"


def test_tf_vectors_bad_step():
    bad = {"memory_limit": 1, "steps": [["region", 0, 1024], ["alloc", 4], ["free", 0]]}
    with pytest.raises(TraceFormatError, match="step 1"):
        gt.load_tf_vectors(bad)
    with pytest.raises(TraceFormatError, match="'steps' list"):
        gt.load_tf_vectors(io.StringIO("{\"x\": 1}"))


# ---------------------------------------------------------------------------- PyTorch
MB = 1 << 20
SEG_A, SEG_B, SEG_C, SEG_D = 0x7F00_0000_0000, 0x7F10_0000_0000, 0x7F20_0000_0000, \
    0x7E00_0000_0000


def torch_snapshot() -> dict:
    """A snapshot with a legacy block, both pending-free spellings, an oom and VMM maps."""
    def entry(action, addr, size, t, **kw):
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
                "frames": [{"filename": "train.py", "line": 3, "name": "step"}], **kw}

    trace0 = [
        entry("segment_alloc", SEG_A, 2 * MB, 100),
        entry("alloc", SEG_A, 512, 110),
        entry("alloc", SEG_A + 512, 1024, 120),
        entry("alloc", SEG_A + 1536, 2048, 130),
        entry("free_requested", SEG_A, 512, 140),
        entry("free_completed", SEG_A, 512, 150),
        entry("free_requested", SEG_A + 512, 1024, 160),
        entry("free_completed", SEG_B + 4096, 8192, 170),     # allocated before the trace
        {"action": "oom", "device_free": 12345, "size": 1 << 40, "stream": 0,
         "time_us": 180, "frames": []},
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 190},
        entry("segment_map", SEG_C, 2 * MB, 200),
        entry("alloc", SEG_C, 512, 210),
        entry("free_requested", SEG_C, 512, 215),
        entry("free_completed", SEG_C, 512, 220),
        entry("segment_unmap", SEG_C, 2 * MB, 230),
        entry("free_requested", SEG_A + 1536, 2048, 240),
    ]
    seg_a = {"device": 0, "address": SEG_A, "total_size": 2 * MB, "allocated_size": 3072,
             "active_size": 3072, "requested_size": 3000, "stream": 0,
             "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
             "frames": [], "blocks": [
                 {"address": SEG_A, "size": 512, "requested_size": 0, "state": "inactive",
                  "frames": []},
                 {"address": SEG_A + 512, "size": 1024, "requested_size": 1000,
                  "state": "active_pending_free", "frames": []},
                 {"address": SEG_A + 1536, "size": 2048, "requested_size": 2000,
                  "state": "active_awaiting_free", "frames": []},
                 {"address": SEG_A + 3584, "size": 2 * MB - 3584, "requested_size": 0,
                  "state": "inactive", "frames": []}]}
    seg_b_legacy = {"device": 0, "address": SEG_B, "total_size": MB,
                    "allocated_size": 4096, "active_size": 4096, "stream": 0,
                    "segment_type": "small", "blocks": [
                        {"size": 4096, "state": "active_allocated",
                         "history": [{"addr": SEG_B, "real_size": 4000, "frames": []}]},
                        {"size": MB - 4096, "state": "inactive", "history": []}]}
    seg_d = {"device": 1, "address": SEG_D, "total_size": 2 * MB, "stream": 0,
             "segment_type": "large", "segment_pool_id": (1, 0), "is_expandable": False,
             "blocks": [{"address": SEG_D, "size": 1536, "requested_size": 1500,
                         "state": "active_allocated", "frames": []}]}
    return {"segments": [seg_a, seg_b_legacy, seg_d], "device_traces": [trace0, []],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None, "max_split_size": -1,
                                   "roundup_power2_divisions": {"1": 0}},
            "external_annotations": []}


def check_torch_trace(t):
    assert [d["name"] for d in t.devices] == ["cuda:0", "cuda:1"]
    assert t.meta["source"] == "pytorch-snapshot"
    assert t.meta["free_requested"] == 4
    assert t.meta["pending_free_blocks"] == 2
    assert t.meta["reconstructed"] == {"segments": 2, "allocations": 3}
    assert t.meta["skipped_actions"] == {"snapshot": 1}
    assert t.meta["allocator_settings"]["max_split_size"] == -1
    d1 = t.select(device=1)
    assert kinds(d1) == [E, A]
    assert (d1[1].ptr, d1[1].size, d1[1].requested) == (SEG_D, 1536, 1500)
    d0 = t.select(device=0)
    assert kinds(d0) == [E, A, A,                       # reconstructed: segment B, 2 blocks
                         E, A, A, A, F, F, O, E, A, F, R]
    assert (d0[0].ptr, d0[0].size) == (SEG_B, MB)
    assert (d0[1].ptr, d0[1].size, d0[1].requested) == (SEG_B, 4096, 4000)   # legacy
    assert (d0[2].ptr, d0[2].size) == (SEG_B + 4096, 8192)
    assert d0[9].kind == O and d0[9].requested == 1 << 40
    assert t.meta["oom_device_free"] == [[int(np.flatnonzero(t.kind == int(O))[0]), 12345]]
    # live blocks take their requested size from the final segments
    live = {e.ptr: e.requested for e in d0 if e.kind == A}
    assert live[SEG_A + 512] == 1000 and live[SEG_A + 1536] == 2000 and live[SEG_A] == 512
    assert t.time_ns[t.kind == int(A)].min() == 0                  # device 1, no trace
    assert d0[4].time_ns == 110_000
    calls = t.calls()
    assert calls.unmatched_frees == 0
    assert (calls.op == 1).sum() == 7 and (calls.op == 2).sum() == 3


def test_torch_pickle_protocol_4(tmp_path):
    path = tmp_path / "snapshot.pickle"
    with open(path, "wb") as f:
        pickle.dump(torch_snapshot(), f, protocol=4)
    t = gt.load_torch_snapshot(path)
    check_torch_trace(t)
    assert gt.load_trace(path) == t
    with open(path, "rb") as f:
        assert gt.load_torch_snapshot(f) == t


def test_torch_json_form_equals_pickle(tmp_path):
    snap = torch_snapshot()
    p_json = tmp_path / "snapshot.json"
    p_json.write_text(json.dumps(snap))
    t = gt.load_torch_snapshot(p_json)
    check_torch_trace(t)
    assert t == gt.load_torch_snapshot(snap)
    p_old = tmp_path / "proto0.pickle"
    p_old.write_bytes(pickle.dumps(snap, protocol=0))
    assert gt.load_torch_snapshot(p_old) == t


def test_torch_segments_only_and_legacy_list():
    snap = torch_snapshot()
    del snap["device_traces"]
    t = gt.load_torch_snapshot(snap)
    d0 = t.select(device=0)
    assert kinds(d0) == [E, E, A, A, A]             # segments first, then blocks
    assert d0.ptr.tolist() == [SEG_A, SEG_B, SEG_A + 512, SEG_A + 1536, SEG_B]
    assert d0.requested.tolist()[2:] == [1000, 2000, 4000]
    assert (d0.region[2:] == [SEG_A, SEG_A, SEG_B]).all()
    assert gt.load_torch_snapshot(io.BytesIO(json.dumps(snap["segments"]).encode())) \
        .columns.keys() == t.columns.keys()
    assert len(gt.load_torch_snapshot({"segments": snap["segments"]})) == len(t)


def test_torch_malicious_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": Evil()}, protocol=4))
    with pytest.raises(TraceFormatError) as info:
        gt.load_torch_snapshot(path)
    text = str(info.value)
    assert "refusing to load" in text and str(path) in text and ".system" in text
    assert not marker.exists()
    with pytest.raises(TraceFormatError, match="refusing to load"):
        gt.load_trace(path)
    assert not marker.exists()


def test_torch_bad_inputs(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"hello": 1}))
    with pytest.raises(TraceFormatError, match="expected a PyTorch memory snapshot"):
        gt.load_torch_snapshot(p)
    p.write_bytes(b"\x80\x04garbage")
    with pytest.raises(TraceFormatError, match="readable pickle"):
        gt.load_torch_snapshot(p)
    snap = {"device_traces": [[{"action": "alloc", "size": 512}]]}
    with pytest.raises(TraceFormatError, match=r"device_traces\[0\]\[0\].*addr"):
        gt.load_torch_snapshot(snap)


@pytest.mark.parametrize("name, cut", [("pressure_104", None), ("random_101", 1500)])
def test_torch_export_round_trip(tmp_path, name, cut):
    t = gt.load_tf_vectors(DATA / f"{name}.json")
    if cut:
        t = t[:cut]                      # allocations still live at the end
    path = tmp_path / "export.json"
    gt.save_torch_snapshot(t, path)
    snap = json.loads(path.read_text())
    for seg in snap["segments"]:        # blocks tile their segment
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["blocks"][0]["address"] == seg["address"]
    back = gt.load_torch_snapshot(path)
    a, b = t.calls(), back.calls()
    for field in ("op", "key", "nbytes", "time_ns"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert back.meta["reconstructed"] == {"segments": 0, "allocations": 0}
    assert len(back.select("extend")) == len(t.select("extend"))
    live_blocks = sum(blk["state"] == "active_allocated" for s in snap["segments"]
                      for blk in s["blocks"])
    assert live_blocks == (a.op == 1).sum() - (a.op == 2).sum()

    pk = tmp_path / "export.pickle"
    gt.save_torch_snapshot(t, pk)
    assert pk.read_bytes()[:2] == b"\x80\x04"
    assert np.array_equal(gt.load_torch_snapshot(pk).calls().key, a.key)
    with pytest.raises(TraceFormatError, match="overwrite=True"):
        gt.save_torch_snapshot(t, pk)
    gt.save_torch_snapshot(t[:10], pk, overwrite=True)


# ---------------------------------------------------------------------------- RMM
def test_rmm_csv_midnight_nil_and_device_suffix():
    t = gt.load_rmm_csv(TRACES / "rmm_log.dev1.csv")
    assert [d["index"] for d in t.devices] == [1] and set(t.device.tolist()) == {1}
    assert t.meta["source"] == "rmm-csv"
    assert kinds(t) == [A, A, O, F, A, F, F, F]
    day = 86_400 * 10**9
    assert t.time_ns.tolist() == [
        day - 2_000_000, day - 1_000_000, day - 500_000,          # 23:59:59.998...
        day + 100_000, day + 50_000,                               # after midnight
        day + 1_600_000_000, day + 2_000_000_000, day + 2_100_000_000]
    assert t.meta["days"] == 1
    assert t[2].requested == 68719476736 and t[2].ptr == 0          # (nil) failure
    assert t.meta["null_frees"] == 1                                # (nil) free skipped
    assert t.meta["threads"] == 2 and t.meta["streams"] == 2
    calls = t.calls()
    assert calls.unmatched_frees == 1                               # freed before the log
    assert calls.op.tolist() == [1, 1, 7, 2, 1, 2, 2]
    assert calls.nbytes.tolist() == [1024, 4096, 68719476736, 1024, 512, 4096, 512]
    assert gt.load_rmm_csv(TRACES / "rmm_log.dev1.csv", device=5).device.tolist() == [5] * 8


def test_rmm_csv_column_order_errors_and_many_days(tmp_path):
    p = tmp_path / "log.csv"
    p.write_text("Stream,Size,Pointer,Action,Time,Thread,Extra\n"
                 "0x0,256,0x1000,allocate,12:00:00.000001,1,x\n"
                 "0x0,256,0x1000,free,23:30:00,1,x\n"
                 "0x0,256,0x1000,allocate,00:10:00.5,1,x\n"       # next day
                 "0x0,256,0x1000,free,11:00:00.000000,1,x\n"
                 "0x0,256,0x1000,allocate,10:00:00.000000,2,x\n")   # 1 h back: same day
    t = gt.load_rmm_csv(p)
    assert t.device.tolist() == [0] * 5 and t.meta["days"] == 1
    assert t.time_ns.tolist()[2] == (86_400 + 600) * 10**9 + 500_000_000
    p.write_text("Thread,Time,Action,Pointer,Size,Stream\n"
                 "1,00:00:00.1,allocate,0x10,256,0x0\n"
                 "1,00:00:00.2,allocate,0x20,lots,0x0\n")
    with pytest.raises(TraceFormatError, match=r"log.csv, line 3: Size 'lots'"):
        gt.load_rmm_csv(p)
    p.write_text("Thread,Time,Action,Size\n1,00:00:00.1,allocate,256\n")
    with pytest.raises(TraceFormatError, match=r"line 1: .*missing \['Pointer'\]"):
        gt.load_rmm_csv(p)
    p.write_text("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.1,reallocate,0x1,2,0\n")
    with pytest.raises(TraceFormatError, match="line 2: Action 'reallocate'"):
        gt.load_rmm_csv(p)
    stream = io.StringIO("Thread,Time,Action,Pointer,Size,Stream\n1,1:02:03.5,allocate,0x1,2,0\n")
    assert gt.load_rmm_csv(stream).time_ns.tolist() == [3723 * 10**9 + 500_000_000]


# ---------------------------------------------------------------------------- CuPy
def test_cupy_hook_jsonl():
    t = gt.load_cupy_hook(TRACES / "cupy_debug.jsonl")
    assert t.meta["source"] == "cupy-hook"
    assert [d["name"] for d in t.devices] == ["cuda:0", "cuda:1"]
    assert kinds(t) == [E, A, A, F, A, E, A, O, F, F, F]
    assert t.device.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert t.time_ns.tolist() == [1000, 2000, 3000, 4000, 5000, 7000, 8000, 9000, 10000,
                                  11000, 12000]       # line order (line 6 is blank)
    assert (t[1].requested, t[1].size) == (24, 512)
    assert (t[6].requested, t[6].size, t[6].region) == (2000000, 2000384, 150000000000000)
    assert (t[7].requested, t[7].size) == (4000000000, 4000000000)
    assert t[0].size == 1024 and t[5].size == 2097152
    calls = t.calls()
    assert calls.unmatched_frees == 0
    assert calls.nbytes.tolist() == [24, 300, 24, 500, 2000000, 4000000000, 2000000, 300, 500]
    assert t.summary()["peak_requested_bytes_by_device"] == {0: 800, 1: 2000000}


def test_cupy_hook_bad_line():
    with pytest.raises(TraceFormatError) as info:
        gt.load_cupy_hook(TRACES / "cupy_bad_line.jsonl")
    assert "cupy_bad_line.jsonl, line 4" in str(info.value)
    assert "strict=False" in str(info.value)
    t = gt.load_cupy_hook(TRACES / "cupy_bad_line.jsonl", strict=False)
    assert t.meta["skipped_lines"] == 1 and kinds(t) == [E, A, F, A, F]
    assert t.time_ns.tolist()[-1] == 6000
    with pytest.raises(TraceFormatError, match="line 1: 'malloc' record without"):
        gt.load_cupy_hook(io.BytesIO(b'{"hook":"malloc","device_id":0}\n'))
    with pytest.raises(TraceFormatError, match="line 2: not a hook record"):
        gt.load_cupy_hook(io.StringIO('\n{"hook":"realloc","device_id":0}\n'))
