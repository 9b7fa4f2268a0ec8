# gpudash.Session's hot path in C: the fields that allocate and free read (as C fields of the
# bases of Session, Device and the deferred-deletion queue), the session's lock, the set of
# queued addresses, and Session.allocate / Session.free for their common case (an open
# TensorFlow-style session, the compiled BFC allocator, no holder tracking or placement log;
# for free one device and an int address). Every other case, and every error, is the Python
# method's: the fast path hands the call to it unchanged. Included by _core.pyx; bound to
# gpudash.session by make_session_methods and make_deferred_class.

from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE

cdef extern from "pythread.h":
    unsigned long PyThread_get_thread_ident() nogil

# bound by make_session_methods, make_bfc_class and make_deferred_class
cdef object _Session = None, _BFCClass = None, _DeferredClass = None
cdef object _py_allocate = None, _py_free = None


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


# ------------------------------------------------------------------------------ fields
cdef class SessionFields:
    """The fields of a :class:`gpudash.Session` that allocate and free read, as C fields:
    the base of Session where the compiled core is built (``object`` on the pure-Python
    path, where they are plain attributes)."""

    cdef public object devices
    cdef public object _lock
    cdef public bint _closed
    cdef public bint _track_holders
    cdef public bint _log_placement


cdef class DeviceFields:
    """The fields of a session's :class:`gpudash.session.Device` that allocate and free
    read, as C fields: the base of Device where the compiled core is built."""

    cdef public object allocator
    cdef public object _deferred


cdef class DeferredCore:
    """The fields of a device's deferred-deletion queue (``session._Deferred``) that free
    reads and writes, as C fields: the bytes queued and the flush threshold as int64, the
    queue as a list, the queued addresses as an :class:`AddressSet`. ``session._Deferred``
    is this class's subclass of the pure dataclass, which gives it its ``repr`` and
    equality."""

    cdef public list pending
    cdef public object queued
    cdef public int64_t threshold
    cdef public int64_t pending_bytes


def make_deferred_class(pure, module):
    """``session._Deferred``: :class:`DeferredCore` first, the pure dataclass ``pure``; its
    ``queued`` is an :class:`AddressSet`."""
    global _DeferredClass

    class _Deferred(DeferredCore, pure):
        __doc__ = pure.__doc__
        __module__ = pure.__module__
        __qualname__ = pure.__qualname__

        def __init__(self, *args, **kwargs):
            pure.__init__(self, *args, **kwargs)
            self.queued = AddressSet(self.queued)

    _DeferredClass = _Deferred
    return _Deferred


# ------------------------------------------------------------------------------ fast paths
@cython.binding(True)
def session_allocate(self, nbytes, device=0):
    cdef SessionFields s
    cdef BFCCore alloc
    cdef uint64_t ptr
    cdef int overflow = 0
    cdef long long i
    if type(self) is not _Session or type(device) is not int:
        return _py_allocate(self, nbytes, device)
    s = <SessionFields>self
    devices = s.devices
    if s._closed or s._track_holders or s._log_placement or type(devices) is not list:
        return _py_allocate(self, nbytes, device)
    i = PyLong_AsLongLongAndOverflow(device, &overflow)
    if overflow or i < 0 or i >= PyList_GET_SIZE(devices):
        return _py_allocate(self, nbytes, device)
    dev = <object>PyList_GET_ITEM(devices, <Py_ssize_t>i)
    if not isinstance(dev, DeviceFields):
        return _py_allocate(self, nbytes, device)
    a = (<DeviceFields>dev).allocator
    if type(a) is not _BFCClass:
        return _py_allocate(self, nbytes, device)
    alloc = <BFCCore>a
    ptr = alloc.c_try_allocate(nbytes, False)
    if ptr or not nbytes:
        return ptr
    # Session._allocate_on's retry: flush the deferred frees, then the real attempt
    self._drain(dev)
    return dev.allocator.allocate(nbytes)


@cython.binding(True)
def session_free(self, ptr, device=None):
    cdef SessionFields s
    cdef BFCCore alloc
    cdef DeferredCore q
    cdef AddressSet queued
    cdef RLock lock
    cdef int64_t v, size
    cdef uint64_t p
    if device is not None or type(ptr) is not int or type(self) is not _Session:
        return _py_free(self, ptr, device)
    s = <SessionFields>self
    devices = s.devices
    if type(devices) is not list or PyList_GET_SIZE(devices) != 1 or type(s._lock) is not RLock:
        return _py_free(self, ptr, device)
    dev = <object>PyList_GET_ITEM(devices, 0)
    if not isinstance(dev, DeviceFields):
        return _py_free(self, ptr, device)
    a = (<DeviceFields>dev).allocator
    dq = (<DeviceFields>dev)._deferred
    if type(a) is not _BFCClass or type(dq) is not _DeferredClass:
        return _py_free(self, ptr, device)
    q = <DeferredCore>dq
    if type(q.queued) is not AddressSet or q.pending is None:
        return _py_free(self, ptr, device)
    alloc = <BFCCore>a
    p = as_address(ptr)
    if p == 0 or not pm_get(&alloc.byptr, p, &v) or alloc.ch[v].aid < 0:
        return _py_free(self, ptr, device)  # 0, not live, closed: the Python method says
    size = alloc.ch[v].size
    queued = <AddressSet>q.queued
    lock = <RLock>s._lock
    lock.take()
    try:
        if not queued.c_add(p):
            raise InvalidPointerError(
                f"{alloc.name}: free({ptr:#x}): this address is already queued for "
                "deletion (double free?)")
        PyList_Append(q.pending, ptr)
        q.pending_bytes += size
        if q.pending_bytes >= q.threshold:
            self._flush_pending(dev)
    finally:
        lock.give()


def make_session_methods(session, module):
    """``{name: function}``: the compiled fast paths of ``session``'s (gpudash.Session's)
    methods, each handing every case but its own to the Python method it replaces."""
    global _Session, _py_allocate, _py_free
    _Session = session
    _py_allocate, _py_free = session.allocate, session.free
    return {"allocate": session_allocate, "free": session_free}
