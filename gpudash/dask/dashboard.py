"""The cluster dashboard: a row per Dask worker, controls for all workers or one, and the
usual live views of a picked worker.

Layout (a ``VBox``)::

    header (workers live / gone, recording)
    one row per worker: [pick] sparkline of bytes in use | in use / pool / limit |
                        fragmentation | OOMs | state (live, gone, stopped)
    controls: target (all workers or one), fraction, growth, deferred, apply,
              release free regions, flush deferred frees; error line; status line
    the picked worker's views (built from its feeds by :func:`views_for`)

The controls show the target's settings as the workers report them ("mixed" where the target
workers differ) and apply only what was touched since the last apply, through
:func:`~gpudash.dask.configure_workers`: checked on the client, then on every target
worker, before anything changes; a refusal is shown with the worker's name. A fraction is
applied as the slider shows it (two decimals).

Picking a worker makes it the target. Its views (the usual
:class:`gpudash.widgets.Dashboard`) bring their own controls, acting on that worker: the
cluster's controls are hidden meanwhile, so one set acts on the worker, until "all workers"
closes the views. Views without controls of their own (``views=``) leave the cluster's
controls shown, aimed at the picked worker.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets

from .._comm_routing import follow_the_page
from .._errors import GpudashError
from .._units import format_bytes
from .control import configure_workers
from .model import ClusterModel
from .plugin import run_flush_deferred, run_release
from .control import _errors, _resolve_workers

__all__ = ["ClusterDashboard", "views_for", "sparkline_svg"]

_RED = "#d62728"
_BLUE = "#1f77b4"
_GREY = "#999999"


def views_for(feeds: list, **options: Any) -> Any:
    """The usual live views of ``feeds`` (one worker's devices) as one widget: a
    :class:`gpudash.widgets.Dashboard` whose controls act on the worker. Its timeline starts
    with the history the :class:`~gpudash.dask.ClusterModel` holds for each device."""
    from ..widgets.dashboard import Dashboard  # late: anywidget (optional here)

    return Dashboard(feeds=list(feeds), **options)


def _has_controls(view: Any) -> bool:
    """Whether a picked worker's views bring their own controls (a gpudash Dashboard)."""
    try:
        from ..widgets.dashboard import Dashboard  # late: anywidget, may be missing
    except ImportError:  # anywidget missing: the views are someone else's widget
        return False
    return isinstance(view, Dashboard)


def _format_fraction(value: float) -> str:
    """A fraction as the dashboards show it (``0.25``, not ``0.24999999999999994``)."""
    return f"{round(float(value), 2):g}"


def _shown_fraction(options: dict) -> float:
    """The fraction a worker device runs at: its setting, or (0, TensorFlow's default;
    above 1, unified memory) its limit over its memory."""
    fraction = float(options.get("fraction") or 0.0)
    if 0.0 < fraction <= 1.0:
        return fraction
    total = options.get("total") or 0
    return float(options.get("limit") or 0) / total if total else 1.0


def _describe(changes: dict) -> str:
    """``name=value`` of applied changes, in words (``0.25``, ``8.00 MiB``)."""
    out = []
    for name, value in changes.items():
        if name == "per_process_gpu_memory_fraction" and isinstance(value, float):
            text = f"{value:g}"
        elif name == "deferred_deletion_bytes" and isinstance(value, int):
            text = format_bytes(value)
        else:
            text = str(value)
        out.append(f"{name}={text}")
    return ", ".join(out)


def sparkline_svg(values: Any, limit: int = 0, *, width: int = 120, height: int = 24,
                  color: str = _BLUE) -> str:
    """A small inline SVG line of ``values`` (bytes), scaled to ``limit`` (or the largest
    value); the limit is drawn as a dashed line when it is in scale."""
    vals = [float(v) for v in values][-width:]
    top = max([float(limit or 0)] + vals + [1.0])
    pad = 2.0
    h = height - 2 * pad

    def y(v: float) -> float:
        return pad + h - (v / top) * h

    if len(vals) < 2:
        vals = (vals or [0.0]) * 2
    step = (width - 2 * pad) / (len(vals) - 1)
    points = " ".join(f"{pad + i * step:.1f},{y(v):.1f}" for i, v in enumerate(vals))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">']
    if limit:
        ly = y(float(limit))
        parts.append(f'<line x1="0" x2="{width}" y1="{ly:.1f}" y2="{ly:.1f}" stroke="{_GREY}" '
                     'stroke-dasharray="3,2" stroke-width="1"/>')
    parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                 f'points="{points}"/></svg>')
    return "".join(parts)


class _Row(widgets.HBox):
    """One worker: pick button, sparkline, figures, fragmentation, OOMs, state."""

    def __init__(self, address: str, on_pick: Callable[[str], Any]) -> None:
        self.address = address
        self.pick = widgets.Button(description=address.split("://")[-1], tooltip=address,
                                   icon="search", layout=widgets.Layout(width="190px"))
        self.pick.on_click(lambda _: on_pick(address))
        self.spark = widgets.HTML(layout=widgets.Layout(width="130px"))
        self.figures = widgets.HTML(layout=widgets.Layout(width="300px"))
        self.frag = widgets.HTML(layout=widgets.Layout(width="110px"))
        self.ooms = widgets.HTML(layout=widgets.Layout(width="80px"))
        self.state = widgets.HTML(layout=widgets.Layout(width="120px"))
        super().__init__([self.pick, self.spark, self.figures, self.frag, self.ooms,
                          self.state], layout=widgets.Layout(align_items="center"))

    def show(self, w: dict, history: dict) -> None:
        gone = w["gone"]
        color = _GREY if gone else _BLUE
        values = {
            "spark": sparkline_svg(history["bytes_in_use"], w["bytes_limit"], color=color),
            "figures": (f"{format_bytes(w['bytes_in_use'])} / {format_bytes(w['pool_bytes'])}"
                        f" / {format_bytes(w['bytes_limit'])}"),
            "frag": f"frag {w['fragmentation']:.1%}",
            "ooms": (f'<span style="color:{_RED}"><b>{w["ooms"]} OOM</b></span>'
                     if w["ooms"] else "0 OOM"),
            "state": (f'<span style="color:{_RED}"><b>&#x2717; gone</b></span>' if gone
                      else "stopped" if w["state"] == "stopped" else "live"),
        }
        dropped = int(sum(w.get("dropped", {}).values()))
        if dropped and not gone:
            values["state"] += f" <small>({dropped} dropped)</small>"
        for name, value in values.items():
            widget = getattr(self, name)
            if widget.value != value:
                widget.value = value
        self.pick.disabled = gone


class ClusterDashboard(widgets.VBox):
    """Every gpudash worker of a Dask cluster in one widget.

    Parameters
    ----------
    client : distributed.Client
    model : ClusterModel, optional
        The model to show (default: a new ``ClusterModel(client, record=False)``, closed
        with the dashboard).
    views : callable, optional
        ``views(feeds) -> widget`` for a picked worker (default :func:`views_for`, the
        feed-based :class:`gpudash.widgets.Dashboard`).
    rate_hz : float
        Row updates a second (for a model made here).

    Attributes
    ----------
    model : ClusterModel
    rows : dict
        ``{address: row}``; a row's ``spark``, ``figures``, ``frag``, ``ooms`` and ``state``
        are ``HTML`` widgets and ``pick`` a ``Button``.
    target, fraction, growth, deferred, apply_button, release, flush
        The controls (``Dropdown``, ``FloatSlider``, ``ToggleButton``, ``FloatLogSlider``,
        ``Button`` x 3), in ``controls``; they show the target workers' settings.
    fraction_label, deferred_label : ipywidgets.HTML
        The deferred slider's readout; for both sliders, what the target runs when the
        slider shows something else ("mixed: 0.25, 0.5" when the target workers differ,
        "now 0.5" while a moved slider waits for apply).
    error, status : ipywidgets.HTML
        The last refusal (with the worker's name) and what the last action did.
    detail : ipywidgets.VBox
        The picked worker's name, an "all workers" button (:meth:`unpick`), and its views.
    """

    def __init__(self, client: Any, *, model: ClusterModel | None = None,
                 views: Callable[[list], Any] | None = None, rate_hz: float = 2.0) -> None:
        self.client = client
        self._own_model = model is None
        self.model = model if model is not None else ClusterModel(client, record=False,
                                                                  rate_hz=rate_hz)
        self._views_for = views if views is not None else views_for
        self._lock = threading.RLock()
        self.rows: dict[str, _Row] = {}
        self.picked: str | None = None
        self.view: Any = None
        self._touched: set[str] = set()
        self._syncing = False
        self._listing = False
        self._running: dict[str, list[str]] = {}  # what the target runs, as shown

        self.header = widgets.HTML()
        self.rows_box = widgets.VBox()
        self.target = widgets.Dropdown(options=[("all workers", "")], value="",
                                       description="workers",
                                       style={"description_width": "60px"})
        self.fraction = widgets.FloatSlider(min=0.05, max=1.0, step=0.01, value=1.0,
                                            description="fraction", continuous_update=False,
                                            readout_format=".2f",
                                            style={"description_width": "60px"})
        self.fraction_label = widgets.HTML()
        self.growth = widgets.ToggleButton(description="allow growth", icon="expand")
        self.deferred = widgets.FloatLogSlider(base=2, min=10, max=30, step=1, value=8 << 20,
                                               description="deferred", readout=False,
                                               continuous_update=False,
                                               style={"description_width": "60px"})
        self.deferred_label = widgets.HTML(format_bytes(8 << 20))
        self.apply_button = widgets.Button(description="apply", icon="check",
                                           button_style="primary")
        self.release = widgets.Button(description="release free regions", icon="recycle",
                                      layout=widgets.Layout(width="auto"))
        self.flush = widgets.Button(description="flush deferred frees", icon="download",
                                    layout=widgets.Layout(width="auto"))
        self.error = widgets.HTML()
        self.status = widgets.HTML()
        self.unpick_button = widgets.Button(description="all workers", icon="arrow-left",
                                            tooltip="close the views; the controls act on "
                                                    "all workers again",
                                            layout=widgets.Layout(width="auto"))
        self.detail = widgets.VBox()
        wrap = widgets.Layout(flex_flow="row wrap", align_items="center")
        self.controls = widgets.VBox([
            widgets.HBox([self.target, self.fraction, self.fraction_label, self.growth],
                         layout=wrap),
            widgets.HBox([self.deferred, self.deferred_label, self.apply_button, self.release,
                          self.flush], layout=wrap),
            self.error, self.status])
        super().__init__([self.header, self.rows_box, self.controls, self.detail])
        follow_the_page(self)   # its rows and figures change from the model's thread

        for name in ("fraction", "growth", "deferred"):
            getattr(self, name).observe(self._on_touch(name), "value")
        self.target.observe(self._on_target, "value")
        self.unpick_button.on_click(lambda _: self.unpick())
        self.apply_button.on_click(lambda _: self.apply_touched())
        self.release.on_click(lambda _: self.release_free_regions())
        self.flush.on_click(lambda _: self.flush_deferred())
        self._remove_listener = self.model.add_listener(lambda _: self.update())
        self.update()

    # ------------------------------------------------------------------ rows
    def update(self) -> None:
        """Redraw the rows and the worker list from the model (its thread calls this)."""
        with self._lock:
            workers = self.model.workers
            rows_changed = False
            for address in workers:
                if address not in self.rows:
                    self.rows[address] = row = _Row(address, self.pick)
                    follow_the_page(row)
                    rows_changed = True
            for address, w in workers.items():
                self.rows[address].show(w, self.model.history(address))
            if rows_changed:
                self.rows_box.children = [self.rows[a] for a in sorted(self.rows)]
            live = sorted(a for a, w in workers.items() if not w["gone"])
            options = [("all workers", "")] + [(a, a) for a in live]
            if list(self.target.options) != options:
                value = self.target.value if self.target.value in live else ""
                if value != self.target.value:
                    self._touched.clear()  # moved for a worker that left
                self._listing = True  # a new list, not a new target
                try:
                    self.target.options = options
                    self.target.value = value
                finally:
                    self._listing = False
            gone = len(workers) - len(live)
            text = (f"<b>{len(live)} worker(s)</b>" + (f", {gone} gone" if gone else "")
                    + (" &middot; recording events" if self.model.record else ""))
            if self.header.value != text:
                self.header.value = text
            self._sync_controls(workers)

    def _sync_controls(self, workers: dict | None = None) -> None:
        """Show the target workers' settings on the controls not moved since the last
        apply; the labels say "mixed" where the target workers differ."""
        with self._lock:
            if workers is None:
                workers = self.model.workers
            addrs = [self.target.value] if self.target.value else sorted(
                a for a, w in workers.items() if not w["gone"])
            opts = [d["options"] for a in addrs if a in workers
                    for d in workers[a]["devices"] if d.get("options")]
            if not opts:
                return
            fractions = sorted({round(_shown_fraction(o), 2) for o in opts})  # as shown
            growths = sorted({bool(o.get("allow_growth")) for o in opts})
            deferreds = sorted({int(o.get("deferred_deletion_bytes") or 0) for o in opts})
            self._running = {"fraction": [_format_fraction(f) for f in fractions],
                             "deferred": [format_bytes(d) for d in deferreds]}
            growth_text = "allow growth" + (" (mixed)" if len(growths) > 1 else "")
            if self.growth.description != growth_text:
                self.growth.description = growth_text
            self._syncing = True
            try:
                if "fraction" not in self._touched and len(fractions) == 1:
                    shown = min(1.0, max(0.05, fractions[0]))
                    if abs(self.fraction.value - shown) > 1e-9:
                        self.fraction.value = shown
                if "growth" not in self._touched and len(growths) == 1 and \
                        self.growth.value != growths[0]:
                    self.growth.value = growths[0]
                if "deferred" not in self._touched and len(deferreds) == 1 and deferreds[0]:
                    shown = min(float(1 << 30), max(float(1 << 10), float(deferreds[0])))
                    if abs(self.deferred.value - shown) > 0.5:
                        self.deferred.value = shown
            finally:
                self._syncing = False
            self._show_labels()

    def _show_labels(self) -> None:
        """Next to the fraction slider, and after the deferred slider's readout, what the
        target runs when the control shows something else: "mixed: ..." where the target
        workers differ, "now ..." where the control was moved."""
        readouts = {"fraction": ("", _format_fraction(self.fraction.value)),
                    "deferred": (format_bytes(int(round(self.deferred.value))), None)}
        for name, (readout, shown) in readouts.items():
            running = self._running.get(name) or []
            shown = readout if shown is None else shown
            if len(running) > 1:
                note = "<b>mixed:</b> " + ", ".join(running)
            elif running and running[0] != shown:
                note = f"now {running[0]}"
            else:
                note = ""
            text = readout + (" &middot; " if readout and note else "") + note
            widget = getattr(self, f"{name}_label")
            if widget.value != text:
                widget.value = text

    # ------------------------------------------------------------------ controls
    def _on_touch(self, name: str) -> Callable[[dict], None]:
        def touched(change: dict) -> None:
            if self._syncing:
                return
            self._touched.add(name)
            self._show_labels()
        return touched

    def _on_target(self, change: dict) -> None:
        """Another target: the controls show its settings, and forget what was moved."""
        with self._lock:
            if self._listing:
                return
            self._touched.clear()
            self._sync_controls()

    def _workers(self) -> list[str] | None:
        return [self.target.value] if self.target.value else None

    def _refused(self, exc: BaseException) -> None:
        self.error.value = (f'<span style="color:{_RED}"><b>refused:</b> '
                            f"{html.escape(str(exc))}</span>")
        self.status.value = ""

    def apply(self, **changes: Any) -> dict | None:
        """Apply live-setting changes to the target (all workers, or the one picked in
        ``target``). Returns the settings read back, or None when refused (the error line
        says why and nothing changed)."""
        with self._lock:
            try:
                result = configure_workers(self.client, workers=self._workers(), **changes)
            except (GpudashError, ValueError, TypeError) as exc:
                self._refused(exc)
                return None
            self.error.value = ""
            self.status.value = html.escape(f"applied {_describe(changes)} on {len(result)} "
                                            "worker(s)")
            self.model.sync(timeout=5.0)  # the controls show what the workers now report
            self._touched.clear()
            self._sync_controls()
            return result

    def apply_touched(self) -> dict | None:
        """Apply the controls moved since the last apply (the ``apply`` button); the
        fraction as the slider shows it, to two decimals."""
        values = {"fraction": ("per_process_gpu_memory_fraction",
                               round(float(self.fraction.value), 2)),
                  "growth": ("allow_growth", bool(self.growth.value)),
                  "deferred": ("deferred_deletion_bytes", int(round(self.deferred.value)))}
        changes = dict(values[n] for n in sorted(self._touched))
        if not changes:
            self.status.value = "nothing to apply: move a control first"
            return None
        return self.apply(**changes)

    def _run_each(self, fn: Any, what: str) -> int | None:
        with self._lock:
            try:
                targets = _resolve_workers(self.client, self._workers())
                results = self.client.run(fn, None, workers=targets, on_error="return")
            except (GpudashError, OSError) as exc:
                self._refused(exc)
                return None
            errors = _errors(results, targets)
            if errors:
                self._refused(GpudashError("; ".join(f"worker {a}: {m}"
                                                     for a, m in sorted(errors.items()))))
                return None
            total = int(sum(results.values()))
            self.error.value = ""
            self.status.value = f"{what}: {format_bytes(total)} on {len(targets)} worker(s)"
            return total

    def release_free_regions(self) -> int | None:
        """Return wholly free regions on the target workers; the bytes returned."""
        return self._run_each(run_release, "released")

    def flush_deferred(self) -> int | None:
        """Hand deferred frees to the allocators on the target workers; the bytes."""
        return self._run_each(run_flush_deferred, "flushed")

    # ------------------------------------------------------------------ views
    def pick(self, address: str) -> Any:
        """Open the usual views of one worker below the rows (closing the previous ones) and
        make it the target; returns the views' widget, or None when they could not be made
        (the detail area says why). Views with controls of their own hide the cluster's
        controls until :meth:`unpick`."""
        with self._lock:
            self._close_view()
            self.picked = address
            self.update()  # a worker the model knows, not listed yet (its thread lags): listed
            if address in [v for _, v in self.target.options]:
                self.target.value = address
            head = widgets.HBox([widgets.HTML(f"<b>{html.escape(address)}</b>"),
                                 self.unpick_button],
                                layout=widgets.Layout(align_items="center"))
            try:
                feeds = self.model.feeds(address)
                view = self._views_for(feeds)
            except Exception as exc:  # noqa: BLE001 - shown, not raised, in a widget
                self.detail.children = [head, widgets.HTML(
                    f'<span style="color:{_RED}">could not open the views of {html.escape(address)}'
                    f": {html.escape(str(exc))}</span>")]
                return None
            self.view = view
            self.controls.layout.display = "none" if _has_controls(view) else None
            self.detail.children = [head, view]
            return view

    def unpick(self) -> None:
        """Close the picked worker's views; the controls act on all workers again."""
        with self._lock:
            self._close_view()
            self.picked = None
            self.target.value = ""

    def _close_view(self) -> None:
        view, self.view = self.view, None
        if view is not None and hasattr(view, "close"):
            view.close()
        self.detail.children = []
        self.controls.layout.display = None

    def close(self) -> None:
        """Close the views, the rows and (when the dashboard made it) the model."""
        remove = getattr(self, "_remove_listener", None)
        if remove is not None:
            remove()
        self._close_view()
        if getattr(self, "_own_model", False):
            self.model.close()
        self.unpick_button.close()
        _close_tree(self)

    def __repr__(self) -> str:
        return f"ClusterDashboard({self.model!r})"


def _close_tree(widget: Any) -> None:
    """Close a widget and every widget inside it."""
    for child in getattr(widget, "children", ()):
        _close_tree(child)
    widgets.Widget.close(widget)
