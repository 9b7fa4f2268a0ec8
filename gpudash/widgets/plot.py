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

import base64
import threading
from typing import Any

import anywidget
import numpy as np
import traitlets

from .._errors import GpudashError
from .._comm_routing import follow_the_page
from .dashboard import esm, lib_message, plotly_bundle

__all__ = ["PlotView", "typed_array", "decode_array"]


# --- arrays on the wire ---------------------------------------------------------------

def _plotly_typed_arrays() -> bool:
    import plotly

    try:
        return int(plotly.__version__.split(".")[0]) >= 6
    except ValueError:  # pragma: no cover - odd version string
        return False


_TYPED: bool | None = None


def typed_array(values: Any, dtype: Any) -> Any:
    """An array for a plotly figure: a typed-array spec (``{"dtype", "bdata", "shape"}``,
    base64) with plotly >= 6, whose plotly.js decodes it; else a numpy array.

    A spec is one string to the widget machinery, where a nested list costs a Python call per
    element (ipywidgets walks lists looking for buffers) and several bytes per number.
    """
    global _TYPED
    arr = np.ascontiguousarray(values, dtype=dtype)
    if _TYPED is None:
        _TYPED = _plotly_typed_arrays()
    if not _TYPED:
        return arr
    spec = {"dtype": _DTYPE_CODES[arr.dtype.str[1:]],
            "bdata": base64.b64encode(arr.astype(arr.dtype.newbyteorder("<"), copy=False)
                                      .tobytes()).decode("ascii")}
    if arr.ndim > 1:
        spec["shape"] = ",".join(str(n) for n in arr.shape)
    return spec


_DTYPE_CODES = {"i1": "i1", "u1": "u1", "i2": "i2", "u2": "u2", "i4": "i4", "u4": "u4",
                "f4": "f4", "f8": "f8"}
_CODE_DTYPES = {"i1": np.int8, "u1": np.uint8, "i2": np.int16, "u2": np.uint16,
                "i4": np.int32, "u4": np.uint32, "f4": np.float32, "f8": np.float64,
                "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16,
                "int32": np.int32, "uint32": np.uint32, "float32": np.float32,
                "float64": np.float64}


def decode_array(value: Any) -> np.ndarray:
    """The numpy array behind a figure attribute (a typed-array spec, an array or a list)."""
    if isinstance(value, dict) and "bdata" in value:
        arr = np.frombuffer(base64.b64decode(value["bdata"]), dtype=_CODE_DTYPES[value["dtype"]])
        shape = value.get("shape")
        if shape is not None and "," in str(shape):
            arr = arr.reshape([int(n) for n in str(shape).split(",")])
        return arr
    if value is None:
        return np.zeros(0)
    return np.asarray(value)


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
