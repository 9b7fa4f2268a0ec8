"""The stats table: TensorFlow's allocator stats and fragmentation, one column per device.

Rows: TensorFlow's ``AllocatorStats`` (num_allocs, bytes in use, peak, largest allocation,
limit, pool, peak pool, largest free block), then fragmentation: external (TensorFlow's
``1 - largest_free / free``), internal (allocated - requested of live chunks) and
pool - in use. A device over its limit (after the fraction was lowered) gets a red banner.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets
import traitlets

from .._units import format_bytes

__all__ = ["StatsView", "stats_rows"]


def stats_rows(state: Any) -> list[tuple[str, str, str]]:
    """``(label, value, exact)`` rows for one device state."""
    s = state.stats
    c = state.counters

    def b(n: int) -> tuple[str, str]:
        return format_bytes(int(n)), f"{int(n):,} B"

    rows = [
        ("num_allocs", f"{s.num_allocs:,}", ""),
        ("bytes_in_use", *b(s.bytes_in_use)),
        ("peak_bytes_in_use", *b(s.peak_bytes_in_use)),
        ("largest_alloc_size", *b(s.largest_alloc_size)),
        ("bytes_limit", *b(s.bytes_limit)),
        ("pool_bytes", *b(s.pool_bytes)),
        ("peak_pool_bytes", *b(s.peak_pool_bytes)),
        ("largest_free_block_bytes", *b(s.largest_free_block_bytes)),
        ("external fragmentation", f"{s.fragmentation:.1%}", "1 - largest free / free"),
        ("internal fragmentation", *b(state.internal_fragmentation)),
        ("pool - in use", *b(state.reserved_unused)),
        ("chunks", f"{state.num_chunks:,}", f"{int(state.table['in_use'].sum()):,} in use"),
        ("OOMs", f"{c['ooms']:,}", "since the model started"),
    ]
    return rows


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
                    f"{format_bytes(st.stats.bytes_in_use)} in use, limit "
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
