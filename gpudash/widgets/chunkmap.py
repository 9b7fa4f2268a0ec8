"""The chunk map: every region as a horizontal bar of its chunks (PyTorch's caching
allocator: every segment as a bar of its blocks, labelled with its pool and whether it is
expandable; the words are the allocator model's).

One bar trace per category (in use, rounding waste, free), each drawn from arrays, so 10,000
chunks are three traces, not 10,000. Regions are rows (numeric y with the regions' addresses
as tick labels), x is the offset inside the region in MiB (``base`` = where a chunk starts,
``x`` = its width). In-use chunks are drawn whole; their rounding waste (size - requested) is
overlaid at their end. Hovering a chunk shows its address (hex), size, requested size, bin
and allocation id.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import traitlets

from .._units import format_bytes
from . import _figure, _ModelView
from .model import typed_array

__all__ = ["ChunkMapView"]

_MIB = float(1 << 20)

COLORS = {"in use": "#1f77b4", "waste": "#d62728", "free": "#b8d8b0"}

_HOVER_USED = ("address 0x%{customdata[0]:x}<br>size %{customdata[1]:,} B<br>"
               "requested %{customdata[2]:,} B<br>bin %{customdata[3]}<br>"
               "allocation id %{customdata[4]}<extra>in use</extra>")
_HOVER_FREE = ("address 0x%{customdata[0]:x}<br>size %{customdata[1]:,} B<br>"
               "bin %{customdata[2]}<extra>free</extra>")


class ChunkMapView(_ModelView):
    """Regions as bars of their chunks: in use, rounding waste, free.

    Parameters
    ----------
    model : LiveModel
    device : int
        Index of the device shown (changeable: ``view.device = 1``).
    height : int
        Figure height in pixels.
    max_rate_hz : float or None
        Most redraws a second (default 1: a map of 10,000 chunks is ~0.6 MB on the wire);
        None redraws at every model refresh. Unchanged chunks are never sent again.

    Attributes
    ----------
    figure : plotly.graph_objects.FigureWidget
        Traces 0, 1, 2: in use, waste, free.
    arrays : dict
        What was drawn last, as numpy arrays (bytes, not MiB): ``used_ptr``,
        ``used_offset``, ``used_size``, ``used_requested``, ``used_alloc_id``, ``used_bin``,
        ``used_region``, ``free_ptr``, ``free_offset``, ``free_size``, ``free_bin``,
        ``free_region``, ``regions``.
    """

    redraws = traitlets.Int(0, help="Times the figure was redrawn (unchanged chunks are "
                                    "not sent again).")

    def __init__(self, model: Any, *, device: int = 0, height: int = 320,
                 max_rate_hz: float | None = 1.0) -> None:
        self._height = height
        self.arrays: dict[str, np.ndarray] = {}
        self._key: tuple | None = None
        super().__init__(model, device=device, max_rate_hz=max_rate_hz)

    def _build(self) -> None:
        import plotly.graph_objects as go

        fig = _figure(self._height, title="chunks by region", barmode="overlay",
                      bargap=0.25, showlegend=True)
        for name, hover in (("in use", _HOVER_USED), ("waste", None), ("free", _HOVER_FREE)):
            fig.add_trace(go.Bar(name=name, orientation="h", marker_color=COLORS[name],
                                 marker_line_width=0, hovertemplate=hover,
                                 hoverinfo="skip" if hover is None else None))
        fig.update_xaxes(title_text="offset in region (MiB)", rangemode="tozero")
        fig.update_yaxes(autorange="reversed", title_text="region")
        self.figure = fig
        self.children = (fig,)

    def _draw(self, state: Any, reset: bool) -> None:
        t = state.table
        key = (state.device, t["ptr"].tobytes(), t["size"].tobytes(),
               t["requested"].tobytes(), t["alloc_id"].tobytes(), t["regions"].tobytes())
        if not reset and key == self._key:
            return
        self._key = key
        regions = t["regions"]
        reg_ptr = regions[:, 0]
        ri = np.searchsorted(reg_ptr, t["region"]) if len(reg_ptr) else np.zeros(0, np.intp)
        offset = t["ptr"] - t["region"]
        used = t["in_use"]
        free = ~used
        size = t["size"]
        model = state.model
        bins = model.bin_index(t)  # TensorFlow's bin of each chunk, PyTorch's pool
        a = {
            "used_ptr": t["ptr"][used], "used_offset": offset[used], "used_size": size[used],
            "used_requested": t["requested"][used], "used_alloc_id": t["alloc_id"][used],
            "used_bin": bins[used], "used_region": ri[used],
            "free_ptr": t["ptr"][free], "free_offset": offset[free], "free_size": size[free],
            "free_bin": bins[free], "free_region": ri[free], "regions": regions.copy(),
        }
        self.arrays = a
        waste = a["used_size"] - a["used_requested"]
        has_waste = waste > 0
        used_custom = np.column_stack([a["used_ptr"], a["used_size"], a["used_requested"],
                                       a["used_bin"], a["used_alloc_id"]])
        free_custom = np.column_stack([a["free_ptr"], a["free_size"], a["free_bin"]])
        kinds = model.region_kinds(t) or [""] * len(regions)  # PyTorch: small/large, expandable
        labels = [f"{p:#x} ({format_bytes(int(s))})" + (f" {k}" if k else "")
                  for (p, s), k in zip(regions, kinds)]
        w = model.words()
        fig = self.figure
        with fig.batch_update():
            if reset:  # the model's words (PyTorch: segments of blocks, pools)
                fig.data[0].name = w["in_use"]
                fig.data[0].hovertemplate = _HOVER_USED.replace(
                    "<br>bin ", f"<br>{w['bin']} ").replace(">in use<", f">{w['in_use']}<")
                fig.data[2].hovertemplate = _HOVER_FREE.replace("<br>bin ", f"<br>{w['bin']} ")
                fig.layout.xaxis.title.text = f"offset in {w['region']} (MiB)"
                fig.layout.yaxis.title.text = w["region"]
            tr_used, tr_waste, tr_free = fig.data
            tr_used.update(x=typed_array(a["used_size"] / _MIB, np.float32),
                           base=typed_array(a["used_offset"] / _MIB, np.float32),
                           y=typed_array(a["used_region"], np.uint16),
                           customdata=typed_array(used_custom, np.float64))
            tr_waste.update(x=typed_array(waste[has_waste] / _MIB, np.float32),
                            base=typed_array((a["used_offset"] + a["used_requested"])[has_waste]
                                             / _MIB, np.float32),
                            y=typed_array(a["used_region"][has_waste], np.uint16))
            tr_free.update(x=typed_array(a["free_size"] / _MIB, np.float32),
                           base=typed_array(a["free_offset"] / _MIB, np.float32),
                           y=typed_array(a["free_region"], np.uint16),
                           customdata=typed_array(free_custom, np.float64))
            fig.layout.yaxis.update(tickmode="array", tickvals=list(range(len(labels))),
                                    ticktext=labels,
                                    range=[len(labels) - 0.5, -0.5] if labels else None)
            fig.layout.title.text = (f"{state.name}: {len(labels)} {w['region']}(s), "
                                     f"{int(used.sum())} {w['chunk']}s {w['in_use']}, "
                                     f"{int(free.sum())} free")
        self.redraws += 1
