"""Live controls: change a running session's settings from the notebook.

Every control acts through the model (``LiveModel.configure`` -> ``Session.configure``), on
the device picked in the dropdown (shown when the session has more than one device):

- fraction slider (0.05-1.0; ``continuous_update=False``, so a drag acts once, on release),
  with the absolute limit it gives shown next to it;
- allow-growth toggle;
- deferred-deletion bytes on a log scale (1 KiB - 1 GiB);
- "release free regions" and "flush deferred frees" buttons;
- pause/resume and the refresh rate of the model.

A refused value (any :class:`~gpudash.GpudashError`, or a ValueError/TypeError from
validation) shows its message in the error line,
changes nothing, and the control snaps back to the setting in force. The controls follow the
session when it is changed elsewhere (``sess.configure(...)`` in a cell).
"""

from __future__ import annotations

import html
import math
import threading
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets
import traitlets

from .._errors import GpudashError
from .._units import format_bytes

__all__ = ["ControlsView"]

_KIB = 1 << 10
_GIB = 1 << 30


class ControlsView(widgets.VBox):
    """Sliders, toggles and buttons acting on the model's session.

    Parameters
    ----------
    model : LiveModel
        Its ``session`` receives the changes (fraction, growth, deferred deletion and the
        deferred flush need one; with a bare allocator those controls are disabled).
    device : int
        The device the controls act on at first.

    Attributes
    ----------
    fraction, growth, deferred, release, flush, pause, rate, device_picker
        The widgets (``FloatSlider``, ``ToggleButton``, ``FloatLogSlider``, ``Button``,
        ``Button``, ``ToggleButton``, ``FloatSlider``, ``Dropdown``).
    limit_label, deferred_label : ipywidgets.HTML
        The absolute limit and deferred threshold in bytes.
    error : ipywidgets.HTML
        The last refused change's message ("" when the last change worked).
    status : ipywidgets.HTML
        What the last action did.
    """

    device = traitlets.Int(0, help="Index of the device the controls act on.")

    def __init__(self, model: Any, *, device: int = 0) -> None:
        self.model = model
        self._lock = threading.RLock()
        self._syncing = False
        has_session = model.session is not None
        n = model.num_devices

        self.device_picker = widgets.Dropdown(
            options=[(name, i) for i, name in enumerate(model.device_names)], value=device,
            description="device", layout=widgets.Layout(display="" if n > 1 else "none"))
        self.fraction = widgets.FloatSlider(
            min=0.05, max=1.0, step=0.01, value=1.0, description="fraction",
            continuous_update=False, readout_format=".2f", disabled=not has_session,
            style={"description_width": "70px"}, layout=widgets.Layout(width="340px"))
        self.limit_label = widgets.HTML()
        self.growth = widgets.ToggleButton(description="allow growth", icon="expand",
                                           disabled=not has_session,
                                           tooltip="BFC allow_growth: start small and double")
        self.deferred = widgets.FloatLogSlider(
            base=2, min=10, max=30, step=0.5, value=8 << 20, description="deferred",
            continuous_update=False, readout=False, disabled=not has_session,
            style={"description_width": "70px"}, layout=widgets.Layout(width="300px"))
        self.deferred_label = widgets.HTML()
        self.release = widgets.Button(description="Release free regions", icon="recycle",
                                      tooltip="Return wholly free regions to the device",
                                      layout=widgets.Layout(width="auto"))
        self.flush = widgets.Button(description="Flush deferred frees", icon="download",
                                    disabled=not has_session,
                                    tooltip="Hand queued frees to the allocator now",
                                    layout=widgets.Layout(width="auto"))
        self.pause = widgets.ToggleButton(description="pause", icon="pause",
                                          value=model.paused, tooltip="Pause live updates")
        self.rate = widgets.FloatSlider(min=0.25, max=10.0, step=0.25, value=model.rate_hz,
                                        description="rate (Hz)", continuous_update=False,
                                        style={"description_width": "70px"},
                                        layout=widgets.Layout(width="280px"))
        self.error = widgets.HTML()
        self.status = widgets.HTML()
        self._links = [widgets.link((self.pause, "value"), (model, "paused")),
                       widgets.link((self.rate, "value"), (model, "rate_hz"))]

        # rows wrap rather than cut their last widgets off in a narrow output area
        wrap = dict(flex_flow="row wrap", align_items="center")
        row1 = widgets.HBox([self.device_picker, self.fraction, self.limit_label],
                            layout=widgets.Layout(**wrap))
        row2 = widgets.HBox([self.growth, self.deferred, self.deferred_label],
                            layout=widgets.Layout(**wrap))
        row3 = widgets.HBox([self.release, self.flush, self.pause, self.rate],
                            layout=widgets.Layout(**wrap))
        super().__init__(children=(row1, row2, row3, self.error, self.status))

        self.device = device
        self.device_picker.observe(self._on_picker_change, "value")
        self.fraction.observe(self._on_fraction_change, "value")
        self.growth.observe(self._on_growth_change, "value")
        self.deferred.observe(self._on_deferred_change, "value")
        self.pause.observe(self._on_pause_change, "value")
        self.release.on_click(self._on_release_click)
        self.flush.on_click(self._on_flush_click)
        self._remove_listener = model.add_listener(self._on_model_update)
        self.sync()

    # ------------------------------------------------------------------ traits
    @traitlets.validate("device")
    def _validate_device(self, proposal: Any) -> int:
        value = proposal["value"]
        n = self.model.num_devices
        if not 0 <= value < n:
            raise traitlets.TraitError(f"device must be an index in 0..{n - 1}; got {value}")
        return value

    @traitlets.observe("device")
    def _on_device_change(self, change: dict) -> None:
        if hasattr(self, "device_picker"):
            self.device_picker.value = change["new"]
            self.sync()

    def _on_picker_change(self, change: dict) -> None:
        self.device = change["new"]

    # ------------------------------------------------------------------ model -> widgets
    def _on_model_update(self, changed: dict) -> None:
        if self.device in changed:
            self.sync()

    def sync(self) -> None:
        """Show the settings in force on the selected device (a no-op for widgets that
        already show them)."""
        with self._lock:
            s = self.model.device_settings(self.device)
            fraction = s["fraction"]
            if not fraction or fraction > 1.0:
                fraction = s["limit"] / s["total"] if s["total"] else 1.0
            # on the slider's grid, so a browser snapping to its step sends no change back
            fraction = round(min(1.0, max(0.05, fraction)), 2)
            limit_text = (f"limit <b>{format_bytes(s['limit'])}</b> of "
                          f"{format_bytes(s['total'])} <small>({s['limit']:,} B)</small>")
            deferred = s["deferred_deletion_bytes"]
            self._syncing = True
            try:
                with self.fraction.hold_sync():
                    if abs(self.fraction.value - fraction) > 1e-12:
                        self.fraction.value = fraction
                    tooltip = f"limit {s['limit']:,} bytes"
                    if self.fraction.tooltip != tooltip:
                        self.fraction.tooltip = tooltip
                if self.limit_label.value != limit_text:
                    self.limit_label.value = limit_text
                if self.growth.value != bool(s["allow_growth"]):
                    self.growth.value = bool(s["allow_growth"])
                if deferred:
                    clamped = min(float(_GIB), max(float(_KIB), float(deferred)))
                    if abs(math.log2(self.deferred.value) - math.log2(clamped)) > 1e-9:
                        self.deferred.value = clamped
                    text = f"{format_bytes(deferred)}"
                    if self.deferred_label.value != text:
                        self.deferred_label.value = text
            finally:
                self._syncing = False

    # ------------------------------------------------------------------ widgets -> session
    def _target(self) -> int | None:
        """The device argument for the session: None (every device) for a one-device
        session, so the session-wide options follow too."""
        return None if self.model.num_devices == 1 else self.device

    def _apply(self, action: Callable[[], Any], done: Callable[[Any], str]) -> bool:
        with self._lock:
            try:
                result = action()
            except (GpudashError, ValueError, TypeError) as exc:
                self.error.value = (f'<span style="color:#d62728"><b>refused:</b> '
                                    f"{html.escape(str(exc))}</span>")
                self.sync()  # snap back to what is in force
                return False
            self.error.value = ""
            self.status.value = f"<small>{html.escape(done(result))}</small>"
            self.sync()
            return True

    def _on_fraction_change(self, change: dict) -> None:
        with self._lock:
            if self._syncing:
                return
            value = float(change["new"])
            self._apply(lambda: self.model.configure(per_process_gpu_memory_fraction=value,
                                                     device=self._target()),
                        lambda _: f"fraction set to {value:g}")

    def _on_growth_change(self, change: dict) -> None:
        with self._lock:
            if self._syncing:
                return
            value = bool(change["new"])
            self._apply(lambda: self.model.configure(allow_growth=value, device=self._target()),
                        lambda _: f"allow_growth set to {value}")

    def _on_deferred_change(self, change: dict) -> None:
        with self._lock:
            if self._syncing:
                return
            value = int(round(change["new"]))
            self._apply(lambda: self.model.configure(deferred_deletion_bytes=value,
                                                     device=self._target()),
                        lambda _: f"deferred_deletion_bytes set to {format_bytes(value)}")

    def _on_release_click(self, _button: Any = None) -> None:
        self._apply(lambda: self.model.release_free_regions(self._target()),
                    lambda n: f"released {format_bytes(n)} of free regions")

    def _on_flush_click(self, _button: Any = None) -> None:
        self._apply(lambda: self.model.flush_deferred(self._target()),
                    lambda n: f"flushed {format_bytes(n)} of deferred frees")

    def _on_pause_change(self, change: dict) -> None:
        paused = bool(change["new"])
        with self.pause.hold_sync():
            self.pause.description = "resume" if paused else "pause"
            self.pause.icon = "play" if paused else "pause"

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        remove = getattr(self, "_remove_listener", None)
        if remove is not None:
            remove()
            self._remove_listener = None
        for link in self._links:
            link.unlink()
        self._links = []
        for w in (self.device_picker, self.fraction, self.limit_label, self.growth,
                  self.deferred, self.deferred_label, self.release, self.flush, self.pause,
                  self.rate, self.error, self.status):
            w.close()
        for row in self.children:
            row.close()
        super().close()

    def __repr__(self) -> str:
        return f"ControlsView(device={self.device}, model={self.model!r})"
