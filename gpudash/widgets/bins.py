"""The bins view: TensorFlow's 21 BFC bins (256 B ... 256 MiB+).

Top: free bytes and in-use bytes per bin (MiB); bottom: free chunks per bin. Chunks are
bucketed by ``BinNumForSize`` of their size, as ``MemoryDump`` does. Hover shows exact
figures.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import traitlets

from .._units import format_bytes
from . import _figure, _ModelView
from .model import NUM_BINS, bin_labels

__all__ = ["BinsView"]

_MIB = float(1 << 20)


class BinsView(_ModelView):
    """Free chunks, free bytes and in-use bytes in each of the 21 bins.

    Attributes
    ----------
    figure : plotly.graph_objects.FigureWidget
        Traces: free bytes (MiB), in-use bytes (MiB), free chunks.
    counts : BinCounts
        The counts drawn last.
    """

    redraws = traitlets.Int(0, help="Times the figure was redrawn.")

    def __init__(self, model: Any, *, device: int = 0, height: int = 360) -> None:
        self._height = height
        self._last: tuple | None = None
        self.counts = None
        super().__init__(model, device=device)

    def _build(self) -> None:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        labels = bin_labels()
        # The rows say what they show in their y titles, not in subplot titles: those sit
        # where the legend row is (above the plot), and between the rows.
        base = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                             row_heights=[0.6, 0.4])
        fig = _figure(self._height, "bins", base=base, barmode="group")
        zeros = [0] * NUM_BINS
        fig.add_trace(go.Bar(name="free bytes", x=labels, y=zeros, marker_color="#b8d8b0",
                             hovertemplate="bin %{x}: %{text} free<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Bar(name="in-use bytes", x=labels, y=zeros, marker_color="#1f77b4",
                             hovertemplate="bin %{x}: %{text} in use<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Bar(name="free chunks", x=labels, y=zeros, marker_color="#31a354",
                             hovertemplate="bin %{x}: %{y} free chunks<extra></extra>"),
                      row=2, col=1)
        fig.update_xaxes(type="category", row=2, col=1, title_text="bin (chunk size)")
        fig.update_yaxes(title_text="MiB", row=1, col=1)
        fig.update_yaxes(title_text="free chunks", rangemode="tozero", row=2, col=1)
        self.figure = fig
        self.children = (fig,)

    def _draw(self, state: Any, reset: bool) -> None:
        c = state.bins
        key = (c.free_chunks.tobytes(), c.free_bytes.tobytes(), c.in_use_bytes.tobytes())
        if not reset and key == self._last:
            return
        self._last = key
        self.counts = c
        fig = self.figure
        with fig.batch_update():
            free_b, used_b, free_n = fig.data
            free_b.y = np.round(c.free_bytes / _MIB, 6)
            free_b.text = [format_bytes(int(v)) for v in c.free_bytes]
            used_b.y = np.round(c.in_use_bytes / _MIB, 6)
            used_b.text = [format_bytes(int(v)) for v in c.in_use_bytes]
            free_n.y = c.free_chunks.astype(np.int32)
            fig.layout.title.text = f"{state.name}: bytes and free chunks per bin"
        self.redraws += 1
