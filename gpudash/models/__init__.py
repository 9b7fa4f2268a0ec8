"""The allocator protocol and its models: what every layer above an allocator asks of a model.

:mod:`gpudash.models.base` holds the protocol (:class:`AllocatorModel`, :class:`ReplaySettings`,
:class:`Control`, :class:`Fragmentation`) and the registry (:func:`model_for`,
:func:`trace_model`, :func:`model_of`, :func:`model_of_dump`). Each other module of this
package is one allocator's model, which registers itself on import: :mod:`.bfc` (TensorFlow's
and JAX's BFC, :data:`BFC`) and :mod:`.torch` (PyTorch's caching allocator, :data:`TORCH`).
Importing this package imports every model module in it, so a third allocator is one new
module here (its model, its settings, their resolution and its replay loops) beside its
allocator.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import (MODELS, AllocatorModel, Control, Fragmentation, ReplaySettings,
                   default_model, fitting_fraction, fraction_text, model_for, model_of, model_of_dump,
                   register, replay_settings, trace_model)
from .bfc import BFC, BFCReplaySettings
from .torch import TORCH, TorchReplaySettings

# every other model module of the package registers itself on import
for _name in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _name not in ("base", "bfc", "torch") and not _name.startswith("_"):
        importlib.import_module(f"{__name__}.{_name}")

__all__ = ["AllocatorModel", "Control", "Fragmentation", "ReplaySettings", "BFCReplaySettings",
           "TorchReplaySettings", "BFC", "TORCH", "MODELS", "model_for", "trace_model",
           "model_of", "model_of_dump", "default_model", "replay_settings", "register",
           "fitting_fraction", "fraction_text"]
