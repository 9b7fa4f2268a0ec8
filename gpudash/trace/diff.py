"""What changed: bytes gained and lost by line (or stack, category...) between two moments, and
what stays live from one iteration to the next.

- :func:`diff_holders` compares the holders of two traces (two runs of one program: their
  lines, stacks and categories are the same keys) or of one trace at two moments, and says
  the changes as lines a person reads, largest first::

      +1.20 GiB at train.py:88 forward (48 blocks, 12 before)

- :func:`leaks` cuts a trace into iterations and finds the allocations made in one iteration
  that are still live at the end of the next: memory that grows step after step. The
  iterations come from the annotations PyTorch's snapshot keeps (the END of each
  ``ProfilerStep#N``, else of each ``Optimizer.step``, else the START of each
  ``Optimizer.zero_grad`` or ``enumerate(DataLoader)`` fetch) or from boundaries the caller
  gives; the result says which were used.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import ConfigError
from .._units import format_bytes
from ..models import trace_model
from .callers import annotation_ranges, user_code_rule
from ..formats.format import Trace
from .holders import (BY, HolderTable, _default_by, _group, _holders, _one_device,
                      _parse_at, _rebuilt, allocations, resolve_moment)

__all__ = ["diff_holders", "HolderChange", "HolderDiff", "leaks", "Retained", "LeakTable",
           "ITERATION_MARKS"]

#: The annotations that mark iterations, in the order :func:`leaks` looks for them:
#: (name prefix, stage).
ITERATION_MARKS = (("ProfilerStep#", "END"), ("Optimizer.step", "END"),
                   ("Optimizer.zero_grad", "START"), ("enumerate(DataLoader)", "START"))


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + format_bytes(abs(n))


@dataclass(frozen=True)
class HolderChange:
    """How one holder's bytes changed.

    Attributes
    ----------
    holder : str
        The row's label (``train.py:88 forward``).
    key : object
        What it groups by (as :class:`~gpudash.trace.holders.HolderBytes`' ``key``).
    before, after : int
        Its bytes at the first and at the second moment.
    allocations_before, allocations_after : int
    frames : tuple of Frame
        The stack of its largest allocation (at the second moment, else the first).
    """

    holder: str
    key: Any
    before: int
    after: int
    allocations_before: int
    allocations_after: int
    frames: tuple = ()

    @property
    def change(self) -> int:
        """``after - before``."""
        return self.after - self.before

    def line(self, chunk: str = "allocation") -> str:
        """``+1.20 GiB at train.py:88 forward (48 blocks, 12 before)``."""
        n, was = self.allocations_after, self.allocations_before
        if self.change < 0 and n == 0:
            count = f"{was} {chunk}{'s' if was != 1 else ''}, none after"
        else:
            count = f"{n} {chunk}{'s' if n != 1 else ''}" + (f", {was} before" if was else "")
        return f"{_signed(self.change)} at {self.holder} ({count})"


class HolderDiff(list):
    """The rows of :func:`diff_holders` (a list of :class:`HolderChange`, largest change
    first; rows that did not change are left out).

    Attributes
    ----------
    before, after : HolderTable
        The two tables compared (their ``moment``, ``rule`` and ``notes``).
    by : str
    chunk : str
    gained, lost : int
        Bytes of all the rows that grew, and of all that shrank (positive).
    """

    def __init__(self, rows: list[HolderChange], before: HolderTable, after: HolderTable,
                 by: str, chunk: str, labels: tuple[str, str]) -> None:
        super().__init__(rows)
        self.before = before
        self.after = after
        self.by = by
        self.chunk = chunk
        self.labels = labels
        self.gained = sum(r.change for r in rows if r.change > 0)
        self.lost = -sum(r.change for r in rows if r.change < 0)

    def header(self) -> str:
        a, b = self.labels
        return (f"by {self.by}: {format_bytes(self.before.total_bytes)} at {a} -> "
                f"{format_bytes(self.after.total_bytes)} at {b} "
                f"({_signed(self.after.total_bytes - self.before.total_bytes)}: "
                f"{format_bytes(self.gained)} gained, {format_bytes(self.lost)} lost)")

    def lines(self, limit: int | None = None) -> list[str]:
        """Each change as a line (``+1.20 GiB at train.py:88 forward (48 blocks)``)."""
        rows = self if limit is None else list(self)[:limit]
        return [r.line(self.chunk) for r in rows]

    def to_text(self, limit: int | None = None) -> str:
        out = [self.header(), *(f"  {line}" for line in self.lines(limit))]
        if limit is not None and len(self) > limit:
            out.append(f"  ... {len(self) - limit:,} more change(s)")
        notes = []
        for t in (self.before, self.after):
            for n in ([t.rule] if t.rule else []) + t.notes:
                if n not in notes:
                    notes.append(n)
        out.extend(f"note: {n}" for n in notes)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<HolderDiff {self.header()}: {len(self)} change(s)>"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(r.holder)}</td><td>{html.escape(format_bytes(r.before))}</td>"
            f"<td>{html.escape(format_bytes(r.after))}</td>"
            f"<td style=\"color:{'#b00' if r.change > 0 else '#070'}\">"
            f"{html.escape(_signed(r.change))}</td>"
            f"<td>{r.allocations_before:,} &rarr; {r.allocations_after:,}</td></tr>"
            for r in self)
        a, b = (html.escape(x) for x in self.labels)
        return (f"<div class=\"gpudash-diff\"><p><b>{html.escape(self.header())}</b></p>"
                f"<table><tr><th>{html.escape(self.by)}</th><th>{a}</th><th>{b}</th>"
                f"<th>change</th><th>{html.escape(self.chunk)}s</th></tr>{rows}</table></div>")


def diff_holders(a: Trace, b: Trace | None = None, *, at: Any = "peak", to: Any = None,
                 by: str | None = None, device: int | None = None, user_code: Any = None,
                 limit: int | None = None) -> HolderDiff:
    """Bytes gained and lost by holder between two traces, or one trace at two moments.

    Parameters
    ----------
    a : Trace
    b : Trace, optional
        The second trace. Without it, ``a`` is compared with itself at ``to``.
    at : moment, default "peak"
        The first moment (of ``a``), in any form :func:`~gpudash.trace.holders.top_holders`
        takes.
    to : moment, optional
        The second moment: of ``b`` (default: ``at``), or of ``a`` when there is no ``b``
        (then required).
    by : str, optional
        As for ``top_holders`` (default: ``"line"`` when both traces recorded stacks).
    device, user_code :
        As for ``top_holders``.
    limit : int, optional
        Keep the ``limit`` largest changes.

    Returns
    -------
    HolderDiff
        One :class:`HolderChange` per holder whose bytes changed, largest change first.

    Raises
    ------
    ConfigError
        One trace and no ``to``, or a bad moment, ``by`` or ``user_code``.
    """
    for t in (a, b):
        if t is not None and not isinstance(t, Trace):
            raise TypeError(f"diff_holders compares gpudash.trace.Trace objects; got "
                            f"{type(t).__name__}")
    if b is None and to is None:
        raise ConfigError("diff_holders of one trace needs to= (the second moment): e.g. "
                          "diff_holders(trace, at='peak', to='end'); or give two traces")
    if by is None:
        by = _default_by(a) if b is None else (
            "line" if _default_by(a) == _default_by(b) == "line" else "holder")
    if by not in BY:
        raise ConfigError(f"by must be one of {', '.join(repr(x) for x in BY)}; got {by!r:.40}")
    rule = user_code_rule(user_code)
    second = b if b is not None else a
    cache: dict = {}                # one trace at two moments: its allocations paired once
    first_t = _holders(a, at, by, device, rule, None, cache)
    second_t = _holders(second, to if to is not None else at, by, device, rule, None,
                        cache if b is None else None)
    old = {r.key: r for r in first_t}
    new = {r.key: r for r in second_t}
    rows = []
    for key in list(new) + [k for k in old if k not in new]:
        x, y = old.get(key), new.get(key)
        before, after = (x.bytes if x else 0), (y.bytes if y else 0)
        if before == after and (x.allocations if x else 0) == (y.allocations if y else 0):
            continue
        rows.append(HolderChange((y or x).holder, key, before, after,
                                 x.allocations if x else 0, y.allocations if y else 0,
                                 (y or x).frames))
    rows.sort(key=lambda r: (-abs(r.change), r.holder))
    if limit is not None:
        rows = rows[:limit]
    if b is None:
        labels = (first_t.moment.text, second_t.moment.text)
    else:
        labels = (f"A, {first_t.moment.text}", f"B, {second_t.moment.text}")
    return HolderDiff(rows, first_t, second_t, by, trace_model(second).chunk, labels)


# ------------------------------------------------------------------------------- leaks
@dataclass(frozen=True)
class Retained:
    """Bytes of one holder that outlived the iteration after the one that made them.

    Attributes
    ----------
    holder : str
    key : object
    bytes : int
        Over every iteration measured.
    allocations : int
    per_iteration : tuple of int
        The bytes of each measured iteration (made in iteration k, live at the end of k+1).
    frames : tuple of Frame
    """

    holder: str
    key: Any
    bytes: int
    allocations: int
    per_iteration: tuple
    frames: tuple = ()

    @property
    def iterations(self) -> int:
        """In how many iterations it kept something."""
        return sum(1 for b in self.per_iteration if b)

    def line(self, chunk: str = "allocation") -> str:
        n = len(self.per_iteration)
        return (f"+{format_bytes(self.bytes)} at {self.holder} ({self.allocations} "
                f"{chunk}{'s' if self.allocations != 1 else ''}), kept into the next "
                f"iteration in {self.iterations} of {n} iteration{'s' if n != 1 else ''}")


class LeakTable(list):
    """The rows of :func:`leaks` (a list of :class:`Retained`: those kept in the most
    iterations first, then the most bytes).

    Attributes
    ----------
    boundaries : list of int
        The trace rows that end each iteration.
    source : str
        Where they came from (which annotation, or the caller).
    iterations : int
        Iterations measured (each needs the next one to end within the trace).
    by, rule, chunk : str
    notes : list of str
    """

    def __init__(self, rows: list[Retained], **attrs: Any) -> None:
        super().__init__(rows)
        self.boundaries: list[int] = attrs.get("boundaries", [])
        self.source: str = attrs.get("source", "")
        self.iterations: int = attrs.get("iterations", 0)
        self.by: str = attrs.get("by", "line")
        self.rule: str = attrs.get("rule", "")
        self.chunk: str = attrs.get("chunk", "allocation")
        self.notes: list[str] = attrs.get("notes", [])

    def header(self) -> str:
        total = sum(r.bytes for r in self)
        return (f"{format_bytes(total)} made in one iteration and still live at the end of "
                f"the next, over {self.iterations} iteration(s), by {self.by}; iterations: "
                f"{self.source}")

    def lines(self, limit: int | None = None) -> list[str]:
        rows = self if limit is None else list(self)[:limit]
        return [r.line(self.chunk) for r in rows]

    def to_text(self, limit: int | None = None) -> str:
        out = [self.header(), *(f"  {x}" for x in self.lines(limit))]
        if limit is not None and len(self) > limit:
            out.append(f"  ... {len(self) - limit:,} more row(s)")
        out.extend([self.rule] if self.rule else [])
        out.extend(f"note: {n}" for n in self.notes)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<LeakTable {self.header()}: {len(self)} row(s)>"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(r.holder)}</td><td>{html.escape(format_bytes(r.bytes))}</td>"
            f"<td>{r.iterations} of {len(r.per_iteration)}</td><td>{r.allocations:,}</td></tr>"
            for r in self)
        return (f"<div class=\"gpudash-leaks\"><p><b>{html.escape(self.header())}</b></p>"
                f"<table><tr><th>{html.escape(self.by)}</th><th>kept</th><th>iterations</th>"
                f"<th>{html.escape(self.chunk)}s</th></tr>{rows}</table></div>")


def _marks(trace: Trace, device: int | None) -> tuple[np.ndarray, str]:
    """Iteration boundaries from the annotations: their times (ns) and what they are."""
    ranges = annotation_ranges(trace.meta)
    never = (np.iinfo(np.int64).min, np.iinfo(np.int64).max)
    for prefix, stage in ITERATION_MARKS:
        ids = [i for i, n in enumerate(ranges.names) if n.startswith(prefix)]
        pick = np.isin(ranges.name, ids)
        if device is not None:
            pick &= (ranges.device == device) | (ranges.device == -1)
        times = (ranges.end if stage == "END" else ranges.start)[pick]
        times = times[(times != never[0]) & (times != never[1])]
        if len(times):
            return (np.unique(times),
                    f"the {stage} of each {prefix}... annotation ({len(times)} mark(s))")
    return np.zeros(0, dtype=np.int64), ""


def leaks(trace: Trace, *, by: str | None = None, device: int | None = None,
          boundaries: Any = None, user_code: Any = None, limit: int | None = None) -> LeakTable:
    """What stays live from one iteration to the next, grouped by line (or ``by``).

    An iteration ends at each boundary; the allocations made in iteration k that are still
    live when iteration k+1 ends are counted for k (the part of the trace after the last
    boundary is the last iteration, ending with the trace). A holder kept in every
    iteration grows step after step. Allocations the importer rebuilt (they existed before
    the trace's first event) are left out, and said in ``notes``.

    Parameters
    ----------
    trace : Trace
    by : str, optional
        As for :func:`~gpudash.trace.holders.top_holders` (default ``"line"`` with stacks).
    device : int, optional
    boundaries : sequence of moments, optional
        Where iterations end, in any form ``top_holders``' ``at`` takes (event indices,
        times). Default: from the annotations (:data:`ITERATION_MARKS`).
    user_code, limit :
        As for ``top_holders``.

    Returns
    -------
    LeakTable

    Raises
    ------
    ConfigError
        No boundaries given and none in the annotations, or a bad moment.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"leaks needs a gpudash.trace.Trace; got {type(trace).__name__}")
    if by is None:
        by = _default_by(trace)
    if by not in BY:
        raise ConfigError(f"by must be one of {', '.join(repr(x) for x in BY)}; got {by!r:.40}")
    rule = user_code_rule(user_code)
    device = _one_device(trace, device)
    n = len(trace)
    times = trace.columns["time_ns"]
    if boundaries is None:
        marks, source = _marks(trace, device)
        if not len(marks):
            have = len(annotation_ranges(trace.meta))
            raise ConfigError(
                "leaks: no iteration boundaries: the trace has "
                + (f"{have} annotation range(s), none of them " if have else "no annotations, "
                   "so no ")
                + "ProfilerStep#N, Optimizer.step, Optimizer.zero_grad or DataLoader marks; "
                "pass boundaries= (event indices or times where iterations end)")
        rows = [int(np.flatnonzero(times <= m).max()) if (times <= m).any() else -1
                for m in marks.tolist()]
    else:
        if isinstance(boundaries, (str, int, float)):
            boundaries = [boundaries]
        rows = []
        for x in boundaries:
            if _parse_at(x)[0] not in ("index", "time"):
                raise ConfigError(f"leaks: a boundary is an event index or a time; got "
                                  f"{x!r:.40}")
            rows.append(resolve_moment(trace, x, device).event)
        source = f"{len(rows)} boundary(ies) given"
    edges = sorted(set(r for r in rows if 0 <= r < n - 1))
    edges = [-1, *edges, n - 1]
    allocs = allocations(trace, device)
    measured = max(0, len(edges) - 2)
    # iteration of each allocation, and whether it outlived the next one
    it = np.searchsorted(np.array(edges[1:], dtype=np.int64), allocs.row, side="left")
    ok = it < measured
    end_next = np.array(edges, dtype=np.int64)[np.minimum(it + 2, len(edges) - 1)]
    rebuilt = _rebuilt(trace, allocs.row)
    kept = np.flatnonzero(ok & (allocs.free_row > end_next) & ~rebuilt)
    g = _group(trace, allocs, kept, by, rule)
    model = trace_model(trace)
    out: list[Retained] = []
    if len(kept):
        size = allocs.size[kept]
        codes, inv = np.unique(g.code, return_inverse=True)
        per = np.zeros((len(codes), measured), dtype=np.int64)
        np.add.at(per, (inv, it[kept]), size)
        counts = np.bincount(inv, minlength=len(codes))
        big = np.lexsort((-size, inv))
        first = np.flatnonzero(np.r_[True, np.diff(inv[big]) != 0])
        rep = allocs.stack[kept][big[first]]
        for k, cg in enumerate(codes.tolist()):
            out.append(Retained(g.labels[cg], g.keys[cg], int(per[k].sum()), int(counts[k]),
                                tuple(int(x) for x in per[k]),
                                tuple(trace.stacks.frames_of(int(rep[k])))))
    out.sort(key=lambda r: (-r.iterations, -r.bytes, r.holder))
    if limit is not None:
        out = out[:limit]
    notes = list(g.notes)
    if rebuilt.any():
        notes.append(f"{int(rebuilt.sum()):,} {model.chunk}(s) existed before the trace's "
                     "first event (rebuilt by the importer): no iteration made them, so they "
                     "are left out")
    if measured == 0:
        notes.append("fewer than two iterations: nothing to compare (an iteration is measured "
                     "when the next one ends within the trace)")
    return LeakTable(out, boundaries=edges[1:-1], source=source, iterations=measured, by=by,
                     rule=g.rule_text, chunk=model.chunk, notes=notes)
