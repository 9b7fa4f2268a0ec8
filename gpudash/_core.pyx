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

# Event codes (gpudash.events.EventKind)
cdef enum:
    K_ALLOC = 1
    K_FREE = 2
    K_SPLIT = 3
    K_MERGE = 4
    K_EXTEND = 5
    K_RELEASE = 6
    K_OOM = 7
    K_LIMIT = 8

cdef Py_ssize_t JOURNAL_FLUSH = _eventsource.JOURNAL_FLUSH
cdef int64_t MAX_ALLOCATION = (1 << 63) - 1 - 256
cdef int64_t K_FIRST_GROWTH_REGION = 2 << 20

# Names of the pure-Python modules, bound by make_bfc_class / make_caching_class (the
# modules import this one at their end).
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


def make_bfc_class(pure, module):
    """The compiled ``BFCAllocator``: :class:`BFCCore` first, the pure-Python model
    ``pure`` for everything the core does not replace."""
    global _PyChunk, _PyRegion, _coerce_size, _negative_size, _pointer_or_none, _logger
    global _GC_MESSAGE, _BFCClass
    _PyChunk, _PyRegion = module._Chunk, module._Region
    _coerce_size, _negative_size = module._coerce_size, module._negative_size
    _pointer_or_none = module._pointer_or_none
    _logger, _GC_MESSAGE = module.logger, module._GC_MESSAGE
    if (module.MAX_ALLOCATION != MAX_ALLOCATION or module.K_NUM_BINS != NUM_BINS
            or module.K_FIRST_GROWTH_REGION != K_FIRST_GROWTH_REGION):
        raise ImportError("gpudash._core was built for other BFC constants; rebuild it")

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


def make_caching_class(pure, module):
    """The compiled ``CachingAllocator``: :class:`CachingCore` first, the pure-Python model
    ``pure`` for everything the core does not replace."""
    global _PyCaching, _PyStats, _PyBlock, _PyPool, _PyES, _stream_of
    _PyCaching, _PyStats, _PyBlock = pure, module._Stats, module._Block
    _PyPool, _PyES, _stream_of = module._Pool, module._ExpandableSegment, module._stream_of
    if (module.K_MIN_BLOCK_SIZE != KMIN_BLOCK or module.K_SMALL_SIZE != KSMALL_SIZE
            or module.K_SMALL_BUFFER != KSMALL_BUFFER or module.K_LARGE_BUFFER != KLARGE_BUFFER
            or module.K_MIN_LARGE_ALLOC != KMIN_LARGE_ALLOC
            or module.K_ROUND_LARGE != KROUND_LARGE or module.K_ONE_EXA != K_ONE_EXA
            or tuple(module._STAT_TYPES) != ("all", "small_pool", "large_pool")):
        raise ImportError("gpudash._core was built for other caching-allocator constants; "
                          "rebuild it")

    class CachingAllocator(CachingCore, pure):
        __doc__ = pure.__doc__
        __module__ = pure.__module__
        __qualname__ = "CachingAllocator"
        compiled = True
        _expand_journal = staticmethod(expand_journal)
        _count_events = staticmethod(count_journal_events)
        _keep_journal = staticmethod(keep_journal)

    return CachingAllocator
