"""The cluster's recorded events as one trace: :func:`collect_traces`."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from .._errors import ConfigError
from .._eventsource import expand_records as _expand_numpy
from ..events import COLUMN_DTYPES, COLUMNS, ALLOC as _ALLOC, EXTEND as _EXTEND, RELEASE as _RELEASE
from . import _wire
from .model import ClusterModel, _Hub
from ..formats.format import Trace, write_trace

__all__ = ["collect_traces"]

logger = logging.getLogger("gpudash")


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

