"""The heatmap: address x time, coloured by the fraction of each address row in use.

y is the offset in the device's memory with its regions laid end to end (the heatmap rows
split the device's capacity equally); x is seconds since the model started. Each model
refresh that changed the device appends one column: the view extends its z/x arrays and
sends them inside one ``fig.batch_update()``; the figure is never recreated. Two lines mark
the pool's end and the limit, drawn to the right edge of the last column (so a new limit
shows as a line, not as a jump at the edge). z travels as one byte per cell (percent in
use).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import traitlets

from . import _figure, _ModelView
from .model import typed_array

__all__ = ["HeatmapView"]

_MIB = float(1 << 20)


class HeatmapView(_ModelView):
    """Fraction of bytes in use per address row over time; grows as events arrive.

    Parameters
    ----------
    model : LiveModel
    device : int
    height : int
    colorscale : str
    max_rate_hz : float or None
        Most redraws a second (default 1; the full heatmap, 256 x 600 cells, is ~200 kB on
        the wire). Columns are never lost: a redraw appends every column the model made
        since the last one. None redraws at every model refresh.

    Attributes
    ----------
    figure : FigureWidget
        Traces: the heatmap, the pool end line, the limit line.
    z : numpy.ndarray
        The percentages drawn (uint8, rows x columns, oldest column first).
    x : numpy.ndarray
        The columns' times (ms since the epoch).
    """

    columns_appended = traitlets.Int(0, help="Columns appended since the view started.")

    def __init__(self, model: Any, *, device: int = 0, height: int = 340,
                 colorscale: str = "Blues", max_rate_hz: float | None = 1.0) -> None:
        self._height = height
        self._colorscale = colorscale
        self.z = np.zeros((0, 0), dtype=np.uint8)
        self.x = np.zeros(0, dtype=np.float64)
        self._row_bytes = 0
        super().__init__(model, device=device, max_rate_hz=max_rate_hz)

    def _build(self) -> None:
        import plotly.graph_objects as go

        fig = _figure(self._height, title="address × time: fraction in use")
        fig.add_trace(go.Heatmap(name="in use", zmin=0, zmax=100, colorscale=self._colorscale,
                                 colorbar=dict(title=dict(text="% in use"), len=0.9),
                                 hovertemplate="%{x:.1f} s, offset %{y:.1f} MiB<br>%{z}% in use"
                                               "<extra></extra>"))
        fig.add_trace(go.Scatter(name="pool end", mode="lines", line_shape="hv",
                                 line=dict(color="#2ca02c", width=1.5),
                                 hovertemplate="pool %{y:.1f} MiB<extra></extra>"))
        fig.add_trace(go.Scatter(name="limit", mode="lines", line_shape="hv",
                                 line=dict(color="#d62728", width=1.5, dash="dash"),
                                 hovertemplate="limit %{y:.1f} MiB<extra></extra>"))
        fig.update_xaxes(title_text=f"seconds since {self.model.start_label}")
        fig.update_yaxes(title_text="offset (MiB, regions end to end)")
        self.figure = fig
        self.children = (fig,)

    def _draw(self, state: Any, reset: bool) -> None:
        cols = np.rint(state.heatmap * 100.0).astype(np.uint8)
        times = state.heatmap_time_ms
        reset = reset or state.heatmap_row_bytes != self._row_bytes or not len(self.x)
        if reset:
            z, x = cols, times.copy()
            added = len(times)
        else:
            new = times > self.x[-1]
            added = int(new.sum())
            if not added:
                return
            z = np.concatenate([self.z, cols[:, new]], axis=1)
            x = np.concatenate([self.x, times[new]])
            keep = cols.shape[1]  # the model's bound on columns
            if x.size > keep:
                z, x = z[:, -keep:], x[-keep:]
        self.z, self.x = np.ascontiguousarray(z), x
        self._row_bytes = state.heatmap_row_bytes
        rows = z.shape[0]
        y = (np.arange(rows) + 0.5) * (state.heatmap_row_bytes / _MIB)
        tl = state.timeline
        since = tl["time_ms"] >= (x[0] if len(x) else 0)
        sec = self.model.seconds
        t_lines = tl["time_ms"][since]
        y_pool, y_limit = tl["pool"][since], tl["limit"][since]
        if len(t_lines) and len(x):
            # the last column reaches half a column past its time: so do the lines
            edge = x[-1] + (x[-1] - x[-2]) / 2 if len(x) > 1 else x[-1]
            if edge > t_lines[-1]:
                t_lines = np.append(t_lines, edge)
                y_pool, y_limit = np.append(y_pool, y_pool[-1]), np.append(y_limit, y_limit[-1])
        tx = typed_array(sec(t_lines), np.float64)
        fig = self.figure
        with fig.batch_update():
            hm, pool, limit = fig.data
            hm.update(z=typed_array(self.z, np.uint8), x=typed_array(sec(self.x), np.float64))
            if reset:
                hm.y = typed_array(y, np.float64)
            pool.update(x=tx, y=typed_array(y_pool / _MIB, np.float32))
            limit.update(x=tx, y=typed_array(y_limit / _MIB, np.float32))
            fig.layout.yaxis.range = [0, rows * state.heatmap_row_bytes / _MIB]
            fig.layout.title.text = f"{state.name}: address × time, fraction in use"
        self.columns_appended += added
