"""The allocator protocol: what every layer above an allocator asks of a model.

gpudash has two allocator models, siblings at the bottom layer: TensorFlow's and JAX's BFC
(:class:`~gpudash.BFCAllocator`) and PyTorch's caching allocator
(:class:`~gpudash.CachingAllocator`). Both have ``allocate``/``try_allocate``/``deallocate``,
events (``subscribe``, batch sinks), ``stats()`` in gpudash's neutral names,
``chunk_table()`` for the views, ``check()`` and a lock. What differs between them is
described here, once, by an :class:`AllocatorModel`:

- its settings and their names in the framework's own language, and how to build one;
- how its layout is drawn (``"bins"``: TensorFlow's 21 size bins; ``"pools"``: PyTorch's
  small and large pools) and what its pieces are called (regions / segments, pool /
  reserved);
- the what-if dimensions worth sweeping, and the lines a user pastes to apply an answer.

Replay, what-if, the live session, the views, the report and the command ask the model of
an allocator or a trace (:func:`model_for`, :func:`trace_model`, :func:`model_of`) instead of
testing which one it is.

The live layers (the session, the live model and its one control path, the dashboard) ask a
model for:

- its :class:`Control` list: what the controls are, what each sets
  (:meth:`gpudash.Session.configure`'s keyword) or calls, and how it is drawn;
- :meth:`AllocatorModel.check_setting` (a value checked before anything changes) and
  :meth:`AllocatorModel.answer` (what a control did, in the framework's words);
- :meth:`AllocatorModel.live_settings` (the settings in force on an allocator) and
  :meth:`AllocatorModel.figures` (its own statistics, under the framework's names);
- the layout's words (:meth:`AllocatorModel.words`), bins or pools (:meth:`bin_labels`,
  :meth:`bin_index`), what kind each region is (:meth:`region_kinds`), the stats rows
  (:meth:`stats_rows`) and the words for a pool above a limit lowered live
  (:meth:`pending_release`, :meth:`limit_banner`);
- its fragmentation figure (:meth:`AllocatorModel.fragmentation` for one state,
  :meth:`AllocatorModel.fragmentation_over` for a run): TensorFlow's external fragmentation
  (``1 - largest free / free``) for the BFC, PyTorch's reserved but unallocated bytes (and
  their share of reserved) for the caching allocator. The dashboard's headline, the report
  and ``explain`` show the figure the model names.

A dump (:class:`~gpudash.MemoryDump`) says its layout (``extra["layout"]``): its model is
:func:`model_of_dump`.

Each model is one module of this package (``bfc.py``: TensorFlow's and JAX's BFC;
``torch.py``: PyTorch's caching allocator) that defines its :class:`AllocatorModel`
subclass, its :class:`ReplaySettings` dataclass and the resolution of its settings, names
its replay loops (pure and compiled) and calls :func:`register`. This module holds the
protocol and the pieces the models share; importing :mod:`gpudash.models` imports every
model module of the package.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .._errors import ConfigError
from .._units import format_bytes

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class _Unset:
    def __repr__(self) -> str:
        return "<default>"


#: A replay setting not given: replay's keywords default to it, and the model's resolution
#: (:meth:`AllocatorModel.resolve`) decides.
UNSET: Any = _Unset()


def recorded_flag(value: Any) -> bool | None:
    """A recorded on/off setting (``allow_growth``, ``garbage_collection``): a boolean
    (numpy's too), None when absent.

    Raises
    ------
    ValueError
        Anything else, the strings ``"true"`` and ``"false"`` included (``bool("false")``
        is True, so a string is not guessed at).
    """
    if value is None or isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":   # numpy's
        return bool(value)
    text = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if isinstance(value, str):
        raise ValueError(f"{text} (a string); expected true or false (JSON booleans)")
    raise ValueError(f"{text}; expected true or false")


def _part(seq: Any, start: int, stop: int) -> list:
    """``seq[start:stop]`` as a list (a replay loop's part of its calls): calls are kept as numpy columns (17 bytes a call) and
    turned into Python ints one chunk at a time, not all at once (~90 bytes a call)."""
    part = seq[start:stop]
    return part.tolist() if isinstance(part, np.ndarray) else part


def fitting_fraction(fraction: float) -> float:
    """The memory fraction to print and to paste for one that fits: rounded *up* to three
    decimals (at most 1), so the limit it gives is never below the one that fitted. Every
    answer that shows a fraction found to fit (``gpudash whatif``, the what-if view, the
    lines to paste) shows this one, through :func:`fraction_text`."""
    value = math.ceil(float(fraction) * 1000 - 1e-9) / 1000
    return min(1.0, max(value, 0.0))


def fraction_text(fraction: float) -> str:
    """:func:`fitting_fraction` as every answer writes it: ``0.954``, ``0.5``, ``1``."""
    return f"{fitting_fraction(fraction):g}"


def _flag_text(setting: str, text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{setting} must be true or false; got {text!r}")


def _number_text(setting: str, text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{setting} must be {what}; got {text!r}") from None


def _b(n: int) -> tuple[str, str]:
    """A byte count for a stats row: ``(format_bytes(n), "n B")``."""
    return format_bytes(int(n)), f"{int(n):,} B"


@dataclass(frozen=True)
class Fragmentation:
    """A model's fragmentation figure for one state, as the views show it.

    Attributes
    ----------
    label : str
        What the figure is called in the framework ("fragmentation"; PyTorch's
        "reserved but unallocated").
    ratio : float
        The figure as a share, 0 to 1 (TensorFlow: ``1 - largest free / free``; PyTorch:
        ``(reserved - allocated) / reserved``); 0 when nothing is free.
    bytes : int or None
        The bytes behind it, where the figure is a byte count (PyTorch's reserved -
        allocated); None for TensorFlow's ratio.
    text : str
        The value as shown: ``"97.5 %"``, ``"1.20 GiB (12.3 % of reserved)"``.
    meaning : str
        How it is computed, for a tooltip or a table's third column.
    """

    label: str
    ratio: float
    bytes: int | None
    text: str
    meaning: str

    def as_dict(self) -> dict[str, Any]:
        """The fields, for the page."""
        return {"label": self.label, "ratio": self.ratio, "bytes": self.bytes,
                "text": self.text, "meaning": self.meaning}


def _external(in_use: int, pool: int, largest_free: int) -> float:
    """TensorFlow's external fragmentation: ``1 - largest free / free`` (0 when nothing is
    free)."""
    free = int(pool) - int(in_use)
    return 1.0 - int(largest_free) / free if free > 0 else 0.0


@dataclass(frozen=True)
class Control:
    """One live control of an allocator model, as the dashboard draws it and
    :meth:`gpudash.live.LiveModel.act` runs it.

    Attributes
    ----------
    name : str
        The control's name on the wire and in the page (``data-ctl``).
    kind : str
        ``"fraction"`` (a slider, 0.01-1), ``"toggle"`` (on/off), ``"bytes"`` (a byte count:
        a number of ``unit`` in the page), ``"number"``
        (a number; an empty field means ``None``) or ``"button"``.
    label : str
        What the dashboard shows.
    setting : str
        The :meth:`gpudash.Session.configure` keyword it sets ("" for a button).
    action : str
        A button's :class:`~gpudash.live.LiveModel` method (``release_free_regions``,
        ``flush_deferred``, ``empty_cache``).
    tooltip : str
        What hovering it says.
    min, max, step : float or None
        A number's range and step.
    unit : int
        Bytes per unit the page shows (a ``"bytes"`` control: 1 MiB).
    needs_session : bool
        It acts on something only a :class:`gpudash.Session` has (deferred frees).
    empty, empty_value
        A number's meaning and value when its field is empty (``"unset"``, None).
    """

    name: str
    kind: str
    label: str
    setting: str = ""
    action: str = ""
    tooltip: str = ""
    min: float | None = None
    max: float | None = None
    step: float | None = None
    unit: int = 1
    needs_session: bool = False
    empty: str = ""
    empty_value: Any = None

    def as_dict(self) -> dict[str, Any]:
        """The fields, for the page."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass(frozen=True)
class AllocatorModel:
    """One allocator model, as the layers above it see it.

    Attributes
    ----------
    name : str
        ``"bfc"`` or ``"torch"``.
    title : str
        How output names it ("PyTorch's caching allocator").
    frameworks : tuple of str
        The frameworks that run it; the first is the default for answers.
    layout : str
        ``"bins"`` or ``"pools"``: what the bins view shows.
    region, regions : str
        What one unit of memory from the device is called ("region" / "segment").
    pool : str
        What the memory held from the device is called ("pool" / "reserved").
    in_use : str
        What the bytes handed to the program are called ("in use" / "allocated").
    grid : dict
        The what-if dimensions :func:`gpudash.trace.whatif.sweep` crosses with the
        fractions by default, with their values.
    fraction_setting : str
        The framework's name for the fraction of the device a process may take.
    chunk : str
        What one piece of a region is called ("chunk" / "block").
    bin : str
        What the bins view groups free pieces by ("bin" / "pool").
    controls : tuple of Control
        The live controls, in the order they are drawn.
    deferred_frees : bool
        Whether a session's frees wait for the device (TensorFlow's deferred deletion) or
        reach the allocator at once (PyTorch).
    setting_names : dict
        The names ``%gpudash_config key=value`` takes, each to the
        :meth:`gpudash.Session.configure` keyword it sets.
    whatif_toggles : tuple of str
        The on/off settings the what-if view offers beside its fraction slider (replay
        settings by name).
    streams : bool
        Its calls run on streams, with ``empty_cache()`` calls among them (a trace's calls
        are read with :func:`gpudash.trace.replay.torch_calls`).
    checkpoints : bool
        A replay's state can be copied (scrubbing keeps checkpoints).
    sweep_words : dict
        A sweep table's words: ``setting`` (its :attr:`grid` setting's column),
        ``unset_fraction`` (a row without a fraction).
    sweep_knobs : tuple of str
        The settings a sweep may also vary (``vary=``), besides the fraction and the
        :attr:`grid` setting.
    cli_flags : tuple of (str, str)
        The command's flags that set this model's settings, each with its attribute of the
        parsed arguments (``("--conf", "conf")``); under another model they are refused.
    cli_words : dict
        The command's words: ``owner`` (whose a flag of this model is, for a refusal),
        ``settings`` (its settings as flags), ``switch`` (how to pick it), ``through`` (how a
        replay line names it), ``smallest`` (what ``whatif``'s answer is the smallest of),
        ``regions`` (what a replay counts it took from the device).
    """

    name: str
    title: str
    frameworks: tuple[str, ...]
    layout: str
    region: str
    regions: str
    pool: str
    in_use: str = "in use"
    grid: dict = field(default_factory=dict)
    fraction_setting: str = ""
    chunk: str = "chunk"
    bin: str = "bin"
    controls: tuple = ()
    deferred_frees: bool = True
    setting_names: dict = field(default_factory=dict)
    whatif_toggles: tuple = ()
    streams: bool = False
    checkpoints: bool = False
    sweep_words: dict = field(default_factory=dict)
    sweep_knobs: tuple = ()
    cli_flags: tuple = ()
    cli_words: dict = field(default_factory=dict)
    #: Whether analysis takes TensorFlow's ``GPUOptions`` (merged over the trace's own
    #: settings); a model without them takes a dict of its replay settings and replays the
    #: trace's calls under them rather than its recorded addresses.
    gpu_options: bool = False

    def __repr__(self) -> str:
        return f"<allocator model {self.name!r}: {self.title}>"

    # ------------------------------------------------------------------ per model
    @property
    def settings_type(self) -> type:  # pragma: no cover - abstract
        """Its :class:`ReplaySettings` class (:class:`BFCReplaySettings`,
        :class:`TorchReplaySettings`)."""
        raise NotImplementedError

    def build(self, settings: dict, sub: Any) -> Any:  # pragma: no cover - abstract
        """An allocator of this model over ``sub`` with replay ``settings`` (as
        :func:`gpudash.trace.replay.resolve_settings` returns them)."""
        raise NotImplementedError

    def limit(self, device_bytes: int, fraction: float | None,
              cc_major: int = 8) -> int:  # pragma: no cover - abstract
        """The bytes an allocator of this model may hold on a device at a fraction."""
        raise NotImplementedError

    def describe(self, settings: dict) -> str:  # pragma: no cover - abstract
        """The settings a replay ran with, in the framework's words."""
        raise NotImplementedError

    # ------------------------------------------------------------------ a replay's settings
    def inputs(self) -> frozenset:  # pragma: no cover - abstract
        """The settings a replay of this model takes by name (replay's keywords, a dict of
        options), ``allocator`` included."""
        raise NotImplementedError

    def resolve(self, trace: Any, index: Any, options: Any,
                explicit: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - abstract
        """This model's resolution of a replay's settings: defaults, what ``trace`` says
        (through ``index``, the trace's :class:`~gpudash.trace.replay.DeviceIndex`: its
        ``pick``, ``settings``, ``recorded``, ``source_limit``, ``capacity`` and
        ``peak_reserved``), ``options`` and the ``explicit`` keywords (:data:`UNSET` where
        not given), as a dict of :attr:`settings_type`'s fields."""
        raise NotImplementedError

    def owner_of(self, setting: str) -> AllocatorModel | None:
        """Another model whose replay takes ``setting`` and this one's does not."""
        if setting in self.inputs():
            return None
        return next((m for m in MODELS.values() if m is not self and setting in m.inputs()),
                    None)

    def trace_capacity(self, index: Any, device: int) -> tuple[int, str] | None:
        """The device memory a trace of this model shows for ``device``, and how (None: it
        does not say)."""
        return None

    # ------------------------------------------------------------------ the command
    def cli_kwargs(self, args: Any, recorded: dict) -> dict[str, Any]:  # pragma: no cover
        """The replay settings the command's flags (``args``, parsed) give for this model;
        ``recorded``: the trace's settings of the device (:func:`trace_settings`)."""
        raise NotImplementedError

    def settings_text(self, options: dict, fraction: bool = True) -> str:
        """A replay's settings (``ReplayResult.options``) in the framework's words, as the
        command prints them (``fraction``: with the fraction)."""
        return self.describe(options)

    def toggle_on(self, settings: dict, toggle: str) -> bool:
        """Whether a what-if toggle (:attr:`whatif_toggles`) is on in a replay's settings
        (``for_meta``'s dict)."""
        return bool(settings.get(toggle))

    def refuse_flags(self, args: Any) -> str | None:
        """The refusal of another model's flag given to a command that runs this one, or
        None."""
        for other in MODELS.values():
            if other is self:
                continue
            for flag, attr in other.cli_flags:
                if getattr(args, attr, None) is not None:
                    return (f"{flag} is {other.cli_words['owner']}; this replays {self.title} "
                            f"({self.cli_words['settings']}; {other.cli_words['switch']})")
        return None

    # ------------------------------------------------------------------ a replay's allocator
    def loop(self, settings: Any) -> str:  # pragma: no cover - abstract
        """The replay loop that runs these settings: ``plain``, ``deferred`` (the BFC's,
        frees held back) or ``torch`` (calls on streams); the replay engine runs its
        pure-Python loop or the compiled core's twin of it (``run_bfc``,
        ``run_bfc_deferred``, ``run_torch``)."""
        raise NotImplementedError

    def made(self, meta: dict) -> bool:
        """Whether this model's allocator made a trace with this ``meta`` (the default
        model, the BFC, is the answer when none says so)."""
        return False

    def runner(self, settings: Any, compiled: bool) -> Any:  # pragma: no cover - abstract
        """The replay loop of :meth:`loop`: a function ``run(engine, start, stop, sample,
        max_ooms)`` over a replay engine (:class:`gpudash.trace.replay._Engine`), the
        pure-Python loop or, for a ``compiled`` allocator, its twin in the compiled core.
        The model's module defines both."""
        raise NotImplementedError

    def clone(self, allocator: Any, sub: Any) -> Any:
        """An independent copy of an idle allocator of this model over ``sub`` (replay's
        checkpoints; :attr:`checkpoints` says whether the model has them).

        Raises
        ------
        NotImplementedError
            The model has no copy, or this allocator cannot be copied (callers replay from
            the start instead).
        """
        raise NotImplementedError(f"{self.title} has no copy of its state")

    def keep_history(self, allocator: Any, entries: int) -> None:
        """Before a recorded replay: keep the allocator's own history (PyTorch's
        ``record_history``); nothing for the BFC."""

    def history(self, allocator: Any) -> dict | None:
        """After a replay: the allocator's own snapshot of it (PyTorch's), or None."""
        return None

    def dump(self, allocator: Any) -> Any:
        """The allocator's state as gpudash's neutral :class:`~gpudash.MemoryDump`."""
        return allocator.snapshot()

    def device_calls(self, allocator: Any, sub: Any) -> tuple[int, int]:
        """``(regions obtained, regions returned)`` over a replay: the sub-allocator's
        counts, or the allocator's own where it keeps them (PyTorch's ``num_device_*``)."""
        return sub.extensions, sub.releases

    def result_sizes(self, result: Any) -> str:
        """A :class:`~gpudash.trace.replay.ReplayResult`'s sizes, in the framework's names."""
        return (f"peak_pool={format_bytes(result.peak_pool_bytes)}, "
                f"peak_in_use={format_bytes(result.peak_bytes_in_use)}, "
                f"extensions={result.extensions}")

    def recorded(self, allocator: Any) -> dict[str, Any]:
        """What a recording's ``meta["devices"]`` entry says of the allocator beyond its
        index, name, capacity and limit: its settings (``options``; PyTorch's with its
        model's name)."""
        raise NotImplementedError  # pragma: no cover - abstract

    # ------------------------------------------------------------------ the report
    def report_summary(self, result: Any, device_bytes: int,
                       verdict: str) -> list[tuple[str, str]]:
        """The report's summary rows of a replay, in the framework's names."""
        pc = result.per_call
        return [
            ("device", format_bytes(device_bytes)),
            ("memory limit", format_bytes(result.memory_limit)),
            ("allow_growth", str(result.options.get("allow_growth"))),
            ("calls replayed", f"{result.calls:,}"),
            ("peak in use", format_bytes(result.peak_bytes_in_use)),
            ("peak pool", format_bytes(result.peak_pool_bytes)),
            ("regions obtained", str(result.extensions)),
            self.fragmentation_over(pc.get("in_use", ()), pc.get("pool", ()),
                                    pc.get("largest_free", ())),
            ("result", verdict),
        ]

    def peak_options(self, result: Any) -> dict | None:
        """Replay settings to rebuild the report's state at the peak from the trace's own
        calls (PyTorch's pools and segments), or None to take it from the replay's
        recording."""
        return None

    def report_sweep(self, options: dict, result: Any) -> dict[str, Any]:
        """The report's what-if question, as :func:`~gpudash.trace.whatif.sweep` keywords
        (besides the fractions and the device): the BFC's growth as replayed."""
        return {"allow_growth": (options.get("allow_growth", True),),
                **{k: v for k, v in options.items() if k in ("device", "garbage_collection")}}

    def paste_lines(self, framework: str, fraction: float, settings: dict,
                    device_bytes: int) -> list[str]:  # pragma: no cover - abstract
        """The lines a user pastes to run at ``fraction`` with ``settings``."""
        raise NotImplementedError

    def check_fraction(self, fraction: float | None) -> None:
        """Refuse a fraction the framework does not take (:class:`~gpudash.ConfigError`);
        the BFC takes any (above 1: unified memory)."""

    def meta_settings(self, options: dict) -> dict:
        """Settings as :meth:`paste_lines` and :meth:`describe` take them, from their
        JSON form (:meth:`ReplaySettings.for_meta`, a result's ``options``)."""
        return dict(options)

    # ------------------------------------------------------------------ the live layers
    def control(self, name: str) -> Control | None:
        """The :class:`Control` called ``name``, or None."""
        return next((c for c in self.controls if c.name == name), None)

    def words(self) -> dict[str, str]:
        """What the views call things: ``in_use``, ``pool``, ``region``, ``regions``,
        ``chunk``, ``bin``, ``peak``, ``unset_fraction`` (the fraction's readout when
        unset), ``title``, ``map``, ``bins`` and ``bins_axis`` (the layout views' titles)."""
        return {"in_use": self.in_use, "pool": self.pool, "region": self.region,
                "regions": self.regions, "chunk": self.chunk, "bin": self.bin,
                "peak": "peak", "unset_fraction": "auto", "title": self.title,
                "map": "chunk map", "bins": "bins", "bins_axis": "bin (chunk size)"}

    def bin_labels(self) -> list[str]:  # pragma: no cover - abstract
        """The labels of the bins view's bars (TensorFlow's 21 bins, PyTorch's 2 pools)."""
        raise NotImplementedError

    def bin_index(self, table: dict) -> Any:  # pragma: no cover - abstract
        """The bar of the bins view each chunk of a chunk table counts in (an int array)."""
        raise NotImplementedError

    def region_kinds(self, table: dict) -> list[str] | None:
        """Words for each region of a chunk table (PyTorch: its pool, expandable or
        not); None when regions have no kinds."""
        return None

    def live_settings(self, allocator: Any) -> dict[str, Any]:  # pragma: no cover
        """The settings in force on a live allocator, by their :class:`Control` settings
        (plus ``limit``)."""
        raise NotImplementedError

    def check_setting(self, setting: str, value: Any) -> None:  # pragma: no cover
        """Refuse a value (:class:`~gpudash.ConfigError`, naming it) before anything
        changes."""
        raise NotImplementedError

    def answer(self, name: str, value: Any, result: Any,
               settings: dict) -> dict[str, str]:  # pragma: no cover - abstract
        """What a control did, in words: ``{"text": ..., "warning": ...}`` (warning
        optional). ``result`` is what its action returned (bytes released for a button),
        ``settings`` the device's settings afterwards (``LiveModel.answer_facts``: the
        settings, ``pending``/``held``, ``regions`` as the map draws them, the figures)."""
        raise NotImplementedError

    def parse_setting(self, setting: str, text: str) -> Any:  # pragma: no cover - abstract
        """The value of ``setting`` (a :meth:`gpudash.Session.configure` keyword) written as
        text (``%gpudash_config``); a :class:`~gpudash.ConfigError` naming it otherwise."""
        raise NotImplementedError

    def fraction_line(self, fraction: float, settings: dict) -> str:
        """The line that sets ``fraction`` in the framework, where one call does it ("" for
        TensorFlow, whose fraction is a ``ConfigProto`` field read at start)."""
        return ""

    def figures(self, allocator: Any) -> dict[str, Any]:
        """The allocator's own statistics the views show beside gpudash's neutral ones,
        under the framework's names (none for the BFC: its stats are TensorFlow's)."""
        return {}

    def stats_rows(self, state: Any) -> list[tuple[str, str, str]]:  # pragma: no cover
        """``(label, value, exact)`` rows of a live device state for the stats table."""
        raise NotImplementedError

    def headline(self, state: Any) -> list[list[str]]:
        """Extra ``[label, value]`` items of the dashboard's headline (none for the BFC)."""
        return []

    def pending_release(self, allocator: Any) -> tuple[int, int]:
        """``(bytes, regions)`` the pool is above a limit lowered live, held by regions
        that still hold memory in use."""
        return allocator.pending_release()

    def fragmentation(self, in_use: int, pool: int, largest_free: int) -> Fragmentation:
        """The fragmentation figure of one state (bytes in use, held, and the largest free
        piece): TensorFlow's external fragmentation, ``1 - largest free / free``."""
        ratio = _external(in_use, pool, largest_free)
        return Fragmentation("fragmentation", ratio, None, f"{100.0 * ratio:.1f} %",
                             "1 - largest free chunk / free bytes in the pool "
                             "(TensorFlow's external fragmentation)")

    def fragmentation_over(self, in_use: Any, pool: Any,
                           largest_free: Any) -> tuple[str, str]:
        """``(label, text)`` of the worst fragmentation over a run, from per-call arrays
        (a replay's ``per_call``): TensorFlow's, the highest external fragmentation."""
        import numpy as np

        in_use, pool, lf = (np.asarray(a, dtype=np.int64) for a in (in_use, pool, largest_free))
        free = pool - in_use
        with np.errstate(divide="ignore", invalid="ignore"):
            frag = np.where(free > 0, 1.0 - lf / np.where(free > 0, free, 1), 0.0)
        return "worst external fragmentation", f"{float(frag.max(initial=0.0)):.1%}"

    def limit_banner(self, pool: int, limit: int, pending: int, held: int) -> str:
        """The words for a pool above a limit lowered live ("" when it is not)."""
        return ""


@dataclass(frozen=True, repr=False)

class ReplaySettings(Mapping):
    """The settings of one replay, resolved: a frozen dataclass per model
    (:class:`BFCReplaySettings`, :class:`TorchReplaySettings`) that
    :func:`gpudash.trace.replay.resolve_settings` returns and every replay, what-if row and
    probe runs with.

    It reads as the dict it once was (``settings["fraction"]``, ``settings.get("conf")``,
    ``dict(settings)``; ``settings["allocator"]`` is the model's name), and changes only by
    :meth:`replace`. :meth:`of` turns such a dict back into settings, once, at the edge of
    the functions that take one. What a model's settings are called in its framework is its
    :attr:`WORDS` table.
    """

    #: The :data:`MODELS` key of the model these settings are for.
    model_name: ClassVar[str] = ""
    #: Each setting's name in the framework's own words.
    WORDS: ClassVar[dict[str, str]] = {}
    #: Settings a dict may carry that resolution folds into others (PyTorch's knobs by name,
    #: into ``conf``): accepted by :meth:`of`.
    FOLDED: ClassVar[tuple[str, ...]] = ()

    @property
    def model(self) -> AllocatorModel:
        """The :class:`AllocatorModel` these settings are for."""
        return MODELS[self.model_name]

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings' names, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    # -- the mapping they read as
    def __getitem__(self, key: str) -> Any:
        if key == "allocator":
            return self.model_name
        if key in self.names():
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Any:
        yield "allocator"
        yield from self.names()

    def __len__(self) -> int:
        return 1 + len(self.names())

    def replace(self, **changes: Any) -> ReplaySettings:
        """A copy with ``changes`` (setting names as keywords)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    @classmethod
    def of(cls, value: Any) -> ReplaySettings:
        """Settings from resolved settings or their dict (``{"allocator": ..., ...}``, as
        ``dict(settings)`` gives it); the model is the dict's ``allocator`` (BFC without one).

        Raises
        ------
        ConfigError
            A key that is not a setting of the model (the message lists the known ones),
            or a missing one.
        """
        if isinstance(value, ReplaySettings):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"replay settings must be a ReplaySettings or a dict of them; "
                              f"got {type(value).__name__}")
        model = model_for(value.get("allocator") or _default())
        kind = model.settings_type
        fields = {f.name: f for f in dataclasses.fields(kind)}
        unknown = sorted(k for k in value if k not in fields and k != "allocator"
                         and k not in kind.FOLDED)
        if unknown:
            raise ConfigError(f"unknown replay setting(s) {unknown} of {model.title}; known: "
                              f"{sorted(fields)}")
        args = {k: v for k, v in value.items() if k in fields}
        missing = sorted(k for k, f in fields.items() if k not in args
                         and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ConfigError(f"replay settings of {model.title} lack {missing} (resolve them "
                              "with gpudash.trace.replay.resolve_settings)")
        return kind._from_dict(args, {k: value[k] for k in kind.FOLDED if k in value})

    @classmethod
    def _from_dict(cls, args: dict, folded: dict) -> ReplaySettings:
        return cls(**args)

    # -- what the layers above ask of them
    def limit(self, fraction: float | None) -> int:
        """The limit these settings give at ``fraction`` (the model's rule)."""
        return self.model.limit(self.device_bytes, fraction,  # type: ignore[attr-defined]
                                int(getattr(self, "cc_major", 8) or 8))

    def for_meta(self) -> dict[str, Any]:  # pragma: no cover - abstract
        """The settings as a JSON-friendly dict (:attr:`ReplayResult.options`)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The settings, in the framework's words."""
        return self.model.describe(self)

    def paste_lines(self, framework: str, fraction: float) -> list[str]:
        """The lines a user pastes to run at ``fraction`` with these settings."""
        return self.model.paste_lines(framework, fraction, self,
                                      self.device_bytes)  # type: ignore[attr-defined]

    def row(self) -> dict[str, Any]:  # pragma: no cover - abstract
        """A what-if row's setting columns besides the fraction (:attr:`AllocatorModel.grid`'s
        setting, and what the sweep varied)."""
        raise NotImplementedError

    def unsupported(self) -> str | None:
        """The framework's rule against these settings together, or None."""
        return None


def replay_settings(value: Any) -> ReplaySettings:
    """:meth:`ReplaySettings.of`: resolved settings from settings or their dict."""
    return ReplaySettings.of(value)


# ------------------------------------------------------------------------------ the models
#: Every model by name (a model module adds itself with :func:`register`).
MODELS: dict[str, AllocatorModel] = {}
#: Each name :func:`model_for` takes, to its model.
_ALIASES: dict[str, AllocatorModel] = {}
#: The model of a trace or allocator that names none (the BFC).
_DEFAULT: list[AllocatorModel] = []


def register(model: AllocatorModel, *, aliases: tuple[str, ...] = (),
             default: bool = False) -> AllocatorModel:
    """Add a model: :data:`MODELS` under its name, :func:`model_for` under its name,
    ``aliases`` and its frameworks; ``default`` makes it the model of what names none."""
    MODELS[model.name] = model
    for name in (model.name, *aliases, *model.frameworks):
        _ALIASES[name.lower()] = model
    if default:
        _DEFAULT[:] = [model]
    return model


def default_model() -> AllocatorModel:
    """The model of a trace or allocator that names none (TensorFlow's BFC)."""
    return _DEFAULT[0] if _DEFAULT else next(iter(MODELS.values()))


_default = default_model


def model_for(name: Any) -> AllocatorModel:
    """The model a name means: ``"bfc"``, ``"tensorflow"``, ``"jax"`` -> BFC;
    ``"torch"``, ``"pytorch"`` -> PyTorch's caching allocator (an :class:`AllocatorModel`
    is returned as it is).

    Raises
    ------
    ConfigError
        Any other name, with the accepted ones.
    """
    if isinstance(name, AllocatorModel):
        return name
    model = _ALIASES.get(name.lower()) if isinstance(name, str) else None
    if model is None:
        known = "; ".join(
            f"{m.name!r} ({m.title}; also "
            + ", ".join(repr(a) for a, v in _ALIASES.items() if v is m and a != m.name) + ")"
            for m in MODELS.values())
        raise ConfigError(f"allocator must be one of {known}; got {name!r}")
    return model


def trace_model(trace: Any) -> AllocatorModel:
    """The model of the allocator that made a trace: the first model that says it made it
    (:meth:`AllocatorModel.made`: PyTorch's for a PyTorch snapshot, a trace saved from one
    and a gpudash recording whose devices all ran PyTorch's model), else the BFC."""
    meta = getattr(trace, "meta", {}) or {}
    return next((m for m in MODELS.values() if m.made(meta)), None) or _default()


def model_of(allocator: Any) -> AllocatorModel:
    """The model of a live allocator: the one its class names (``allocator_model``, a
    :data:`MODELS` key). A stand-in that is no gpudash allocator (a feed's, a proxy's) may
    name it by ``kind`` instead; anything else is taken for the BFC."""
    name = getattr(type(allocator), "allocator_model", None) or getattr(allocator, "kind", None)
    return MODELS.get(name, _default()) if isinstance(name, str) else _default()


def device_meta(alloc: Any) -> dict:
    """What a trace keeps of one live allocator's device: its index, name, capacity and limit,
    and the model's own settings (:meth:`AllocatorModel.recorded`)."""
    meta = {"index": alloc.device_index, "name": alloc.name,
            "capacity": getattr(alloc.sub_allocator, "total", None),
            "memory_limit": alloc.memory_limit}
    meta.update(model_of(alloc).recorded(alloc))
    return meta


def model_of_dump(dump: Any) -> AllocatorModel:
    """The model of a :class:`~gpudash.MemoryDump`, by the layout it says
    (``extra["layout"]``: ``"pools"`` for PyTorch's caching allocator; TensorFlow's bins
    otherwise)."""
    layout = (getattr(dump, "extra", None) or {}).get("layout")
    return next((m for m in MODELS.values() if m.layout == layout), _default())
