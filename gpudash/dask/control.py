"""Acting on the cluster: :func:`configure_workers` (validated on the client first, rolled back
on every worker when one refuses) and :func:`current_settings`."""

from __future__ import annotations

import logging
from typing import Any

from .._errors import ConfigError
from ..live.feeds import CONTROL_NAMES
from ..options import GPUOptions
from .plugin import run_apply, run_check, run_settings

__all__ = ["configure_workers", "current_settings", "validate_changes"]

logger = logging.getLogger("gpudash")


def validate_changes(changes: dict) -> dict:
    """Check live-setting changes on the client: names among
    :data:`~gpudash.live.feeds.CONTROL_NAMES`, values as ``GPUOptions`` accepts them (the
    BFC model's :meth:`~gpudash.models.AllocatorModel.check_setting`, which
    :meth:`gpudash.live.LiveModel.act` runs before a worker's control acts).

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
