"""PyTorch's caching-allocator settings: ``PYTORCH_CUDA_ALLOC_CONF``, parsed as PyTorch does.

:class:`CachingAllocatorConfig` holds the settings that change the allocator's decisions
(``max_split_size_mb``, ``max_non_split_rounding_mb``, ``garbage_collection_threshold``,
``roundup_power2_divisions``, ``expandable_segments``) and accepts the ones that do not
(``release_lock_on_cudamalloc``, the ``pinned_*`` keys, ``graph_capture_record_stream_reuse``,
``backend:native``). It is read from a settings string with PyTorch's lexer (``,``, ``:``,
``[`` and ``]`` separate tokens; spaces are dropped, from 2.8 every C whitespace character)
and PyTorch's number rules (``std::stoull``/``std::stoi`` and ``std::stod``: an optional sign,
ASCII digits from the start, the rest of the token ignored, so ``+128`` and ``128MB`` are 128
and ``١٢٨`` is refused); it accepts what PyTorch's parser accepts and refuses what it refuses,
with a :class:`~gpudash.ConfigError` that names the key, the value and PyTorch's words.

The rules depend on the PyTorch version (``version=(2, 11)`` by default):

========================================  ==========================================
rule                                      versions
========================================  ==========================================
``max_split_size_mb`` must be > 20        up to 2.7 (2.8 on: >= 20)
``max_non_split_rounding_mb``             2.6 on (must be > 20; 2.8 on: >= 20)
``roundup_power2_divisions:N``            1.12 on
``roundup_power2_divisions:[K:v,...]``    2.0 on; ``>`` fills from the last key's interval
                                          up to 2.7 (overwriting it), from the next one on
``garbage_collection_threshold``          1.12 on
``expandable_segments``                   2.1 on
``divisions == 1`` leaves sizes unrounded 1.12 to 2.3 (later: plain 512-byte rounding)
MiB and divisions read by ``std::stoi``   up to 2.7 (int: 2**31 MiB and more refused);
                                          2.8 on ``std::stoull`` (up to 2**64 - 1)
tokens drop spaces only; ``:`` and ``,``  up to 2.7; 2.8 on every C whitespace
checked                                   character is dropped and a separator only
                                          has to be there (``ConfigTokenizer``)
========================================  ==========================================

A snapshot's ``allocator_settings`` (PyTorch 2.4 on) holds the parsed values;
:meth:`CachingAllocatorConfig.from_snapshot_settings` reads them, so a replay needs no
string at all.
"""

from __future__ import annotations

import decimal
import math
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from ._errors import ConfigError

__all__ = ["CachingAllocatorConfig", "parse_torch_version", "DEFAULT_TORCH_VERSION"]

#: The PyTorch version whose rules apply when none is given.
DEFAULT_TORCH_VERSION = (2, 11)

K_LARGE_BUFFER = 20 << 20
_MIB = 1 << 20
_INTERVALS = 16
#: The snapshot's keys for the 16 roundup intervals: interval start in MiB.
_INTERVAL_KEYS = tuple(str(1 << i) for i in range(_INTERVALS))

# Keys PyTorch accepts without an effect on the allocator's decisions, from the version that
# added them (best knowledge: PyTorch's release notes and parser history).
_INERT_KEYS: dict[str, tuple[int, int]] = {
    "release_lock_on_cudamalloc": (2, 2),
    "release_lock_on_hipmalloc": (2, 2),
    "pinned_use_cuda_host_register": (2, 1),
    "pinned_use_hip_host_register": (2, 1),
    "pinned_num_register_threads": (2, 1),
    "pinned_use_background_threads": (2, 8),
    "pinned_reserve_segment_size_mb": (2, 9),
    "graph_capture_record_stream_reuse": (2, 9),
}
_BOOL_INERT = {"release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
               "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
               "pinned_use_background_threads", "graph_capture_record_stream_reuse"}
_KEYS_SINCE: dict[str, tuple[int, int]] = {
    "max_split_size_mb": (1, 10),
    "roundup_power2_divisions": (1, 12),
    "garbage_collection_threshold": (1, 12),
    "backend": (2, 0),
    "expandable_segments": (2, 1),
    "max_non_split_rounding_mb": (2, 6),
    **_INERT_KEYS,
}


def parse_torch_version(version: Any) -> tuple[int, int]:
    """``"2.4.1+cu121"``, ``(2, 4)`` or ``2.4`` -> ``(2, 4)``; None -> the default.

    Raises
    ------
    ConfigError
        Anything else, or a version before 1.0.
    """
    if version is None:
        return DEFAULT_TORCH_VERSION
    if isinstance(version, tuple) and len(version) >= 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in version[:2]):
        out = (version[0], version[1])
    elif isinstance(version, (str, float)) and not isinstance(version, bool):
        m = re.match(r"^\s*(\d+)\.(\d+)", str(version))
        if not m:
            raise ConfigError(f"torch version must look like '2.4' or (2, 4); got {version!r}")
        out = (int(m.group(1)), int(m.group(2)))
    else:
        raise ConfigError(f"torch version must look like '2.4' or (2, 4); got {version!r}")
    if out < (1, 0):
        raise ConfigError(f"torch version must be 1.0 or newer; got {version!r}")
    return out


#: From this version PyTorch parses the string with ``AcceleratorAllocatorConfig`` and its
#: ``ConfigTokenizer`` (c10/core/AllocatorConfig.h) in two passes, the accelerator's keys and
#: then CUDA's (c10/cuda/CUDAAllocatorConfig.cpp); before it, with CUDAAllocatorConfig's own
#: ``lexArgs``/``consumeToken``. gpudash's other 2.8 rules (``>= 20``, ``>`` from the next
#: interval) come from the same refactor.
_TOKENIZER_SINCE = (2, 8)
#: C's ``isspace`` in the "C" locale, byte by byte: what ``ConfigTokenizer`` drops (a
#: non-ASCII character is bytes >= 0x80 in UTF-8, never a space there).
_C_SPACE = " \t\n\v\f\r"
_U64 = (1 << 64) - 1
_ACCEL_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
               "roundup_power2_divisions", "expandable_segments",
               "pinned_use_background_threads")


def _lex(conf: str, version: tuple[int, int] = DEFAULT_TORCH_VERSION) -> list[str]:
    """PyTorch's lexer: ``,``, ``:``, ``[`` and ``]`` are tokens of their own; from 2.8
    (``ConfigTokenizer``) every C whitespace character is dropped, before it (``lexArgs``)
    only the space."""
    drop = _C_SPACE if version >= _TOKENIZER_SINCE else " "
    out: list[str] = []
    buf: list[str] = []
    for ch in conf:
        if ch in ",:[]":
            if buf:
                out.append("".join(buf))
                buf = []
            out.append(ch)
        elif ch not in drop:
            buf.append(ch)
    if buf:
        out.append("".join(buf))
    return out


class _CNumberError(ValueError):
    """``std::invalid_argument`` or ``std::out_of_range`` from ``std::sto*``."""

    def __init__(self, func: str, kind: str) -> None:
        super().__init__(func)
        self.func = func
        self.kind = kind


_C_INT_RE = re.compile(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)")
_C_DEC_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_C_HEX_RE = re.compile(r"([+-]?)0[xX]((?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)"
                       r"(?:[pP][+-]?[0-9]+)?)?")
_C_SPECIAL_RE = re.compile(r"([+-]?)(inf(?:inity)?|nan(?:\([0-9A-Za-z_]*\))?)", re.I)


def _c_integer(text: str, func: str) -> int:
    """``std::stoull``/``std::stoul`` (base 10, 64-bit) or ``std::stoi`` on ``text``: leading
    C whitespace, an optional sign, then the longest run of ASCII digits; what follows is
    ignored (``"128MB"`` is 128, ``"0x80"`` is 0, ``"1e3"`` is 1). No digit: invalid_argument;
    beyond the type: out_of_range. The unsigned ones negate modulo 2**64 (``"-1"`` is
    2**64 - 1); ``stoi``'s result is returned signed."""
    m = _C_INT_RE.match(text.split("\0", 1)[0])
    if m is None:
        raise _CNumberError(func, "invalid_argument")
    digits = m.group(2).lstrip("0") or "0"
    if len(digits) > 20:  # beyond every 64-bit type; also keeps int() clear of huge strings
        raise _CNumberError(func, "out_of_range")
    n = int(digits)
    negative = m.group(1) == "-"
    if func == "stoi":
        # strtol (64-bit long), then stoi's own check against int's range
        if n > (1 << 63) - (0 if negative else 1):
            raise _CNumberError(func, "out_of_range")
        v = -n if negative else n
        if not -(1 << 31) <= v < (1 << 31):
            raise _CNumberError(func, "out_of_range")
        return v
    if n > _U64:
        raise _CNumberError(func, "out_of_range")
    return (-n) % (1 << 64) if negative else n


def _c_double(text: str) -> float:
    """``std::stod`` (``strtod`` in the "C" locale): leading C whitespace, then the longest
    decimal (``"1e3"``, ``".5"``), hexadecimal (``"0x1p-1"``) or ``inf``/``nan`` prefix;
    what follows is ignored. No number: invalid_argument; overflow or underflow (ERANGE,
    subnormal results included): out_of_range."""
    s = text.split("\0", 1)[0].lstrip(_C_SPACE)
    m = _C_SPECIAL_RE.match(s)
    if m:
        word = m.group(2).lower()
        x = math.nan if word.startswith("nan") else math.inf
        return -x if m.group(1) == "-" else x
    m = _C_HEX_RE.match(s)
    if m:
        if m.group(2) is None:  # "0x" with no hex digit: strtod reads the "0"
            return -0.0 if m.group(1) == "-" else 0.0
        try:
            x = float.fromhex(m.group(0))
        except OverflowError:
            raise _CNumberError("stod", "out_of_range") from None
        mant = re.split("[pP]", m.group(0))[0].lstrip("+-")[2:]
    else:
        m = _C_DEC_RE.match(s)
        if m is None:
            raise _CNumberError("stod", "invalid_argument")
        x = float(m.group(0))
        mant = re.split("[eE]", m.group(0))[0]
    if math.isinf(x):
        raise _CNumberError("stod", "out_of_range")
    if abs(x) < 2.2250738585072014e-308 and any(c not in "0.+-" for c in mant):
        # glibc's strtod sets ERANGE on underflow: a zero or subnormal result that is
        # not the written value exactly (0x1p-1074 is exact and accepted; 1e-310 is not)
        if x == 0.0 or len(m.group(0)) > 1000 or _exact_value(m.group(0)) != Fraction(x):
            raise _CNumberError("stod", "out_of_range")
    return x


def _exact_value(text: str) -> Fraction:
    """The exact value of a short decimal or hexadecimal C float literal."""
    hexm = re.fullmatch(r"([+-]?)0[xX]([0-9a-fA-F]*)\.?([0-9a-fA-F]*)(?:[pP]([+-]?[0-9]+))?",
                        text)
    if hexm is None:
        return Fraction(decimal.Decimal(text))
    sign, whole, frac, exp = hexm.groups()
    v = Fraction(int((whole + frac) or "0", 16)) * Fraction(2) ** (int(exp or 0) - 4 * len(frac))
    return -v if sign == "-" else v


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class _Tokens:
    """The token stream of one settings string, with PyTorch's errors for missing tokens.

    ``strict`` is the parser before 2.8, whose ``consumeToken`` refuses a wrong separator;
    2.8's ``ConfigTokenizer::checkToken`` result goes unread, so from 2.8 a separator must
    only be there (``"max_split_size_mb,128"`` is read as ``max_split_size_mb:128``).
    """

    def __init__(self, conf: str, version: tuple[int, int] = DEFAULT_TORCH_VERSION) -> None:
        self.conf = conf
        self.strict = version < _TOKENIZER_SINCE
        self.toks = _lex(conf, version)
        self.i = 0

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"PYTORCH_CUDA_ALLOC_CONF={self.conf!r}: {message}")

    def out_of_bounds(self, after: str) -> ConfigError:
        return self.error(f"the string ends after {after!r} where PyTorch reads another token "
                          "(PyTorch: INTERNAL ASSERT FAILED \"Index out of bounds in "
                          "ConfigTokenizer\")")

    def expect(self, ch: str, after: str) -> None:
        if not self.strict:
            if self.i >= len(self.toks):
                raise self.out_of_bounds(after)
            self.i += 1
            return
        if self.i >= len(self.toks) or self.toks[self.i] != ch:
            found = self.toks[self.i] if self.i < len(self.toks) else "the end"
            raise self.error(f"expected {ch!r} after {after!r}, found {found!r} (PyTorch: "
                             f"\"Error parsing CachingAllocator settings, expected {ch}\")")
        self.i += 1

    def value(self, key: str) -> str:
        self.expect(":", key)
        if self.i >= len(self.toks) or (self.strict and self.toks[self.i] in ",:[]"):
            if not self.strict:
                raise self.out_of_bounds(key)
            raise self.error(f"{key} needs a value (PyTorch: \"Error, expecting {key} value\")")
        v = self.toks[self.i]
        self.i += 1
        return v

    def skip_key(self, key: str) -> None:
        """``ConfigTokenizer::skipKey``: past the key's value, or its ``[...]`` list."""
        self.expect(":", key)
        if self.i >= len(self.toks):
            raise self.out_of_bounds(key)
        if self.toks[self.i] == "[":
            while self.i < len(self.toks) and self.toks[self.i] != "]":
                self.i += 1
            if self.i >= len(self.toks):
                raise self.error(f"{key}: the list has no closing ']' (PyTorch: INTERNAL "
                                 "ASSERT FAILED \"Expected closing bracket ']' in "
                                 "ConfigTokenizer but reached end of config\")")
        self.i += 1


def _c_number_error(tok: _Tokens, key: str, text: str, what: str,
                    err: _CNumberError) -> ConfigError:
    if err.kind == "invalid_argument":
        why = (f"PyTorch reads it with std::{err.func}, which finds no number at its start "
               "(ASCII digits, after an optional sign)")
    else:
        why = f"it is beyond the range of std::{err.func}"
    return tok.error(f"{key} takes {what}; got {text!r}: {why} (PyTorch: {err.kind} "
                     f"\"{err.func}\")")


def _int_value(tok: _Tokens, key: str, text: str, what: str, func: str = "stoull") -> int:
    """A whole number read as PyTorch reads it (``func``: ``stoull`` from 2.8, ``stoi`` or
    ``stoul`` before), as the unsigned 64-bit value PyTorch then holds."""
    try:
        return _c_integer(text, func) % (1 << 64)
    except _CNumberError as err:
        raise _c_number_error(tok, key, text, what, err) from None


class CachingAllocatorConfig:
    """The settings of PyTorch's CUDA caching allocator (``PYTORCH_CUDA_ALLOC_CONF``).

    Parameters
    ----------
    conf : str, optional
        A settings string, as in ``PYTORCH_CUDA_ALLOC_CONF`` (``"expandable_segments:True"``,
        ``"max_split_size_mb:128,garbage_collection_threshold:0.6"``,
        ``"roundup_power2_divisions:[256:1,512:2,>:8]"``).
    version : str or tuple, optional
        The PyTorch version whose parsing rules and decisions apply (default 2.11).
    **parts
        Settings by name, applied after ``conf``: ``max_split_size_mb`` (int MiB or None),
        ``max_non_split_rounding_mb`` (int MiB), ``garbage_collection_threshold`` (float in
        (0, 1), or 0 for off), ``expandable_segments`` (bool), ``roundup_power2_divisions``
        (an int, a settings string such as ``"[256:1,>:4]"``, a dict of the snapshot's
        ``{"1": d0, ..., "32768": d15}`` or a sequence of 16 ints).

    Attributes
    ----------
    max_split_size : int or None
        Bytes; None when unset (PyTorch's SIZE_MAX: no block is "oversize").
    max_non_split_rounding_size : int
        Bytes an oversize block may exceed a request by and still serve it (20 MiB).
    garbage_collection_threshold : float
        0.0 when off.
    expandable_segments : bool
    roundup_power2_divisions : tuple of 16 int
        Divisions per interval ``[2**(20+i), 2**(21+i))`` bytes (index 0 also below 1 MiB,
        index 15 also above); 0 = no power-of-two rounding.
    inert : dict
        Accepted keys that do not change decisions, with their values.
    version : tuple of int

    Raises
    ------
    ConfigError
        A key PyTorch does not know (in that version), a value it refuses, or a malformed
        string; the message names the key and what is accepted.

    Examples
    --------
    >>> c = CachingAllocatorConfig("max_split_size_mb:128,expandable_segments:True")
    >>> c.max_split_size, c.expandable_segments
    (134217728, True)
    >>> CachingAllocatorConfig("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"
    ...                        ).roundup_power2_divisions[8:12]
    (1, 2, 4, 8)
    """

    __slots__ = ("max_split_size", "max_non_split_rounding_size",
                 "garbage_collection_threshold", "expandable_segments",
                 "roundup_power2_divisions", "inert", "version")

    def __init__(self, conf: str | None = None, *, version: Any = None, **parts: Any) -> None:
        self.version = parse_torch_version(version)
        self.max_split_size: int | None = None
        self.max_non_split_rounding_size = K_LARGE_BUFFER
        self.garbage_collection_threshold = 0.0
        self.expandable_segments = False
        self.roundup_power2_divisions: tuple[int, ...] = (0,) * _INTERVALS
        self.inert: dict[str, Any] = {}
        if conf is not None:
            self.apply(conf)
        if parts:
            self.update(**parts)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 version: Any = None) -> CachingAllocatorConfig:
        """The settings of ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``, PyTorch
        2.9's name, which wins when both are set) in ``environ`` (default ``os.environ``)."""
        import os

        env = os.environ if environ is None else environ
        conf = env.get("PYTORCH_ALLOC_CONF")
        if conf is None:
            conf = env.get("PYTORCH_CUDA_ALLOC_CONF")
        return cls(conf, version=version)

    @classmethod
    def from_snapshot_settings(cls, settings: Mapping[str, Any] | None, *,
                               version: Any = None) -> CachingAllocatorConfig:
        """The settings a snapshot's ``allocator_settings`` holds (PyTorch 2.4 on), already
        parsed by PyTorch: ``max_split_size`` (-1 = unset), ``garbage_collection_threshold``,
        ``expandable_segments``, ``roundup_power2_divisions`` (dict by interval start in
        MiB). Missing or odd values keep the defaults; the settings string is not re-read."""
        out = cls(version=version)
        if not isinstance(settings, Mapping):
            return out
        mss = settings.get("max_split_size")
        if isinstance(mss, int) and not isinstance(mss, bool) and 0 < mss < (1 << 62):
            out.max_split_size = mss
        gc = settings.get("garbage_collection_threshold")
        if isinstance(gc, (int, float)) and not isinstance(gc, bool) and 0 < gc < 1:
            out.garbage_collection_threshold = float(gc)
        if isinstance(settings.get("expandable_segments"), bool):
            out.expandable_segments = settings["expandable_segments"]
        rd = settings.get("roundup_power2_divisions")
        if isinstance(rd, Mapping):
            vec = [0] * _INTERVALS
            for i, key in enumerate(_INTERVAL_KEYS):
                v = rd.get(key)
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    vec[i] = v
            out.roundup_power2_divisions = tuple(vec)
        mnsr = settings.get("max_non_split_rounding_size")
        if isinstance(mnsr, int) and not isinstance(mnsr, bool) and mnsr > 0:
            out.max_non_split_rounding_size = mnsr
        return out

    def copy(self) -> CachingAllocatorConfig:
        new = object.__new__(CachingAllocatorConfig)
        for name in self.__slots__:
            setattr(new, name, getattr(self, name))
        new.inert = dict(self.inert)
        return new

    # ------------------------------------------------------------------ parsing
    def apply(self, conf: str) -> None:
        """Parse a settings string onto these settings, as PyTorch's ``parseArgs`` does:
        ``max_split_size_mb``, ``roundup_power2_divisions`` and
        ``garbage_collection_threshold`` return to their defaults unless the string sets
        them (``torch.cuda.memory._set_allocator_settings`` behaves the same way); the other
        keys keep their values. Nothing changes when the string is refused."""
        if not isinstance(conf, str):
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF must be a string; got {conf!r}")
        work = self.copy()
        work.max_split_size = None
        work.roundup_power2_divisions = (0,) * _INTERVALS
        work.garbage_collection_threshold = 0.0
        tok = _Tokens(conf, self.version)
        if tok.strict:
            work._parse_pass(tok, None)
        else:
            # 2.8 on: AcceleratorAllocatorConfig::parseArgs reads its own keys and skips the
            # rest, then CUDAAllocatorConfig::parseArgs reads CUDA's keys, refuses unknown
            # ones and skips the accelerator's (c10/core/AllocatorConfig.cpp,
            # c10/cuda/CUDAAllocatorConfig.cpp); a refusal in either refuses the string.
            work._parse_pass(tok, True)
            tok.i = 0
            work._parse_pass(tok, False)
        for name in self.__slots__:
            setattr(self, name, getattr(work, name))

    def _parse_pass(self, tok: _Tokens, accelerator: bool | None) -> None:
        """One parser's loop over the tokens: both kinds of key (``None``, before 2.8), the
        accelerator's (``True``) or CUDA's (``False``)."""
        toks = tok.toks
        while tok.i < len(toks):
            key = toks[tok.i]
            tok.i += 1
            if accelerator is not None and (key in _ACCEL_KEYS) != accelerator and \
                    self._known(key):
                tok.skip_key(key)  # the other parser's key
            else:
                # an unknown key: CUDA's parser refuses it ("Unrecognized key"); the
                # accelerator's would skip it first, so the string is refused either way
                self._parse_key(tok, key)
            if tok.i < len(toks):
                tok.expect(",", key)

    def _known(self, key: str) -> bool:
        since = _KEYS_SINCE.get(key)
        return since is not None and self.version >= since

    def _parse_key(self, tok: _Tokens, key: str) -> None:
        v = self.version
        if not self._known(key):
            since = _KEYS_SINCE.get(key)
            known = sorted(k for k in _KEYS_SINCE if self._known(k))
            if since is not None:
                raise tok.error(f"{key!r} is not a setting of PyTorch {v[0]}.{v[1]} (it "
                                f"came in {since[0]}.{since[1]}); PyTorch "
                                f"{v[0]}.{v[1]} accepts {', '.join(known)}")
            raise tok.error(f"unrecognized key {key!r} (PyTorch: \"Unrecognized key '{key}' "
                            f"in CUDA allocator config.\"); accepted: {', '.join(known)}")
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            n = _int_value(tok, key, tok.value(key), "an integer number of MiB",
                           "stoi" if tok.strict else "stoull")
            low_ok = n >= 20 if v >= (2, 8) else n > 20
            if not low_ok:
                bound = ">= 20" if v >= (2, 8) else "> 20"
                raise tok.error(f"{key}:{n} is too small (PyTorch: \"CachingAllocator option "
                                f"{key} too small, must be {bound}\")")
            nbytes = min(n, ((1 << 64) - 1) // _MIB) * _MIB
            if key == "max_split_size_mb":
                self.max_split_size = nbytes
            else:
                self.max_non_split_rounding_size = nbytes
        elif key == "garbage_collection_threshold":
            text = tok.value(key)
            try:
                x = _c_double(text)
            except _CNumberError as err:
                raise _c_number_error(tok, key, text, "a number in (0.0, 1.0)", err) from None
            if not (0.0 < x < 1.0):
                raise tok.error(f"{key}:{text} is outside (0.0, 1.0) (PyTorch: "
                                "\"garbage_collect_threshold is invalid, set it in (0.0, "
                                "1.0)\")")
            self.garbage_collection_threshold = x
        elif key == "roundup_power2_divisions":
            self._parse_roundup(tok)
        elif key == "expandable_segments":
            text = tok.value(key)
            if text not in ("True", "False"):
                said = ("Expected a single True/False argument for expandable_segments"
                        if tok.strict else f"Expected 'True' or 'False' at index "
                        f"{tok.i - 1} in ConfigTokenizer but got '{text}'")
                raise tok.error(f"expandable_segments takes True or False; got {text!r} "
                                f"(PyTorch: \"{said}\")")
            self.expandable_segments = text == "True"
        elif key == "backend":
            text = tok.value(key)
            if text == "native":
                self.inert[key] = text
            elif text == "cudaMallocAsync":
                raise tok.error("backend:cudaMallocAsync is CUDA's own stream-ordered pool, "
                                "not the caching allocator gpudash models; use backend:native "
                                "(the default)")
            else:
                raise tok.error(f"backend takes native or cudaMallocAsync; got {text!r} "
                                "(PyTorch: \"Unknown allocator backend, options are native "
                                "and cudaMallocAsync\")")
        elif key in _BOOL_INERT:
            text = tok.value(key)
            if text not in ("True", "False"):
                raise tok.error(f"{key} takes True or False; got {text!r}")
            self.inert[key] = text == "True"
        else:  # pinned_num_register_threads, pinned_reserve_segment_size_mb
            n = _int_value(tok, key, tok.value(key), "a positive integer",
                           "stoi" if tok.strict else "stoull")
            if key == "pinned_num_register_threads" and not (_is_pow2(n) and n <= 128):
                raise tok.error(f"{key} must be a power of 2 up to 128; got {n}")
            if n <= 0:
                raise tok.error(f"{key} must be > 0; got {n}")
            self.inert[key] = n

    def _parse_roundup(self, tok: _Tokens) -> None:
        """``parseRoundUpPower2Divisions``: divisions by ``stoi`` and interval starts by
        ``stoul`` before 2.8, both by ``stoull`` from 2.8 (``ConfigTokenizer::toSizeT``)."""
        key = "roundup_power2_divisions"
        tok.expect(":", key)
        toks = tok.toks
        if tok.i >= len(toks):
            if tok.strict:
                raise tok.error(f"{key} needs a value (PyTorch: \"Error, expecting {key} "
                                "value\")")
            raise tok.out_of_bounds(key)
        div_func = "stoi" if tok.strict else "stoull"
        if toks[tok.i] != "[":
            text = toks[tok.i]
            tok.i += 1
            n = _int_value(tok, key, text, "a power of 2 or a list such as [256:1,>:4]",
                           div_func)
            if not _is_pow2(n):
                raise tok.error(f"{key}:{text}: the divisions must be a power of 2 (PyTorch: "
                                "\"For roundups, the divisions has to be power of 2\")")
            self.roundup_power2_divisions = (n,) * _INTERVALS
            return
        if self.version < (2, 0):
            raise tok.error(f"{key} takes a single power of 2 in PyTorch "
                            f"{self.version[0]}.{self.version[1]} (the list form came in 2.0)")
        tok.i += 1  # "["
        vec = list(self.roundup_power2_divisions)
        first = True
        last_index = 0
        while tok.i < len(toks) and toks[tok.i] != "]":
            k = toks[tok.i]
            tok.i += 1
            tok.expect(":", k)
            if tok.i >= len(toks):
                if tok.strict:
                    raise tok.error(f"{key}: the interval {k!r} needs a value (PyTorch: "
                                    "\"Error parsing roundup_power2_divisions value\")")
                raise tok.out_of_bounds(f"{k}:")
            text = toks[tok.i]
            val = _int_value(tok, key, text, "power-of-2 divisions (or 0)", div_func)
            tok.i += 1
            if not (val == 0 or _is_pow2(val)):
                raise tok.error(f"{key}: divisions must be a power of 2 or 0; got {text!r} "
                                "(PyTorch: \"For roundups, the divisions has to be power of 2 "
                                "or 0 to disable roundup\")")
            if k == ">":
                start = last_index + 1 if self.version >= (2, 8) else last_index
                for i in range(min(start, _INTERVALS), _INTERVALS):
                    vec[i] = val
            else:
                mib = _int_value(tok, key, k, "interval starts in MiB that are powers of 2",
                                 "stoul" if tok.strict else "stoull")
                if not _is_pow2(mib):
                    raise tok.error(f"{key}: the interval {k!r} MiB is not a power of 2 "
                                    "(PyTorch: \"For roundups, the intervals have to be "
                                    "power of 2\")")
                index = min(mib.bit_length() - 1, _INTERVALS - 1)
                if first:
                    for i in range(index):
                        vec[i] = val
                    first = False
                vec[index] = val
                last_index = index
            # PyTorch: if (tokens[i + 1] != "]") expect ',' (read, never past the end)
            if tok.i >= len(toks):
                if tok.strict:
                    break
                raise tok.out_of_bounds(f"{k}:{text}")
            if toks[tok.i] != "]":
                tok.expect(",", f"{k}:{text}")
        if tok.i >= len(toks):
            raise tok.error(f"{key}: the list has no closing ']' (PyTorch 2.8 on: INTERNAL "
                            "ASSERT FAILED \"Expected closing bracket ']' in ConfigTokenizer "
                            "but reached end of config\")")
        tok.i += 1  # "]"
        self.roundup_power2_divisions = tuple(vec)

    def update(self, **parts: Any) -> None:
        """Set settings by name (see the class parameters); nothing changes on a refusal."""
        work = self.copy()
        for name, value in parts.items():
            work._set_part(name, value)
        for name in self.__slots__:
            setattr(self, name, getattr(work, name))

    def _set_part(self, name: str, value: Any) -> None:
        v = self.version
        if name == "max_split_size_mb" or name == "max_non_split_rounding_mb":
            if not self._known(name):
                raise ConfigError(f"{name} is not a setting of PyTorch {v[0]}.{v[1]}")
            if value is None and name == "max_split_size_mb":
                self.max_split_size = None
                return
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer number of MiB"
                                  f"{' or None (unset)' if name == 'max_split_size_mb' else ''}"
                                  f"; got {value!r}")
            low_ok = value >= 20 if v >= (2, 8) else value > 20
            if not low_ok:
                raise ConfigError(f"{name} must be {'>=' if v >= (2, 8) else '>'} 20 in "
                                  f"PyTorch {v[0]}.{v[1]}; got {value}")
            if name == "max_split_size_mb":
                self.max_split_size = value * _MIB
            else:
                self.max_non_split_rounding_size = value * _MIB
        elif name == "garbage_collection_threshold":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or not (value == 0 or 0 < value < 1):
                raise ConfigError(f"garbage_collection_threshold must be in (0.0, 1.0), or 0 "
                                  f"for off; got {value!r}")
            self.garbage_collection_threshold = float(value)
        elif name == "expandable_segments":
            if not isinstance(value, bool):
                raise ConfigError(f"expandable_segments must be True or False; got {value!r}")
            if value and v < (2, 1):
                raise ConfigError(f"expandable_segments came in PyTorch 2.1; this is "
                                  f"{v[0]}.{v[1]}")
            self.expandable_segments = value
        elif name == "roundup_power2_divisions":
            self.roundup_power2_divisions = self._divisions_from(value)
        else:
            raise ConfigError(
                f"unknown caching-allocator setting {name!r}; known: expandable_segments, "
                "garbage_collection_threshold, max_non_split_rounding_mb, max_split_size_mb, "
                "roundup_power2_divisions")

    def _divisions_from(self, value: Any) -> tuple[int, ...]:
        if isinstance(value, bool):
            raise ConfigError(f"roundup_power2_divisions: got {value!r}")
        if isinstance(value, int):
            if not (value == 0 or _is_pow2(value)):
                raise ConfigError(f"roundup_power2_divisions must be a power of 2 (or 0 for "
                                  f"off); got {value}")
            return (value,) * _INTERVALS
        if isinstance(value, str):
            tmp = CachingAllocatorConfig(version=self.version)
            tmp.apply(f"roundup_power2_divisions:{value}")
            return tmp.roundup_power2_divisions
        if isinstance(value, Mapping):
            return CachingAllocatorConfig.from_snapshot_settings(
                {"roundup_power2_divisions": value}).roundup_power2_divisions
        try:
            vec = tuple(int(x) for x in value)
        except (TypeError, ValueError):
            raise ConfigError(f"roundup_power2_divisions must be an int, a string such as "
                              f"'[256:1,>:4]', a dict or 16 ints; got {value!r}") from None
        if len(vec) != _INTERVALS or any(not (x == 0 or _is_pow2(x)) for x in vec):
            raise ConfigError(f"roundup_power2_divisions needs 16 powers of 2 (or 0); got "
                              f"{value!r}")
        return vec

    # ------------------------------------------------------------------ views
    def unsupported(self) -> str | None:
        """PyTorch's rule for ``max_split_size_mb`` with ``expandable_segments:True``: None
        unless these settings combine them, else why no answer should offer them together.

        PyTorch's parser takes both, but the allocator does not support them together: when
        a new segment is refused, ``release_available_cached_blocks`` frees cached blocks of
        ``max_split_size`` or more without passing over expandable ones, and
        ``release_block`` stops on ``TORCH_INTERNAL_ASSERT(!block->expandable_segment_)``
        (c10/cuda/CUDACachingAllocator.cpp; pytorch/pytorch#123548) instead of raising out
        of memory. With expandable segments ``max_split_size_mb`` no longer keeps blocks
        whole either (``should_split`` splits every block). The models reproduce the
        assert where a replay reaches it; what-if, the dashboard and sessions use this rule
        so that a replay that happens not to reach it is never offered as a setting.
        """
        if not (self.expandable_segments and self.max_split_size is not None
                and self.version >= (2, 1)):
            return None
        return (f"expandable_segments:True with max_split_size_mb:"
                f"{self.max_split_size // _MIB} is not supported by PyTorch: it takes both, "
                "but when memory runs short it frees cached oversize blocks without passing "
                "over expandable ones and stops on an internal assert "
                "(TORCH_INTERNAL_ASSERT(!block->expandable_segment_), "
                "pytorch/pytorch#123548) instead of raising out of memory; and with "
                "expandable segments max_split_size_mb keeps no block whole. Use one of the "
                "two")

    def divisions_for(self, size: int) -> int:
        """PyTorch's ``roundup_power2_divisions(size)``: the divisions of size's interval."""
        i = size.bit_length() - 1 - 20
        if i < 0:
            i = 0
        elif i > _INTERVALS - 1:
            i = _INTERVALS - 1
        return self.roundup_power2_divisions[i]

    def as_conf(self) -> str:
        """The settings as a ``PYTORCH_CUDA_ALLOC_CONF`` string (non-default ones only)."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // _MIB}")
        if self.max_non_split_rounding_size != K_LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size // _MIB}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        rd = self.roundup_power2_divisions
        if any(rd):
            if len(set(rd)) == 1:
                parts.append(f"roundup_power2_divisions:{rd[0]}")
            else:
                parts.append("roundup_power2_divisions:[" + ",".join(
                    f"{1 << i}:{d}" for i, d in enumerate(rd)) + "]")
        return ",".join(parts)

    def snapshot_settings(self) -> dict[str, Any]:
        """``allocator_settings`` as PyTorch's snapshot writes them."""
        return {
            "PYTORCH_CUDA_ALLOC_CONF": self.as_conf(),
            "max_split_size": -1 if self.max_split_size is None else self.max_split_size,
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "expandable_segments": self.expandable_segments,
            "pinned_num_register_threads": int(self.inert.get("pinned_num_register_threads", 1)),
            "release_lock_on_cudamalloc": bool(self.inert.get("release_lock_on_cudamalloc",
                                                              False)),
            "pinned_use_cuda_host_register": bool(self.inert.get(
                "pinned_use_cuda_host_register", False)),
            "roundup_power2_divisions": dict(zip(_INTERVAL_KEYS, self.roundup_power2_divisions)),
        }

    def as_dict(self) -> dict[str, Any]:
        """The settings by their ``PYTORCH_CUDA_ALLOC_CONF`` names (MiB where PyTorch takes
        MiB), plus ``version``."""
        return {
            "expandable_segments": self.expandable_segments,
            "max_split_size_mb": None if self.max_split_size is None
            else self.max_split_size // _MIB,
            "max_non_split_rounding_mb": self.max_non_split_rounding_size // _MIB,
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "roundup_power2_divisions": list(self.roundup_power2_divisions),
            "version": f"{self.version[0]}.{self.version[1]}",
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CachingAllocatorConfig):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        conf = self.as_conf()
        v = self.version
        return f"CachingAllocatorConfig({conf!r}, version='{v[0]}.{v[1]}')"
