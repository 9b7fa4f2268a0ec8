"""Bytes gained and lost by line between two traces or two moments, and what stays live
from one iteration to the next."""

from __future__ import annotations

import pytest

import gpudash
from gpudash import ConfigError
from gpudash.trace.diff import HolderDiff, diff_holders, leaks
from gpudash.formats.stacks import Frame

from attrib_helpers import CPP_ALLOC, TORCH_LINEAR, make_trace, user

MiB = 1 << 20


def _run(batch: int):
    """One program's run: the weights, then activations that scale with the batch."""
    return make_trace([
        ("alloc", "w", 100 * MiB, [CPP_ALLOC, user(30, "main")]),
        *[("alloc", f"a{i}", batch * MiB, [CPP_ALLOC, TORCH_LINEAR, user(88, "forward")])
          for i in range(4)],
        ("alloc", "tmp", 2 * MiB, [CPP_ALLOC, user(95, "loss")]),
    ])


def test_two_runs_compared_line_by_line():
    small, large = _run(1), _run(300)
    d = diff_holders(small, large)
    assert isinstance(d, HolderDiff) and gpudash.diff_holders is diff_holders
    assert [(r.holder, r.before, r.after) for r in d] == [
        ("train.py:88 forward", 4 * MiB, 1200 * MiB)]
    assert d[0].key == Frame("/home/u/proj/train.py", 88, "forward")
    assert d.lines() == ["+1.17 GiB at train.py:88 forward (4 blocks, 4 before)"]
    assert d.gained == 1196 * MiB and d.lost == 0
    assert "A, the peak" in d.header() and "B, the peak" in d.header()
    html = d._repr_html_()
    assert "<table>" in html and "train.py:88 forward" in html and "+1.17 GiB" in html
    back = diff_holders(large, small)
    assert back.lines() == ["-1.17 GiB at train.py:88 forward (4 blocks, 4 before)"]


def test_one_trace_at_two_moments_largest_change_first():
    t = make_trace([
        ("alloc", 1, 10 * MiB, [user(1, "a")]),
        ("alloc", 2, 30 * MiB, [user(2, "b")]),
        ("alloc", 3, 5 * MiB, [user(3, "c")]),
        ("free", 2),
        ("free", 3),
        ("alloc", 4, 20 * MiB, [user(4, "d")]),
    ])
    d = diff_holders(t, at="peak", to="end")
    assert d.lines() == ["-30.00 MiB at train.py:2 b (1 block, none after)",
                         "+20.00 MiB at train.py:4 d (1 block)",
                         "-5.00 MiB at train.py:3 c (1 block, none after)"]
    assert d.before.moment.event == 2 and d.after.moment.event == 5
    assert "train.py:1 a" not in d.to_text()               # unchanged rows are left out
    assert len(diff_holders(t, at="peak", to="end", limit=1)) == 1
    with pytest.raises(ConfigError, match="needs to="):
        diff_holders(t)
    with pytest.raises(ConfigError, match="at must be"):
        diff_holders(t, to="later")


def test_leaks_find_what_each_iteration_keeps():
    """Three iterations: each keeps one 'cache' block (a leak) and frees its activations;
    the first also makes the optimizer state, kept once."""
    calls = []
    marks = []
    for step in range(3):
        calls.append(("alloc", f"act{step}", 8 * MiB, [user(88, "forward")]))
        calls.append(("alloc", f"cache{step}", 1 * MiB, [user(42, "remember")]))
        if step == 0:
            calls.append(("alloc", "state", 4 * MiB, [user(60, "step")]))
        calls.append(("free", f"act{step}"))
        marks.append(len(calls) * 1000 - 500)        # an END after each step's last event
    meta = {"annotations": {"names": ["Optimizer.step#Adam.step"],
                            "ranges": [[0, 0, m - 100, m] for m in marks]}}
    t = make_trace(calls, meta)
    table = leaks(t)
    assert table.iterations == 2 and "Optimizer.step" in table.source
    assert [(r.holder, r.per_iteration) for r in table] == [
        ("train.py:42 remember", (MiB, MiB)),            # kept in every iteration
        ("train.py:60 step", (4 * MiB, 0)),
    ]
    assert "in 2 of 2 iterations" in table.lines()[0]
    # boundaries given by the caller (event indices) instead of the annotations
    given = leaks(t, boundaries=[3, 6])
    assert given.boundaries == [3, 6] and "given" in given.source
    assert [r.per_iteration for r in given] == [(MiB, MiB), (4 * MiB, 0)]
    # allocations that existed before the trace began were made by no iteration
    rebuilt = make_trace(calls, {**meta, "torch": {"prefix": {"0": 2}}})
    table = leaks(rebuilt)
    assert [(r.holder, r.per_iteration) for r in table] == [
        ("train.py:60 step", (4 * MiB, 0)), ("train.py:42 remember", (0, MiB))]
    assert any("existed before the trace's first event" in n for n in table.notes)
    with pytest.raises(ConfigError, match="no iteration boundaries"):
        leaks(make_trace(calls))
    with pytest.raises(ConfigError, match="event index or a time"):
        leaks(t, boundaries=["peak"])
