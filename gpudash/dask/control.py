"""Acting on the cluster: :func:`configure_workers` and :func:`collect_traces`."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from .._errors import ConfigError
from .._eventsource import expand_records as _expand_numpy
from ..events import COLUMN_DTYPES, COLUMNS
from ..options import GPUOptions
from ..widgets.feeds import CONTROL_NAMES
from . import _wire
from .model import ClusterModel, _Hub
from .plugin import run_apply, run_check, run_settings

__all__ = ["configure_workers", "collect_traces", "validate_changes"]

logger = logging.getLogger("gpudash")

_EXTEND, _RELEASE, _ALLOC = 5, 6, 1


def validate_changes(changes: dict) -> dict:
    """Check live-setting changes on the client: names among
    :data:`~gpudash.widgets.feeds.CONTROL_NAMES`, values as ``GPUOptions`` accepts them.

    Returns the converted values; raises :class:`~gpudash.ConfigError` naming the field, the
    value and what is accepted."""
    if not changes:
        raise ConfigError("nothing to change: pass one or more of "
                          f"{', '.join(CONTROL_NAMES)}")
    unknown = [k for k in changes if k not in CONTROL_NAMES]
    if unknown:
        raise ConfigError(f"{', '.join(map(repr, unknown))} cannot change on a running "
                          f"worker; the live settings are: {', '.join(CONTROL_NAMES)}")
    opts = GPUOptions().copy(**changes)  # raises ConfigError for a bad value
    return {k: getattr(opts, k) for k in changes}


def _resolve_workers(client: Any, workers: Any) -> list[str]:
    # Ask the scheduler itself: Client.scheduler_info() returns a cache that the client's own
    # periodic refresh (which asks for no workers) can overwrite between fetch and read.
    if getattr(client, "asynchronous", False):
        info = client.scheduler_info(n_workers=-1).get("workers", {})
    else:
        info = client.sync(client.scheduler.identity, n_workers=-1).get("workers", {})
    if workers is None:
        if not info:
            raise ConfigError("the cluster has no workers")
        return sorted(info)
    if isinstance(workers, str):
        workers = [workers]
    by_name = {str(v.get("name")): a for a, v in info.items()}
    out = []
    for w in workers:
        if w in info:
            out.append(w)
        elif str(w) in by_name:
            out.append(by_name[str(w)])
        else:
            raise ConfigError(f"no worker {w!r} in the cluster; its workers are: "
                              f"{', '.join(sorted(info)) or 'none'}")
    return out


def _errors(results: dict, targets: list[str]) -> dict[str, str]:
    out = {}
    for a in targets:
        if a not in results:
            out[a] = "did not answer (it left the cluster?)"
        elif isinstance(results[a], BaseException):
            out[a] = str(results[a]) or type(results[a]).__name__
        elif isinstance(results[a], dict) and "error" in results[a]:
            out[a] = str(results[a]["error"])
    return out


def configure_workers(client: Any, workers: Any = None, *, device: int | None = None,
                      **changes: Any) -> dict[str, list[dict]]:
    """Change live settings on every worker (or some) of a gpudash Dask cluster.

    Parameters
    ----------
    client : distributed.Client
    workers : str or list of str, optional
        Addresses or names of the workers; all by default.
    device : int, optional
        One device of each worker's session; all by default.
    **changes
        ``per_process_gpu_memory_fraction``, ``allow_growth`` and/or
        ``deferred_deletion_bytes`` (as :meth:`gpudash.Session.configure`).

    Returns
    -------
    dict
        ``{address: [settings of each device]}`` read back on each worker after the change
        (``fraction``, ``allow_growth``, ``deferred_deletion_bytes``, ``limit``, ``total``,
        ``pool_bytes``, ``bytes_in_use``).

    Raises
    ------
    ConfigError
        A bad name or value (checked on the client: no worker is contacted), or a value a
        worker refuses (checked on every worker before any applies it). The message names
        the worker. Nothing changes anywhere in either case.
    """
    checked = validate_changes(changes)
    if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
        raise ConfigError(f"device must be a device index or None (all); got {device!r}")
    targets = _resolve_workers(client, workers)
    errors = _errors(client.run(run_check, checked, device, workers=targets,
                                on_error="return"), targets)
    if errors:
        raise ConfigError("configure_workers changed nothing: " + "; ".join(
            f"worker {a}: {m}" for a, m in sorted(errors.items())))
    results = client.run(run_apply, checked, device, workers=targets, on_error="return")
    errors = _errors(results, targets)
    if errors:
        applied = [a for a in targets if a not in errors]
        _roll_back(client, results, applied, device)
        raise ConfigError("configure_workers changed nothing (the workers that had applied "
                          "the change were set back): " + "; ".join(
                              f"worker {a}: {m}" for a, m in sorted(errors.items())))
    return {a: results[a]["settings"] for a in targets}


def _roll_back(client: Any, results: dict, applied: list[str], device: int | None) -> None:
    for a in applied:
        before = results[a]["before"]
        settings = results[a]["settings"]
        indices = [s["device"] for s in settings] if device is None else [device]
        for index, values in zip(indices, before):
            try:
                client.run(run_apply, values, index, workers=[a], on_error="return")
            except Exception:  # noqa: BLE001 - best effort; the error says what failed
                logger.exception("gpudash: could not set worker %s back", a)


def current_settings(client: Any, workers: Any = None) -> dict[str, list[dict]]:
    """Each worker's settings now (``{address: [per device]}``)."""
    targets = _resolve_workers(client, workers)
    results = client.run(run_settings, workers=targets, on_error="return")
    errors = _errors(results, targets)
    if errors:
        raise ConfigError("; ".join(f"worker {a}: {m}" for a, m in sorted(errors.items())))
    return {a: results[a] for a in targets}


# ------------------------------------------------------------------------------ traces
def _segment_columns(seg: dict, device: int) -> tuple[dict, list[dict]]:
    """One recorded event batch as trace columns (and its settings rows)."""
    rec = _wire.decode_records(int(seg["n"]), seg["z"])
    flat = list(seg.get("regions0") or [])
    half = len(flat) // 2
    regions = dict(zip(flat[:half], flat[half:]))
    if len(rec):
        # The region table at the end of the batch: the start's, with its extends/releases.
        code = rec[:, 1]
        for row in rec[(code == _EXTEND) | (code == _RELEASE)]:
            if row[1] == _EXTEND:
                regions[int(row[2])] = int(row[3])
            else:
                regions.pop(int(row[2]), None)
        rec = rec.copy()
        rec[:, 0] += int(seg.get("offset", 0))  # the client's clock
    ptrs = sorted(regions)
    ends = [p + regions[p] for p in ptrs]
    n_alloc = int(np.count_nonzero(rec[:, 1] == _ALLOC)) if len(rec) else 0
    cols = _expand_numpy(rec, int(seg["seq0"]), int(seg["aid0"]) + n_alloc, ptrs, ends, device)
    settings = [{"seq": int(s), "setting": name, "old": old, "new": new, "device": device}
                for s, name, old, new in seg.get("extra") or ()]
    return cols, settings


def collect_traces(client: Any, path: str | os.PathLike | None = None, *,
                   model: ClusterModel | None = None, overwrite: bool = False,
                   timeout: float = 10.0) -> Any:
    """One multi-device gpudash trace of the cluster's run: one device per worker device.

    The events are those a recording :class:`ClusterModel` received. Live workers are asked
    to send what they hold first (so the trace reaches the moment of the call); workers
    that died keep what they had sent.

    Parameters
    ----------
    client : distributed.Client
    path : str or os.PathLike, optional
        Write the trace there (``.gdtrace``); without it the trace is only returned.
    model : ClusterModel, optional
        The recording model; by default the latest open ``ClusterModel(client,
        record=True)`` of this client.
    overwrite : bool
        Replace an existing ``path``.
    timeout : float
        Seconds to wait for live workers' last events.

    Returns
    -------
    gpudash.trace.Trace
        Device ``i`` is named after its worker (``tcp://10.0.0.2:4000``, plus the
        allocator's name when a worker has several devices); ``meta["devices"][i]`` also
        has ``worker``, ``worker_name``, ``allocator``, ``gone``, ``recorded_events`` and
        ``dropped_events`` (operations the worker dropped under its event budget: the
        trace has gaps there). Times are on the client's clock.

    Raises
    ------
    ConfigError
        When no model records this client's cluster.
    """
    from ..trace.format import Trace, write_trace

    if model is None:
        model = _Hub.recording_model(client)
        if model is None:
            raise ConfigError("no ClusterModel records this cluster: create "
                              "gpudash.dask.ClusterModel(client) (record=True) before the run; "
                              "it collects each worker's events")
    elif not model.record:
        raise ConfigError("this ClusterModel does not record events (record=False); create "
                          "one with record=True before the run")
    if path is not None and os.path.exists(path) and not overwrite:
        raise ConfigError(f"{os.fspath(path)} exists; pass overwrite=True to replace it")
    if not model.closed:
        model.sync(timeout=timeout)
    with model._lock:
        plan = []
        for address, rec in model._workers.items():
            for index in sorted(rec.devices):
                dev = rec.devices[index]
                # one device per plugin run: a plugin registered again starts a new session
                runs: dict[Any, list[dict]] = {}
                for seg in dev.segments:
                    runs.setdefault(seg.get("rid"), []).append(seg)
                for k, segs in enumerate(runs.values() or [[]]):
                    plan.append((address, rec.name, rec.state, dev, len(rec.devices), k,
                                 list(segs)))
    columns: dict[str, list[np.ndarray]] = {c: [] for c in COLUMNS}
    settings: list[dict] = []
    devices = []
    total_dropped = 0
    for i, (address, name, state, dev, ndev, run, segs) in enumerate(plan):
        for seg in segs:
            cols, rows = _segment_columns(seg, i)
            for c in COLUMNS:
                columns[c].append(cols[c])
            settings += rows
        dropped = sum(int(seg.get("dropped", 0)) for seg in segs)
        if run == 0:
            dropped += dev.unkept_ops
        total_dropped += dropped
        label = address if ndev == 1 else f"{address} {dev.name}"
        devices.append({
            "index": i, "name": label if run == 0 else f"{label} (plugin run {run + 1})",
            "capacity": dev.capacity, "memory_limit": dev.stats.get("bytes_limit"),
            "options": {"allow_growth": dev.options.get("allow_growth"),
                        "per_process_gpu_memory_fraction": dev.options.get("fraction")},
            "worker": address, "worker_name": name, "allocator": dev.name,
            "gone": state == "gone",
            "recorded_events": sum(int(seg.get("n", 0)) for seg in segs),
            "dropped_events": dropped})
    cols = {c: (np.concatenate(columns[c]) if columns[c]
                else np.empty(0, dtype=COLUMN_DTYPES[c])) for c in COLUMNS}
    meta = {"source": "gpudash-dask", "devices": devices, "dropped_events": total_dropped,
            "clock": "client"}
    trace = Trace(cols, meta, settings)
    if total_dropped:
        logger.warning("gpudash: the cluster trace misses %d operations the workers dropped "
                       "under their event budget (GpudashPlugin(max_event_rate=...))",
                       total_dropped)
    if path is not None:
        write_trace(trace, path, overwrite=overwrite)
    return trace

