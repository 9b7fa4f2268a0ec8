"""The stats table: the allocator's stats and fragmentation, one column per device.

The rows are the allocator model's (:meth:`gpudash.models.AllocatorModel.stats_rows`). For
TensorFlow's BFC: ``AllocatorStats`` (num_allocs, bytes in use, peak, largest allocation,
limit, pool, peak pool, largest free block), then fragmentation: external (TensorFlow's
``1 - largest_free / free``), internal (allocated - requested of live chunks) and
pool - in use. For PyTorch's caching allocator: ``torch.cuda.memory_stats()``'s keys
(``allocated_bytes.all.current``, ``reserved_bytes.all.peak``, ``num_alloc_retries``...),
the limit, reserved - allocated and fragmentation. A device over its limit (after the
fraction was lowered) gets a red banner.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets
import traitlets

from .._units import format_bytes

__all__ = ["StatsView", "stats_rows"]


def stats_rows(state: Any) -> list[tuple[str, str, str]]:
    """``(label, value, exact)`` rows for one device state, in its allocator model's names
    (:meth:`gpudash.models.AllocatorModel.stats_rows`)."""
    return state.model.stats_rows(state)


_CSS = ("<style>.gpudash-stats td,.gpudash-stats th{padding:2px 10px;text-align:right;"
        "font-family:var(--jp-code-font-family,monospace);font-size:12px}"
        ".gpudash-stats th{text-align:left}"
        ".gpudash-over{background:#d62728;color:white;font-weight:bold;padding:4px 8px;"
        "margin:2px 0;border-radius:3px}</style>")


class StatsView(widgets.VBox):
    """An HTML table of every device's stats, redrawn when a device changes.

    Attributes
    ----------
    html : ipywidgets.HTML
        The table (and an "over limit" banner per device that is over its limit).
    """

    redraws = traitlets.Int(0, help="Times the table was redrawn.")

    def __init__(self, model: Any) -> None:
        self.model = model
        self.html = widgets.HTML()
        super().__init__(children=(self.html,))
        self._remove_listener = model.add_listener(self._on_model_update)
        self.redraw()

    def _on_model_update(self, changed: dict) -> None:
        self.redraw()

    def redraw(self) -> None:
        """Render the model's latest states."""
        states = [s for s in self.model.states.values() if s is not None]
        text = self.render(states)
        if text != self.html.value:
            self.html.value = text
            self.redraws += 1

    @staticmethod
    def render(states: list) -> str:
        """The HTML for a list of device states."""
        banners = []
        for st in states:
            if st.over_limit:
                over = st.stats.bytes_in_use - st.stats.bytes_limit
                banners.append(
                    f'<div class="gpudash-over">{html.escape(st.name)} is OVER LIMIT: '
                    f"{format_bytes(st.stats.bytes_in_use)} {st.model.in_use}, limit "
                    f"{format_bytes(st.stats.bytes_limit)} ({format_bytes(over)} over)</div>")
        table = [[r for r in stats_rows(st)] for st in states]
        head = "".join(f"<th>{html.escape(st.name)}</th>" for st in states)
        body = []
        for i, (label, _, _) in enumerate(table[0] if table else []):
            cells = "".join(
                f'<td title="{html.escape(rows[i][2])}">{html.escape(rows[i][1])}</td>'
                for rows in table)
            body.append(f"<tr><th>{html.escape(label)}</th>{cells}</tr>")
        return (_CSS + "".join(banners) + f'<table class="gpudash-stats"><tr><th></th>{head}'
                f"</tr>{''.join(body)}</table>")

    def close(self) -> None:
        remove = getattr(self, "_remove_listener", None)
        if remove is not None:
            remove()
            self._remove_listener = None
        self.html.close()
        super().close()

    def __repr__(self) -> str:
        return f"StatsView(devices={self.model.num_devices}, model={self.model!r})"
