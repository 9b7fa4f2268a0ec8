"""The HTML report: one self-contained file that opens offline in a browser.

It replays a trace through gpudash's BFC allocator on a simulated device and shows the
memory timeline (in use, pool, limit, out-of-memory marks, setting changes), the
fragmentation heatmap (address x time), bin occupancy and the chunk map at the peak, and a
what-if table of fractions. plotly's JavaScript is embedded once, inline, so the file needs
no network.
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
           "bins_figure", "chunkmap_figure", "stack_icicle_figure"]

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
    fig = go.Figure(go.Heatmap(
        z=np.asarray(values, dtype=np.float64) * 100.0, x=np.asarray(col_edges),
        y=rows / scale, zmin=0, zmax=100, colorscale=style.HEATMAP_SCALE,
        colorbar={"title": {"text": "% in use"}},
        hovertemplate=f"offset %{{y:.2f}} {unit}<br>%{{x}}<br>%{{z:.0f}} % in use"
                      "<extra></extra>"))
    _layout(fig, "Fragmentation heatmap (address \u00d7 time)", 420,
            xaxis={"title": {"text": x_title}},
            yaxis={"title": {"text": "offset in the pool"}, "ticksuffix": " " + unit})
    return fig


def _pools(dump: Any) -> bool:
    """A dump of PyTorch's caching allocator: pools, segments and blocks, not TensorFlow's
    bins, regions and chunks."""
    return (getattr(dump, "extra", None) or {}).get("layout") == "pools"


def _words(dump: Any) -> dict[str, str]:
    """What the pieces of a dump are called in its framework."""
    if _pools(dump):
        return {"region": "segment", "chunk": "block", "bin": "pool"}
    return {"region": "region", "chunk": "chunk", "bin": "bin"}


def bins_figure(dump: Any) -> Any:
    """Free chunks and bytes per bin, and bytes in use by bin (for PyTorch's allocator: per
    pool, small and large)."""
    go = _go()
    w = _words(dump)
    if _pools(dump):
        labels = ["small pool (≤ 1 MiB)", "large pool"][:len(dump.bins)]
    else:
        labels = [format_bytes(b.bin_size).replace(".00", "") for b in dump.bins]
        labels[-1] += "+"
    free = np.array([b.free_bytes for b in dump.bins], dtype=np.float64)
    used = np.array([b.total_bytes_in_use for b in dump.bins], dtype=np.float64)
    unit, scale = style.unit_for(max(float(free.max(initial=0)), float(used.max(initial=0)), 1))
    fig = go.Figure()
    fig.add_bar(x=labels, y=used / scale, name="in use", marker_color=_C["in use"],
                hovertemplate=f"bin %{{x}}<br>in use %{{y:.2f}} {unit}<extra></extra>")
    fig.add_bar(x=labels, y=free / scale, name="free", marker_color=_C["free"],
                customdata=[b.free_chunks for b in dump.bins],
                hovertemplate=f"{w['bin']} %{{x}}<br>free %{{y:.2f}} {unit} in "
                              f"%{{customdata}} {w['chunk']}(s)<extra></extra>")
    _layout(fig, "Pool occupancy" if _pools(dump) else "Bin occupancy", 340, barmode="group",
            xaxis={"title": {"text": "pool" if _pools(dump) else "bin (chunk size)"},
                   "type": "category"},
            yaxis={"title": {"text": "bytes"}, "ticksuffix": " " + unit,
                   "gridcolor": _C["grid"]})
    return fig


#: A chunk map's legend: above its plot area on the right, where a figure of many rows still
#: shows it next to the title (below the plot it would sit a screen away).
_TOP_LEGEND = {"orientation": "h", "x": 1.0, "xanchor": "right", "y": 1.0, "yanchor": "bottom"}

#: Chunks a chunk map draws one bar each; a dump with more is drawn downsampled.
CHUNKMAP_MAX_CHUNKS = 5000
#: Columns (pixels) across all the rows of a downsampled chunk map, and per row at most.
CHUNKMAP_COLUMNS_TOTAL = 60_000
CHUNKMAP_COLUMNS = 1500


def chunkmap_figure(dump: Any, *, title: str = "Chunk map",
                    max_chunks: int = CHUNKMAP_MAX_CHUNKS) -> Any:
    """Every region as a bar of its chunks: in use, rounding waste, free.

    Up to ``max_chunks`` chunks each chunk is a bar with its own hover text. A larger dump
    is rasterised as the heatmap is (:func:`gpudash.analysis._coverage`, exact shares per
    cell): each region is cut into up to :data:`CHUNKMAP_COLUMNS` columns, each column
    takes the colour of what covers most of it, and runs of one colour are one bar whose
    hover gives its shares and chunk count; the figure then holds at most a few thousand
    bars however many chunks the dump has.
    """
    go = _go()
    if len(dump.chunks) > max_chunks:
        return _chunkmap_downsampled(dump, title)
    w = _words(dump)
    pool_names = ("small pool", "large pool") if _pools(dump) else None
    regions = {r.ptr: i for i, r in enumerate(dump.regions)}
    names = [f"{w['region']} {i} @ {r.ptr:#x}" for i, r in enumerate(dump.regions)]
    unit, scale = style.unit_for(max((r.size for r in dump.regions), default=1))
    cats: dict[str, dict[str, list]] = {k: {"y": [], "base": [], "x": [], "text": []}
                                        for k in ("in use", "waste", "free")}
    for c in dump.chunks:
        region = dump.regions[regions[c.region]]
        y = names[regions[c.region]]
        off = (c.address - region.ptr) / scale
        if c.in_use:
            # requested 0: not known (a dump read from a log): the whole chunk shows in use
            req = c.requested_size if c.requested_size > 0 else c.size
            used = req / scale
            info = (f"{c.address:#x}<br>size {format_bytes(c.size)}<br>requested "
                    f"{format_bytes(c.requested_size) if c.requested_size > 0 else 'unknown'}"
                    f"<br>allocation {c.allocation_id}"
                    + (f"<br>held by {html.escape(str(c.holder))}"
                       if getattr(c, "holder", "") else ""))
            for key, base, width in (("in use", off, used),
                                     ("waste", off + used, (c.size - req) / scale)):
                if width > 0:
                    d = cats[key]
                    d["y"].append(y)
                    d["base"].append(base)
                    d["x"].append(width)
                    d["text"].append(info)
        else:
            d = cats["free"]
            d["y"].append(y)
            d["base"].append(off)
            d["x"].append(c.size / scale)
            where = (pool_names[c.bin] if pool_names and 0 <= c.bin < 2 else f"bin {c.bin}")
            d["text"].append(f"{c.address:#x}<br>free {format_bytes(c.size)}<br>{where}")
    fig = go.Figure()
    for key, d in cats.items():
        fig.add_bar(y=d["y"], x=d["x"], base=d["base"], orientation="h", name=key,
                    marker={"color": _C[key], "line": {"width": 0}},
                    hovertext=d["text"], hoverinfo="text")
    _layout(fig, title, max(220, 60 + 40 * len(names)), barmode="overlay",
            xaxis={"title": {"text": f"offset in {w['region']}"}, "ticksuffix": " " + unit,
                   "rangemode": "tozero"},
            margin={"l": 160, "r": 20, "t": 56, "b": 40}, legend=_TOP_LEGEND)
    return fig


def _chunkmap_downsampled(dump: Any, title: str) -> Any:
    """:func:`chunkmap_figure` for a dump of many chunks: runs of columns, not chunks."""
    from .analysis import _coverage

    go = _go()
    chunks = dump.chunks
    n = len(chunks)
    starts = np.array([r.ptr for r in dump.regions], dtype=np.int64)
    sizes = np.array([r.size for r in dump.regions], dtype=np.int64)
    address = np.fromiter((c.address for c in chunks), dtype=np.int64, count=n)
    size = np.fromiter((c.size for c in chunks), dtype=np.int64, count=n)
    in_use = np.fromiter((c.in_use for c in chunks), dtype=bool, count=n)
    req = np.fromiter((c.requested_size for c in chunks), dtype=np.int64, count=n)
    row = np.searchsorted(starts, address, side="right") - 1
    keep = (row >= 0) & (address < starts[np.maximum(row, 0)] + sizes[np.maximum(row, 0)])
    row, address, size, in_use, req = row[keep], address[keep], size[keep], in_use[keep], \
        req[keep]
    n_rows = len(starts)
    cols = max(16, min(CHUNKMAP_COLUMNS, CHUNKMAP_COLUMNS_TOTAL // max(n_rows, 1)))
    col_bytes = sizes / cols                       # bytes per column, per region
    # requested 0: not known (a dump read from a log): the whole chunk shows in use
    used = np.where(in_use, np.where(req > 0, np.minimum(req, size), size), 0)
    x0 = (address - starts[row]) / col_bytes[row]
    y0 = row.astype(np.float64)
    shares = {}
    for key, lo, hi in (("in use", x0, x0 + used / col_bytes[row]),
                        ("waste", x0 + used / col_bytes[row], x0 + size / col_bytes[row]),
                        ("free", x0, x0 + size / col_bytes[row])):
        pick = in_use if key != "free" else ~in_use
        shares[key] = _coverage(y0[pick], y0[pick] + 1.0, lo[pick], hi[pick], n_rows, cols)
    first_col = np.minimum(np.floor(x0), cols - 1).astype(np.int64)
    starts_in = np.bincount(row * cols + first_col, minlength=n_rows * cols).reshape(n_rows,
                                                                                     cols)
    stack = np.stack([shares["in use"], shares["waste"], shares["free"]])   # 3 x rows x cols
    colour = np.argmax(stack, axis=0)
    colour[stack.sum(axis=0) == 0] = 2             # a column nothing covers: shown as free
    keys = ("in use", "waste", "free")
    words = _words(dump)
    unit, scale = style.unit_for(int(sizes.max()) if n_rows else 1)
    names = [f"{words['region']} {i} @ {p:#x}" for i, p in enumerate(starts.tolist())]
    cats: dict[str, dict[str, list]] = {k: {"y": [], "base": [], "x": [], "text": []}
                                        for k in keys}
    for r in range(n_rows):
        c = colour[r]
        edges = np.concatenate([[0], np.flatnonzero(np.diff(c)) + 1, [cols]])
        counts = np.concatenate([[0], np.cumsum(starts_in[r])])
        per = col_bytes[r]
        for a, b in zip(edges[:-1].tolist(), edges[1:].tolist()):
            d = cats[keys[int(c[a])]]
            u, w, f = (float(stack[k, r, a:b].sum()) / (b - a) for k in range(3))
            lo, hi = int(round(a * per)), int(round(b * per))
            d["y"].append(names[r])
            d["base"].append(lo / scale)
            d["x"].append((hi - lo) / scale)
            d["text"].append(f"{starts[r] + lo:#x} to {starts[r] + hi:#x} "
                             f"({format_bytes(hi - lo)})<br>{u:.0%} in use, {w:.0%} waste, "
                             f"{f:.0%} free<br>{int(counts[b] - counts[a]):,} {words['chunk']}(s) "
                             "begin here")
    fig = go.Figure()
    for key, d in cats.items():
        fig.add_bar(y=d["y"], x=d["x"], base=d["base"], orientation="h", name=key,
                    marker={"color": _C[key], "line": {"width": 0}},
                    hovertext=d["text"], hoverinfo="text")
    title = (f"{title}<br><sup>{n:,} {words['chunk']}s drawn as {cols:,} columns per "
             f"{words['region']}: each column in the colour of what covers most of it</sup>")
    _layout(fig, title, max(220, min(60 + 40 * n_rows, 4000)), barmode="overlay",
            xaxis={"title": {"text": f"offset in {words['region']}"}, "ticksuffix": " " + unit,
                   "rangemode": "tozero"},
            margin={"l": 160, "r": 20, "t": 72, "b": 40}, legend=_TOP_LEGEND)
    return fig


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
    from .trace.replay import replay
    from .trace.whatif import sweep

    opts = {k: v for k, v in (replay_options or {}).items() if v is not None}
    if device_bytes is not None:
        opts["device_bytes"] = device_bytes
    result = replay(trace, record=True, per_call=True, **opts)
    if result.calls == 0:
        raise GpudashError("the trace has no events for this device: nothing to report")
    torch = result.allocator == "torch"
    device_bytes = result.options["device_bytes"]
    recording = result.recording
    sections: list[tuple[str, Any]] = []
    sections.append(("timeline", timeline_figure(
        result.per_call, limit=result.memory_limit, ooms=result.ooms,
        settings=_settings_marks(trace, result.calls),
        names=("reserved", "allocated") if result.allocator == "torch" else ("pool", "in use"))))
    served = bool(np.any(np.asarray(recording.columns["kind"]) == int(EventKind.ALLOC)))
    if served:   # the state views need memory that was allocated at some point
        hm = heatmap(recording, rows=256, cols=min(600, max(1, len(recording))))
        edges = calls_at_events(recording, hm.col_edges)  # one time base with the timeline
        sections.append(("heatmap", heatmap_figure(hm.values, hm.row_edges, edges,
                                                   x_title="call")))
        if torch:   # the model's own pools and segments, from the trace's calls
            same = {k: v for k, v in result.options.items()
                    if k in ("device_bytes", "fraction", "conf", "torch_version", "device")}
            peak = chunk_map_at_peak(trace, options=same, device=same.get("device"))
            title_map = (f"Segment map at the peak ({format_bytes(peak.stats.bytes_in_use)} "
                         "allocated)")
        else:
            peak = chunk_map_at_peak(recording)
            title_map = f"Chunk map at the peak ({format_bytes(peak.stats.bytes_in_use)} in use)"
        sections.append(("bins", bins_figure(peak)))
        sections.append(("chunkmap", chunkmap_figure(peak, title=title_map)))
    if sweep_table is None:
        if torch:   # PyTorch's question: would expandable segments fit in less?
            sweep_table = sweep(trace, fractions=fractions, device_bytes=device_bytes, jobs=1,
                                device=result.options.get("device"))
        else:
            sweep_table = sweep(trace, fractions=fractions,
                                allow_growth=(opts.get("allow_growth", True),),
                                device_bytes=device_bytes, jobs=1,
                                **{k: v for k, v in opts.items()
                                   if k in ("device", "garbage_collection")})

    parts = []
    for i, (name, fig) in enumerate(sections):
        div = fig.to_html(full_html=False, include_plotlyjs=(i == 0),
                          div_id=f"gpudash-{name}", config={"displaylogo": False})
        parts.append(f'<section class="plot" data-plot="{name}">{div}</section>')
    verdict = ("fits: no allocation ran out of memory" if result.fits else
               f"OUT OF MEMORY: {result.oom_count} allocation(s) refused, the first at call "
               f"{result.first_oom[0]} ({format_bytes(result.first_oom[1])})")
    if torch:
        frac = result.options.get("fraction")
        summary = [
            ("device", format_bytes(device_bytes)),
            ("allocator", "PyTorch's caching allocator (PyTorch "
                          f"{result.options.get('torch_version')} rules)"),
            ("PYTORCH_CUDA_ALLOC_CONF", result.options.get("conf") or "unset"),
            ("set_per_process_memory_fraction",
             "not set" if frac is None else f"{frac:g} ({format_bytes(result.memory_limit)})"),
            ("calls replayed", f"{result.calls:,}"),
            ("peak allocated", format_bytes(result.peak_bytes_in_use)),
            ("peak reserved", format_bytes(result.peak_pool_bytes)),
            ("segments obtained (cudaMalloc)", str(result.extensions)),
            ("worst external fragmentation", f"{result.worst_fragmentation:.1%}"),
            ("result", verdict),
        ]
        if result.fidelity is not None:
            summary.insert(5, ("replayed exactly", result.fidelity.summary()))
    else:
        summary = [
            ("device", format_bytes(device_bytes)),
            ("memory limit", format_bytes(result.memory_limit)),
            ("allow_growth", str(result.options.get("allow_growth"))),
            ("calls replayed", f"{result.calls:,}"),
            ("peak in use", format_bytes(result.peak_bytes_in_use)),
            ("peak pool", format_bytes(result.peak_pool_bytes)),
            ("regions obtained", str(result.extensions)),
            ("worst external fragmentation", f"{result.worst_fragmentation:.1%}"),
            ("result", verdict),
        ]
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
