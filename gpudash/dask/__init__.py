"""gpudash on a Dask cluster: a session per worker, streamed through Dask's own channels.

>>> from dask.distributed import Client, LocalCluster            # doctest: +SKIP
>>> from gpudash.dask import GpudashPlugin, worker_session, ClusterModel
>>> client = Client(LocalCluster(n_workers=2, threads_per_worker=1))  # doctest: +SKIP
>>> client.register_plugin(GpudashPlugin(simulate="16GiB"))       # doctest: +SKIP
>>> client.submit(lambda: worker_session().allocate(1 << 20)).result()  # doctest: +SKIP

- :class:`GpudashPlugin` (a ``distributed.WorkerPlugin``): a gpudash session on every worker,
  streaming summaries (and, on request, chunk tables and events) on the Dask topic
  ``"gpudash"`` and in the workers' heartbeat metrics; :func:`worker_session` inside a task
  or a ``client.run`` function;
- :class:`ClusterModel`: every worker's figures, history, feeds and recorded events;
  :class:`WorkerFeed`: one worker device as a :class:`~gpudash.live.feeds.DeviceFeed`;
- :class:`ClusterDashboard`: a row per worker, controls for all workers or one, the usual
  views of a picked worker;
- :func:`configure_workers` (validated on the client, then on every worker, before anything
  changes) and :func:`collect_traces` (one multi-device ``.gdtrace``).

Needs ``distributed`` (``pip install 'gpudash[dask]'``); ``import gpudash`` never imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "GpudashPlugin": "gpudash.dask.plugin",
    "worker_session": "gpudash.dask.plugin",
    "ClusterModel": "gpudash.dask.model",
    "WorkerFeed": "gpudash.dask.model",
    "ClusterDashboard": "gpudash.dask.dashboard",
    "configure_workers": "gpudash.dask.control",
    "collect_traces": "gpudash.dask.traces",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpudash.dask' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name in ("distributed", "dask"):
            raise ImportError("gpudash.dask needs Dask's distributed scheduler: "
                              "pip install 'gpudash[dask]'") from exc
        raise
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
