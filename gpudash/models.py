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
an allocator or a trace (:func:`model_for`, :func:`trace_model`) instead of testing which one
it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ._errors import ConfigError
from ._units import format_bytes

__all__ = ["AllocatorModel", "BFC", "TORCH", "MODELS", "model_for", "trace_model",
           "model_of"]


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

    def __repr__(self) -> str:
        return f"<allocator model {self.name!r}: {self.title}>"

    # ------------------------------------------------------------------ per model
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

    def paste_lines(self, framework: str, fraction: float, settings: dict,
                    device_bytes: int) -> list[str]:  # pragma: no cover - abstract
        """The lines a user pastes to run at ``fraction`` with ``settings``."""
        raise NotImplementedError


@dataclass(frozen=True, repr=False)
class _BFCModel(AllocatorModel):
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


@dataclass(frozen=True, repr=False)
class _TorchModel(AllocatorModel):
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
        frac = min(1.0, math.ceil(fraction * 1000) / 1000)
        lines.append(f"torch.cuda.set_per_process_memory_fraction({frac:g})  # "
                     f"{format_bytes(int(frac * device_bytes))} of {format_bytes(device_bytes)}")
        if text:
            lines.append(f"# or live, for the segments PyTorch makes from then on: "
                         f"torch.cuda.memory._set_allocator_settings({text!r})")
        return lines


BFC = _BFCModel(
    name="bfc", title="TensorFlow's BFC allocator", frameworks=("tensorflow", "jax"),
    layout="bins", region="region", regions="regions", pool="pool", in_use="in use",
    grid={"allow_growth": (True, False)},
    fraction_setting="per_process_gpu_memory_fraction")
TORCH = _TorchModel(
    name="torch", title="PyTorch's caching allocator", frameworks=("torch",),
    layout="pools", region="segment", regions="segments", pool="reserved",
    in_use="allocated",
    grid={"expandable_segments": (False, True)},
    fraction_setting="torch.cuda.set_per_process_memory_fraction")
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
    trace saved from one), else BFC."""
    meta = getattr(trace, "meta", {}) or {}
    return TORCH if meta.get("source") == "pytorch-snapshot" or meta.get("allocator") == \
        "torch" else BFC


def model_of(allocator: Any) -> AllocatorModel:
    """The model of a live allocator (by its ``kind``: PyTorch's caching allocator says
    ``"torch"``)."""
    return TORCH if getattr(allocator, "kind", None) == "torch" else BFC
