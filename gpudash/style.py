"""gpudash's visual language: one set of colours, units and axis rules for every figure.

The live dashboard, the static figures (``%%gpudash_track``, what-if, reports, ``explain``) and
the notebooks all draw from here, so a colour or a unit means the same thing everywhere:

- **Colours** (:data:`COLORS`): bytes in use, free bytes, waste (the part of an in-use chunk
  beyond the request), the pool (bytes the allocator holds from the device), the limit, an
  out-of-memory mark, and a highlight for "pool above limit".
- **Bytes** are printed in binary units on every axis and hover (:func:`byte_ticks` for axes,
  :func:`format_bytes` for text); never plotly's SI "2.45B".
- **Fragmentation** is a percentage (:func:`format_percent`), never a 0-1 ratio.
- **Time**: one time base per figure group, so stacked plots line up. A live view measures
  seconds since its session started (:data:`TIME_TITLE`); a trace measures seconds since its
  first event, or event numbers where a trace has no times (:data:`EVENT_TITLE`).

Example
-------
>>> byte_ticks(3 << 30)[1][:3]
['0 B', '512 MiB', '1 GiB']
>>> format_percent(0.5)
'50.0 %'
"""

from __future__ import annotations

import math

from ._units import format_bytes

__all__ = [
    "COLORS",
    "FILLS",
    "EVENT_TITLE",
    "FONT",
    "TIME_TITLE",
    "byte_axis",
    "byte_ticks",
    "format_bytes",
    "format_percent",
    "format_size",
    "base_layout",
    "unit_for",
]

#: One colour per meaning. Keys are the names used in legends.
COLORS: dict[str, str] = {
    "in use": "#1f77b4",     # blue: bytes handed out
    "free": "#98c98a",       # light green: free bytes inside the pool
    "waste": "#ff7f0e",      # orange: rounding and split slack inside in-use chunks
    "pool": "#2ca02c",       # green line: bytes the allocator holds from the device
    "limit": "#d62728",      # red dashed line: the memory limit
    "oom": "#d62728",        # red marks: an allocation that failed
    "over limit": "#9467bd", # purple: the pool above a lowered limit, waiting to be returned
    "requested": "#17becf",  # cyan: bytes asked for (before rounding)
    "marker": "#7f7f7f",     # grey: cell boundaries, annotations
    "grid": "#e5e5e5",
}

#: Translucent fills matching :data:`COLORS` (area under a line, heatmap background).
FILLS: dict[str, str] = {
    "in use": "rgba(31,119,180,0.15)",
    "free": "rgba(152,201,138,0.35)",
    "over limit": "rgba(148,103,189,0.18)",
}

#: Continuous scale for the address x time heatmap: 0 = empty or free, 1 = wholly in use.
HEATMAP_SCALE: list[list] = [[0.0, "#f7fbff"], [0.35, "#9ecae1"], [0.7, "#3182bd"],
                             [1.0, "#08306b"]]

FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"

#: Axis titles for the two time bases.
TIME_TITLE = "time (s)"
EVENT_TITLE = "event"

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_size(n: float) -> str:
    """Short binary-unit label for an axis tick: ``0 B``, ``512 MiB``, ``1.5 GiB``."""
    n = float(n)
    if n == 0:
        return "0 B"
    sign = "-" if n < 0 else ""
    n = abs(n)
    i = 0
    while n >= 1024 and i < len(_UNITS) - 1:
        n /= 1024.0
        i += 1
    text = f"{n:.0f}" if abs(n - round(n)) < 1e-9 else f"{n:.3g}"
    return f"{sign}{text} {_UNITS[i]}"


def format_percent(ratio: float, digits: int = 1) -> str:
    """A 0-1 ratio as a percentage: ``0.5 -> '50.0 %'``."""
    return f"{100.0 * float(ratio):.{digits}f} %"


def byte_ticks(top: float, count: int = 6) -> tuple[list[int], list[str]]:
    """Tick values and binary-unit labels for a bytes axis from 0 to *top*.

    Steps are powers of two times 1, 2 or 4 of a binary unit, so labels read ``256 MiB``,
    ``1 GiB``... Returns ``(values, labels)`` for plotly's ``tickvals``/``ticktext``.
    """
    top = max(float(top), 1.0)
    raw = top / max(count - 1, 1)
    step = 1 << max(int(math.floor(math.log2(raw))), 0)
    if step * 2 < raw:  # pragma: no cover - floor(log2) makes this rare
        step *= 2
    values = list(range(0, int(top) + step, step))
    while len(values) > count + 2:
        step *= 2
        values = list(range(0, int(top) + step, step))
    return values, [format_size(v) for v in values]


def unit_for(top: float) -> tuple[str, float]:
    """The binary unit to scale an axis that reaches *top* bytes: ``(name, bytes per unit)``.

    Plot ``values / scale`` with ``ticksuffix=" " + name``: ticks read ``12 GiB``, never
    ``12k MiB`` or ``12.9B``.

    >>> unit_for(3 << 30)
    ('GiB', 1073741824.0)
    >>> unit_for(100)
    ('B', 1.0)
    """
    top = abs(float(top))
    i = 0
    while i + 1 < len(_UNITS) and top >= 1024.0 ** (i + 1):
        i += 1
    return _UNITS[i], float(1024 ** i)


def byte_axis(top: float, title: str = "bytes", count: int = 6) -> dict:
    """A plotly axis dict for bytes from 0 to *top*, labelled in binary units."""
    vals, text = byte_ticks(top, count)
    return {"title": {"text": title}, "tickmode": "array", "tickvals": vals, "ticktext": text,
            "range": [0, max(top, 1) * 1.05], "gridcolor": COLORS["grid"], "zeroline": False}


def base_layout(title: str = "", height: int = 300) -> dict:
    """Shared plotly layout: the title sits above the plot area, clear of the mode bar.

    The mode bar (toolbar) is drawn at the top right of the plot area; a top margin that
    leaves room for the title line keeps titles and their figures uncovered.
    """
    return {
        # at the figure's top edge, in pixels: a tall figure (a chunk map of many regions)
        # keeps it above the plot area too
        "title": {"text": title, "x": 0.0, "xanchor": "left", "yref": "container", "y": 1.0,
                  "yanchor": "top", "pad": {"t": 12}, "font": {"size": 13}},
        "height": height,
        "margin": {"l": 70, "r": 20, "t": 56, "b": 40},
        "font": {"family": FONT, "size": 11},
        "plot_bgcolor": "white",
        "paper_bgcolor": "white",
        "legend": {"orientation": "h", "y": -0.2},
        "hovermode": "closest",
    }
