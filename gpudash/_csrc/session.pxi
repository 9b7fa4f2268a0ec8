# gpudash.Session's hot path in C: the session's lock, the set of queued addresses, and
# Session.allocate / Session.free for their common case (an open TensorFlow-style session,
# the compiled BFC allocator, no holder tracking or placement log; for free one device and an
# int address), which read the __slots__ of Session, Device and the deferred-deletion queue
# by offset. Every other case, and every error, is the Python method's: the fast path hands
# the call to it unchanged. Included by _core.pyx; bound to gpudash.session by its
# bind_session.

from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF

cdef extern from "pythread.h":
    unsigned long PyThread_get_thread_ident() nogil

# bound by bind_session and bind_bfc_allocator (_core.pyx)
cdef object _Session = None, _BFCClass = None, _DeferredClass = None
cdef object _py_allocate = None, _py_free = None

from types import MemberDescriptorType as _MemberDescriptor


# ------------------------------------------------------------------------------ lock
cdef class RLock:
    """A reentrant lock, as ``threading.RLock``: ``acquire``/``release``, a context manager,
    usable by ``threading.Condition`` (``_is_owned``, ``_release_save``,
    ``_acquire_restore``). The session's lock where the compiled core is built.

    Like :class:`Lock` it relies on the GIL: every acquire and release happens with the GIL
    held, so taking a free lock (or one this thread holds) is setting two fields. A thread
    that finds it held by another waits with the GIL released, looking again after a pause
    that doubles from a few microseconds to a millisecond."""

    cdef unsigned long owner
    cdef Py_ssize_t count
    cdef PyThread_type_lock pause   # never released: timed waits on it are sleeps

    def __cinit__(self):
        self.owner = 0
        self.count = 0
        self.pause = PyThread_allocate_lock()
        if self.pause == NULL:
            raise MemoryError("cannot allocate a lock")
        PyThread_acquire_lock(self.pause, NOWAIT_LOCK)

    def __dealloc__(self):
        if self.pause != NULL:
            PyThread_release_lock(self.pause)
            PyThread_free_lock(self.pause)
            self.pause = NULL

    cdef inline int take(self) except -1:
        cdef unsigned long me = PyThread_get_thread_ident()
        if self.count == 0:
            self.owner = me
            self.count = 1
        elif self.owner == me:
            self.count += 1
        else:
            self.wait(me, -1.0)
        return 0

    cdef inline void give(self) noexcept:
        """Release once; only the owner calls it."""
        self.count -= 1
        if self.count == 0:
            self.owner = 0

    cdef bint wait(self, unsigned long me, double timeout) except -1:
        """Wait until another thread's hold ends and take the lock (True), or until
        ``timeout`` seconds passed (False; < 0: no limit), the GIL released while pausing;
        signals are handled between pauses."""
        cdef long long step = 2, left = <long long>(timeout * 1e6) if timeout >= 0 else -1
        while True:
            if left >= 0 and step > left:
                step = left
            with nogil:
                PyThread_acquire_lock_timed(self.pause, step, 0)
            if self.count == 0:
                self.owner = me
                self.count = 1
                return True
            if left >= 0:
                left -= step
                if left <= 0:
                    return False
            if step < 1000:
                step *= 2
            PyErr_CheckSignals()

    def acquire(self, blocking=True, timeout=-1):
        cdef double t = timeout
        cdef unsigned long me = PyThread_get_thread_ident()
        if not blocking and t != -1:
            raise ValueError("can't specify a timeout for a non-blocking call")
        if t < 0 and t != -1:
            raise ValueError("timeout value must be a non-negative number")
        if self.count == 0 or self.owner == me:
            if self.count == 0:
                self.owner = me
            self.count += 1
            return True
        if not blocking:
            return False
        return self.wait(me, t)

    def release(self):
        if self.count == 0 or self.owner != PyThread_get_thread_ident():
            raise RuntimeError("cannot release un-acquired lock")
        self.give()

    def __enter__(self):
        self.take()
        return True

    def __exit__(self, *exc):
        if self.count == 0 or self.owner != PyThread_get_thread_ident():
            raise RuntimeError("cannot release un-acquired lock")
        self.give()

    def _is_owned(self):
        return self.count != 0 and self.owner == PyThread_get_thread_ident()

    def _release_save(self):
        if self.count == 0 or self.owner != PyThread_get_thread_ident():
            raise RuntimeError("cannot release un-acquired lock")
        state = (self.count, self.owner)
        self.count = 0
        self.owner = 0
        return state

    def _acquire_restore(self, state):
        count, owner = state
        self.take()
        self.count = count
        self.owner = owner

    def _at_fork_reinit(self):
        self.count = 0
        self.owner = 0

    def __repr__(self):
        return (f"<gpudash._core.RLock {'locked' if self.count else 'unlocked'} object "
                f"owner={self.owner} count={self.count}>")


# ------------------------------------------------------------------------------ address set
cdef class AddressSet:
    """A set of addresses (ints in [0, 2**64)) in a C hash table: the deferred-deletion
    queue's ``queued``. Set-like for the Python code that reads it (``in``, ``len``,
    iteration, ``add``, ``discard``, ``difference_update``, ``clear``, equality with a set);
    a block address's low bits are all zero, which a Python set hashes poorly."""

    cdef PMap m

    def __cinit__(self, values=()):
        pm_init(&self.m, 64)

    def __init__(self, values=()):
        for v in values:
            self.add(v)

    def __dealloc__(self):
        pm_free(&self.m)

    cdef inline bint c_add(self, uint64_t p) except -1:
        """Add p; False when it was there already."""
        cdef int64_t v
        if pm_get(&self.m, p, &v):
            return False
        pm_put(&self.m, p, 0)
        return True

    cdef inline uint64_t key(self, object value) except? 0:
        cdef unsigned long p
        if type(value) is not int:
            value = _index(value)
        p = _as_ulong(value)
        if p == <unsigned long>-1 and PyErr_Occurred():
            PyErr_Clear()
            raise ValueError(f"an address is an int in [0, 2**64); got {value!r}")
        return p

    def add(self, value):
        self.c_add(self.key(value))

    def discard(self, value):
        cdef int64_t v
        try:
            p = self.key(value)
        except (TypeError, ValueError):
            return
        pm_del(&self.m, p, &v)

    def difference_update(self, *others):
        cdef int64_t v
        for other in others:
            for value in other:
                try:
                    p = self.key(value)
                except (TypeError, ValueError):
                    continue
                pm_del(&self.m, p, &v)

    def clear(self):
        pm_free(&self.m)
        pm_init(&self.m, 64)

    def __contains__(self, value):
        cdef int64_t v
        try:
            p = self.key(value)
        except (TypeError, ValueError):
            return False
        return pm_get(&self.m, p, &v)

    def __len__(self):
        return self.m.n

    def __bool__(self):
        return self.m.n != 0

    def __iter__(self):
        return iter(self.tolist())

    def tolist(self):
        cdef size_t i
        out = [0] if self.m.has0 else []
        for i in range(self.m.cap):
            if self.m.k[i] != 0:
                out.append(self.m.k[i])
        return out

    def __eq__(self, other):
        if isinstance(other, (AddressSet, set, frozenset)):
            return set(self.tolist()) == set(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        return f"AddressSet({set(self.tolist())!r})" if self.m.n else "AddressSet()"


# ------------------------------------------------------------------------------ fast paths
cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member

cdef int _T_OBJECT_EX = 16   # a __slots__ member (structmember.h's T_OBJECT_EX)
cdef object _False = False

# offsets of the __slots__ the fast paths read (set by bind_session, _core.pyx)
cdef Py_ssize_t _off_devices = 0, _off_lock = 0, _off_closed = 0, _off_track = 0, _off_log = 0
cdef Py_ssize_t _off_allocator = 0, _off_deferred = 0
cdef Py_ssize_t _off_pending = 0, _off_queued = 0, _off_pending_bytes = 0, _off_threshold = 0
cdef object _Device = None


cdef inline PyObject* _slot(object obj, Py_ssize_t off) noexcept:
    """The value of a __slots__ member at ``off`` (borrowed; NULL when unset)."""
    return (<PyObject**>((<char*><PyObject*>obj) + off))[0]


cdef inline void _set_slot(object obj, Py_ssize_t off, object value) noexcept:
    cdef PyObject** p = <PyObject**>((<char*><PyObject*>obj) + off)
    cdef PyObject* old = p[0]
    Py_INCREF(value)
    p[0] = <PyObject*>value
    Py_XDECREF(old)


cdef Py_ssize_t _slot_offset(cls, str name) except -1:
    """The offset of ``cls``'s ``__slots__`` member ``name``."""
    descr = getattr(cls, name)
    if type(descr) is not _MemberDescriptor or (
            (<PyMemberDescrObject*><PyObject*>descr).d_member.type != _T_OBJECT_EX):
        raise TypeError(f"{cls.__qualname__}.{name} is not a __slots__ member")
    return (<PyMemberDescrObject*><PyObject*>descr).d_member.offset


@cython.binding(True)
def session_allocate(self, nbytes, device=0):
    cdef BFCCore alloc
    cdef uint64_t ptr
    cdef int overflow = 0
    cdef long long i
    cdef PyObject* f = <PyObject*>_False
    cdef PyObject* pd
    if type(self) is not _Session or type(device) is not int:
        return _py_allocate(self, nbytes, device)
    pd = _slot(self, _off_devices)
    if (_slot(self, _off_closed) != f or _slot(self, _off_track) != f
            or _slot(self, _off_log) != f or pd == NULL or type(<object>pd) is not list):
        return _py_allocate(self, nbytes, device)
    devices = <object>pd
    i = PyLong_AsLongLongAndOverflow(device, &overflow)
    if overflow or i < 0 or i >= PyList_GET_SIZE(devices):
        return _py_allocate(self, nbytes, device)
    dev = <object>PyList_GET_ITEM(devices, <Py_ssize_t>i)
    if type(dev) is not _Device:
        return _py_allocate(self, nbytes, device)
    pd = _slot(dev, _off_allocator)
    if pd == NULL or type(<object>pd) is not _BFCClass:
        return _py_allocate(self, nbytes, device)
    alloc = <BFCCore><object>pd
    ptr = alloc.c_try_allocate(nbytes, False)
    if ptr or not nbytes:
        return ptr
    # Session._allocate_on's retry: flush the deferred frees, then the real attempt
    self._drain(dev)
    return dev.allocator.allocate(nbytes)


@cython.binding(True)
def session_free(self, ptr, device=None):
    cdef BFCCore alloc
    cdef RLock lock
    cdef int64_t v
    cdef uint64_t p
    cdef PyObject* pd
    cdef PyObject* pl
    cdef PyObject* pq
    cdef PyObject* pp
    cdef PyObject* pb
    cdef PyObject* pt
    if device is not None or type(ptr) is not int or type(self) is not _Session:
        return _py_free(self, ptr, device)
    pd = _slot(self, _off_devices)
    pl = _slot(self, _off_lock)
    if (pd == NULL or type(<object>pd) is not list or PyList_GET_SIZE(<object>pd) != 1
            or pl == NULL or type(<object>pl) is not RLock):
        return _py_free(self, ptr, device)
    dev = <object>PyList_GET_ITEM(<object>pd, 0)
    if type(dev) is not _Device:
        return _py_free(self, ptr, device)
    pd = _slot(dev, _off_allocator)
    pq = _slot(dev, _off_deferred)
    if pd == NULL or type(<object>pd) is not _BFCClass or pq == NULL or (
            type(<object>pq) is not _DeferredClass):
        return _py_free(self, ptr, device)
    alloc = <BFCCore><object>pd
    d = <object>pq
    p = as_address(ptr)
    if p == 0 or not pm_get(&alloc.byptr, p, &v) or alloc.ch[v].aid < 0:
        return _py_free(self, ptr, device)  # 0, not live, closed: the Python method says
    size = alloc.ch[v].size
    lock = <RLock><object>pl
    lock.take()
    try:
        pq = _slot(d, _off_queued)
        pp = _slot(d, _off_pending)
        pb = _slot(d, _off_pending_bytes)
        pt = _slot(d, _off_threshold)
        if (pq == NULL or type(<object>pq) is not AddressSet or pp == NULL
                or type(<object>pp) is not list or pb == NULL or pt == NULL):
            lock.give()
            lock = None
            return _py_free(self, ptr, device)
        if not (<AddressSet><object>pq).c_add(p):
            raise InvalidPointerError(
                f"{alloc.name}: free({ptr:#x}): this address is already queued for "
                "deletion (double free?)")
        PyList_Append(<object>pp, ptr)
        pending = <object>pb + size
        _set_slot(d, _off_pending_bytes, pending)
        if pending >= <object>pt:
            self._flush_pending(dev)
    finally:
        if lock is not None:
            lock.give()
