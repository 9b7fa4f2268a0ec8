"""PyTorch snapshots keep their call stacks: every trace entry's frames (with its
compile_context and user_metadata) become its row's stack, rebuilt allocations take their
final block's frames, and record_function annotations are kept as ranges.

Real snapshots from other people's projects (../shared/reference/external, skipped when
absent) and small synthetic ones for the edge cases."""

from __future__ import annotations

import io
import json
import pickle
import random

import numpy as np
import pytest

from gpudash import TraceFormatError
from gpudash.events import EventKind
from gpudash.trace import load_trace
from gpudash.formats.stacks import Frame
from gpudash.formats.torch_snapshot import load_torch_snapshot, load_torch_snapshot_dict


from shared_files import EXTERNAL  # noqa: E402
SNAPSHOTS = sorted(p.name for p in EXTERNAL.glob("*.p*k*l*")) if EXTERNAL.is_dir() else []
needs_external = pytest.mark.skipif(not SNAPSHOTS, reason="../shared/reference/external "
                                                          "is not here")
ROW_ACTIONS = {"alloc", "free_completed", "segment_alloc", "segment_free", "segment_map",
               "segment_unmap", "oom"}


def _frames(raw) -> list[Frame]:
    return [Frame(f["filename"], f["line"], f["name"]) for f in raw or ()]


def _entry_rows(trace, snap) -> dict[tuple[int, int], int]:
    """(device, index in device_traces[device]) -> trace row, for entries that make rows:
    a device's rows after its rebuilt prefix, in the order of (time, index)."""
    prefix = trace.meta["torch"]["prefix"]
    out = {}
    for dev, lst in enumerate(snap.get("device_traces") or []):
        rows = np.flatnonzero(trace.columns["device"] == dev)[prefix.get(str(dev), 0):]
        order = sorted((e.get("time_us") or 0, i) for i, e in enumerate(lst)
                       if e["action"] in ROW_ACTIONS)
        assert len(order) == len(rows)
        out.update({(dev, i): int(r) for (_, i), r in zip(order, rows)})
    return out


# ------------------------------------------------------------------ real snapshots
@needs_external
@pytest.mark.parametrize("name", SNAPSHOTS)
def test_every_entry_with_frames_has_its_stack(name):
    snap = load_torch_snapshot_dict(EXTERNAL / name)
    trace = load_trace(EXTERNAL / name)
    rows = _entry_rows(trace, snap)
    ids = trace.stack_ids()
    with_frames = 0
    for (dev, i), row in rows.items():
        e = snap["device_traces"][dev][i]
        if e.get("frames"):
            with_frames += 1
            assert ids[row] >= 0, (dev, i)
        elif not e.get("user_metadata") and e.get("compile_context", "N/A") == "N/A":
            assert ids[row] == -1, (dev, i)
    # a random sample: the frames, compile context and user metadata are PyTorch's
    rng = random.Random(name)
    for dev, i in rng.sample(sorted(rows), min(300, len(rows))):
        e = snap["device_traces"][dev][i]
        row = rows[(dev, i)]
        assert trace.frames_of(row) == _frames(e.get("frames")), (dev, i)
        st = trace.stack_of(row)
        if st is not None:
            assert st.compile_context == e.get("compile_context", "")
            assert st.user_metadata == e.get("user_metadata", "")
    assert int((ids[list(rows.values())] >= 0).sum()) >= with_frames


@needs_external
@pytest.mark.parametrize("name, entries, rows_with_stacks", [
    ("DeComFL.memory.pickle", 23105, 15556),
    ("code_location.memory_snapshot.pickle", 7923, 5624),
    ("ftcourse.memory_snapshot.pickle", 10307, 6982),
    ("cs336_MAGMA27.memory_snapshot.pickle", 5163, 1038),
])
def test_stack_counts_of_real_snapshots(name, entries, rows_with_stacks):
    if name not in SNAPSHOTS:
        pytest.skip(f"{name} is not here")
    snap = load_torch_snapshot_dict(EXTERNAL / name)
    trace = load_trace(EXTERNAL / name)
    traces = snap["device_traces"]
    assert sum(len(t) for t in traces) == entries
    framed = sum(1 for t in traces for e in t if e["action"] in ROW_ACTIONS and e["frames"])
    rebuilt = sum(trace.meta["torch"]["prefix"].values())
    ids = trace.stack_ids()
    assert int((ids >= 0).sum()) == rows_with_stacks
    # every framed entry, plus rebuilt allocations and segments with final frames
    assert framed <= rows_with_stacks <= framed + rebuilt
    # one frame per distinct (filename, line, name), one stack per distinct call
    distinct = {(f["filename"], f["line"], f["name"]) for t in traces for e in t
                if e["action"] in ROW_ACTIONS for f in e["frames"]}
    assert {tuple(f) for f in trace.stacks.frames} >= distinct
    assert len(trace.stacks.frames) == len(set(trace.stacks.frames))
    assert len(trace.stacks.stacks) == len(set(trace.stacks.stacks))


@needs_external
def test_the_first_snapshot_entries_named_in_the_issue_all_have_stacks():
    # DeComFL: 23,105 of 23,105 events; code_location: 6,445 of 6,445 (device 0);
    # ftcourse: 10,307 of 10,307 (C++ frames included)
    for name, dev, n in (("DeComFL.memory.pickle", 0, 23105),
                         ("code_location.memory_snapshot.pickle", 0, 6445),
                         ("ftcourse.memory_snapshot.pickle", 0, 10307)):
        snap = load_torch_snapshot_dict(EXTERNAL / name)
        trace = load_trace(EXTERNAL / name)
        lst = snap["device_traces"][dev]
        assert len(lst) == n and all(e["frames"] for e in lst)
        rows = _entry_rows(trace, snap)
        assert all(trace.stack_ids()[r] >= 0 for (d, _), r in rows.items() if d == dev)
    cpp = [f for f in trace.stacks.frames if f.filename.endswith(".cpp")]
    assert cpp and any("CUDACachingAllocator" in f.filename for f in cpp)


@needs_external
@pytest.mark.parametrize("name, dev, framed", [
    ("cs336_notHanmin.memory_snapshot.pickle", "0", 656),     # a trace that starts mid-run
    ("LayoutEditing.memory_snapshot.pkl", "1", 805),          # no trace: segments only
])
def test_rebuilt_allocations_of_a_real_snapshot_take_their_blocks_frames(name, dev, framed):
    snap = load_torch_snapshot_dict(EXTERNAL / name)
    trace = load_trace(EXTERNAL / name)
    segments = snap["segments"] if isinstance(snap["segments"], list) else snap
    final = {b["address"]: b for s in segments for b in s["blocks"]
             if b["state"] == "active_allocated"}
    traced = {e["addr"] for t in snap.get("device_traces") or [] for e in t}
    c = trace.columns
    checked = 0
    for row in range(trace.meta["torch"]["prefix"][dev]):
        p = int(c["ptr"][row])
        if c["kind"][row] == EventKind.ALLOC and p in final and p not in traced:
            assert trace.frames_of(row) == _frames(final[p]["frames"])
            checked += bool(final[p]["frames"])
    assert checked == framed


@needs_external
def test_annotations_of_a_real_snapshot_are_ranges_by_time():
    snap = load_torch_snapshot_dict(EXTERNAL / "DeComFL.memory.pickle")
    ann = load_trace(EXTERNAL / "DeComFL.memory.pickle").meta["annotations"]
    raw = snap["external_annotations"]
    assert len(ann["ranges"]) * 2 == len(raw)
    first = raw[0]
    dev, nid, start, end = ann["ranges"][0]
    assert (dev, ann["names"][nid], start) == (0, first["name"], first["time_us"] * 1000)
    assert end == next(a["time_us"] for a in raw if a["name"] == first["name"]
                       and a["stage"] == "END") * 1000
    json.dumps(ann)


# ------------------------------------------------------------------ synthetic edge cases
F1 = {"filename": "train.py", "line": 10, "name": "step"}
F2 = {"filename": "model.py", "line": 20, "name": "forward"}
F3 = {"filename": "CUDACachingAllocator.cpp", "line": 0, "name": "malloc"}


def _snap(entries, segments=(), **extra) -> dict:
    return {"segments": list(segments), "device_traces": [list(entries)], **extra}


def _seg(addr, size, blocks, frames=()):
    return {"device": 0, "address": addr, "total_size": size, "stream": 0,
            "segment_type": "large", "is_expandable": False, "frames": list(frames),
            "blocks": blocks}


def test_frames_compile_context_and_user_metadata_are_kept_as_pytorch_wrote_them():
    shared = [F2, F1]
    snap = _snap([
        {"action": "segment_alloc", "addr": 0, "size": 2 << 20, "stream": 0, "time_us": 1,
         "frames": shared, "compile_context": "N/A"},
        {"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 1,
         "frames": shared, "compile_context": "N/A"},
        {"action": "alloc", "addr": 512, "size": 512, "stream": 0, "time_us": 2,
         "frames": [F3, F2, F1], "compile_context": "[0/1]", "user_metadata": "step 3"},
        {"action": "free_requested", "addr": 0, "size": 512, "stream": 0, "time_us": 3,
         "frames": [F1]},
        {"action": "free_completed", "addr": 0, "size": 512, "stream": 0, "time_us": 3,
         "frames": [F1]},
        {"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 4},      # no key
        {"action": "free_completed", "addr": 0, "size": 512, "stream": 0, "time_us": 5,
         "frames": [], "compile_context": "N/A"},                                   # empty
        {"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 6,
         "frames": [], "user_metadata": "only metadata"},
    ])
    t = load_torch_snapshot(snap)
    assert t.stack is not None and len(t) == 7
    assert t.frames_of(0) == t.frames_of(1) == [Frame("model.py", 20, "forward"),
                                                  Frame("train.py", 10, "step")]
    assert t.stack_of(0) == t.stack_of(1) and t.stack_of(0).compile_context == "N/A"
    assert t.frames_of(2)[0] == Frame("CUDACachingAllocator.cpp", 0, "malloc")
    assert t.stack_of(2)[1:] == ("[0/1]", "step 3")
    # a free carries its own stack (where it was freed), not its allocation's
    assert t.columns["kind"][3] == EventKind.FREE
    assert t.frames_of(3) == [Frame("train.py", 10, "step")]
    assert t.stack_ids()[4:6].tolist() == [-1, -1]     # no frames key; empty frames
    assert t.stack_of(6) == ((), "", "only metadata")
    # one frame per distinct frame, one stack per distinct stack
    assert len(t.stacks.frames) == 3 and len(t.stacks) == 4
    # equal frames given as separate objects (JSON) intern the same
    assert load_torch_snapshot(json.loads(json.dumps(snap))) == t


def test_a_snapshot_without_frames_has_no_stack_column():
    snap = _snap([{"action": "alloc", "addr": 0, "size": 512, "stream": 0},
                  {"action": "free_completed", "addr": 0, "size": 512, "stream": 0,
                   "frames": []}])
    t = load_torch_snapshot(snap)
    assert t.stack is None and t.stack_ids().tolist() == [-1, -1] and not len(t.stacks)


def test_rebuilt_blocks_and_segments_take_their_final_frames():
    blocks = [{"address": 0, "size": 1024, "requested_size": 1000,
               "state": "active_allocated", "frames": [F2, F1]},
              {"address": 1024, "size": 1024, "requested_size": 1024,
               "state": "active_allocated", "frames": []},
              {"address": 2048, "size": (2 << 20) - 2048, "state": "inactive", "frames": []}]
    # no trace at all: the final state, each allocation with its block's frames
    t = load_torch_snapshot({"segments": [_seg(0, 2 << 20, blocks, [F1])]})
    kinds = t.columns["kind"].tolist()
    assert kinds == [EventKind.EXTEND, EventKind.ALLOC, EventKind.ALLOC]
    assert t.frames_of(0) == [Frame("train.py", 10, "step")]
    assert t.frames_of(1) == _frames([F2, F1])
    assert t.stack_ids()[2] == -1
    # a ring buffer that started mid-run: the block freed in the trace was allocated before
    # it, but where is not recorded (its free's frames say where it was freed)
    trace = [{"action": "free_completed", "addr": 4096, "size": 512, "stream": 0,
              "time_us": 5, "frames": [F3]},
             {"action": "alloc", "addr": 1024, "size": 1024, "stream": 0, "time_us": 6,
              "frames": [F3, F1]}]
    blocks[1]["frames"] = [F3, F1]
    t = load_torch_snapshot(_snap(trace, [_seg(0, 2 << 20, blocks, [F1])]))
    assert t.meta["reconstructed"] == {"segments": 1, "allocations": 2}
    rows = {(int(k), int(p)): r for r, (k, p) in enumerate(zip(t.columns["kind"],
                                                               t.columns["ptr"]))}
    assert t.frames_of(rows[(EventKind.EXTEND, 0)]) == _frames([F1])
    assert t.frames_of(rows[(EventKind.ALLOC, 0)]) == _frames([F2, F1])    # from the block
    assert t.stack_ids()[rows[(EventKind.ALLOC, 4096)]] == -1    # rebuilt from its free
    assert t.frames_of(rows[(EventKind.FREE, 4096)]) == _frames([F3])
    assert t.frames_of(rows[(EventKind.ALLOC, 1024)]) == _frames([F3, F1])   # the entry's


def test_legacy_history_frames_are_kept():
    legacy = [{"device": 0, "address": 0, "total_size": 2 << 20, "stream": 0,
               "blocks": [{"size": 1024, "requested_size": 1000, "state": "active_allocated",
                           "history": [{"addr": 0, "real_size": 1000, "frames": [F1]},
                                       {"addr": 0, "real_size": 900, "frames": [F2, F1]}]},
                          {"size": (2 << 20) - 1024, "state": "inactive"}]}]
    t = load_torch_snapshot({"segments": legacy})
    assert t.columns["requested"][1] == 1000
    assert t.frames_of(1) == _frames([F2, F1])       # the latest allocation's frames
    t = load_torch_snapshot(legacy[:0] or {"segments": [
        {**legacy[0], "blocks": [{**legacy[0]["blocks"][0], "history": []},
                                 legacy[0]["blocks"][1]]}]})
    assert t.stack is None


def test_pickled_snapshots_with_shared_frames_load_as_their_json(tmp_path):
    snap = _snap([{"action": "alloc", "addr": 512 * i, "size": 512, "stream": 0,
                   "time_us": i, "frames": [F1, F2] if i % 2 else [F2]} for i in range(50)])
    (tmp_path / "s.pickle").write_bytes(pickle.dumps(snap, protocol=4))
    (tmp_path / "s.json").write_text(json.dumps(snap))
    a, b = load_trace(tmp_path / "s.pickle"), load_trace(tmp_path / "s.json")
    assert a == b and len(a.stacks) == 2 and len(a.stacks.frames) == 2


@pytest.mark.parametrize("entry, match", [
    ({"frames": "train.py"}, r"device_traces\[0\]\[0\]\.frames: expected a list"),
    ({"frames": [{"filename": "a.py", "line": "10", "name": "f"}]},
     r"device_traces\[0\]\[0\]\.frames\[0\]: expected a frame"),
    ({"frames": [F1, 7]}, r"frames\[1\]: expected a frame"),
    ({"frames": [F1], "compile_context": 3}, r"compile_context: expected a string"),
    ({"frames": [F1], "user_metadata": ["x"]}, r"user_metadata: expected a string"),
])
def test_bad_frames_are_refused_naming_the_entry(entry, match):
    snap = _snap([{"action": "alloc", "addr": 0, "size": 512, "stream": 0, **entry}])
    with pytest.raises(TraceFormatError, match=match):
        load_torch_snapshot(snap)


def test_annotations_are_kept_as_ranges():
    ann = [{"name": "fwd", "stage": "START", "device": 0, "time_us": 10},
           {"name": "fwd", "stage": "START", "device": 0, "time_us": 12},   # nested
           {"name": "fwd", "stage": "END", "device": 0, "time_us": 15},
           {"name": "bwd", "stage": "END", "device": 1, "time_us": 16},     # began before
           {"name": "fwd", "stage": "END", "device": 0, "time_us": 20},
           {"name": "opt", "stage": "START", "device": 0, "time_us": 30}]   # never ended
    t = load_torch_snapshot(_snap([{"action": "alloc", "addr": 0, "size": 512}],
                                  external_annotations=ann))
    assert t.meta["annotations"] == {
        "names": ["fwd", "bwd", "opt"],
        "ranges": [[0, 0, 10_000, 20_000], [0, 0, 12_000, 15_000], [1, 1, None, 16_000],
                   [0, 2, 30_000, None]]}
    assert "annotations" not in load_torch_snapshot(_snap([])).meta
    with pytest.raises(TraceFormatError, match=r"external_annotations\[0\]: expected a 'name'"):
        load_torch_snapshot(_snap([], external_annotations=[{"stage": "BEGIN"}]))
    # annotations count against the bound on what a file may expand to
    many = pickle.dumps(_snap([], external_annotations=[ann[0]] * 100_000), protocol=4)
    with pytest.raises(TraceFormatError, match="bound on what one import may expand"):
        load_torch_snapshot(io.BytesIO(many))


# ------------------------------------------------------------------ exports and replays
def _resolved(trace) -> list:
    """Each row's stack as (frames, compile_context, user_metadata), None for none."""
    out = []
    for i in range(len(trace)):
        st = trace.stack_of(i)
        out.append(None if st is None else (tuple(trace.frames_of(i)), *st[1:]))
    return out


def _synthetic_with_stacks() -> dict:
    blocks = [{"address": 0, "size": 1024, "requested_size": 1000,
               "state": "active_allocated", "frames": [F2, F1]},
              {"address": 1024, "size": (2 << 20) - 1024, "state": "inactive", "frames": []}]
    trace = [
        {"action": "segment_alloc", "addr": 4 << 20, "size": 2 << 20, "stream": 0,
         "time_us": 1, "frames": [F3, F1], "compile_context": "N/A"},
        {"action": "alloc", "addr": 4 << 20, "size": 512, "stream": 0, "time_us": 1,
         "frames": [F3, F1], "compile_context": "N/A"},
        {"action": "alloc", "addr": (4 << 20) + 512, "size": 512, "stream": 0, "time_us": 2,
         "frames": [F2, F1], "compile_context": "[0/0]", "user_metadata": "step 1"},
        {"action": "free_requested", "addr": 4 << 20, "size": 512, "stream": 0,
         "time_us": 3, "frames": [F1]},
        {"action": "free_completed", "addr": 4 << 20, "size": 512, "stream": 0,
         "time_us": 3, "frames": [F1]},
        {"action": "alloc", "addr": 4 << 20, "size": 512, "stream": 0, "time_us": 4},
    ]
    segs = [_seg(0, 2 << 20, blocks, [F1]),
            _seg(4 << 20, 2 << 20, [
                {"address": 4 << 20, "size": 512, "state": "active_allocated",
                 "requested_size": 512, "frames": []},
                {"address": (4 << 20) + 512, "size": 512, "state": "active_allocated",
                 "requested_size": 512, "frames": [F2, F1]},
                {"address": (4 << 20) + 1024, "size": (2 << 20) - 1024, "state": "inactive",
                 "frames": []}])]
    return _snap(trace, segs, external_annotations=[
        {"name": "fwd", "stage": "START", "device": 0, "time_us": 1},
        {"name": "fwd", "stage": "END", "device": 0, "time_us": 3}])


@pytest.mark.parametrize("suffix", ["pickle", "json"])
def test_export_and_load_again_keeps_every_rows_stack(tmp_path, suffix):
    t = load_torch_snapshot(_synthetic_with_stacks())
    assert sum(s is not None for s in _resolved(t)) == 6
    path = tmp_path / f"out.{suffix}"
    from gpudash.trace import save_torch_snapshot
    save_torch_snapshot(t, path)
    back = load_torch_snapshot(path)
    assert _resolved(back) == _resolved(t)
    assert back.meta["annotations"] == t.meta["annotations"]
    snap = load_torch_snapshot_dict(path)
    entries = snap["device_traces"][0]
    # both entries of a free carry the free's frames; compile context only where recorded
    freed = [e for e in entries if e["action"].startswith("free")]
    assert [_frames(e["frames"]) for e in freed] == [_frames([F1])] * 2
    assert "compile_context" not in freed[0]
    alloc = [e for e in entries if e["action"] == "alloc"]
    assert alloc[2]["compile_context"] == "[0/0]" and alloc[2]["user_metadata"] == "step 1"
    blocks = {b["address"]: b for s in snap["segments"] for b in s["blocks"]}
    assert _frames(blocks[0]["frames"]) == _frames([F2, F1])
    assert _frames(blocks[(4 << 20) + 512]["frames"]) == _frames([F2, F1])
    if suffix == "pickle":
        raw = path.read_bytes()
        assert raw[:2] == b"\x80\x04"
        # one dict per distinct frame, one list per distinct stack, shared by reference
        objs = {id(f) for e in entries for f in e["frames"]}
        assert len(objs) == len({tuple(f.values()) for e in entries for f in e["frames"]})
        assert freed[0]["frames"] is freed[1]["frames"]


@needs_external
@pytest.mark.parametrize("name", ["DeComFL.memory.pickle", "ftcourse.memory_snapshot.pickle",
                                  "cs336_MAGMA27.memory_snapshot.pickle"])
def test_a_real_snapshot_exported_and_loaded_again_keeps_its_stacks(tmp_path, name):
    from gpudash.trace import save_torch_snapshot
    t = load_trace(EXTERNAL / name)
    save_torch_snapshot(t, tmp_path / "out.pickle")
    back = load_trace(tmp_path / "out.pickle")
    assert _resolved(back) == _resolved(t)
    assert (tmp_path / "out.pickle").stat().st_size < 3 * (EXTERNAL / name).stat().st_size


def test_convert_to_a_pytorch_snapshot_carries_the_stacks(tmp_path):
    from gpudash.cli import main
    from gpudash.trace import write_trace
    t = load_torch_snapshot(_synthetic_with_stacks())
    write_trace(t, tmp_path / "t.gdtrace")
    for out in ("t.pickle", "t.json"):
        assert main(["convert", str(tmp_path / "t.gdtrace"), str(tmp_path / out)]) == 0
        assert _resolved(load_trace(tmp_path / out)) == _resolved(t)


@pytest.mark.core
@pytest.mark.parametrize("exact", [True, False])
def test_a_replays_recording_and_snapshot_carry_the_stacks_of_its_calls(exact):
    from gpudash.trace import replay
    t = load_torch_snapshot(_synthetic_with_stacks())
    r = replay(t, record=True, exact=exact)
    rec = r.recording
    kinds = t.columns["kind"]
    ours = rec.stack_ids()[rec.columns["kind"] == EventKind.ALLOC]
    prefix = t.meta["torch"]["prefix"]["0"]
    rows = np.flatnonzero(kinds == EventKind.ALLOC)
    if exact:        # the rebuilt starting state is installed, not replayed
        rows = rows[rows >= prefix]
    assert [t.stacks.frames_of(s) for s in ours] == [t.frames_of(r_) for r_ in rows]
    assert rec.stacks is t.stacks
    # the free carries the free's stack, the extend its allocation's
    fr = np.flatnonzero(rec.columns["kind"] == EventKind.FREE)
    assert [rec.frames_of(i) for i in fr] == [_frames([F1])]
    ext = np.flatnonzero(rec.columns["kind"] == EventKind.EXTEND)
    allocs_at = np.flatnonzero(rec.columns["kind"] == EventKind.ALLOC)
    assert len(ext) and all(rec.frames_of(int(x)) == rec.frames_of(
        int(allocs_at[np.searchsorted(allocs_at, x)])) and rec.frames_of(int(x)) for x in ext)
    if exact:      # the segment the trace made for its first allocation
        assert rec.frames_of(int(ext[-1])) == _frames([F3, F1])
    # the model's own snapshot (MemoryViz opens it) has them too
    entries = r.snapshot["device_traces"][0]
    allocs = [e for e in entries if e["action"] == "alloc"]
    assert [_frames(e["frames"]) for e in allocs] == [t.frames_of(r_) for r_ in rows]
    assert [e["compile_context"] for e in allocs][-3:-1] == ["N/A", "[0/0]"]
    live = sorted(_frames(b["frames"]) for s in r.snapshot["segments"] for b in s["blocks"]
                  if b["state"] == "active_allocated")
    assert live == [[], _frames([F2, F1]), _frames([F2, F1])]
    # without stacks in the trace, none in the recording
    text = json.dumps(_synthetic_with_stacks())
    for key in ("frames", "compile_context", "user_metadata"):
        text = text.replace(f'"{key}"', f'"no_{key}"')
    plain = load_torch_snapshot(json.loads(text))
    assert replay(plain, record=True, exact=exact).recording.stack is None


@pytest.mark.core
@needs_external
@pytest.mark.parametrize("name", [n for n in SNAPSHOTS if not n.startswith("LLM-inference")])
def test_an_exact_replays_snapshot_has_pytorchs_frames_entry_for_entry(name):
    from gpudash.trace import replay
    snap = load_torch_snapshot_dict(EXTERNAL / name)
    t = load_trace(EXTERNAL / name)
    for dev in sorted(set(t.columns["device"].tolist())):
        r = replay(t, record=True, device=dev)
        assert r.fidelity.exact
        theirs = [(e["action"], _frames(e.get("frames")))
                  for e in (snap.get("device_traces") or [[]] * (dev + 1))[dev]
                  if e["action"] != "snapshot"]
        mine = [(e["action"], _frames(e["frames"]))
                for e in r.snapshot["device_traces"][dev] if e["action"] != "snapshot"]
        assert mine == theirs
        ours = {b["address"]: _frames(b["frames"]) for s in r.snapshot["segments"]
                for b in s["blocks"] if b["state"] != "inactive"}
        assert ours == {b["address"]: _frames(b["frames"]) for s in snap["segments"]
                        if s.get("device", 0) == dev for b in s["blocks"]
                        if b["state"] != "inactive"}
