"""The units of what-if work, below every way of running them.

One replay of one setting (a sweep's row, a bisection's probe) and the bisection over
fractions. :mod:`gpudash.trace.whatif` runs them in this process or in worker processes;
:mod:`gpudash.dask` runs the same units as tasks on a cluster. Neither runner is imported
here: the layers go whatif -> (dask ->) tasks -> replay.

``calls`` is a replay's call list for either allocator model: ``(op, key, nbytes, streams,
n_events)`` as :func:`gpudash.trace.replay._model_calls` returns it (numpy columns or
lists; ``streams`` None for BFC).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .._errors import GpudashError
from ..models import ReplaySettings
from .replay import _replay_lists

__all__ = ["Probe", "probe", "sweep_row", "bisect"]


class Probe(NamedTuple):
    """One bisection replay: the allocations refused (counting stopped at ``max_ooms``), the
    replay's limit and its :attr:`~gpudash.trace.replay.ReplayResult.limit_floor`: every
    limit from ``floor`` to ``limit`` replays the same, with these refusals."""

    ooms: int
    limit: int
    floor: int


def probe(settings: ReplaySettings | dict, calls: tuple, max_ooms: int | None) -> Probe:
    """Replay ``calls`` under ``settings`` (no recording, no samples)."""
    ops, keys, nbytes, streams, n_events = calls
    r = _replay_lists(settings, ops, keys, nbytes, n_events, record=False, per_call=False,
                      max_ooms=max_ooms, progress=None, streams=streams)
    floor = r.memory_limit if r.limit_floor is None else r.limit_floor
    return Probe(int(r.oom_count), int(r.memory_limit), int(floor))


def sweep_row(settings: ReplaySettings | dict, calls: tuple) -> dict:
    """One row of a sweep: the replay of ``calls`` under ``settings``, summed up. The row's
    second setting is the model's (``allow_growth``, or PyTorch's ``expandable_segments``),
    and for PyTorch the other knobs the sweep varies, by name. Where the framework itself
    fails under the setting (PyTorch's internal assert with ``max_split_size_mb`` and
    expandable segments), the row does not fit and its ``error`` says why."""
    ops, keys, nbytes, streams, n_events = calls
    settings = ReplaySettings.of(settings)   # a dict of them: converted once, here
    row: dict[str, Any] = {"fraction": settings["fraction"]}
    try:
        r = _replay_lists(settings, ops, keys, nbytes, n_events, record=False, per_call=True,
                          max_ooms=None, progress=None, streams=streams)
    except GpudashError as exc:   # the framework itself fails under this setting
        r = None
        error = str(exc)
    row.update(settings.row())
    if r is None:
        row.update({"limit_bytes": 0, "fits": False, "oom_count": 0, "first_oom": None,
                    "peak_pool_bytes": 0, "peak_bytes_in_use": 0, "worst_fragmentation": 0.0,
                    "extensions": 0, "error": error})
        return row
    row.update({
        "limit_bytes": r.memory_limit,
        "fits": r.fits,
        "oom_count": r.oom_count,
        "first_oom": r.first_oom[0] if r.first_oom else None,
        "peak_pool_bytes": r.peak_pool_bytes,
        "peak_bytes_in_use": r.peak_bytes_in_use,
        "worst_fragmentation": r.worst_fragmentation,
        "extensions": r.extensions,
    })
    return row


def bisect(run: Callable[[list[float]], dict[float, Probe]], lo: float, hi: float,
           tolerance: float, history: list, step: Callable[[], None] | None = None,
           width: int = 1, limit_of: Callable[[float], int] | None = None) -> tuple:
    """The smallest fraction in ``(lo, hi]`` that fits, by bisection (None when ``hi``
    fails), and how many of the fractions noted in ``history`` were known without a replay.

    ``run(fractions)`` replays each fraction and returns ``{fraction: Probe}`` (or the
    exception a replay raised: it is raised here only if the path reaches it, so a failing
    replay beside the path changes nothing). Each round
    asks it for up to ``width`` fractions at once (a cluster replays them side by side):
    the next midpoint and those the following steps may visit, level by level, the lower
    half first (a midpoint that fits, the costly replay, leads there). The bisection then
    follows the path the one-at-a-time bisection takes for as long as the answers reach,
    so the fractions noted in ``history`` (``(fraction, ooms)``, in order) and the result
    are the same whatever the width. ``step()`` is called after each noted fraction.

    With ``limit_of`` (a fraction's limit in bytes), a fraction whose limit lies between
    the floor and the limit of a replay already noted (:class:`Probe`; a fraction above 1,
    unified memory, only by another such) is answered by that replay and not run: its
    replay would be the same, call for call. Only replays noted on the path count, so the
    fractions known, like the answer, are the same whatever the width.
    """
    spans: list[tuple[bool, int, int, int]] = []   # (unified, floor, limit, ooms) noted
    results: dict[float, Probe] = {}
    inferred = 0

    def known(frac: float) -> int | None:
        if limit_of is None or not spans:
            return None
        limit, unified = limit_of(frac), frac > 1.0
        for u, low, high, ooms in spans:
            if u == unified and low <= limit <= high:
                return ooms
        return None

    def note(frac: float) -> int:
        nonlocal inferred
        ooms = known(frac)
        if ooms is None:
            p = results[frac]
            if isinstance(p, BaseException):
                raise p
            ooms = p.ooms
            spans.append((frac > 1.0, p.floor, p.limit, p.ooms))
        else:
            inferred += 1
        history.append((frac, ooms))
        if step is not None:
            step()
        return ooms

    results.update(run([hi]))
    if note(hi):
        return None, inferred
    good, bad = hi, lo
    while good - bad > tolerance:
        mid = (good + bad) / 2.0
        if not bad < mid < good:   # as fine as floats go
            break
        if mid not in results and known(mid) is None:
            results.update(run(_ahead(good, bad, tolerance, width, known)))
        if note(mid) == 0:
            good = mid
        else:
            bad = mid
    return good, inferred


def _ahead(good: float, bad: float, tolerance: float, width: int,
           known: Callable[[float], int | None]) -> list[float]:
    """Up to ``width`` midpoints the bisection may visit from ``(good, bad)``, level by
    level, the lower half first, leaving out those already known (the first, the next
    midpoint, is not)."""
    out: list[float] = []
    level = [(good, bad)]
    depth = 0
    while level and len(out) < width and depth < width:   # no deeper than width replays go
        depth += 1
        nxt = []
        for g, b in level:
            mid = (g + b) / 2.0
            if g - b <= tolerance or not b < mid < g:
                continue
            if known(mid) is None:
                out.append(mid)
                if len(out) == width:
                    break
            nxt += [(mid, b), (g, mid)]
        level = nxt
    return out
