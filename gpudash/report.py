"""The HTML report: one self-contained file that opens offline in a browser.

It replays a trace through its allocator's model on a simulated device (TensorFlow's BFC,
or PyTorch's caching allocator for a PyTorch trace) and shows the memory timeline (in use,
pool, limit, out-of-memory marks, setting changes), the fragmentation heatmap (address x
time), bin (pool) occupancy and the chunk (segment) map at the peak, and a what-if table of
fractions, in the framework's words; the fragmentation figure is the model's
(:meth:`gpudash.models.AllocatorModel.fragmentation`). plotly's JavaScript is embedded once,
inline, so the file needs no network.

The chunk map stays bounded whatever the number of regions (:func:`chunkmap_figure`: at most
:data:`CHUNKMAP_MAX_HEIGHT` pixels, the first rows in view and the rest a pan away, a bar
budget when downsampled), and its hover names who holds each block where the trace says
(:func:`chunk_holders`: the holder, the top frames of the allocating stack).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np

from . import style
from ._errors import GpudashError
from ._units import format_bytes
from ._version import __version__

__all__ = ["build_report", "write_report", "timeline_figure", "heatmap_figure",
           "bins_figure", "chunkmap_figure", "chunk_holders", "stack_icicle_figure"]

_C = style.COLORS


def _go():
    import plotly.graph_objects as go

    return go


def _layout(fig: Any, title: str, height: int, **axes: Any) -> None:
    """The shared layout (style.base_layout: the title clear of the mode bar)."""
    fig.update_layout(**style.base_layout(title, height))
    fig.update_layout(**axes)


def timeline_figure(per_call: dict, *, limit: int, ooms: np.ndarray | None = None,
                    settings: list[dict] | None = None, x: np.ndarray | None = None,
                    x_title: str = "call", max_points: int = 4000,
                    names: tuple[str, str] = ("pool", "in use")) -> Any:
    """Bytes in use and pool bytes over the calls, the limit, OOMs and setting changes
    (``names``: what the two lines are called; PyTorch's are reserved and allocated)."""
    go = _go()
    in_use = np.asarray(per_call.get("in_use", []), dtype=np.int64)
    pool = np.asarray(per_call.get("pool", []), dtype=np.int64)
    n = len(in_use)
    xs = np.arange(n) if x is None else np.asarray(x)
    if n > max_points:  # max-box downsampling keeps every peak
        step = int(np.ceil(n / max_points))
        cut = (n // step) * step
        idx = np.arange(0, cut, step)
        xs_d = xs[idx]
        in_use_d = in_use[:cut].reshape(-1, step).max(axis=1)
        pool_d = pool[:cut].reshape(-1, step).max(axis=1)
    else:
        xs_d, in_use_d, pool_d = xs, in_use, pool
    top = max(int(pool.max()) if n else 0, int(in_use.max()) if n else 0, int(limit), 1)
    unit, scale = style.unit_for(top)
    hover = f"%{{y:.2f}} {unit}<extra>%{{fullData.name}}</extra>"
    fig = go.Figure()
    fig.add_scatter(x=xs_d, y=pool_d / scale, name=names[0], mode="lines",
                    line={"color": _C["pool"], "shape": "hv"}, hovertemplate=hover)
    fig.add_scatter(x=xs_d, y=in_use_d / scale, name=names[1], mode="lines", fill="tozeroy",
                    fillcolor=style.FILLS["in use"], hovertemplate=hover,
                    line={"color": _C["in use"], "shape": "hv"})
    if n:
        fig.add_scatter(x=[xs[0], xs[-1]], y=[limit / scale, limit / scale], name="limit",
                        mode="lines", line={"color": _C["limit"], "dash": "dash"},
                        hovertemplate=hover)
    if ooms is not None and len(ooms):
        ooms = np.asarray(ooms)
        ooms = ooms[ooms < n]
        fig.add_scatter(x=xs[ooms], y=in_use[ooms] / scale, name="out of memory",
                        mode="markers", marker={"symbol": "x", "size": 10, "color": _C["oom"]},
                        hovertemplate=hover)
    for s in settings or []:
        at = s.get("x")
        if at is None:
            continue
        fig.add_vline(x=at, line={"dash": "dot", "color": _C["marker"]},
                      annotation_text=f"{s['setting']} {s['old']}\u2192{s['new']}",
                      annotation_position="top left")
    _layout(fig, "Memory timeline", 360, legend={"orientation": "h"},
            xaxis={"title": {"text": x_title}, "gridcolor": _C["grid"]},
            yaxis={"title": {"text": "bytes"}, "ticksuffix": " " + unit,
                   "rangemode": "tozero", "gridcolor": _C["grid"]})
    return fig


def calls_at_events(recording: Any, event_edges: Any) -> np.ndarray:
    """Event indices of a replay's recording as call numbers (allocations, frees and
    refusals: the timeline's x), so a heatmap over events lines up with the timeline."""
    kinds = np.asarray(recording.columns["kind"])
    calls_before = np.concatenate([[0], np.cumsum(np.isin(kinds, (1, 2, 7)))])
    return np.interp(np.asarray(event_edges, dtype=np.float64),
                     np.arange(len(calls_before)), calls_before)


def heatmap_figure(values: np.ndarray, row_edges: np.ndarray, col_edges: np.ndarray,
                   *, x_title: str = "event") -> Any:
    """Address (rows) x time (columns); each cell the share of its bytes in use, in %."""
    go = _go()
    rows = np.asarray(row_edges, dtype=np.float64)
    unit, scale = style.unit_for(rows[-1] if len(rows) else 1)
    # whole percents, one byte a cell (the hover shows no decimals): a 256 x 600 map is
    # 0.2 MB in the page instead of 1.6 MB of float64
    pct = np.rint(np.clip(np.asarray(values, dtype=np.float64), 0.0, 1.0) * 100.0)
    fig = go.Figure(go.Heatmap(
        z=pct.astype(np.uint8), x=np.asarray(col_edges),
        y=rows / scale, zmin=0, zmax=100, colorscale=style.HEATMAP_SCALE,
        colorbar={"title": {"text": "% in use"}},
        hovertemplate=f"offset %{{y:.2f}} {unit}<br>%{{x}}<br>%{{z:.0f}} % in use"
                      "<extra></extra>"))
    _layout(fig, "Fragmentation heatmap (address \u00d7 time)", 420,
            xaxis={"title": {"text": x_title}},
            yaxis={"title": {"text": "offset in the pool"}, "ticksuffix": " " + unit})
    return fig


def _model(dump: Any) -> Any:
    """The allocator model of a dump (:func:`gpudash.models.model_of_dump`)."""
    from .models import model_of_dump

    return model_of_dump(dump)


def bins_figure(dump: Any) -> Any:
    """Free chunks and bytes per bin, and bytes in use by bin (for PyTorch's allocator: per
    pool, small and large)."""
    go = _go()
    model = _model(dump)
    w = model.words()
    if model.layout == "pools":
        labels = model.bin_labels()[:len(dump.bins)]
    else:
        labels = [format_bytes(b.bin_size).replace(".00", "") for b in dump.bins]
        labels[-1] += "+"
    free = np.array([b.free_bytes for b in dump.bins], dtype=np.float64)
    used = np.array([b.total_bytes_in_use for b in dump.bins], dtype=np.float64)
    unit, scale = style.unit_for(max(float(free.max(initial=0)), float(used.max(initial=0)), 1))
    fig = go.Figure()
    fig.add_bar(x=labels, y=used / scale, name=w["in_use"], marker_color=_C["in use"],
                hovertemplate=f"{w['bin']} %{{x}}<br>{w['in_use']} %{{y:.2f}} {unit}"
                              "<extra></extra>")
    fig.add_bar(x=labels, y=free / scale, name="free", marker_color=_C["free"],
                customdata=[b.free_chunks for b in dump.bins],
                hovertemplate=f"{w['bin']} %{{x}}<br>free %{{y:.2f}} {unit} in "
                              f"%{{customdata}} {w['chunk']}(s)<extra></extra>")
    _layout(fig, "Pool occupancy" if model.layout == "pools" else "Bin occupancy", 340,
            barmode="group", xaxis={"title": {"text": w["bins_axis"]}, "type": "category"},
            yaxis={"title": {"text": "bytes"}, "ticksuffix": " " + unit,
                   "gridcolor": _C["grid"]})
    return fig


#: A chunk map's legend: above its plot area, at the left, under the title (the mode bar
#: takes the top right corner when the mouse is over the figure).
_TOP_LEGEND = {"orientation": "h", "x": 0.0, "xanchor": "left", "y": 1.0, "yanchor": "bottom"}

#: Chunks a chunk map draws one bar each; a dump with more is drawn downsampled.
CHUNKMAP_MAX_CHUNKS = 5000
#: Columns (pixels) across all the rows of a downsampled chunk map, and per row at most.
CHUNKMAP_COLUMNS_TOTAL = 60_000
CHUNKMAP_COLUMNS = 1500
#: Bars a downsampled chunk map draws at most (columns per row are halved until it fits).
CHUNKMAP_MAX_BARS = 12_000
#: Rows a chunk map draws at most; the regions after them are counted in its subtitle.
CHUNKMAP_MAX_ROWS = 2000
#: The tallest a chunk map figure gets (pixels); more rows are reached by panning.
CHUNKMAP_MAX_HEIGHT = 760
_MAP_MARGIN = {"l": 190, "r": 20, "t": 84, "b": 44}


def _map_arrays(dump: Any) -> dict[str, np.ndarray]:
    """A dump's regions and chunks as numpy columns (chunks outside every region dropped)."""
    chunks = dump.chunks
    n = len(chunks)
    starts = np.array([r.ptr for r in dump.regions], dtype=np.int64)
    sizes = np.array([r.size for r in dump.regions], dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    starts, sizes = starts[order], sizes[order]
    address = np.fromiter((c.address for c in chunks), dtype=np.int64, count=n)
    size = np.fromiter((c.size for c in chunks), dtype=np.int64, count=n)
    in_use = np.fromiter((c.in_use for c in chunks), dtype=bool, count=n)
    req = np.fromiter((c.requested_size for c in chunks), dtype=np.int64, count=n)
    index = np.arange(n, dtype=np.int64)
    row = np.searchsorted(starts, address, side="right") - 1
    safe = np.maximum(row, 0)
    keep = (row >= 0) & (address < starts[safe] + sizes[safe]) if len(starts) else \
        np.zeros(n, dtype=bool)
    return {"starts": starts, "sizes": sizes, "order": order, "region": row[keep],
            "address": address[keep], "size": size[keep], "in_use": in_use[keep],
            "req": req[keep], "index": index[keep]}


def _frame_text(lines: Any) -> str:
    """Holder lines (a label, stack frames) for a hover: escaped, one per line."""
    if not lines:
        return ""
    if isinstance(lines, str):
        lines = lines.splitlines()
    return "<br>held by:<br>&nbsp;&nbsp;" + "<br>&nbsp;&nbsp;".join(
        html.escape(str(x)) for x in lines)


def chunkmap_figure(dump: Any, *, title: str = "Chunk map",
                    max_chunks: int = CHUNKMAP_MAX_CHUNKS,
                    holders: dict[int, Any] | None = None) -> Any:
    """Every region as a bar of its chunks: in use, rounding waste, free.

    Regions are rows laid out by :func:`gpudash.maplayout.row_layout`: one row each, and a
    region much larger than the rest continues on the next rows, so it does not shrink the
    others to slivers. The figure is at most :data:`CHUNKMAP_MAX_HEIGHT` pixels tall
    whatever the region count: it opens on the first rows that fit
    (:data:`gpudash.maplayout.ROW_PX` pixels each) and the rest is a drag (pan) or a
    double-click (every row) away; the row names are the y axis' categories, whose labels
    plotly thins by the space per row, and each hover names its row. At most
    :data:`CHUNKMAP_MAX_ROWS` rows are drawn (the subtitle counts the regions after them).

    Up to ``max_chunks`` chunks each chunk is a bar with its own hover text: address,
    size, requested, and who holds it (``holders``: address -> lines, a label or the top
    frames of its stack; else the chunk's own ``holder``). A larger dump is rasterised as the
    heatmap is (:func:`gpudash.analysis._coverage`, exact shares per cell): each row is cut
    into up to :data:`CHUNKMAP_COLUMNS` columns (fewer while the bars would exceed
    :data:`CHUNKMAP_MAX_BARS`), each column takes the colour of what covers most of it, and
    runs of one colour are one bar whose hover gives its shares, its chunk count and who
    holds the largest chunk in use that begins in it.
    """
    from .maplayout import row_labels, row_layout, visible_rows

    go = _go()
    model = _model(dump)
    w = model.words()
    a = _map_arrays(dump)
    layout = row_layout(a["sizes"])
    names = [f"{w['region']} {i} @ {p:#x}" for i, p in zip(a["order"].tolist(),
                                                           a["starts"].tolist())]
    labels = row_labels(layout, names)
    n_regions = len(names)
    # at most CHUNKMAP_MAX_ROWS rows: whole regions, in the layout's order
    drawn = layout.first_row + layout.rows <= CHUNKMAP_MAX_ROWS
    if n_regions and not drawn.any():
        drawn[layout.order[0]] = True
    n_rows = int((layout.first_row + layout.rows)[drawn].max()) if n_regions else 0
    shown = int(drawn.sum())
    labels = labels[:n_rows]
    pick = drawn[a["region"]] if n_regions else np.zeros(0, dtype=bool)
    a = {k: (v[pick] if k in ("region", "address", "size", "in_use", "req", "index") else v)
         for k, v in a.items()}
    holder_of = _holder_lines(dump, a["index"], holders)
    unit, scale = style.unit_for(layout.row_bytes)
    if len(dump.chunks) > max_chunks:
        cats, sub = _downsampled_bars(a, layout, n_rows, labels, holder_of, w, scale)
    else:
        cats, sub = _chunk_bars(dump, a, layout, labels, holder_of, w, scale, model)
    fig = go.Figure()
    for key, d in cats.items():
        fig.add_bar(y=d["y"], x=d["x"], base=d["base"], orientation="h",
                    name=w["in_use"] if key == "in use" else key,
                    marker={"color": _C[key], "line": {"width": 0}},
                    hovertext=d["text"], hoverinfo="text")
    height = int(min(CHUNKMAP_MAX_HEIGHT,
                     max(240, _MAP_MARGIN["t"] + _MAP_MARGIN["b"] + 22 * max(n_rows, 1))))
    plot_px = height - _MAP_MARGIN["t"] - _MAP_MARGIN["b"]
    first = visible_rows(n_rows, plot_px)
    notes = [sub] if sub else []
    if layout.wraps:
        notes.append(f"rows of {style.format_size(layout.row_bytes)}: a larger {w['region']} "
                     "continues on the next rows, after the others")
    if first < n_rows:
        notes.append(f"rows 1-{first} of {n_rows:,} shown: drag to pan, double-click for all")
    if shown < n_regions:
        rest = int(a["sizes"][~drawn].sum())
        notes.append(f"the first {n_rows:,} rows drawn; {n_regions - shown:,} "
                     f"{w['regions']} after them ({format_bytes(rest)}) are not")
    if notes:
        title = f"{title}<br><sup>{html.escape('; '.join(notes))}</sup>"
    _layout(fig, title, height, barmode="overlay", dragmode="pan" if first < n_rows else "zoom",
            xaxis={"title": {"text": f"offset in {w['region']}"}, "ticksuffix": " " + unit,
                   "range": [0, layout.row_bytes / scale], "gridcolor": _C["grid"]},
            yaxis={"type": "category", "categoryorder": "array", "categoryarray": labels,
                   "range": [first - 0.5, -0.5], "automargin": True,
                   "nticks": max(2, plot_px // 16), "tickfont": {"size": 10}},
            margin=dict(_MAP_MARGIN), legend=_TOP_LEGEND)
    return fig


def _holder_lines(dump: Any, index: np.ndarray, holders: dict[int, Any] | None) -> list:
    """Who holds each chunk of ``index`` (positions in ``dump.chunks``): lines from
    ``holders`` (by address) or the chunk's own ``holder``; None where nobody is named."""
    chunks = dump.chunks
    out: list = []
    for i in index.tolist():
        c = chunks[i]
        lines = holders.get(c.address) if holders else None
        if not lines and getattr(c, "holder", ""):
            lines = [str(c.holder)]
        out.append(lines or None)
    return out


def _chunk_bars(dump: Any, a: dict, layout: Any, labels: list[str], holder_of: list,
                w: dict, scale: float, model: Any) -> tuple[dict, str]:
    """One bar per chunk (a piece per row it touches)."""
    chunks = dump.chunks
    pool_names = model.bin_labels() if model.layout == "pools" else None
    off = a["address"] - a["starts"][a["region"]]
    size, in_use, req = a["size"], a["in_use"], a["req"]
    # requested 0: not known (a dump read from a log): the whole chunk shows in use
    used = np.where(in_use, np.where(req > 0, np.minimum(req, size), size), 0)
    texts: list[str] = []
    waste_texts: list[str] = []
    for k, i in enumerate(a["index"].tolist()):
        c = chunks[i]
        head = f"{labels[int(layout.first_row[a['region'][k]])]}<br>{c.address:#x}"
        if c.in_use:
            texts.append(f"{head}<br>size {format_bytes(c.size)}<br>requested "
                         f"{format_bytes(c.requested_size) if c.requested_size > 0 else 'unknown'}"
                         f"<br>allocation {c.allocation_id}{_frame_text(holder_of[k])}")
            waste_texts.append(f"{head}<br>waste {format_bytes(int(size[k] - used[k]))} of "
                               f"a {format_bytes(c.size)} {w['chunk']}")
        else:
            where = (pool_names[c.bin] if pool_names and 0 <= c.bin < len(pool_names)
                     else f"{w['bin']} {c.bin}")
            texts.append(f"{head}<br>free {format_bytes(c.size)}<br>{where}")
            waste_texts.append("")
    texts_a = np.array(texts, dtype=object)
    waste_a = np.array(waste_texts, dtype=object)
    lab = np.array(labels, dtype=object)
    cats: dict[str, dict[str, list]] = {}
    for key, mask, start, length, text in (
            ("in use", in_use, off, used, texts_a),
            ("waste", in_use & (size > used), off + used, size - used, waste_a),
            ("free", ~in_use, off, size, texts_a)):
        idx = np.flatnonzero(mask & (length > 0))
        ch, row, lo, ln = layout.pieces(a["region"][idx], start[idx], length[idx])
        cats[key] = {"y": lab[row].tolist(), "base": (lo / scale).tolist(),
                     "x": (ln / scale).tolist(), "text": text[idx[ch]].tolist()}
    return cats, ""


def _downsampled_bars(a: dict, layout: Any, n_rows: int, labels: list[str], holder_of: list,
                      w: dict, scale: float) -> tuple[dict, str]:
    """Runs of columns, not chunks (see :func:`chunkmap_figure`)."""
    from .analysis import _coverage

    n = len(a["address"])
    off = a["address"] - a["starts"][a["region"]]
    size, in_use, req = a["size"], a["in_use"], a["req"]
    used = np.where(in_use, np.where(req > 0, np.minimum(req, size), size), 0)
    W = layout.row_bytes
    # the part of each row a region covers (its last row may be short)
    row_region = layout.region_of_row()[:n_rows]
    row_end = np.minimum(a["sizes"][row_region] - (np.arange(n_rows) -
                                                    layout.first_row[row_region]) * W, W)
    keys = ("in use", "waste", "free")
    pieces = {}
    for key, mask, start, length in (("in use", in_use, off, used),
                                     ("waste", in_use, off + used, size - used),
                                     ("free", ~in_use, off, size)):
        idx = np.flatnonzero(mask & (length > 0))
        pieces[key] = (idx,) + layout.pieces(a["region"][idx], start[idx], length[idx])
    # where each chunk begins: its row and offset in that row
    first_row = layout.first_row[a["region"]] + off // W
    first_off = off % W
    cols = max(16, min(CHUNKMAP_COLUMNS, CHUNKMAP_COLUMNS_TOTAL // max(n_rows, 1)))
    while True:
        col_bytes = W / cols
        shares = []
        for key in keys:
            idx, ch, row, lo, ln = pieces[key]
            y0 = row.astype(np.float64)
            shares.append(_coverage(y0, y0 + 1.0, lo / col_bytes, (lo + ln) / col_bytes,
                                    n_rows, cols))
        stack = np.stack(shares)                        # 3 x rows x cols
        colour = np.argmax(stack, axis=0)
        colour[stack.sum(axis=0) <= 1e-12] = -1         # past a region's end: nothing drawn
        change = np.diff(colour, axis=1) != 0
        runs = int(change.sum()) + n_rows
        if runs <= CHUNKMAP_MAX_BARS or cols <= 4:
            break
        cols = max(4, cols // 2)
    first_col = np.minimum((first_off / col_bytes).astype(np.int64), cols - 1)
    key_of = first_row * cols + first_col
    starts_in = np.bincount(key_of, minlength=n_rows * cols).reshape(n_rows, cols)
    # the largest chunk in use beginning in each cell: who holds it, for the hover
    named = np.flatnonzero(in_use & np.array([h is not None for h in holder_of], dtype=bool))
    named = named[np.lexsort((-size[named], key_of[named]))]
    named_keys = key_of[named]
    cats: dict[str, dict[str, list]] = {k: {"y": [], "base": [], "x": [], "text": []}
                                        for k in keys}
    for r in range(n_rows):
        c = colour[r]
        edges = np.concatenate([[0], np.flatnonzero(np.diff(c)) + 1, [cols]])
        counts = np.concatenate([[0], np.cumsum(starts_in[r])])
        for lo_c, hi_c in zip(edges[:-1].tolist(), edges[1:].tolist()):
            kind = int(c[lo_c])
            if kind < 0:
                continue
            d = cats[keys[kind]]
            u, wst, f = (float(stack[k, r, lo_c:hi_c].sum()) / (hi_c - lo_c) for k in range(3))
            lo = int(round(lo_c * col_bytes))
            hi = min(int(round(hi_c * col_bytes)), int(row_end[r]))
            if hi <= lo:
                continue
            base = int(a["starts"][row_region[r]]) + (r - int(layout.first_row[row_region[r]])) * W
            text = (f"{labels[r]}<br>{base + lo:#x} to {base + hi:#x} ({format_bytes(hi - lo)})"
                    f"<br>{u:.0%} {w['in_use']}, {wst:.0%} waste, {f:.0%} free<br>"
                    f"{int(counts[hi_c] - counts[lo_c]):,} {w['chunk']}(s) begin here")
            i0, i1 = np.searchsorted(named_keys, [r * cols + lo_c, r * cols + hi_c])
            if i1 > i0:
                best = named[i0 + int(np.argmax(size[named[i0:i1]]))]
                text += (f"<br>the largest {w['in_use']}, {format_bytes(int(size[best]))}"
                         + _frame_text(holder_of[best]))
            d["y"].append(labels[r])
            d["base"].append(lo / scale)
            d["x"].append((hi - lo) / scale)
            d["text"].append(text)
    sub = (f"{n:,} {w['chunk']}s drawn as {cols:,} columns per row: each column in the "
           "colour of what covers most of it")
    return cats, sub


def _map_title(dump: Any, when: str) -> str:
    """``Segment map at the peak (1.20 GiB allocated; reserved but unallocated 300.00 MiB
    (20.0 % of reserved))``: the map's name, the bytes in use and the model's fragmentation
    figure, in the framework's words."""
    model = _model(dump)
    w = model.words()
    st = dump.stats
    frag = model.fragmentation(int(st.bytes_in_use), int(st.pool_bytes),
                               int(st.largest_free_block_bytes))
    return (f"{w['map'][0].upper()}{w['map'][1:]} {when} ({format_bytes(st.bytes_in_use)} "
            f"{w['in_use']}; {frag.label} {frag.text})")


def chunk_holders(trace: Any, dump: Any, *, device: int | None = None,
                  replayed: Any = None, before_row: int | None = None) -> dict[int, list[str]]:
    """Who holds each chunk in use of ``dump``, from the trace's holders and stacks:
    ``{address: lines}``, the holder's name (an op, a label) then the top frames of the
    allocating call's stack (:func:`gpudash.maplayout.stack_text`, the user's own frames
    first, innermost first).

    Parameters
    ----------
    trace : Trace
        The trace whose holders and stacks name the allocations.
    dump : MemoryDump
        A state of ``trace`` (:func:`gpudash.analysis.state_at`: its ``seq`` says when), or
        of ``replayed``.
    device : int, optional
        The device the dump is of (default: the trace's first).
    replayed : Trace, optional
        The recording of a replay of ``trace`` the dump comes from: its allocation calls are
        the trace's, in the same order, so its n-th allocation is named by the trace's n-th.
    before_row : int, optional
        Instead of the dump's ``seq``: the state is the one before this row of ``trace``
        (``explain``'s state at an out-of-memory row).

    Returns
    -------
    dict
        Empty when the trace names no holder and records no stack. A chunk whose address
        matches no allocation live at that moment (a replay that placed it elsewhere) is
        left out: its hover names nobody rather than the wrong one.
    """
    holder = getattr(trace, "holder", None)
    stack = trace.stack_ids() if hasattr(trace, "stack_ids") else None
    has_holder = holder is not None and len(holder) and bool((np.asarray(holder) >= 0).any())
    has_stack = stack is not None and len(stack) and bool((stack >= 0).any())
    if not (has_holder or has_stack):
        return {}
    from .maplayout import stack_text

    src = trace if replayed is None else replayed
    c = src.columns
    dev = int(device) if device is not None else (int(c["device"][0]) if len(c["device"]) else 0)
    if before_row is not None and replayed is None:
        mask = np.arange(len(c["seq"])) < int(before_row)
    else:
        mask = c["seq"] < int(dump.seq)
    mask &= c["device"] == dev
    rows = np.flatnonzero(mask)
    kind = c["kind"][rows]
    allocs = rows[kind == 1]
    freed = c["alloc_id"][rows[(kind == 2)]]
    live = allocs[~np.isin(c["alloc_id"][allocs], freed[freed > 0])]
    if replayed is not None:   # the replay's n-th allocation call is the trace's n-th
        def alloc_calls(t: Any) -> np.ndarray:
            k = t.columns["kind"]
            return np.flatnonzero(((k == 1) | (k == 7)) & (t.columns["device"] == dev))
        ours, theirs = alloc_calls(src), alloc_calls(trace)
        j = np.searchsorted(ours, live)
        ok = (j < len(theirs)) & (j < len(ours))
        ok[ok] &= ours[j[ok]] == live[ok]
        live, target = live[ok], theirs[j[ok]]
    else:
        target = live
    wanted = {ch.address for ch in dump.chunks if ch.in_use}
    ptrs = c["ptr"][live].tolist()
    cache: dict[tuple[int, int], list[str]] = {}
    out: dict[int, list[str]] = {}
    for p, t in zip(ptrs, target.tolist()):
        if p not in wanted:
            continue
        h = int(holder[t]) if has_holder else -1
        sid = int(stack[t]) if has_stack else -1
        if h < 0 and sid < 0:
            continue
        lines = cache.get((h, sid))
        if lines is None:
            lines = ([trace.holders[h]] if h >= 0 else []) + \
                (stack_text(trace.stacks.frames_of(sid)) if sid >= 0 else [])
            cache[(h, sid)] = lines
        out[p] = lines
    return out


def _settings_marks(trace: Any, n_calls: int) -> list[dict]:
    """Setting changes of the trace, placed at the call index they happened before."""
    settings = getattr(trace, "settings", None) or []
    if not settings or n_calls == 0:
        return []
    kind = np.asarray(trace.columns["kind"])
    seq = np.asarray(trace.columns["seq"])
    is_call = np.isin(kind, (1, 2, 7))
    call_index = np.cumsum(is_call)  # calls made up to and including each row
    out = []
    for s in settings:
        rows = np.flatnonzero(seq == s["seq"])
        if len(rows) == 0 or s["setting"] == "memory_limit":
            continue
        out.append({**s, "x": int(call_index[rows[0]])})
    return out


def build_report(trace: Any, *, title: str = "gpudash report", device_bytes: int | None = None,
                 replay_options: dict | None = None, sweep_table: Any = None,
                 fractions: tuple = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0)) -> str:
    """The report as an HTML string (see the module docstring)."""
    from .analysis import chunk_map_at_peak, heatmap
    from .events import EventKind
    from .models import model_for
    from .trace.replay import replay
    from .trace.whatif import sweep

    opts = {k: v for k, v in (replay_options or {}).items() if v is not None}
    if device_bytes is not None:
        opts["device_bytes"] = device_bytes
    result = replay(trace, record=True, per_call=True, **opts)
    if result.calls == 0:
        raise GpudashError("the trace has no events for this device: nothing to report")
    model = model_for(result.allocator)
    device_bytes = result.options["device_bytes"]
    recording = result.recording
    sections: list[tuple[str, Any]] = []
    sections.append(("timeline", timeline_figure(
        result.per_call, limit=result.memory_limit, ooms=result.ooms,
        settings=_settings_marks(trace, result.calls),
        names=(model.pool, model.in_use))))
    served = bool(np.any(np.asarray(recording.columns["kind"]) == int(EventKind.ALLOC)))
    if served:   # the state views need memory that was allocated at some point
        hm = heatmap(recording, rows=256, cols=min(600, max(1, len(recording))))
        edges = calls_at_events(recording, hm.col_edges)  # one time base with the timeline
        sections.append(("heatmap", heatmap_figure(hm.values, hm.row_edges, edges,
                                                   x_title="call")))
        same = model.peak_options(result)
        if same is not None:   # the model's own layout, from the trace's calls
            peak = chunk_map_at_peak(trace, options=same, device=same.get("device"))
            holders = chunk_holders(trace, peak, device=same.get("device"))
        else:
            peak = chunk_map_at_peak(recording)
            holders = chunk_holders(trace, peak, device=result.options.get("device"),
                                    replayed=recording)
        sections.append(("bins", bins_figure(peak)))
        sections.append(("chunkmap", chunkmap_figure(peak, title=_map_title(peak, "at the peak"),
                                                     holders=holders)))
    if sweep_table is None:
        sweep_table = sweep(trace, fractions=fractions, device_bytes=device_bytes, jobs=1,
                            **model.report_sweep(opts, result))

    parts = []
    for i, (name, fig) in enumerate(sections):
        div = fig.to_html(full_html=False, include_plotlyjs=(i == 0),
                          div_id=f"gpudash-{name}", config={"displaylogo": False})
        parts.append(f'<section class="plot" data-plot="{name}">{div}</section>')
    verdict = ("fits: no allocation ran out of memory" if result.fits else
               f"OUT OF MEMORY: {result.oom_count} allocation(s) refused, the first at call "
               f"{result.first_oom[0]} ({format_bytes(result.first_oom[1])})")
    summary = model.report_summary(result, device_bytes, verdict)
    summary.extend(("assumed", a) for a in result.assumed)
    changed = _settings_marks(trace, result.calls)
    if changed:   # a live session's recording: configure() ran while it recorded
        summary.append(("settings changed live", "; ".join(
            f"{m['setting']} {m['old']}→{m['new']} at call {m['x']}" for m in changed[:8])
            + ("; ..." if len(changed) > 8 else "")
            + ": the replay runs the settings in force when the recording began throughout"))
    if not served:
        summary.append(("state views", "none: no allocation was served in this replay, so "
                                       "there is no heatmap, chunk map or bins to draw"))
    summary.extend(("warning", w) for w in result.warnings)
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in summary)
    holders_html = _holders_section(trace, opts.get("device"))
    source = html.escape(str(trace.meta.get("source", "")))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 8px 0 16px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: left; }}
th {{ background: #f4f4f4; }}
section.plot {{ margin: 12px 0; }}
.oom {{ color: #b00; font-weight: bold; }}
</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>gpudash {__version__} &middot; trace source: {source} &middot; {len(trace):,} events</p>
<table id="summary">{rows}</table>
{''.join(parts)}
{holders_html}
<h2>What if: other fractions</h2>
<div id="whatif">{sweep_table.to_html()}</div>
</body></html>
"""


def _holders_section(trace: Any, device: Any) -> str:
    """"Who holds memory at the peak": bytes by the line of the user's code that allocated
    them when the trace recorded call stacks (the top :data:`HOLDER_ROWS` rows, each with
    its stack in a ``<details>``; at the out-of-memory error too when there is one; and an
    icicle of the stacks at the peak), else by holder (op, label) when the trace names
    holders; empty otherwise."""
    from .events import EventKind
    from .trace.holders import top_holders

    stack = getattr(trace, "stack", None)
    if stack is not None and len(stack) and (np.asarray(stack) >= 0).any():
        parts = []
        peak = top_holders(trace, at="peak", by="line", device=device, limit=HOLDER_ROWS)
        parts.append(f"<h2>Who holds memory at the peak</h2>{_holder_table(peak, 'holders')}")
        kind = np.asarray(trace.columns["kind"])
        oom = kind == int(EventKind.OOM)
        if device is not None:
            oom &= np.asarray(trace.columns["device"]) == device
        if oom.any():
            at_oom = top_holders(trace, at="oom", by="line", device=device, limit=HOLDER_ROWS)
            parts.append("<h2>Who held memory at the out-of-memory error</h2>"
                         f"{_holder_table(at_oom, 'holders-oom')}")
        fig = stack_icicle_figure(trace, at="peak", device=device)
        div = fig.to_html(full_html=False, include_plotlyjs=False, div_id="gpudash-icicle",
                          config={"displaylogo": False})
        parts.append(f'<section class="plot" data-plot="icicle">{div}</section>')
        return "\n".join(parts)
    holder = getattr(trace, "holder", None)
    if holder is None or not len(holder) or not (np.asarray(holder) >= 0).any():
        return ""
    top = top_holders(trace, at="peak", by="holder", device=device, limit=15)
    if not top:
        return ""
    body = "".join(
        f"<tr><td>{html.escape(h.holder)}</td><td>{html.escape(format_bytes(h.bytes))}</td>"
        f"<td>{h.allocations:,}</td></tr>" for h in top)
    return ('<h2>Who holds memory at the peak</h2><table id="holders"><tr><th>holder</th>'
            f"<th>bytes in use</th><th>allocations</th></tr>{body}</table>")


#: Rows of a holders table in the report; frames of a stack shown under a row.
HOLDER_ROWS = 20
STACK_LINES = 40


def _holder_table(table: Any, table_id: str) -> str:
    """A holders table: each row's stack on demand (``<details>``), and what it rests on."""
    from .trace.callers import stack_lines

    body = []
    for r in table:
        stack = stack_lines(list(r.frames), table.rule_test, STACK_LINES, full=True)
        cell = html.escape(r.holder)
        if stack:
            more = (f" ({len(r.stack_ids)} distinct stacks; the largest block's shown)"
                    if len(r.stack_ids) > 1 else "")
            cell = (f"<details><summary>{cell}</summary><pre>"
                    f"{html.escape(chr(10).join(stack))}</pre>{html.escape(more)}</details>")
        body.append(f"<tr><td>{cell}</td><td>{html.escape(format_bytes(r.bytes))}</td>"
                    f"<td>{r.allocations:,}</td></tr>")
    notes = [table.header()]
    if table.left_out[0]:
        notes.append(f"{table.left_out[0]:,} more row(s), {format_bytes(table.left_out[1])}, "
                     "not shown")
    notes += ([table.rule] if table.rule else []) + table.notes
    items = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return (f'<table id="{table_id}"><tr><th>line (your code)</th><th>bytes '
            f"{html.escape(table.in_use)}</th><th>{html.escape(table.chunk)}s</th></tr>"
            f'{"".join(body)}</table><ul class="notes">{items}</ul>')


#: Nodes an icicle of stacks draws at most (the largest; the rest stay in their parents).
ICICLE_NODES = 300


def stack_icicle_figure(trace: Any, *, at: Any = "peak", device: Any = None,
                        user_code: Any = None, max_nodes: int = ICICLE_NODES) -> Any:
    """The stacks of the allocations live at a moment as an icicle: the outermost frame of
    the user's code at the root, each deeper frame of it below, and under the innermost one
    the library or C++ code that allocated (``(in libraries) functional.py:1701 relu``);
    user frames are labelled ``file:line function``. Widths are bytes. At most
    ``max_nodes`` nodes are drawn, the largest: a smaller node's bytes stay in its parent,
    so the figure's size is bounded whatever the trace."""
    from .trace.callers import (below_user_code, call_sites, frame_text, short_paths,
                                user_code_rule)
    from .trace.holders import allocations, resolve_moment

    go = _go()
    rule = user_code_rule(user_code)
    allocs = allocations(trace, device)
    moment = resolve_moment(trace, at, device, allocs)
    live = allocs.live_after(moment.event)
    stacks = trace.stacks
    sites = call_sites(stacks, rule)
    sids, inv = np.unique(allocs.stack[live], return_inverse=True)
    sizes = np.bincount(inv, weights=allocs.size[live].astype(np.float64),
                        minlength=len(sids)) if len(live) else np.zeros(0)
    files = sorted({stacks.frames[f].filename for s in sids.tolist() if s >= 0
                    for f in stacks.stacks[s].frames})
    short = short_paths(files)
    paths = []
    for s in sids.tolist():
        if s < 0:
            paths.append(("(no stack recorded)",))
            continue
        frames = stacks.frames_of(s)
        user = [i for i, f in enumerate(frames) if sites.is_user[stacks.stacks[s].frames[i]]]
        if not user:
            fb = int(sites.fallback_frame[s])
            text = sites.fallback[s] + (f" {frame_text(stacks.frames[fb], short)}"
                                        if fb >= 0 else "")
            paths.append((text,))
            continue
        path = [frame_text(frames[i], short) for i in reversed(user)]
        below = below_user_code(frames, rule, short)
        if below:
            path.append(below)
        paths.append(tuple(path))
    total = float(sizes.sum())
    value: dict[tuple, float] = {(): total}
    for p, b in zip(paths, sizes.tolist()):
        for k in range(1, len(p) + 1):
            value[p[:k]] = value.get(p[:k], 0.0) + b
    nodes = sorted((k for k in value if k), key=lambda k: (-value[k], len(k)))[:max_nodes]
    kept = set(nodes)
    nodes = [k for k in nodes if all(k[:j] in kept for j in range(1, len(k)))]
    root = f"{format_bytes(int(total))} at {moment.text}"
    ids = ["/"] + ["/" + "\x1f".join(k) for k in nodes]
    labels = [root] + [k[-1] for k in nodes]
    parents = [""] + ["/" + "\x1f".join(k[:-1]) if len(k) > 1 else "/" for k in nodes]
    values = [total] + [value[k] for k in nodes]
    fig = go.Figure(go.Icicle(
        ids=ids, labels=labels, parents=parents, values=values, branchvalues="total",
        customdata=[format_bytes(int(v)) for v in values], root={"color": _C["grid"]},
        hovertemplate="%{label}<br>%{customdata}<extra></extra>", tiling={"orientation": "v"},
        maxdepth=6))
    _layout(fig, "Stacks at the peak (outermost frame of your code at the top)", 520,
            margin={"l": 10, "r": 10, "t": 56, "b": 10})
    return fig


def write_report(trace: Any, path: str | Path, *, overwrite: bool = False, **kwargs: Any) -> Path:
    """Write :func:`build_report` to ``path``; refuses to replace a file unless
    ``overwrite=True``."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise GpudashError(f"{path} exists; pass overwrite=True to replace it")
    text = build_report(trace, **kwargs)
    path.write_text(text, encoding="utf-8")
    return path
