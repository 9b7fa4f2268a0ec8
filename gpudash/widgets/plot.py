"""One plotly figure of the kernel drawn in the page by gpudash's own front end.

:class:`PlotView` is a small `anywidget <https://anywidget.dev>`_ (``static/plot.js``) that
shows a ``plotly.graph_objects.Figure`` the kernel keeps and changes. It speaks the
dashboard's protocol (:mod:`gpudash.widgets.dashboard`):

- **plotly.js once per page**, asked for only when the page does not have it yet, and shared
  with every dashboard and plot of the page (``static/loader.js``): the widget's own module
  is a few kilobytes. (plotly's ``FigureWidget`` ships its 5 MB module in every widget's
  state, which a busy page may not load within the 2 s anywidget allows a model; the
  figure then stays empty.)
- **The figure on hello.** Each rendered view says hello and the kernel answers with the
  figure as it is now, so a reloaded page, a notebook opened again while the kernel runs or
  a second view of the widget draws it whole. (A ``FigureWidget`` sends its traces and
  layout once, when it is made, and every later change as a message: a page loaded later
  drew empty axes.)
- **The figure after each change**, whole, to the views that said hello
  (:meth:`PlotView.redraw`); the page draws it with ``Plotly.react`` on the next animation
  frame.

The figure fits the width of the box it is shown in, and follows it when the box changes.
"""

from __future__ import annotations

import threading
from typing import Any

import anywidget
import traitlets

from .._errors import GpudashError
from .._comm_routing import follow_the_page
from .dashboard import esm, lib_message, plotly_bundle

__all__ = ["PlotView"]


class PlotView(anywidget.AnyWidget):
    """A plotly figure the kernel changes, drawn in the page by gpudash's front end.

    Parameters
    ----------
    figure : plotly.graph_objects.Figure
        What to draw; change it, then call :meth:`redraw`.

    Attributes
    ----------
    figure : plotly.graph_objects.Figure
    sent : dict
        Messages and bytes sent so far, by kind (``lib``, ``figure``).

    Examples
    --------
    >>> import plotly.graph_objects as go
    >>> fig = go.Figure(go.Scatter(y=[1, 3, 2]))
    >>> view = PlotView(fig)  # in a notebook, end the cell with ``view`` to show it
    >>> fig.data[0].y = [2, 1, 3]
    >>> view.redraw()         # the views of the page draw the new figure
    >>> view.close()
    """

    _esm = traitlets.Unicode(esm("plot.js")).tag(sync=True)
    lib_version = traitlets.Unicode("").tag(sync=True)
    height = traitlets.Int(300, help="Height (px) kept while the figure loads.").tag(sync=True)

    def __init__(self, figure: Any, **kwargs: Any) -> None:
        self.figure = figure
        self.sent: dict[str, list[int]] = {}
        self._hellos = 0
        self._send_lock = threading.Lock()
        height = figure.layout.height
        super().__init__(lib_version=plotly_bundle()[0],
                         height=int(height) if height else 300, **kwargs)
        self.on_msg(self._on_msg)
        follow_the_page(self)   # redrawn from worker threads (the what-if view's replays)

    def redraw(self) -> None:
        """Send the figure as it is now to the views of the page (none said hello yet: a
        view that does gets it then)."""
        if self._hellos:
            self._send_figure()

    def _send_figure(self) -> None:
        with self._send_lock:
            if self.comm is None:
                return
            text = self.figure.to_json(validate=False)
            self._post("figure", {"type": "figure", "json": text})

    def _post(self, kind: str, content: dict, buffers: list | None = None) -> None:
        self.send(content, buffers=buffers)
        rec = self.sent.setdefault(kind, [0, 0])
        rec[0] += 1
        rec[1] += len(content.get("json", "")) + sum(len(b) for b in (buffers or ()))

    def _on_msg(self, _widget: Any, content: dict, buffers: list) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        try:
            if kind == "hello":
                self._hellos += 1
                self._send_figure()
            elif kind in ("lib", "lib-raw"):
                self._post("lib", *lib_message(raw=kind == "lib-raw"))
        except (GpudashError, ValueError, TypeError) as exc:  # shown in the view
            self.send({"type": "error", "text": f"{type(exc).__name__}: {exc}"})

    def __repr__(self) -> str:
        title = self.figure.layout.title.text or ""
        return f"PlotView({title!r}, {len(self.figure.data)} trace(s))"
