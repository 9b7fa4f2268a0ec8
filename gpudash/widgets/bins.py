"""The bins view: TensorFlow's 21 BFC bins (256 B ... 256 MiB+), or PyTorch's two pools.

Top: free bytes and in-use bytes per bin (MiB); bottom: free chunks per bin. Chunks are
bucketed as the allocator model says (:meth:`gpudash.models.AllocatorModel.bin_index`):
``BinNumForSize`` of their size, as ``MemoryDump`` does, or PyTorch's pool (small: requests
up to 1 MiB; large). Hover shows exact figures.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import traitlets

from .._units import format_bytes
from . import _figure, _ModelView

__all__ = ["BinsView"]

_MIB = float(1 << 20)


class BinsView(_ModelView):
    """Free chunks, free bytes and in-use bytes in each of the 21 bins (PyTorch: each pool).

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

        model = self.model.model(self.device)
        labels = model.bin_labels()
        words = model.words()
        # The rows say what they show in their y titles, not in subplot titles: those sit
        # where the legend row is (above the plot), and between the rows.
        base = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                             row_heights=[0.6, 0.4])
        fig = _figure(self._height, words["bins"], base=base, barmode="group")
        zeros = [0] * len(labels)
        fig.add_trace(go.Bar(name="free bytes", x=labels, y=zeros, marker_color="#b8d8b0",
                             hovertemplate=f"{words['bin']} %{{x}}: %{{text}} free"
                                           "<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Bar(name="in-use bytes", x=labels, y=zeros, marker_color="#1f77b4",
                             hovertemplate=f"{words['bin']} %{{x}}: %{{text}} "
                                           f"{words['in_use']}<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Bar(name=f"free {words['chunk']}s", x=labels, y=zeros,
                             marker_color="#31a354",
                             hovertemplate=f"{words['bin']} %{{x}}: %{{y}} free "
                                           f"{words['chunk']}s<extra></extra>"),
                      row=2, col=1)
        fig.update_xaxes(type="category", row=2, col=1, title_text=words["bins_axis"])
        fig.update_yaxes(title_text="MiB", row=1, col=1)
        fig.update_yaxes(title_text=f"free {words['chunk']}s", rangemode="tozero", row=2, col=1)
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
            w = state.model.words()
            fig.layout.title.text = f"{state.name}: bytes and free {w['chunk']}s per {w['bin']}"
        self.redraws += 1
