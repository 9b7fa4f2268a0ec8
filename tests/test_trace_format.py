"""The in-memory Trace, the .gdtrace file format (batches, truncation, damage) and load_trace."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest

import gpudash.trace as gt
from gpudash import GpudashWarning, TraceFormatError
from gpudash.events import COLUMN_DTYPES, COLUMNS, Event, EventKind
from gpudash.trace import Trace, TraceWriter, read_trace, write_trace
from gpudash.formats.format import MAGIC, bin_for_size, round_up_256
from gpudash.formats.io import sniff_format

DATA = Path(__file__).parent / "data"
TRACES = DATA / "traces"

A, F, E, L = (int(EventKind.ALLOC), int(EventKind.FREE), int(EventKind.EXTEND),
              int(EventKind.LIMIT))
O = int(EventKind.OOM)  # noqa: E741 - one letter like its neighbours, for rows of kinds


def make_trace(rows, meta=None, settings=None) -> Trace:
    """rows: (kind, ptr, size, requested, alloc_id, device) tuples; time = 10 * row."""
    n = len(rows)
    cols = {name: np.zeros(n, dtype=COLUMN_DTYPES[name]) for name in COLUMNS}
    for i, (kind, ptr, size, req, aid, dev) in enumerate(rows):
        cols["seq"][i] = i
        cols["time_ns"][i] = 10 * i
        cols["kind"][i] = kind
        cols["ptr"][i] = ptr
        cols["size"][i] = size
        cols["requested"][i] = req
        cols["alloc_id"][i] = aid
        cols["device"][i] = dev
        cols["bin"][i] = bin_for_size(size) if kind in (A, F, O) else -1
    return Trace(cols, meta, settings)


def sample_trace(n_allocs: int = 150) -> Trace:
    """A trace with regions, allocs and frees, an OOM and a limit change."""
    rng = np.random.default_rng(7)
    rows = [(E, 1 << 30, 1 << 24, 1 << 24, -1, 0)]
    live = []
    for i in range(1, n_allocs + 1):
        req = int(rng.integers(1, 100_000))
        rows.append((A, (1 << 30) + 4096 * i, round_up_256(req), req, i, 0))
        live.append(rows[-1])
        if i % 3 == 0:
            _, p, s, r, aid, d = live.pop(int(rng.integers(0, len(live))))
            rows.append((F, p, s, r, aid, d))
    rows.append((O, 0, 1 << 32, (1 << 32) - 5, -1, 0))
    rows.append((L, 0, 1 << 29, 1 << 30, -1, 0))
    meta = {"source": "test", "devices": [{"index": 0, "name": "GPU_0_bfc",
                                           "capacity": 1 << 34, "options": {"a": [1, 2]}}]}
    settings = [{"seq": len(rows) - 1, "setting": "memory_limit", "old": 1 << 30,
                 "new": 1 << 29}]
    return make_trace(rows, meta, settings)


# ---------------------------------------------------------------------------- Trace
def test_package_exports_exactly_the_public_names():
    assert sorted(gt.__all__) == sorted([
        "Trace", "TraceWriter", "read_trace", "write_trace", "load_trace", "save_trace",
        "load_tf_log", "load_tf_vectors", "load_vector_json", "load_torch_snapshot",
        "save_torch_snapshot", "load_rmm_csv", "load_cupy_hook", "replay", "ReplayResult",
        "min_fraction", "MinFractionResult", "sweep", "SweepTable", "load_xplane",
        "read_dumps", "top_holders", "diff_holders", "leaks", "replay_devices", "load_ranks"])
    for name in gt.__all__:
        assert getattr(gt, name) is not None


def test_empty_trace_has_every_column_with_its_dtype():
    t = Trace.empty()
    assert len(t) == 0
    assert list(t.columns) == list(COLUMNS)
    for name in COLUMNS:
        assert t.columns[name].dtype == np.dtype(COLUMN_DTYPES[name])
    assert t.meta["source"] == "gpudash" and t.meta["devices"] == []
    assert t.duration_ns == 0
    assert t.summary()["peak_requested_bytes"] == 0
    assert len(t.calls()) == 0


def test_trace_validates_columns():
    good = {name: [0, 1] for name in COLUMNS}
    assert len(Trace(good)) == 2
    with pytest.raises(TraceFormatError, match="missing \\['device'\\]"):
        Trace({k: v for k, v in good.items() if k != "device"})
    with pytest.raises(TraceFormatError, match="unknown \\['colour'\\]"):
        Trace({**good, "colour": [1, 2]})
    with pytest.raises(TraceFormatError, match="same length"):
        Trace({**good, "ptr": [1, 2, 3]})
    with pytest.raises(TraceFormatError, match="'kind'"):
        Trace({**good, "kind": [1, 300]})          # int8 column
    with pytest.raises(TraceFormatError, match="'size'"):
        Trace({**good, "size": [1.5, 2.0]})        # not integers
    t = Trace({**good, "size": np.array([1.0, 2.0])})
    assert t.size.dtype == np.int64 and t.size.tolist() == [1, 2]


def test_indexing_slicing_attributes_and_events():
    t = sample_trace()
    assert t.kind is t.columns["kind"]
    with pytest.raises(AttributeError):
        t.nonexistent  # noqa: B018
    e = t[1]
    assert isinstance(e, Event)
    assert e.kind == EventKind.ALLOC and e.alloc_id == 1 and e.allocator == "GPU_0_bfc"
    last = t[-1]
    assert last.kind == EventKind.LIMIT
    assert (last.setting, last.old, last.new) == ("memory_limit", 1 << 30, 1 << 29)
    with pytest.raises(IndexError):
        t[len(t)]
    part = t[10:20]
    assert isinstance(part, Trace) and len(part) == 10
    assert part.seq.tolist() == list(range(10, 20))      # slices keep seq
    assert part.meta == t.meta and part.settings == []
    assert t[-3:].settings == t.settings
    assert [ev.seq for ev in t[:3]] == [0, 1, 2]
    assert "events=" in repr(t) and len(repr(t)) < 200


def test_select_concat_devices_duration():
    t = sample_trace()
    allocs = t.select("alloc")
    assert len(allocs) == 150 and set(allocs.kind.tolist()) == {A}
    assert len(t.select([EventKind.ALLOC, "free"])) == 150 + 50
    assert len(t.select(kinds=E, device=0)) == 1
    assert len(t.select(device=3)) == 0
    with pytest.raises(ValueError, match="unknown event kind"):
        t.select("allocate")
    other = make_trace([(A, 5, 256, 10, 1, 1), (F, 5, 256, 10, 1, 1)],
                       meta={"devices": [{"index": 1, "name": "GPU_1_bfc", "capacity": None,
                                          "options": None}]})
    both = Trace.concat([t, other])
    assert len(both) == len(t) + 2
    assert both.seq.tolist() == list(range(len(both)))
    assert [d["name"] for d in both.devices] == ["GPU_0_bfc", "GPU_1_bfc"]
    assert both.settings == t.settings
    assert Trace.concat([t[:5], t[-1:]]).settings == [{**t.settings[0], "seq": 5}]
    assert t.duration_ns == 10 * (len(t) - 1)
    bare = make_trace([(A, 5, 256, 10, 1, 2)])
    assert bare.devices == [{"index": 2, "name": "device2", "capacity": None, "options": None}]


def test_summary_counts_and_peaks():
    rows = [(E, 0, 4096, 4096, -1, 0),
            (A, 0, 256, 100, 1, 0), (A, 256, 512, 300, 2, 0), (F, 0, 256, 100, 1, 0),
            (A, 0, 1024, 1000, 3, 0), (A, 9999, 256, 7, 4, 1), (O, 0, 1 << 20, 1 << 20, -1, 0),
            (F, 256, 512, 300, 2, 0), (F, 0, 1024, 1000, 3, 0)]
    s = make_trace(rows).summary()
    assert s["events"] == 9
    assert s["kinds"]["alloc"] == 4 and s["kinds"]["free"] == 3 and s["kinds"]["oom"] == 1
    assert s["kinds"]["extend"] == 1 and s["kinds"]["merge"] == 0
    assert (s["allocations"], s["frees"], s["ooms"]) == (4, 3, 1)
    assert s["devices"] == [0, 1]
    # running requested sum: 100, 400, 300, 1300, 1307 (peak), 1007, 7
    assert s["peak_requested_bytes"] == 1307
    assert s["peak_allocated_bytes"] == 512 + 1024 + 256
    assert s["peak_requested_bytes_by_device"] == {0: 1300, 1: 7}


def test_calls_pairs_frees_by_id_and_by_pointer():
    rows = [(E, 0, 1 << 20, 1 << 20, -1, 0),
            (A, 100, 256, 10, -1, 0),       # no id: key assigned
            (A, 200, 256, 20, 7, 0),
            (F, 100, 256, 0, -1, 0),        # paired by pointer; nbytes from its alloc
            (F, 555, 256, 99, -1, 0),       # matches nothing: dropped, counted
            (O, 0, 1 << 30, 1 << 30, -1, 0),
            (F, 200, 256, 20, 7, 0),
            (A, 100, 512, 30, -1, 0)]
    c = make_trace(rows).calls()
    assert c.op.tolist() == [1, 1, 2, 7, 2, 1]
    assert c.key.tolist() == [8, 7, 8, 0, 7, 9]
    assert c.nbytes.tolist() == [10, 20, 10, 1 << 30, 20, 30]
    assert c.time_ns.tolist() == [10, 20, 30, 50, 60, 70]
    assert c.row.tolist() == [1, 2, 3, 5, 6, 7]
    assert c.unmatched_frees == 1
    assert c.op.dtype == np.int8 and c.key.dtype == np.int64
    assert "unmatched_frees=1" in repr(c)


def test_calls_by_id_and_by_pointer_agree():
    t = gt.load_tf_vectors(DATA / "random_101.json")
    by_id = t.calls()
    cols = dict(t.columns)
    cols["alloc_id"] = np.full(len(t), -1, dtype=np.int64)
    by_ptr = Trace(cols, t.meta).calls()
    for field in ("op", "key", "nbytes", "time_ns", "row", "device"):
        assert np.array_equal(getattr(by_id, field), getattr(by_ptr, field)), field
    assert by_id.unmatched_frees == by_ptr.unmatched_frees == 0
    # a slice that starts mid-run: the frees of earlier allocations are dropped
    late = t[1000:].calls()
    assert late.unmatched_frees > 0
    assert (late.op == 2).sum() == (late.op == 1).sum() - (
        (t[1000:].kind == A).sum() - (t[1000:].kind == F).sum() + late.unmatched_frees)


def _calls_fields(c):
    return [getattr(c, f).tolist() for f in ("op", "key", "nbytes", "time_ns", "row",
                                             "device")] + [c.unmatched_frees]


@pytest.mark.parametrize("case", ["clean", "double free", "unknown id", "free first",
                                  "gap in ids", "two devices"])
def test_calls_with_ids_counting_up_pair_as_by_search_and_row_by_row(case):
    # Ids 1, 2, 3... (a recorder's, a snapshot's) pair each free with its alloc by offset;
    # the same Calls as shuffled ids (sorted and searched) and as no ids (row by row), and
    # a trace that offset pairing cannot take (a second free, an id never allocated, a free
    # before its alloc) is paired row by row, its odd frees dropped and counted.
    rng = np.random.default_rng(3)
    rows, live, nxt = [], [], 1
    for _ in range(300):
        if live and rng.random() < 0.45:
            aid, req = live.pop(int(rng.integers(len(live))))
            rows.append([F, 4096 * aid, round_up_256(req), req, aid, 0])
        else:
            req = int(rng.integers(1, 5000))
            rows.append([A, 4096 * nxt, round_up_256(req), req, nxt, 0])
            live.append((nxt, req))
            nxt += 1
    frees = [i for i, r in enumerate(rows) if r[0] == F]
    if case == "double free":
        rows.append(list(rows[frees[3]]))
    elif case == "unknown id":
        rows.append([F, 4096 * (nxt + 5), 256, 1, nxt + 5, 0])
    elif case == "free first":
        i = frees[0]
        first_alloc = next(j for j, r in enumerate(rows) if r[0] == A and r[4] == rows[i][4])
        rows.insert(first_alloc, rows.pop(i))
    elif case == "gap in ids":
        for r in rows:
            r[4] += 1000 * (r[4] > 50)
    elif case == "two devices":
        for r in rows:
            r[5] = r[4] % 2    # odd ids on device 1
    t = make_trace([tuple(r) for r in rows])
    got = _calls_fields(t.calls())
    # the same rows with the ids renamed by a random permutation: the sorted path
    perm = rng.permutation(2000) + 1
    cols = dict(t.columns)
    cols["alloc_id"] = np.where(cols["alloc_id"] > 0, perm[cols["alloc_id"] % 2000], -1)
    shuffled = _calls_fields(Trace(cols, t.meta).calls())
    assert got[0] == shuffled[0] and got[2:] == shuffled[2:]
    # no ids: frees paired with the live allocation at their pointer
    cols = dict(t.columns)
    cols["alloc_id"] = np.full(len(t), -1, dtype=np.int64)
    by_ptr = _calls_fields(Trace(cols, t.meta).calls())
    assert got[0] == by_ptr[0] and got[2:] == by_ptr[2:]
    expected = {"double free": 1, "unknown id": 1, "free first": 1}.get(case, 0)
    assert got[-1] == expected
    assert got[0].count(2) == len(frees) + (case == "double free") + (case == "unknown id") \
        - expected


def test_calls_per_device_and_colliding_ids():
    rows = [(A, 100, 256, 10, 1, 0), (A, 100, 256, 11, 1, 1),
            (F, 100, 256, 10, 1, 0), (F, 100, 256, 11, 1, 1)]
    t = make_trace(rows)
    c0 = t.calls(device=0)
    assert c0.key.tolist() == [1, 1] and c0.nbytes.tolist() == [10, 10]
    c = t.calls()
    assert c.unmatched_frees == 0
    assert c.key.tolist() == [1, (1 << 40) | 1, 1, (1 << 40) | 1]
    assert c.nbytes.tolist() == [10, 11, 10, 11]


def test_settings_matched_by_device_and_seq():
    # a Recorder of two allocators numbers each one's events from 0: seq alone is ambiguous
    t = make_trace([(A, 16, 256, 1, 1, 0), (L, 0, 100, 200, -1, 0),
                    (A, 16, 256, 1, 1, 1), (L, 0, 300, 400, -1, 1)])
    t.columns["seq"][:] = [0, 1, 0, 1]
    t.settings[:] = [{"device": 1, "seq": 1, "setting": "memory_limit", "old": 400, "new": 300},
                     {"device": 0, "seq": 1, "setting": "allow_growth", "old": 1, "new": 0}]
    assert t[1].setting == "allow_growth" and t[3].setting == "memory_limit"
    assert t[2:].settings == [t.settings[0]]
    assert t.select(device=0).settings == [t.settings[1]]
    both = Trace.concat([t[2:], t[:2]])
    assert [(s["seq"], s["setting"]) for s in both.settings] == [(1, "memory_limit"),
                                                                 (3, "allow_growth")]


@pytest.mark.core
def test_recorder_trace_round_trip(tmp_path):
    pytest.importorskip("gpudash.bfc")
    from gpudash import BFCAllocator, Recorder, SimulatedDevice

    a = BFCAllocator(SimulatedDevice(1 << 30), 1 << 30, name="GPU_0_bfc")
    with Recorder(a) as rec:
        ptrs = [a.allocate(1000 * i + 1) for i in range(1, 40)]
        for p in ptrs[::2]:
            a.deallocate(p)
    t = rec.to_trace()
    write_trace(t, tmp_path / "rec.gdtrace")
    back = read_trace(tmp_path / "rec.gdtrace")
    assert back == t
    calls = back.calls()
    assert (calls.op == 1).sum() == 39 and (calls.op == 2).sum() == 20
    assert calls.unmatched_frees == 0
    assert calls.nbytes[calls.op == 1].tolist() == [1000 * i + 1 for i in range(1, 40)]


# ---------------------------------------------------------------------------- file format
def test_write_read_round_trip(tmp_path):
    t = sample_trace()
    path = tmp_path / "run.gdtrace"
    write_trace(t, path)
    back = read_trace(path)
    assert back == t
    assert back.settings == t.settings
    assert back[-1].setting == "memory_limit"
    for name in COLUMNS:
        assert back.columns[name].dtype == np.dtype(COLUMN_DTYPES[name])
    with open(path, "rb") as f:     # a file object works too
        assert read_trace(f) == t
    empty = tmp_path / "empty.gdtrace"
    write_trace(Trace.empty({"source": "x"}), empty)
    assert read_trace(empty) == Trace.empty({"source": "x"})


def test_write_refuses_to_overwrite(tmp_path):
    path = tmp_path / "run.gdtrace"
    write_trace(sample_trace(), path)
    with pytest.raises(TraceFormatError) as info:
        write_trace(sample_trace(5), path)
    assert str(path) in str(info.value) and "overwrite=True" in str(info.value)
    with pytest.raises(TraceFormatError, match="overwrite=True"):
        TraceWriter(path, {})
    write_trace(sample_trace(5), path, overwrite=True)
    assert read_trace(path) == sample_trace(5)


def test_meta_must_be_json(tmp_path):
    with pytest.raises(TraceFormatError, match="JSON"):
        write_trace(Trace.empty({"bad": object()}), tmp_path / "x.gdtrace")
    t = Trace.empty({"n": np.int64(3), "arr": np.arange(2)})   # numpy values are converted
    write_trace(t, tmp_path / "y.gdtrace")
    assert read_trace(tmp_path / "y.gdtrace").meta["arr"] == [0, 1]


def test_writer_batches_by_count_and_time(tmp_path):
    t = sample_trace()
    path = tmp_path / "w.gdtrace"
    with TraceWriter(path, t.meta, batch_events=40, flush_interval=3600) as w:
        for i in range(0, len(t), 7):
            w.append(t[i:i + 7])
        assert w.batches_written == 4          # 7-row appends: a batch once 40+ wait
        w.update_meta(note="halfway")
    assert w.closed and "closed" in repr(w)
    back = read_trace(path)
    assert back.columns.keys() == t.columns.keys()
    assert all(np.array_equal(back.columns[n], t.columns[n]) for n in COLUMNS)
    assert back.meta["note"] == "halfway" and back.settings == t.settings
    with pytest.raises(ValueError, match="closed"):
        w.append(t)

    path2 = tmp_path / "w2.gdtrace"
    w2 = TraceWriter(path2, t.meta, flush_interval=0.0)
    w2.append(t[:10])
    w2.append(dict(t[10:20].columns))
    assert w2.batches_written == 2 and w2.events_written == 20
    # not closed: the file is readable, with a warning that the writer did not finish
    with pytest.warns(GpudashWarning, match="no end record"):
        part = read_trace(path2)
    assert part.seq.tolist() == list(range(20))
    w2.close()
    w2.close()   # idempotent


def _batched_file(tmp_path, t, per_batch):
    """Write ``t`` in batches of ``per_batch`` rows; return (path, meta end, batch ends)."""
    path = tmp_path / "batched.gdtrace"
    w = TraceWriter(path, t.meta, batch_events=per_batch, flush_interval=3600)
    meta_end = os.path.getsize(path)
    ends = []
    for i in range(0, len(t), per_batch):
        w.append(t[i:i + per_batch])
        w.flush()
        ends.append(os.path.getsize(path))
    w.close()
    return path, meta_end, ends


def test_truncated_at_every_97th_byte_reads_complete_batches(tmp_path):
    t = sample_trace(120)
    per = 30
    path, meta_end, ends = _batched_file(tmp_path, t, per)
    data = path.read_bytes()
    assert len(ends) >= 5
    cut_path = tmp_path / "cut.gdtrace"
    checked = 0
    for off in range(0, len(data), 97):
        cut_path.write_bytes(data[:off])
        if off < meta_end:
            with pytest.raises(TraceFormatError, match=str(cut_path)):
                read_trace(cut_path)
            continue
        complete = sum(e <= off for e in ends)
        with pytest.warns(GpudashWarning) as rec:
            got = read_trace(cut_path)
        msg = str(rec[0].message)
        if off not in ends and off != meta_end:
            assert f"ignored {off - [meta_end, *ends][complete]} bytes" in msg
        expected = t[:min(complete * per, len(t))]
        assert len(got) == len(expected)
        assert all(np.array_equal(got.columns[n], expected.columns[n]) for n in COLUMNS)
        assert got.meta == t.meta
        checked += 1
    assert checked > 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_trace(path) == t     # the whole file: no warning


def test_damaged_later_record_keeps_what_came_before(tmp_path):
    t = sample_trace(120)
    path, _, ends = _batched_file(tmp_path, t, 30)
    data = bytearray(path.read_bytes())
    data[ends[1] + 100] ^= 0xFF                   # inside the third batch
    path.write_bytes(bytes(data))
    with pytest.warns(GpudashWarning, match=f"from byte offset {ends[1]} \\(record 3: crc32"):
        got = read_trace(path)
    assert got.seq.tolist() == t[:60].seq.tolist()


def test_damaged_first_record_or_magic_is_an_error(tmp_path):
    path = tmp_path / "run.gdtrace"
    write_trace(sample_trace(), path)
    data = bytearray(path.read_bytes())
    bad = bytearray(data)
    bad[len(MAGIC) + 30] ^= 0x55                 # inside the metadata JSON
    path.write_bytes(bytes(bad))
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    text = str(info.value)
    assert str(path) in text and f"byte offset {len(MAGIC)}" in text
    assert "record 0 (metadata)" in text and "crc32" in text

    bad = bytearray(data)
    bad[len(MAGIC)] = ord("X")                   # record marker
    path.write_bytes(bytes(bad))
    with pytest.raises(TraceFormatError, match="expected the record marker"):
        read_trace(path)

    path.write_bytes(b"GPUDASH-TRACE 9\n" + bytes(data[len(MAGIC):]))
    with pytest.raises(TraceFormatError, match="is not a gpudash trace"):
        read_trace(path)
    with pytest.raises(TraceFormatError, match=r"random_101\.json is not a gpudash trace"):
        read_trace(DATA / "random_101.json")


def test_golden_file_still_reads(tmp_path):
    """tests/data/traces/golden_v1.gdtrace pins the file format: it must always read back."""
    expected = _golden_source()
    got = read_trace(TRACES / "golden_v1.gdtrace")
    assert all(np.array_equal(got.columns[n], expected.columns[n]) for n in COLUMNS)
    assert {k: v for k, v in got.meta.items() if k != "gpudash_version"} == \
        {k: v for k, v in expected.meta.items() if k != "gpudash_version"}
    assert got.settings == expected.settings
    assert got.meta["gpudash_version"] == "0.1.0"


def _golden_source() -> Trace:
    base = gt.load_tf_vectors(DATA / "pressure_104.json")[:40]
    base.meta["stats"] = base.meta["stats"][:5]
    limit = make_trace([(L, 0, 1 << 24, 1 << 25, -1, 0)])
    t = Trace.concat([base, limit])
    t.settings.append({"seq": 40, "setting": "memory_limit", "old": 1 << 25, "new": 1 << 24})
    t.meta["gpudash_version"] = "0.1.0"
    return t


# ---------------------------------------------------------------------------- load/save_trace
@pytest.mark.parametrize("name, fmt", [
    ("random_101.json", "tf-vectors"),
    ("fragment_202.log", "tf-log"),
    ("traces/rmm_log.dev1.csv", "rmm-csv"),
    ("traces/cupy_debug.jsonl", "cupy-hook"),
    ("traces/golden_v1.gdtrace", "gdtrace"),
    ("traces/tf_gpu_two_allocators.log", "tf-log"),
])
def test_sniff_format(name, fmt):
    assert sniff_format(DATA / name) == fmt
    assert len(gt.load_trace(DATA / name)) > 0


def test_load_trace_sniffs_torch_and_refuses_unknown(tmp_path):
    t = gt.load_tf_vectors(DATA / "pressure_104.json")
    for fmt, suffix in (("torch-json", ".json"), ("torch-pickle", ".pickle")):
        p = tmp_path / f"snap{suffix}"
        gt.save_trace(t, p, format=fmt)
        assert sniff_format(p) == fmt
        back = gt.load_trace(p)
        assert back.meta["source"] == "pytorch-snapshot"
        assert np.array_equal(back.calls().nbytes, t.calls().nbytes)
        with pytest.raises(TraceFormatError, match="overwrite=True"):
            gt.save_trace(t, p, format=fmt)
    p = tmp_path / "t.gdtrace"
    gt.save_trace(t, p)
    assert gt.load_trace(p) == t
    with pytest.raises(TraceFormatError, match=f"{p} already exists"):
        gt.save_trace(t, p)
    gt.save_trace(t[:3], p, overwrite=True)
    assert len(gt.load_trace(p, format="gdtrace")) == 3
    with pytest.raises(TraceFormatError, match="cannot save as 'csv'"):
        gt.save_trace(t, tmp_path / "x.csv", format="csv")

    odd = tmp_path / "notes.txt"
    odd.write_text("hello\nworld\n")
    with pytest.raises(TraceFormatError) as info:
        gt.load_trace(odd)
    for fmt in ("gdtrace", "tf-log", "tf-vectors", "torch-pickle", "torch-json", "rmm-csv",
                "cupy-hook"):
        assert fmt in str(info.value)
    with pytest.raises(TraceFormatError, match="unknown trace format 'xml'"):
        gt.load_trace(odd, format="xml")


# ---------------------------------------------------------------------------- crafted records
def _crafted(tmp_path, *records):
    """A .gdtrace of a valid metadata record then ``records`` ((type, header, payload)),
    each with a correct crc, so only the reader's own checks can refuse them."""
    from gpudash.formats.format import _record

    data = MAGIC + _record(1, {"format": "crafted"})
    for rtype, header, payload in records:
        data += _record(rtype, header, payload)
    path = tmp_path / "crafted.gdtrace"
    path.write_bytes(data)
    return path


def _batch_header_and_payload(settings=None, spoil=None):
    import io as _io

    from numpy.lib import format as npformat

    payload, layout = _io.BytesIO(), []
    for name in COLUMNS:
        start = payload.tell()
        npformat.write_array(payload, np.zeros(1, dtype=COLUMN_DTYPES[name]),
                             allow_pickle=False)
        layout.append([name, start, payload.tell() - start])
    data = payload.getvalue()
    if spoil is not None:
        data = spoil(data, layout)
    return {"n": 1, "columns": layout, "settings": settings if settings is not None else []}, data


@pytest.mark.parametrize("settings", [5, "abc", {"a": 1}, [1, 2]])
def test_crafted_batch_with_non_list_settings_is_a_format_error(tmp_path, settings):
    header, payload = _batch_header_and_payload(settings)
    path = _crafted(tmp_path, (2, header, payload))
    with pytest.raises(TraceFormatError, match=r"crafted\.gdtrace: record 1 .*'settings'"):
        read_trace(path)
    with pytest.raises(TraceFormatError, match="record 1"):
        gt.load_trace(path)


def test_crafted_metadata_update_that_is_a_list_is_a_format_error(tmp_path):
    path = _crafted(tmp_path, (3, [1, 2, 3], b""))
    with pytest.raises(TraceFormatError, match=r"record 1 \(metadata update\).*JSON object"):
        gt.load_trace(path)


def test_crafted_bad_npy_header_is_a_format_error(tmp_path):
    def spoil(data, layout):  # the first column's header dict made unparseable
        start = layout[0][1]
        i = data.index(b"{", start)
        return data[:i] + b"{'descr': <i8'," + data[i + 15:]
    header, payload = _batch_header_and_payload(spoil=spoil)
    path = _crafted(tmp_path, (2, header, payload))
    with pytest.raises(TraceFormatError, match=r"record 1 .*column 'seq' is not valid \.npy"):
        gt.load_trace(path)


def test_columns_are_aligned_writable_views_of_the_file_buffer(tmp_path):
    from gpudash.workloads import training_loop

    t = training_loop(steps=2, layers=3, batch=8, hidden=256)
    path = tmp_path / "t.gdtrace"
    write_trace(t, path)
    back = read_trace(path)
    assert back == t
    for name, col in back.columns.items():
        assert not col.flags.owndata, name  # a view into the one read buffer: no copy
        assert col.flags.aligned and col.flags.writeable, name
    back.columns["ptr"][0] += 0  # writable
    # a file object gives read-only bytes: the columns are then copies, still writable
    with open(path, "rb") as f:
        again = read_trace(f)
    assert again == t and again.columns["ptr"].flags.writeable
