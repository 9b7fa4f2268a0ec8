"""What every out-of-memory explanation shows the same way: the summary as an HTML table,
its figures, a self-contained page that opens offline, and display in a notebook. TensorFlow's
and JAX's (:class:`gpudash.postmortem.Explanation`) and PyTorch's
(:class:`gpudash.torch_explain.TorchExplanation`) explanations share it."""

from __future__ import annotations

import gzip
import html
import os
from pathlib import Path

from ._errors import GpudashError

__all__: list[str] = []


def _plotly_script() -> str:
    """A ``<script>`` with plotly.js's cartesian bundle (shipped for the dashboard), or ""
    where the package has no copy of it."""
    bundle = Path(__file__).resolve().parent / "widgets" / "static" / "plotly-cartesian.min.js.gz"
    try:
        js = gzip.decompress(bundle.read_bytes()).decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError):
        return ""
    return f'<script type="text/javascript">{js}</script>'


class _ExplanationViews:
    """What every explanation shows the same way: an HTML summary of :meth:`lines`, the
    figures, a self-contained page, and display in a notebook. Subclasses have ``path``,
    ``warnings``, ``lines()``, ``figures()`` and a ``__str__`` whose first line heads the
    summary."""

    path: str
    warnings: list[str]

    def lines(self) -> list[tuple[str, str]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def figures(self) -> list:  # pragma: no cover - abstract
        raise NotImplementedError

    def _summary_html(self) -> str:
        rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                       for k, v in self.lines())
        warn = "".join(f"<li>{html.escape(w)}</li>" for w in self.warnings)
        head = html.escape(str(self).splitlines()[0])
        return (f'<div class="gpudash-explain"><p><b>{head}</b></p>'
                f'<table id="explain-summary">{rows}</table>'
                + (f"<ul class=\"warnings\">{warn}</ul>" if warn else "") + "</div>")

    def to_html(self, *, full: bool = True) -> str:
        """The explanation as HTML with its figures (plotly.js inline: opens offline).

        The script is plotly.js's cartesian bundle, the dashboard's (1.5 MB: bars, lines,
        heatmaps), not the whole library (4.6 MB); a dump of many chunks is drawn
        downsampled (:func:`gpudash.report.chunkmap_figure`), so the file stays a few MB.
        """
        script = _plotly_script()
        parts = [self._summary_html()]
        if script:
            parts.append(script)
        for i, fig in enumerate(self.figures()):
            parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0 and not script),
                                     config={"displaylogo": False}))
        body = "\n".join(parts)
        if not full:
            return body
        title = html.escape(f"gpudash explain: {Path(self.path).name}")
        return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{title}</title><style>body {{ font-family: system-ui, sans-serif; "
                f"margin: 24px; }} table {{ border-collapse: collapse; }} th, td {{ border: "
                f"1px solid #ccc; padding: 4px 10px; text-align: left; }}</style></head>"
                f"<body><h1>{title}</h1>{body}</body></html>\n")

    def write_html(self, path: str | os.PathLike, overwrite: bool = False) -> Path:
        """Write :meth:`to_html` to ``path`` (refuses to replace a file unless asked)."""
        out = Path(path)
        if out.exists() and not overwrite:
            raise GpudashError(f"{out} exists; pass overwrite=True to replace it")
        out.write_text(self.to_html(), encoding="utf-8")
        return out

    def _ipython_display_(self) -> None:  # pragma: no cover - exercised through IPython
        from IPython.display import HTML, display

        display(HTML(self._summary_html()))
        for fig in self.figures():
            display(fig)

    def _repr_html_(self) -> str:
        return self._summary_html()
