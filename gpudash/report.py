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

from ._errors import GpudashError
from ._units import format_bytes
from ._version import __version__

__all__ = ["build_report", "write_report", "timeline_figure", "heatmap_figure",
           "bins_figure", "chunkmap_figure"]

_GIB = float(1 << 30)
_COLORS = {"in_use": "#d62728", "free": "#2ca02c", "waste": "#ff7f0e", "pool": "#1f77b4",
           "limit": "#444444"}


def _go():
    import plotly.graph_objects as go

    return go


def timeline_figure(per_call: dict, *, limit: int, ooms: np.ndarray | None = None,
                    settings: list[dict] | None = None, x: np.ndarray | None = None,
                    x_title: str = "call", max_points: int = 4000) -> Any:
    """Bytes in use and pool bytes over the calls, the limit, OOMs and setting changes."""
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
    fig = go.Figure()
    fig.add_scatter(x=xs_d, y=pool_d / _GIB, name="pool", mode="lines",
                    line={"color": _COLORS["pool"], "shape": "hv"})
    fig.add_scatter(x=xs_d, y=in_use_d / _GIB, name="in use", mode="lines", fill="tozeroy",
                    line={"color": _COLORS["in_use"], "shape": "hv"})
    if n:
        fig.add_scatter(x=[xs[0], xs[-1]], y=[limit / _GIB, limit / _GIB], name="limit",
                        mode="lines", line={"color": _COLORS["limit"], "dash": "dash"})
    if ooms is not None and len(ooms):
        ooms = np.asarray(ooms)
        ooms = ooms[ooms < n]
        fig.add_scatter(x=xs[ooms], y=in_use[ooms] / _GIB, name="out of memory",
                        mode="markers", marker={"symbol": "x", "size": 10, "color": "black"})
    for s in settings or []:
        at = s.get("x")
        if at is None:
            continue
        fig.add_vline(x=at, line={"dash": "dot", "color": "#9467bd"},
                      annotation_text=f"{s['setting']} {s['old']}\u2192{s['new']}",
                      annotation_position="top left")
    fig.update_layout(title="Memory timeline", xaxis_title=x_title, yaxis_title="GiB",
                      height=360, margin={"l": 60, "r": 20, "t": 50, "b": 40},
                      legend={"orientation": "h"})
    return fig


def heatmap_figure(values: np.ndarray, row_edges: np.ndarray, col_edges: np.ndarray,
                   *, x_title: str = "event") -> Any:
    """Address (rows) x time (columns); each cell the fraction of its bytes in use."""
    go = _go()
    rows_mid = (np.asarray(row_edges[:-1]) + np.asarray(row_edges[1:])) / 2
    cols_mid = (np.asarray(col_edges[:-1]) + np.asarray(col_edges[1:])) / 2
    fig = go.Figure(go.Heatmap(z=values, x=cols_mid, y=rows_mid / (1 << 20), zmin=0, zmax=1,
                               colorscale="Viridis", colorbar={"title": "in use"},
                               hovertemplate="offset %{y:.1f} MiB<br>%{x}<br>"
                                             "in use %{z:.0%}<extra></extra>"))
    fig.update_layout(title="Fragmentation heatmap (address \u00d7 time)", xaxis_title=x_title,
                      yaxis_title="offset in the pool (MiB)", height=420,
                      margin={"l": 60, "r": 20, "t": 50, "b": 40})
    return fig


def bins_figure(dump: Any) -> Any:
    """Free chunks and bytes per bin, and bytes in use by bin."""
    go = _go()
    labels = [format_bytes(b.bin_size).replace(".00", "") for b in dump.bins]
    labels[-1] += "+"
    fig = go.Figure()
    fig.add_bar(x=labels, y=[b.free_bytes / (1 << 20) for b in dump.bins], name="free",
                marker_color=_COLORS["free"],
                customdata=[b.free_chunks for b in dump.bins],
                hovertemplate="bin %{x}<br>free %{y:.2f} MiB in %{customdata} chunk(s)"
                              "<extra></extra>")
    fig.add_bar(x=labels, y=[b.total_bytes_in_use / (1 << 20) for b in dump.bins],
                name="in use", marker_color=_COLORS["in_use"])
    fig.update_layout(title="Bin occupancy", barmode="group", yaxis_title="MiB",
                      height=340, margin={"l": 60, "r": 20, "t": 50, "b": 60})
    return fig


def chunkmap_figure(dump: Any, *, title: str = "Chunk map") -> Any:
    """Every region as a bar of its chunks: in use, rounding waste, free."""
    go = _go()
    regions = {r.ptr: i for i, r in enumerate(dump.regions)}
    names = [f"region {i} @ {r.ptr:#x}" for i, r in enumerate(dump.regions)]
    cats: dict[str, dict[str, list]] = {k: {"y": [], "base": [], "x": [], "text": []}
                                        for k in ("in use", "waste", "free")}
    for c in dump.chunks:
        region = dump.regions[regions[c.region]]
        y = names[regions[c.region]]
        off = (c.address - region.ptr) / (1 << 20)
        if c.in_use:
            # requested 0: not known (a dump read from a log): the whole chunk shows in use
            req = c.requested_size if c.requested_size > 0 else c.size
            used = req / (1 << 20)
            info = (f"{c.address:#x}<br>size {c.size}<br>requested "
                    f"{c.requested_size if c.requested_size > 0 else 'unknown'}"
                    f"<br>allocation {c.allocation_id}"
                    + (f"<br>held by {c.holder}" if getattr(c, "holder", "") else ""))
            for key, base, width in (("in use", off, used),
                                     ("waste", off + used, (c.size - req) / (1 << 20))):
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
            d["x"].append(c.size / (1 << 20))
            d["text"].append(f"{c.address:#x}<br>free {c.size}<br>bin {c.bin}")
    fig = go.Figure()
    colors = {"in use": _COLORS["in_use"], "waste": _COLORS["waste"], "free": _COLORS["free"]}
    for key, d in cats.items():
        fig.add_bar(y=d["y"], x=d["x"], base=d["base"], orientation="h", name=key,
                    marker={"color": colors[key], "line": {"width": 0}},
                    hovertext=d["text"], hoverinfo="text")
    fig.update_layout(title=title, barmode="overlay", xaxis_title="offset in region (MiB)",
                      height=max(220, 60 + 40 * len(names)),
                      margin={"l": 160, "r": 20, "t": 50, "b": 40})
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


def build_report(trace: Any, *, title: str = "gpudash report", device_bytes: int = 16 << 30,
                 replay_options: dict | None = None, sweep_table: Any = None,
                 fractions: tuple = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0)) -> str:
    """The report as an HTML string (see the module docstring)."""
    from .analysis import bin_occupancy, chunk_map_at_peak, heatmap
    from .trace.replay import replay
    from .trace.whatif import sweep

    opts = {k: v for k, v in (replay_options or {}).items() if v is not None}
    result = replay(trace, device_bytes=device_bytes, record=True, per_call=True, **opts)
    recording = result.recording
    sections: list[tuple[str, Any]] = []
    sections.append(("timeline", timeline_figure(
        result.per_call, limit=result.memory_limit, ooms=result.ooms,
        settings=_settings_marks(trace, result.calls))))
    hm = heatmap(recording, rows=256, cols=min(600, max(1, len(recording))))
    sections.append(("heatmap", heatmap_figure(hm.values, hm.row_edges, hm.col_edges)))
    peak = chunk_map_at_peak(recording)
    sections.append(("bins", bins_figure(peak)))
    sections.append(("chunkmap", chunkmap_figure(
        peak, title=f"Chunk map at the peak ({format_bytes(peak.stats.bytes_in_use)} in use)")))
    if sweep_table is None:
        sweep_table = sweep(trace, fractions=fractions,
                            allow_growth=(opts.get("allow_growth", True),),
                            device_bytes=device_bytes, jobs=1)

    parts = []
    for i, (name, fig) in enumerate(sections):
        div = fig.to_html(full_html=False, include_plotlyjs=(i == 0),
                          div_id=f"gpudash-{name}", config={"displaylogo": False})
        parts.append(f'<section class="plot" data-plot="{name}">{div}</section>')
    verdict = ("fits: no allocation ran out of memory" if result.fits else
               f"OUT OF MEMORY: {result.oom_count} allocation(s) refused, the first at call "
               f"{result.first_oom[0]} ({format_bytes(result.first_oom[1])})")
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
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in summary)
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
<h2>What if: other fractions</h2>
<div id="whatif">{sweep_table.to_html()}</div>
</body></html>
"""


def write_report(trace: Any, path: str | Path, *, overwrite: bool = False, **kwargs: Any) -> Path:
    """Write :func:`build_report` to ``path``; refuses to replace a file unless
    ``overwrite=True``."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise GpudashError(f"{path} exists; pass overwrite=True to replace it")
    text = build_report(trace, **kwargs)
    path.write_text(text, encoding="utf-8")
    return path
