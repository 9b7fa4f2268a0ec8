"""Byte counts: parsing ``"16GiB"``-style strings and printing sizes for people.

Three functions:

- :func:`parse_bytes` turns ``16``, ``"16GiB"``, ``"1.5 GiB"`` or ``"2GB"`` into an ``int``;
- :func:`format_bytes` prints ``"16.00 GiB"`` / ``"512 B"`` (binary units, two decimals);
- :func:`human_readable_num_bytes` is TensorFlow's ``strings::HumanReadableNumBytes``,
  character for character, so that gpudash's logs read like TensorFlow's.

Examples
--------
>>> parse_bytes("1.5GiB")
1610612736
>>> format_bytes(1610612736)
'1.50 GiB'
>>> human_readable_num_bytes(18874368)
'18.00MiB'
"""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

from ._errors import ConfigError

__all__ = ["UNITS", "format_bytes", "human_readable_num_bytes", "parse_bytes"]

#: Unit name (lower case) -> bytes. Binary units are powers of 1024, decimal ones of 1000.
UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}

_ACCEPTED = (
    "a non-negative integer, or a non-negative number with an optional unit such as "
    "'4096', '512MiB', '1.5 GiB' or '2GB' (binary units B, KiB, MiB, GiB, TiB, PiB are "
    "powers of 1024; decimal units KB, MB, GB, TB, PB are powers of 1000; case-insensitive)"
)

_BYTES_RE = re.compile(
    r"^\s*(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$"
)

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _bad(value: object, name: str | None) -> ConfigError:
    what = f"{name} must be" if name else "a byte count must be"
    return ConfigError(f"{what} {_ACCEPTED}; got {value!r}")


def parse_bytes(value: object, *, name: str | None = None) -> int:
    """Parse a byte count.

    Parameters
    ----------
    value : int or str
        A non-negative integer (``4096``), an integral non-negative float (``2.0**30``), or a
        string: a number with an optional unit, with or without a space (``"4096"``,
        ``"512MiB"``, ``"1.5 GiB"``, ``"2GB"``, ``"8kib"``). Binary units (``KiB`` ... ``PiB``)
        are powers of 1024, decimal units (``KB`` ... ``PB``) powers of 1000; units are
        case-insensitive. A fractional result (``"0.1GiB"``) is rounded down to whole bytes.
    name : str, optional
        What the value configures (a field or an environment variable); used in the error
        message.

    Returns
    -------
    int
        The number of bytes.

    Raises
    ------
    ConfigError
        For a bool, a negative number, NaN or infinity, a non-integral float, an unknown unit
        or anything else that is not one of the forms above. The message names the value and
        the accepted forms.

    Examples
    --------
    >>> parse_bytes("16 GiB")
    17179869184
    >>> parse_bytes("2GB")
    2000000000
    >>> parse_bytes(4096)
    4096
    """
    if isinstance(value, bool):
        raise _bad(value, name)
    if isinstance(value, numbers.Integral):
        result = int(value)
        if result < 0:
            raise _bad(value, name)
        return _within_int64(result, value, name)
    if isinstance(value, numbers.Real):
        f = float(value)
        if not math.isfinite(f) or f < 0 or not f.is_integer():
            raise _bad(value, name)
        return _within_int64(int(f), value, name)
    if not isinstance(value, str):
        raise _bad(value, name)
    match = _BYTES_RE.match(value)
    if match is None:
        raise _bad(value, name)
    unit = UNITS.get(match["unit"].lower())
    if unit is None:
        raise _bad(value, name)
    # Fraction parses decimal strings exactly, so "1.5GiB" is exactly 1610612736.
    exact = Fraction(match["num"]) * unit
    if exact > MAX_BYTES:  # compared before any huge integer is made or printed
        raise _too_large(value, name)
    return math.floor(exact)


#: The largest byte count taken (TensorFlow's sizes are int64).
MAX_BYTES = (1 << 63) - 1


def _too_large(value: object, name: str | None):
    what = name or "a byte count"
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return ConfigError(f"{what} must be at most {MAX_BYTES} bytes (8 EiB, int64); got {shown}")


def _within_int64(result: int, value: object, name: str | None) -> int:
    if result > MAX_BYTES:
        raise _too_large(value, name)
    return result


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


def format_bytes(n: int) -> str:
    """Format a byte count for people, with binary units.

    Counts below 1024 print as an integer with ``" B"``; larger ones with two decimals in
    the largest binary unit that keeps the number at least 1 (a value that would round to
    ``1024.00`` moves up one unit).

    Parameters
    ----------
    n : int
        Bytes; may be negative (a difference).

    Returns
    -------
    str

    Examples
    --------
    >>> format_bytes(512)
    '512 B'
    >>> format_bytes(16 << 30)
    '16.00 GiB'
    >>> format_bytes(-1536)
    '-1.50 KiB'
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(f"format_bytes expects a number of bytes; got {n!r}")
    if not math.isfinite(n):
        return f"{n} B"  # inf / nan: shown, not a crash in a view
    sign = "-" if n < 0 else ""
    n = abs(int(n))
    if n < 1024:
        return f"{sign}{n} B"
    exp = 0
    value = float(n)
    while value >= 1024 and exp < len(_BINARY_UNITS) - 1:
        value /= 1024
        exp += 1
    if f"{value:.2f}" == "1024.00" and exp < len(_BINARY_UNITS) - 1:
        value /= 1024
        exp += 1
    return f"{sign}{value:.2f} {_BINARY_UNITS[exp]}"


def human_readable_num_bytes(num_bytes: int) -> str:
    """TensorFlow's ``strings::HumanReadableNumBytes``, reproduced exactly.

    The rules (tsl ``numbers.cc``): below 1024 bytes ``"%lldB"``; otherwise the count is
    divided by 1024 with *integer* division while it is at least 1024*1024, and then printed
    divided by 1024.0 as ``"%.1fKiB"`` for kibibytes or ``"%.2f%ciB"`` (M, G, T, P, E) above.
    Negative counts get a ``"-"``; the smallest int64 prints as ``"-8E"``.

    Parameters
    ----------
    num_bytes : int
        A byte count in the int64 range.

    Returns
    -------
    str

    Raises
    ------
    ValueError
        If ``num_bytes`` is outside the int64 range.

    Examples
    --------
    >>> human_readable_num_bytes(1023)
    '1023B'
    >>> human_readable_num_bytes(4096)
    '4.0KiB'
    >>> human_readable_num_bytes(18874368)
    '18.00MiB'
    """
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, numbers.Integral):
        raise TypeError(f"human_readable_num_bytes expects an int; got {num_bytes!r}")
    num_bytes = int(num_bytes)
    if not _INT64_MIN <= num_bytes <= _INT64_MAX:
        raise ValueError(f"human_readable_num_bytes takes an int64; got {num_bytes}")
    if num_bytes == _INT64_MIN:
        return "-8E"  # TensorFlow's special case: the negation is not representable
    neg = "-" if num_bytes < 0 else ""
    num_bytes = abs(num_bytes)
    if num_bytes < 1024:
        return f"{neg}{num_bytes}B"
    units = "KMGTPE"
    unit = 0
    while num_bytes >= 1024 * 1024:
        num_bytes //= 1024
        unit += 1
    if unit == 0:
        return f"{neg}{num_bytes / 1024.0:.1f}KiB"
    return f"{neg}{num_bytes / 1024.0:.2f}{units[unit]}iB"
