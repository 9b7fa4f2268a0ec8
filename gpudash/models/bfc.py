"""TensorFlow's and JAX's BFC allocator (:class:`gpudash.BFCAllocator`) as an
:class:`~gpudash.models.base.AllocatorModel`: its settings and their words, its replay
settings (:class:`BFCReplaySettings`) and their resolution, its replay loops, its controls."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .._accel import twin
from .._errors import ConfigError
from .._eventsource import _bins_of
from .._units import format_bytes, parse_bytes
from ..bfc import BFCAllocator, clone
from ..options import (DEFAULT_DEFERRED_DELETION_BYTES, GPUOptions, memory_limit,
                       restart_lines)
from .base import (UNSET, AllocatorModel, _part, Control, ReplaySettings, _b, _flag_text,
                   _number_text, recorded_flag, register, trace_model)

#: The simulated device's memory when neither the trace nor the call says.
DEFAULT_DEVICE_BYTES = 16 << 30

#: The settings a replay through the BFC takes, with their defaults.
_DEFAULTS: dict[str, Any] = {
    "device_bytes": DEFAULT_DEVICE_BYTES,
    "fraction": None,
    "memory_limit": None,
    "allow_growth": True,
    "garbage_collection": False,
    "fragmentation_fraction": 0.0,
    "deferred_deletion_bytes": 0,
    "device": None,
    "cc_major": 8,
    "allocator": None,
}
#: GPUOptions fields that map onto replay settings; the others do not affect a replay.
_FROM_GPU_OPTIONS = {
    "per_process_gpu_memory_fraction": "fraction",
    "allow_growth": "allow_growth",
    "deferred_deletion_bytes": "deferred_deletion_bytes",
}
#: TensorFlow's number of BFC bins (256 B << b, the last one open-ended).
_NUM_BINS = 21


@dataclass(frozen=True, repr=False)
class _BFCModel(AllocatorModel):
    @property
    def settings_type(self) -> type:
        return BFCReplaySettings

    def build(self, settings: dict, sub: Any) -> Any:
        dev = int(settings.get("device") or 0)
        alloc = BFCAllocator(sub, settings["memory_limit"], allow_growth=settings["allow_growth"],
                             garbage_collection=settings["garbage_collection"],
                             fragmentation_fraction=settings["fragmentation_fraction"],
                             name=settings.get("name") or f"GPU_{dev}_bfc")
        alloc.device_index = dev
        return alloc

    def inputs(self) -> frozenset:
        return frozenset(_DEFAULTS)

    def resolve(self, trace: Any, index: Any, options: Any,
                explicit: dict[str, Any]) -> dict[str, Any]:
        """The settings of a replay through TensorFlow's BFC allocator."""
        for k, v in explicit.items():
            other = self.owner_of(k) if k != "name" else None
            if other is not None and v not in (UNSET, None):
                raise ConfigError(f"{k} is a setting of {other.title}; replay with "
                                  f"allocator={other.name!r} to use it (this replay runs "
                                  "TensorFlow's BFC)")
        explicit = {k: v for k, v in explicit.items()
                    if k in _DEFAULTS or k == "name" or (self.owner_of(k) is None and v is not UNSET)}
        s = dict(_DEFAULTS)
        if isinstance(options, str):
            if options != "trace":
                raise ConfigError(f"options must be a GPUOptions, a dict or 'trace'; got {options!r}")
            if trace is None:
                raise ConfigError("options='trace' needs a trace")
            dev = explicit.get("device", UNSET)
            s.update(index.settings(None if dev is UNSET else dev))
        elif isinstance(options, GPUOptions):
            for f, key in _FROM_GPU_OPTIONS.items():
                s[key] = getattr(options, f)
        elif isinstance(options, Mapping):
            for k, v in options.items():
                if k in _FROM_GPU_OPTIONS:
                    s[_FROM_GPU_OPTIONS[k]] = v
                elif k in _DEFAULTS or k == "name":
                    s[k] = v
                elif k in GPUOptions.FIELDS:
                    continue  # a GPUOptions field that does not change a replay
                else:
                    raise ConfigError(
                        f"unknown replay setting {k!r}; known: {sorted(_DEFAULTS)} and the "
                        f"GPUOptions fields {list(GPUOptions.FIELDS)}")
        elif options is not None:
            raise ConfigError(f"options must be a GPUOptions, a dict or 'trace'; got {options!r}")
        for k, v in explicit.items():
            if k not in _DEFAULTS and k != "name":
                raise ConfigError(f"unknown replay setting {k!r}; known: {sorted(_DEFAULTS)}")
            if v is not UNSET:
                s[k] = v
        if explicit.get("fraction", UNSET) is not UNSET \
                and explicit.get("memory_limit", UNSET) is UNSET:
            s["memory_limit"] = None  # the fraction asked for decides the limit
        elif (trace is not None and options is None and s["memory_limit"] is None
              and explicit.get("fraction", UNSET) is UNSET
              and explicit.get("memory_limit", UNSET) is UNSET):
            # a TensorFlow log says what limit its allocator had: replay with it
            dev = explicit.get("device", UNSET)
            picked = index.pick(None if dev is UNSET else dev)
            limit = index.source_limit(picked)
            if limit is not None:
                s["memory_limit"] = limit
                s["device"] = picked
                s["device_bytes"] = max(parse_bytes(s["device_bytes"], name="device_bytes"),
                                        limit)

        s["assumed"] = []
        if (trace is not None and explicit.get("device_bytes", UNSET) is UNSET
                and not (isinstance(options, Mapping) and "device_bytes" in options)
                and s["memory_limit"] is None):
            dev = explicit.get("device", UNSET)
            picked = index.pick(None if dev is UNSET or dev is None else dev)
            cap = trace_model(trace).trace_capacity(index, picked)  # the trace's own model's
            if cap is not None:
                s["device_bytes"], how = cap
                s["assumed"].append(f"device {format_bytes(s['device_bytes'])}: {how}")
            else:
                s["assumed"].append(
                    f"device {format_bytes(parse_bytes(s['device_bytes']))}: gpudash's default "
                    "(the trace does not say how much the GPU had; pass device_bytes= or --device "
                    "SIZE)")
        s["device_bytes"] = parse_bytes(s["device_bytes"], name="device_bytes")
        if s["device_bytes"] <= 0:
            raise ConfigError(f"device_bytes must be > 0; got {s['device_bytes']}")
        frac = s["fraction"]
        if frac is not None:
            frac = float(frac)
            if not frac >= 0.0:
                raise ConfigError(f"fraction must be >= 0 (0 or None: TensorFlow's default); "
                                  f"got {frac}")
            s["fraction"] = frac
        if s["memory_limit"] is not None:
            s["memory_limit"] = parse_bytes(s["memory_limit"], name="memory_limit")
        else:
            s["memory_limit"] = memory_limit(s["device_bytes"], s["device_bytes"], frac or 0.0,
                                                 int(s["cc_major"]), environ={})
        for key in ("allow_growth", "garbage_collection"):
            try:
                s[key] = bool(recorded_flag(s[key]))
            except ValueError as exc:
                raise ConfigError(f"{key} is {exc}") from None
        s["fragmentation_fraction"] = float(s["fragmentation_fraction"])
        ddb = s["deferred_deletion_bytes"]
        s["deferred_deletion_bytes"] = parse_bytes(ddb or 0, name="deferred_deletion_bytes")
        if trace is not None:
            s["device"] = index.pick(s["device"])
        elif s["device"] is None:
            s["device"] = 0
        s["allocator"] = "bfc"
        return s

    def limit(self, device_bytes: int, fraction: float | None, cc_major: int = 8) -> int:
        """TensorFlow's limit rule (None: its default, free memory minus the reserve)."""
        return memory_limit(device_bytes, device_bytes, fraction or 0.0, cc_major, environ={})

    def cli_kwargs(self, args: Any, recorded: dict) -> dict[str, Any]:
        """``--growth``/``--no-growth`` (else the trace's recorded setting, else TensorFlow's
        default, off), ``--gc``, and ``--deferred`` where the command has it (TensorFlow's
        reading of deferred_deletion_bytes: 0 is its 8 MiB default; not given: frees at once,
        as the trace recorded them)."""
        growth = args.growth if args.growth is not None else bool(
            recorded.get("allow_growth", False))
        kwargs = {"allow_growth": growth, "garbage_collection": bool(args.gc)}
        if hasattr(args, "deferred"):
            deferred = args.deferred
            kwargs["deferred_deletion_bytes"] = (
                0 if deferred is None else deferred or DEFAULT_DEFERRED_DELETION_BYTES)
        return kwargs

    def settings_text(self, options: dict, fraction: bool = True) -> str:
        deferred = options.get("deferred_deletion_bytes") or 0
        return (f"allow_growth={options['allow_growth']}"
                + (f", deferred deletion {format_bytes(deferred)}" if deferred else ""))

    def describe(self, settings: dict) -> str:
        return (f"allow_growth={settings['allow_growth']}"
                + (f", garbage_collection={settings['garbage_collection']}"
                   if settings.get("garbage_collection") else ""))

    def paste_lines(self, framework: str, fraction: float, settings: dict,
                    device_bytes: int) -> list[str]:
        """TensorFlow's or JAX's lines (:func:`gpudash.options.restart_lines`)."""
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

        return _bins_of(np.asarray(table["size"], dtype=np.int64)).astype(np.intp)

    def live_settings(self, allocator: Any) -> dict[str, Any]:
        return {"limit": allocator.memory_limit, "allow_growth": allocator.allow_growth}

    def loop(self, settings: Any) -> str:
        return "deferred" if settings["deferred_deletion_bytes"] > 0 else "plain"

    def runner(self, settings: Any, compiled: bool) -> Any:
        return _LOOPS[self.loop(settings)][bool(compiled)]

    def clone(self, allocator: Any, sub: Any) -> Any:
        return clone(allocator, sub)

    def recorded(self, allocator: Any) -> dict[str, Any]:
        return {"options": {"allow_growth": allocator.allow_growth,
                            "garbage_collection": allocator.garbage_collection}}

    def check_setting(self, setting: str, value: Any) -> None:
        """A session's own checks (:class:`~gpudash.GPUOptions`), no coercion."""
        GPUOptions().copy(**{setting: value})

    def parse_setting(self, setting: str, text: str) -> Any:
        """``allow_growth``: true/false (1/0, yes/no, on/off); the fraction: a number;
        ``deferred_deletion_bytes``: a size (``16MiB``)."""
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



BFC = _BFCModel(
    name="bfc", title="TensorFlow's BFC allocator", frameworks=("tensorflow", "jax"),
    layout="bins", region="region", regions="regions", pool="pool", in_use="in use",
    grid={"allow_growth": (True, False)},
    fraction_setting="per_process_gpu_memory_fraction", chunk="chunk", bin="bin",
    deferred_frees=True, checkpoints=True, gpu_options=True,
    sweep_words={"setting": "growth", "unset_fraction": "default"},
    cli_flags=(("--growth/--no-growth", "growth"), ("--gc/--no-gc", "gc"),
               ("--deferred", "deferred")),
    cli_words={"owner": "a setting of TensorFlow's BFC allocator",
               "settings": "its settings: --fraction, --growth/--no-growth, --gc/--no-gc, "
                           "--deferred",
               "switch": "--framework tensorflow or jax for it", "through": "",
               "smallest": "fraction", "regions": "region(s)"},
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

# ------------------------------------------------------------------------------ replay loops
# A replay engine (gpudash.trace.replay._Engine) runs one of these over its calls: ``engine``
# holds the allocator (``alloc``), the calls (``ops``, ``keys``, ``nbytes``), the key ->
# pointer map (``ptrs``), the frees held back (``held``, ``held_bytes``), and counts
# (``pos``, ``oom_calls``, ``skipped_frees``, ``retried``). The loops bind what they touch to
# locals and read the allocator's private counters (``_in_use``, ``_pool``, ``_mask``/``_bins``
# for the largest free chunk, as ``BFCAllocator._largest_free_chunk`` does) instead of calling
# ``stats()``, which would take the lock and build a dataclass per call.

# The compiled core's twins of the loops (_csrc/replay.pxi); None without it.
_core_run_bfc = twin("run_bfc", None)
_core_run_bfc_deferred = twin("run_bfc_deferred", None)

def _sample_now(alloc: Any, sample: list) -> None:
    """Append in use, pool and largest free block now to the three sample lists."""
    sample[0].append(alloc._in_use)
    sample[1].append(alloc._pool)
    sample[2].append(alloc._largest_free_chunk())




def run_plain(engine: Any, start: int, stop: int, sample: list | None,
               max_ooms: int = sys.maxsize) -> None:
    alloc = engine.alloc
    allocate, deallocate = alloc.try_allocate, alloc.deallocate
    ptrs = engine.ptrs
    pop = ptrs.pop
    oom_calls = engine.oom_calls
    skipped = 0
    ops = _part(engine.ops, start, stop)
    keys = _part(engine.keys, start, stop)
    nbytes = _part(engine.nbytes, start, stop)
    if sample is not None:
        s_in, s_pool, s_lf = (lst.append for lst in sample)
        bins = alloc._bins
    i = start
    for op, key, n in zip(ops, keys, nbytes):
        if op == 2:
            p = pop(key, None)
            if p is None:
                skipped += 1
            else:
                deallocate(p)
        else:
            p = allocate(n, True)  # 0 when refused: an oom event, no memory log
            if p or not n:
                if op == 1:
                    ptrs[key] = p
                else:  # an allocation the source refused, served now: give it back
                    deallocate(p)
            else:
                oom_calls.append(i)
                if len(oom_calls) >= max_ooms:
                    stop = i + 1
                    if sample is not None:
                        _sample_now(alloc, sample)
                    break
        i += 1
        if sample is not None:
            s_in(alloc._in_use)
            s_pool(alloc._pool)
            m = alloc._mask
            s_lf(bins[m.bit_length() - 1][-1] >> 64 if m else 0)
    engine.skipped_frees += skipped
    engine.pos = stop


def run_deferred(engine: Any, start: int, stop: int, sample: list | None,
                  max_ooms: int = sys.maxsize) -> None:
    alloc = engine.alloc
    allocate, deallocate = alloc.try_allocate, alloc.deallocate
    ptrs = engine.ptrs
    pop = ptrs.pop
    oom_calls = engine.oom_calls
    held = engine.held
    threshold = engine.settings["deferred_deletion_bytes"]
    held_bytes = engine.held_bytes
    if sample is not None:
        s_in, s_pool, s_lf = (lst.append for lst in sample)
        bins = alloc._bins
    ops = _part(engine.ops, start, stop)
    keys = _part(engine.keys, start, stop)
    nbytes = _part(engine.nbytes, start, stop)
    for i in range(start, stop):
        op = ops[i - start]
        n = nbytes[i - start]
        if op == 2:
            p = pop(keys[i - start], None)
            if p is None:
                engine.skipped_frees += 1
            else:
                held.append(p)
                held_bytes += n
                if held_bytes >= threshold:
                    for q in held:
                        deallocate(q)
                    held.clear()
                    held_bytes = 0
        else:
            # With frees held, the first attempt is quiet: EventMgr flushes them and
            # the allocator retries, and only a refusal of the retry is an oom event.
            p = allocate(n, not held)
            if not p and n and held:
                for q in held:
                    deallocate(q)
                held.clear()
                held_bytes = 0
                p = allocate(n, True)
                if p:
                    engine.retried += 1
            if p or not n:
                if op == 1:
                    ptrs[keys[i - start]] = p
                else:
                    deallocate(p)
            else:
                oom_calls.append(i)
                if len(oom_calls) >= max_ooms:
                    if sample is not None:
                        _sample_now(alloc, sample)
                    stop = i + 1
                    break
        if sample is not None:
            s_in(alloc._in_use)
            s_pool(alloc._pool)
            m = alloc._mask
            s_lf(bins[m.bit_length() - 1][-1] >> 64 if m else 0)
    engine.held_bytes = held_bytes
    engine.pos = stop


def run_plain_compiled(engine: Any, start: int, stop: int, sample: list | None,
                        max_ooms: int = sys.maxsize) -> None:
    """:func:`run_plain` in C (``gpudash._core.run_bfc``), call for call."""
    ops, keys, nbytes, _ = engine._core_columns()
    engine.pos, skipped = _core_run_bfc(engine.alloc, ops, keys, nbytes, start, stop,
                                 engine.ptrs, engine.oom_calls, sample, max_ooms)
    engine.skipped_frees += skipped


def run_deferred_compiled(engine: Any, start: int, stop: int, sample: list | None,
                           max_ooms: int = sys.maxsize) -> None:
    """:func:`run_deferred` in C (``gpudash._core.run_bfc_deferred``), call for call."""
    ops, keys, nbytes, _ = engine._core_columns()
    engine.pos, skipped, retried, engine.held_bytes = _core_run_bfc_deferred(
        engine.alloc, ops, keys, nbytes, start, stop, engine.ptrs, engine.oom_calls, sample,
        max_ooms, engine.held, engine.settings["deferred_deletion_bytes"], engine.held_bytes)
    engine.skipped_frees += skipped
    engine.retried += retried


_LOOPS = {"plain": (run_plain, run_plain_compiled),
          "deferred": (run_deferred, run_deferred_compiled)}


register(BFC, aliases=("tensorflow", "tf", "jax", "xla"), default=True)
