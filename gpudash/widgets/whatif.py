"""What if: replay a trace at the fraction on a slider, and see where it runs out of memory.

Moving the slider (on release) replays the trace through a fresh allocator of the trace's
model (TensorFlow's BFC, or PyTorch's caching allocator for a PyTorch trace) on a simulated
device (:func:`gpudash.trace.replay.replay`) in a background thread, while a short
"replaying…" status shows. A PyTorch trace also gets an ``expandable_segments`` toggle (the
model's :attr:`~gpudash.models.AllocatorModel.whatif_toggles`), its lines are allocated and
reserved, and the minimum fraction comes with the
``torch.cuda.set_per_process_memory_fraction`` line. The view draws:

- a timeline over the trace's calls: bytes in use, pool bytes, the limit line, every refused
  allocation and the first one marked;
- the replay's address x time heatmap (fraction of each address row in use, sampled at
  evenly spaced events, exact partial coverage);
- the minimum fraction at which the trace fits (:func:`gpudash.trace.whatif.min_fraction`),
  found once in the background.

The two figures are ``plotly.graph_objects.Figure`` objects the kernel keeps, each drawn in
the page by a :class:`~gpudash.widgets.plot.PlotView` as the dashboard draws its views:
plotly.js once per page, and the whole figure whenever a view says hello, so a reloaded page
draws the last replay again, not empty axes.
"""

from __future__ import annotations

import html
import threading
from typing import Any

import ipywidgets as widgets
import numpy as np
import traitlets

from .. import style
from .._comm_routing import follow_the_page
from .._units import format_bytes
from ..events import ALLOC as _ALLOC, FREE as _FREE, EXTEND as _EXTEND, OOM as _OOM
from .plot import PlotView, typed_array
from .._units import parse_bytes
from ..background import run_in_background
from ..models import model_for, trace_model
from ..trace.replay import DEFAULT_DEVICE_BYTES, replay, resolve_settings
from ..trace.whatif import min_fraction

__all__ = ["WhatIfView", "replay_heatmap"]


# --------------------------------------------------------------------------------------
# The replay's heatmap
# --------------------------------------------------------------------------------------


def replay_heatmap(columns: dict, *, rows: int = 128, samples: int = 300,
                   call_ops: np.ndarray | None = None) -> dict[str, Any]:
    """Address x time fraction-in-use of a recorded replay (one device's event columns).

    The events are cut into ``samples`` equal runs; column ``k`` is the state right after
    the last event of run ``k``. Rows split the address span of the regions (lowest region
    start to highest region end) into ``rows`` equal slices; a row's value is the bytes of
    live allocations inside it / its bytes (exact partial coverage).

    Computed without walking the events: each allocation is alive over a range of columns
    ``[c0, c1)`` and covers a range of rows, so its contribution is four corners in a 2-D
    difference array (whole rows) plus two entries per partial row; cumulative sums over rows
    and columns give the coverage.

    Parameters
    ----------
    columns : dict of numpy arrays
        Event columns (``gpudash.events.COLUMNS``) of one device, in order.
    rows, samples : int
    call_ops : numpy.ndarray, optional
        The replayed calls' ops (1 alloc, 2 free, 7 OOM row): maps each column to the call
        it follows (an allocation's terminal event, ALLOC or OOM, belongs to the next
        allocating call). Without it, ``x`` is the event index.

    Returns
    -------
    dict
        ``z`` (rows x samples float64), ``x`` (call or event index of each column), ``lo``
        (address of row 0), ``row_bytes``, ``event`` (event index of each column).
    """
    kind = np.asarray(columns["kind"])
    n_ev = len(kind)
    k = max(1, min(int(samples), n_ev))
    if n_ev == 0:
        return {"z": np.zeros((rows, 0)), "x": np.zeros(0), "lo": 0, "row_bytes": 256,
                "event": np.zeros(0, dtype=np.int64)}
    ends = (np.arange(1, k + 1) * n_ev + k - 1) // k - 1  # last event of each run
    ptr = np.asarray(columns["ptr"], dtype=np.int64)
    size = np.asarray(columns["size"], dtype=np.int64)
    aid = np.asarray(columns["alloc_id"], dtype=np.int64)

    is_alloc = kind == _ALLOC
    a_idx = np.flatnonzero(is_alloc)
    a_ptr, a_size, a_id = ptr[a_idx], size[a_idx], aid[a_idx]
    f_idx = np.flatnonzero(kind == _FREE)
    free_at = np.full(len(a_idx), n_ev, dtype=np.int64)
    if len(f_idx) and len(a_idx):
        order = np.argsort(a_id, kind="stable")
        pos = np.searchsorted(a_id[order], aid[f_idx])
        ok = pos < len(order)
        ok[ok] &= a_id[order][pos[ok]] == aid[f_idx][ok]
        free_at[order[pos[ok]]] = f_idx[ok]

    ext = np.flatnonzero(kind == _EXTEND)
    if len(ext):
        lo = int(ptr[ext].min())
        hi = int((ptr[ext] + size[ext]).max())
    elif len(a_idx):
        lo, hi = int(a_ptr.min()), int((a_ptr + a_size).max())
    else:
        lo, hi = 0, 256
    row_bytes = max(256, -(-(hi - lo) // rows))
    row_bytes = -(-row_bytes // 256) * 256

    c0 = np.searchsorted(ends, a_idx, side="left")
    c1 = np.searchsorted(ends, free_at, side="left")
    live = c1 > c0
    s = a_ptr[live] - lo
    e = s + a_size[live]
    c0, c1 = c0[live], c1[live]
    s = np.clip(s, 0, rows * row_bytes)
    e = np.clip(e, 0, rows * row_bytes)
    keep = e > s
    s, e, c0, c1 = s[keep], e[keep], c0[keep], c1[keep]
    r0 = s // row_bytes
    r1 = (e - 1) // row_bytes
    width = k + 1

    def scatter(r: np.ndarray, c: np.ndarray, w: np.ndarray, shape_rows: int) -> np.ndarray:
        return np.bincount(r * width + c, weights=w, minlength=shape_rows * width)

    same = r0 == r1
    part_r = np.concatenate([r0[same], r0[~same], r1[~same]])
    part_w = np.concatenate([(e - s)[same], ((r0 + 1) * row_bytes - s)[~same],
                             (e - r1 * row_bytes)[~same]]).astype(np.float64)
    part_c0 = np.concatenate([c0[same], c0[~same], c0[~same]])
    part_c1 = np.concatenate([c1[same], c1[~same], c1[~same]])
    partial = (scatter(part_r, part_c0, part_w, rows)
               - scatter(part_r, part_c1, part_w, rows)).reshape(rows, width)
    multi = r1 > r0 + 1  # whole rows r0+1 .. r1-1
    fr0, fr1, fc0, fc1 = r0[multi] + 1, r1[multi], c0[multi], c1[multi]
    ones = np.ones(len(fr0))
    full = (scatter(fr0, fc0, ones, rows + 1) - scatter(fr1, fc0, ones, rows + 1)
            - scatter(fr0, fc1, ones, rows + 1) + scatter(fr1, fc1, ones, rows + 1))
    full = np.cumsum(full.reshape(rows + 1, width), axis=0)[:rows]
    z = (np.cumsum(partial, axis=1) + row_bytes * np.cumsum(full, axis=1))[:, :k] / row_bytes

    x = ends.astype(np.float64)
    if call_ops is not None:
        ops = np.asarray(call_ops)
        terminal = np.flatnonzero(is_alloc | (kind == _OOM))
        alloc_calls = np.flatnonzero((ops == 1) | (ops == 7))
        m = min(len(terminal), len(alloc_calls))
        if m >= 2:
            x = np.interp(ends, terminal[:m], alloc_calls[:m].astype(np.float64))
        elif len(ops):
            x = ends * (len(ops) / n_ev)
    return {"z": z, "x": x, "lo": lo, "row_bytes": int(row_bytes), "event": ends}


def _max_box(x: np.ndarray, ys: list[np.ndarray], points: int) -> tuple:
    """At most ``points`` points: the max of each run of samples (peaks survive)."""
    n = len(x)
    if n <= points:
        return x, ys
    edges = np.linspace(0, n, points + 1).astype(np.int64)
    starts = edges[:-1]
    return x[edges[1:] - 1], [np.maximum.reduceat(y, starts) for y in ys]


# --------------------------------------------------------------------------------------
# The view
# --------------------------------------------------------------------------------------


class WhatIfView(widgets.VBox):
    """A fraction slider that replays a trace and shows where it runs out of memory.

    Parameters
    ----------
    trace : gpudash.trace.Trace
        What to replay.
    device_bytes : int or str
        Size of the simulated device (default: replay's 16 GiB).
    fraction : float
        The slider's first value (replayed at once).
    device : int, optional
        Which device of a multi-device trace.
    heatmap_rows, heatmap_columns : int
        Heatmap resolution (address rows, sampled columns).
    min_fraction : bool
        Look for the minimum fraction that fits, in the background (default True).
    min_fraction_delay : float
        Seconds to wait before that search starts (its replays take the CPU; the browser
        first needs it to load the figures, which anywidget gives 2 s).
    background : bool
        Replay slider changes in a background thread (default True), so the kernel stays
        free; :meth:`wait` waits for the replay in flight.
    **replay_options
        More :func:`~gpudash.trace.replay.replay` arguments (``allow_growth``,
        ``garbage_collection``, ``deferred_deletion_bytes``...).

    Attributes
    ----------
    slider : FloatSlider
    status, min_fraction_text : ipywidgets.HTML
    timeline, heatmap : plotly.graph_objects.Figure
        The figures of the replay drawn last (change one, then ``plots[i].redraw()``).
    plots : tuple of PlotView
        The widgets that draw them in the page.
    result : ReplayResult or None
        The replay drawn last.
    heatmap_data : dict
        What :func:`replay_heatmap` returned for it.
    """

    replays = traitlets.Int(0, help="Replays drawn so far.")

    def __init__(self, trace: Any, *, device_bytes: Any = None, fraction: float = 1.0,
                 device: int | None = None, heatmap_rows: int = 128,
                 heatmap_columns: int = 300, min_fraction: bool = True,
                 min_fraction_delay: float = 1.0, background: bool = True,
                 **replay_options: Any) -> None:
        self.trace = trace
        self._options = dict(replay_options)
        if device_bytes is not None:
            self._options["device_bytes"] = device_bytes
        if device is not None:
            self._options["device"] = device
        self.device_bytes = device_bytes if device_bytes is not None else DEFAULT_DEVICE_BYTES
        self._rows = int(heatmap_rows)
        self._samples = int(heatmap_columns)
        self._background = background
        self._lock = threading.RLock()
        self._generation = 0
        self._task: Any = None
        self._min_task: Any = None
        self._min_gen = 0  # the minimum-fraction search whose answer is shown
        self.result: Any = None
        self.heatmap_data: dict = {}
        self.error: BaseException | None = None
        self._call_ops: dict[int, np.ndarray] = {}

        # the model the trace replays through: its words, its toggles, its paste line

        name = self._options.get("allocator")
        self.allocator_model = model_for(name) if name is not None else trace_model(trace)
        self._words = self.allocator_model.words()
        self.slider = widgets.FloatSlider(
            min=0.05, max=1.0, step=0.01, value=fraction, description="fraction",
            continuous_update=False, readout_format=".2f", style={"description_width": "70px"},
            tooltip=self.allocator_model.fraction_setting,
            layout=widgets.Layout(width="360px"))
        self.toggles: dict[str, Any] = {}
        for key in self.allocator_model.whatif_toggles:  # PyTorch: expandable_segments
            toggle = widgets.ToggleButton(description=key, value=self._setting(key),
                                          tooltip=f"replay with {key} on or off")
            toggle.observe(lambda change, key=key: self._on_toggle(key, change), "value")
            self.toggles[key] = toggle
        self.status = widgets.HTML()
        self.min_fraction_text = widgets.HTML("<i>minimum fraction: …</i>")

        tl = _new_figure(320, "replay: memory over the trace")
        C = style.COLORS
        tl.add_scatter(name=self._words["in_use"], mode="lines", line=dict(color=C["in use"]),
                       fill="tozeroy", fillcolor=style.FILLS["in use"])
        tl.add_scatter(name=self._words["pool"], mode="lines", line=dict(color=C["pool"]))
        tl.add_scatter(name="limit", mode="lines", line=dict(color=C["limit"], dash="dash"))
        tl.add_scatter(name="OOM", mode="markers", marker=dict(color=C["oom"], symbol="x",
                                                               size=7),
                       hovertemplate="OOM at call %{x:.0f}<extra></extra>")
        tl.add_scatter(name="first OOM", mode="markers",
                       marker=dict(color=C["oom"], symbol="star", size=14),
                       hovertemplate="%{text}<extra></extra>")
        tl.update_xaxes(title_text="call", rangemode="tozero")
        tl.update_yaxes(title_text="bytes", rangemode="tozero", gridcolor=C["grid"])
        hm = _new_figure(340, "replay: address × time, fraction in use")
        hm.add_heatmap(zmin=0, zmax=100, colorscale=style.HEATMAP_SCALE,
                       colorbar=dict(title=dict(text="% in use")))
        hm.add_scatter(name="first OOM", mode="lines", line=dict(color=C["oom"], dash="dot"),
                       hoverinfo="skip")
        hm.update_xaxes(title_text="call")
        hm.update_yaxes(title_text="address offset")
        self.timeline = tl
        self.heatmap = hm
        self.plots = (PlotView(tl), PlotView(hm))
        super().__init__(children=(
            widgets.HBox([self.slider, *self.toggles.values(), self.status]),
            self.min_fraction_text, *self.plots))
        self.slider.observe(self._on_slider_change, "value")
        follow_the_page(self)   # its status and plots change from timer and replay threads
        self._min_timer: threading.Timer | None = None
        self.replay_now(fraction)
        if min_fraction:
            self._min_timer = threading.Timer(max(0.0, float(min_fraction_delay)),
                                              self._start_min_fraction)
            self._min_timer.daemon = True
            self._min_timer.start()

    # ------------------------------------------------------------------ replays
    def _setting(self, key: str) -> bool:
        """An on/off setting the replays run with (the trace's own unless given)."""
        s = resolve_settings(self.trace, **self._options)
        value = s.get(key)
        return bool(getattr(s.get("conf"), key, False) if value is None else value)

    def _on_toggle(self, key: str, change: dict) -> None:
        """Replay with the setting flipped, at the slider's fraction; the minimum fraction
        is looked for again under it."""
        self._options[key] = bool(change["new"])
        self.min_fraction_text.value = "<i>minimum fraction: …</i>"
        self._on_slider_change({"new": self.slider.value})
        if self._min_timer is not None:
            self._start_min_fraction()

    def _replay(self, fraction: float) -> tuple[Any, dict]:
        result = replay(self.trace, fraction=float(fraction), record=True, per_call=True,
                        **self._options)
        dev = int(result.options.get("device") or 0)
        if dev not in self._call_ops:
            self._call_ops[dev] = self.trace.calls(dev).op
        hm = replay_heatmap(result.recording.columns, rows=self._rows, samples=self._samples,
                            call_ops=self._call_ops[dev])
        return result, hm

    def replay_now(self, fraction: float | None = None) -> Any:
        """Replay at ``fraction`` (default: the slider's) in this thread, draw, return the
        :class:`~gpudash.trace.replay.ReplayResult`."""
        fraction = self.slider.value if fraction is None else float(fraction)
        with self._lock:
            self._generation += 1
            gen = self._generation
        self.status.value = f"<i>replaying at {fraction:.2f}…</i>"
        result, hm = self._replay(fraction)
        self._draw(gen, fraction, result, hm)
        return result

    def _on_slider_change(self, change: dict) -> None:
        fraction = float(change["new"])
        if not self._background:
            self._safe(lambda: self.replay_now(fraction))
            return

        with self._lock:
            self._generation += 1
            gen = self._generation
            self.status.value = f"<i>replaying at {fraction:.2f}…</i>"
            self._task = run_in_background(self._replay_and_draw, gen, fraction,
                                           name="whatif-replay")

    def _replay_and_draw(self, gen: int, fraction: float) -> None:
        self._safe(lambda: self._draw(gen, fraction, *self._replay(fraction)))

    def _safe(self, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - shown in the view
            self.error = exc
            self.status.value = (f'<span style="color:#d62728">replay failed: '
                                 f"{html.escape(f'{type(exc).__name__}: {exc}')}</span>")

    def wait(self, timeout: float | None = 60) -> bool:
        """Wait for the replay in flight; True if none is left running."""
        task = self._task
        return task is None or task.join(timeout)

    def _draw(self, gen: int, fraction: float, result: Any, hm: dict) -> None:
        with self._lock:
            if gen != self._generation:
                return  # a newer replay was asked for
            self.result, self.heatmap_data, self.error = result, hm, None
            pc = result.per_call
            in_use = pc.get("in_use", np.zeros(0, dtype=np.int64))
            pool = pc.get("pool", np.zeros(0, dtype=np.int64))
            calls = np.arange(len(in_use), dtype=np.float64)
            x, (y_in, y_pool) = _max_box(calls, [in_use, pool], 4000)
            limit = result.memory_limit
            # bytes in one binary unit, chosen for the highest line (ticks read "12 GiB")
            top_bytes = max([limit, int(y_pool.max()) if len(y_pool) else 0,
                             int(y_in.max()) if len(y_in) else 0, 1])
            unit, scale = style.unit_for(top_bytes)
            ooms = result.ooms[:1000]
            oom_y = in_use[ooms] / scale if len(in_use) else np.zeros(len(ooms))
            first = result.first_oom
            with self.timeline.batch_update():
                t_in, t_pool, t_limit, t_oom, t_first = self.timeline.data
                w = self._words
                t_in.update(x=typed_array(x, np.float64), y=typed_array(y_in / scale, np.float32),
                            hovertemplate=f"call %{{x:.0f}}: %{{y:.2f}} {unit} {w['in_use']}"
                                          "<extra></extra>")
                t_pool.update(x=typed_array(x, np.float64),
                              y=typed_array(y_pool / scale, np.float32),
                              hovertemplate=f"call %{{x:.0f}}: {w['pool']} %{{y:.2f}} {unit}"
                                            "<extra></extra>")
                t_limit.update(x=[0, max(len(calls) - 1, 1)], y=[limit / scale] * 2,
                               hovertemplate=f"limit %{{y:.2f}} {unit}<extra></extra>")
                self.timeline.layout.yaxis.ticksuffix = " " + unit
                t_oom.update(x=typed_array(ooms, np.float64), y=typed_array(oom_y, np.float32))
                # room above the highest line for the markers on it (OOMs happen at the limit)
                self.timeline.layout.yaxis.range = [0, top_bytes / scale * 1.12]
                if first is not None:
                    label = f"first OOM: call {first[0]}, asked {format_bytes(first[1])}"
                    t_first.update(x=[first[0]], y=[float(oom_y[0])], text=[label])
                    # the label below the marker (never above the plot), on the side of the
                    # marker with more room
                    right = first[0] <= 0.6 * max(len(calls) - 1, 1)
                    self.timeline.layout.annotations = [dict(
                        x=first[0], y=float(oom_y[0]), text=label, showarrow=True,
                        arrowhead=2, arrowcolor="#d62728", ax=24 if right else -24, ay=28,
                        xanchor="left" if right else "right", yanchor="top",
                        font=dict(color="#d62728", size=11), bgcolor="rgba(255,255,255,0.8)")]
                else:
                    t_first.update(x=[], y=[], text=[])
                    self.timeline.layout.annotations = []
                self.timeline.layout.title.text = (
                    f"replay at fraction {fraction:.2f}: limit {format_bytes(limit)}, "
                    + ("fits" if first is None else f"{result.oom_count} OOMs"))
            z = np.rint(hm["z"] * 100).astype(np.uint8)
            rows = z.shape[0]
            hunit, hscale = style.unit_for(rows * hm["row_bytes"])
            y = (np.arange(rows) + 0.5) * hm["row_bytes"] / hscale
            with self.heatmap.batch_update():
                h, line = self.heatmap.data
                h.update(z=typed_array(z, np.uint8), x=typed_array(hm["x"], np.float64),
                         y=typed_array(y, np.float64),
                         hovertemplate=f"call %{{x:.0f}}<br>offset %{{y:.2f}} {hunit}<br>"
                                       "%{z}% in use<extra></extra>")
                self.heatmap.layout.yaxis.ticksuffix = " " + hunit
                if first is not None:
                    line.update(x=[first[0], first[0]], y=[0, rows * hm["row_bytes"] / hscale])
                else:
                    line.update(x=[], y=[])
            self.device_bytes = result.options.get("device_bytes", self.device_bytes)
            if first is None:
                text = (f"<b style='color:#2ca02c'>fits</b> at {fraction:.2f}: limit "
                        f"{format_bytes(limit)}, peak {self._words['pool']} "
                        f"{format_bytes(result.peak_pool_bytes)}, peak {self._words['in_use']} "
                        f"{format_bytes(result.peak_bytes_in_use)}")
            else:
                text = (f"<b style='color:#d62728'>out of memory</b> at {fraction:.2f}: "
                        f"first at call {first[0]} asking {format_bytes(first[1])}; "
                        f"{result.oom_count} allocation(s) refused; limit "
                        f"{format_bytes(limit)}")
            for plot in self.plots:
                plot.redraw()
            self.status.value = text
            self.replays += 1

    # ------------------------------------------------------------------ minimum fraction
    def _start_min_fraction(self) -> None:
        self._min_gen += 1
        self._min_task = run_in_background(self._find_min_fraction, name="whatif-min-fraction")

    def _find_min_fraction(self) -> None:
        gen = self._min_gen
        try:
            pass
        except ImportError:
            self.min_fraction_text.value = ("<i>minimum fraction: unavailable "
                                            "(gpudash.trace.whatif is missing)</i>")
            return
        try:
            found = min_fraction(self.trace, **self._options)
        except Exception as exc:  # noqa: BLE001 - shown in the view
            if gen != self._min_gen:
                return
            self.min_fraction_text.value = (f"<i>minimum fraction: failed "
                                            f"({html.escape(type(exc).__name__)}: "
                                            f"{html.escape(str(exc))})</i>")
            return
        if gen != self._min_gen:
            return  # a toggle asked for a newer search
        self.min_fraction_value = found
        text = _describe_min_fraction(found, self.device_bytes)
        value = getattr(found, "fraction", found)
        if isinstance(value, (int, float)):   # PyTorch: the line that sets it, live

            line = self.allocator_model.fraction_line(
                float(value), resolve_settings(self.trace, **self._options))
            if line:
                text += f"<br><small><code>{html.escape(line)}</code></small>"
        self.min_fraction_text.value = text

    def wait_min_fraction(self, timeout: float | None = 60) -> bool:
        """Wait for the minimum-fraction search; True once it ended (or never started)."""
        timer = self._min_timer
        if timer is not None:
            timer.join(timeout)
        task = self._min_task
        return task is None or task.join(timeout)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        timer = getattr(self, "_min_timer", None)  # (a view whose making failed, too)
        if timer is not None:
            timer.cancel()
        for task in (getattr(self, "_task", None), getattr(self, "_min_task", None)):
            if task is not None:
                task.cancel()
        for w in (getattr(self, "slider", None), getattr(self, "status", None),
                  getattr(self, "min_fraction_text", None), *getattr(self, "plots", ()),
                  *getattr(self, "toggles", {}).values()):
            if w is not None:
                w.close()
        for child in self.children:
            child.close()
        super().close()

    def __repr__(self) -> str:
        r = self.result
        verdict = "none yet" if r is None else ("fits" if r.fits else f"{r.oom_count} OOMs")
        return f"WhatIfView(fraction={self.slider.value:.2f}, last replay: {verdict})"


def _layout(height: int, title: str) -> dict:
    # no width: the figure is as wide as its box (PlotView follows it)
    return dict(height=height, margin=dict(l=60, r=20, t=72, b=40), template="plotly_white",
                title=dict(text=title, x=0.01, xanchor="left", y=0.98, yanchor="top",
                           font=dict(size=14)),
                legend=dict(orientation="h", x=1, xanchor="right", y=1.01, yanchor="bottom"))


def _new_figure(height: int, title: str) -> Any:
    """An empty figure with the layout of gpudash's figure widgets, as wide as its box."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.update_layout(**_layout(height, title), autosize=True)
    return fig


def _describe_min_fraction(found: Any, device_bytes: Any) -> str:
    """Text for what ``min_fraction`` returned (a ``MinFractionResult``, or a number)."""
    value = getattr(found, "fraction", found)
    if value is None:
        return "<b>minimum fraction:</b> none fits (even the largest fraction tried runs out)"
    try:
        value = float(value)
    except (TypeError, ValueError):
        return f"<b>minimum fraction:</b> {html.escape(str(found))}"
    limit = getattr(found, "limit_bytes", None)
    if limit is None:
        limit = int(parse_bytes(device_bytes) * value)
    note = (" <small>(fitting is not monotone in the fraction for this trace: a smaller "
            "fraction may fit too)</small>" if getattr(found, "non_monotone", False) else "")
    return (f"<b>minimum fraction that fits:</b> {value:.3f} (limit {format_bytes(int(limit))})"
            f"{note}")
