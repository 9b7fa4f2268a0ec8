"""The timeline: bytes in use, pool bytes and the limit over time (PyTorch's caching
allocator: allocated, reserved and the limit: the lines take the allocator model's words).

Out-of-memory events are red markers on the in-use line (hover: the bytes asked for);
setting changes are vertical dotted lines with a label such as ``fraction 0.5→0.3``. The x
axis is seconds since the model started; lines are steps (a state holds until the next one),
and the latest state holds until the model's latest refresh: the lines go on, flat, while
nothing changes (so a new limit shows as a line, not as a jump at the right edge).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import traitlets

from .._units import format_bytes
from . import _figure, _ModelView
from .model import typed_array

__all__ = ["TimelineView", "setting_label"]

_MIB = float(1 << 20)

_SHORT = {
    "per_process_gpu_memory_fraction": "fraction",
    "memory_limit": "limit",
    "allow_growth": "growth",
    "deferred_deletion_bytes": "deferred",
}
_BYTES = {"memory_limit", "deferred_deletion_bytes"}


def setting_label(setting: str, old: Any, new: Any) -> str:
    """``fraction 0.5→0.3``, ``limit 8.00 GiB→4.00 GiB``, ``growth off→on``."""
    name = _SHORT.get(setting, setting)

    def fmt(v: Any) -> str:
        if setting in _BYTES and isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            return format_bytes(int(v))
        if isinstance(v, bool):
            return "on" if v else "off"
        if isinstance(v, float):
            return f"{v:g}"
        return str(v)

    return f"{name} {fmt(old)}→{fmt(new)}"


def _group_settings(marks: tuple, window_ms: float = 100.0) -> list[tuple[float, str]]:
    """Setting marks of one change as one labelled line: a fraction change also moves the
    limit, so marks within ``window_ms`` of each other share a line unless the same setting
    repeats (two changes of the fraction are two lines)."""
    groups: list[tuple[float, list[str], set]] = []
    for m in marks:
        label = setting_label(m.setting, m.old, m.new)
        g = groups[-1] if groups else None
        if g is not None and m.time_ms - g[0] <= window_ms and m.setting not in g[2]:
            g[1].append(label)
            g[2].add(m.setting)
        else:
            groups.append((m.time_ms, [label], {m.setting}))
    return [(t, ", ".join(labels)) for t, labels, _ in groups]


def _steps(t: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The points of a step line (``line_shape="hv"``) where its value changes, and the last
    one: the same drawing from fewer points (the pool and the limit rarely move)."""
    if len(y) <= 2:
        return t, y
    keep = np.empty(len(y), dtype=bool)
    keep[0] = keep[-1] = True
    keep[1:-1] = y[1:-1] != y[:-2]
    return t[keep], y[keep]


class TimelineView(_ModelView):
    """In use, pool and limit over time, with OOMs and setting changes marked.

    x is seconds since the model started (its local start time is in the axis title). Not
    a date axis: plotly.js re-guesses an axis's type whenever a trace's x data changes, and
    guesses numbers as linear.

    Parameters
    ----------
    model : LiveModel
    device : int
    max_marked_settings : int
        Most setting-change lines drawn (the latest).

    Attributes
    ----------
    figure : FigureWidget
        Traces: in use, pool, limit, OOM markers, then the three lines' tails (two points
        each: the latest state, held until the model's latest refresh; moved at most every
        ``tail_interval`` seconds while nothing changes, a few bytes each time). Setting
        changes are layout shapes and annotations.
    marked_settings : list of (time_ms, label)
        The setting lines drawn last.
    marked_ooms : list of OomMark
        The OOMs drawn last.
    """

    max_marked_settings = traitlets.Int(20, help="Most setting-change lines drawn.")
    tail_interval = traitlets.Float(1.0, help="Seconds between moves of the lines' tails "
                                              "while nothing changes.")

    def __init__(self, model: Any, *, device: int = 0, height: int = 300,
                 max_marked_settings: int = 20) -> None:
        self._height = height
        self.max_marked_settings = max_marked_settings
        self.marked_settings: list[tuple[float, str]] = []
        self.marked_ooms: list = []
        self._version = -1
        self._tail: tuple[float, list[float]] | None = None  # (x, [in use, pool, limit])
        self._tail_end = -np.inf
        self._tail_sent = -np.inf
        super().__init__(model, device=device)

    @traitlets.validate("max_marked_settings")
    def _validate_max_marked_settings(self, proposal: Any) -> int:
        if proposal["value"] < 0:
            raise traitlets.TraitError("max_marked_settings must be >= 0")
        return proposal["value"]

    def _build(self) -> None:
        import plotly.graph_objects as go

        fig = _figure(self._height, title="memory over time",
                      hovermode="x unified")
        hover = "%{y:.2f} MiB at %{x:.1f} s"
        words = self.model.model(self.device).words()  # PyTorch: allocated, reserved
        lines = (dict(name=words["in_use"], line=dict(color="#1f77b4", width=2),
                      fill="tozeroy", fillcolor="rgba(31,119,180,0.15)"),
                 dict(name=words["pool"], line=dict(color="#2ca02c", width=1.5)),
                 dict(name="limit", line=dict(color="#d62728", width=1.5, dash="dash")))
        for style in lines:
            fig.add_trace(go.Scatter(mode="lines", line_shape="hv", hovertemplate=hover,
                                     legendgroup=style["name"], **style))
        fig.add_trace(go.Scatter(name="OOM", mode="markers",
                                 marker=dict(color="#d62728", symbol="x", size=10),
                                 hovertemplate="OOM: %{text}<extra></extra>"))
        for style in lines:  # the tails: in the legend (and hidden) with their lines
            fig.add_trace(go.Scatter(mode="lines", showlegend=False, hoverinfo="skip",
                                     legendgroup=style["name"], x=[], y=[], **style))
        fig.update_xaxes(title_text=f"seconds since {self.model.start_label}")
        fig.update_yaxes(title_text="MiB", rangemode="tozero")
        self.figure = fig
        self.children = (fig,)

    def _draw(self, state: Any, reset: bool) -> None:
        if not reset and state.version == self._version:
            return
        self._version = state.version
        tl = state.timeline
        sec = self.model.seconds
        t = sec(tl["time_ms"])
        ooms = list(state.ooms)
        groups = _group_settings(state.settings)[-self.max_marked_settings:] \
            if self.max_marked_settings else []
        fig = self.figure
        with fig.batch_update():
            in_use, pool, limit, oom = fig.data[:4]
            for trace, key in ((in_use, "in_use"), (pool, "pool"), (limit, "limit")):
                x, y = _steps(t, tl[key])
                trace.update(x=typed_array(x, np.float64),
                             y=typed_array(y / _MIB, np.float32))
            if len(t):
                self._tail = (float(t[-1]), [float(tl[k][-1] / _MIB)
                                             for k in ("in_use", "pool", "limit")])
                end = max(float(t[-1]), float(sec(self.model.last_refresh_ms)))
                self._move_tail(end)
            if ooms != self.marked_ooms or reset:
                oom.update(x=sec([m.time_ms for m in ooms]),
                           y=[m.in_use / _MIB for m in ooms],
                           text=[f"asked {format_bytes(m.requested)} "
                                 f"({format_bytes(m.rounded)} rounded)" for m in ooms])
            if groups != self.marked_settings or reset:
                fig.layout.shapes = [
                    dict(type="line", xref="x", yref="paper", x0=sec(t), x1=sec(t),
                         y0=0, y1=1, line=dict(color="#7f7f7f", width=1, dash="dot"))
                    for t, _ in groups]
                # one setting a line of text (a fraction change also moves the limit): a
                # label as long as the plot is high would run into the x axis
                fig.layout.annotations = [
                    dict(x=sec(t), xref="x", y=1, yref="paper",
                         text=label.replace(", ", "<br>"), showarrow=False,
                         textangle=-90, xanchor="right", yanchor="top", align="right",
                         bgcolor="rgba(255,255,255,0.6)",
                         font=dict(size=10, color="#555")) for t, label in groups]
            s = state.stats
            words = state.model.words()
            if reset:  # the device's model names the lines (and their tails)
                for i, key in ((0, "in_use"), (1, "pool")):
                    fig.data[i].name = fig.data[4 + i].name = words[key]
                    fig.data[i].legendgroup = fig.data[4 + i].legendgroup = words[key]
            over = " — OVER LIMIT" if state.over_limit else ""
            fig.layout.title.text = (f"{state.name}: {format_bytes(s.bytes_in_use)} "
                                     f"{words['in_use']}, {words['pool']} "
                                     f"{format_bytes(s.pool_bytes)}, limit "
                                     f"{format_bytes(s.bytes_limit)}{over}")
        self.marked_ooms = ooms
        self.marked_settings = groups

    def _move_tail(self, end: float) -> None:
        """Draw the latest state from its time to ``end`` (seconds); call in a batch."""
        x0, ys = self._tail  # type: ignore[misc]
        for trace, y in zip(self.figure.data[4:7], ys):
            trace.update(x=[x0, end], y=[y, y])
        self._tail_end = end
        self._tail_sent = time.monotonic()

    def _tick(self, now_ms: float, changed: set) -> None:
        # A rebuilt device was just drawn up to now; a state waiting for its draw (a rate
        # cap) will be drawn soon; otherwise the latest state still holds: extend it.
        if self._tail is None or self.device in changed or self._pending is not None:
            return
        end = float(self.model.seconds(now_ms))
        if end <= self._tail_end or time.monotonic() - self._tail_sent < self.tail_interval:
            return
        with self.figure.batch_update():
            self._move_tail(end)
