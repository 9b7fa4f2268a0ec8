"""Who holds the memory, by the user's own line, function, file or stack, at any moment."""

from __future__ import annotations

import re

import numpy as np
import pytest

import gpudash
from gpudash import ConfigError
from gpudash.trace import Trace, write_trace, read_trace
from gpudash.trace.callers import (NO_STACK, below_user_code, short_paths, stack_lines,
                                   user_code_rule)
from gpudash.trace.holders import EventIndexError, HolderTable, top_holders
from gpudash.formats.stacks import Frame

from attrib_helpers import (CPP_ALLOC, CPP_MM, ENGINE, MM_BACKWARD, STDLIB, TORCH_APPLY,
                            TORCH_CALL, TORCH_CONVERT, TORCH_LINEAR, TORCH_TO, make_trace, user)

MiB = 1 << 20


def _model_calls() -> list[tuple]:
    """A forward pass: two user lines through torch and C++ frames, one stdlib-only stack,
    one C++-only autograd stack, one without a stack."""
    fwd88 = [CPP_ALLOC, CPP_MM, TORCH_LINEAR, TORCH_CALL, user(88, "forward"), user(120)]
    fwd90 = [CPP_ALLOC, TORCH_LINEAR, TORCH_CALL, user(90, "forward"), user(120)]
    return [
        ("alloc", "w", 9 * MiB, [CPP_ALLOC, TORCH_CONVERT, TORCH_APPLY, TORCH_TO,
                                 user(30, "main")]),
        ("alloc", "a1", 4 * MiB, fwd88),
        ("alloc", "a2", 4 * MiB, fwd88),
        ("alloc", "b1", 2 * MiB, fwd90),
        ("alloc", "t", 1 * MiB, [CPP_ALLOC, STDLIB]),
        ("alloc", "g", 3 * MiB, [CPP_ALLOC, MM_BACKWARD, ENGINE]),
        ("alloc", "x", 5 * MiB, None),
        ("free", "a2"),
        ("free", "x"),
    ]


def test_by_line_is_the_innermost_frame_of_the_users_code():
    t = make_trace(_model_calls())
    table = top_holders(t)                      # the default with stacks: by line
    assert isinstance(table, HolderTable) and table.by == "line"
    assert [(r.holder, r.bytes, r.allocations) for r in table] == [
        ("train.py:30 main", 9 * MiB, 1),
        ("train.py:88 forward", 8 * MiB, 2),
        (NO_STACK, 5 * MiB, 1),
        ("(autograd) MmBackward0", 3 * MiB, 1),
        ("train.py:90 forward", 2 * MiB, 1),
        ("(outside user code) threading.py:982 run", 1 * MiB, 1),
    ]
    assert table.total_bytes == 28 * MiB == sum(r.bytes for r in table)
    assert table[1].key == Frame("/home/u/proj/train.py", 88, "forward")
    # the row keeps its largest allocation's whole stack, and every distinct stack
    assert table[1].frames[0] == Frame(*CPP_ALLOC) and len(table[1].frames) == 6
    assert len(table[1].stack_ids) == 1
    assert table.stacks_of(table[1])[0][4] == Frame(*user(88, "forward"))
    # what it rests on: the rule, the moment, what was missing
    assert table.rule.startswith("user code: default") and "site-packages" in table.rule
    assert table.moment.event == 6 and "the peak" in table.moment.text
    assert table.missing["no stack"] == (1, 5 * MiB)
    assert any("no recorded stack" in n for n in table.notes)
    assert "block(s)" in table.to_text() and "allocated" in table.header()


def test_function_file_and_stack_groupings():
    t = make_trace(_model_calls())
    fn = {r.holder: r.bytes for r in top_holders(t, by="function")}
    assert fn["train.py forward"] == 10 * MiB and fn["train.py main"] == 9 * MiB
    files = {r.holder: r.bytes for r in top_holders(t, by="file")}
    assert files["train.py"] == 19 * MiB
    stacks = top_holders(t, by="stack")
    row = next(r for r in stacks if r.holder.startswith("train.py:88"))
    assert row.holder == "train.py:88 forward \u2190 train.py:120 step"
    assert row.key == tuple(Frame(*f) for f in _model_calls()[1][3])


def test_user_code_regex_or_callable_replaces_the_rule_and_says_so():
    t = make_trace(_model_calls())
    table = top_holders(t, user_code=r"torch/nn/modules/linear\.py")
    assert table[0].holder == "linear.py:125 forward" and table[0].bytes == 10 * MiB
    assert "user_code='torch/nn/modules/linear\\\\.py'" in table.rule
    by_fn = top_holders(t, user_code=lambda f: f.endswith("threading.py"))
    assert by_fn[0].holder.startswith("(outside user code)") or \
        any(r.holder == "threading.py:982 run" for r in by_fn)
    assert "user_code=" in by_fn.rule
    with pytest.raises(ConfigError, match="not a regular expression"):
        top_holders(t, user_code="(")
    with pytest.raises(ConfigError, match="regular expression .* or a callable"):
        top_holders(t, user_code=3)


def test_default_rule_on_real_path_shapes():
    rule = user_code_rule(None)
    mine = ["/home/u/proj/train.py", "C:\\research\\DeComFL\\decomfl_main.py",
            "/tmp/ipykernel_12/3105878423.py", "D:/Dev/a2/cs336_basics/model.py"]
    not_mine = ["C:\\research\\DeComFL\\.venv\\lib\\site-packages\\torch\\nn\\modules\\module.py",
                "/home/x/anaconda3/envs/gnn/lib/python3.11/site-packages/transformers/x.py",
                "/usr/lib/python3/dist-packages/numpy/core.py",
                "/home/x/anaconda3/envs/gnn/lib/python3.11/threading.py",
                "C:\\Python311\\Lib\\threading.py", "??", "memory_snapshot.cpp", "",
                "/src/pytorch/torch/nn/functional.py",
                "/tmp/torchinductor_me/cz/cz3vcpgktv5ml3u.py", "<frozen runpy>"]
    assert all(rule(f) for f in mine)
    assert not any(rule(f) for f in not_mine)


def test_short_paths_grow_only_where_names_clash():
    short = short_paths(["/a/x/models.py", "/b/y/models.py", "/c/train.py"])
    assert short == {"/a/x/models.py": "x/models.py", "/b/y/models.py": "y/models.py",
                     "/c/train.py": "train.py"}


def test_a_stack_for_people_puts_the_users_frames_first():
    frames = [Frame(*f) for f in (CPP_ALLOC, CPP_MM, TORCH_LINEAR, user(88, "forward"),
                                  STDLIB)]
    lines = stack_lines(frames, user_code_rule(None))
    assert lines[0] == "/home/u/proj/train.py:88 forward"
    assert lines[1].startswith("called into (in libraries)") and "linear.py:125" in lines[1]
    assert lines[2] == "(4 more frame(s) in libraries and C++)"
    cpp_only = [Frame(*CPP_ALLOC), Frame(*CPP_MM), Frame(*user(7, "f"))]
    assert below_user_code(cpp_only, user_code_rule(None)) == "(C++) aten::mm"


# ------------------------------------------------------------------------------ moments
def _timeline() -> Trace:
    return make_trace([
        ("alloc", 1, 4 * MiB, [user(1, "a")]),       # 0
        ("alloc", 2, 4 * MiB, [user(2, "b")]),       # 1: first peak, 8 MiB
        ("free", 2),                                 # 2
        ("alloc", 3, 4 * MiB, [user(3, "c")]),       # 3: 8 MiB again (not the first)
        ("oom", 64 * MiB, [user(4, "d")]),           # 4
        ("free", 1),                                 # 5
        ("alloc", 5, 1 * MiB, [user(5, "e")]),       # 6
    ])


def test_at_peak_oom_end_index_and_time():
    t = _timeline()
    lines = lambda **kw: [r.holder for r in top_holders(t, **kw)]   # noqa: E731
    assert lines() == ["train.py:1 a", "train.py:2 b"]          # the FIRST peak
    assert top_holders(t).moment.event == 1
    oom = top_holders(t, at="oom")
    assert [r.holder for r in oom] == ["train.py:1 a", "train.py:3 c"]
    assert oom.moment.oom_row == 4 and oom.moment.event == 3 and oom.moment.device == 0
    assert lines(at="end") == ["train.py:3 c", "train.py:5 e"]
    assert lines(at=2) == ["train.py:1 a"] and lines(at=-1) == lines(at="end")
    assert lines(at="2") == lines(at=2)                          # the CLI's string form
    # times from the first event: 2.5 us is after event 2
    assert lines(at=2.5e-6) == ["train.py:1 a"]
    assert lines(at="2.5us") == lines(at="0.0025ms") == ["train.py:1 a"]
    assert top_holders(t, at="1s").moment.event == 6
    assert top_holders(t, at=0.0).moment.event == 0


def test_bad_moments_are_refused_with_what_is_accepted():
    t = _timeline()
    for bad in ("middle", True, float("nan"), -1.0, "12 parsecs", None):
        with pytest.raises(ConfigError, match="at must be"):
            top_holders(t, at=bad)
    with pytest.raises(EventIndexError, match="out of range"):
        top_holders(t, at=99)
    with pytest.raises(IndexError):
        top_holders(t, at=-99)
    no_oom = make_trace([("alloc", 1, 10, [user(1)])])
    with pytest.raises(ConfigError, match="no refused allocation"):
        top_holders(no_oom, at="oom")
    with pytest.raises(ConfigError, match="by must be one of"):
        top_holders(t, by="colour")


def test_oom_takes_the_failing_device_and_peak_is_per_device():
    t = make_trace([
        ("alloc", 1, 10 * MiB, [user(1)], 0),
        ("alloc", 2, 3 * MiB, [user(2)], 1),
        ("free", 1),
        ("alloc", 3, 5 * MiB, [user(3)], 1),
        ("oom", MiB, [user(4)], 1),
    ])
    assert [r.holder for r in top_holders(t, device=1)] == ["train.py:3 step",
                                                             "train.py:2 step"]
    both = top_holders(t)                     # every device together: the peak is event 0
    assert both.moment.device is None and both.moment.event == 1
    oom = top_holders(t, at="oom")
    assert oom.moment.device == 1 and oom.total_bytes == 8 * MiB


def test_limit_keeps_the_largest_and_counts_the_rest():
    t = make_trace(_model_calls())
    table = top_holders(t, limit=2)
    assert len(table) == 2 and table.left_out == (4, 11 * MiB)
    assert table.total_bytes == 28 * MiB
    assert "4 more row(s)" in table.to_text()


def test_the_old_api_still_answers_by_holder_without_stacks():
    t = make_trace(_model_calls())
    plain = Trace(t.columns, t.meta)
    plain.set_holders(["op" if k == 1 else None for k in plain.kind])
    table = gpudash.top_holders(plain)
    assert table.by == "holder" and table[0].holder == "op"
    assert gpudash.trace.top_holders is top_holders
    assert "no call stacks" in " ".join(top_holders(plain, by="line").notes)


def test_stacks_survive_a_gdtrace_round_trip(tmp_path):
    t = make_trace(_model_calls())
    write_trace(t, tmp_path / "s.gdtrace")
    back = read_trace(tmp_path / "s.gdtrace")
    assert [(r.holder, r.bytes) for r in top_holders(back)] == \
        [(r.holder, r.bytes) for r in top_holders(t)]


# ------------------------------------------------------------------------------ annotations
def test_by_annotation_is_the_innermost_range_open_on_the_device():
    calls = [("alloc", i, MiB, [user(i)], 1 if i == 5 else 0) for i in range(7)]
    meta = {"annotations": {"names": ["ProfilerStep#1", "forward", "other"],
                            "ranges": [[0, 0, 500, 6500], [0, 1, 1500, 3500],
                                       [1, 2, 0, 9000]]}}
    t = make_trace(calls, meta)
    got = {r.holder: r.allocations for r in top_holders(t, at="end", by="annotation")}
    # event i at i us: 0 none; 1 step; 2,3 forward (inner wins); 4,6 step; 5 on device 1
    assert got == {"(no annotation)": 1, "ProfilerStep#1": 3, "forward": 2, "other": 1}
    # PyTorch's own list of marks reads the same; an unclosed START runs to the end
    marks = [{"name": "ProfilerStep#1", "stage": "START", "device": 0, "time_us": 0.5},
             {"name": "forward", "stage": "START", "device": 0, "time_us": 1.5},
             {"name": "forward", "stage": "END", "device": 0, "time_us": 3.5}]
    t2 = make_trace(calls, {"annotations": marks})
    got2 = {r.holder: r.allocations for r in top_holders(t2, at="end", by="annotation")}
    assert got2 == {"(no annotation)": 2, "ProfilerStep#1": 3, "forward": 2}
    none = top_holders(make_trace(calls), by="annotation")
    assert any("no annotations" in n for n in none.notes)


def test_rebuilt_allocations_are_said():
    t = make_trace([("alloc", i, MiB, [user(i)]) for i in range(4)],
                   {"torch": {"prefix": {"0": 2}}})
    table = top_holders(t, at="end")
    assert table.missing["rebuilt"] == (2, 2 * MiB)
    assert any("existed before the trace's first event" in n for n in table.notes)


def test_a_million_events_group_without_a_python_loop_per_event():
    """Shape only (timings are benchmarks/bench_holders.py's): 10^6 events, a few hundred
    distinct stacks, every grouping answers and the bytes add up."""
    n = 500_000
    rng = np.random.default_rng(0)
    base = make_trace([("alloc", 0, MiB, [user(1)])])
    st = base.stacks
    ids = [st.intern_frames([CPP_ALLOC, TORCH_LINEAR, user(k % 97, f"f{k % 13}")])
           for k in range(300)]
    kind = np.tile(np.array([1, 2], dtype=np.int8), n)
    aid = np.repeat(np.arange(1, n + 1), 2)
    keep = rng.random(n) < 0.01                          # 1 % never freed
    kind[1::2][keep] = 1
    aid[1::2][keep] = n + 1 + np.arange(int(keep.sum()))
    size = np.repeat(rng.integers(1, 1 << 16, n) * 512, 2)
    cols = {"seq": np.arange(2 * n), "time_ns": np.arange(2 * n) * 1000, "kind": kind,
            "ptr": aid * 4096, "size": size, "requested": size, "bin": np.zeros(2 * n),
            "region": np.zeros(2 * n), "alloc_id": aid, "device": np.zeros(2 * n)}
    stack = np.array(ids, dtype=np.int32)[rng.integers(0, 300, 2 * n)]
    t = Trace(cols, {"source": "pytorch-snapshot"}, stack=stack, stacks=st)
    for by in ("line", "stack", "category", "function"):
        table = top_holders(t, at="end", by=by)
        assert table.total_bytes == sum(r.bytes for r in table) > 0
        assert re.search(r"block\(s\)", table.header())


def test_pairing_without_ids_by_pointer_and_with_ids_repeated_across_devices():
    t = make_trace(_model_calls())
    cols = dict(t.columns)
    cols["alloc_id"] = np.full(len(t), -1)           # a log without ids: paired by pointer
    by_ptr = Trace(cols, t.meta, stack=t.stack, stacks=t.stacks)
    want = [(r.holder, r.bytes) for r in top_holders(t, at="end")]
    assert [(r.holder, r.bytes) for r in top_holders(by_ptr, at="end")] == want
    # two allocators numbering their allocations from 1 each: (device, id) pairs them
    two = make_trace([("alloc", "a", MiB, [user(1)], 0), ("alloc", "b", 2 * MiB, [user(2)], 1),
                      ("free", "a"), ("alloc", "c", 4 * MiB, [user(3)], 0)])
    cols = dict(two.columns)
    cols["alloc_id"] = np.array([1, 1, 1, 2])
    two = Trace(cols, two.meta, stack=two.stack, stacks=two.stacks)
    assert {r.holder: r.bytes for r in top_holders(two, at="end")} == {
        "train.py:2 step": 2 * MiB, "train.py:3 step": 4 * MiB}


def test_annotations_at_reads_times_out_of_order():
    from gpudash.trace.callers import annotation_ranges, annotations_at

    ranges = annotation_ranges({"annotations": {"names": ["a", "b"],
                                                "ranges": [[0, 0, 10, 20], [0, 1, 30, None]]}})
    at = annotations_at(ranges, np.array([35, 15, 5, 25]), np.zeros(4))
    assert [ranges.names[ranges.name[i]] if i >= 0 else None for i in at] == \
        ["b", "a", None, None]
