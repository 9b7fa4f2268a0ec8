"""TensorFlow's and JAX's BFC allocator (:class:`gpudash.BFCAllocator`) as an
:class:`~gpudash.models.base.AllocatorModel`: its settings and their words, its replay
settings (:class:`BFCReplaySettings`) and their resolution, its replay loops, its controls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .._errors import ConfigError
from .._eventsource import _bins_of
from .._units import format_bytes, parse_bytes
from ..bfc import BFCAllocator
from ..options import GPUOptions, memory_limit, restart_lines
from .base import (AllocatorModel, Control, ReplaySettings, _b, _flag_text, _number_text,
                   register)

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

    def limit(self, device_bytes: int, fraction: float | None, cc_major: int = 8) -> int:
        """TensorFlow's limit rule (None: its default, free memory minus the reserve)."""
        return memory_limit(device_bytes, device_bytes, fraction or 0.0, cc_major, environ={})

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
register(BFC, aliases=("tensorflow", "tf", "jax", "xla"), default=True)
