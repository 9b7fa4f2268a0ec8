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
"""

from __future__ import annotations

import math
import numbers
import os
import re
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
        limit = int(total * fraction)

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
