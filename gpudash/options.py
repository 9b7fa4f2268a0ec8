"""TensorFlow's GPU configuration, mirrored: ``GPUOptions``, ``ConfigProto``, the environment
variables TensorFlow reads, and the memory limit it derives from them.

gpudash never imports TensorFlow. :class:`GPUOptions` has exactly the eight fields of
TensorFlow's ``GPUOptions`` proto (field numbers 1-8) with the same defaults, so code written
for TensorFlow carries over::

    config = ConfigProto()
    config.gpu_options.per_process_gpu_memory_fraction = 0.5
    config.gpu_options.allow_growth = True

Every assignment is validated at once, and a bad value raises :class:`~gpudash.ConfigError`
naming the field, the value and what is accepted. A TensorFlow ``GPUOptions`` or ``ConfigProto``
(or anything with the same attributes) converts with :meth:`GPUOptions.from_tf` /
:meth:`ConfigProto.from_tf`.

The environment functions take an ``environ`` mapping (default :data:`os.environ`) and follow
TensorFlow's parsing exactly; where TensorFlow logs an error or a warning, gpudash issues a
:class:`~gpudash.GpudashWarning`.

JAX's knobs (``XLA_PYTHON_CLIENT_MEM_FRACTION``, ``XLA_CLIENT_MEM_FRACTION``,
``XLA_PYTHON_CLIENT_PREALLOCATE``, ``XLA_PYTHON_CLIENT_ALLOCATOR``...) are read by
:func:`jax_settings_from_env` exactly as jaxlib reads them (:class:`JaxSettings`,
:func:`jax_memory_limit`). :data:`FRAMEWORK_SETTING_NAMES`, :func:`framework_changes` and
:func:`framework_settings_text` name the options the way each framework does, and
:func:`restart_lines` gives the lines to paste. docs/frameworks.md has the whole table.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import numbers
import os
import re
import struct
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from ._errors import ConfigError, GpudashWarning
from ._units import human_readable_num_bytes, parse_bytes

__all__ = [
    "DEFAULT_DEFERRED_DELETION_BYTES",
    "DEFAULT_POLLING_ACTIVE_DELAY_USECS",
    "DEFAULT_POLLING_INACTIVE_DELAY_MSECS",
    "ConfigProto",
    "GPUOptions",
    "allow_growth_from_env",
    "cuda_visible_devices",
    "garbage_collection_from_env",
    "memory_limit",
    "min_system_memory",
    "normalize_allocator_type",
    "parse_device_list",
    "resolve_visible_devices",
    "simulated_devices_from_env",
    "FRAMEWORKS",
    "FRAMEWORK_SETTING_NAMES",
    "JAX_ALLOCATOR_KINDS",
    "JAX_DEFAULT_MEMORY_FRACTION",
    "JaxSettings",
    "check_framework",
    "float32",
    "framework_changes",
    "framework_settings_text",
    "installed_jaxlib_version",
    "jax_memory_limit",
    "jax_settings_from_env",
    "paste_fraction",
    "restart_lines",
]

#: EventMgr's flush threshold when ``deferred_deletion_bytes`` is 0 (``8*1048576``).
DEFAULT_DEFERRED_DELETION_BYTES = 8 * 1048576
#: EventMgr's sleep between polls while events are pending when the field is 0.
DEFAULT_POLLING_ACTIVE_DELAY_USECS = 10
#: gpudash's idle poll interval when the field is 0 (the 2015 EventMgr's hard-coded 1 ms).
DEFAULT_POLLING_INACTIVE_DELAY_MSECS = 100

_INT32_MAX = (1 << 31) - 1
_INT64_MAX = (1 << 63) - 1
_MIB = 1 << 20
_GIB = 1 << 30

_UNIFIED_PRE_PASCAL = (
    "Unified memory on GPUs with compute capability lower than 6.0 "
    "(pre-Pascal class GPUs) does not support oversubscription."
)


# --------------------------------------------------------------------------------------------
# Field validators: each takes the raw value and returns the value to store, or raises.


def _is_bool(value: object) -> bool:
    if isinstance(value, bool):
        return True
    t = type(value)
    return t.__module__ == "numpy" and t.__name__ in ("bool_", "bool")


def _check_bool(field: str, value: object) -> bool:
    if not _is_bool(value):
        raise ConfigError(f"{field} must be True or False; got {value!r}")
    return bool(value)


def _check_fraction(field: str, value: object) -> float:
    ok = (
        not _is_bool(value)
        and isinstance(value, numbers.Real)
        and math.isfinite(float(value))
        and float(value) >= 0
    )
    if not ok:
        raise ConfigError(
            f"{field} must be a number >= 0 (0 = TensorFlow's default, above 1 = "
            f"oversubscription through unified memory); got {value!r}"
        )
    return float(value)


def _check_int(field: str, value: object, maximum: int, meaning: str) -> int:
    if _is_bool(value) or not isinstance(value, numbers.Integral) or not 0 <= value <= maximum:
        raise ConfigError(
            f"{field} must be an integer between 0 and {maximum} ({meaning}); got {value!r}"
        )
    return int(value)


def normalize_allocator_type(value: object, field: str = "allocator_type") -> str:
    """Normalise an allocator type name.

    Parameters
    ----------
    value : str
        ``""`` or ``"BFC"`` (any case) for TensorFlow's BFC allocator, or ``"cuda_malloc"``
        (any case) for TensorFlow's ``TF_GPU_ALLOCATOR=cuda_malloc`` mode (no BFC: every
        request goes to the device).
    field : str
        Name used in the error message.

    Returns
    -------
    str
        ``"BFC"`` or ``"cuda_malloc"``.

    Raises
    ------
    ConfigError
        For any other value.
    """
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("", "bfc"):
            return "BFC"
        if low == "cuda_malloc":
            return "cuda_malloc"
    raise ConfigError(
        f"{field} must be '' or 'BFC' (best-fit with coalescing, TensorFlow's allocator) or "
        f"'cuda_malloc' (no BFC, any case); got {value!r}"
    )


def _check_allocator_type(field: str, value: object) -> str:
    normalize_allocator_type(value, field)
    return value  # type: ignore[return-value]  # stored as given, like the proto


_DEVICE_LIST_ITEM = re.compile(r"^\s*(\d+)\s*$")


def parse_device_list(text: str, field: str = "visible_device_list") -> list[int]:
    """Parse a comma-separated list of device ids such as ``"5, 3"``.

    Parameters
    ----------
    text : str
        Non-negative integers separated by commas; whitespace around them is ignored. ``""``
        (or only whitespace) gives an empty list.
    field : str
        Name used in the error message.

    Returns
    -------
    list of int

    Raises
    ------
    ConfigError
        If ``text`` is not a string, an entry is not a non-negative integer, or an id repeats.
    """
    accepted = "a comma-separated list of distinct non-negative integers such as '0' or '5,3'"
    if not isinstance(text, str):
        raise ConfigError(f"{field} must be a string, {accepted} ('' = all); got {text!r}")
    if not text.strip():
        return []
    ids: list[int] = []
    for part in text.split(","):
        m = _DEVICE_LIST_ITEM.match(part)
        if m is None:
            raise ConfigError(
                f"{field} must be {accepted} ('' = all); got {text!r} (bad entry {part!r})"
            )
        i = int(m.group(1))
        if i in ids:
            raise ConfigError(
                f"{field} must be {accepted} ('' = all); got {text!r} (id {i} repeats)"
            )
        ids.append(i)
    return ids


def _check_device_list(field: str, value: object) -> str:
    parse_device_list(value, field)  # type: ignore[arg-type]
    return value  # type: ignore[return-value]


# name -> (default, validator), in proto field order (1..8)
_GPU_FIELDS: dict[str, tuple[Any, Any]] = {
    "per_process_gpu_memory_fraction": (0.0, _check_fraction),
    "allocator_type": ("", _check_allocator_type),
    "deferred_deletion_bytes": (
        0,
        lambda f, v: _check_int(f, v, _INT64_MAX, "bytes; 0 = TensorFlow's default of 8 MiB"),
    ),
    "allow_growth": (False, _check_bool),
    "visible_device_list": ("", _check_device_list),
    "polling_active_delay_usecs": (
        0,
        lambda f, v: _check_int(f, v, _INT32_MAX, "microseconds; 0 = the default of 10"),
    ),
    "polling_inactive_delay_msecs": (
        0,
        lambda f, v: _check_int(f, v, _INT32_MAX, "milliseconds; 0 = the default of 1"),
    ),
    "force_gpu_compatible": (False, _check_bool),
}


def _unknown(cls_name: str, key: object, valid: Any) -> ConfigError:
    return ConfigError(
        f"{cls_name} has no field {key!r}; valid fields are: {', '.join(valid)}"
    )


def _validate_fields(cls_name: str, spec: dict[str, tuple[Any, Any]],
                     values: Mapping[str, Any]) -> dict[str, Any]:
    """Validate every entry of ``values`` against ``spec``; return the converted values."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        entry = spec.get(key)
        if entry is None:
            raise _unknown(cls_name, key, spec)
        out[key] = entry[1](key, value)
    return out


def _read_attrs(obj: object, names: Any) -> dict[str, Any]:
    """The attributes of ``obj`` among ``names`` that it has."""
    missing = object()
    out = {}
    for name in names:
        value = getattr(obj, name, missing)
        if value is not missing:
            out[name] = value
    return out


# --------------------------------------------------------------------------------------------


class GPUOptions:
    """TensorFlow's ``GPUOptions``: the eight fields of the proto, validated on assignment.

    Parameters
    ----------
    source : GPUOptions, dict or TensorFlow GPUOptions-like object, optional
        Initial values: another :class:`GPUOptions`, a mapping of field names to values, or
        any object with some of the field attributes (read by attribute, as from a
        TensorFlow ``tf.compat.v1.GPUOptions``).
    **fields
        Field values; they override ``source``.

    Attributes
    ----------
    per_process_gpu_memory_fraction : float, default 0.0
        Fraction of the device's **total** memory to reserve. 0 means TensorFlow's default:
        the free memory minus a system reserve (see :func:`memory_limit`); above 1 means
        oversubscription through unified (managed) memory.
    allocator_type : str, default ""
        ``""`` or ``"BFC"`` (any case) for the BFC allocator, ``"cuda_malloc"`` for none.
    deferred_deletion_bytes : int, default 0
        EventMgr's flush threshold for freed tensors; 0 means 8 MiB.
    allow_growth : bool, default False
        Start with a small region and grow, instead of reserving the whole limit at once.
        ``TF_FORCE_GPU_ALLOW_GROWTH`` overrides it (:func:`allow_growth_from_env`).
    visible_device_list : str, default ""
        Comma-separated visible device ids mapped to TensorFlow's virtual ``/gpu:0``,
        ``/gpu:1``... (``"5,3"``); ``""`` means all (:func:`resolve_visible_devices`).
    polling_active_delay_usecs : int, default 0
        Sleep between event polls while events are pending; 0 means 10 µs.
    polling_inactive_delay_msecs : int, default 0
        Documented by TensorFlow but never read by it; gpudash uses it as the idle poll
        interval (0 means 1 ms).
    force_gpu_compatible : bool, default False
        Allocate every CPU tensor in pinned host memory.

    Raises
    ------
    ConfigError
        For an unknown field (the message lists the valid ones) or an invalid value.

    Examples
    --------
    >>> opts = GPUOptions(allow_growth=True)
    >>> opts.per_process_gpu_memory_fraction = 0.5
    >>> opts
    GPUOptions(per_process_gpu_memory_fraction=0.5, allow_growth=True)
    >>> GPUOptions({"allow_growth": True}) == GPUOptions(allow_growth=True)
    True
    """

    __slots__ = tuple(_GPU_FIELDS)
    __hash__ = None  # type: ignore[assignment]  # mutable

    #: The eight field names, in proto order.
    FIELDS: ClassVar[tuple[str, ...]] = tuple(_GPU_FIELDS)
    #: TensorFlow's defaults (read-only).
    DEFAULTS: ClassVar[Mapping[str, Any]] = MappingProxyType(
        {k: v[0] for k, v in _GPU_FIELDS.items()})

    per_process_gpu_memory_fraction: float
    allocator_type: str
    deferred_deletion_bytes: int
    allow_growth: bool
    visible_device_list: str
    polling_active_delay_usecs: int
    polling_inactive_delay_msecs: int
    force_gpu_compatible: bool

    def __init__(self, source: Any = None, /, **fields: Any) -> None:
        values = dict(self.DEFAULTS)
        if source is not None:
            values.update(self._source_values(source))
        values.update(_validate_fields("GPUOptions", _GPU_FIELDS, fields))
        for key, value in values.items():
            object.__setattr__(self, key, value)

    @classmethod
    def _source_values(cls, source: Any) -> dict[str, Any]:
        if isinstance(source, GPUOptions):
            return source.as_dict()
        if isinstance(source, Mapping):
            return _validate_fields("GPUOptions", _GPU_FIELDS, source)
        found = _read_attrs(source, _GPU_FIELDS)
        if not found:
            raise ConfigError(
                "GPUOptions expects a GPUOptions, a dict of fields or a TensorFlow "
                f"GPUOptions-like object (with attributes such as allow_growth); got {source!r}"
            )
        return _validate_fields("GPUOptions", _GPU_FIELDS, found)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GPUOptions:
        """Build from a mapping of field names to values (unknown keys raise ConfigError)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"GPUOptions.from_dict expects a mapping; got {data!r}")
        return cls(data)

    @classmethod
    def from_tf(cls, obj: Any) -> GPUOptions:
        """Build from a TensorFlow ``GPUOptions`` (or any object with the same attributes).

        The eight fields are read with ``getattr``; an attribute the object lacks keeps its
        default. TensorFlow itself is never imported.
        """
        found = _read_attrs(obj, _GPU_FIELDS)
        if not found:
            raise ConfigError(
                f"GPUOptions.from_tf expects an object with GPUOptions attributes "
                f"({', '.join(_GPU_FIELDS)}); got {obj!r}"
            )
        return cls(**found)

    def __setattr__(self, name: str, value: Any) -> None:
        entry = _GPU_FIELDS.get(name)
        if entry is None:
            raise _unknown("GPUOptions", name, _GPU_FIELDS)
        object.__setattr__(self, name, entry[1](name, value))

    def __delattr__(self, name: str) -> None:
        raise ConfigError(f"GPUOptions fields cannot be deleted ({name!r}); assign a value")

    def as_dict(self) -> dict[str, Any]:
        """All eight fields, in proto order."""
        return {k: getattr(self, k) for k in _GPU_FIELDS}

    def copy(self, **changes: Any) -> GPUOptions:
        """A new GPUOptions with ``changes`` applied; all are validated before any is used."""
        values = self.as_dict()
        values.update(_validate_fields("GPUOptions", _GPU_FIELDS, changes))
        return type(self)(**values)

    replace = copy

    def update(self, **changes: Any) -> None:
        """Apply ``changes`` in place: every change is validated first, so a bad one leaves
        this object untouched."""
        checked = _validate_fields("GPUOptions", _GPU_FIELDS, changes)
        for key, value in checked.items():
            object.__setattr__(self, key, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GPUOptions):
            return NotImplemented
        return self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self.as_dict().items() if v != self.DEFAULTS[k]]
        return f"GPUOptions({', '.join(parts)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.as_dict(),))

    # -- effective values ---------------------------------------------------------------------

    @property
    def effective_deferred_deletion_bytes(self) -> int:
        """``deferred_deletion_bytes``, or TensorFlow's ``8*1048576`` when it is 0."""
        return self.deferred_deletion_bytes or DEFAULT_DEFERRED_DELETION_BYTES

    @property
    def effective_polling_active_delay_usecs(self) -> int:
        """``polling_active_delay_usecs``, or TensorFlow's 10 when it is 0."""
        return self.polling_active_delay_usecs or DEFAULT_POLLING_ACTIVE_DELAY_USECS

    @property
    def effective_polling_inactive_delay_msecs(self) -> int:
        """``polling_inactive_delay_msecs``, or 100 when it is 0.

        TensorFlow documents this field but never reads it (its 2015 EventMgr hard-coded a
        1 ms wait on an empty queue; later ones block until work arrives). gpudash's poller
        wakes as soon as a batch is queued, and otherwise polls at this interval, so an idle
        session costs next to nothing.
        """
        return self.polling_inactive_delay_msecs or DEFAULT_POLLING_INACTIVE_DELAY_MSECS

    @property
    def normalized_allocator_type(self) -> str:
        """``"BFC"`` for ``""``/``"bfc"`` (any case), ``"cuda_malloc"`` for that (any case)."""
        return normalize_allocator_type(self.allocator_type)

    @property
    def visible_device_ids(self) -> list[int]:
        """``visible_device_list`` parsed (``[]`` when empty, which means all devices)."""
        return parse_device_list(self.visible_device_list)

    @property
    def uses_unified_memory(self) -> bool:
        """True when ``per_process_gpu_memory_fraction > 1`` (TensorFlow's trigger)."""
        return self.per_process_gpu_memory_fraction > 1.0


def _to_gpu_options(value: Any) -> GPUOptions:
    if value is None:
        return GPUOptions()
    if isinstance(value, GPUOptions):
        return value
    return GPUOptions(value)


_CONFIG_FIELDS: dict[str, tuple[Any, Any]] = {
    "gpu_options": (None, lambda f, v: _to_gpu_options(v)),
    "allow_soft_placement": (False, _check_bool),
    "log_device_placement": (False, _check_bool),
}


class ConfigProto:
    """TensorFlow's ``ConfigProto``, reduced to what gpudash uses.

    Parameters
    ----------
    gpu_options : GPUOptions, dict or TensorFlow GPUOptions-like object, optional
        Converted to a :class:`GPUOptions` (a GPUOptions instance is kept, not copied, as in
        ``config.gpu_options.allow_growth = True``). None gives the defaults.
    allow_soft_placement : bool, default False
        Recorded for fidelity; gpudash places nothing.
    log_device_placement : bool, default False
        Recorded for fidelity.

    Examples
    --------
    >>> config = ConfigProto()
    >>> config.gpu_options.per_process_gpu_memory_fraction = 0.5
    >>> config
    ConfigProto(gpu_options=GPUOptions(per_process_gpu_memory_fraction=0.5))
    """

    __slots__ = tuple(_CONFIG_FIELDS)
    __hash__ = None  # type: ignore[assignment]

    FIELDS: ClassVar[tuple[str, ...]] = tuple(_CONFIG_FIELDS)

    gpu_options: GPUOptions
    allow_soft_placement: bool
    log_device_placement: bool

    def __init__(self, gpu_options: Any = None, allow_soft_placement: bool = False,
                 log_device_placement: bool = False) -> None:
        values = _validate_fields("ConfigProto", _CONFIG_FIELDS, {
            "gpu_options": gpu_options,
            "allow_soft_placement": allow_soft_placement,
            "log_device_placement": log_device_placement,
        })
        for key, value in values.items():
            object.__setattr__(self, key, value)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConfigProto:
        """Build from a mapping (``gpu_options`` may itself be a mapping)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"ConfigProto.from_dict expects a mapping; got {data!r}")
        for key in data:
            if key not in _CONFIG_FIELDS:
                raise _unknown("ConfigProto", key, _CONFIG_FIELDS)
        return cls(**data)

    @classmethod
    def from_tf(cls, obj: Any) -> ConfigProto:
        """Build from a TensorFlow ``ConfigProto`` (or any object with the same attributes)."""
        found = _read_attrs(obj, _CONFIG_FIELDS)
        if not found:
            raise ConfigError(
                f"ConfigProto.from_tf expects an object with ConfigProto attributes "
                f"({', '.join(_CONFIG_FIELDS)}); got {obj!r}"
            )
        if found.get("gpu_options") is not None:
            found["gpu_options"] = GPUOptions.from_tf(found["gpu_options"])
        return cls(**found)

    def __setattr__(self, name: str, value: Any) -> None:
        entry = _CONFIG_FIELDS.get(name)
        if entry is None:
            raise _unknown("ConfigProto", name, _CONFIG_FIELDS)
        object.__setattr__(self, name, entry[1](name, value))

    def __delattr__(self, name: str) -> None:
        raise ConfigError(f"ConfigProto fields cannot be deleted ({name!r}); assign a value")

    def as_dict(self) -> dict[str, Any]:
        """All fields; ``gpu_options`` as a nested dict."""
        return {
            "gpu_options": self.gpu_options.as_dict(),
            "allow_soft_placement": self.allow_soft_placement,
            "log_device_placement": self.log_device_placement,
        }

    def copy(self, **changes: Any) -> ConfigProto:
        """A deep copy (its own GPUOptions) with ``changes`` applied, all validated first."""
        checked = _validate_fields("ConfigProto", _CONFIG_FIELDS, changes)
        values = {
            "gpu_options": self.gpu_options.copy(),
            "allow_soft_placement": self.allow_soft_placement,
            "log_device_placement": self.log_device_placement,
        }
        values.update(checked)
        return type(self)(**values)

    replace = copy

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConfigProto):
            return NotImplemented
        return self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        parts = []
        if self.gpu_options != GPUOptions():
            parts.append(f"gpu_options={self.gpu_options!r}")
        if self.allow_soft_placement:
            parts.append("allow_soft_placement=True")
        if self.log_device_placement:
            parts.append("log_device_placement=True")
        return f"ConfigProto({', '.join(parts)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.gpu_options, self.allow_soft_placement,
                             self.log_device_placement))


# --------------------------------------------------------------------------------------------
# Environment variables


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def allow_growth_from_env(config_value: bool, environ: Mapping[str, str] | None = None) -> bool:
    """TensorFlow's ``GetAllowGrowthValue``: apply ``TF_FORCE_GPU_ALLOW_GROWTH``.

    Parameters
    ----------
    config_value : bool
        ``GPUOptions.allow_growth``.
    environ : mapping, optional
        Environment to read (default :data:`os.environ`).

    Returns
    -------
    bool
        The config value when the variable is unset; ``True``/``False`` when it is exactly
        ``"true"``/``"false"`` (case-sensitive, as TensorFlow's ``strcmp``); the config value,
        with a warning, for anything else.

    Warns
    -----
    GpudashWarning
        When the variable changes the value (TensorFlow's LOG WARNING), or cannot be parsed
        (TensorFlow's LOG ERROR).
    """
    config_value = _check_bool("allow_growth", config_value)
    raw = _env(environ).get("TF_FORCE_GPU_ALLOW_GROWTH")
    if raw is None:
        return config_value
    if raw == "false":
        result = False
    elif raw == "true":
        result = True
    else:
        warnings.warn(
            f'The TF_FORCE_GPU_ALLOW_GROWTH environment variable is set but could not be '
            f'parsed: "{raw}". Valid values are "true" or "false". Using original config '
            f'value of {config_value}.',
            GpudashWarning, stacklevel=2,
        )
        return config_value
    if result != config_value:
        warnings.warn(
            "Overriding allow_growth setting because the TF_FORCE_GPU_ALLOW_GROWTH "
            f"environment variable is set. Original config value was {config_value}.",
            GpudashWarning, stacklevel=2,
        )
    return result


def garbage_collection_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """TensorFlow's ``GetGarbageCollectionValue``: read ``TF_ENABLE_GPU_GARBAGE_COLLECTION``.

    Returns
    -------
    bool
        True when unset (the GPU default; BFC's own default is False), ``"false"`` gives
        False, ``"true"`` True, anything else True with a warning.

    Warns
    -----
    GpudashWarning
        When the value cannot be parsed.
    """
    raw = _env(environ).get("TF_ENABLE_GPU_GARBAGE_COLLECTION")
    if raw is None or raw == "true":
        return True
    if raw == "false":
        return False
    warnings.warn(
        "The TF_ENABLE_GPU_GARBAGE_COLLECTION environment variable is set but could not be "
        f'parsed: "{raw}". Valid values are "true" or "false". Using the default value "true".',
        GpudashWarning, stacklevel=2,
    )
    return True


def cuda_visible_devices(environ: Mapping[str, str] | None = None) -> list[int] | None:
    """Parse ``CUDA_VISIBLE_DEVICES`` into device indices.

    Returns
    -------
    list of int or None
        None when the variable is unset (every device is visible), ``[]`` when it is empty,
        else the indices in order (``"0,2"`` gives ``[0, 2]``). As in CUDA, a negative entry
        ends the list: ``"-1"`` hides every device and ``"0,-1,2"`` gives ``[0]``.

    Raises
    ------
    ConfigError
        For an entry that is not an integer (UUIDs such as ``GPU-...`` and ``MIG-...`` are not
        supported by gpudash) or a repeated index; the message names the variable.
    """
    raw = _env(environ).get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    if not raw.strip():
        return []
    ids: list[int] = []
    for part in raw.split(","):
        try:
            i = int(part.strip())
        except ValueError:
            raise ConfigError(
                "CUDA_VISIBLE_DEVICES must be a comma-separated list of device indices such "
                f"as '0,2' ('' or '-1' = no device; UUIDs are not supported by gpudash); "
                f"got {raw!r} (bad entry {part!r})"
            ) from None
        if i < 0:
            break
        if i in ids:
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES lists device {i} twice; got {raw!r}"
            )
        ids.append(i)
    return ids


_SIM_ITEM = re.compile(r"^\s*(?:(\d+)\s*[xX*]\s*)?(.+?)\s*$")


def simulated_devices_from_env(environ: Mapping[str, str] | None = None) -> list[int] | None:
    """Parse ``GPUDASH_SIMULATE``: the capacities of the devices to simulate.

    The value is a comma-separated list of ``SIZE`` or ``NxSIZE`` items, where SIZE is
    anything :func:`~gpudash._units.parse_bytes` accepts: ``"16GiB"`` is one 16 GiB device,
    ``"2x16GiB"`` two, ``"1x8GiB,1x16GiB"`` or ``"8GiB,16GiB"`` one of each.

    Returns
    -------
    list of int or None
        Capacities in bytes, one per device; None when the variable is unset or blank.

    Raises
    ------
    ConfigError
        For a count below 1, a size of 0 or a size that does not parse.
    """
    raw = _env(environ).get("GPUDASH_SIMULATE")
    if raw is None or not raw.strip():
        return None
    accepted = ("a comma-separated list of device sizes, each SIZE or NxSIZE, such as "
                "'16GiB', '2x16GiB' or '1x8GiB,1x16GiB'")
    sizes: list[int] = []
    for part in raw.split(","):
        m = _SIM_ITEM.match(part)
        if m is None:
            raise ConfigError(f"GPUDASH_SIMULATE must be {accepted}; got {raw!r}")
        count = int(m.group(1)) if m.group(1) is not None else 1
        try:
            size = parse_bytes(m.group(2), name="a GPUDASH_SIMULATE size")
        except ConfigError as exc:
            raise ConfigError(
                f"GPUDASH_SIMULATE must be {accepted}; got {raw!r} (bad size {m.group(2)!r})"
            ) from exc
        if count < 1 or size == 0:
            raise ConfigError(
                f"GPUDASH_SIMULATE must be {accepted} with N >= 1 and SIZE > 0; got {raw!r}"
            )
        sizes.extend([size] * count)
    return sizes


def resolve_visible_devices(visible_device_list: str, n_visible: int) -> list[int]:
    """Map TensorFlow's virtual device ids to visible ones (``GPUOptions.visible_device_list``).

    Parameters
    ----------
    visible_device_list : str
        ``"5,3"`` makes visible device 5 ``/gpu:0`` and visible device 3 ``/gpu:1``;
        ``""`` keeps every visible device in order.
    n_visible : int
        How many devices the process can see (after ``CUDA_VISIBLE_DEVICES``).

    Returns
    -------
    list of int
        Element ``i`` is the visible id of virtual device ``i``.

    Raises
    ------
    ConfigError
        For a malformed list, or an id that is not below ``n_visible`` (TensorFlow's
        "'visible_device_list' listed an invalid GPU id").
    """
    if _is_bool(n_visible) or not isinstance(n_visible, numbers.Integral) or n_visible < 0:
        raise ConfigError(f"n_visible must be an integer >= 0; got {n_visible!r}")
    ids = parse_device_list(visible_device_list)
    if not ids:
        return list(range(n_visible))
    for i in ids:
        if i >= n_visible:
            raise ConfigError(
                f"'visible_device_list' listed an invalid GPU id '{i}' but visible device "
                f"count is {n_visible} (ids must be below {n_visible}; "
                f"visible_device_list={visible_device_list!r})"
            )
    return ids


# --------------------------------------------------------------------------------------------
# Memory limit


def min_system_memory(available: int, cc_major: int) -> int:
    """TensorFlow's ``MinSystemMemory``: bytes left to the system when the fraction is 0.

    Parameters
    ----------
    available : int
        Free device memory in bytes.
    cc_major : int
        Major compute capability.

    Returns
    -------
    int
        225 MiB when ``available`` is below 2 GiB; else 500 MiB for ``cc_major <= 6``,
        1050 MiB for 7, 1536 MiB for 8 and 1800 MiB above (an optimised build's values).
    """
    if available < 2 * _GIB:
        return 225 * _MIB
    if cc_major <= 6:
        return 500 * _MIB
    if cc_major <= 7:
        return 1050 * _MIB
    if cc_major <= 8:
        return 1536 * _MIB
    return 1800 * _MIB


def memory_limit(total: int, available: int, fraction: float, cc_major: int = 8,
                 system_memory_mb: int | None = None,
                 environ: Mapping[str, str] | None = None) -> int:
    """TensorFlow's ``SingleVirtualDeviceMemoryLimit``: the BFC limit of one GPU.

    Parameters
    ----------
    total, available : int
        The device's total and free memory in bytes (``cudaMemGetInfo``).
    fraction : float
        ``per_process_gpu_memory_fraction``. 0 gives ``available - min_system_memory(...)``
        (the reserve is only subtracted when it is below ``available``); otherwise
        ``int(total * fraction)`` -- of the **total**, not the free memory.
    cc_major : int, default 8
        Major compute capability.
    system_memory_mb : int, optional
        ``experimental.gpu_system_memory_size_in_mb``: when > 0, the limit becomes
        ``available - system_memory_mb MiB`` (if that reservation fits in ``available``),
        whatever the fraction. Takes precedence over the environment variable.
    environ : mapping, optional
        Environment for ``TF_DEVICE_MIN_SYS_MEMORY_IN_MB`` (default :data:`os.environ`),
        which overrides the same way when ``system_memory_mb`` is not given.

    Returns
    -------
    int
        The limit in bytes.

    Raises
    ------
    ConfigError
        For a negative size, an invalid fraction, or ``fraction > 1`` on a GPU with compute
        capability below 6.0 (TensorFlow: "Unified memory on GPUs with compute capability
        lower than 6.0 (pre-Pascal class GPUs) does not support oversubscription.").

    Warns
    -----
    GpudashWarning
        When ``TF_DEVICE_MIN_SYS_MEMORY_IN_MB`` is not a non-negative integer, or a
        reservation exceeds the available memory; the override is then ignored.

    Examples
    --------
    >>> memory_limit(16 << 30, 16 << 30, 0.0, cc_major=8, environ={})
    15569256448
    >>> memory_limit(16 << 30, 8 << 30, 0.5, environ={})
    8589934592
    """
    total = parse_bytes(total, name="total")
    available = parse_bytes(available, name="available")
    fraction = _check_fraction("per_process_gpu_memory_fraction", fraction)
    if fraction > 1.0 and cc_major < 6:
        raise ConfigError(
            f"{_UNIFIED_PRE_PASCAL} per_process_gpu_memory_fraction={fraction} needs compute "
            f"capability >= 6.0; this GPU has {cc_major}.x"
        )
    if fraction == 0:
        limit = available
        reserve = min_system_memory(available, cc_major)
        if reserve < limit:
            limit -= reserve
    else:
        product = total * fraction
        if not math.isfinite(product) or product > _INT64_MAX:
            raise ConfigError(
                f"per_process_gpu_memory_fraction={fraction} of {total} bytes is beyond what "
                f"a limit can be (int64 bytes); choose a smaller fraction")
        limit = int(product)

    reserved_mb: int | None = None
    if system_memory_mb is not None and system_memory_mb != 0:
        reserved_mb = _check_int("system_memory_mb", system_memory_mb, _INT64_MAX >> 20,
                                 "MiB left to the system")
    else:
        raw = _env(environ).get("TF_DEVICE_MIN_SYS_MEMORY_IN_MB")
        if raw:
            try:
                reserved_mb = int(raw.strip())
            except ValueError:
                reserved_mb = -1
            if reserved_mb < 0:
                warnings.warn(
                    f"The requested reserved device memory {raw} is invalid. The request "
                    "will be ignored. (TF_DEVICE_MIN_SYS_MEMORY_IN_MB must be an integer >= 0)",
                    GpudashWarning, stacklevel=2,
                )
                reserved_mb = None
    if reserved_mb is not None:
        reserved = reserved_mb * _MIB
        if reserved <= available:
            limit = available - reserved
        else:
            warnings.warn(
                "The requested reserved device memory "
                f"{human_readable_num_bytes(min(reserved, _INT64_MAX))} is larger than the "
                f"available memory of {human_readable_num_bytes(available)}. The request is "
                "ignored.",
                GpudashWarning, stacklevel=2,
            )
    return limit


# --------------------------------------------------------------------------------------------
# JAX / XLA
#
# JAX's GPU client runs the same BFC allocator (TSL's ``tsl::BFCAllocator``) with its own
# knobs. jaxlib turns environment variables into PJRT plugin options in
# ``xla_client.generate_pjrt_gpu_plugin_options`` (in XLA's ``xla/python/xla_client.py`` up to
# jaxlib 0.5, in JAX's ``jaxlib/xla_client.py`` from 0.6); XLA's ``CreateBFCAllocator``
# (``xla/pjrt/gpu/gpu_helpers.cc``) builds the allocator from them. docs/frameworks.md has
# the table of every knob, with the jaxlib versions.

#: jaxlib's default memory fraction (``GpuAllocatorConfig::memory_fraction``).
JAX_DEFAULT_MEMORY_FRACTION = 0.75
#: The oldest jaxlib whose semantics gpudash models (the first plugin-only CUDA release).
JAX_OLDEST_SUPPORTED = (0, 4, 30)

#: ``XLA_PYTHON_CLIENT_ALLOCATOR`` kinds: (first jaxlib that accepts it, what it means).
JAX_ALLOCATOR_KINDS: Mapping[str, tuple[tuple[int, ...], str]] = MappingProxyType({
    "default": ((0, 4, 30), "the BFC allocator (GpuAllocatorConfig::kDefault is built as kBFC)"),
    "bfc": ((0, 4, 30), "the BFC allocator, named GPU_<n>_bfc"),
    "platform": ((0, 4, 30), "no BFC: every buffer is allocated from and returned to the "
                 "device at once (slow; the only kind that gives memory back)"),
    "cuda_async": ((0, 4, 30), "no BFC: CUDA's stream-ordered pool (cudaMallocAsync) "
                   "capped at the fraction, reserved up front when preallocating"),
    "vmm": ((0, 10, 0), "no BFC: CUDA virtual memory management "
            "(CudaDeviceAddressVmmAllocator), capped at the fraction, never preallocated"),
    "address": ((0, 11, 0), "no BFC: a synchronous pass-through allocator built by the "
                "PJRT client (StreamExecutorAddressAllocator)"),
})
#: Kinds whose allocator gpudash runs: the BFC, or one region per allocation.
JAX_MODELLED_KINDS = {"default": "BFC", "bfc": "BFC", "platform": "cuda_malloc",
                      "address": "cuda_malloc"}
#: The first jaxlib that reads ``XLA_CLIENT_MEM_FRACTION`` (XLA change of 26 Aug 2024).
JAX_CLIENT_MEM_FRACTION_SINCE = (0, 4, 32)
#: XLA rounds the BFC's limit up to a multiple of this (``kGpuMemoryLimitGranularity``).
JAX_LIMIT_GRANULARITY = 2 * _MIB
#: The first jaxlib that rounds the limit up (XLA PR #43125 of 3 June 2026, in jaxlib 0.10.2).
JAX_LIMIT_ROUNDED_SINCE = (0, 10, 2)

_JAX_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def _version_tuple(version: Any) -> tuple[int, ...] | None:
    """``"0.4.35"`` / ``(0, 4, 35)`` / None -> a tuple of ints (None = the newest)."""
    if version is None:
        return None
    if isinstance(version, tuple) and all(isinstance(v, int) for v in version):
        return version
    if isinstance(version, str):
        m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
        if m:
            return tuple(int(g) for g in m.groups() if g is not None)
    raise ConfigError(f"jaxlib_version must be a version such as '0.4.35' or (0, 4, 35); "
                      f"got {version!r}")


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def installed_jaxlib_version() -> str | None:
    """The installed jaxlib's version, read from its metadata (jaxlib is not imported)."""
    from importlib import metadata

    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return None


def float32(value: float) -> float:
    """``value`` rounded to single precision, as a Python float.

    jaxlib passes ``memory_fraction`` to the PJRT plugin as a 32-bit float
    (``PJRT_NamedValue_kFloat``), so XLA computes the limit with the rounded fraction.
    """
    return struct.unpack("f", struct.pack("f", value))[0]


def jax_memory_limit(total: int, fraction: float = JAX_DEFAULT_MEMORY_FRACTION,
                     unified_memory: bool = False, jaxlib_version: Any = None) -> int:
    """XLA's ``CreateBFCAllocator`` limit (``bytes_limit`` in ``device.memory_stats()``).

    ``size_t(total * fraction)``, rounded up to a multiple of 2 MiB from jaxlib 0.10.2 on:
    ``RoundUpGpuMemoryLimit`` in XLA's ``xla/pjrt/gpu/gpu_helpers.cc`` (XLA PR #43125, 3 June
    2026, which moved CUDA device memory to the VMM allocator; its allocations are whole
    2 MiB granules, and the limit is rounded so that ``pool_bytes`` never exceeds it). The
    rounding applies to the limit itself, so it holds whether the BFC preallocates
    (``XLA_PYTHON_CLIENT_PREALLOCATE``, the default) or grows, with unified memory too, and
    whichever variable gave the fraction (``XLA_CLIENT_MEM_FRACTION`` or the older
    ``XLA_PYTHON_CLIENT_MEM_FRACTION``: jaxlib passes either as the same plugin option).

    Parameters
    ----------
    total : int
        The device's total memory in bytes (``DeviceMemoryUsage``).
    fraction : float
        The memory fraction as jaxlib read it; rounded to single precision first, as the
        plugin option carries it.
    unified_memory : bool
        ``TF_FORCE_UNIFIED_MEMORY``: the limit is then ``total * max(1, fraction)``.
    jaxlib_version : str or tuple, optional
        The jaxlib whose rule to apply (default: the newest, which rounds); jaxlibs older
        than 0.10.2 do not round.

    Examples
    --------
    >>> jax_memory_limit(16 << 30)          # 0.75 of 16 GiB
    12884901888
    >>> jax_memory_limit(16 << 30, 0.41)    # float32(0.41) = 0.4099999964..., then 2 MiB up
    7044333568
    >>> jax_memory_limit(16 << 30, 0.41, jaxlib_version="0.10.1")
    7043746304
    """
    total = parse_bytes(total, name="total")
    f = float32(fraction)
    if unified_memory:
        f = max(1.0, f)
    limit = int(total * f)
    version = _version_tuple(jaxlib_version)
    if version is None or version >= JAX_LIMIT_ROUNDED_SINCE:
        limit = -(-limit // JAX_LIMIT_GRANULARITY) * JAX_LIMIT_GRANULARITY
    return limit


@dataclasses.dataclass(frozen=True)
class JaxSettings:
    """JAX's GPU allocator settings, as jaxlib reads them from the environment.

    Attributes
    ----------
    allocator : str
        ``XLA_PYTHON_CLIENT_ALLOCATOR``, lower-cased (``"default"`` when unset).
    memory_fraction : float
        The fraction of **total** device memory (default 0.75), as a double; XLA uses its
        single-precision rounding (:attr:`effective_fraction`).
    fraction_variable : str or None
        The variable it came from, or None for the default.
    preallocate : bool
        ``XLA_PYTHON_CLIENT_PREALLOCATE``: reserve the whole limit at start (default True).
    unified_memory : bool
        ``TF_FORCE_UNIFIED_MEMORY`` (read by XLA's ``CreateBFCAllocator``).
    collective_memory_size : int
        ``XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB`` in bytes (a separate BFC for NCCL
        memory; 0 = grown as needed).
    jaxlib_version : tuple of int or None
        The jaxlib whose rules were applied (None: the newest gpudash knows).
    """

    allocator: str = "default"
    memory_fraction: float = JAX_DEFAULT_MEMORY_FRACTION
    fraction_variable: str | None = None
    preallocate: bool = True
    unified_memory: bool = False
    collective_memory_size: int = 0
    jaxlib_version: tuple[int, ...] | None = None

    @property
    def effective_fraction(self) -> float:
        """The fraction XLA multiplies by: single precision, at least 1 with unified memory."""
        f = float32(self.memory_fraction)
        return max(1.0, f) if self.unified_memory else f

    @property
    def uses_bfc(self) -> bool:
        return self.allocator in ("default", "bfc")

    @property
    def allow_growth(self) -> bool:
        """The BFC's ``allow_growth`` (``opts.allow_growth = !preallocate``)."""
        return not self.preallocate

    @property
    def garbage_collection(self) -> bool:
        """Always False: XLA leaves ``BFCAllocator::Options::garbage_collection`` at its
        default, unlike TensorFlow's GPU default of True."""
        return False

    def memory_limit(self, total: int) -> int:
        """The BFC limit on a device of ``total`` bytes, by :attr:`jaxlib_version`'s rule
        (:func:`jax_memory_limit`)."""
        return jax_memory_limit(total, self.memory_fraction, self.unified_memory,
                                self.jaxlib_version)

    def gpu_options(self) -> GPUOptions:
        """The TensorFlow-shaped options gpudash runs JAX's allocator with.

        Raises
        ------
        ConfigError
            For an allocator kind gpudash does not run (``cuda_async``, ``vmm``).
        """
        kind = JAX_MODELLED_KINDS.get(self.allocator)
        if kind is None:
            raise ConfigError(
                f"XLA_PYTHON_CLIENT_ALLOCATOR={self.allocator!r} is "
                f"{JAX_ALLOCATOR_KINDS[self.allocator][1]}, which gpudash does not run; a "
                f"gpudash session accepts {', '.join(repr(k) for k in JAX_MODELLED_KINDS)}")
        return GPUOptions(per_process_gpu_memory_fraction=self.effective_fraction,
                          allow_growth=self.allow_growth, allocator_type=kind)

    def as_env(self) -> dict[str, str]:
        """The variables that give these settings (only those differing from the defaults)."""
        env = {}
        if self.allocator != "default":
            env["XLA_PYTHON_CLIENT_ALLOCATOR"] = self.allocator
        if self.fraction_variable is not None:
            env[self.fraction_variable] = _fraction_text(self.memory_fraction)
        if not self.preallocate:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        if self.unified_memory:
            env["TF_FORCE_UNIFIED_MEMORY"] = "1"
        if self.collective_memory_size:
            env["XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB"] = str(
                self.collective_memory_size >> 20)
        return env


def _fraction_text(value: float) -> str:
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def jax_settings_from_env(environ: Mapping[str, str] | None = None,
                          jaxlib_version: Any = None) -> JaxSettings:
    """Read JAX's allocator variables exactly as jaxlib does.

    Parameters
    ----------
    environ : mapping, optional
        Environment to read (default :data:`os.environ`).
    jaxlib_version : str or tuple, optional
        Apply this jaxlib's rules (``"0.4.35"``); default: the newest gpudash knows
        (0.11), which accepts every kind. See docs/frameworks.md for the differences.

    Returns
    -------
    JaxSettings

    Raises
    ------
    ConfigError
        Where jaxlib raises, naming the variable and what is accepted: both fraction
        variables set; a fraction that is not a number; an allocator kind the jaxlib does
        not know (including ``""``). Also, where jaxlib would fail later or silently do
        something else: a fraction that is not finite or not above 0, a fraction above 1
        without ``TF_FORCE_UNIFIED_MEMORY=1``, a collective size that is not an integer, or
        a jaxlib older than 0.4.30.

    Warns
    -----
    GpudashWarning
        ``XLA_PYTHON_CLIENT_PREALLOCATE`` set to something other than ``true``/``false``/
        ``1``/``0``/``True``/``False``: jaxlib reads anything but ``false``, ``False`` and
        ``0`` as true (so ``FALSE`` or ``no`` preallocate); ``XLA_CLIENT_MEM_FRACTION`` set
        for a jaxlib older than 0.4.32, which ignores it.
    """
    env = _env(environ)
    version = _version_tuple(jaxlib_version)
    if version is not None and version < JAX_OLDEST_SUPPORTED:
        raise ConfigError(
            f"jaxlib_version {_dotted(version)} is older than gpudash models; accepted: "
            f"jaxlib {_dotted(JAX_OLDEST_SUPPORTED)} or newer")

    raw_kind = env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default")
    kind = raw_kind.lower()
    known = [k for k, (since, _) in JAX_ALLOCATOR_KINDS.items()
             if version is None or version >= since]
    if kind not in known:
        where = "" if version is None else f" in jaxlib {_dotted(version)}"
        later = ""
        if kind in JAX_ALLOCATOR_KINDS:
            later = f" ({kind!r} needs jaxlib >= {_dotted(JAX_ALLOCATOR_KINDS[kind][0])})"
        raise ConfigError(
            f"XLA_PYTHON_CLIENT_ALLOCATOR must be one of {', '.join(repr(k) for k in known)}"
            f"{where} (any case); got {raw_kind!r}{later}")

    new = env.get("XLA_CLIENT_MEM_FRACTION", "")
    old = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    if new and version is not None and version < JAX_CLIENT_MEM_FRACTION_SINCE:
        warnings.warn(
            f"XLA_CLIENT_MEM_FRACTION={new!r} is ignored by jaxlib {_dotted(version)} (read "
            f"from jaxlib {_dotted(JAX_CLIENT_MEM_FRACTION_SINCE)}); use "
            "XLA_PYTHON_CLIENT_MEM_FRACTION", GpudashWarning, stacklevel=2)
        new = ""
    if old and new:
        raise ConfigError(
            f"XLA_CLIENT_MEM_FRACTION={new!r} and XLA_PYTHON_CLIENT_MEM_FRACTION={old!r} are "
            "both set, which JAX refuses; accepted: one of them (XLA_PYTHON_CLIENT_MEM_FRACTION "
            "is the older name)")
    variable, text = (("XLA_CLIENT_MEM_FRACTION", new) if new else
                      ("XLA_PYTHON_CLIENT_MEM_FRACTION", old) if old else (None, ""))

    unified = False
    raw_unified = env.get("TF_FORCE_UNIFIED_MEMORY")
    if raw_unified is not None:
        low = raw_unified.lower()
        if low in ("1", "true"):
            unified = True
        elif low not in ("0", "false"):
            warnings.warn(
                f"Failed to parse the env-var ${{TF_FORCE_UNIFIED_MEMORY}} into bool: "
                f"{raw_unified}. Use the default value: 0 (accepted: 0, 1, true, false in "
                "any case)", GpudashWarning, stacklevel=2)

    fraction = JAX_DEFAULT_MEMORY_FRACTION
    if variable is not None:
        accepted = ("a number above 0, such as 0.5 (a fraction of the device's total memory; "
                    "above 1 only with TF_FORCE_UNIFIED_MEMORY=1)")
        try:
            fraction = float(text)
        except ValueError:
            raise ConfigError(f"{variable} must be {accepted}; got {text!r}") from None
        if not math.isfinite(fraction) or float32(fraction) <= 0:
            raise ConfigError(f"{variable} must be {accepted}; got {text!r}")
        if fraction > 1 and not unified:
            raise ConfigError(
                f"{variable}={text!r} is above 1, which XLA can only honour with unified "
                "memory: set TF_FORCE_UNIFIED_MEMORY=1 as well, or choose a fraction in "
                "(0, 1]")

    preallocate = True
    raw_pre = env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "")
    if raw_pre:
        preallocate = raw_pre not in ("false", "False", "0")
        if preallocate and raw_pre not in ("true", "True", "1"):
            warnings.warn(
                f"XLA_PYTHON_CLIENT_PREALLOCATE={raw_pre!r}: jaxlib reads this as true "
                "(preallocate); only 'false', 'False' and '0' turn preallocation off",
                GpudashWarning, stacklevel=2)

    collective = 0
    raw_coll = env.get("XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", "")
    if raw_coll:
        try:
            collective = int(raw_coll) * _MIB
        except ValueError:
            raise ConfigError(
                "XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB must be an integer number of MiB "
                f"(0 = grow as needed); got {raw_coll!r}") from None
        if collective < 0:
            raise ConfigError(
                "XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB must be an integer >= 0 (MiB); "
                f"got {raw_coll!r}")
    return JaxSettings(allocator=kind, memory_fraction=fraction, fraction_variable=variable,
                       preallocate=preallocate, unified_memory=unified,
                       collective_memory_size=collective, jaxlib_version=version)


# --------------------------------------------------------------------------------------------
# Settings under each framework's names, and the lines to paste


#: The frameworks gpudash speaks.
FRAMEWORKS = ("tensorflow", "jax", "torch")

#: gpudash option -> the name a framework gives it (shown in views and ``%gpudash_config``).
FRAMEWORK_SETTING_NAMES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "tensorflow": MappingProxyType({
        "per_process_gpu_memory_fraction": "per_process_gpu_memory_fraction",
        "allow_growth": "allow_growth",
        "deferred_deletion_bytes": "deferred_deletion_bytes",
    }),
    "jax": MappingProxyType({
        "per_process_gpu_memory_fraction": "XLA_PYTHON_CLIENT_MEM_FRACTION",
        "allow_growth": "XLA_PYTHON_CLIENT_PREALLOCATE",
    }),
    "torch": MappingProxyType({
        "per_process_gpu_memory_fraction": "set_per_process_memory_fraction",
    }),
})

#: What JAX fixes at start (``%gpudash_config`` refuses to change them live).
_JAX_FIXED = ("XLA_PYTHON_CLIENT_ALLOCATOR", "TF_FORCE_UNIFIED_MEMORY",
              "XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB")


def check_framework(framework: object, accepted: tuple[str, ...] = FRAMEWORKS) -> str:
    """Normalise a framework name (``"tf"`` -> ``"tensorflow"``, ``"pytorch"`` -> ``"torch"``).

    Raises
    ------
    ConfigError
        For anything else, naming what is accepted.
    """
    aliases = {"tf": "tensorflow", "tensorflow": "tensorflow", "jax": "jax",
               "torch": "torch", "pytorch": "torch"}
    name = aliases.get(framework.strip().lower()) if isinstance(framework, str) else None
    if name is None or name not in accepted:
        raise ConfigError(f"framework must be one of {', '.join(accepted)}; got {framework!r}")
    return name


#: framework -> the module that must be importable.
FRAMEWORK_MODULES = {"torch": "torch", "jax": "jax", "tensorflow": "tensorflow"}


def require_installed(framework: str) -> None:
    """Raise ConfigError naming the framework when it is not installed (nothing imported)."""
    module = FRAMEWORK_MODULES[framework]
    if importlib.util.find_spec(module) is None:
        have = [f for f, m in FRAMEWORK_MODULES.items() if importlib.util.find_spec(m)]
        raise ConfigError(
            f"cannot watch {framework}: it is not installed here (no module {module!r}); "
            f"watch accepts torch, jax or tensorflow"
            + (f" (installed: {', '.join(have)})" if have else " (none is installed)"))


def framework_changes(framework: str, items: Mapping[str, str]) -> dict[str, Any]:
    """Turn ``{framework name: text}`` into :meth:`gpudash.Session.configure` changes.

    For JAX, ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (or ``XLA_CLIENT_MEM_FRACTION``) and
    ``XLA_PYTHON_CLIENT_PREALLOCATE`` are parsed exactly as jaxlib parses them (the
    fraction is kept in single precision, as XLA uses it). For TensorFlow the names are the
    ``GPUOptions`` fields. Everything is validated before anything is returned.

    Raises
    ------
    ConfigError
        For a name the framework does not have, a setting it fixes at start, or a bad value
        (the message names the variable and what is accepted).
    """
    framework = check_framework(framework, ("tensorflow", "jax"))
    if framework == "tensorflow":
        names = FRAMEWORK_SETTING_NAMES["tensorflow"]
        out: dict[str, Any] = {}
        for key, text in items.items():
            if key not in names:
                raise ConfigError(f"TensorFlow setting must be one of {', '.join(names)}; "
                                  f"got {key!r}")
            out[key] = text
        return out
    env: dict[str, str] = {}
    for key, text in items.items():
        if key in _JAX_FIXED:
            raise ConfigError(
                f"{key} is fixed when the session starts; create a new session with "
                f"gpudash.Session.from_env('jax', environ={{{key!r}: {text!r}, ...}})")
        if key not in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
                       "XLA_PYTHON_CLIENT_PREALLOCATE"):
            raise ConfigError(
                "a JAX setting must be XLA_PYTHON_CLIENT_MEM_FRACTION, XLA_CLIENT_MEM_FRACTION "
                f"or XLA_PYTHON_CLIENT_PREALLOCATE; got {key!r}")
        env[key] = str(text)
    settings = jax_settings_from_env(env)
    out = {}
    if settings.fraction_variable is not None:
        out["per_process_gpu_memory_fraction"] = settings.effective_fraction
    if "XLA_PYTHON_CLIENT_PREALLOCATE" in env:
        out["allow_growth"] = settings.allow_growth
    return out


def framework_settings_text(framework: str, fraction: float, allow_growth: bool,
                            limit: int | None = None) -> str:
    """Settings under the framework's names, one line: ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.5
    XLA_PYTHON_CLIENT_PREALLOCATE=false (limit 8.00 GiB)``."""
    framework = check_framework(framework, ("tensorflow", "jax"))
    if framework == "jax":
        text = (f"XLA_PYTHON_CLIENT_MEM_FRACTION={_fraction_text(fraction)} "
                f"XLA_PYTHON_CLIENT_PREALLOCATE={'false' if allow_growth else 'true'}")
    else:
        text = (f"per_process_gpu_memory_fraction={_fraction_text(fraction)} "
                f"allow_growth={allow_growth}")
    if limit is not None:
        text += f" (limit {human_readable_num_bytes(limit)})"
    return text


def paste_fraction(needed_bytes: int, total: int, framework: str = "tensorflow") -> float:
    """The shortest fraction (3 decimals, rounded up) whose limit reaches ``needed_bytes``.

    The limit is computed the framework's way: ``int(total * fraction)`` for TensorFlow,
    in single precision for JAX (:func:`jax_memory_limit`), without the 2 MiB rounding of
    jaxlib 0.10.2 and later, so that the fraction covers ``needed_bytes`` whichever jaxlib
    takes it.
    """
    framework = check_framework(framework, ("tensorflow", "jax"))
    total = parse_bytes(total, name="total")
    fraction = math.ceil(needed_bytes / total * 1000 - 1e-9) / 1000 if total else 1.0
    fraction = max(fraction, 0.001)
    if framework == "jax":
        def limit(t: int, f: float) -> int:
            return jax_memory_limit(t, f, jaxlib_version=JAX_OLDEST_SUPPORTED)
    else:
        def limit(t: int, f: float) -> int:
            return int(t * f)
    while limit(total, fraction) < needed_bytes:
        fraction = round(fraction + 0.001, 3)
    return fraction


def restart_lines(framework: str, fraction: float | None = None,
                  allow_growth: bool | None = None, total: int | None = None,
                  form: str = "env") -> list[str]:
    """The lines to paste to run a framework with these settings, and the restart note.

    Parameters
    ----------
    framework : {"tensorflow", "jax", "torch"}
    fraction : float, optional
        The memory fraction (of the device's total memory).
    allow_growth : bool, optional
        Grow on demand instead of reserving the limit at start.
    total : int, optional
        The device's total memory; TensorFlow's ``tf.config`` form needs it (its
        ``memory_limit`` is in MiB).
    form : {"env", "notebook"}
        JAX: shell assignments or ``%env`` lines. TensorFlow: ``ConfigProto`` lines plus the
        ``tf.config`` form either way.

    Returns
    -------
    list of str
        Code lines, then a comment saying the framework must restart to take them.
    """
    framework = check_framework(framework)
    if form not in ("env", "notebook"):
        raise ConfigError(f"form must be 'env' or 'notebook'; got {form!r}")
    if fraction is not None:
        fraction = _check_fraction("fraction", fraction)
    lines: list[str] = []
    if framework == "jax":
        prefix = "%env " if form == "notebook" else ""
        if fraction is not None:
            lines.append(f"{prefix}XLA_PYTHON_CLIENT_MEM_FRACTION={_fraction_text(fraction)}")
        if allow_growth is not None:
            lines.append(f"{prefix}XLA_PYTHON_CLIENT_PREALLOCATE="
                         f"{'false' if allow_growth else 'true'}")
        lines.append("# JAX reads these once, when its GPU backend starts: set them before "
                     "the first JAX call and restart the process (kernel) to take them")
    elif framework == "tensorflow":
        if fraction is not None:
            lines.append(f"config.gpu_options.per_process_gpu_memory_fraction = "
                         f"{_fraction_text(fraction)}")
        if allow_growth is not None:
            lines.append(f"config.gpu_options.allow_growth = {allow_growth}")
        if fraction is not None and total:
            mib = math.ceil(int(total * fraction) / _MIB)
            lines.append("# or, TensorFlow 2: tf.config.set_logical_device_configuration(gpu, "
                         f"[tf.config.LogicalDeviceConfiguration(memory_limit={mib})])  # MiB")
        if allow_growth:
            lines.append("# or, TensorFlow 2: tf.config.experimental.set_memory_growth(gpu, "
                         "True)")
        lines.append("# TensorFlow fixes its allocator when it creates its GPU devices: "
                     "restart the process (kernel) to take these")
    else:
        if fraction is not None:
            lines.append(f"torch.cuda.set_per_process_memory_fraction({_fraction_text(fraction)})")
        if allow_growth is not None and not allow_growth:
            lines.append("# PyTorch always grows on demand; there is no preallocation to set")
        lines.append("# PyTorch applies the fraction to later allocations without a restart; "
                     "PYTORCH_CUDA_ALLOC_CONF is read once, at the first CUDA allocation")
    return lines
