"""The segment / chunk map at real sizes: rows, wrapping, bounded HTML, who holds a block,
and each framework's fragmentation figure (report, explain, the dashboard's wire)."""

from __future__ import annotations

import pickle
import re
from html import unescape

import numpy as np
import pytest

import test_widgets_model as shared
from test_widgets_dashboard import say, sent

import gpudash
from gpudash.widgets import LiveModel
from gpudash.maplayout import ROW_PX, row_labels, row_layout, stack_text, visible_rows
from gpudash.models import BFC, TORCH, model_of_dump
from gpudash.report import (
    CHUNKMAP_MAX_HEIGHT,
    build_report,
    chunk_holders,
    chunkmap_figure,
)
from gpudash.trace import Trace
from gpudash.formats.stacks import Frame, StackTable
from gpudash.formats.torch_snapshot import load_torch_snapshot
from gpudash.workloads import caching_snapshot, fragmentation_stress

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

MIB = 1 << 20
GIB = 1 << 30

#: The bounds the HTML keeps whatever the segment count (measured on the 1,000-segment
#: snapshot below: chunk map 0.52 MB, explain page 2.3 MB).
MAP_BYTES = 1_000_000       # the chunk map figure, as JSON
EXPLAIN_BYTES = 3_000_000   # explain's whole page (1.5 MB of it plotly.js)


def many_segments(n: int = 1000, *, oom: bool = False, seed: int = 0) -> list:
    """Calls that leave ``n`` segments of PyTorch's caching allocator (each request above
    10 MiB gets a segment of its own), a third freed (their segments stay cached, free),
    small blocks in the small pool; with ``oom``, none freed (PyTorch would return those
    segments before giving up) and a last request the 48 GiB device cannot hold."""
    rng = np.random.default_rng(seed)
    calls = [("alloc", k, int(rng.integers(12, 60)) * MIB + int(rng.integers(0, MIB)))
             for k in range(n)]
    if not oom:
        calls += [("free", k) for k in range(0, n, 3)]
    calls += [("alloc", n + k, int(rng.integers(1, 900)) * 1024) for k in range(50)]
    if oom:
        calls.append(("alloc", 2 * n, 40 * GIB))
    return calls


@pytest.fixture(scope="module")
def snap1000():
    return caching_snapshot(many_segments(), device_bytes="80GiB")


def _with_stacks(trace: Trace) -> Trace:
    """``trace`` with a recorded stack on every allocation: PyTorch's frames (C++, torch,
    site-packages) around the user's own ``train.py:<40 + k> step`` and ``model.py``."""
    st = StackTable()
    ids = []
    for k in range(7):
        ids.append(st.intern_frames([
            ("??", 0, "torch::unwind::unwind()"),
            ("/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125, "forward"),
            ("/home/me/proj/model.py", 10 + k, "forward"),
            ("/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", 1532,
             "_call_impl"),
            ("/home/me/proj/train.py", 40 + k, "step")]))
    kinds = trace.columns["kind"]
    col = np.where(kinds == 1, np.array(ids, dtype=np.int32)[np.arange(len(trace)) % 7], -1)
    return Trace(trace.columns, trace.meta, trace.settings, holder=trace.holder,
                 holders=trace.holders, stack=col.astype(np.int32), stacks=st)


# ------------------------------------------------------------------------------ layout
def test_rows_wrap_a_region_that_dwarfs_the_rest_and_stay_bounded():
    # comparable sizes: one row each, as wide as the largest
    plain = row_layout([2 * MIB, 20 * MIB, 30 * MIB, 200 * MIB, 600 * MIB])
    assert plain.row_bytes == 600 * MIB and plain.rows.tolist() == [1] * 5
    # 117 segments of 20-330 MiB and a 6 GiB expandable one: rows of a power of two that
    # holds the typical segment; the big one continues on the next rows
    rng = np.random.default_rng(1)
    sizes = (rng.integers(20, 330, 117) * MIB).tolist() + [6 * GIB]
    lay = row_layout(sizes)
    regular = max(sizes[:-1])   # the largest that is not an outlier: one row, half of it
    assert regular <= lay.row_bytes < 2 * regular and lay.row_bytes & (lay.row_bytes - 1) == 0
    assert lay.rows[-1] == -(-6 * GIB // lay.row_bytes) and lay.rows[:-1].max() == 1
    assert lay.first_row.tolist() == np.concatenate(([0], np.cumsum(lay.rows)[:-1])).tolist()
    # a few huge regions among tiny ones: the width doubles until the rows are bounded
    many = [2 * MIB] * 60 + [8 * GIB] * 4
    bounded = row_layout(many)
    assert bounded.wraps and 64 + 64 < bounded.total_rows <= 64 + 128
    assert row_layout([2 * MIB] * 40 + [8 * GIB] * 10).rows.max() == 1   # 20 % are typical
    # names: unique, a continuation row by its offset
    labels = row_labels(lay, [f"segment {i}" for i in range(len(sizes))])
    assert len(labels) == len(set(labels)) == lay.total_rows
    assert labels[int(lay.first_row[-1]) + 1] == "segment 117 +" + \
        gpudash.style.format_size(lay.row_bytes)
    assert visible_rows(1000, 640) == 640 // ROW_PX and visible_rows(5, 640) == 5


def test_regions_that_wrap_come_after_the_others():
    # a 6 GiB region at the lowest address: the map opens on the typical regions
    sizes = [6 * GIB] + [(20 + k) * MIB for k in range(40)]
    lay = row_layout(sizes)
    assert lay.order.tolist() == list(range(1, 41)) + [0]
    assert lay.first_row[1] == 0 and lay.first_row[0] == 40 and lay.rows[0] > 1
    assert lay.region_of_row().tolist() == list(range(1, 41)) + [0] * int(lay.rows[0])
    labels = row_labels(lay, [f"r{i}" for i in range(41)])
    assert labels[:2] == ["r1", "r2"] and labels[40] == "r0" and labels[41].startswith("r0 +")


def test_pieces_cut_chunks_at_row_boundaries_exactly():
    lay = row_layout([10 * MIB] * 20 + [100 * MIB])     # rows of 16 MiB: 7 for the last
    assert lay.row_bytes == 16 * MIB
    region = np.array([20, 20, 3])
    offset = np.array([0, 5 * MIB, 2 * MIB])
    size = np.array([5 * MIB, 95 * MIB, 8 * MIB])
    ch, row, start, length = lay.pieces(region, offset, size)
    for k in range(3):
        mine = ch == k
        assert length[mine].sum() == size[k]
        assert np.all(start[mine] >= 0) and np.all(start[mine] + length[mine] <= lay.row_bytes)
    assert row[ch == 2].tolist() == [3]
    assert row[ch == 1].tolist() == list(range(20, 27))  # 5 MiB + 95 MiB ends at row 6 of 7


def test_stack_text_shows_the_users_frames_innermost_first():
    frames = [Frame("??", 0, "torch::unwind::unwind()"),
              Frame("/x/site-packages/torch/nn/modules/linear.py", 125, "forward"),
              Frame("/home/me/proj/model.py", 12, "forward"),
              Frame("C:\\venv\\Lib\\site-packages\\torch\\autograd\\function.py", 1, "apply"),
              Frame("/home/me/proj/train.py", 41, "step"),
              Frame("/usr/lib/python3.11/runpy.py", 86, "_run_code")]
    assert stack_text(frames) == ["proj/model.py:12 forward", "proj/train.py:41 step",
                                  "(+4 more frames)"]
    # no user frame: the Python frames; none of those either: the frames as they are
    assert stack_text(frames[:2]) == ["modules/linear.py:125 forward",
                                      "(+1 more frame)"]
    assert stack_text(frames[:1]) == ["?? torch::unwind::unwind()"]


# ------------------------------------------------------------------------------ the HTML
def test_a_1000_segment_map_is_bounded_in_height_and_bytes(snap1000):
    from gpudash.analysis import chunk_map_at_peak

    trace = load_torch_snapshot(snap1000)
    dump = chunk_map_at_peak(trace, options={"device_bytes": 80 * GIB})
    assert len(dump.regions) >= 1000
    fig = chunkmap_figure(dump, title="Segment map")
    size = len(fig.to_json())
    assert size < MAP_BYTES, size
    assert fig.layout.height <= CHUNKMAP_MAX_HEIGHT
    y = fig.layout.yaxis
    rows = len(y.categoryarray)
    assert y.type == "category" and rows == len(dump.regions)   # nothing wraps here
    # opens on the first rows, ROW_PX pixels each at least; the rest a drag away
    plot_px = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    shown = int(y.range[0] + 0.5)
    assert y.range[1] == -0.5 and shown * ROW_PX <= plot_px and 0 < shown < rows
    assert fig.layout.dragmode == "pan"
    assert y.nticks * ROW_PX <= plot_px   # plotly labels at most one row per ROW_PX
    assert f"rows 1-{shown} of {rows:,} shown" in fig.layout.title.text
    # every byte of every segment is drawn, in its own row
    per_row: dict[str, float] = {}
    for t in fig.data:
        for yy, x in zip(t.y, t.x):
            per_row[yy] = per_row.get(yy, 0.0) + x
    _, scale = gpudash.style.unit_for(fig.layout.xaxis.range[1] * 1.0001 * (1 << 20))
    unit = {"MiB": MIB, "GiB": GIB, "KiB": 1024}[fig.layout.xaxis.ticksuffix.strip()]
    for i, r in enumerate(sorted(dump.regions, key=lambda r: r.ptr)):
        name = f"segment {i} @ {r.ptr:#x}"
        in_use_waste_free = per_row[name] * unit
        assert abs(in_use_waste_free - r.size) < 64, (name, in_use_waste_free, r.size)


def test_a_10_segment_map_shows_every_segment():
    snap = caching_snapshot(many_segments(10), device_bytes="8GiB")
    from gpudash.analysis import chunk_map_at_peak

    dump = chunk_map_at_peak(load_torch_snapshot(snap), options={"device_bytes": 8 * GIB})
    fig = chunkmap_figure(dump, title="Segment map")
    y = fig.layout.yaxis
    assert len(y.categoryarray) == len(dump.regions) >= 10
    assert y.range[0] == len(dump.regions) - 0.5 and y.range[1] == -0.5   # all in view
    assert fig.layout.dragmode == "zoom" and "rows 1-" not in fig.layout.title.text
    assert fig.layout.height <= 60 + 84 + 44 + 22 * len(dump.regions)
    drawn = {yy for t in fig.data for yy in t.y}
    assert drawn == set(y.categoryarray)


def test_a_huge_expandable_segment_wraps_instead_of_crushing_the_others():
    # 40 segments of 20-60 MiB, then expandable segments on and a 6 GiB request
    with gpudash.Session(allocator="torch", simulate="24GiB", poll=False) as sess:
        keep = [sess.allocate((20 + k) * MIB) for k in range(40)]
        sess.configure(expandable_segments=True)
        keep.append(sess.allocate(6 * GIB))
        dump = sess.devices[0].allocator.memory_dump()
    largest = max(r.size for r in dump.regions)
    assert largest >= 6 * GIB and len(dump.regions) == 41
    fig = chunkmap_figure(dump, title="Segment map")
    unit = {"MiB": MIB, "GiB": GIB}[fig.layout.xaxis.ticksuffix.strip()]
    width = fig.layout.xaxis.range[1] * unit
    small = [r.size for r in dump.regions if r.size < GIB]
    # the x axis is a row, not the 6 GiB segment: the others keep most of their width
    assert max(small) <= width < 2 * max(small) + 1
    rows = fig.layout.yaxis.categoryarray
    assert len(rows) == 40 + -(-largest // int(width))
    assert sum("+" in r for r in rows) == len(rows) - 41 and "rows of " in fig.layout.title.text


def test_a_downsampled_map_covers_each_wrapped_row_and_nothing_past_its_end():
    from gpudash.report import CHUNKMAP_MAX_BARS

    # many small chunks in a few segments and one large one: more chunks than max_chunks
    calls = [("alloc", k, (13 + k % 7) * MIB) for k in range(20)]
    calls += [("alloc", 100 + k, 600_000) for k in range(300)]
    calls += [("free", 100 + k) for k in range(0, 300, 2)]
    snap = caching_snapshot(calls + [("alloc", 999, 2 * GIB)], device_bytes="16GiB")
    from gpudash.analysis import chunk_map_at_peak

    dump = chunk_map_at_peak(load_torch_snapshot(snap), options={"device_bytes": 16 * GIB})
    fig = chunkmap_figure(dump, title="Segment map", max_chunks=50)
    assert "columns per row" in fig.layout.title.text
    assert sum(len(t.x) for t in fig.data) <= CHUNKMAP_MAX_BARS
    unit = {"MiB": MIB, "GiB": GIB, "KiB": 1024}[fig.layout.xaxis.ticksuffix.strip()]
    W = fig.layout.xaxis.range[1] * unit
    regions = sorted(dump.regions, key=lambda r: r.ptr)
    widths: dict[str, float] = {}
    for t in fig.data:
        for yy, base, x in zip(t.y, t.base, t.x):
            assert (base + x) * unit <= W + 1
            widths[yy] = widths.get(yy, 0.0) + x * unit
    counts = [int(m.replace(",", "")) for t in fig.data for h in t.hovertext
              for m in re.findall(r"([\d,]+) block\(s\) begin here", h)]
    assert sum(counts) == len(dump.chunks)
    for i, r in enumerate(regions):
        name = f"segment {i} @ {r.ptr:#x}"
        total = sum(v for k, v in widths.items() if k == name or k.startswith(name + " +"))
        assert abs(total - r.size) <= 2 * len(widths), (name, total, r.size)


def test_hover_names_who_holds_a_block_from_its_stack(snap1000):
    trace = _with_stacks(load_torch_snapshot(snap1000))
    from gpudash.analysis import chunk_map_at_peak

    dump = chunk_map_at_peak(trace, options={"device_bytes": 80 * GIB})
    holders = chunk_holders(trace, dump, device=0)
    used = [c for c in dump.chunks if c.in_use]
    assert len(holders) == len(used)
    lines = next(iter(holders.values()))
    assert re.fullmatch(r"proj/model\.py:1\d forward", lines[0])     # innermost user frame
    assert re.fullmatch(r"proj/train\.py:4\d step", lines[1])
    assert lines[2] == "(+3 more frames)"
    fig = chunkmap_figure(dump, holders=holders)
    texts = [h for t in fig.data if t.name == "allocated" for h in t.hovertext]
    assert all("held by:" in h for h in texts)
    assert sum("proj/model.py:1" in h for h in texts) == len(used)
    # a trace without holders or stacks names nobody
    assert chunk_holders(load_torch_snapshot(snap1000), dump) == {}


def test_explain_names_who_holds_each_block_at_the_failure(tmp_path, monkeypatch):
    """explain's segment map (the state before the out-of-memory row, replayed exactly)
    names each block's allocating stack, where the snapshot recorded one."""
    import gpudash.torch_explain as te

    load = te.load_torch_snapshot
    monkeypatch.setattr(te, "load_torch_snapshot", lambda *a, **k: _with_stacks(load(*a, **k)))
    snap = caching_snapshot(many_segments(40, oom=True), device_bytes="4GiB")
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snap))
    e = gpudash.explain(path)
    used = [c for c in e.dump.chunks if c.in_use]
    assert len(e._holders) == len(used) > 40
    texts = [h for t in e.figures()[0].data if t.name == "allocated" for h in t.hovertext]
    assert texts and all(re.search(r"held by:<br>&nbsp;&nbsp;proj/model\.py:1\d forward<br>"
                                   r"&nbsp;&nbsp;proj/train\.py:4\d step", h) for h in texts)


def test_a_replays_chunks_are_named_by_the_traces_allocations():
    """The report's BFC map is a replay's state: its n-th allocation is the trace's n-th,
    so its blocks get the trace's holders even where the replay placed them elsewhere."""
    from gpudash.analysis import chunk_map_at_peak
    from gpudash.trace.replay import replay

    trace = fragmentation_stress(rounds=60, seed=2)
    trace.set_holders([f"op{i % 5}" for i in range(len(trace))])
    r = replay(trace, record=True, per_call=True, device_bytes=1 * GIB, fraction=0.9,
               allow_growth=True)
    peak = chunk_map_at_peak(r.recording)
    holders = chunk_holders(trace, peak, device=0, replayed=r.recording)
    used = {c.address: c for c in peak.chunks if c.in_use}
    assert len(holders) == len(used) > 0
    # check each against the trace: the k-th allocation of both
    rc, tc = r.recording.columns, trace.columns
    ours = np.flatnonzero(np.isin(rc["kind"], (1, 7)))
    theirs = np.flatnonzero(np.isin(tc["kind"], (1, 7)))
    for addr, lines in list(holders.items())[:20]:
        rows = ours[(rc["kind"][ours] == 1) & (rc["ptr"][ours] == addr)]
        k = int(np.searchsorted(ours, rows[-1]))
        assert lines == [trace.holders[trace.holder[theirs[k]]]]


def test_report_and_explain_html_of_1000_segments_are_bounded(tmp_path):
    snap = caching_snapshot(many_segments(oom=True), device_bytes="48GiB")
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snap))
    e = gpudash.explain(path)
    html = e.to_html()
    assert len(html.encode()) < EXPLAIN_BYTES, len(html)
    m = e.figures()[0]
    assert len(e.dump.regions) >= 1000
    assert m.layout.height <= CHUNKMAP_MAX_HEIGHT and len(m.layout.yaxis.categoryarray) >= 1000
    text = unescape(html)
    assert "reserved but unallocated" in text and "% of reserved)" in text
    # the report of the same snapshot: the map the same size whatever the count
    report = build_report(load_torch_snapshot(snap), fractions=(1.0,))
    section = report[report.index('data-plot="chunkmap"'):]
    section = section[:section.index("</section>")]
    assert len(section.encode()) < MAP_BYTES + 10_000


# ------------------------------------------------------------------------------ figures
def test_each_model_names_its_own_fragmentation_figure():
    tf = BFC.fragmentation(in_use=6 * GIB, pool=8 * GIB, largest_free=512 * MIB)
    assert (tf.label, tf.text, tf.bytes) == ("fragmentation", "75.0 %", None)
    pt = TORCH.fragmentation(in_use=6 * GIB, pool=8 * GIB, largest_free=512 * MIB)
    assert pt.label == "reserved but unallocated" and pt.bytes == 2 * GIB
    assert pt.text == "2.00 GiB (25.0 % of reserved)" and pt.ratio == 0.25
    assert TORCH.fragmentation(0, 0, 0).text == "0 B (0.0 % of reserved)"
    label, text = TORCH.fragmentation_over([1 * GIB, 2 * GIB, 3 * GIB], [4 * GIB, 4 * GIB,
                                                                         4 * GIB], [0, 0, 0])
    assert label == "most reserved but unallocated"
    assert text == "3.00 GiB (75.0 % of reserved) after call 1"
    assert BFC.fragmentation_over([1, 2], [4, 4], [1, 2]) == ("worst external fragmentation",
                                                              "66.7%")


def test_the_report_speaks_each_frameworks_fragmentation(snap1000):
    torch_html = unescape(build_report(load_torch_snapshot(snap1000), fractions=(1.0,)))
    assert "most reserved but unallocated" in torch_html
    assert "worst external fragmentation" not in torch_html
    assert re.search(r"Segment map at the peak \([\d.]+ GiB allocated; reserved but "
                     r"unallocated [\d.]+ [KMG]iB \([\d.]+ % of reserved\)\)", torch_html)
    tf_html = unescape(build_report(fragmentation_stress(rounds=60, seed=2),
                                    device_bytes=GIB, fractions=(1.0,)))
    assert "worst external fragmentation" in tf_html
    assert "reserved but unallocated" not in tf_html
    assert re.search(r"Chunk map at the peak \([\d.]+ [KMG]iB in use; fragmentation "
                     r"[\d.]+ %\)", tf_html)


def test_model_of_dump_reads_the_layout(snap1000):
    from gpudash.analysis import chunk_map_at_peak

    torch_dump = chunk_map_at_peak(load_torch_snapshot(snap1000),
                                   options={"device_bytes": 80 * GIB})
    assert model_of_dump(torch_dump) is TORCH
    assert model_of_dump(chunk_map_at_peak(fragmentation_stress(rounds=20, seed=1))) is BFC


# ------------------------------------------------------------------------------ the wire
comms = shared.comms


@pytest.fixture
def tdash():
    from gpudash.widgets import Dashboard, LiveModel

    sess = gpudash.Session(allocator="torch", simulate="80GiB", poll=False)
    model = LiveModel(sess, start=False)
    dash = Dashboard(model=model)
    yield sess, model, dash
    dash.close()
    model.close()
    sess.close()


def test_the_dashboard_sends_every_segment_and_its_rows(comms, tdash):
    sess, model, dash = tdash
    for op, key, n in (c for c in many_segments(300) if c[0] == "alloc"):
        sess.allocate(n)
    sess.configure(expandable_segments=True)
    sess.allocate(6 * GIB)
    model.refresh_now()
    say(dash, {"type": "hello"})
    (content, buffers), = sent(comms, dash, "snapshot")
    meta = content["chunks"]
    table = sess.devices[0].allocator.chunk_table()
    R = len(table["regions"])
    assert meta["n_regions"] == R > 300
    regions = np.frombuffer(buffers[6], dtype=np.float64).reshape(2, R)   # all, not 64
    lay = row_layout(table["regions"][:, 1])
    assert np.array_equal(regions[0].astype(np.int64), table["regions"][:, 0])
    assert np.array_equal(regions[1].astype(np.int64), table["regions"][:, 1])
    assert meta["row_bytes"] == lay.row_bytes < 6 * GIB and meta["n_rows"] == lay.total_rows
    # the page's rows (ceil(size / row_bytes) a region) are the layout's
    rows = np.ceil(regions[1] / meta["row_bytes"]).astype(np.int64)
    assert np.array_equal(rows, lay.rows)
    kinds = [meta["kind_names"][k] for k in np.frombuffer(buffers[7], dtype=np.int8)]
    assert kinds == TORCH.region_kinds(table) and kinds.count("large, expandable") == 1
    assert lay.wraps and meta["kind_names"] == ["large", "large, expandable", "small"]
    head = content["headline"]["frag"]
    assert head["label"] == "reserved but unallocated" and "% of reserved" in head["text"]


def test_the_bfc_headline_keeps_tensorflows_fragmentation(comms):
    from gpudash.widgets import Dashboard, LiveModel

    with gpudash.Session(simulate="4GiB", poll=False) as sess:
        keep = [sess.allocate(n * MIB) for n in (1, 2, 3, 4)]
        sess.free_now(keep[1])
        with LiveModel(sess, start=False) as model, Dashboard(model=model) as dash:
            model.refresh_now()
            say(dash, {"type": "hello"})
            head = sent(comms, dash, "snapshot")[-1][0]["headline"]
    assert head["frag"]["label"] == "fragmentation"
    assert head["frag"]["text"] == f"{100 * head['fragmentation']:.1f} %"


def test_holders_cross_the_wire_once_as_ids(comms, tdash):
    sess, model, dash = tdash
    ptrs = []
    for i in range(200):
        with sess.label(f"layer {i % 4}"):
            ptrs.append(sess.allocate((i % 5 + 1) * MIB))
    model.refresh_now()
    say(dash, {"type": "hello"})
    (content, buffers), = sent(comms, dash, "snapshot")
    strings = content["chunks"]["strings"]
    assert strings["base"] == 0 and sorted(strings["new"]) == [f"layer {k}" for k in range(4)]
    ids = np.frombuffer(buffers[5], dtype=np.int32)
    table = sess.devices[0].allocator.chunk_table()
    by_ptr = dict(zip(table["ptr"].tolist(), ids.tolist()))
    for i, p in enumerate(ptrs):
        assert strings["new"][by_ptr[p]] == f"layer {i % 4}"
    assert (ids[~table["in_use"]] == -1).all()
    # an update with the same holders sends no string again; a new one only itself
    sess.free(ptrs.pop())
    with sess.label("optimizer"):
        ptrs.append(sess.allocate(3 * MIB))
    model.refresh_now()
    updates = [c for c, _ in sent(comms, dash, "update") if c["chunks"]]
    assert updates[-1]["chunks"]["strings"] == {"base": 4, "new": ["optimizer"]}
    # 4 bytes a block and each string once, not a string per block
    last = [b for c, b in sent(comms, dash, "update") if c["chunks"]][-1]
    assert len(last[5]) == 4 * updates[-1]["chunks"]["n"]
    # a table without holders sends no ids at all
    with gpudash.Session(allocator="torch", simulate="1GiB", poll=False) as plain, \
            LiveModel(plain, start=False) as other:
        plain.allocate(MIB)
        meta, bufs = dash._chunk_buffers(other.refresh_now()[0])
    assert len(bufs[2]) == 0 and meta["strings"]["new"] == []
    # a snapshot starts the page's table afresh
    say(dash, {"type": "hello"})
    again = sent(comms, dash, "snapshot")[-1][0]["chunks"]["strings"]
    assert again["base"] == 0 and len(again["new"]) == 5


# ------------------------------------------------------------------------------ in a browser
@pytest.mark.browser
def test_a_1000_segment_report_in_chromium_keeps_labels_apart_and_names_holders(tmp_path,
                                                                                snap1000):
    """The report of 1,000 segments in headless Chromium: the map's height is bounded, its
    row labels do not overlap (first view and every row), and hovering a block shows the
    user's frames of the stack that allocated it."""
    from browser_helpers import launch_chromium, missing_browser_reason

    why = missing_browser_reason()
    if why:
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    trace = _with_stacks(load_torch_snapshot(snap1000))
    path = tmp_path / "r.html"
    path.write_text(build_report(trace, fractions=(1.0,)), encoding="utf-8")
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(path.as_uri())
            section = page.locator('section[data-plot="chunkmap"]')
            section.locator(".main-svg").first.wait_for(timeout=60_000)
            section.scroll_into_view_if_needed()
            box = section.locator(".js-plotly-plot").bounding_box()
            assert box["height"] <= CHUNKMAP_MAX_HEIGHT + 1

            def ticks() -> list[dict]:
                return section.evaluate("""(s) => Array.from(s.querySelectorAll(
                    '.yaxislayer-above .ytick text')).map(e => {
                        const b = e.getBoundingClientRect();
                        return {text: e.textContent, top: b.top, bottom: b.bottom}; })
                    .sort((a, b) => a.top - b.top)""")

            first = ticks()
            assert len(first) >= 20 and first[0]["text"] == "segment 0 @ 0x7f0000000000"
            assert all(b["top"] >= a["bottom"] - 0.5 for a, b in zip(first, first[1:]))
            drag = section.locator(".nsewdrag").first.bounding_box()
            # a block: the middle of an allocated bar in view
            bar = section.evaluate("""(s) => { for (const p of s.querySelectorAll(
                '.barlayer .trace:first-child .point path')) { const b = p.getBoundingClientRect();
                if (b.width > 8 && b.height > 4 && b.top > 0) return {x: b.left + 4,
                y: b.top + b.height / 2}; } return null; }""")
            page.mouse.move(bar["x"], bar["y"])
            page.wait_for_timeout(300)
            hover = section.evaluate("""(s) => Array.from(s.querySelectorAll(
                '.hoverlayer .hovertext text tspan')).map(e => e.textContent).join('\\n')""")
            assert re.search(r"held by:\s*proj/model\.py:1\d forward\s*proj/train\.py:4\d step",
                             hover), hover
            # every row: plotly labels every n-th, apart
            page.mouse.dblclick(drag["x"] + drag["width"] / 2, drag["y"] + drag["height"] / 2)
            page.wait_for_timeout(800)
            every = ticks()
            assert 2 <= len(every) < len(first) * 2
            assert all(b["top"] >= a["bottom"] - 0.5 for a, b in zip(every, every[1:]))
            assert errors == []
        finally:
            browser.close()
