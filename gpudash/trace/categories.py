"""What each allocation is for: parameters, gradients, optimizer state, activations,
temporaries, or unknown, with the rule that placed it.

PyTorch's memory profiler (``torch.profiler._memory_profiler``, its ``Category``) decides this
from the data flow of a profiled run: which tensors the optimizer holds, which ones
``AccumulateGrad`` writes, what the forward pass makes that the backward pass reads. Meta's
Mosaic decides it from an allocation's call stack alone, with a table of rules where the first
one that matches wins ("forward" in a frame's name: activation; the autograd engine's C++
frames: backward; ``torch/optim/``: optimizer...). A memory snapshot has no data flow but has
both the stacks and each allocation's lifetime, so gpudash takes Mosaic's approach and adds
the lifetimes the profiler's categories stand for. The rules, first match wins (each result
row says which rule placed its bytes):

===  =================  ============================================================
 1   gradients          ``AccumulateGrad`` in the stack (autograd writing a ``.grad``)
 2   optimizer state    under an optimizer step (a frame in ``torch/optim/``, a
                        ``step`` in a file named like an optimizer, or an open
                        ``Optimizer.step`` annotation) and alive after the step ended
 3   temporaries        the same, freed within the step
 4   gradients          made by the backward pass (the autograd engine's frames,
                        ``_engine_run_backward``, an open annotation naming backward)
                        and alive after the backward pass ended
 5   temporaries        the same, freed within the backward pass
 6   parameters         made while building or moving a module: ``nn.Module``'s
                        ``to``/``cuda``/``_apply``/``convert``/``load_state_dict``, a
                        module's ``__init__`` in ``torch/nn/modules/``, ``torch/nn/init.py``,
                        ``reset_parameters``/``init_weights``/``from_pretrained``
 7   activations        made by a forward pass ("forward" in a frame's name, a module
                        call) and alive when the next backward pass began
 8   temporaries        the same, freed before the next backward pass began
 9   activations        made by a forward pass with no backward pass after it in the
                        trace (inference: what the forward pass produced)
10   unknown            no rule matched its stack
11   unknown            no stack recorded
===  =================  ============================================================

A step or a backward pass "ends" at the next allocation on the device that is not part of
it (or at the ``Optimizer.step`` annotation's END, when one is open). Allocations still
alive at the end of the trace outlived their step. Rows are compared in trace order, not by
time, so allocations in one microsecond keep their order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .callers import AnnotationRanges, annotations_at
from ..formats.stacks import StackTable

__all__ = ["CATEGORIES", "RULES", "Categorized", "categorize", "stack_flags"]

#: The categories, in the order results list them.
CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "temporaries",
              "unknown")
_P, _G, _O, _A, _T, _U = range(6)

#: Each rule's words and its category (see the module docstring).
RULES = (
    ("AccumulateGrad in the stack", _G),
    ("optimizer step, alive after the step", _O),
    ("optimizer step, freed within it", _T),
    ("backward pass, alive after it", _G),
    ("backward pass, freed within it", _T),
    ("building or moving a module (.to(), _apply, convert, __init__, init)", _P),
    ("forward pass, alive when the backward pass began", _A),
    ("forward pass, freed before the backward pass", _T),
    ("forward pass, no backward pass after it in the trace", _A),
    ("no rule matched its stack", _U),
    ("no stack recorded", _U),
)
_R_ACC, _R_OPT_KEEP, _R_OPT_TMP, _R_BWD_KEEP, _R_BWD_TMP, _R_PARAM, _R_FWD_KEEP, _R_FWD_TMP, \
    _R_FWD_ONLY, _R_NONE, _R_NOSTACK = range(len(RULES))
RULE_CATEGORY = np.array([c for _, c in RULES], dtype=np.int8)

_ENGINE_PREFIXES = ("torch::autograd::Engine::", "torch::autograd::python::PythonEngine::",
                    "torch::autograd::Node::operator()")
_MODULE_MOVE = {"_apply", "convert", "to", "cuda", "to_empty", "load_state_dict",
                "_load_from_state_dict"}
_PARAM_NAMES = {"reset_parameters", "_init_weights", "init_weights", "from_pretrained",
                "_load_pretrained_model", "load_state_dict", "_load_from_state_dict"}
# flag bits, per frame and per stack
F_ACC, F_OPT, F_BWD, F_PARAM, F_FWD = 1, 2, 4, 8, 16


def _frame_flags(filename: str, name: str) -> int:
    path = filename.replace("\\", "/")
    base = path.rsplit("/", 1)[-1].lower()
    flags = 0
    if "AccumulateGrad" in name:
        flags |= F_ACC
    if "/torch/optim/" in path or path.startswith("torch/optim/") or (
            name == "step" and "optim" in base):
        flags |= F_OPT
    if name.startswith(_ENGINE_PREFIXES) or name == "_engine_run_backward" or (
            name == "backward" and ("torch/autograd/" in path
                                    or path.endswith("torch/_tensor.py"))):
        flags |= F_BWD
    module_py = path.endswith("torch/nn/modules/module.py")
    if (module_py and name in _MODULE_MOVE) or name in _PARAM_NAMES or (
            "torch/nn/modules/" in path and name == "__init__") or path.endswith(
            ("torch/nn/init.py", "torch/nn/parameter.py")):
        flags |= F_PARAM
    if "forward" in name or (module_py and name in ("_call_impl", "_wrapped_call_impl")):
        flags |= F_FWD
    return flags


def stack_flags(stacks: StackTable) -> np.ndarray:
    """Per stack id, the OR of its frames' flags (``F_ACC``, ``F_OPT``, ``F_BWD``,
    ``F_PARAM``, ``F_FWD``), each distinct frame examined once."""
    per_frame = np.fromiter((_frame_flags(f.filename, f.name) for f in stacks.frames),
                            dtype=np.int64, count=len(stacks.frames))
    offsets, ids = stacks.frame_arrays()
    out = np.zeros(len(stacks), dtype=np.int64)
    if not len(ids):
        return out
    vals = per_frame[ids]
    lengths = np.diff(offsets)
    nonempty = np.flatnonzero(lengths > 0)
    if len(nonempty):
        out[nonempty] = np.bitwise_or.reduceat(vals, offsets[nonempty])
    return out


def _annotation_flags(names: list[str]) -> np.ndarray:
    out = np.zeros(len(names) + 1, dtype=np.int64)   # the last entry: no annotation
    for i, n in enumerate(names):
        low = n.lower()
        if n.startswith("Optimizer.step"):
            out[i] |= F_OPT
        if "backward" in low or low.startswith("autograd::engine"):
            out[i] |= F_BWD
        if "forward" in low:
            out[i] |= F_FWD
    return out


@dataclass
class Categorized:
    """The category and rule of each allocation given to :func:`categorize`.

    Attributes
    ----------
    category : numpy.ndarray of int8
        Index into :data:`CATEGORIES`.
    rule : numpy.ndarray of int8
        Index into :data:`RULES`.
    """

    category: np.ndarray
    rule: np.ndarray


def _next_after(rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """For each row, the first candidate row after it (``big`` where none)."""
    big = np.iinfo(np.int64).max
    if not len(candidates):
        return np.full(len(rows), big, dtype=np.int64)
    i = np.searchsorted(candidates, rows, side="right")
    return np.where(i < len(candidates), candidates[np.minimum(i, len(candidates) - 1)], big)


def categorize(rows: np.ndarray, free_rows: np.ndarray, device: np.ndarray,
               stack: np.ndarray, stacks: StackTable, time_ns: np.ndarray,
               ranges: AnnotationRanges | None = None, all_times: np.ndarray | None = None,
               flags: np.ndarray | None = None) -> Categorized:
    """The category of every allocation of a trace (see the module docstring).

    Parameters
    ----------
    rows : numpy.ndarray of int64
        The allocations' rows, in trace order: every allocation of the devices asked about
        (the phases are read from all of them).
    free_rows : numpy.ndarray of int64
        The row of each one's free (int64 max: never freed in the trace).
    device, stack, time_ns : numpy.ndarray
        Each allocation's device, stack id (-1: none) and time.
    stacks : StackTable
    ranges : AnnotationRanges, optional
        The trace's annotations.
    all_times : numpy.ndarray, optional
        Every row's time (to place an annotation's END on a row).
    flags : numpy.ndarray, optional
        :func:`stack_flags` of ``stacks``, when already known.
    """
    n = len(rows)
    big = np.iinfo(np.int64).max
    if flags is None:
        flags = stack_flags(stacks)
    f = np.where(stack >= 0, flags[np.maximum(stack, 0)] if len(flags) else 0, 0)
    opt_end = np.full(n, -1, dtype=np.int64)       # an Optimizer.step END, as a row
    if ranges is not None and len(ranges):
        at = annotations_at(ranges, time_ns, device)
        names = ranges.names
        fa = _annotation_flags(names)
        name_of = np.where(at >= 0, ranges.name[np.maximum(at, 0)], len(names))
        f = f | fa[name_of]
        if all_times is not None and len(all_times) and bool(np.all(np.diff(all_times) >= 0)):
            in_step = (at >= 0) & ((fa[name_of] & F_OPT) > 0)
            ends = ranges.end[np.maximum(at, 0)]
            end_rows = np.searchsorted(all_times, ends, side="right") - 1
            opt_end = np.where(in_step & (ends < big), end_rows, -1)
    has_stack = stack >= 0
    rule = np.full(n, _R_NONE, dtype=np.int8)
    rule[~has_stack & (f == 0)] = _R_NOSTACK
    decided = np.zeros(n, dtype=bool)

    def place(mask: np.ndarray, value: int) -> None:
        m = mask & ~decided
        rule[m] = value
        decided[m] = True

    place((f & F_ACC) > 0, _R_ACC)
    for bit, keep, tmp in ((F_OPT, _R_OPT_KEEP, _R_OPT_TMP), (F_BWD, _R_BWD_KEEP, _R_BWD_TMP)):
        member = ((f & bit) > 0) & ~decided
        if not member.any():
            continue
        end = np.full(n, big, dtype=np.int64)
        for d in np.unique(device[member]).tolist():
            on = device == d
            outside = rows[on & ~((f & bit) > 0)]
            sel = member & on
            end[sel] = _next_after(rows[sel], outside)
        if bit == F_OPT:
            end = np.where(opt_end >= 0, opt_end, end)
        outlived = (free_rows == big) | (free_rows > end)
        place(member & outlived, keep)
        place(member & ~outlived, tmp)
    place((f & F_PARAM) > 0, _R_PARAM)
    fwd = ((f & F_FWD) > 0) & ~decided
    if fwd.any():
        start = np.full(n, big, dtype=np.int64)
        for d in np.unique(device[fwd]).tolist():
            on = device == d
            bwd_rows = rows[on & ((f & F_BWD) > 0)]
            sel = fwd & on
            start[sel] = _next_after(rows[sel], bwd_rows)
        none_after = start == big
        alive = (free_rows == big) | (free_rows > start)
        place(fwd & none_after, _R_FWD_ONLY)
        place(fwd & ~none_after & alive, _R_FWD_KEEP)
        place(fwd & ~none_after & ~alive, _R_FWD_TMP)
    return Categorized(RULE_CATEGORY[rule], rule)
