# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=False, binding=False
"""gpudash's compiled allocator core.

The state of both allocator models in C arrays, every operation that changes it, and the
replay loops that drive them: :class:`BFCCore` (TensorFlow's BFC, the model of
``gpudash.bfc``) and :class:`CachingCore` (PyTorch's caching allocator, ``gpudash.caching``).
The pure-Python models stay the readable reference: the compiled classes are subclasses of
them (``class BFCAllocator(BFCCore, PyBFCAllocator)``) that inherit every method that only
reads the state (snapshots, memory logs, ``check()``, the settings) and replace the ones that
change it. Differential tests hold the two to the same addresses, statistics, events and
errors (``tests/test_core_diff.py``, ``benchmarks/fuzz_core.py``).

Sources: this file and the ``_csrc/*.pxi`` it includes (base: lock, journal, sorted keys,
hash map, event expansion; devices: a simulated device's first-fit placement; bfc; caching;
replay; session: the session's lock, queue fields and the fast paths of ``Session.allocate``
and ``Session.free``).
"""

import threading

import numpy as np

cimport cython
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES
from cpython.exc cimport PyErr_CheckSignals
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.exc cimport PyErr_Occurred, PyErr_Clear
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.pythread cimport (
    NOWAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
    PyThread_type_lock,
)
from libc.stdint cimport INT64_MAX, int8_t, int16_t, int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport qsort
from libc.string cimport memcpy, memmove, memset

from . import _eventsource
from numbers import Integral as _Integral
from operator import index as _index

from ._errors import (
    BackendUnavailableError,
    GpudashError,
    InvalidPointerError,
    OutOfMemoryError,
)

cdef extern from *:
    """
    #include <limits.h>
    #if ULONG_MAX < 0xFFFFFFFFFFFFFFFFULL
    #error "gpudash._core needs a 64-bit unsigned long (LP64)"
    #endif
    """
    int __builtin_clzll(unsigned long long) nogil
    int __builtin_clz(unsigned int) nogil
    int __builtin_ctz(unsigned int) nogil
    int __builtin_ctzll(unsigned long long) nogil

cdef extern from *:
    """
    #ifndef GPUDASH_SOURCE_HASH
    #define GPUDASH_SOURCE_HASH ""
    #endif
    """
    const char* GPUDASH_SOURCE_HASH

#: The sha256 of the sources this extension was built from (gpudash._sourcehash).
SOURCE_HASH = GPUDASH_SOURCE_HASH.decode("ascii")

# Event codes: gpudash.events.EventKind's, which gpudash._accel holds them to (EVENT_KINDS)
cdef enum:
    K_ALLOC = 1
    K_FREE = 2
    K_SPLIT = 3
    K_MERGE = 4
    K_EXTEND = 5
    K_RELEASE = 6
    K_OOM = 7
    K_LIMIT = 8

#: The event codes this core was built with, by gpudash.events.EventKind name.
EVENT_KINDS = {"ALLOC": K_ALLOC, "FREE": K_FREE, "SPLIT": K_SPLIT, "MERGE": K_MERGE,
               "EXTEND": K_EXTEND, "RELEASE": K_RELEASE, "OOM": K_OOM, "LIMIT": K_LIMIT}

cdef Py_ssize_t JOURNAL_FLUSH = _eventsource.JOURNAL_FLUSH
cdef int64_t MAX_ALLOCATION = (1 << 63) - 1 - 256
cdef int64_t K_FIRST_GROWTH_REGION = 2 << 20

# What the core takes from the Python side: handed in by keyword when gpudash._accel.twin
# calls bind_bfc_allocator / bind_caching_allocator / bind_session (see _core.pyi).
_PyChunk = _PyRegion = None
_coerce_size = _negative_size = _pointer_or_none = None
_logger = None
_GC_MESSAGE = ""
_PyCaching = _PyStats = _PyBlock = _PyPool = _PyES = _stream_of = None

include "_csrc/base.pxi"
include "_csrc/devices.pxi"
include "_csrc/bfc.pxi"
include "_csrc/caching.pxi"
include "_csrc/replay.pxi"
include "_csrc/session.pxi"
include "_csrc/pluggable.pxi"
include "_csrc/pickcheck.pxi"


def _check_constants(what, given, built):
    """ImportError unless the Python model's constants ``given`` are those the core was
    built with (``built``)."""
    if dict(given) != built:
        wrong = sorted(k for k in built.keys() | given.keys()
                       if given.get(k) != built.get(k))
        raise ImportError(f"gpudash._core was built for other {what} constants "
                          f"({', '.join(wrong)}); rebuild it")


def bind_bfc_allocator(pure, *, chunk, region, coerce_size, negative_size, pointer_or_none,
                       logger, gc_message, constants):
    """The compiled ``BFCAllocator``: :class:`BFCCore` first, the pure-Python model
    ``pure`` (``gpudash.bfc.PyBFCAllocator``) for everything the core does not replace.
    The rest is what the core takes from ``gpudash.bfc``: its chunk and region classes, its
    size checks, its logger and garbage-collection message, and its constants (checked)."""
    global _PyChunk, _PyRegion, _coerce_size, _negative_size, _pointer_or_none, _logger
    global _GC_MESSAGE, _BFCClass
    _check_constants("BFC", constants, {"MAX_ALLOCATION": MAX_ALLOCATION,
                                        "K_NUM_BINS": NUM_BINS,
                                        "K_FIRST_GROWTH_REGION": K_FIRST_GROWTH_REGION})
    _PyChunk, _PyRegion = chunk, region
    _coerce_size, _negative_size, _pointer_or_none = coerce_size, negative_size, pointer_or_none
    _logger, _GC_MESSAGE = logger, gc_message

    class BFCAllocator(BFCCore, pure):
        __doc__ = pure.__doc__
        __module__ = pure.__module__
        __qualname__ = "BFCAllocator"
        compiled = True
        _expand_journal = staticmethod(expand_journal)
        _count_events = staticmethod(count_journal_events)
        _keep_journal = staticmethod(keep_journal)

    _BFCClass = BFCAllocator
    return BFCAllocator


def bind_caching_allocator(pure, *, stats, block, pool, expandable_segment, stream_of,
                           stat_types, constants):
    """The compiled ``CachingAllocator``: :class:`CachingCore` first, the pure-Python model
    ``pure`` (``gpudash.caching.PyCachingAllocator``) for everything the core does not
    replace. The rest is what the core takes from ``gpudash.caching``: its statistics,
    block, pool and expandable-segment classes, its stream parser, the names of its
    statistics' pools, and its constants (checked)."""
    global _PyCaching, _PyStats, _PyBlock, _PyPool, _PyES, _stream_of
    _check_constants("caching-allocator", constants, {
        "K_MIN_BLOCK_SIZE": KMIN_BLOCK, "K_SMALL_SIZE": KSMALL_SIZE,
        "K_SMALL_BUFFER": KSMALL_BUFFER, "K_LARGE_BUFFER": KLARGE_BUFFER,
        "K_MIN_LARGE_ALLOC": KMIN_LARGE_ALLOC, "K_ROUND_LARGE": KROUND_LARGE,
        "K_ONE_EXA": K_ONE_EXA})
    if tuple(stat_types) != ("all", "small_pool", "large_pool"):
        raise ImportError("gpudash._core was built for other statistics pools; rebuild it")
    _PyCaching, _PyStats, _PyBlock = pure, stats, block
    _PyPool, _PyES, _stream_of = pool, expandable_segment, stream_of

    class CachingAllocator(CachingCore, pure):
        __doc__ = pure.__doc__
        __module__ = pure.__module__
        __qualname__ = "CachingAllocator"
        compiled = True
        _expand_journal = staticmethod(expand_journal)
        _count_events = staticmethod(count_journal_events)
        _keep_journal = staticmethod(keep_journal)

    return CachingAllocator


def bind_session(pure, *, device, deferred):
    """The compiled ``Session``: the pure-Python ``pure`` (``gpudash.session.PySession``)
    with :func:`session_allocate` and :func:`session_free` as its ``allocate`` and ``free``,
    each handing every case but the common one to ``pure``'s method, whose name, document
    and signature it takes (``__wrapped__``). They read the ``__slots__`` of the session, of
    ``device`` (``gpudash.session.Device``) and of ``deferred`` (a device's
    deferred-deletion queue) by offset."""
    global _Session, _Device, _DeferredClass, _py_allocate, _py_free
    global _off_devices, _off_lock, _off_closed, _off_track, _off_log
    global _off_allocator, _off_deferred
    global _off_pending, _off_queued, _off_pending_bytes, _off_threshold
    _off_devices = _slot_offset(pure, "devices")
    _off_lock = _slot_offset(pure, "_lock")
    _off_closed = _slot_offset(pure, "_closed")
    _off_track = _slot_offset(pure, "_track_holders")
    _off_log = _slot_offset(pure, "_log_placement")
    _off_allocator = _slot_offset(device, "allocator")
    _off_deferred = _slot_offset(device, "_deferred")
    _off_pending = _slot_offset(deferred, "pending")
    _off_queued = _slot_offset(deferred, "queued")
    _off_pending_bytes = _slot_offset(deferred, "pending_bytes")
    _off_threshold = _slot_offset(deferred, "threshold")
    _Device, _DeferredClass = device, deferred
    _py_allocate, _py_free = pure.allocate, pure.free
    for fast, py in ((session_allocate, pure.allocate), (session_free, pure.free)):
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(fast, attr, getattr(py, attr))
        fast.__wrapped__ = py

    class Session(pure):
        __doc__ = pure.__doc__
        __module__ = pure.__module__
        __qualname__ = "Session"
        __slots__ = ()
        allocate = session_allocate
        free = session_free

    _Session = Session
    return Session
