"""The dashboard: every view of a live session, with its controls, in one widget.

Layout (a ``VBox``)::

    controls (device, fraction + limit, growth, deferred, buttons, pause, rate)
    stats table (every device)
    timeline      | heatmap
    chunk map     | bins

The device picked in the controls is the device the figures show.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets

from .._errors import ConfigError
from . import _width_watcher
from .bins import BinsView
from .chunkmap import ChunkMapView
from .controls import ControlsView
from .heatmap import HeatmapView
from .model import LiveModel
from .stats import StatsView
from .timeline import TimelineView

__all__ = ["Dashboard", "VIEWS"]

#: View names accepted by ``Dashboard(views=...)``, in layout order.
VIEWS = ("stats", "timeline", "heatmap", "chunkmap", "bins")

_CLASSES = {"timeline": TimelineView, "heatmap": HeatmapView, "chunkmap": ChunkMapView,
            "bins": BinsView}


class Dashboard(widgets.VBox):
    """Live views and controls of a session (or one allocator).

    Parameters
    ----------
    source : Session or BFCAllocator
        What to show and control.
    rate_hz : float
        Model refreshes a second (adjustable in the controls).
    views : sequence of str
        Which of :data:`VIEWS` to show (controls are always shown).
    device : int
        The device shown first.
    **model_options
        ``history``, ``heatmap_rows``, ``heatmap_columns`` for the :class:`LiveModel`.

    Attributes
    ----------
    model : LiveModel
    controls : ControlsView
    views : dict
        ``{name: view}`` for the views shown.

    Examples
    --------
    >>> import gpudash
    >>> from gpudash.widgets import Dashboard
    >>> sess = gpudash.Session(simulate="2x16GiB")
    >>> dash = Dashboard(sess)   # in a notebook, end the cell with ``dash`` to show it
    >>> dash.model.num_devices
    2
    >>> dash.close(); sess.close()
    """

    def __init__(self, source: Any, *, rate_hz: float = 4.0, views: Any = VIEWS,
                 device: int = 0, **model_options: Any) -> None:
        names = list(views)
        unknown = [n for n in names if n not in VIEWS]
        if unknown:
            raise ValueError(f"unknown view(s) {unknown}; choose from {list(VIEWS)}")
        self.model = LiveModel(source, rate_hz=rate_hz, **model_options)
        n = self.model.num_devices
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < n:
            self.model.close()
            raise ConfigError(f"device must be an index in 0..{n - 1} (the source has {n} "
                              f"device(s)); got {device!r}")
        # refits the figures when the dashboard's width changes; made before them (see
        # _width_watcher)
        watcher = _width_watcher()
        try:
            self.controls = ControlsView(self.model, device=device)
            self.views: dict[str, Any] = {}
            for name in VIEWS:
                if name not in names:
                    continue
                if name == "stats":
                    self.views[name] = StatsView(self.model)
                else:
                    self.views[name] = _CLASSES[name](self.model, device=device)
        except Exception:
            self.model.close()
            if watcher is not None:
                watcher.close()
            raise
        self.controls.observe(self._on_controls_device_change, "device")
        figures = [self.views[n] for n in ("timeline", "heatmap", "chunkmap", "bins")
                   if n in self.views]
        children: list[Any] = [self.controls]
        if "stats" in self.views:
            children.append(self.views["stats"])
        if figures:
            children.append(widgets.GridBox(
                figures, layout=widgets.Layout(grid_template_columns="repeat(2, minmax(0, 1fr))",
                                               grid_gap="8px", width="100%")))
        if watcher is not None:
            children.append(watcher)
        super().__init__(children=children)

    def _on_controls_device_change(self, change: dict) -> None:
        for view in self.views.values():
            if hasattr(view, "device"):
                view.device = change["new"]

    @property
    def device(self) -> int:
        """The device the figures show (set it, or pick it in the controls)."""
        return self.controls.device

    @device.setter
    def device(self, value: int) -> None:
        self.controls.device = value

    def refresh(self) -> None:
        """Update every view now (for example after a cell finished a workload)."""
        self.model.refresh_now()

    def close(self) -> None:
        """Stop the model's thread, detach it from the allocators, close every widget.
        The session stays open."""
        model = getattr(self, "model", None)
        if model is not None:
            model.close()
        for view in getattr(self, "views", {}).values():
            view.close()
        controls = getattr(self, "controls", None)
        if controls is not None:
            controls.close()
        for child in self.children:
            child.close()
        super().close()

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        model = getattr(self, "model", None)
        return f"Dashboard(views={list(getattr(self, 'views', {}))}, model={model!r})"
