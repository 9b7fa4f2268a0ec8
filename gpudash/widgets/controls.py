"""Live controls: change a running session's settings from the notebook.

Every control acts through the model (``LiveModel.configure`` -> ``Session.configure``), on
the device picked in the dropdown (shown when the session has more than one device). The
controls are the allocator model's (:mod:`gpudash.models`):

- fraction slider (0.05-1.0; ``continuous_update=False``, so a drag acts once, on release),
  with the absolute limit it gives shown next to it;
- TensorFlow's BFC: allow-growth toggle; deferred-deletion bytes on a log scale (1 KiB -
  1 GiB); "release free regions" and "flush deferred frees" buttons;
- PyTorch's caching allocator: ``expandable_segments`` toggle, ``max_split_size_mb`` and
  ``garbage_collection_threshold`` fields (empty: unset / off), "empty cache" button;
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

from .._errors import ConfigError, GpudashError
from .._units import format_bytes

__all__ = ["ControlsView"]

_KIB = 1 << 10
_GIB = 1 << 30


class ControlsView(widgets.VBox):
    """Sliders, toggles and buttons acting on the model's session.

    The controls are the allocator model's (:attr:`gpudash.models.AllocatorModel.controls`):
    for TensorFlow's BFC the fraction, growth, deferred deletion and the release and flush
    buttons; for PyTorch's caching allocator the fraction, ``expandable_segments``,
    ``max_split_size_mb``, ``garbage_collection_threshold`` and "empty cache". Each answers
    in the model's words (:meth:`~gpudash.models.AllocatorModel.answer`) in the status line.

    Parameters
    ----------
    model : LiveModel
        Its ``session`` receives the changes (the settings and the deferred flush need one;
        with a bare allocator those controls are disabled).
    device : int
        The device the controls act on at first.

    Attributes
    ----------
    fraction, pause, rate, device_picker
        The widgets (``FloatSlider``, ``ToggleButton``, ``FloatSlider``, ``Dropdown``).
    controls : dict
        Every control's widget by its name; each is also an attribute: BFC ``growth``
        (``ToggleButton``), ``deferred`` (``FloatLogSlider``), ``release``, ``flush``
        (``Button``); PyTorch ``expandable`` (``ToggleButton``), ``max_split``, ``gc``
        (``Text``: a number, empty for unset/off), ``empty_cache`` (``Button``).
    limit_label, deferred_label : ipywidgets.HTML
        The absolute limit, and a byte count control's value in bytes (``<name>_label``).
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
        self._specs = model.model(device).controls

        self.device_picker = widgets.Dropdown(
            options=[(name, i) for i, name in enumerate(model.device_names)], value=device,
            description="device", layout=widgets.Layout(display="" if n > 1 else "none"))
        self.limit_label = widgets.HTML()
        self.controls: dict[str, Any] = {}
        self._labels: dict[str, Any] = {}
        settings_row, buttons = [], []
        for spec in self._specs:
            widget = self._make(spec, has_session)
            self.controls[spec.name] = widget
            setattr(self, spec.name, widget)
            if spec.kind == "fraction":
                continue
            (buttons if spec.kind == "button" else settings_row).append(widget)
            if spec.kind == "bytes":
                label = widgets.HTML()
                self._labels[spec.name] = label
                setattr(self, f"{spec.name}_label", label)
                settings_row.append(label)
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
        row2 = widgets.HBox(settings_row, layout=widgets.Layout(**wrap))
        row3 = widgets.HBox([*buttons, self.pause, self.rate], layout=widgets.Layout(**wrap))
        super().__init__(children=(row1, row2, row3, self.error, self.status))

        self.device = device
        self.device_picker.observe(self._on_picker_change, "value")
        for spec in self._specs:
            widget = self.controls[spec.name]
            if spec.kind == "button":
                widget.on_click(lambda _b, spec=spec: self._on_button(spec))
            else:
                widget.observe(lambda change, spec=spec: self._on_setting_change(spec, change),
                               "value")
        self.pause.observe(self._on_pause_change, "value")
        self._remove_listener = model.add_listener(self._on_model_update)
        self.sync()

    @staticmethod
    def _make(spec: Any, has_session: bool) -> Any:
        """The widget of one :class:`~gpudash.models.Control`."""
        text = spec.widget_label or spec.label
        if spec.kind == "fraction":
            return widgets.FloatSlider(
                min=0.05, max=1.0, step=0.01, value=1.0, description=text,
                continuous_update=False, readout_format=".2f", disabled=not has_session,
                style={"description_width": "70px"}, layout=widgets.Layout(width="340px"))
        if spec.kind == "toggle":
            return widgets.ToggleButton(description=text, icon=spec.icon,
                                        disabled=not has_session, tooltip=spec.tooltip)
        if spec.kind == "bytes":
            return widgets.FloatLogSlider(
                base=2, min=math.log2(spec.min), max=math.log2(spec.max), step=0.5,
                value=8 << 20, description=text, continuous_update=False, readout=False,
                disabled=not has_session, style={"description_width": "70px"},
                layout=widgets.Layout(width="300px"))
        if spec.kind == "number":
            return widgets.Text(description=text, placeholder=spec.empty,
                                continuous_update=False, disabled=not has_session,
                                tooltip=spec.tooltip, style={"description_width": "initial"},
                                layout=widgets.Layout(width="300px"))
        return widgets.Button(description=text, icon=spec.icon, tooltip=spec.tooltip,
                              disabled=spec.needs_session and not has_session,
                              layout=widgets.Layout(width="auto"))

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
            self._syncing = True
            try:
                for spec in self._specs:
                    if spec.kind != "button":
                        self._show(spec, s)
            finally:
                self._syncing = False

    def _show(self, spec: Any, s: dict) -> None:
        widget = self.controls[spec.name]
        if spec.kind == "fraction":
            fraction = s["fraction"]
            if not fraction or fraction > 1.0:
                fraction = s["limit"] / s["total"] if s["total"] else 1.0
            # on the slider's grid, so a browser snapping to its step sends no change back
            fraction = round(min(1.0, max(0.05, fraction)), 2)
            limit_text = (f"limit <b>{format_bytes(s['limit'])}</b> of "
                          f"{format_bytes(s['total'])} <small>({s['limit']:,} B)</small>")
            with widget.hold_sync():
                if abs(widget.value - fraction) > 1e-12:
                    widget.value = fraction
                tooltip = f"limit {s['limit']:,} bytes"
                if widget.tooltip != tooltip:
                    widget.tooltip = tooltip
            if self.limit_label.value != limit_text:
                self.limit_label.value = limit_text
            return
        value = s.get(spec.setting)
        if spec.kind == "toggle":
            if widget.value != bool(value):
                widget.value = bool(value)
        elif spec.kind == "bytes":
            if value:
                clamped = min(float(spec.max), max(float(spec.min), float(value)))
                if abs(math.log2(widget.value) - math.log2(clamped)) > 1e-9:
                    widget.value = clamped
                text = f"{format_bytes(value)}"
                if self._labels[spec.name].value != text:
                    self._labels[spec.name].value = text
        elif spec.kind == "number":
            text = "" if value is None or value == spec.empty_value else f"{value:g}"
            if widget.value != text:
                widget.value = text

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

    def _said(self, spec: Any, value: Any, result: Any) -> str:
        """The model's answer for a control, with its warning."""
        answer = self.model.model(self.device).answer(spec.name, value, result,
                                                      self.model.answer_facts(self.device))
        return answer["text"] + (f" - {answer['warning']}" if answer.get("warning") else "")

    def _on_setting_change(self, spec: Any, change: dict) -> None:
        with self._lock:
            if self._syncing:
                return
            value = change["new"]
            if spec.kind == "fraction":
                value = float(value)
            elif spec.kind == "toggle":
                value = bool(value)
            elif spec.kind == "bytes":
                value = int(round(value))

            def act() -> None:
                v = value
                if spec.kind == "number":
                    v = _number(spec, v)
                self.model.model(self.device).check_setting(spec.setting, v)
                self.model.configure(**{spec.setting: v}, device=self._target())
                return v

            self._apply(act, lambda v: self._said(spec, v, None))

    def _on_button(self, spec: Any) -> None:
        self._apply(lambda: getattr(self.model, spec.action)(self._target()),
                    lambda n: self._said(spec, None, n))

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
        for w in (self.device_picker, self.limit_label, *self.controls.values(),
                  *self._labels.values(), self.pause, self.rate, self.error, self.status):
            w.close()
        for row in self.children:
            row.close()
        super().close()

    def __repr__(self) -> str:
        return f"ControlsView(device={self.device}, model={self.model!r})"


def _number(spec: Any, text: str) -> Any:
    """A number field's value: its empty value, an int where it reads as one, else a
    float; a ConfigError naming the control for anything else."""
    text = str(text).strip()
    if not text:
        return spec.empty_value
    try:
        number = float(text)
    except ValueError:
        raise ConfigError(f"{spec.label} must be a number (empty: {spec.empty}); "
                          f"got {text!r}") from None
    return int(number) if number.is_integer() and spec.step == 1 else number
