"""The one place that picks the compiled allocator core or the pure-Python models.

``pip install`` builds :mod:`gpudash._core` (Cython: ``_core.pyx`` and ``_csrc/*.pxi``;
its contract is ``_core.pyi``) where a C compiler exists. Without the extension, with one
built from other sources than those beside it (:mod:`gpudash._sourcehash`), or with
``GPUDASH_PURE_PYTHON=1``, the pure-Python models run. ``gpudash info`` says which path
runs and why (:func:`describe`).

Every module asks one way, :func:`twin`: ``twin(name, pure, **needs)`` is the compiled
core's ``name`` where the core runs, else ``pure``. A name that starts with ``bind_`` is a
binder: the core builds the twin from ``pure`` and the ``needs`` the module hands it by
keyword (the compiled ``BFCAllocator`` is ``class BFCAllocator(BFCCore, PyBFCAllocator)``),
so the core reads no private name of the Python side. The twins gpudash binds:

=======================  ==========================================  =====================
where                    public name = twin(name, pure)              compiled twin
=======================  ==========================================  =====================
``bfc.py`` (end)         ``BFCAllocator`` of ``PyBFCAllocator``       ``_csrc/bfc.pxi``
``caching.py`` (end)     ``CachingAllocator`` of ``PyCachingAllocator``  ``_csrc/caching.pxi``
``session.py``           ``Session`` of ``PySession``; its lock and   ``_csrc/session.pxi``
                         its set of queued addresses
``devices.py``           a simulated device's first-fit table         ``_csrc/devices.pxi``
``trace/replay.py``      the replay loops and their key map           ``_csrc/replay.pxi``
``cli.py``               the clock of the events' times (``info``)    ``_csrc/base.pxi``
``torch_snapshot.py``    ``_pickle_check`` of ``_check_pickle``       ``_csrc/pickcheck.pxi``
=======================  ==========================================  =====================

:data:`TWINS` says, for each method of a pure-Python class that its compiled twin
replaces, where the compiled one lives (``tests/test_accel.py`` holds it to the classes).
"""

from __future__ import annotations

import logging
import os
from typing import Any, TypeVar

from ._sourcehash import source_hash
from .events import EventKind

__all__ = ["COMPILED", "ENV", "REASON", "TWINS", "describe", "extension", "twin"]

#: Set to 1 to run the pure-Python models even where the compiled core is built.
ENV = "GPUDASH_PURE_PYTHON"

logger = logging.getLogger("gpudash")

T = TypeVar("T")

_REBUILD = "rebuild it (pip install -e . or python setup.py build_ext --inplace)"


def _load() -> tuple[Any, str]:
    if os.environ.get(ENV, "").strip() not in ("", "0"):
        return None, f"{ENV} is set"
    try:
        import gpudash._core as _core  # late: the compiled core is optional (setup.py builds it)
    except ImportError as exc:
        return None, f"the compiled core is not built here ({exc})"
    here = source_hash(os.path.dirname(os.path.abspath(__file__)))
    if here is not None and here != getattr(_core, "SOURCE_HASH", None):
        return None, f"the compiled core was built from other sources than these ({_REBUILD})"
    codes = {k.name: int(k) for k in EventKind}
    if getattr(_core, "EVENT_KINDS", codes) != codes:
        return None, f"the compiled core was built for other event codes ({_REBUILD})"
    return _core, ""


_core, REASON = _load()
#: True when the allocators run on the compiled core.
COMPILED = _core is not None
_said = False


def twin(name: str, pure: T, **needs: Any) -> T:
    """The compiled core's twin of ``pure``: ``gpudash._core.<name>``, or ``pure`` on the
    pure-Python path (said once, as a warning, when the extension is missing rather than
    switched off).

    Where ``name`` starts with ``bind_`` the core's function builds the twin from ``pure``
    and ``needs`` (what it takes from the Python side, by keyword; ``_core.pyi`` lists them)
    and its result is returned. ``pure`` may be None where the caller runs its own Python
    path when the twin is None (the replay's loops)."""
    global _said
    if _core is None:
        if not _said and not REASON.startswith(ENV):
            _said = True
            logger.warning(
                "gpudash: %s; the pure-Python allocator models run (about 10x slower). "
                "Reinstall where a C compiler exists to build it, or set %s=1 to choose the "
                "pure-Python path and silence this.", REASON, ENV)
        return pure
    try:
        found = getattr(_core, name)
    except AttributeError:
        raise ImportError(f"gpudash._core has no {name}: it was built from older sources; "
                          f"{_REBUILD}") from None
    if name.startswith("bind_"):
        return found(pure, **needs)
    if needs:
        raise TypeError(f"gpudash._core.{name} is not a binder; it takes no needs")
    return found


def extension(purpose: str) -> Any:
    """The compiled extension itself, for a use with no pure-Python twin: install mode, where
    PyTorch loads C functions from the shared object. Built from these sources, it is
    returned even where ``GPUDASH_PURE_PYTHON`` runs the pure models; otherwise ImportError
    says why, naming ``purpose``."""
    if _core is not None:
        return _core
    try:
        import gpudash._core as core  # late: the compiled core is optional
    except ImportError as exc:
        raise ImportError(f"{purpose} needs gpudash's compiled core (gpudash._core), which is "
                          f"not built here ({exc}); install a C compiler and reinstall "
                          "gpudash") from None
    here = source_hash(os.path.dirname(os.path.abspath(__file__)))
    if here is not None and here != getattr(core, "SOURCE_HASH", None):
        raise ImportError(f"{purpose} needs gpudash._core built from these sources; "
                          f"{_REBUILD}")
    return core


def describe() -> str:
    """One line: which allocator core runs, and why."""
    if COMPILED:
        return f"compiled (gpudash._core, {os.path.basename(_core.__file__)})"
    return f"pure Python ({REASON})"


#: ``{"module.PureClass.method": "_csrc/file.pxi: CompiledClass.method"}``: where the compiled
#: twin of each pure-Python method lives, for every method the compiled class replaces.
#: ``tests/test_accel.py`` checks that it names exactly the methods each compiled class
#: overrides and that each named definition is in the named file.
TWINS: dict[str, str] = {
    # bfc.PyBFCAllocator: class BFCAllocator(BFCCore, PyBFCAllocator)
    "bfc.PyBFCAllocator._init_state": "_csrc/bfc.pxi: BFCCore._init_state",
    "bfc.PyBFCAllocator.allocate": "_csrc/bfc.pxi: BFCCore.allocate",
    "bfc.PyBFCAllocator.try_allocate": "_csrc/bfc.pxi: BFCCore.try_allocate",
    "bfc.PyBFCAllocator._take": "_csrc/bfc.pxi: BFCCore._take",
    "bfc.PyBFCAllocator._allocate_slow": "_csrc/bfc.pxi: BFCCore._allocate_slow",
    "bfc.PyBFCAllocator.deallocate": "_csrc/bfc.pxi: BFCCore.deallocate",
    "bfc.PyBFCAllocator._deallocate_batch": "_csrc/bfc.pxi: BFCCore._deallocate_batch",
    "bfc.PyBFCAllocator.requested_size": "_csrc/bfc.pxi: BFCCore.requested_size",
    "bfc.PyBFCAllocator.allocated_size": "_csrc/bfc.pxi: BFCCore.allocated_size",
    "bfc.PyBFCAllocator.allocation_id": "_csrc/bfc.pxi: BFCCore.allocation_id",
    "bfc.PyBFCAllocator.owns": "_csrc/bfc.pxi: BFCCore.owns",
    "bfc.PyBFCAllocator._live_size": "_csrc/bfc.pxi: BFCCore._live_size",
    "bfc.PyBFCAllocator._add_region": "_csrc/bfc.pxi: BFCCore._add_region",
    "bfc.PyBFCAllocator._extend": "_csrc/bfc.pxi: BFCCore._extend",
    "bfc.PyBFCAllocator._deallocate_regions": "_csrc/bfc.pxi: BFCCore._deallocate_regions",
    "bfc.PyBFCAllocator._deallocate_free_regions":
        "_csrc/bfc.pxi: BFCCore._deallocate_free_regions",
    "bfc.PyBFCAllocator._largest_free_chunk": "_csrc/bfc.pxi: BFCCore._largest_free_chunk",
    "bfc.PyBFCAllocator._region_table": "_csrc/bfc.pxi: BFCCore._region_table",
    "bfc.PyBFCAllocator._region_at": "_csrc/bfc.pxi: BFCCore._region_at",
    "bfc.PyBFCAllocator.close": "_csrc/bfc.pxi: BFCCore.close",
    "bfc.PyBFCAllocator._expand_journal": "_csrc/base.pxi: expand_journal",
    "bfc.PyBFCAllocator._count_events": "_csrc/base.pxi: count_journal_events",
    "bfc.PyBFCAllocator._keep_journal": "_csrc/base.pxi: keep_journal",
    # caching.PyCachingAllocator: class CachingAllocator(CachingCore, PyCachingAllocator)
    "caching.PyCachingAllocator._init_state": "_csrc/caching.pxi: CachingCore._init_state",
    "caching.PyCachingAllocator._settings_changed":
        "_csrc/caching.pxi: CachingCore._settings_changed",
    "caching.PyCachingAllocator.allocate": "_csrc/caching.pxi: CachingCore.allocate",
    "caching.PyCachingAllocator.try_allocate": "_csrc/caching.pxi: CachingCore.try_allocate",
    "caching.PyCachingAllocator._malloc": "_csrc/caching.pxi: CachingCore._malloc",
    "caching.PyCachingAllocator._release_cached_blocks":
        "_csrc/caching.pxi: CachingCore._release_cached_blocks",
    "caching.PyCachingAllocator.deallocate": "_csrc/caching.pxi: CachingCore.deallocate",
    "caching.PyCachingAllocator.owns": "_csrc/caching.pxi: CachingCore.owns",
    "caching.PyCachingAllocator.allocated_size": "_csrc/caching.pxi: CachingCore.allocated_size",
    "caching.PyCachingAllocator.requested_size": "_csrc/caching.pxi: CachingCore.requested_size",
    "caching.PyCachingAllocator.allocation_id": "_csrc/caching.pxi: CachingCore.allocation_id",
    "caching.PyCachingAllocator.reset_peak_stats":
        "_csrc/caching.pxi: CachingCore.reset_peak_stats",
    "caching.PyCachingAllocator.reset_accumulated_stats":
        "_csrc/caching.pxi: CachingCore.reset_accumulated_stats",
    "caching.PyCachingAllocator._largest_free_block":
        "_csrc/caching.pxi: CachingCore._largest_free_block",
    "caching.PyCachingAllocator._region_table": "_csrc/caching.pxi: CachingCore._region_table",
    "caching.PyCachingAllocator._region_at": "_csrc/caching.pxi: CachingCore._region_at",
    "caching.PyCachingAllocator.close": "_csrc/caching.pxi: CachingCore.close",
    "caching.PyCachingAllocator._expand_journal": "_csrc/base.pxi: expand_journal",
    "caching.PyCachingAllocator._count_events": "_csrc/base.pxi: count_journal_events",
    "caching.PyCachingAllocator._keep_journal": "_csrc/base.pxi: keep_journal",
    # session.PySession: class Session(PySession)
    "session.PySession.allocate": "_csrc/session.pxi: session_allocate",
    "session.PySession.free": "_csrc/session.pxi: session_free",
    # whole classes and loops
    "devices._FirstFitTable": "_csrc/devices.pxi: FirstFit",
    "models.bfc.run_plain": "_csrc/replay.pxi: run_bfc",
    "models.bfc.run_deferred": "_csrc/replay.pxi: run_bfc_deferred",
    "models.torch.run_torch": "_csrc/replay.pxi: run_torch",
    "trace.torch_snapshot._check_pickle": "_csrc/pickcheck.pxi: check_pickle",
}
