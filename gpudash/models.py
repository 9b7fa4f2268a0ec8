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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._errors import ConfigError
from ._units import format_bytes

__all__ = ["AllocatorModel", "Control", "Fragmentation", "ReplaySettings", "BFCReplaySettings",
           "TorchReplaySettings", "BFC", "TORCH", "MODELS", "model_for", "trace_model",
           "model_of", "model_of_dump", "replay_settings"]


#: TensorFlow's number of BFC bins (256 B << b, the last one open-ended).
_NUM_BINS = 21
#: PyTorch's two pools, as the bins view names them.
_POOLS = ("small pool (≤ 1 MiB)", "large pool")
#: The caching-allocator settings a live session changes by name.
_LIVE_PARTS = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold",
               "roundup_power2_divisions", "max_non_split_rounding_mb")
#: TensorFlow's settings a PyTorch session refuses, and what PyTorch has instead.
TF_ONLY = {
    "allow_growth": (
        "allow_growth is TensorFlow's setting: PyTorch's caching allocator always grows on "
        "demand (a segment is cudaMalloc'd when a request needs one); cap it with the fraction "
        "(per_process_gpu_memory_fraction, torch.cuda.set_per_process_memory_fraction) and "
        "give cached memory back with empty_cache()"),
    "deferred_deletion_bytes": (
        "deferred_deletion_bytes is TensorFlow's setting: PyTorch frees a block at once (the "
        "stream's order keeps its reuse safe), so there is no queue to tune; empty_cache() "
        "returns cached segments to the device"),
}
#: ``memory_stats()`` keys the live views show.
_FIGURES = ("allocated_bytes.all.current", "allocated_bytes.all.peak",
            "reserved_bytes.all.current", "reserved_bytes.all.peak", "segment.all.current",
            "segment.small_pool.current", "segment.large_pool.current",
            "allocation.all.current", "inactive_split_bytes.all.current",
            "requested_bytes.all.current", "num_alloc_retries", "num_ooms",
            "num_device_alloc", "num_device_free", "num_sync_all_streams")
_COUNTERS = {"num_alloc_retries": "requests that freed the cache and tried again",
             "num_ooms": "out-of-memory errors raised",
             "num_device_alloc": "cudaMalloc calls (and pages mapped)",
             "num_device_free": "cudaFree calls (and pages unmapped)"}


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


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

    # ------------------------------------------------------------------ a replay's allocator
    def loop(self, settings: Any) -> str:  # pragma: no cover - abstract
        """The replay loop that runs these settings: ``plain``, ``deferred`` (the BFC's,
        frees held back) or ``torch`` (calls on streams); the replay engine runs its
        pure-Python loop or the compiled core's twin of it (``run_bfc``,
        ``run_bfc_deferred``, ``run_torch``)."""
        raise NotImplementedError

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
class _BFCModel(AllocatorModel):
    @property
    def settings_type(self) -> type:
        return BFCReplaySettings

    def build(self, settings: dict, sub: Any) -> Any:
        from .bfc import BFCAllocator

        dev = int(settings.get("device") or 0)
        alloc = BFCAllocator(sub, settings["memory_limit"], allow_growth=settings["allow_growth"],
                             garbage_collection=settings["garbage_collection"],
                             fragmentation_fraction=settings["fragmentation_fraction"],
                             name=settings.get("name") or f"GPU_{dev}_bfc")
        alloc.device_index = dev
        return alloc

    def limit(self, device_bytes: int, fraction: float | None, cc_major: int = 8) -> int:
        """TensorFlow's limit rule (None: its default, free memory minus the reserve)."""
        from .options import memory_limit

        return memory_limit(device_bytes, device_bytes, fraction or 0.0, cc_major, environ={})

    def describe(self, settings: dict) -> str:
        return (f"allow_growth={settings['allow_growth']}"
                + (f", garbage_collection={settings['garbage_collection']}"
                   if settings.get("garbage_collection") else ""))

    def paste_lines(self, framework: str, fraction: float, settings: dict,
                    device_bytes: int) -> list[str]:
        """TensorFlow's or JAX's lines (:func:`gpudash.options.restart_lines`)."""
        from .options import restart_lines

        growth = bool(settings.get("allow_growth"))
        return restart_lines(framework, fraction, growth, total=device_bytes)[:-1]

    # ------------------------------------------------------------------ the live layers
    def bin_labels(self) -> list[str]:
        """TensorFlow's 21 bins: ``256B``, ``512B``, ``1KiB`` ... ``256MiB+``."""
        out = []
        for b in range(_NUM_BINS):
            n = 256 << b
            for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
                if n >= 1 << shift:
                    label = f"{n >> shift}{unit}"
                    break
            else:
                label = f"{n}B"
            out.append(label + ("+" if b == _NUM_BINS - 1 else ""))
        return out

    def bin_index(self, table: dict) -> Any:
        """TensorFlow's ``BinNumForSize`` of each chunk's size."""
        import numpy as np

        from ._eventsource import _bins_of

        return _bins_of(np.asarray(table["size"], dtype=np.int64)).astype(np.intp)

    def live_settings(self, allocator: Any) -> dict[str, Any]:
        return {"limit": allocator.memory_limit, "allow_growth": allocator.allow_growth}

    def loop(self, settings: Any) -> str:
        return "deferred" if settings["deferred_deletion_bytes"] > 0 else "plain"

    def recorded(self, allocator: Any) -> dict[str, Any]:
        return {"options": {"allow_growth": allocator.allow_growth,
                            "garbage_collection": allocator.garbage_collection}}

    def check_setting(self, setting: str, value: Any) -> None:
        """A session's own checks (:class:`~gpudash.GPUOptions`), no coercion."""
        from .options import GPUOptions

        GPUOptions().copy(**{setting: value})

    def parse_setting(self, setting: str, text: str) -> Any:
        """``allow_growth``: true/false (1/0, yes/no, on/off); the fraction: a number;
        ``deferred_deletion_bytes``: a size (``16MiB``)."""
        from ._units import parse_bytes

        if setting == "allow_growth":
            return _flag_text(setting, text)
        if setting == "per_process_gpu_memory_fraction":
            return _number_text(setting, text, "a number >= 0")
        if setting == "deferred_deletion_bytes":
            return parse_bytes(text, name="deferred_deletion_bytes")
        raise ConfigError(f"unknown setting {setting!r}")

    def answer(self, name: str, value: Any, result: Any, settings: dict) -> dict[str, str]:
        pending, held = settings.get("pending", 0), settings.get("held", 0)
        if name == "fraction":
            out = {"text": f"fraction {float(value):.3f}: limit "
                           f"{format_bytes(settings['limit'])}"}
            if pending:
                out["warning"] = (f"pool is {format_bytes(pending)} above the new limit: "
                                  f"allocations past the limit are refused, and {held} "
                                  "region(s) go back as they empty")
            return out
        if name == "growth":
            return {"text": "growth: " + ("on" if value else "off")}
        if name == "deferred":
            eff = settings.get("deferred_deletion_bytes")
            return {"text": f"deferred deletion: {format_bytes(eff or 0)}"}
        if name == "release":
            if result:
                return {"text": f"released {format_bytes(result)}"}
            why = "no region is wholly free"
            if pending:
                why += (f"; {format_bytes(pending)} above the limit wait in {held} region(s) "
                        "that still hold memory in use")
            return {"text": f"released 0 B: {why}"}
        if name == "flush":
            if result:
                return {"text": f"flushed {format_bytes(result)} of deferred frees"}
            return {"text": "flushed 0 B: no frees were waiting"}
        raise ConfigError(f"unknown control {name!r}")

    def stats_rows(self, state: Any) -> list[tuple[str, str, str]]:
        """TensorFlow's ``AllocatorStats``, then fragmentation (external, internal, pool -
        in use), chunks and OOMs."""
        s = state.stats
        c = state.counters
        return [
            ("num_allocs", f"{s.num_allocs:,}", ""),
            ("bytes_in_use", *_b(s.bytes_in_use)),
            ("peak_bytes_in_use", *_b(s.peak_bytes_in_use)),
            ("largest_alloc_size", *_b(s.largest_alloc_size)),
            ("bytes_limit", *_b(s.bytes_limit)),
            ("pool_bytes", *_b(s.pool_bytes)),
            ("peak_pool_bytes", *_b(s.peak_pool_bytes)),
            ("largest_free_block_bytes", *_b(s.largest_free_block_bytes)),
            ("external fragmentation", f"{s.fragmentation:.1%}", "1 - largest free / free"),
            ("internal fragmentation", *_b(state.internal_fragmentation)),
            ("pool - in use", *_b(state.reserved_unused)),
            ("chunks", f"{state.num_chunks:,}", f"{int(state.table['in_use'].sum()):,} in use"),
            ("OOMs", f"{c['ooms']:,}", "since the model started"),
        ]

    def limit_banner(self, pool: int, limit: int, pending: int, held: int) -> str:
        if not pending:
            return ""
        return (f"pool above limit: {format_bytes(pool)} held against a {format_bytes(limit)} "
                f"limit. {format_bytes(pending)} wait to be returned: {held} region(s) still "
                "hold memory in use, and each goes back when it empties. Allocations that "
                "would take bytes in use past the limit are refused.")


@dataclass(frozen=True, repr=False)
class _TorchModel(AllocatorModel):
    @property
    def settings_type(self) -> type:
        return TorchReplaySettings

    def build(self, settings: dict, sub: Any) -> Any:
        from .caching import CachingAllocator

        dev = int(settings.get("device") or 0)
        alloc = CachingAllocator(sub, settings["conf"], fraction=settings["fraction"],
                                 name=settings.get("name") or f"cuda:{dev}", device=dev)
        alloc.device_index = dev
        return alloc

    def limit(self, device_bytes: int, fraction: float | None, cc_major: int = 8) -> int:
        """PyTorch's ``allowed_memory_maximum`` (None: the whole device)."""
        return device_bytes if fraction is None else int(fraction * device_bytes)

    def describe(self, settings: dict) -> str:
        conf = settings.get("conf")
        text = conf.as_conf() if conf is not None else ""
        frac = settings.get("fraction")
        parts = [f"PYTORCH_CUDA_ALLOC_CONF={text}" if text else "PYTORCH_CUDA_ALLOC_CONF unset"]
        parts.append("no set_per_process_memory_fraction" if frac is None else
                     f"set_per_process_memory_fraction({frac:g})")
        if conf is not None:
            parts.append(f"PyTorch {conf.version[0]}.{conf.version[1]} rules")
        return ", ".join(parts)

    def check_fraction(self, fraction: float | None) -> None:
        if fraction is not None and not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"fraction is torch.cuda.set_per_process_memory_fraction's, "
                              f"in [0, 1]; got {fraction!r}")

    def meta_settings(self, options: dict) -> dict:
        """``conf`` back to a :class:`~gpudash.CachingAllocatorConfig` of its version."""
        from ._torch_conf import CachingAllocatorConfig

        conf = CachingAllocatorConfig(options.get("conf") or None,
                                      version=options.get("torch_version"))
        return {**options, "conf": conf}

    def loop(self, settings: Any) -> str:
        return "torch"

    def keep_history(self, allocator: Any, entries: int) -> None:
        allocator.record_history(True, max_entries=entries)

    def history(self, allocator: Any) -> dict | None:
        return allocator.snapshot()

    def dump(self, allocator: Any) -> Any:
        return allocator.memory_dump()

    def device_calls(self, allocator: Any, sub: Any) -> tuple[int, int]:
        st = allocator.memory_stats()
        return st["num_device_alloc"], st["num_device_free"]

    def result_sizes(self, result: Any) -> str:
        """``memory_stats()``'s names: peak reserved and allocated, ``num_device_alloc``
        (and whether an exact replay followed the snapshot)."""
        sizes = (f"peak_reserved={format_bytes(result.peak_pool_bytes)}, "
                 f"peak_allocated={format_bytes(result.peak_bytes_in_use)}, "
                 f"num_device_alloc={result.extensions}")
        if result.fidelity is not None:
            sizes += f", exact={result.fidelity.exact}"
        return sizes

    def recorded(self, allocator: Any) -> dict[str, Any]:
        conf = allocator.config
        return {"allocator": self.name,
                "options": {"conf": conf.as_conf(), "fraction": allocator.fraction,
                            "torch_version": ".".join(map(str, conf.version))}}

    def report_summary(self, result: Any, device_bytes: int,
                       verdict: str) -> list[tuple[str, str]]:
        """PyTorch's names: PYTORCH_CUDA_ALLOC_CONF, set_per_process_memory_fraction,
        allocated and reserved, cudaMalloc'd segments (and how exactly a snapshot was
        followed)."""
        pc = result.per_call
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
            self.fragmentation_over(pc.get("in_use", ()), pc.get("pool", ()),
                                    pc.get("largest_free", ())),
            ("result", verdict),
        ]
        if result.fidelity is not None:
            summary.insert(5, ("replayed exactly", result.fidelity.summary()))
        return summary

    def peak_options(self, result: Any) -> dict | None:
        return {k: v for k, v in result.options.items()
                if k in ("device_bytes", "fraction", "conf", "torch_version", "device")}

    def report_sweep(self, options: dict, result: Any) -> dict[str, Any]:
        """PyTorch's question: would expandable segments fit in less?"""
        return {"device": result.options.get("device")}

    def paste_lines(self, framework: str, fraction: float, settings: dict,
                    device_bytes: int) -> list[str]:
        """``PYTORCH_CUDA_ALLOC_CONF=...`` (read when PyTorch starts; the live
        ``_set_allocator_settings`` takes it for new segments) and
        ``torch.cuda.set_per_process_memory_fraction(...)`` (live)."""
        conf = settings.get("conf")
        text = conf.as_conf() if conf is not None else ""
        lines = []
        if text:
            lines.append(f"PYTORCH_CUDA_ALLOC_CONF={text}")
        frac = fitting_fraction(fraction)
        lines.append(f"torch.cuda.set_per_process_memory_fraction({fraction_text(frac)})  # "
                     f"{format_bytes(int(frac * device_bytes))} of {format_bytes(device_bytes)}")
        if text:
            lines.append(f"# or live, for the segments PyTorch makes from then on: "
                         f"torch.cuda.memory._set_allocator_settings({text!r})")
        return lines

    # ------------------------------------------------------------------ the live layers
    def words(self) -> dict[str, str]:
        return {**super().words(), "peak": "peak allocated", "unset_fraction": "not set",
                "map": "segment map", "bins": "pools", "bins_axis": "pool"}

    def bin_labels(self) -> list[str]:
        return list(_POOLS)

    def bin_index(self, table: dict) -> Any:
        """The pool of each block (0 small, 1 large: the chunk table's ``bin``)."""
        import numpy as np

        return np.asarray(table["bin"], dtype=np.intp)

    def region_kinds(self, table: dict) -> list[str]:
        """``small``, ``large`` or ``large, expandable`` for each segment."""
        import numpy as np

        regions = table["regions"]
        if not len(regions):
            return []
        first = np.searchsorted(table["ptr"], regions[:, 0])
        first = np.minimum(first, max(len(table["ptr"]) - 1, 0))
        pools = table["bin"][first] if len(table["ptr"]) else np.zeros(len(regions), np.int8)
        exp = table.get("expandable")
        exp = exp[first] if exp is not None and len(exp) else np.zeros(len(regions), bool)
        return [("small" if p == 0 else "large") + (", expandable" if e else "")
                for p, e in zip(pools.tolist(), exp.tolist())]

    def live_settings(self, allocator: Any) -> dict[str, Any]:
        conf = allocator.config
        parts = conf.as_dict()
        return {"limit": allocator.memory_limit, "fraction": allocator.fraction,
                "allow_growth": None, "deferred_deletion_bytes": None,
                "expandable_segments": conf.expandable_segments,
                "max_split_size_mb": parts["max_split_size_mb"],
                "garbage_collection_threshold": conf.garbage_collection_threshold,
                "conf": conf.as_conf()}

    def check_setting(self, setting: str, value: Any) -> None:
        """PyTorch's checks: the fraction in [0, 1]; the settings as
        ``PYTORCH_CUDA_ALLOC_CONF`` takes them; TensorFlow's settings refused by name."""
        from ._torch_conf import CachingAllocatorConfig

        if setting in ("per_process_gpu_memory_fraction", "fraction"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not 0.0 <= float(value) <= 1.0:
                raise ConfigError(f"fraction is torch.cuda.set_per_process_memory_fraction's, "
                                  f"in [0, 1]; got {value!r}")
            return
        if setting in TF_ONLY:
            raise ConfigError(TF_ONLY[setting])
        if setting == "conf":
            CachingAllocatorConfig().apply(value)
            return
        if setting not in _LIVE_PARTS:
            raise ConfigError(f"{setting!r} is not a setting of PyTorch's caching allocator; "
                              f"known: fraction (per_process_gpu_memory_fraction), "
                              f"{', '.join(_LIVE_PARTS)}, conf")
        CachingAllocatorConfig().update(**{setting: value})

    def parse_setting(self, setting: str, text: str) -> Any:
        """The fraction and ``garbage_collection_threshold``: numbers;
        ``expandable_segments``: true/false; ``max_split_size_mb``: MiB, or ``none`` /
        ``unset``; ``roundup_power2_divisions``: a number or PyTorch's list
        (``[256:1,>:4]``); ``conf``: a settings string as it is."""
        if setting in ("fraction", "garbage_collection_threshold"):
            return _number_text(setting, text, "a number")
        if setting == "expandable_segments":
            return _flag_text(setting, text)
        if setting in ("max_split_size_mb", "max_non_split_rounding_mb"):
            if setting == "max_split_size_mb" and text.strip().lower() in ("none", "unset", ""):
                return None
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"{setting} must be a whole number of MiB"
                                  f"{' (or none)' if setting == 'max_split_size_mb' else ''}"
                                  f"; got {text!r}") from None
        if setting == "roundup_power2_divisions":
            try:
                return int(text)
            except ValueError:
                return text
        if setting in ("conf", *TF_ONLY):
            return text
        raise ConfigError(f"unknown setting {setting!r}")

    def fraction_line(self, fraction: float, settings: dict) -> str:
        """``torch.cuda.set_per_process_memory_fraction(0.623)`` (rounded up to what still
        fits), with the settings string when it is not PyTorch's defaults."""
        line = f"torch.cuda.set_per_process_memory_fraction({fraction_text(fraction)})"
        conf = settings.get("conf")
        text = conf if isinstance(conf, str) else (conf.as_conf() if conf is not None else "")
        return line + (f" with PYTORCH_CUDA_ALLOC_CONF={text}" if text else "")

    def figures(self, allocator: Any) -> dict[str, Any]:
        """``torch.cuda.memory_stats()``'s figures the views show, by PyTorch's keys."""
        st = allocator.memory_stats()
        return {k: st[k] for k in _FIGURES if k in st}

    def answer(self, name: str, value: Any, result: Any, settings: dict) -> dict[str, str]:
        limit = settings.get("limit") or 0
        reserved = int(settings.get("reserved_bytes.all.current", 0))
        segments = int(settings.get("regions", settings.get("segment.all.current", 0)))
        if name == "fraction":
            out = {"text": f"fraction {float(value):.3f}: limit {format_bytes(limit)} "
                           f"(torch.cuda.set_per_process_memory_fraction({float(value):g}); "
                           "segments held stay)"}
            gc = settings.get("garbage_collection_threshold") or 0.0
            if gc:
                out["text"] += (f"; garbage collection at {gc:g} of the limit acts from now "
                                "on")
            if reserved > limit:
                out["warning"] = (f"reserved {format_bytes(reserved)} is "
                                  f"{format_bytes(reserved - limit)} above the new limit: "
                                  "PyTorch gives nothing back by itself; no new segment is "
                                  "made until reserved fits (a request that needs one frees "
                                  "the cached segments first), and empty cache returns the "
                                  "wholly free ones now")
            return out
        if name == "expandable":
            on = bool(value)
            text = (f"expandable_segments: {'on' if on else 'off'}: segments made from now on "
                    + ("are expandable (a virtual range per pool and stream, pages mapped as "
                       "requests need them, unmapped at empty cache), and large-pool blocks "
                       "split down to 512 B" if on else "are plain cudaMalloc segments")
                    + f"; the {segments} segment(s) held stay as they are")
            return self._with_paste(text, settings, "expandable_segments", on)
        if name == "max_split":
            if value is None:
                text = ("max_split_size_mb: unset: from the next request any block may be "
                        "split, and oversize blocks serve any request again")
            else:
                tol = settings.get("max_non_split_rounding_mb", 20)
                text = (f"max_split_size_mb: {value}: from the next request, blocks of "
                        f"{value} MiB or more are not split and serve only requests of that "
                        f"size or more within {tol} MiB; blocks already split stay split")
            return self._with_paste(text, settings, "max_split_size_mb", value)
        if name == "gc":
            value = float(value or 0.0)
            if not value:
                text = "garbage_collection_threshold: off"
            elif settings.get("fraction") is None:
                text = (f"garbage_collection_threshold: {value:g}: kept, but it acts only "
                        "once a fraction is set (set_per_process_memory_fraction), as in "
                        "PyTorch")
            else:
                text = (f"garbage_collection_threshold: {value:g}: when a request finds no "
                        f"cached block and reserved is above {value:.0%} of the limit "
                        f"({format_bytes(int(value * limit))}), PyTorch first frees wholly "
                        "free cached segments, the longest unused first")
            return {"text": text + self._paste(settings, "garbage_collection_threshold",
                                               value)}
        if name == "empty_cache":
            freed = int(result or 0)
            if freed:
                text = f"empty_cache(): returned {format_bytes(freed)}"
                if segments:
                    text += (f"; {segments} segment(s) ({format_bytes(reserved)}) stay: each "
                             "holds an allocated block")
                return {"text": text}
            why = ("no segment is held" if not segments else
                   f"each of the {segments} segment(s) holds an allocated block")
            return {"text": f"empty_cache(): returned 0 B: {why}"}
        raise ConfigError(f"unknown control {name!r}")

    def _with_paste(self, text: str, settings: dict, key: str, value: Any) -> dict[str, str]:
        """A control's answer with its line to paste, unless the settings now combine
        ``expandable_segments`` with ``max_split_size_mb``: then PyTorch's rule for that
        (:meth:`~gpudash.CachingAllocatorConfig.unsupported`) as the warning, and no line."""
        from ._torch_conf import CachingAllocatorConfig

        try:
            rule = CachingAllocatorConfig(settings.get("conf") or "").unsupported()
        except ConfigError:
            rule = None
        if rule is not None:
            return {"text": text, "warning": rule + " (no line to paste)"}
        return {"text": text + self._paste(settings, key, value)}

    @staticmethod
    def _paste(settings: dict, key: str, value: Any) -> str:
        """The live line that does the same in PyTorch: the whole settings string (what
        ``_set_allocator_settings`` leaves out goes back to its default)."""
        conf = settings.get("conf") or ""
        if key == "expandable_segments" and not value:
            conf = ",".join(p for p in ("expandable_segments:False", conf) if p)
        if not conf:
            return " - in PyTorch: torch.cuda.memory._set_allocator_settings('') (the defaults)"
        return f" - in PyTorch: torch.cuda.memory._set_allocator_settings({conf!r})"

    def stats_rows(self, state: Any) -> list[tuple[str, str, str]]:
        """``torch.cuda.memory_stats()``'s figures by PyTorch's keys, the limit, what is
        reserved but unallocated, fragmentation, the counters."""
        s = state.stats
        f = state.figures
        frac = (state.in_force or {}).get("fraction")
        rows = [
            ("allocated_bytes.all.current", *_b(s.bytes_in_use)),
            ("allocated_bytes.all.peak", *_b(s.peak_bytes_in_use)),
            ("reserved_bytes.all.current", *_b(s.pool_bytes)),
            ("reserved_bytes.all.peak", *_b(s.peak_pool_bytes)),
            ("limit", format_bytes(int(s.bytes_limit)),
             "the device's total memory (no fraction set)" if frac is None else
             f"set_per_process_memory_fraction({frac:g})"),
            ("reserved - allocated", *_b(state.reserved_unused)),
            ("allocated - requested", *_b(state.internal_fragmentation)),
            ("largest free block", *_b(s.largest_free_block_bytes)),
            ("external fragmentation", f"{s.fragmentation:.1%}", "1 - largest free / free"),
        ]
        if "inactive_split_bytes.all.current" in f:
            rows.append(("inactive_split_bytes.all.current",
                         *_b(f["inactive_split_bytes.all.current"])))
        if "segment.all.current" in f:
            rows.append(("segment.all.current", f"{f['segment.all.current']:,}",
                         f"{f.get('segment.small_pool.current', 0):,} small pool, "
                         f"{f.get('segment.large_pool.current', 0):,} large pool"))
        rows.append(("blocks", f"{state.num_chunks:,}",
                     f"{int(state.table['in_use'].sum()):,} allocated"))
        for key in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"):
            if key in f:
                rows.append((key, f"{f[key]:,}", _COUNTERS[key]))
        return rows

    def headline(self, state: Any) -> list[list[str]]:
        """The segments as the map draws them (an expandable segment's mapped range is one;
        PyTorch's ``segment.all.current`` counts cudaMalloc segments only) by pool, and
        ``num_alloc_retries``."""
        kinds = self.region_kinds(state.table)
        small = sum(1 for k in kinds if k.startswith("small"))
        exp = sum(1 for k in kinds if k.endswith("expandable"))
        out = [["segments", f"{len(kinds)} ({small} small, {len(kinds) - small} large"
                            + (f", {exp} expandable" if exp else "") + ")"]]
        if "num_alloc_retries" in state.figures:
            out.append(["num_alloc_retries", f"{state.figures['num_alloc_retries']:,}"])
        return out

    def fragmentation(self, in_use: int, pool: int, largest_free: int) -> Fragmentation:
        """PyTorch's figure: reserved but unallocated bytes (free blocks inside segments),
        and their share of reserved (what its out-of-memory message reports)."""
        unused = max(int(pool) - int(in_use), 0)
        ratio = unused / int(pool) if pool > 0 else 0.0
        return Fragmentation("reserved but unallocated", ratio, unused,
                             f"{format_bytes(unused)} ({100.0 * ratio:.1f} % of reserved)",
                             "reserved - allocated: free blocks inside PyTorch's segments "
                             "(memory_stats' reserved_bytes - allocated_bytes)")

    def fragmentation_over(self, in_use: Any, pool: Any,
                           largest_free: Any) -> tuple[str, str]:
        """The most reserved but unallocated bytes over a run, their share of reserved
        then, and after which call."""
        import numpy as np

        in_use, pool = (np.asarray(a, dtype=np.int64) for a in (in_use, pool))
        if not len(pool):
            return "most reserved but unallocated", "0 B"
        unused = pool - in_use
        i = int(np.argmax(unused))
        f = self.fragmentation(int(in_use[i]), int(pool[i]), 0)
        return "most reserved but unallocated", f"{f.text} after call {i + 1:,}"

    def pending_release(self, allocator: Any) -> tuple[int, int]:
        """Reserved bytes above the limit, and the segments holding allocated blocks
        (PyTorch returns none of it by itself)."""
        over = allocator.pool_bytes - allocator.memory_limit
        if over <= 0:
            return 0, 0
        return over, sum(1 for s in allocator.segments() if s["allocated_size"])

    def limit_banner(self, pool: int, limit: int, pending: int, held: int) -> str:
        if not pending:
            return ""
        return (f"reserved above limit: {format_bytes(pool)} held against a "
                f"{format_bytes(limit)} limit. PyTorch gives nothing back by itself: no new "
                "segment is made until reserved fits (a request that needs one frees the "
                "cached segments first), and empty cache returns the wholly free ones now; "
                f"{held} segment(s) hold allocated blocks and stay until those are freed.")


# ---------------------------------------------------------------------------------- replay settings
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
        model = model_for(value.get("allocator") or "bfc")
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


@dataclass(frozen=True)
class BFCReplaySettings(ReplaySettings):
    """A replay through TensorFlow's and JAX's BFC allocator.

    Attributes
    ----------
    device_bytes : int
        The simulated device's memory.
    fraction : float or None
        ``per_process_gpu_memory_fraction`` (None: TensorFlow's default).
    memory_limit : int
        The allocator's limit, from the fraction by TensorFlow's rule (or given).
    allow_growth, garbage_collection : bool
    fragmentation_fraction : float
    deferred_deletion_bytes : int
        Frees wait until this many bytes are queued (0: at once).
    device : int
    cc_major : int
        The compute capability's major version (TensorFlow's reserve depends on it).
    name : str or None
        The allocator's name (``GPU_<device>_bfc``).
    assumed : tuple of str
        What the resolution assumed that the trace does not say.
    """

    model_name: ClassVar[str] = "bfc"
    WORDS: ClassVar[dict[str, str]] = {
        "fraction": "GPUOptions.per_process_gpu_memory_fraction "
                    "(JAX: XLA_PYTHON_CLIENT_MEM_FRACTION)",
        "memory_limit": "tf.config.LogicalDeviceConfiguration(memory_limit=...)",
        "allow_growth": "GPUOptions.allow_growth / TF_FORCE_GPU_ALLOW_GROWTH "
                        "(JAX: XLA_PYTHON_CLIENT_PREALLOCATE=false)",
        "garbage_collection": "TF_ENABLE_GPU_GARBAGE_COLLECTION",
        "fragmentation_fraction": "BFCAllocator::Options.fragmentation_fraction",
        "deferred_deletion_bytes": "GPUOptions.Experimental / EventMgr's "
                                   "deferred_deletion_bytes",
    }

    device_bytes: int
    fraction: float | None
    memory_limit: int
    allow_growth: bool = True
    garbage_collection: bool = False
    fragmentation_fraction: float = 0.0
    deferred_deletion_bytes: int = 0
    device: int = 0
    cc_major: int = 8
    name: str | None = None
    assumed: tuple = ()

    def for_meta(self) -> dict[str, Any]:
        keys = ("device_bytes", "fraction", "memory_limit", "allow_growth",
                "garbage_collection", "fragmentation_fraction", "deferred_deletion_bytes",
                "device")
        return {"allocator": self.model_name, **{k: getattr(self, k) for k in keys}}

    def row(self) -> dict[str, Any]:
        return {"allow_growth": self.allow_growth}


@dataclass(frozen=True)
class TorchReplaySettings(ReplaySettings):
    """A replay through PyTorch's caching allocator.

    Attributes
    ----------
    device_bytes : int
        The device's total memory.
    fraction : float or None
        ``torch.cuda.set_per_process_memory_fraction`` (None: the whole device).
    memory_limit : int
        ``fraction * device_bytes`` (PyTorch's ``allowed_memory_maximum``).
    conf : CachingAllocatorConfig
        ``PYTORCH_CUDA_ALLOC_CONF``, with the PyTorch version whose rules run.
    exact : bool
        Replay with the snapshot's own segment addresses and release points.
    device : int
    cc_major : int
    name : str or None
        The allocator's name (``cuda:<device>``).
    assumed : tuple of str
    torch_version : tuple or str or None
        The version asked for (``conf`` holds the one that runs).
    varied : dict or None
        The knobs a sweep set on this row, by name.
    """

    model_name: ClassVar[str] = "torch"
    WORDS: ClassVar[dict[str, str]] = {
        "fraction": "torch.cuda.set_per_process_memory_fraction",
        "memory_limit": "torch.cuda.set_per_process_memory_fraction(...) x total memory",
        "conf": "PYTORCH_CUDA_ALLOC_CONF (torch.cuda.memory._set_allocator_settings live)",
        "expandable_segments": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "max_split_size_mb": "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N",
        "garbage_collection_threshold": "PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:F",
        "roundup_power2_divisions": "PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:N",
        "max_non_split_rounding_mb": "PYTORCH_CUDA_ALLOC_CONF=max_non_split_rounding_mb:N",
        "exact": "the snapshot's own segments (torch.cuda.memory._snapshot())",
    }
    FOLDED: ClassVar[tuple[str, ...]] = (
        "expandable_segments", "max_split_size_mb", "garbage_collection_threshold",
        "roundup_power2_divisions", "max_non_split_rounding_mb")

    device_bytes: int
    fraction: float | None
    memory_limit: int
    conf: Any
    exact: bool = False
    device: int = 0
    cc_major: int = 8
    name: str | None = None
    assumed: tuple = ()
    torch_version: Any = None
    varied: dict | None = None

    @classmethod
    def _from_dict(cls, args: dict, folded: dict) -> ReplaySettings:
        from ._torch_conf import CachingAllocatorConfig

        conf = args.get("conf")
        if conf is None or isinstance(conf, str):
            conf = CachingAllocatorConfig(conf or None, version=args.get("torch_version"))
        elif not isinstance(conf, CachingAllocatorConfig):
            raise ConfigError(f"conf must be a PYTORCH_CUDA_ALLOC_CONF string or a "
                              f"CachingAllocatorConfig; got {conf!r}")
        parts = {k: v for k, v in folded.items() if v is not None}
        if parts:
            conf = conf.copy()
            conf.update(**parts)
        return cls(**dict(args, conf=conf))

    def for_meta(self) -> dict[str, Any]:
        conf = self.conf
        return {"allocator": self.model_name, "device_bytes": self.device_bytes,
                "fraction": self.fraction, "memory_limit": self.memory_limit,
                "conf": conf.as_conf(), "torch_version": ".".join(map(str, conf.version)),
                "exact": self.exact, "device": self.device}

    def row(self) -> dict[str, Any]:
        return {"expandable_segments": self.conf.expandable_segments, **(self.varied or {})}

    def unsupported(self) -> str | None:
        return self.conf.unsupported()


def replay_settings(value: Any) -> ReplaySettings:
    """:meth:`ReplaySettings.of`: resolved settings from settings or their dict."""
    return ReplaySettings.of(value)


BFC = _BFCModel(
    name="bfc", title="TensorFlow's BFC allocator", frameworks=("tensorflow", "jax"),
    layout="bins", region="region", regions="regions", pool="pool", in_use="in use",
    grid={"allow_growth": (True, False)},
    fraction_setting="per_process_gpu_memory_fraction", chunk="chunk", bin="bin",
    deferred_frees=True, checkpoints=True,
    sweep_words={"setting": "growth", "unset_fraction": "default"},
    setting_names={"per_process_gpu_memory_fraction": "per_process_gpu_memory_fraction",
                   "fraction": "per_process_gpu_memory_fraction",
                   "allow_growth": "allow_growth", "growth": "allow_growth",
                   "deferred_deletion_bytes": "deferred_deletion_bytes",
                   "deferred": "deferred_deletion_bytes"},
    controls=(
        Control("fraction", "fraction", "fraction", setting="per_process_gpu_memory_fraction",
                tooltip="per_process_gpu_memory_fraction: the share of the device the "
                        "allocator may hold"),
        Control("growth", "toggle", "growth", setting="allow_growth",
                tooltip="BFC allow_growth: start small and double"),
        Control("deferred", "bytes", "deferred (MiB)", setting="deferred_deletion_bytes",
                unit=1 << 20, min=1 << 10, max=1 << 30, needs_session=True,
                tooltip="deferred_deletion_bytes: frees wait until this many bytes are queued"),
        Control("release", "button", "release free regions", action="release_free_regions",
                tooltip="Return wholly free regions to the device"),
        Control("flush", "button", "flush deferred", action="flush_deferred",
                needs_session=True, tooltip="Hand queued frees to the allocator now"),
    ))
TORCH = _TorchModel(
    name="torch", title="PyTorch's caching allocator", frameworks=("torch",),
    layout="pools", region="segment", regions="segments", pool="reserved",
    in_use="allocated",
    grid={"expandable_segments": (False, True)},
    fraction_setting="torch.cuda.set_per_process_memory_fraction", chunk="block", bin="pool",
    deferred_frees=False, streams=True,
    sweep_words={"setting": "expandable", "unset_fraction": "none"},
    sweep_knobs=("max_split_size_mb", "garbage_collection_threshold",
                 "roundup_power2_divisions", "max_non_split_rounding_mb"),
    setting_names={"fraction": "fraction", "per_process_gpu_memory_fraction": "fraction",
                   "expandable_segments": "expandable_segments",
                   "expandable": "expandable_segments",
                   "max_split_size_mb": "max_split_size_mb", "max_split": "max_split_size_mb",
                   "garbage_collection_threshold": "garbage_collection_threshold",
                   "gc": "garbage_collection_threshold",
                   "roundup_power2_divisions": "roundup_power2_divisions",
                   "max_non_split_rounding_mb": "max_non_split_rounding_mb",
                   "conf": "conf", "PYTORCH_CUDA_ALLOC_CONF": "conf",
                   "PYTORCH_ALLOC_CONF": "conf",
                   # TensorFlow's: refused by name, saying what PyTorch has instead
                   "allow_growth": "allow_growth", "growth": "allow_growth",
                   "deferred_deletion_bytes": "deferred_deletion_bytes",
                   "deferred": "deferred_deletion_bytes"},
    whatif_toggles=("expandable_segments",),
    controls=(
        Control("fraction", "fraction", "fraction", setting="per_process_gpu_memory_fraction",
                tooltip="torch.cuda.set_per_process_memory_fraction: segments may total at "
                        "most this share of the device (memory held stays)"),
        Control("expandable", "toggle", "expandable_segments", setting="expandable_segments",
                tooltip="PYTORCH_CUDA_ALLOC_CONF expandable_segments: segments made from now "
                        "on grow and shrink by pages"),
        Control("max_split", "number", "max_split_size_mb", setting="max_split_size_mb",
                min=20, step=1, empty="unset", empty_value=None,
                tooltip="blocks of this many MiB or more are not split (empty: unset)"),
        Control("gc", "number", "garbage_collection_threshold",
                setting="garbage_collection_threshold", min=0.0, max=0.99, step=0.05,
                empty="off", empty_value=0.0,
                tooltip="with a fraction set: free cached segments when reserved passes this "
                        "share of the limit (0: off)"),
        Control("empty_cache", "button", "empty cache", action="empty_cache",
                tooltip="torch.cuda.empty_cache(): return every wholly free cached segment"),
    ))
MODELS = {"bfc": BFC, "torch": TORCH}

_ALIASES = {"bfc": BFC, "tensorflow": BFC, "tf": BFC, "jax": BFC, "xla": BFC,
            "torch": TORCH, "pytorch": TORCH, "caching": TORCH}


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
        raise ConfigError(f"allocator must be one of 'bfc' (TensorFlow's and JAX's BFC; also "
                          f"'tensorflow', 'jax') or 'torch' (PyTorch's caching allocator; "
                          f"also 'pytorch'); got {name!r}")
    return model


def trace_model(trace: Any) -> AllocatorModel:
    """The model of the allocator that made a trace: PyTorch's for a PyTorch snapshot (or a
    trace saved from one) and for a gpudash recording whose devices all ran PyTorch's model,
    else BFC."""
    meta = getattr(trace, "meta", {}) or {}
    if meta.get("source") == "pytorch-snapshot" or meta.get("allocator") == "torch":
        return TORCH
    devices = meta.get("devices")
    if isinstance(devices, list) and devices and all(
            isinstance(d, dict) and d.get("allocator") == "torch" for d in devices):
        return TORCH  # a gpudash recording of PyTorch's model (a PyTorch session)
    return BFC


def model_of(allocator: Any) -> AllocatorModel:
    """The model of a live allocator: the one its class names (``allocator_model``, a
    :data:`MODELS` key). A stand-in that is no gpudash allocator (a feed's, a proxy's) may
    name it by ``kind`` instead; anything else is taken for the BFC."""
    name = getattr(type(allocator), "allocator_model", None) or getattr(allocator, "kind", None)
    return MODELS.get(name, BFC) if isinstance(name, str) else BFC


def model_of_dump(dump: Any) -> AllocatorModel:
    """The model of a :class:`~gpudash.MemoryDump`, by the layout it says
    (``extra["layout"]``: ``"pools"`` for PyTorch's caching allocator; TensorFlow's bins
    otherwise)."""
    layout = (getattr(dump, "extra", None) or {}).get("layout")
    return next((m for m in MODELS.values() if m.layout == layout), BFC)
