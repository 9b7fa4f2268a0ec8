"""What each allocation is for: every rule of gpudash.trace.categories on a small trace."""

from __future__ import annotations

from gpudash.trace.categories import CATEGORIES, RULES
from gpudash.trace.holders import top_holders

from attrib_helpers import (ACC_GRAD, CPP_ALLOC, ENGINE, MM_BACKWARD, TORCH_ADAM,
                            TORCH_APPLY, TORCH_BACKWARD, TORCH_CALL, TORCH_CONVERT,
                            TORCH_LINEAR, TORCH_STEP, TORCH_TO, make_trace, user)

K = 1 << 10
PARAM = [CPP_ALLOC, TORCH_CONVERT, TORCH_APPLY, TORCH_TO, user(10, "main")]
FWD = [CPP_ALLOC, TORCH_LINEAR, TORCH_CALL, user(20, "forward"), user(50, "main")]
BWD = [CPP_ALLOC, MM_BACKWARD, ENGINE]
ACC = [CPP_ALLOC, ACC_GRAD, ENGINE]
OPT = [CPP_ALLOC, TORCH_ADAM, TORCH_STEP, user(60, "main")]


def _categories(trace, at="end") -> dict[str, dict[str, int]]:
    """{category: {rule: bytes}} of the allocations live at ``at``."""
    return {r.holder: dict(r.rules) for r in top_holders(trace, at=at, by="category")}


def _rule(i: int) -> str:
    return RULES[i][0]


def test_one_training_step_puts_each_allocation_in_its_category():
    t = make_trace([
        ("alloc", "w", 64 * K, PARAM),        # parameters: module.to()
        ("alloc", "act", 32 * K, FWD),        # an activation: alive when backward begins
        ("alloc", "tmp", 8 * K, FWD),         # a forward temporary: freed before backward
        ("free", "tmp"),
        ("alloc", "gx", 4 * K, BWD),          # a backward temporary
        ("free", "act"),
        ("alloc", "gw", 64 * K, ACC),         # the weight's .grad
        ("alloc", "gb", 2 * K, BWD),          # alive after the backward pass: a gradient
        ("alloc", "gz", 1 * K, BWD),          # a gradient too, freed later (zero_grad)
        ("free", "gx"),
        ("alloc", "m", 64 * K, OPT),          # Adam's state: outlives the step
        ("alloc", "upd", 16 * K, OPT),        # freed within the step
        ("free", "upd"),
        ("alloc", "in", 1 * K, FWD),          # next forward: ends the step
        ("free", "gz"),
    ])
    got = _categories(t, at="end")
    assert got == {
        "parameters": {_rule(5): 64 * K},
        "gradients": {_rule(0): 64 * K, _rule(3): 2 * K},
        "optimizer state": {_rule(1): 64 * K},
        "activations": {_rule(8): 1 * K},       # the last forward: no backward after it
    }
    before = _categories(t, at=-2)               # gz freed after the backward pass ended
    assert before["gradients"] == {_rule(0): 64 * K, _rule(3): 3 * K}
    peak = _categories(t, at=4)                  # during the backward pass
    assert peak["activations"] == {_rule(6): 32 * K}
    assert peak["temporaries"] == {_rule(4): 4 * K}
    # the forward temporary and the step's temporary, each by its rule
    at_tmp = _categories(t, at=2)
    assert at_tmp["temporaries"] == {_rule(7): 8 * K}
    at_upd = _categories(t, at=11)
    assert at_upd["temporaries"] == {_rule(2): 16 * K}
    assert set(CATEGORIES) >= set(got)


def test_annotations_place_allocations_without_telling_frames():
    plain = [user(5, "work")]             # no frame says optimizer or backward
    meta = {"annotations": {"names": ["Optimizer.step#Adam.step", "my backward"],
                            "ranges": [[0, 0, 500, 3500], [0, 1, 4500, 5500]]}}
    t = make_trace([
        ("alloc", "a", K, plain),         # 0: before the step
        ("alloc", "s", 2 * K, plain),     # 1: inside the step, kept: state (END at 3.5 us)
        ("alloc", "u", 3 * K, plain),     # 2: inside, freed at 3 (before END): temporary
        ("free", "u"),                    # 3
        ("alloc", "b", 4 * K, plain),     # 4
        ("alloc", "g", 5 * K, plain),     # 5: inside "my backward", kept: gradient
        ("alloc", "z", 6 * K, plain),     # 6
    ], meta)
    got = _categories(t, at="end")
    assert got["optimizer state"] == {_rule(1): 2 * K}
    assert got["gradients"] == {_rule(3): 5 * K}
    assert got["unknown"] == {_rule(9): K + 4 * K + 6 * K}
    assert _categories(t, at=2)["temporaries"] == {_rule(2): 3 * K}


def test_unknown_says_whether_a_stack_was_there():
    t = make_trace([("alloc", 1, K, [user(1, "load")]), ("alloc", 2, 2 * K, None)])
    got = _categories(t)
    assert got == {"unknown": {_rule(10): 2 * K, _rule(9): K}}
    table = top_holders(t, by="category")
    assert "Mosaic" in table.rule and table.missing["no stack"] == (1, 2 * K)


def test_backward_from_python_frames_and_a_step_that_never_ends():
    bwd_py = [CPP_ALLOC, TORCH_BACKWARD, user(70, "train")]
    t = make_trace([
        ("alloc", "g", K, bwd_py),        # the backward pass's Python side
        ("alloc", "s", 2 * K, OPT),       # the trace ends inside the step: kept, state
    ])
    got = _categories(t)
    assert got["gradients"] == {_rule(3): K} and got["optimizer state"] == {_rule(1): 2 * K}
