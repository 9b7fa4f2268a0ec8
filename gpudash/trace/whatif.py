"""What-if questions over a trace: the smallest memory fraction that fits, and settings sweeps.

Both replay the trace (:func:`gpudash.trace.replay.replay`) without recording, through the
allocator model of the trace's framework (``allocator=`` picks the other one):

- :func:`min_fraction` bisects the fraction for the smallest value at which no allocation is
  refused: TensorFlow's ``per_process_gpu_memory_fraction`` (JAX's
  ``XLA_PYTHON_CLIENT_MEM_FRACTION``) or PyTorch's
  ``torch.cuda.set_per_process_memory_fraction``;
- :func:`sweep` replays a grid of fractions x the model's second setting (``allow_growth``
  for BFC, ``expandable_segments`` for PyTorch), in this process, in worker processes
  (``jobs``) or as tasks on a Dask cluster (``client``), and returns a :class:`SweepTable`.

A caveat on bisection: for the BFC allocator "fits" is not always monotone in the fraction.
With growth, regions double from 2 MiB and the last one is cut to what the limit leaves, so
a slightly larger limit can produce a different region layout (and a worse one). The
fraction :func:`min_fraction` returns has been replayed and fits; smaller fractions that
also fit may exist below a failing one (``MinFractionResult.non_monotone`` says when the
bisection saw such an inversion).

A trace that is less than the job (an out-of-memory log whose dump is elided, or missing,
as JAX prints none) gives answers for the calls it holds: both results carry
:func:`~gpudash.trace.caveats.trace_warnings` as ``warnings``, and the fraction is then a
lower bound.
"""

from __future__ import annotations

import contextlib
import html
import math
import multiprocessing
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import ConfigError
from .._units import format_bytes
from ..bfc import _check_number
from ..models import ReplaySettings, model_for
from .caveats import trace_warnings
from .format import Trace
from .replay import (
    _UNSET,
    _model,
    _model_calls,
    _progress_fn,
    _settings_for_meta,
    limit_for,
    resolve_settings,
)
from .tasks import Probe, bisect, probe, sweep_row

__all__ = ["min_fraction", "MinFractionResult", "sweep", "SweepTable", "DEFAULT_FRACTIONS",
           "Runner", "register_runner", "runner_for"]

#: The fractions :func:`sweep` tries by default: 0.1, 0.2, ..., 1.0.
DEFAULT_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(1, 11))


# ---------------------------------------------------------------------------- min_fraction
@dataclass
class MinFractionResult:
    """What :func:`min_fraction` found.

    Attributes
    ----------
    fraction : float or None
        The smallest fraction found at which the replay refuses nothing (within
        ``tolerance``); None when even ``hi`` fails.
    limit_bytes : int or None
        The allocator limit at that fraction.
    replays : int
        Replays run (``len(history) - known``).
    history : list of (float, int)
        ``(fraction, oom_count)`` of every fraction the bisection tried, in order. Failing
        replays stop at their first OOM unless ``count_ooms=True``, so their count is then
        1 ("at least one").
    known : int
        Fractions of ``history`` answered without a replay: their limit lies between the
        :attr:`~gpudash.trace.replay.ReplayResult.limit_floor` and the limit of a replay
        tried before, so their replay would have been that one, call for call.
    non_monotone : bool
        True when some replay failed at a larger fraction than one that fitted.
    device_bytes : int
        The simulated device size.
    tolerance : float
        The bisection's resolution: the boundary lies within this much below ``fraction``.
    warnings : list of str
        What the trace lacks to answer for the job that made it
        (:func:`~gpudash.trace.caveats.trace_warnings`); with any, ``fraction`` is a lower
        bound.
    allocator : str
        The model replayed: ``"bfc"`` or ``"torch"``; ``fraction`` is then TensorFlow's
        ``per_process_gpu_memory_fraction`` or PyTorch's
        ``set_per_process_memory_fraction``.
    assumed : list of str
        What the replays assumed that the trace does not say (the device's size...).
    settings : dict
        The other settings of the replays (as :attr:`ReplayResult.options` has them).
    """

    fraction: float | None
    limit_bytes: int | None
    replays: int
    history: list[tuple[float, int]] = field(default_factory=list)
    non_monotone: bool = False
    device_bytes: int = 0
    tolerance: float = 0.0
    warnings: list[str] = field(default_factory=list)
    allocator: str = "bfc"
    assumed: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict, repr=False)
    known: int = 0

    @property
    def fits(self) -> bool:
        """True when some fraction up to ``hi`` fits."""
        return self.fraction is not None

    def paste_lines(self, framework: str | None = None) -> list[str]:
        """The lines that apply :attr:`fraction` in ``framework`` (default: the model's own:
        TensorFlow for BFC, PyTorch for PyTorch's): ``GPUOptions`` / JAX's environment, or
        ``torch.cuda.set_per_process_memory_fraction`` and ``PYTORCH_CUDA_ALLOC_CONF``.
        Empty when nothing fits."""
        if self.fraction is None:
            return []
        model = model_for(self.allocator)
        fw = framework or model.frameworks[0]
        return model.paste_lines(fw, self.fraction, model.meta_settings(self.settings),
                                 self.device_bytes)

    def __repr__(self) -> str:
        note = (f", an incomplete trace: a lower bound ({len(self.warnings)} warning(s): "
                ".warnings)" if self.warnings else "")
        if self.assumed:
            note += f", assumed: {'; '.join(self.assumed)}"
        runs = f"replays={self.replays}" + (f", known={self.known}" if self.known else "")
        if self.fraction is None:
            return (f"MinFractionResult(no fit up to the largest fraction tried, "
                    f"{self.allocator}, {runs}{note})")
        return (f"MinFractionResult(fraction={self.fraction:.4f}, {self.allocator}, "
                f"limit={format_bytes(self.limit_bytes or 0)} of "
                f"{format_bytes(self.device_bytes)}, {runs}{note})")


#: The finest ``min_fraction`` tolerance: below it a step changes no limit.
MIN_TOLERANCE = 1e-15


def min_fraction(trace: Trace, device_bytes: int | str | None = None, *,
                 tolerance: float = 0.005, lo: float = 0.0, hi: float = 1.0,
                 count_ooms: bool = False, progress: Any = None, jobs: int = 1,
                 client: Any = None, **options: Any) -> MinFractionResult:
    """The smallest memory fraction at which the trace replays without OOM: TensorFlow's
    ``per_process_gpu_memory_fraction`` for BFC, PyTorch's
    ``torch.cuda.set_per_process_memory_fraction`` for its caching allocator.

    Parameters
    ----------
    trace : Trace
    device_bytes : int or str, optional
        Size of the simulated device. Default: what the trace says (a PyTorch OOM entry,
        a TensorFlow log's limit...), else an assumption the result names in ``assumed``
        (16 GiB for BFC; for PyTorch the smallest common GPU that held the trace).
    tolerance : float, default 0.005
        Bisection stops when the failing and fitting fractions are this close (absolute).
    lo : float, default 0.0
        A fraction assumed to fail (exclusive lower bound).
    hi : float, default 1.0
        The largest fraction tried; if it fails the result's ``fraction`` is None.
    count_ooms : bool, default False
        Replay failing settings to the end to count every OOM (slower); by default a
        failing replay stops at its first OOM.
    progress : callable or True, optional
        ``progress(done, total)`` in fractions tried, replayed or known (``total`` is the
        bisection's upper bound on them); True prints to stderr.
    jobs : int, default 1
        Replay in this many worker processes: each round replays the next midpoint and
        ``jobs - 1`` of those the following steps may visit (the lower half first), and
        the bisection follows the same path, so the result and history are those of
        ``jobs=1``. On Linux, workers are forked where this process runs no other thread
        (they start in milliseconds and share the calls); else started by forkserver (or
        spawn), and the calls are sent to each: the first use starts the server (about a
        second), and a long trace's calls take a while to send.
    client : distributed.Client, optional
        Run the replays as tasks on this Dask cluster (the trace's calls are sent to each
        worker once). The bisection replays as many of the midpoints its next steps may
        visit at once as the cluster has threads, and follows the same path: the result,
        history and fractions known are those of the local run.
    **options
        Other :func:`~gpudash.trace.replay.replay` settings: ``allocator``, and the model's
        own (``allow_growth``, ``garbage_collection``, ``deferred_deletion_bytes``... for
        BFC; ``conf``, ``expandable_segments``, ``max_split_size_mb``... for PyTorch),
        ``device``, ``options``.

    Returns
    -------
    MinFractionResult

    Notes
    -----
    Bisection on the fraction: each step replays at the midpoint (``record=False``,
    ``per_call=False``) and keeps the half where the boundary lies. The returned fraction is
    one that was replayed and fits. Fitting need not be monotone in the fraction (see this
    module's docstring), so a smaller fitting fraction may exist.

    Examples
    --------
    >>> from gpudash.trace.workloads import training_loop
    >>> r = min_fraction(training_loop(steps=2, layers=2, hidden=1024), "1GiB")
    >>> r.fits and r.fraction < 0.2
    True
    """
    tolerance = _real("tolerance", tolerance)
    if not (math.isfinite(tolerance) and tolerance >= MIN_TOLERANCE):
        raise ConfigError(f"tolerance must be a fraction >= {MIN_TOLERANCE:g} (finer steps "
                          f"change the limit by less than a byte of a 1 PiB device); got "
                          f"{tolerance!r}")
    lo, hi = _real("lo", lo), _real("hi", hi)
    if not (0.0 <= lo < hi and math.isfinite(hi)):
        raise ConfigError(f"need 0 <= lo < hi, both finite fractions; got lo={lo}, hi={hi}")
    if "fraction" in options or "memory_limit" in options:
        raise ValueError("min_fraction chooses the fraction itself; do not pass fraction= or "
                         "memory_limit=")
    jobs = _check_jobs(jobs, client)
    extra = options.pop("options", None)
    base = _base_settings(trace, extra, device_bytes, options)
    rule = _unsupported(base)
    if rule is not None:
        raise ConfigError(f"min_fraction: {rule}")
    dev_bytes = base["device_bytes"]
    ops, keys, nbytes, streams, n_events = _model_calls(trace, base)
    report = _progress_fn(progress, "min_fraction")
    total = 1 + max(1, math.ceil(math.log2(max((hi - lo) / tolerance, 1.0))))
    history: list[tuple[float, int]] = []
    warnings = trace_warnings(trace, base["device"])
    said = {"allocator": base["allocator"], "assumed": list(base.get("assumed") or []),
            "settings": _settings_for_meta(base)}
    calls = (ops, keys, nbytes, streams, n_events)
    max_ooms = None if count_ooms else 1

    def settings(frac: float) -> dict:
        return base.replace(fraction=frac, memory_limit=limit_for(base, frac))

    def step() -> None:
        if report is not None:
            report(min(len(history), total - 1), total)

    def limit_of(frac: float) -> int:
        return limit_for(base, frac)

    good, inferred = runner_for(client, jobs).bisect(
        client, jobs, settings, calls, lo, hi, tolerance, max_ooms, history, step, limit_of)
    if report is not None:
        report(total, total)
    fitted = [f for f, n in history if n == 0]
    failed = [f for f, n in history if n > 0]
    non_monotone = bool(fitted and failed and max(failed) > min(fitted))
    return MinFractionResult(good, None if good is None else limit_for(base, good),
                             len(history) - inferred, history, non_monotone, dev_bytes,
                             tolerance, warnings, **said, known=inferred)


def _base_settings(trace: Trace, extra: Any, device_bytes: Any, options: dict,
                   **more: Any) -> dict:
    """The settings every replay of a what-if shares: the model's own resolution (a
    PyTorch replay is never exact here: the fraction or setting changes)."""
    if device_bytes is not None:
        options = dict(options, device_bytes=device_bytes)
    if "exact" in _model(trace, extra, options).settings_type.names():
        options = dict(options, exact=False)
    return resolve_settings(trace, extra, **options, **more)


# ---------------------------------------------------------------------------- sweep
_ROW_KEYS = ("fraction", "allow_growth", "limit_bytes", "fits", "oom_count", "first_oom",
             "peak_pool_bytes", "peak_bytes_in_use", "worst_fragmentation", "extensions")


def _row_keys(allocator: str) -> tuple[str, ...]:
    grid = next(iter(model_for(allocator).grid))  # what its rows vary besides the fraction
    return tuple(grid if k == "allow_growth" else k for k in _ROW_KEYS)

# Worker-process state: the trace's calls, set once per process by _init_worker.
_WORKER: dict[str, Any] = {}


def _init_worker(ops: np.ndarray, keys: np.ndarray, nbytes: np.ndarray, streams: Any,
                 n_events: int) -> None:
    # numpy: listed a chunk at a time
    _WORKER["calls"] = (ops, keys, nbytes, streams, n_events)


def _sweep_one(settings: dict) -> dict:
    """A worker process's sweep row, over the calls :func:`_init_worker` gave it."""
    return sweep_row(settings, _WORKER["calls"])


def _probe_one(settings: dict, max_ooms: int | None) -> Probe:
    """A worker process's bisection replay, over the calls :func:`_init_worker` gave it."""
    return probe(settings, _WORKER["calls"], max_ooms)


def _check_jobs(jobs: Any, client: Any) -> int:
    if isinstance(jobs, (bool, np.bool_)) or not isinstance(jobs, (int, np.integer)) \
            or jobs < 1:
        raise ConfigError(f"jobs must be an integer >= 1; got {jobs!r}")
    if client is not None and jobs != 1:
        raise ValueError(f"pass jobs= (local processes) or client= (a Dask cluster), not "
                         f"both; got jobs={jobs} and a client")
    return int(jobs)


def _real(name: str, value: Any) -> float:
    """A number argument as a float; a string, bool or None is refused by name (a
    ConfigError)."""
    return _check_number(name, value, "a number")


def sweep(trace: Trace, fractions: Iterable[float | None] = DEFAULT_FRACTIONS,
          allow_growth: bool | Iterable[bool] = _UNSET, *,
          expandable_segments: bool | Iterable[bool] = _UNSET,
          device_bytes: int | str | None = None, jobs: int = 1, progress: Any = None,
          client: Any = None, vary: dict | None = None, **options: Any) -> SweepTable:
    """Replay a trace under every fraction x the model's second setting: ``allow_growth``
    for BFC (TensorFlow, JAX), ``expandable_segments`` for PyTorch's caching allocator.

    Parameters
    ----------
    trace : Trace
    fractions : iterable of float or None
        The fractions: TensorFlow's ``per_process_gpu_memory_fraction`` (None or 0: its
        default rule) or PyTorch's ``set_per_process_memory_fraction`` (None: none set).
    allow_growth : bool or iterable of bool, default (True, False)
        BFC only.
    expandable_segments : bool or iterable of bool, default (False, True)
        PyTorch only (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:...``).
    device_bytes : int or str, optional
        The simulated device; default as :func:`min_fraction`'s.
    vary : dict, optional
        PyTorch only: more of its knobs to cross with the rest, each with its values
        (``{"max_split_size_mb": [None, 128, 512], "garbage_collection_threshold": [None,
        0.8]}``; None keeps the trace's own setting); each row names its values.
    jobs : int, default 1
        1 replays in this process; 2 or more use that many worker processes
        (:class:`~concurrent.futures.ProcessPoolExecutor`), each given the trace's calls as
        numpy arrays once.
    progress : callable or True, optional
        ``progress(done, total)`` in settings; True prints to stderr.
    client : distributed.Client, optional
        Run one Dask task per setting on this cluster instead (the trace's calls are sent
        to each worker once); the table is the same as a local run's. ``jobs`` must then
        stay 1.
    **options
        Other :func:`~gpudash.trace.replay.replay` settings, the same for every row
        (``allocator`` picks the model).

    Returns
    -------
    SweepTable
        One row per setting, fraction-major, in the order given.
    """
    extra = options.pop("options", None)
    probe = dict(options)
    model = _model(trace, extra, probe)
    own = next(iter(model.grid))   # the setting the model's sweep varies
    values = {"allow_growth": allow_growth, "expandable_segments": expandable_segments}
    for other, given in values.items():
        if other != own and given is not _UNSET:
            raise ConfigError(f"{other} is not a setting of {model.title} (its sweep varies "
                              f"{own}); pass allocator= to sweep the other model")
    grid = values[own]
    if grid is _UNSET:
        grid = model.grid[own]
    if isinstance(grid, (bool, np.bool_)):
        grid = (bool(grid),)
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Iterable):
        raise ConfigError(f"{own} must be True, False or a list of them; got {grid!r}")
    if fractions is None or isinstance(fractions, (int, float, np.number)) \
            and not isinstance(fractions, (bool, np.bool_)):
        fractions = [fractions]  # one fraction
    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, Iterable):
        raise ConfigError(f"fractions must be a list of fractions; got {fractions!r}")
    fractions = [f if f is None else _real("fraction", f) for f in fractions]
    growths = []
    for g in grid:
        if not isinstance(g, (bool, np.bool_)):  # "false" or None would be read as a truth
            raise ConfigError(f"{own} values must be True or False; got {g!r}")
        growths.append(bool(g))
    if not fractions or not growths:
        raise ConfigError(f"sweep needs at least one fraction and one {own} value")
    jobs = _check_jobs(jobs, client)
    for bad in ("fraction", "memory_limit"):
        if bad in options:
            raise ValueError(f"sweep sets {bad} itself; pass fractions= instead")
    for f in fractions:
        model.check_fraction(f)
    combos = _vary_combos(vary, model)
    settings = []
    for f in fractions:
        for g in growths:
            for combo in combos:
                s = _base_settings(trace, extra, device_bytes, options, fraction=f,
                                   **{own: g}, **combo)
                if combo:
                    s = s.replace(varied=dict(combo))
                settings.append(s)
    # settings PyTorch does not support together are answered by its rule, not replayed
    every, rules = settings, [_unsupported(s) for s in settings]
    settings = [s for s, rule in zip(every, rules) if rule is None]
    if not settings:
        return SweepTable([_unsupported_row(s, rule) for s, rule in zip(every, rules)],
                          device_bytes=every[0]["device_bytes"],
                          warnings=trace_warnings(trace, every[0]["device"]),
                          allocator=model.name, assumed=every[0].get("assumed") or [])
    lists = _model_calls(trace, settings[0])
    report = _progress_fn(progress, "sweep")
    total = len(settings)
    rows = list(runner_for(client, jobs if total > 1 else 1).sweep(
        client, jobs, settings, lists, report))
    if len(settings) < len(every):
        replayed = iter(rows)
        rows = [_unsupported_row(s, rule) if rule is not None else next(replayed)
                for s, rule in zip(every, rules)]
    return SweepTable([r for r in rows if r is not None],
                      device_bytes=settings[0]["device_bytes"],
                      warnings=trace_warnings(trace, settings[0]["device"]),
                      allocator=model.name, assumed=settings[0].get("assumed") or [])


def _unsupported(settings: dict) -> str | None:
    """PyTorch's rule for settings it does not support together
    (:meth:`~gpudash.CachingAllocatorConfig.unsupported`), None for other settings."""
    return ReplaySettings.of(settings).unsupported()


def _unsupported_row(settings: dict, rule: str) -> dict:
    """A sweep row for settings PyTorch does not support together: no fit, the rule as
    its error (as the row of a replay that reaches PyTorch's assert,
    :func:`~.tasks.sweep_row`)."""
    row: dict[str, Any] = {"fraction": settings["fraction"],
                           **ReplaySettings.of(settings).row()}
    row.update({"limit_bytes": 0, "fits": False, "oom_count": 0, "first_oom": None,
                "peak_pool_bytes": 0, "peak_bytes_in_use": 0, "worst_fragmentation": 0.0,
                "extensions": 0, "error": rule})
    return row




def _vary_combos(vary: dict | None, model: Any) -> list[dict]:
    """The cross product of ``vary``'s values, as settings dicts ([{}] when none)."""
    if not vary:
        return [{}]
    if not model.sweep_knobs:
        raise ConfigError("vary= crosses PyTorch's knobs (max_split_size_mb, "
                          "garbage_collection_threshold...); this sweep runs "
                          f"{model.title}: pass allocator='torch'")
    if not isinstance(vary, dict):
        raise ConfigError(f"vary must be a dict of knob -> list of values; got {vary!r}")
    combos: list[dict] = [{}]
    for knob, values in vary.items():
        if knob not in model.sweep_knobs:
            raise ConfigError(f"vary: {knob!r} is not a knob a sweep varies; known: "
                              f"{', '.join(model.sweep_knobs)} (the fraction and expandable_segments "
                              "have their own arguments)")
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            values = [values]
        values = list(values)
        if not values:
            raise ConfigError(f"vary: {knob} has no values")
        combos = [dict(c, **{knob: v}) for c in combos for v in values]
    return combos


def _mp_context() -> Any:
    """forkserver where there is one (fast after the first start, and safe with threads),
    else spawn. The forkserver preloads this module (added to what it preloads already):
    each worker then starts with gpudash imported, in milliseconds, not the second or so
    an import takes. That holds from the server's start: one already running stays as
    it is."""
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" not in methods:
        return multiprocessing.get_context("spawn")
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    preload = list(getattr(server, "_preload_modules", None) or ["__main__"])
    if __name__ not in preload:
        forkserver.set_forkserver_preload(preload + [__name__])
    return multiprocessing.get_context("forkserver")


@contextlib.contextmanager
def _workers(**kwargs: Any) -> Iterator[ProcessPoolExecutor]:
    """A :class:`~concurrent.futures.ProcessPoolExecutor` that, when the block ends by an
    exception (Ctrl-C: KeyboardInterrupt), cancels what is queued and ends its workers at
    once, instead of waiting for every replay already handed out (the executor's own exit
    waits for them, and for the queue too)."""
    ex = ProcessPoolExecutor(**kwargs)
    try:
        yield ex
    except BaseException:
        _stop_now(ex)
        raise
    ex.shutdown(wait=True)


def _stop_now(ex: ProcessPoolExecutor) -> None:
    """Cancel ``ex``'s queued work and terminate its worker processes (SIGTERM, then
    SIGKILL for one still there after 2 s)."""
    procs = list((getattr(ex, "_processes", None) or {}).values())
    ex.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


def _pool_context() -> Any:
    """fork on Linux where this process runs no other thread: workers start in
    milliseconds and share the trace's calls (a long trace's take seconds to send). Else
    :func:`_mp_context`: a fork while another thread holds a lock would leave it held in
    the child, and macOS's system libraries do not survive a fork (Python spawns there)."""
    if sys.platform.startswith("linux") and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return _mp_context()


class SweepTable:
    """The rows of a :func:`sweep`, with table views.

    Parameters
    ----------
    rows : list of dict
        Each with ``fraction``, ``allow_growth`` (BFC) or ``expandable_segments``
        (PyTorch), ``limit_bytes``, ``fits``, ``oom_count``, ``first_oom`` (call index or
        None), ``peak_pool_bytes``, ``peak_bytes_in_use`` (PyTorch's peak reserved and
        allocated), ``worst_fragmentation`` and ``extensions`` (regions, or PyTorch's
        ``num_device_alloc``).
    device_bytes : int, optional
        The simulated device size (shown by :meth:`to_text`).
    warnings : list of str, optional
        What the trace lacks to answer for the job that made it
        (:func:`~gpudash.trace.caveats.trace_warnings`), shown with the table.
    allocator : str, default "bfc"
        The model of the rows, ``"bfc"`` or ``"torch"``: the table speaks its words.
    assumed : list of str, optional
        What the replays assumed that the trace does not say, shown with the table.
    """

    COLUMNS = _ROW_KEYS

    def __init__(self, rows: Sequence[dict], device_bytes: int | None = None,
                 warnings: Sequence[str] = (), allocator: str = "bfc",
                 assumed: Sequence[str] = ()) -> None:
        self.rows = [dict(r) for r in rows]
        self.device_bytes = device_bytes
        self.warnings = list(warnings)
        self.allocator = model_for(allocator).name
        self.assumed = list(assumed)
        self.setting = next(iter(model_for(self.allocator).grid))
        self.varied = [k for k in model_for(self.allocator).sweep_knobs
                       if any(k in r for r in self.rows)]
        keys = _row_keys(self.allocator)
        self.COLUMNS = keys[:2] + tuple(self.varied) + keys[2:]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SweepTable):
            return NotImplemented
        return self.rows == other.rows

    __hash__ = None  # type: ignore[assignment]

    def columns(self) -> dict[str, np.ndarray]:
        """The rows as numpy columns (``fraction`` NaN for TensorFlow's default,
        ``first_oom`` -1 where none)."""
        rows = self.rows
        out = {
            "fraction": np.array([np.nan if r["fraction"] is None else r["fraction"]
                                  for r in rows], dtype=np.float64),
            self.setting: np.array([r[self.setting] for r in rows], dtype=bool),
            "fits": np.array([r["fits"] for r in rows], dtype=bool),
            "first_oom": np.array([-1 if r["first_oom"] is None else r["first_oom"]
                                   for r in rows], dtype=np.int64),
            "worst_fragmentation": np.array([r["worst_fragmentation"] for r in rows],
                                            dtype=np.float64),
        }
        for k in ("limit_bytes", "oom_count", "peak_pool_bytes", "peak_bytes_in_use",
                  "extensions"):
            out[k] = np.array([r[k] for r in rows], dtype=np.int64)
        for k in self.varied:   # None (the trace's own setting) as NaN
            out[k] = np.array([np.nan if r.get(k) is None else float(r[k])
                               if not isinstance(r[k], str) else np.nan for r in rows],
                              dtype=np.float64)
        return {k: out[k] for k in self.COLUMNS}

    def best(self) -> dict | None:
        """The fitting row with the smallest fraction (then the smallest peak pool), or None.

        Rows at TensorFlow's default fraction count as the limit they resolved to (and
        PyTorch's rows without a fraction as the whole device). Ties go to growth on (BFC) or
        expandable segments off (PyTorch's default).
        """
        fitting = [r for r in self.rows if r["fits"] and not r.get("error")]
        if not fitting:
            return None
        key = self.setting
        prefer = model_for(self.allocator).grid[key][0]   # the model's default first
        return min(fitting, key=lambda r: (r["limit_bytes"], r["peak_pool_bytes"],
                                           r[key] != prefer))

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        model = model_for(self.allocator)   # the model's own words
        said = model.sweep_words
        head = ["fraction", said["setting"], *self.varied, "limit", "fits", "OOMs", "first OOM",
                f"peak {model.pool}", f"peak {model.in_use}", "worst frag", model.regions]
        body = []
        for r in self.rows:
            body.append([
                said["unset_fraction"] if r["fraction"] is None
                else f"{r['fraction']:.3g}",
                "yes" if r[self.setting] else "no",
                *("trace's" if r.get(k) is None else str(r[k]) for k in self.varied),
                format_bytes(r["limit_bytes"]) if not r.get("error") else "-",
                "FAILS" if r.get("error") else "yes" if r["fits"] else "NO",
                f"{r['oom_count']:,}",
                "-" if r["first_oom"] is None else f"{r['first_oom']:,}",
                format_bytes(r["peak_pool_bytes"]),
                format_bytes(r["peak_bytes_in_use"]),
                f"{100 * r['worst_fragmentation']:.1f} %",
                str(r["extensions"]),
            ])
            if r.get("error"):   # the framework fails: no figures to show
                cut = 2 + len(self.varied) + 2
                body[-1][cut:] = ["-"] * (len(body[-1]) - cut)
        return head, body

    def _errors(self) -> list[str]:
        """One line per distinct error of the rows the framework itself fails."""
        seen = []
        for r in self.rows:
            e = r.get("error")
            if e and e not in seen:
                seen.append(e)
        return [f"FAILS: {e}" for e in seen]

    def to_text(self, *, warnings: bool = True) -> str:
        """An aligned plain-text table with human-readable bytes (and what the replays
        assumed and the trace's warnings after it, unless ``warnings=False``)."""
        head, body = self._cells()
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines.append("  ".join("-" * w for w in widths))
        for row in body:
            lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if self.device_bytes:
            lines.append(f"(device {format_bytes(self.device_bytes)}, "
                         f"{model_for(self.allocator).title})")
        lines.extend(self._errors())
        if warnings:
            lines.extend(f"assumed: {a}" for a in self.assumed)
            lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)

    def to_html(self) -> str:
        """A plain ``<table>`` (no styling)."""
        head, body = self._cells()
        out = ["<table>", "<thead><tr>"
               + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr></thead>",
               "<tbody>"]
        for row in body:
            out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
        out.append("</tbody></table>")
        out.extend(f"<p>{html.escape(e)}</p>" for e in self._errors())
        out.extend(f"<p>assumed: {html.escape(a)}</p>" for a in self.assumed)
        out.extend(f'<p class="warning">warning: {html.escape(w)}</p>' for w in self.warnings)
        return "\n".join(out)

    _repr_html_ = to_html

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        best = self.best()
        b = "none fits" if best is None else (
            f"best fraction={best['fraction']}, {self.setting}={best[self.setting]}")
        if self.warnings:
            b += f", an incomplete trace ({len(self.warnings)} warning(s): .warnings)"
        return f"SweepTable(rows={len(self.rows)}, {b})"


# ---------------------------------------------------------------------------- runners
@dataclass(frozen=True)
class Runner:
    """One way to run a what-if's replays: in this process, in worker processes (``jobs``),
    or on a cluster (``client``). A runner registers itself (:func:`register_runner`);
    :func:`min_fraction` and :func:`sweep` ask :func:`runner_for` which one takes their
    ``client`` and ``jobs``, and know none of them.

    Attributes
    ----------
    name : str
    takes : callable
        ``takes(client, jobs) -> bool``.
    sweep : callable
        ``sweep(client, jobs, settings, calls, report) -> rows``: one
        :func:`~gpudash.trace.tasks.sweep_row` per setting, in the order of ``settings``
        (``calls``: the trace's ``(ops, keys, nbytes, streams, n_events)``; ``report``:
        a progress callback or None).
    bisect : callable
        ``bisect(client, jobs, make_settings, calls, lo, hi, tolerance, max_ooms, history,
        step, limit_of) -> (fraction, inferred)``: :func:`~gpudash.trace.tasks.bisect`
        with its replays run here.
    """

    name: str
    takes: Any
    sweep: Any
    bisect: Any


#: The registered runners, the latest first.
_RUNNERS: list[Runner] = []
#: Modules of optional dependencies whose import registers a runner (``gpudash.dask``'s
#: for a Dask client): imported only when a ``client`` comes that no registered runner
#: takes.
RUNNER_MODULES: list[str] = ["gpudash.dask._whatif"]


def register_runner(runner: Runner) -> Runner:
    """Add ``runner`` (replacing one of the same name); it is asked before those
    registered earlier."""
    _RUNNERS[:] = [runner] + [r for r in _RUNNERS if r.name != runner.name]
    return runner


def runner_for(client: Any, jobs: int) -> Runner:
    """The runner that takes ``client`` (None: none) and ``jobs``.

    Raises
    ------
    TypeError
        No registered runner (nor one that :data:`RUNNER_MODULES` registers) takes them.
    """
    found = next((r for r in _RUNNERS if r.takes(client, jobs)), None)
    if found is None and client is not None:
        import importlib

        for module in RUNNER_MODULES:
            importlib.import_module(module)
        found = next((r for r in _RUNNERS if r.takes(client, jobs)), None)
    if found is None:
        raise TypeError(f"no what-if runner takes client={type(client).__name__} with "
                        f"jobs={jobs}")
    return found


def _here_sweep(client: Any, jobs: int, settings: list, calls: tuple, report: Any) -> list:
    rows = []
    for s in settings:
        rows.append(sweep_row(s, calls))
        if report is not None:
            report(len(rows), len(settings))
    return rows


def _here_bisect(client: Any, jobs: int, make_settings: Any, calls: tuple, lo: float,
                 hi: float, tolerance: float, max_ooms: int | None, history: list, step: Any,
                 limit_of: Any) -> tuple:
    return bisect(lambda fracs: {f: probe(make_settings(f), calls, max_ooms) for f in fracs},
                  lo, hi, tolerance, history, step, limit_of=limit_of)


def _processes_sweep(client: Any, jobs: int, settings: list, calls: tuple,
                     report: Any) -> list:
    rows: list[dict | None] = [None] * len(settings)
    done = 0
    with _workers(max_workers=min(jobs, len(settings)), mp_context=_pool_context(),
                  initializer=_init_worker, initargs=calls) as ex:
        futures = {ex.submit(_sweep_one, s): i for i, s in enumerate(settings)}
        for fut in as_completed(futures):
            rows[futures[fut]] = fut.result()
            done += 1
            if report is not None:
                report(done, len(settings))
    return rows


def _processes_bisect(client: Any, jobs: int, make_settings: Any, calls: tuple, lo: float,
                      hi: float, tolerance: float, max_ooms: int | None, history: list,
                      step: Any, limit_of: Any) -> tuple:
    with _workers(max_workers=jobs, mp_context=_pool_context(),
                  initializer=_init_worker, initargs=calls) as ex:
        def run(fracs: list[float]) -> dict:
            futures = {f: ex.submit(_probe_one, make_settings(f), max_ooms) for f in fracs}
            # a replay that failed beside the path must not stop the bisection: bisect
            # raises its error only if the path gets there
            return {f: fut.exception() or fut.result() for f, fut in futures.items()}

        return bisect(run, lo, hi, tolerance, history, step, width=jobs, limit_of=limit_of)


register_runner(Runner("processes", lambda client, jobs: client is None and jobs > 1,
                       _processes_sweep, _processes_bisect))
register_runner(Runner("here", lambda client, jobs: client is None and jobs == 1,
                       _here_sweep, _here_bisect))
