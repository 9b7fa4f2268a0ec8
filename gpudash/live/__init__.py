"""The live layer: what a running source looks like now, and one way to act on it. No UI.

- :class:`DeviceFeed` / :class:`FeedSample` (:mod:`gpudash.live.feeds`): where a device's
  figures come from when gpudash does not run its allocator itself (a framework monitor,
  a Dask worker);
- :class:`LiveModel` (:mod:`gpudash.live.model`): a gpudash session's allocators, or feeds,
  coalesced into a few consistent :class:`DeviceState` a second;
- :meth:`LiveModel.act`: the one path by which a control changes a setting (or runs an
  action) on a device: the allocator model checks the value, the device's source applies
  it, the model answers in its framework's words.

The views (:mod:`gpudash.widgets`) read this layer and act through it; the monitors
(:mod:`gpudash.monitors`) and the Dask client (:mod:`gpudash.dask`) feed it. Nothing here
imports ipywidgets, anywidget or plotly.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "DeviceFeed": "gpudash.live.feeds",
    "FeedSample": "gpudash.live.feeds",
    "CONTROL_NAMES": "gpudash.live.feeds",
    "LiveModel": "gpudash.live.model",
    "DeviceState": "gpudash.live.model",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpudash.live' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
