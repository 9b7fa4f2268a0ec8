"""Interned call stacks on a trace: the tables, the column, slicing, concat and .gdtrace."""

from __future__ import annotations

import numpy as np
import pytest

from gpudash import TraceFormatError
from gpudash.trace import Trace, TraceWriter, read_trace, write_trace
from gpudash.formats.stacks import Frame, Stack, StackTable
from gpudash.workloads import training_loop


def _with_stacks(trace: Trace, seed: int = 0) -> Trace:
    """``trace`` with one of a few stacks (or none) on each row."""
    st = StackTable()
    ids = [st.intern_frames([("torch/nn/modules/linear.py", 125, "forward"),
                             (f"train.py", 80 + k, "step")], "N/A" if k % 2 else "",
                            f"meta{k}" if k == 3 else "") for k in range(5)]
    rng = np.random.default_rng(seed)
    col = np.array(ids + [-1], dtype=np.int32)[rng.integers(0, 6, len(trace))]
    return Trace(trace.columns, trace.meta, trace.settings, holder=trace.holder,
                 holders=trace.holders, stack=col, stacks=st)


def test_interning_keeps_one_copy_of_each_frame_and_stack():
    st = StackTable()
    a = st.intern_frames([("a.py", 1, "f"), ("b.py", 2, "g")])
    b = st.intern_frames([Frame("a.py", 1, "f"), Frame("b.py", 2, "g")])
    c = st.intern_frames([("a.py", 1, "f")], user_metadata="step 3")
    assert a == b != c
    assert len(st.frames) == 2 and len(st) == 2
    assert st.frames_of(a) == [Frame("a.py", 1, "f"), Frame("b.py", 2, "g")]
    assert st.stacks[c] == Stack((0,), "", "step 3")
    assert st.frames_of(-1) == []
    offsets, ids = st.frame_arrays()
    assert offsets.tolist() == [0, 2, 3] and ids.tolist() == [0, 1, 0]
    assert str(Frame("train.py", 88, "forward")) == "train.py:88 forward"


def test_a_bad_table_is_refused_with_what_is_wrong():
    with pytest.raises(TraceFormatError, match="frame 0 must be"):
        StackTable([("a.py", "one", "f")])
    with pytest.raises(TraceFormatError, match="names frame 5"):
        StackTable([("a.py", 1, "f")], [[[5], "", ""]])
    st = StackTable([("a.py", 1, "f")], [[[0], "", ""]])
    t = training_loop(steps=2)
    with pytest.raises(TraceFormatError, match="stack column: indices must be -1 or in"):
        Trace(t.columns, t.meta, stack=np.full(len(t), 3), stacks=st)
    with pytest.raises(TraceFormatError, match="must have"):
        Trace(t.columns, t.meta, stack=[0], stacks=st)


def test_slices_share_the_table_and_equality_compares_frames():
    t = _with_stacks(training_loop(steps=3))
    part = t[10:20]
    assert part.stacks is t.stacks
    assert part.stack_ids().tolist() == t.stack_ids()[10:20].tolist()
    assert t.frames_of(10) == part.frames_of(0)
    plain = training_loop(steps=3)
    assert plain.stack is None and (plain.stack_ids() == -1).all()
    assert t != plain
    # the same stacks numbered in another table: still equal
    other = StackTable()
    other.intern_frames([("x.py", 1, "unused")])
    remap = np.array([other.intern_frames(t.stacks.frames_of(s), *t.stacks.stacks[s][1:])
                      for s in range(len(t.stacks))] + [-1], dtype=np.int32)
    same = Trace(t.columns, t.meta, t.settings, holder=t.holder, holders=t.holders,
                 stack=remap[t.stack_ids()], stacks=other)
    assert same == t
    moved = same.stack.copy()
    moved[moved >= 0] = remap[0]
    assert Trace(t.columns, t.meta, t.settings, holder=t.holder, holders=t.holders,
                 stack=moved, stacks=other) != t


def test_concat_merges_tables_and_keeps_each_row_s_frames():
    a = _with_stacks(training_loop(steps=2), seed=1)
    b = Trace(a.columns, a.meta)          # no stacks
    st = StackTable()
    st.intern_frames([("other.py", 7, "h")])
    c = Trace(a.columns, a.meta, stack=np.zeros(len(a), dtype=np.int32), stacks=st)
    out = Trace.concat([a, b, c])
    n = len(a)
    for i in range(0, n, 7):
        assert out.frames_of(i) == a.frames_of(i)
        assert out.frames_of(n + i) == []
        assert out.frames_of(2 * n + i) == [Frame("other.py", 7, "h")]


def test_gdtrace_round_trips_stacks_across_batches(tmp_path):
    t = _with_stacks(training_loop(steps=4))
    path = tmp_path / "s.gdtrace"
    write_trace(t, path)
    back = read_trace(path)
    assert back == t and back.stacks.frames == t.stacks.frames
    # batches written as they come: later batches bring only their new frames and stacks
    path2 = tmp_path / "batches.gdtrace"
    with TraceWriter(path2, t.meta, batch_events=50, flush_interval=float("inf")) as w:
        for start in range(0, len(t), 37):
            w.append(t[start:start + 37])
    back2 = read_trace(path2)
    assert back2 == t
    assert len(back2.stacks) <= len(t.stacks)    # only the stacks used, each once
    # a file without stacks reads with none
    write_trace(training_loop(steps=2), tmp_path / "plain.gdtrace")
    assert read_trace(tmp_path / "plain.gdtrace").stack is None


def test_a_damaged_stack_table_in_a_file_is_refused(tmp_path):
    t = _with_stacks(training_loop(steps=2))
    path = tmp_path / "s.gdtrace"
    write_trace(t, path)
    data = path.read_bytes()
    # point a stack at a frame that does not exist (same length, so the record parses)
    import json, struct, zlib
    off = data.index(b'"stacks":[[[') + len(b'"stacks":[[[')
    bad = data[:off] + b"9" + data[off + 1:]
    # fix the record's crc so that the reader gets as far as the stack table
    head = bad.rfind(b"GDRC", 0, off)
    magic, rtype, jlen, plen, crc = struct.unpack_from("<4sB3xIQI", bad, head)
    js = bad[head + 24:head + 24 + jlen]
    payload = bad[head + 24 + jlen:head + 24 + jlen + plen]
    fixed = zlib.crc32(payload, zlib.crc32(js, zlib.crc32(bad[head:head + 20])))
    bad = bad[:head + 20] + struct.pack("<I", fixed) + bad[head + 24:]
    json.loads(js)  # still JSON
    p2 = tmp_path / "bad.gdtrace"
    p2.write_bytes(bad)
    with pytest.raises(TraceFormatError, match="names frame 9"):
        read_trace(p2)
