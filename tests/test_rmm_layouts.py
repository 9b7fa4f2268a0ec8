"""RMM logs in their three layouts: with the header, rows without it (spark-rapids), and RMM
0.12's ``rmm.csv_log()``."""

from __future__ import annotations


import numpy as np
import pytest

from gpudash import TraceFormatError
from gpudash.events import EventKind
from gpudash.trace import load_trace
from gpudash.formats.io import sniff_format

from shared_files import EXTERNAL  # noqa: E402
needs_external = pytest.mark.skipif(not EXTERNAL.is_dir(), reason="../shared is absent")

HEADERLESS = ("1979932,14:21:19.998533,allocate,0x30a000000,256,0x2\n"
              "1979932,14:21:20.000100,allocate,0x30a000100,4096,0x2\n"
              "1980043,14:21:32.661875,free,0x30a000000,256,0x2\n")
RMM012 = ("Event Type,Device ID,Address,Stream,Size (bytes),Free Memory,Total Memory,"
          "Current Allocs,Start,End,Elapsed,Location\n"
          "Alloc,1,0x7f4b99a00000,0,1000,1047576,1048576,1,13.5,13.5,3.7e-06,x.py:1\n"
          "Alloc,1,0x7f4b99a00400,0,512,1047064,1048576,2,13.75,13.75,1e-06,x.py:2\n"
          "Free,1,0x7f4b99a00000,0,1000,1048064,1048576,1,14.0,14.0,1e-06,x.py:3\n")


def _kinds(trace):
    return [EventKind(k).name.lower() for k in trace.columns["kind"]]


def test_rows_without_a_header(tmp_path):
    path = tmp_path / "spark.log"
    path.write_text(HEADERLESS)
    assert sniff_format(path) == "rmm-csv"
    t = load_trace(path)
    assert _kinds(t) == ["alloc", "alloc", "free"]
    assert t.columns["ptr"].tolist() == [0x30a000000, 0x30a000100, 0x30a000000]
    assert t.columns["size"].tolist()[:2] == [256, 4096]
    assert t.duration_ns == 12_663_342_000


def test_rmm_012_csv_log(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text(RMM012)
    assert sniff_format(path) == "rmm-csv"
    t = load_trace(path)
    assert t.meta["layout"] == "rmm-0.12"
    assert _kinds(t) == ["alloc", "alloc", "free"]
    assert set(np.unique(t.columns["device"]).tolist()) == {1}  # from Device ID
    assert t.columns["time_ns"].tolist() == [13_500_000_000, 13_750_000_000, 14_000_000_000]
    assert t.columns["requested"].tolist()[:2] == [1000, 512]


def test_a_bad_row_of_the_old_layout_names_its_line(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text(RMM012.replace("Free,1,0x7f4b99a00000", "Realloc,1,0x7f4b99a00000"))
    with pytest.raises(TraceFormatError, match=r"line 4: Event Type 'Realloc'"):
        load_trace(path)


@needs_external
@pytest.mark.parametrize("name, allocs, frees", [
    ("rmm_spark_rapids_mem_debug_noheader.csv", 1, 1),
    ("rmm012_csv_log_issue281.csv", 1, 0),
    ("rmm_docs_record_replay_example.csv", 1, 1),
])
def test_real_rmm_logs_of_every_layout(name, allocs, frees):
    t = load_trace(EXTERNAL / name)
    s = t.summary()
    assert (s["allocations"], s["frees"]) == (allocs, frees)


# ------------------------------------------------------------------ PyTorch: expandable segments
def _reserved_peak(trace, dev):
    c = trace.columns
    m = c["device"] == dev
    k, s = c["kind"][m], c["size"][m]
    d = np.where(k == EventKind.EXTEND, s, 0) - np.where(k == EventKind.RELEASE, s, 0)
    run = np.cumsum(d)
    return int(run.max()), int(run.min())


def test_expandable_segments_unmapped_in_parts_make_no_phantom_segments():
    """A range mapped in the trace and unmapped in two parts at other addresses is not
    memory from before the trace; a part unmapped that the trace never mapped is."""
    from gpudash.trace import load_torch_snapshot

    mib = 1 << 20
    base = 1 << 40
    entries = [
        {"action": "segment_map", "addr": base, "size": 4 * mib, "time_us": 1},
        {"action": "segment_unmap", "addr": base + 2 * mib, "size": 2 * mib, "time_us": 2},
        {"action": "segment_unmap", "addr": base, "size": 2 * mib, "time_us": 3},
        # mapped before the trace began: only its unmap is seen
        {"action": "segment_unmap", "addr": base + 64 * mib, "size": 6 * mib, "time_us": 4},
    ]
    t = load_torch_snapshot({"segments": [], "device_traces": [entries]})
    peak, low = _reserved_peak(t, 0)
    assert peak == 10 * mib  # 6 MiB from before + the 4 MiB mapped
    assert low >= 0          # never more released than held


@needs_external
def test_code_location_device_1_reserved_peak_matches_memoryviz():
    t = load_trace(EXTERNAL / "code_location.memory_snapshot.pickle")
    assert _reserved_peak(t, 1)[0] == 84_202_749_952
