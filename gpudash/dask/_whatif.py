"""What-if replays as Dask tasks (the ``client=`` path of :func:`gpudash.trace.whatif.sweep`
and :func:`~gpudash.trace.whatif.min_fraction`): a what-if runner
(:class:`gpudash.trace.whatif.Runner`) that registers itself on import and takes any
``client``.

The trace's calls are scattered to every worker once (``broadcast=True``); each task replays
one setting with :mod:`gpudash.trace.tasks` (the same units a local run uses: a sweep row, a
bisection probe), and the bisection is :func:`gpudash.trace.tasks.bisect`, fed several
midpoints at a time. A worker process turns the calls into Python lists once and reuses them
for every replay it runs.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from ..trace.tasks import Probe, bisect, probe, sweep_row
from ..trace.whatif import Runner, register_runner

__all__ = ["sweep_rows", "bisect_on"]


class _Calls:
    """The calls of one trace, as shipped to workers (numpy arrays pickle compactly)."""

    def __init__(self, op: np.ndarray, key: np.ndarray, nbytes: np.ndarray, streams: Any,
                 n_events: int) -> None:
        self.token = uuid.uuid4().hex
        self.op = np.asarray(op)
        self.key = np.asarray(key)
        self.nbytes = np.asarray(nbytes)
        self.streams = None if streams is None else np.asarray(streams)  # PyTorch's only
        self.n_events = int(n_events)


_CACHE: dict[str, tuple] = {}  # per worker process: token -> lists (the latest trace only)


def _lists(calls: _Calls) -> tuple:
    lists = _CACHE.get(calls.token)
    if lists is None:
        _CACHE.clear()
        lists = _CACHE[calls.token] = (calls.op.tolist(), calls.key.tolist(),
                                       calls.nbytes.tolist(), calls.streams, calls.n_events)
    return lists


def _sweep_task(settings: dict, calls: _Calls) -> dict:
    return sweep_row(settings, _lists(calls))


def _fits_task(settings: dict, calls: _Calls, max_ooms: int | None) -> tuple:
    return tuple(probe(settings, _lists(calls), max_ooms))


def _scatter(client: Any, calls: tuple) -> Any:
    [future] = client.scatter([_Calls(*calls)], broadcast=True, hash=False)
    return future


def _check_client(client: Any) -> None:
    if getattr(client, "asynchronous", False):
        raise ValueError("client= needs a synchronous distributed.Client")
    if not hasattr(client, "scatter") or not hasattr(client, "submit"):
        raise TypeError(f"client must be a distributed.Client; got {type(client).__name__}")


def sweep_rows(client: Any, settings: list[dict], calls: tuple,
               report: Callable[[int, int], None] | None) -> list[dict]:
    """One replay per setting as Dask tasks; the rows in the order of ``settings``."""
    from distributed import as_completed

    _check_client(client)
    calls = _scatter(client, calls)
    token = uuid.uuid4().hex[:8]
    futures = [client.submit(_sweep_task, s, calls, key=f"gpudash-sweep-{token}-{i}",
                             pure=False) for i, s in enumerate(settings)]
    index = {f.key: i for i, f in enumerate(futures)}
    rows: list[dict | None] = [None] * len(settings)
    done = 0
    try:
        # the client's loop: as_completed() would otherwise look for a default client
        for fut in as_completed(futures, loop=client.loop):
            rows[index[fut.key]] = fut.result()
            done += 1
            if report is not None:
                report(done, len(settings))
    finally:
        for f in futures:
            f.release()
        calls.release()
    return [r for r in rows if r is not None]


def bisect_on(client: Any, make_settings: Callable[[float], dict], calls: tuple, lo: float,
              hi: float, tolerance: float, max_ooms: int | None, history: list,
              step: Callable[[], None] | None,
              limit_of: Callable[[float], int] | None = None) -> tuple:
    """:func:`~gpudash.trace.whatif.min_fraction`'s bisection, replays as Dask tasks: the
    fraction and the count of fractions known without a replay, as
    :func:`gpudash.trace.tasks.bisect` returns them.

    Speculative: each round replays as many of the midpoints the next steps may visit as
    the cluster has threads (none whose answer a replay on the path already gives), then
    follows the path the sequential bisection would take
    (:func:`gpudash.trace.tasks.bisect`). The fractions tried, the history and
    the result are exactly those of the local run.
    """
    _check_client(client)
    shipped = _scatter(client, calls)
    threads = max(1, sum(client.nthreads().values()))
    token = uuid.uuid4().hex[:8]
    count = [0]

    def run(fractions: list[float]) -> dict[float, Any]:
        futures = []
        for f in fractions:
            count[0] += 1
            futures.append(client.submit(_fits_task, make_settings(f), shipped, max_ooms,
                                         key=f"gpudash-bisect-{token}-{count[0]}",
                                         pure=False))
        out: dict[float, Any] = {}
        try:
            # each future's own result (its client's, not a default one): a replay that
            # failed beside the bisection's path must not stop it
            for f, fut in zip(fractions, futures):
                try:
                    out[f] = Probe(*fut.result())
                except Exception as exc:   # raised by bisect if the path gets there
                    out[f] = exc
            return out
        finally:
            for fut in futures:
                fut.release()

    try:
        return bisect(run, lo, hi, tolerance, history, step, width=threads, limit_of=limit_of)
    finally:
        shipped.release()


def _sweep(client: Any, jobs: int, settings: list[dict], calls: tuple,
           report: Callable[[int, int], None] | None) -> list[dict]:
    return sweep_rows(client, settings, calls, report)


def _bisect(client: Any, jobs: int, make_settings: Callable[[float], dict], calls: tuple,
            lo: float, hi: float, tolerance: float, max_ooms: int | None, history: list,
            step: Callable[[], None] | None, limit_of: Callable[[float], int] | None) -> tuple:
    return bisect_on(client, make_settings, calls, lo, hi, tolerance, max_ooms, history, step,
                     limit_of)


register_runner(Runner("dask", lambda client, jobs: client is not None, _sweep, _bisect))
