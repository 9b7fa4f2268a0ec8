"""The notebook views: what a user sees of gpudash in Jupyter.

- :class:`Dashboard`: every live view of a session, an allocator or feeds (timeline,
  heatmap, chunk / segment map, bins or pools, holders) with the allocator model's controls,
  in one `anywidget <https://anywidget.dev>`_ (``static/dashboard.js``). It reads a
  :class:`~gpudash.live.LiveModel` and acts through it (:meth:`gpudash.live.LiveModel.act`);
- :class:`WhatIfView`: replay a trace at the fraction on a slider (its two plotly figures
  drawn by :class:`~gpudash.widgets.plot.PlotView`, the same front end).

:class:`LiveModel` and :class:`DeviceState` are the live layer's (:mod:`gpudash.live`), named
here too because a dashboard is made from them. Names are imported on first use, so
``import gpudash.widgets`` imports neither plotly, ipywidgets nor anywidget.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LiveModel": "gpudash.live.model",
    "DeviceState": "gpudash.live.model",
    "Dashboard": "gpudash.widgets.dashboard",
    "WhatIfView": "gpudash.widgets.whatif",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpudash.widgets' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
