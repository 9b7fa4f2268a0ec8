"""How a segment (chunk) map lays its regions out in rows, and what its hover says.

The live dashboard (``widgets/dashboard.py`` + ``static/dashboard.js``) and the static HTML
(:func:`gpudash.report.chunkmap_figure`: the report, ``explain``) draw an allocator's layout
the same way, from here:

- **One row per region, wrapped when one region dwarfs the rest.** Every row has the same
  width in bytes (:attr:`RowLayout.row_bytes`), so bars compare across rows. When the largest
  region is at most :data:`NO_WRAP_RATIO` times the typical one (the 90th percentile of the
  sizes), the row width is the largest region and nothing wraps. Otherwise (one 6 GiB
  expandable segment among 100 segments of 20-300 MiB) the row width is a power of two that
  holds every region but the outliers in one row, and an outlier continues on the next
  rows, as PyTorch's ``segsum`` prints a segment over several lines of pages: the other
  rows keep their width instead of becoming slivers next to one axis stretched to 6 GiB,
  and an area of the map is the same bytes wherever it is. The rows stay bounded (``n + max(128,
  n // 2)`` for ``n`` regions: the width doubles until they are). A scale per row was the
  other way; it would draw a 2 MiB segment as wide as a 6 GiB one, where one scale keeps an
  offset the same bytes on every row and zooming meaningful. The regions that wrap come
  after the others, so a map opens on its typical regions.
- **Rows are named by their region** (the dashboard: ``0x7f3a00000000 20.00 MiB large``, a
  continuation row ``0x7f3a00000000 +512 MiB``; the HTML: ``segment 3 @ 0x7f3a00000000``, a
  continuation row ``segment 3 @ 0x7f3a00000000 +512 MiB``: the offset it starts at):
  unique names, the categories of the y axis, so plotly thins the tick labels by the space
  per row itself (``nticks``: a category axis then labels every n-th row, never
  overlapping) and the hover says which row a block is in.
- **A bounded initial view.** A map of many rows starts on its first :func:`visible_rows`
  rows, at least :data:`ROW_PX` pixels each, in a plot of at most a fixed height; the rest is
  one drag (pan) or a double-click (all rows) away.
- **Who holds a block**: :func:`stack_text` turns a recorded call stack into a few lines, the
  user's own frames first, innermost first.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .style import format_size

__all__ = ["RowLayout", "row_layout", "row_labels", "visible_rows", "stack_text",
           "NO_WRAP_RATIO", "ROW_PX", "STACK_LINES"]

#: The largest region may be this many times the typical one (the 90th percentile of the
#: sizes) before larger regions wrap onto several rows.
NO_WRAP_RATIO = 4
#: Pixels per row a map's initial view gives each row, at least.
ROW_PX = 16
#: Frames a hover shows of a stack.
STACK_LINES = 4


@dataclass(frozen=True)
class RowLayout:
    """Where each region of a map is drawn: ``first_row[i]`` and ``rows[i]`` rows of
    ``row_bytes`` each (its last row may be shorter).

    The regions that fit a row come first, in the order given (address order), then those
    that take several rows, in the same order: a map opens on its typical regions, one row
    each, rather than on a screenful of one large region.

    Attributes
    ----------
    row_bytes : int
        The width of a row in bytes (the x axis of every row).
    first_row, rows : numpy.ndarray of int64
        Per region (in the order given): its first row and how many rows it takes.
    order : numpy.ndarray of int64
        The regions in the order of their rows.
    """

    row_bytes: int
    first_row: np.ndarray
    rows: np.ndarray
    order: np.ndarray

    @property
    def total_rows(self) -> int:
        """Rows of the whole map."""
        return int(self.rows.sum()) if len(self.rows) else 0

    @property
    def wraps(self) -> bool:
        """Whether any region takes more than one row."""
        return bool(len(self.rows) and self.rows.max() > 1)

    def region_of_row(self) -> np.ndarray:
        """The region each row belongs to (an int64 array of :attr:`total_rows`)."""
        return np.repeat(self.order, self.rows[self.order])

    def pieces(self, region: Any, offset: Any, size: Any) -> tuple[np.ndarray, ...]:
        """The pieces of chunks cut at row boundaries: ``(chunk, row, start, length)`` as
        arrays, ``start`` in bytes from the row's left edge. A chunk inside one row is one
        piece; a chunk across rows one piece per row it touches."""
        region = np.asarray(region, dtype=np.int64)
        offset = np.asarray(offset, dtype=np.int64)
        size = np.asarray(size, dtype=np.int64)
        w = self.row_bytes
        r0 = offset // w
        r1 = np.maximum(offset + size - 1, offset) // w
        count = (r1 - r0 + 1).astype(np.int64)
        chunk = np.repeat(np.arange(len(offset), dtype=np.int64), count)
        step = np.arange(len(chunk), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        r = r0[chunk] + step
        lo = np.maximum(offset[chunk], r * w)
        hi = np.minimum(offset[chunk] + size[chunk], (r + 1) * w)
        return chunk, self.first_row[region[chunk]] + r, lo - r * w, hi - lo


def _pow2_ceil(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def row_layout(sizes: Sequence[int] | np.ndarray) -> RowLayout:
    """The rows of a map whose regions have ``sizes`` bytes (see the module docstring).

    The typical size is the 90th percentile (the size below which 90 % of the regions are,
    ``method="lower"``: with a handful of regions, the largest is not typical). The row
    width is the largest size when it is at most :data:`NO_WRAP_RATIO` times the typical
    one; else the power of two at least the largest size that is (the largest region that
    is not an outlier fits one row, half of it at least), doubled while the regions would
    take more than ``n + max(128, n // 2)`` rows (a few large regions may take up to 128
    rows between them; many take at most about half a row more each). An area of the map
    is the same bytes on every row.
    """
    s = np.asarray(sizes, dtype=np.int64).reshape(-1)
    n = len(s)
    if not n:
        z = np.zeros(0, dtype=np.int64)
        return RowLayout(1, z, z, z)
    s = np.maximum(s, 1)
    big = int(s.max())
    typical = int(np.sort(s)[int(0.9 * (n - 1))])
    if big <= NO_WRAP_RATIO * typical:
        w = big
    else:   # a row for the largest region that is not an outlier
        w = _pow2_ceil(int(s[s <= NO_WRAP_RATIO * typical].max()))
        bound = n + max(128, n // 2)
        while int((-(-s // w)).sum()) > bound:
            w *= 2
    rows = (-(-s // w)).astype(np.int64)
    order = np.concatenate([np.flatnonzero(rows == 1), np.flatnonzero(rows > 1)])
    first = np.empty(n, dtype=np.int64)
    first[order] = np.concatenate(([0], np.cumsum(rows[order])[:-1]))
    return RowLayout(int(w), first, rows, order.astype(np.int64))


def row_labels(layout: RowLayout, names: Sequence[str]) -> list[str]:
    """A unique name per row, from one per region: the region's own on its first row,
    ``"<name> +512 MiB"`` (the offset the row starts at) on the rows it continues on."""
    out: list[str] = []
    w = layout.row_bytes
    for i in layout.order.tolist():
        out.append(names[i])
        out.extend(f"{names[i]} +{format_size(j * w)}" for j in range(1, int(layout.rows[i])))
    return out


def visible_rows(total: int, plot_px: int, row_px: int = ROW_PX) -> int:
    """How many rows a plot area of ``plot_px`` pixels shows at first (all when they fit)."""
    return max(1, min(int(total), int(plot_px) // max(int(row_px), 1)))


# ----------------------------------------------------------------------------- stacks
#: Library frames: installed packages, PyTorch itself, the standard library, C++ frames.
_LIBRARY = re.compile(r"(site-packages|dist-packages|[/\\]torch[/\\]|[/\\]lib[/\\]python\d"
                      r"|[/\\]Lib[/\\]|^<)")


def _is_user(filename: str) -> bool:
    return filename.endswith(".py") and not _LIBRARY.search(filename)


def _short(filename: str) -> str:
    """The last two parts of a path (``train/model.py``)."""
    parts = re.split(r"[/\\]", filename)
    return "/".join(parts[-2:]) if len(parts) > 1 else filename


def stack_text(frames: Sequence[Any], limit: int = STACK_LINES) -> list[str]:
    """A few lines of a call stack (frames innermost first, each with ``filename``,
    ``line``, ``name``): the user's own frames (a ``.py`` file outside installed packages,
    PyTorch and the standard library) innermost first; where there are none, the Python
    frames, else the first frames as they are. A last line says how many were left out."""
    frames = list(frames)
    user = [f for f in frames if _is_user(str(f.filename))]
    pick = user or [f for f in frames if str(f.filename).endswith(".py")] or frames
    lines = [f"{_short(str(f.filename))}:{f.line} {f.name}" if f.line else
             f"{_short(str(f.filename))} {f.name}" for f in pick[:limit]]
    rest = len(frames) - len(lines)
    if rest > 0:
        lines.append(f"(+{rest} more frame{'s' if rest > 1 else ''})")
    return lines

