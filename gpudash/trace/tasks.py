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
from typing import Any

from .._errors import GpudashError
from .replay import _replay_lists

__all__ = ["probe", "sweep_row", "bisect"]


def probe(settings: dict, calls: tuple, max_ooms: int | None) -> int:
    """Replay ``calls`` under ``settings`` (no recording, no samples); the allocations
    refused, counting stopped at ``max_ooms`` (None: all)."""
    ops, keys, nbytes, streams, n_events = calls
    r = _replay_lists(settings, ops, keys, nbytes, n_events, record=False, per_call=False,
                      max_ooms=max_ooms, progress=None, streams=streams)
    return int(r.oom_count)


def sweep_row(settings: dict, calls: tuple) -> dict:
    """One row of a sweep: the replay of ``calls`` under ``settings``, summed up. The row's
    second setting is the model's (``allow_growth``, or PyTorch's ``expandable_segments``),
    and for PyTorch the other knobs the sweep varies, by name. Where the framework itself
    fails under the setting (PyTorch's internal assert with ``max_split_size_mb`` and
    expandable segments), the row does not fit and its ``error`` says why."""
    ops, keys, nbytes, streams, n_events = calls
    row: dict[str, Any] = {"fraction": settings["fraction"]}
    try:
        r = _replay_lists(settings, ops, keys, nbytes, n_events, record=False, per_call=True,
                          max_ooms=None, progress=None, streams=streams)
    except GpudashError as exc:   # the framework itself fails under this setting
        r = None
        error = str(exc)
    if settings["allocator"] == "torch":
        conf = settings["conf"]
        row["expandable_segments"] = conf.expandable_segments
        for knob in settings.get("varied") or ():
            row[knob] = settings["varied"][knob]
    else:
        row["allow_growth"] = settings["allow_growth"]
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


def bisect(run: Callable[[list[float]], dict[float, int]], lo: float, hi: float,
           tolerance: float, history: list, step: Callable[[], None] | None = None,
           depth: int = 1) -> float | None:
    """The smallest fraction in ``(lo, hi]`` that fits, by bisection (None when ``hi``
    fails).

    ``run(fractions)`` replays each fraction and returns ``{fraction: ooms}``. Each round
    asks it for the next ``depth`` levels of the bisection tree at once (``2**depth - 1``
    fractions: a cluster replays them side by side), then follows the path the one-at-a-time
    bisection takes, so the fractions noted in ``history`` (``(fraction, ooms)``, in order)
    and the result are the same whatever the depth. ``step()`` is called after each noted
    replay.
    """
    def note(frac: float, ooms: int) -> None:
        history.append((frac, ooms))
        if step is not None:
            step()

    first = run([hi])[hi]
    note(hi, first)
    if first:
        return None
    good, bad = hi, lo
    while good - bad > tolerance:
        # the tree of midpoints the next `depth` steps may visit
        nodes: list[float] = []
        frontier = [(good, bad)]
        for _ in range(depth):
            nxt = []
            for g, b in frontier:
                mid = (g + b) / 2.0
                if g - b <= tolerance or not b < mid < g:
                    continue
                nodes.append(mid)
                nxt += [(mid, b), (g, mid)]
            frontier = nxt
        if not nodes:   # as fine as floats go
            break
        results = run(nodes)
        for _ in range(depth):
            mid = (good + bad) / 2.0
            if good - bad <= tolerance or not bad < mid < good:
                break
            ooms = results[mid]
            note(mid, ooms)
            if ooms == 0:
                good = mid
            else:
                bad = mid
    return good
