"""PyTorch's caching allocator (:class:`gpudash.CachingAllocator`) as an
:class:`~gpudash.models.base.AllocatorModel`: ``PYTORCH_CUDA_ALLOC_CONF`` and the fraction,
its replay settings (:class:`TorchReplaySettings`) and their resolution, its replay loop on
streams, its pools, its ``memory_stats()`` figures and its controls."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .._accel import twin
from .._errors import ConfigError
from .._torch_conf import CachingAllocatorConfig, parse_torch_version
from .._units import format_bytes, parse_bytes
from ..caching import CachingAllocator
from .base import (UNSET, AllocatorModel, _part, Control, Fragmentation, ReplaySettings, _b, _flag_text,
                   _number_text, fitting_fraction, fraction_text, register,
                   trace_model)

#: The settings a replay through PyTorch's caching allocator takes, with their defaults:
#: None keeps what the trace was recorded with (a PyTorch snapshot's allocator_settings).
_DEFAULTS: dict[str, Any] = {
    "device_bytes": None,
    "fraction": None,
    "conf": None,
    "expandable_segments": None,
    "max_split_size_mb": None,
    "garbage_collection_threshold": None,
    "roundup_power2_divisions": None,
    "max_non_split_rounding_mb": None,
    "torch_version": None,
    "exact": None,
    "device": None,
    "allocator": "torch",
}
_KNOBS = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold",
                "roundup_power2_divisions", "max_non_split_rounding_mb")
#: Memory of common GPUs (GiB), for a device a trace does not name.
_COMMON_GPUS = (8, 12, 16, 24, 32, 40, 48, 80, 94, 141, 192)


def _common_gpu(need: int) -> tuple[int, str]:
    """The smallest common GPU size that holds ``need`` bytes (at least 16 GiB), and why."""
    gib = next((g for g in _COMMON_GPUS if g >= 16 and (g << 30) >= need),
               -(-need // (1 << 30)))
    held = (f"the smallest common GPU size that holds the {format_bytes(need)} the trace's "
            "segments held at most" if need else "gpudash's default")
    return gib << 30, (f"{held} (the trace does not say how much the GPU had; pass "
                       "device_bytes= or --device SIZE)")


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


@dataclass(frozen=True, repr=False)
class _TorchModel(AllocatorModel):
    @property
    def settings_type(self) -> type:
        return TorchReplaySettings

    def build(self, settings: dict, sub: Any) -> Any:
        dev = int(settings.get("device") or 0)
        alloc = CachingAllocator(sub, settings["conf"], fraction=settings["fraction"],
                                 name=settings.get("name") or f"cuda:{dev}", device=dev)
        alloc.device_index = dev
        return alloc

    def inputs(self) -> frozenset:
        return frozenset(_DEFAULTS)

    def trace_capacity(self, index: Any, device: int) -> tuple[int, str]:
        """What the trace shows (:func:`gpudash.trace.replay.torch_capacity`), else the
        smallest common GPU that holds the segments it held at most."""
        return index.capacity(device) or _common_gpu(index.peak_reserved(device))

    def resolve(self, trace: Any, index: Any, options: Any,
                explicit: dict[str, Any]) -> dict[str, Any]:
        """The settings of a replay through PyTorch's caching allocator.

        ``conf`` (a ``PYTORCH_CUDA_ALLOC_CONF`` string or a CachingAllocatorConfig) and the knobs
        by name (``expandable_segments``, ``max_split_size_mb``...) start from what the trace
        was recorded with (a snapshot's ``allocator_settings``; PyTorch's defaults otherwise);
        ``fraction`` is ``set_per_process_memory_fraction`` (None: the whole device);
        ``device_bytes`` the device's total memory (default: what the trace says, see
        :func:`gpudash.trace.replay.torch_capacity`, else assumed and said so); ``exact`` replays with the trace's
        own segment addresses and release points and reports how closely the model followed it
        (default: for a PyTorch trace replayed with its own settings)."""
        s = dict(_DEFAULTS)
        if isinstance(options, str):
            if options == "trace":
                options = None
            else:
                options = {"conf": options}
        if isinstance(options, CachingAllocatorConfig):
            options = {"conf": options}
        if isinstance(options, Mapping):
            for k, v in options.items():
                if k not in _DEFAULTS and k != "name":
                    raise ConfigError(f"unknown setting {k!r} of a replay through PyTorch's "
                                      f"allocator; known: {sorted(_DEFAULTS)}")
                s[k] = v
        elif options is not None:
            raise ConfigError(f"options must be a dict of settings, a PYTORCH_CUDA_ALLOC_CONF "
                              f"string or 'trace'; got {options!r}")
        for k, v in explicit.items():
            if v is UNSET:
                continue
            if k not in _DEFAULTS and k != "name":
                hint = (" (PyTorch's allocator has no such setting: it always grows on demand)"
                        if self.owner_of(k) is not None else "")
                raise ConfigError(f"{k} is not a setting of PyTorch's caching allocator{hint}; "
                                  f"known: {sorted(_DEFAULTS)}")
            s[k] = v
        if trace is not None and index is not None and not isinstance(trace.meta.get("torch"), dict):
            # a gpudash recording of PyTorch's model (a PyTorch session): the device's settings
            # and capacity as recorded, where the call gives none
            entry = index.recorded(index.pick(s["device"]))
            opts = entry.get("options") if isinstance(entry.get("options"), Mapping) else {}
            for key in ("conf", "fraction", "torch_version"):
                if s[key] is None and opts.get(key) is not None:
                    s[key] = opts[key]
            if s["device_bytes"] is None and entry.get("capacity"):
                s["device_bytes"] = entry["capacity"]
        recorded_meta = trace.meta if trace is not None and trace_model(trace) is self else {}
        torch_meta = recorded_meta.get("torch") if isinstance(recorded_meta.get("torch"),
                                                               dict) else {}
        version = s["torch_version"]
        guessed = None
        if version is None:
            try:
                version = parse_torch_version(torch_meta.get("version") or None)
                if torch_meta.get("version"):
                    guessed = version
            except ConfigError:
                version = None
        conf = s["conf"]
        if isinstance(conf, CachingAllocatorConfig):
            conf = conf.copy()
        elif isinstance(conf, str):
            conf = CachingAllocatorConfig(conf, version=version)
        elif conf is None:
            conf = CachingAllocatorConfig.from_snapshot_settings(
                recorded_meta.get("allocator_settings"), version=version)
        else:
            raise ConfigError(f"conf must be a PYTORCH_CUDA_ALLOC_CONF string or a "
                              f"CachingAllocatorConfig; got {conf!r}")
        parts = {k: s[k] for k in _KNOBS if s[k] is not None}
        if parts:
            conf.update(**parts)
        s["conf"] = conf
        frac = s["fraction"]
        if frac is not None:
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or \
                    not 0.0 <= float(frac) <= 1.0:
                raise ConfigError(f"fraction is torch.cuda.set_per_process_memory_fraction's, in "
                                  f"[0, 1]; got {frac!r}")
            s["fraction"] = float(frac)
        if trace is not None:
            s["device"] = index.pick(s["device"])
        elif s["device"] is None:
            s["device"] = 0
        s["assumed"] = []
        other_device = False  # a device_bytes the recorded run cannot have had
        if s["device_bytes"] is not None:
            s["device_bytes"] = parse_bytes(s["device_bytes"], name="device_bytes")
            if s["device_bytes"] <= 0:
                raise ConfigError(f"device_bytes must be > 0; got {s['device_bytes']}")
            if trace is not None and torch_meta:
                cap = index.capacity(s["device"])
                other_device = (s["device_bytes"] != cap[0] if cap is not None else
                                s["device_bytes"] < index.peak_reserved(s["device"]))
        else:
            cap = self.trace_capacity(index, s["device"]) if trace is not None else None
            if cap is None:
                cap = _common_gpu(0)
            s["device_bytes"], how = cap
            s["assumed"].append(f"device {format_bytes(s['device_bytes'])}: {how}")
        if guessed is not None:
            s["assumed"].append(
                f"PyTorch {guessed[0]}.{guessed[1]}'s rules: the oldest PyTorch whose snapshot has "
                "the fields this one has (a snapshot does not record the version; pass "
                "torch_version= or --torch-version)")
        exact = s["exact"]
        recorded = bool(torch_meta)
        overridden = s["fraction"] is not None or parts or explicit.get("conf", UNSET) not in (
            UNSET, None) or (isinstance(options, Mapping) and "conf" in options) or other_device
        if exact is None:
            exact = recorded and not overridden
        elif exact and not recorded:
            raise ConfigError("exact replay follows a PyTorch snapshot's own addresses and release "
                              "points; this trace is not one (replay it with exact=False)")
        s["exact"] = bool(exact)
        s["memory_limit"] = self.limit(s["device_bytes"], s["fraction"])
        s["cc_major"] = 8
        return s

    def limit(self, device_bytes: int, fraction: float | None, cc_major: int = 8) -> int:
        """PyTorch's ``allowed_memory_maximum`` (None: the whole device)."""
        return device_bytes if fraction is None else int(fraction * device_bytes)

    def cli_kwargs(self, args: Any, recorded: dict) -> dict[str, Any]:
        """``--conf`` and ``--torch-version``."""
        return {k: getattr(args, k) for k in ("conf", "torch_version")
                if getattr(args, k, None) is not None}

    def toggle_on(self, settings: dict, toggle: str) -> bool:
        """A knob of ``PYTORCH_CUDA_ALLOC_CONF`` (``expandable_segments:True``)."""
        return f"{toggle}:True" in (settings.get("conf") or "")

    def settings_text(self, options: dict, fraction: bool = True) -> str:
        """``PYTORCH_CUDA_ALLOC_CONF=...``, the fraction, the version's rules."""
        conf = options.get("conf") or ""
        parts = [f"PYTORCH_CUDA_ALLOC_CONF={conf}" if conf else "PYTORCH_CUDA_ALLOC_CONF unset"]
        if fraction:
            frac = options.get("fraction")
            parts.append("no set_per_process_memory_fraction" if frac is None
                         else f"set_per_process_memory_fraction({frac:g})")
        if options.get("torch_version"):
            parts.append(f"PyTorch {options['torch_version']} rules")
        return ", ".join(parts)

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
        conf = CachingAllocatorConfig(options.get("conf") or None,
                                      version=options.get("torch_version"))
        return {**options, "conf": conf}

    def loop(self, settings: Any) -> str:
        return "torch"

    def made(self, meta: dict) -> bool:
        """A PyTorch snapshot (or a trace saved from one), or a gpudash recording whose
        devices all ran PyTorch's model (a PyTorch session)."""
        if meta.get("source") == "pytorch-snapshot" or meta.get("allocator") == "torch":
            return True
        devices = meta.get("devices")
        return isinstance(devices, list) and bool(devices) and all(
            isinstance(d, dict) and d.get("allocator") == "torch" for d in devices)

    def runner(self, settings: Any, compiled: bool) -> Any:
        return run_torch_compiled if compiled else run_torch

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

    @staticmethod
    def split_hazard(table: dict, old_mss: int | None, new_mss: int | None) -> list:
        """The segments a live ``max_split_size_mb`` change would leave unsafe, as
        ``(address, size)``: lowering it (or setting it where it was unset) below what a run
        of free blocks inside a split segment can reach. PyTorch's
        ``release_available_cached_blocks`` releases oversize (>= max_split_size) cached
        blocks with ``cudaFree`` and does not check that they are whole segments: it relies
        on oversize blocks never being split, which holds when the setting is fixed from
        the start. A split segment made under a larger setting (a free run in it reaching
        the new one, next to a block in use) would be freed while that block is in use.
        ``table`` is a chunk table (``regions`` and each block's ``region``). ``[]``: the
        change is safe (raised, unchanged, or no such segment)."""
        import numpy as np

        if new_mss is None or (old_mss is not None and new_mss >= old_mss):
            return []
        regions = np.asarray(table["regions"]).reshape(-1, 2)
        if not len(regions):
            return []
        starts, counts = np.unique(np.asarray(table["region"]), return_counts=True)
        split = dict(zip(starts.tolist(), counts.tolist()))
        # a free run can reach the segment's size less its smallest other block (512 B)
        return [(int(a), int(n)) for a, n in regions.tolist()
                if split.get(a, 0) >= 2 and n - 512 >= new_mss]

    def check_live_split(self, table: dict, old_mss: int | None, new_mss: int | None,
                         where: str, note: str = "") -> None:
        """Refuse (:class:`ConfigError`, naming ``where`` and the segments) a live
        ``max_split_size_mb`` change that :meth:`split_hazard` finds unsafe."""
        hazard = self.split_hazard(table, old_mss, new_mss)
        if hazard:
            raise ConfigError(f"{where}: {self.split_hazard_text(hazard, new_mss)}{note}; "
                              "nothing changed")

    def split_hazard_text(self, hazard: list, new_mss: int) -> str:
        """Why a live ``max_split_size_mb`` change is refused (:meth:`split_hazard`)."""
        shown = ", ".join(f"{a:#x} ({format_bytes(n)})" for a, n in hazard[:3])
        more = f" and {len(hazard) - 3} more" if len(hazard) > 3 else ""
        return (f"max_split_size_mb:{new_mss >> 20} live is not safe now: {len(hazard)} split "
                f"segment(s) ({shown}{more}) hold blocks that can become free runs of "
                f"{format_bytes(new_mss)} or more next to a block in use, and PyTorch's "
                "release of oversize cached blocks (release_available_cached_blocks) would "
                "then cudaFree such a free run (its segment, or an error where it is not "
                "the segment's start) while that block is in use. Set it at the "
                "start (PYTORCH_CUDA_ALLOC_CONF) or once those segments are gone "
                "(torch.cuda.empty_cache() returns them when wholly free)")

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


TORCH = _TorchModel(
    name="torch", title="PyTorch's caching allocator", frameworks=("torch",),
    layout="pools", region="segment", regions="segments", pool="reserved",
    in_use="allocated",
    grid={"expandable_segments": (False, True)},
    fraction_setting="torch.cuda.set_per_process_memory_fraction", chunk="block", bin="pool",
    deferred_frees=False, streams=True,
    sweep_words={"setting": "expandable", "unset_fraction": "none"},
    cli_flags=(("--conf", "conf"), ("--torch-version", "torch_version"), ("--vary", "vary")),
    cli_words={"owner": "PyTorch's", "settings": "its settings: --conf PYTORCH_CUDA_ALLOC_CONF, "
                                                 "--fraction",
               "switch": "--framework torch for PyTorch's",
               "through": " through PyTorch's caching allocator",
               "smallest": "torch.cuda.set_per_process_memory_fraction",
               "regions": "segment(s) from cudaMalloc"},
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

# ------------------------------------------------------------------------------ replay loop
# A replay engine (gpudash.trace.replay._Engine) runs this over its calls (see
# gpudash.models.bfc's loops for what ``engine`` holds); a PyTorch trace's calls carry their
# streams (``engine.streams``) and ``empty_cache()`` calls (op 9).

# The compiled core's twin of the loop (_csrc/replay.pxi); None without it.
_core_run_torch = twin("run_torch", None)



def run_torch(engine: Any, start: int, stop: int, sample: list | None,
               max_ooms: int = sys.maxsize) -> None:
    """The calls through PyTorch's caching allocator: allocations on their streams,
    frees, failed requests tried again, and ``empty_cache()`` calls (op 9)."""
    alloc = engine.alloc
    allocate, deallocate, empty = alloc.try_allocate, alloc.deallocate, alloc.empty_cache
    ptrs = engine.ptrs
    pop = ptrs.pop
    oom_calls = engine.oom_calls
    skipped = 0
    ops = _part(engine.ops, start, stop)
    keys = _part(engine.keys, start, stop)
    nbytes = _part(engine.nbytes, start, stop)
    streams = _part(engine.streams, start, stop) if engine.streams is not None else None
    if sample is not None:
        s_in, s_pool, s_lf = (lst.append for lst in sample)
        stats = alloc._stats.pool["allocated_bytes"]
        largest = alloc._largest_free_block
    i = start
    for j, (op, key, n) in enumerate(zip(ops, keys, nbytes)):
        if op == 2:
            p = pop(key, None)
            if p is None:
                skipped += 1
            else:
                deallocate(p)
        elif op == 9:
            empty()
        else:
            p = allocate(n, True, streams[j] if streams is not None else 0)
            if p or not n:
                if op == 1:
                    ptrs[key] = p
                elif p:
                    deallocate(p)   # a request the source refused, served now
            else:
                oom_calls.append(i)
                if len(oom_calls) >= max_ooms:
                    stop = i + 1
                    if sample is not None:
                        s_in(stats[0])
                        s_pool(alloc._reserved)
                        s_lf(largest())
                    break
        i += 1
        if sample is not None:
            s_in(stats[0])
            s_pool(alloc._reserved)
            s_lf(largest())
    engine.skipped_frees += skipped
    engine.pos = stop


def run_torch_compiled(engine: Any, start: int, stop: int, sample: list | None,
                        max_ooms: int = sys.maxsize) -> None:
    """:func:`run_torch` in C (``gpudash._core.run_torch``), call for call."""
    ops, keys, nbytes, streams = engine._core_columns()
    engine.pos, skipped = _core_run_torch(engine.alloc, ops, keys, nbytes, streams, start,
                                   stop, engine.ptrs, engine.oom_calls, sample, max_ooms)
    engine.skipped_frees += skipped


register(TORCH, aliases=("pytorch", "caching"))
