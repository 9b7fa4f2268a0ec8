"""Which allocator core runs: the compiled one or the pure-Python models.

``pip install`` builds :mod:`gpudash._core` (Cython) where a C compiler exists; the
allocator modules then bind their public classes to compiled subclasses of the pure-Python
models (:func:`compiled_class`). Without the extension, with one built from other sources
than those beside it (:mod:`gpudash._sourcehash`), or with ``GPUDASH_PURE_PYTHON=1``, the
pure-Python models run. ``gpudash info`` says which path runs and why
(:func:`describe`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["COMPILED", "ENV", "REASON", "compiled", "compiled_class", "compiled_methods",
           "describe"]

#: Set to 1 to run the pure-Python models even where the compiled core is built.
ENV = "GPUDASH_PURE_PYTHON"

logger = logging.getLogger("gpudash")


def _load() -> tuple[Any, str]:
    if os.environ.get(ENV, "").strip() not in ("", "0"):
        return None, f"{ENV} is set"
    try:
        from . import _core
    except ImportError as exc:
        return None, f"the compiled core is not built here ({exc})"
    from ._sourcehash import source_hash

    here = source_hash(os.path.dirname(os.path.abspath(__file__)))
    if here is not None and here != getattr(_core, "SOURCE_HASH", None):
        return None, ("the compiled core was built from other sources than these (rebuild it: "
                      "pip install -e . or python setup.py build_ext --inplace)")
    return _core, ""


_core, REASON = _load()
#: True when the allocators run on the compiled core.
COMPILED = _core is not None
_said = False


def compiled_class(kind: str, pure: type, module: Any) -> type:
    """The class an allocator module exports: the compiled subclass of ``pure`` (``kind``:
    ``"bfc"`` or ``"caching"``), or ``pure`` itself on the pure-Python path (said once, as a
    warning, when the extension is missing rather than switched off)."""
    global _said
    if _core is None:
        if not _said and not REASON.startswith(ENV):
            _said = True
            logger.warning(
                "gpudash: %s; the pure-Python allocator models run (about 10x slower). "
                "Reinstall where a C compiler exists to build it, or set %s=1 to choose the "
                "pure-Python path and silence this.", REASON, ENV)
        return pure
    return getattr(_core, f"make_{kind}_class")(pure, module)


def compiled(name: str, default: Any) -> Any:
    """The compiled core's ``name`` (a class gpudash uses, such as the session's lock or its
    set of queued addresses), or ``default`` on the pure-Python path."""
    if _core is None:
        return default
    return _from_core(name)


def compiled_methods(kind: str, cls: type, module: Any) -> dict[str, Any]:
    """``{name: function}``: the compiled core's fast paths for methods of ``cls`` (``kind``:
    ``"session"``), each handing every case it does not handle to the Python method it
    replaces; empty on the pure-Python path (the Python methods stay)."""
    if _core is None:
        return {}
    return _from_core(f"make_{kind}_methods")(cls, module)


def _from_core(name: str) -> Any:
    try:
        return getattr(_core, name)
    except AttributeError:
        raise ImportError(f"gpudash._core has no {name}: it was built from older sources; "
                          "rebuild it (pip install -e . or python setup.py build_ext "
                          "--inplace)") from None


def describe() -> str:
    """One line: which allocator core runs, and why."""
    if COMPILED:
        return f"compiled (gpudash._core, {os.path.basename(_core.__file__)})"
    return f"pure Python ({REASON})"
