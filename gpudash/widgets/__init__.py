"""Notebook views of live gpudash sessions (ipywidgets + plotly ``FigureWidget``).

- :class:`LiveModel` coalesces allocator events into a few consistent updates a second;
- views, each usable alone given a model: :class:`ChunkMapView`, :class:`BinsView`,
  :class:`TimelineView`, :class:`HeatmapView`, :class:`StatsView`, :class:`ControlsView`;
- :class:`Dashboard` composes them for a session; :class:`WhatIfView` replays a trace at a
  chosen fraction.

Names are imported on first use, so ``import gpudash.widgets`` does not import plotly.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LiveModel": "gpudash.widgets.model",
    "DeviceState": "gpudash.widgets.model",
    "ChunkMapView": "gpudash.widgets.chunkmap",
    "BinsView": "gpudash.widgets.bins",
    "TimelineView": "gpudash.widgets.timeline",
    "HeatmapView": "gpudash.widgets.heatmap",
    "StatsView": "gpudash.widgets.stats",
    "ControlsView": "gpudash.widgets.controls",
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


# --------------------------------------------------------------------------------------
# The base of the views (private): a VBox bound to a model and one device.
# --------------------------------------------------------------------------------------

import threading as _threading  # noqa: E402
import time as _time  # noqa: E402

import ipywidgets as _w  # noqa: E402
import traitlets as _t  # noqa: E402


class _ModelView(_w.VBox):
    """A view of one device of a :class:`LiveModel`.

    Subclasses build their widgets in ``_build()`` and draw a :class:`DeviceState` in
    ``_draw(state, reset)``; ``reset`` is True on the first draw and after the device
    changed. Updates arrive in the model's refresher thread; a lock keeps a view's own
    updates in order when the kernel thread redraws it too (a device switch).

    ``max_rate_hz`` caps how often a heavy view redraws: a state that arrives too soon is
    kept and drawn when the interval is over (by a timer, so the last state is never lost).

    A subclass that defines ``_tick(now_ms, changed)`` also hears every refresh of the model
    (:meth:`LiveModel.add_tick_listener`), under the same lock as its draws.
    """

    device = _t.Int(0, help="Index (in the model) of the device this view shows.")
    max_rate_hz = _t.Float(None, allow_none=True,
                           help="Most redraws a second (None: every model refresh).")

    def __init__(self, model: Any, *, device: int = 0, max_rate_hz: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = model
        self._draw_lock = _threading.RLock()
        self._drawn_device: int | None = None
        self._last_draw = 0.0
        self._pending: Any = None
        self._timer: _threading.Timer | None = None
        self._ready = False
        self.device = device
        self.max_rate_hz = max_rate_hz
        self._build()
        self._ready = True
        self._remove_listener = model.add_listener(self._on_model_update)
        self._remove_tick = (model.add_tick_listener(self._on_tick)
                             if type(self)._tick is not _ModelView._tick else None)
        self.redraw()

    @_t.validate("device")
    def _validate_device(self, proposal: Any) -> int:
        value = proposal["value"]
        n = self.model.num_devices
        if not 0 <= value < n:
            raise _t.TraitError(f"device must be an index in 0..{n - 1}; got {value}")
        return value

    @_t.validate("max_rate_hz")
    def _validate_max_rate_hz(self, proposal: Any) -> float | None:
        value = proposal["value"]
        if value is not None and value <= 0:
            raise _t.TraitError(f"max_rate_hz must be > 0 (or None); got {value}")
        return value

    @_t.observe("device")
    def _on_device_change(self, change: dict) -> None:
        if self._ready:
            self.redraw()

    def _on_model_update(self, changed: dict) -> None:
        state = changed.get(self.device)
        if state is None:
            return
        rate = self.max_rate_hz
        if rate is not None:
            with self._draw_lock:
                wait = self._last_draw + 1.0 / rate - _time.monotonic()
                if wait > 0:
                    self._pending = state
                    if self._timer is None:
                        self._timer = _threading.Timer(wait, self._draw_pending)
                        self._timer.daemon = True
                        self._timer.start()
                    return
        self._render(state)

    def _on_tick(self, now_ms: float, changed: set) -> None:
        with self._draw_lock:
            if self._drawn_device == self.device:
                self._tick(now_ms, changed)

    def _tick(self, now_ms: float, changed: set) -> None:
        """Hook: the model refreshed at ``now_ms`` (``changed``: the devices rebuilt)."""

    def _draw_pending(self) -> None:
        with self._draw_lock:
            self._timer = None
            state, self._pending = self._pending, None
            if state is not None and getattr(self, "_remove_listener", None) is not None:
                self._render(state)

    def redraw(self) -> None:
        """Draw the model's latest state of the device now."""
        self._render(self.model.state(self.device))

    def _render(self, state: Any) -> None:
        with self._draw_lock:
            if state.device != self.device:
                return
            if self._pending is not None and self._pending.version <= state.version:
                self._pending = None
            reset = self._drawn_device != state.device
            self._draw(state, reset)
            self._drawn_device = state.device
            self._last_draw = _time.monotonic()

    def _build(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _draw(self, state: Any, reset: bool) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Stop listening to the model and close the widgets."""
        remove = getattr(self, "_remove_listener", None)
        if remove is not None:
            remove()
            self._remove_listener = None
        remove_tick = getattr(self, "_remove_tick", None)
        if remove_tick is not None:
            remove_tick()
            self._remove_tick = None
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
        for child in self.children:
            child.close()
        super().close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, model={self.model!r})"


def _figure(height: int = 300, title: str = "", base: Any = None, **layout: Any) -> Any:
    """A ``FigureWidget`` (empty, or of ``base``, e.g. ``make_subplots(...)``) with gpudash's
    compact layout: the title at the top left, the legend in one row above the plot, at the
    right (they never overlap); as wide as the box it is shown in (:func:`_fit_width`); and
    drawn whole again by a front end that (re)connects (:func:`_figure_class`)."""
    cls = _figure_class()
    fig = cls(base) if base is not None else cls()
    fig.update_layout(**_layout(height, title), **layout)
    _fit_width(fig)
    return fig


_figure_cls: Any = None


def _figure_class() -> Any:
    """plotly's ``FigureWidget``, answering a front end that asks for its state (a reloaded
    page, a notebook opened again while the kernel runs) with the figure as it is now.

    plotly syncs the traces and the layout (``_widget_data``, ``_widget_layout``) once, when
    the figure is made; every later change goes to the page as a message (restyle,
    relayout, add traces) that a page loaded later never sees. So a reloaded page drew
    the figure as it was made: empty axes, no traces. The page asks for the state of every
    widget when it (re)connects, as the dashboard's views say hello and get a snapshot:
    the answer here carries the traces and layout in force, and the figure draws again."""
    global _figure_cls
    if _figure_cls is None:
        import plotly.graph_objects as go
        from plotly.serializers import custom_serializers

        to_json = custom_serializers["to_json"]

        class _Figure(go.FigureWidget):
            def get_state(self, key: Any = None, drop_defaults: bool = False) -> dict:
                state = super().get_state(key, drop_defaults=drop_defaults)
                keys = (self.keys if key is None else [key] if isinstance(key, str)
                        else list(key))
                # (while the figure is being made, before plotly has its state: as is)
                for name, value in (("_widget_data", getattr(self, "_data", None)),
                                    ("_widget_layout", getattr(self, "_layout", None))):
                    if name in keys and value is not None:
                        state[name] = to_json(value, self)
                return state

        _figure_cls = _Figure
    return _figure_cls


def _layout(height: int, title: str) -> dict:
    # no width: the figure is as wide as its box (_fit_width)
    return dict(height=height, margin=dict(l=60, r=20, t=72, b=40), template="plotly_white",
                title=dict(text=title, x=0.01, xanchor="left", y=0.98, yanchor="top",
                           font=dict(size=14)),
                legend=dict(orientation="h", x=1, xanchor="right", y=1.01, yanchor="bottom"))


def _fit_width(fig: Any) -> Any:
    """Make a ``FigureWidget`` as wide as the box it is shown in (a dashboard grid cell, an
    output area), not plotly's default 700 px, which a narrower cell cuts off.

    plotly.js reads the width of the figure's element when it plots; the widget plots before
    the element is attached to the page, when it has no width yet, and falls back to 700 px.
    So, with ``layout.autosize`` set and no ``layout.width``:

    - ``responsive`` (plotly.js config) refits the figure when the window is resized;
    - every layout update from the kernel refits it (plotly.js autosizes on each relayout
      when ``layout.autosize`` is set);
    - and the frontend counts the figure's views attached to the page (ipywidgets'
      ``_view_count``, counted once it is not None): when a view is attached, the figure is
      sent ``relayout({autosize: true})``, a few bytes, so a new view fits at once, even one
      of a figure that is not updated again.

    A box whose width changes without a window resize (a JupyterLab side panel opened or
    closed) is refitted at the figure's next layout update. (:class:`Dashboard` and the
    what-if view's plots draw with gpudash's own front end, which follows its box.)
    """
    fig.layout.width = None
    fig.layout.autosize = True
    fig._config = dict(fig._config or {}, responsive=True)

    def on_view_count(change: dict) -> None:
        if (change["new"] or 0) > (change["old"] or 0):
            send = getattr(fig, "_send_relayout_msg", None)
            if send is not None:
                send({"autosize": True})

    fig.observe(on_view_count, "_view_count")
    fig._view_count = 0
    return fig
