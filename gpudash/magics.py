"""IPython magics: ``%load_ext gpudash`` registers them, ``%unload_ext gpudash`` removes them.

- ``%gpudash [--fraction F] [--growth/--no-growth] [--simulate SIZE] [--device N]``: create
  (or reuse) the default session and show its dashboard. Without a GPU the session runs on a
  simulated device, and says so once.
- ``%gpudash --allocator torch [--conf PYTORCH_CUDA_ALLOC_CONF] [--fraction F]``: the same
  with PyTorch's caching allocator (:class:`gpudash.session.TorchSession`: the settings
  from ``--conf``, else ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF``); its dashboard
  shows segments and pools and has PyTorch's controls. ``--allocator bfc`` is TensorFlow's.
  When the default session runs the other allocator, a new one replaces it as the default
  (the old one stays open, and a line says so).
- ``%gpudash --watch torch|jax|tensorflow [--device NAME]``: watch that framework's own
  allocator, read-only (:func:`gpudash.watch`; ``--device CPU:0`` watches TensorFlow's CPU
  allocator), in the dashboard.
- ``%gpudash --attach torch [--fraction F] [--device N]``: the PyTorch job running in this
  process, with controls that act on it: shadow mode (:func:`gpudash.torch.attach`); where
  ``gpudash.torch.install()`` put gpudash's allocator under PyTorch, that allocator's own
  dashboard (:meth:`gpudash.torch.InstalledAllocator.dashboard`).
- ``%gpudash`` again on the same session shows the same dashboard (its history carries on).
- ``%gpudash_config key=value ...``: change the live session (``sess.configure``); keys are
  ``per_process_gpu_memory_fraction`` (or ``fraction``), ``allow_growth`` (``growth``),
  ``deferred_deletion_bytes`` (``deferred``, sizes like ``16MiB``) and ``device`` (``1`` or
  ``GPU:1``). Every value is checked first and all bad ones are reported together; nothing
  changes unless all are good. Without arguments it shows the settings in force. A JAX
  session (``Session.from_env("jax")``) also takes, and shows, JAX's names:
  ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 XLA_PYTHON_CLIENT_PREALLOCATE=false``. A PyTorch
  session takes PyTorch's: ``fraction``, ``expandable_segments``, ``max_split_size_mb``
  (``none`` to unset), ``garbage_collection_threshold``, ``roundup_power2_divisions`` and
  ``PYTORCH_CUDA_ALLOC_CONF=...`` (or ``conf=``: ``_set_allocator_settings`` itself);
  TensorFlow's ``allow_growth`` and ``deferred_deletion_bytes`` are refused, saying what
  PyTorch has instead.
- ``%%gpudash_track``: run the cell under recording and show a compact summary (either
  allocator; for PyTorch's, in its words: allocated, reserved).
- ``%gpudash_cells on|off``: a one-line memory summary after every cell.
"""

from __future__ import annotations

import argparse
import shlex
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from ._errors import GpudashError
from ._units import format_bytes
from .style import COLORS, EVENT_TITLE, FONT, unit_for
from .models.base import _FALSE, _TRUE
from .events import EventKind
from .models import model_for
from .monitors import watch
from .options import ConfigProto, framework_changes, framework_settings_text
from .recorder import Recorder
from .report import write_report
from .session import Session, default_session, set_default_session
from . import torch_install, torch_shadow
from .widgets import Dashboard

__all__ = ["GpudashMagics", "load_ipython_extension", "unload_ipython_extension"]

def _parse(parser: argparse.ArgumentParser, line: str, usage: str) -> argparse.Namespace:
    """A magic's arguments; a UsageError naming the magic (and its usage for unknown ones)."""
    try:
        args, extra = parser.parse_known_args(shlex.split(line))
    except (argparse.ArgumentError, ValueError) as exc:
        raise UsageError(f"{parser.prog}: {exc}") from None
    if extra:
        raise UsageError(f"{parser.prog}: unknown arguments {extra}; usage: {usage}")
    return args


def _device_arg(text: str) -> Any:
    """``device=`` as an index (``1``) or a name (``GPU:1``, ``/device:GPU:1``)."""
    try:
        return int(text)
    except ValueError:
        return text


def _cells_line(before: Any, after: Any, seconds: float, words: dict | None = None) -> str:
    """One cell's memory line, in the allocator model's words (PyTorch: allocated,
    reserved)."""
    w = words or {"in_use": "in use", "pool": "pool"}
    delta = after.bytes_in_use - before.bytes_in_use
    sign = "+" if delta >= 0 else "-"
    return (f"gpudash: {w['in_use']} {sign}{format_bytes(abs(delta))} -> "
            f"{format_bytes(after.bytes_in_use)}, peak {format_bytes(after.peak_bytes_in_use)}, "
            f"{w['pool']} {format_bytes(after.pool_bytes)}, "
            f"{after.num_allocs - before.num_allocs} allocation(s), {seconds:.2f} s")


@magics_class
class GpudashMagics(Magics):
    """gpudash's magics (see the module docstring)."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session: Any = None
        self.dashboard: Any = None
        self.monitor: Any = None  # %gpudash --watch
        self.shadow: Any = None   # %gpudash --attach torch
        self._cells_on = False
        self._cell_start: tuple[Any, float] | None = None

    # ------------------------------------------------------------------ session
    def _get_session(self, simulate: Any = None, fraction: float | None = None,
                     growth: bool | None = None, allocator: str | None = None,
                     conf: str | None = None) -> Any:

        want = None if allocator is None else model_for(allocator)
        if self.session is None or self.session.closed:
            self.session = default_session(create=False)
        if self.session is not None and not self.session.closed and (
                want is None or self.session.model is want):
            changes: dict[str, Any] = {}
            if fraction is not None:
                changes["per_process_gpu_memory_fraction"] = fraction
            if growth is not None:
                changes["allow_growth"] = growth
            if conf is not None:
                if "conf" not in self.session.model.setting_names:
                    raise GpudashError("--conf is PYTORCH_CUDA_ALLOC_CONF: it goes with a "
                                       "PyTorch session (--allocator torch)")
                changes["conf"] = conf
            if changes:
                self.session.configure(**changes)
            return self.session
        made = Session.class_for(want) if want is not None else Session
        if not made.takes_config_proto:
            # a model with its own settings string (PyTorch's PYTORCH_CUDA_ALLOC_CONF, or
            # --conf) and the fraction; TensorFlow's growth is refused by name
            if growth is not None:
                want.check_setting("allow_growth", growth)  # refused, saying why
            sess = Session(conf, simulate=simulate, allocator=want.name, fraction=fraction)
        else:
            if conf is not None:
                raise GpudashError("--conf is PYTORCH_CUDA_ALLOC_CONF: it goes with "
                                   "--allocator torch")
            config = ConfigProto(allow_soft_placement=True)
            if fraction is not None:
                config.gpu_options.per_process_gpu_memory_fraction = fraction
            if growth is not None:
                config.gpu_options.allow_growth = growth
            sess = Session(config, simulate=simulate)
        replaced = self.session
        self.session = sess
        set_default_session(sess)
        if replaced is not None and not replaced.closed:
            print(f"gpudash: a new session with {sess.model.title}; the one with "
                  f"{replaced.model.title} stays open (gpudash.default_session() is the new "
                  "one)")
        if not sess.simulated and sess.routes_cupy:
            sess.install()  # CuPy's allocations through the session (TensorFlow's only)
        return sess

    @line_magic
    def gpudash(self, line: str = "") -> Any:
        """Create or reuse the default session and show its dashboard.

        ``%gpudash [--allocator bfc|torch] [--conf PYTORCH_CUDA_ALLOC_CONF] [--fraction F]
        [--growth | --no-growth] [--simulate SIZE] [--device N]``
        """
        parser = argparse.ArgumentParser(prog="%gpudash", add_help=False, exit_on_error=False)
        parser.add_argument("--fraction", type=float, default=None)
        parser.add_argument("--growth", action=argparse.BooleanOptionalAction, default=None)
        parser.add_argument("--simulate", default=None)
        parser.add_argument("--device", default=None)
        parser.add_argument("--watch", default=None, metavar="FRAMEWORK")
        parser.add_argument("--allocator", default=None)
        parser.add_argument("--conf", default=None)
        parser.add_argument("--attach", default=None, metavar="FRAMEWORK")
        args = _parse(parser, line, "%gpudash [--allocator bfc|torch] [--conf "
                                    "PYTORCH_CUDA_ALLOC_CONF] [--fraction F] [--growth|"
                                    "--no-growth] [--simulate SIZE] [--device N] | %gpudash "
                                    "--watch torch|jax|tensorflow [--device NAME] | %gpudash "
                                    "--attach torch [--device N]")
        if args.attach is not None:
            return self._attach(args)
        if args.watch is not None:  # a framework's own allocator, read-only (gpudash.watch)
            if args.allocator is not None or args.conf is not None:
                raise UsageError("%gpudash: --watch reads a framework's own allocator; "
                                 "--allocator and --conf are for gpudash's session")

            if self.monitor is not None:
                self.monitor.stop()
            try:
                devices = None if args.device is None else [args.device]
                self.monitor = watch(args.watch, devices=devices)
                return self.monitor.dashboard()
            except GpudashError as exc:
                raise UsageError(str(exc)) from None
        try:
            device = 0 if args.device is None else int(args.device)
        except ValueError:
            raise UsageError(f"%gpudash: --device must be a device index; got {args.device!r}"
                             " (a framework's device name goes with --watch)") from None
        existing = self.session if self.session is not None and not self.session.closed \
            else None
        try:
            sess = self._get_session(args.simulate, args.fraction, args.growth,
                                     args.allocator, args.conf)
        except (GpudashError, ValueError, OverflowError) as exc:
            raise UsageError(f"%gpudash: {exc}") from None
        try:
            return self._show(sess, device)
        except (GpudashError, ValueError, OverflowError) as exc:
            if sess is not existing:  # made by this call: no half-made default session

                sess.close()
                if default_session(create=False) is sess:
                    set_default_session(None)
                self.session = None
            raise UsageError(f"%gpudash: {exc}") from None

    def _attach(self, args: argparse.Namespace, module: Any = None) -> Any:
        """``%gpudash --attach torch``: shadow mode on this process's PyTorch job, or the
        installed allocator's dashboard where install mode is on."""
        if args.attach != "torch":
            raise UsageError(f"%gpudash: --attach follows a PyTorch job (--attach torch); got "
                             f"{args.attach!r} (other frameworks: --watch)")
        if args.watch is not None or args.allocator is not None or args.conf is not None \
                or args.simulate is not None or args.growth is not None:
            raise UsageError("%gpudash: --attach torch follows the job's own allocator; "
                             "--watch, --allocator, --conf, --simulate and --growth do not go "
                             "with it (change its settings from the dashboard's controls)")

        try:
            device = None if args.device is None else int(args.device)
        except ValueError:
            raise UsageError(f"%gpudash: --device must be a CUDA device index; got "
                             f"{args.device!r}") from None
        handle = torch_install.installed()
        if handle is not None:
            # install mode: the job's allocator is gpudash's own; follow it (PyTorch
            # records no history through a pluggable allocator, so there is no shadow)
            try:
                if args.fraction is not None:
                    handle.set_fraction(args.fraction, device)
                return handle.dashboard(device=device or 0)
            except GpudashError as exc:
                raise UsageError(f"%gpudash: {exc}") from None
        if self.shadow is not None:
            self.shadow.stop()
        try:
            self.shadow = torch_shadow.attach(module)
            if args.fraction is not None:
                self.shadow.configure(fraction=args.fraction, device=device)
            return self.shadow.dashboard(device=device or 0)
        except GpudashError as exc:
            raise UsageError(f"%gpudash: {exc}") from None

    def _show(self, sess: Any, device: int) -> Any:

        dash = self.dashboard
        if dash is not None and not dash.model.closed and dash.model.session is sess:
            # the same session: the same dashboard, its history and plotly.js kept; the
            # front end draws it again from a snapshot
            n = dash.model.num_devices
            if not 0 <= device < n:
                raise UsageError(f"%gpudash: --device must be in 0..{n - 1}; got {device}")
            dash.device = device
            return dash
        if dash is not None:
            dash.close()
            self.dashboard = None
        self.dashboard = Dashboard(sess, device=device)
        return self.dashboard

    @line_magic
    def gpudash_config(self, line: str = "") -> None:
        """Change the live session: ``%gpudash_config fraction=0.3 growth=false``.

        Without arguments, shows the settings in force. Every value is checked before
        anything changes; all the bad ones are reported together."""
        if self.session is None or self.session.closed:
            raise UsageError("no gpudash session yet: run %gpudash first")
        try:
            items = shlex.split(line)
        except ValueError as exc:  # unbalanced quotes
            raise UsageError(f"%gpudash_config: {exc}: {line!r}") from None
        framework = getattr(self.session, "framework", "tensorflow")
        model = self.session.model  # its settings' names and checks (gpudash.models)
        if not items:
            for dev in self.session.devices:
                print(self._settings_line(dev, framework))
            return
        changes: dict[str, Any] = {}
        named: dict[str, str] = {}  # settings under the framework's names (JAX's variables)
        problems: list[str] = []
        for item in items:
            key, sep, value = item.partition("=")
            if sep and framework == "jax" and key.startswith(("XLA_", "TF_")):
                named[key] = value
                continue
            if not sep or (key not in model.setting_names and key != "device"):
                problems.append(f"{item!r} is not key=value with a key among "
                                f"{', '.join(sorted({*model.setting_names, 'device'}))}")
                continue
            try:
                if key == "device":
                    changes["device"] = self.session.device(_device_arg(value)).index
                else:
                    name = model.setting_names[key]
                    changes[name] = model.parse_setting(name, value)
            except (GpudashError, ValueError, IndexError, OverflowError) as exc:
                problems.append(str(exc))
        if named:
            try:

                changes.update(framework_changes(framework, named))
            except GpudashError as exc:
                problems.append(str(exc))
        if not problems:
            # the values against the model's own checks (ranges), all before anything changes
            for k, v in changes.items():
                if k == "device":
                    continue
                try:
                    model.check_setting(k, v)
                except GpudashError as exc:
                    problems.append(str(exc))
        if problems:
            raise UsageError("%gpudash_config changed nothing:\n  " + "\n  ".join(problems))
        if not any(k != "device" for k in changes):
            raise UsageError(
                "%gpudash_config: nothing to change, e.g. %gpudash_config fraction=0.5")
        try:
            self.session.configure(**changes)
        except GpudashError as exc:
            raise UsageError(f"%gpudash_config changed nothing: {exc}") from None
        targets = ([self.session.devices[changes["device"]]] if "device" in changes
                   else self.session.devices)
        for dev in targets:
            print(self._settings_line(dev, framework))

    @staticmethod
    def _settings_line(dev: Any, framework: str) -> str:
        if framework == "jax":

            return f"gpudash ({framework}): {dev.name} " + framework_settings_text(
                framework, dev.options.per_process_gpu_memory_fraction,
                dev.allocator.allow_growth, dev.memory_limit)
        prefix = "gpudash: " if framework == "tensorflow" else f"gpudash ({framework}): "
        return prefix + dev.settings_text()

    @cell_magic
    def gpudash_track(self, line: str, cell: str) -> Any:
        """Run the cell under recording and show a compact memory summary.

        ``%%gpudash_track [--report PATH]``: also write the HTML report of the cell's
        recording (:func:`gpudash.report.write_report`, replayed through the session's own
        allocator model and settings) to ``PATH``, replacing it."""

        parser = argparse.ArgumentParser(prog="%%gpudash_track", add_help=False,
                                         exit_on_error=False)
        parser.add_argument("--report", default=None, metavar="PATH")
        args = _parse(parser, line, "%%gpudash_track [--report PATH]")
        sess = self._get_session()
        before = {d.index: d.stats() for d in sess.devices}
        rec = Recorder(sess)  # the allocator's own stats are left alone
        # the cell's allocations are held by "cell [N]" (Session.label): the chunk map's
        # hover and the summary name them
        label = f"cell [{self._prompt_number()}]"
        t0 = time.perf_counter()
        error = None
        try:
            with sess.label(label):
                self.shell.ex(cell)
        except BaseException as exc:  # shown after the summary
            error = exc
        finally:
            rec.detach()
        summary = TrackSummary.from_recording(rec, sess, before, time.perf_counter() - t0)
        from IPython.display import display

        # Two outputs: front ends show only the richest type of one bundle, and the text
        # must not hide behind the figure.
        print(summary)
        try:
            display(summary.figure())
        except Exception:  # noqa: BLE001 - the text is the summary; the plot is a bonus
            pass
        if args.report is not None:
            self._write_report(rec, args.report)
        if error is not None:
            raise error
        return None

    @staticmethod
    def _write_report(rec: Any, path: str) -> None:
        """The report of a cell's recording, or why there is none (one line either way)."""

        try:
            out = write_report(rec.to_trace(), path, overwrite=True,
                               title="gpudash report: a tracked cell")
        except GpudashError as exc:
            print(f"gpudash_track: no report: {exc}")
        else:
            print(f"gpudash_track: report written to {out}")

    def _prompt_number(self) -> Any:
        """The prompt number (``In [N]``) of the cell running now.

        IPython 9 counts the cell before running it, so ``shell.execution_count`` is the
        next cell's number by then (IPython 8 counted after); the cell's own number is on
        the result the display hook holds while the cell runs. Outside a cell (a direct
        ``run_cell_magic``), the shell's count."""
        result = getattr(getattr(self.shell, "displayhook", None), "exec_result", None)
        count = getattr(result, "execution_count", None)
        if count is None:
            count = getattr(self.shell, "execution_count", None)
        return "?" if count is None else count

    @line_magic
    def gpudash_cells(self, line: str = "") -> None:
        """``%gpudash_cells on|off``: a memory line after every cell."""
        arg = line.strip().lower()
        events = self.shell.events
        if arg in _TRUE:
            if not self._cells_on:
                events.register("pre_run_cell", self._pre_run_cell)
                events.register("post_run_cell", self._post_run_cell)
                self._cells_on = True
            print("gpudash: a memory line after every cell is on (%gpudash_cells off to stop)")
        elif arg in _FALSE:
            was = self._cells_on
            self._cells_off()
            print("gpudash: memory lines after cells are off" if was else
                  "gpudash: memory lines after cells were already off")
        else:
            raise UsageError("usage: %gpudash_cells on|off")

    def _cells_off(self) -> None:
        if self._cells_on:
            self.shell.events.unregister("pre_run_cell", self._pre_run_cell)
            self.shell.events.unregister("post_run_cell", self._post_run_cell)
            self._cells_on = False

    def _pre_run_cell(self, info: Any = None) -> None:
        sess = self._get_session()
        dev = sess.devices[0]
        self._cell_start = (dev.stats(), time.perf_counter())

    def _post_run_cell(self, result: Any = None) -> None:
        if self._cell_start is None or self.session is None or self.session.closed:
            return
        before, t0 = self._cell_start
        self._cell_start = None
        print(_cells_line(before, self.session.devices[0].stats(), time.perf_counter() - t0,
                          self.session.model.words()))

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        self._cells_off()
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        if self.shadow is not None:
            self.shadow.stop()
            self.shadow = None
        if self.dashboard is not None:
            self.dashboard.close()
            self.dashboard = None
        if self.session is not None:
            self.session.uninstall()


class TrackSummary:
    """What ``%%gpudash_track`` shows: change in use, peak, allocations, OOMs, worst
    fragmentation and a small timeline, per device."""

    def __init__(self, rows: list[dict], seconds: float, timeline: dict) -> None:
        self.rows = rows
        self.seconds = seconds
        self.timeline = timeline

    @classmethod
    def from_recording(cls, rec: Any, sess: Any, before: dict, seconds: float) -> "TrackSummary":
        import numpy as np


        cols = rec.columns()
        rows = []
        timeline = {}
        for d in sess.devices:
            mask = cols["device"] == d.index
            kind = cols["kind"][mask]
            size = cols["size"][mask]
            after = d.stats()
            delta = np.where(kind == EventKind.ALLOC, size, 0) - np.where(
                kind == EventKind.FREE, size, 0)
            in_use = before[d.index].bytes_in_use + np.cumsum(delta)
            timeline[d.index] = in_use
            rows.append({
                "device": d.name,
                "in_use_change": after.bytes_in_use - before[d.index].bytes_in_use,
                "in_use": after.bytes_in_use,
                # the cell's own peak, from its events (TensorFlow's peak covers all time)
                "peak": int(in_use.max()) if len(in_use) else after.bytes_in_use,
                "allocations": int((kind == EventKind.ALLOC).sum()),
                "ooms": int((kind == EventKind.OOM).sum()),
                "worst_fragmentation": _worst_fragmentation(d, after),
                "pool": after.pool_bytes,
                "words": d.model.words(),  # PyTorch: allocated, reserved
                # what holds memory at the end of the cell, largest first (Session.label)
                "holders": list(sess.holders(d.index).items())[:5],
            })
        return cls(rows, seconds, timeline)

    def __str__(self) -> str:
        lines = [f"gpudash_track: {self.seconds:.2f} s"]
        for r in self.rows:
            sign = "+" if r["in_use_change"] >= 0 else "-"
            w = r.get("words") or {"in_use": "in use", "pool": "pool"}
            lines.append(
                f"  {r['device']}: {w['in_use']} {sign}"
                f"{format_bytes(abs(r['in_use_change']))} "
                f"(now {format_bytes(r['in_use'])}), peak {format_bytes(r['peak'])}, "
                f"{r['allocations']} allocation(s), {r['ooms']} out of memory, "
                f"worst fragmentation {r['worst_fragmentation']:.1%}, "
                f"{w['pool']} {format_bytes(r['pool'])}")
            if r.get("holders"):
                lines.append("    held now by: " + ", ".join(
                    f"{h} {format_bytes(b)} ({n} block(s))" for h, (b, n) in r["holders"]))
        return "\n".join(lines)

    __repr__ = __str__

    def figure(self) -> Any:
        """A small timeline of bytes in use (PyTorch: allocated) during the cell, one line
        per device."""
        import plotly.graph_objects as go

        top = max((int(s.max()) for s in self.timeline.values() if len(s)), default=1)
        unit, scale = unit_for(top)
        in_use = ((self.rows[0].get("words") if self.rows else None) or {}).get("in_use",
                                                                                "in use")
        fig = go.Figure()
        for r, (_, series) in zip(self.rows, self.timeline.items()):
            fig.add_scatter(y=series / scale, mode="lines", name=r["device"],
                            line={"shape": "hv", "color": COLORS["in use"]
                                  if len(self.rows) == 1 else None},
                            hovertemplate=f"event %{{x}}: %{{y:.2f}} {unit} {in_use}"
                                          "<extra></extra>")
        fig.update_layout(height=160, margin={"l": 60, "r": 10, "t": 24, "b": 20},
                          title={"text": f"bytes {in_use} during the cell",
                                 "font": {"size": 12}},
                          showlegend=len(self.rows) > 1, font={"family": FONT},
                          plot_bgcolor="white")
        fig.update_yaxes(ticksuffix=" " + unit, rangemode="tozero",
                         gridcolor=COLORS["grid"])
        fig.update_xaxes(title_text=EVENT_TITLE, gridcolor=COLORS["grid"])
        return fig


def _worst_fragmentation(dev: Any, stats: Any) -> float:
    """The worst external fragmentation seen: the allocator's figure now (gpudash samples
    it per event in replays; live, the end state is what is known cheaply)."""
    return float(stats.fragmentation)


_MAGICS: dict[int, GpudashMagics] = {}


def load_ipython_extension(ipython: Any) -> None:
    """Called by ``%load_ext gpudash``."""
    magics = GpudashMagics(ipython)
    ipython.register_magics(magics)
    _MAGICS[id(ipython)] = magics


def unload_ipython_extension(ipython: Any) -> None:
    """Called by ``%unload_ext gpudash``: removes the magics, closes the dashboard, stops
    the per-cell lines and restores CuPy's allocator."""
    magics = _MAGICS.pop(id(ipython), None)
    if magics is None:
        return
    magics.close()
    manager = ipython.magics_manager
    for kind in ("line", "cell"):
        table = manager.magics[kind]
        for name in [n for n, fn in table.items() if getattr(fn, "__self__", None) is magics]:
            del table[name]
    manager.registry.pop(type(magics).__name__, None)
