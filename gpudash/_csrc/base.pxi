# The pieces both cores share: a lock, the event journal, a sorted set of keys, a hash map,
# the journal's expansion into event columns. Included by _core.pyx.

# ------------------------------------------------------------------------------ clock
cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec* tp)
    enum: CLOCK_REALTIME


cdef extern from "Python.h":
    # no exception check: as_address handles the error itself
    unsigned long _as_ulong "PyLong_AsUnsignedLong"(object) noexcept


cdef inline uint64_t as_address(object ptr) noexcept:
    """An int as an address: 0 for anything negative or past 64 bits (never an address)."""
    cdef unsigned long p = _as_ulong(ptr)
    if p == <unsigned long>-1 and PyErr_Occurred():
        PyErr_Clear()
        return 0
    return p


cdef inline int64_t now_ns() noexcept nogil:
    """time.time_ns(): the same clock (CLOCK_REALTIME)."""
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


# The journal stamps each record with the processor's time-stamp counter where the kernel
# keeps time by it (x86-64 Linux with the "tsc" clock source, which the kernel chooses only
# when the counter runs at a constant rate on every core: one instruction, about 9 ns here
# against 21 ns for clock_gettime), and turns the stamps into time.time_ns() values when the
# records are read (Journal.settle). Elsewhere, or with GPUDASH_JOURNAL_CLOCK=realtime, it
# stamps time.time_ns() values directly.
cdef extern from *:
    """
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    #include <x86intrin.h>
    #define GPUDASH_HAS_TSC 1
    static inline int64_t gpudash_tsc(void) { return (int64_t)__rdtsc(); }
    #else
    #define GPUDASH_HAS_TSC 0
    static inline int64_t gpudash_tsc(void) { return 0; }
    #endif
    """
    int64_t tsc "gpudash_tsc"() noexcept nogil
    const bint HAS_TSC "GPUDASH_HAS_TSC"


def _tsc_usable():
    """Whether the journal may stamp with the time-stamp counter, and why (or why not)."""
    import os
    if os.environ.get("GPUDASH_JOURNAL_CLOCK", "").strip().lower() == "realtime":
        return False, "GPUDASH_JOURNAL_CLOCK=realtime"
    if not HAS_TSC:
        return False, "no time-stamp counter on this platform"
    try:
        with open("/sys/devices/system/clocksource/clocksource0/current_clocksource") as f:
            source = f.read().strip()
    except OSError:
        return False, "the kernel's clock source is unknown"
    if source != "tsc":
        return False, f"the kernel keeps time by {source!r}, not the time-stamp counter"
    return True, "the kernel keeps time by the time-stamp counter"


cdef bint USE_TSC
USE_TSC, JOURNAL_CLOCK_REASON = _tsc_usable()
JOURNAL_CLOCK = "tsc" if USE_TSC else "realtime"


cdef inline int64_t ticks() noexcept nogil:
    """A journal record's stamp: the time-stamp counter, or time.time_ns()."""
    if USE_TSC:
        return tsc()
    return now_ns()


# ------------------------------------------------------------------------------ lock
cdef extern from "pythread.h":
    int PyThread_acquire_lock_timed(PyThread_type_lock, long long microseconds,
                                    int intr_flag) nogil

cdef extern from *:
    """
    #ifdef Py_GIL_DISABLED
    #error "gpudash._core's lock relies on the GIL; build for a CPython with a GIL"
    #endif
    """


cdef class Lock:
    """A plain lock, as ``threading.Lock``: ``acquire``/``release``/``locked``, a context
    manager, usable by ``threading.Condition``.

    Every acquire and release happens with the GIL held (Python code, or the compiled
    cores' C code, which holds the GIL for a whole operation), so taking a free lock is
    setting a flag. A thread that finds it taken waits with the GIL released, looking again
    after a pause that doubles from a few microseconds to a millisecond (the lock is
    seldom held for long: only while an operation calls back into Python, or a reader
    copies the state)."""

    cdef bint held
    cdef PyThread_type_lock pause   # never released: timed waits on it are sleeps

    def __cinit__(self):
        self.held = 0
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
        if not self.held:
            self.held = 1
            return 0
        self.wait(-1.0)
        return 0

    cdef bint wait(self, double timeout) except -1:
        """Wait until the lock is ours (True) or ``timeout`` seconds passed (False; < 0: no
        limit), the GIL released while pausing; signals are handled between pauses."""
        cdef long long step = 2, left = <long long>(timeout * 1e6) if timeout >= 0 else -1
        while True:
            if left >= 0 and step > left:
                step = left
            with nogil:
                PyThread_acquire_lock_timed(self.pause, step, 0)
            if not self.held:
                self.held = 1
                return True
            if left >= 0:
                left -= step
                if left <= 0:
                    return False
            if step < 1000:
                step *= 2
            PyErr_CheckSignals()

    cdef inline void give(self) noexcept:
        self.held = 0

    def acquire(self, blocking=True, timeout=-1):
        cdef double t = timeout
        if not self.held:
            self.held = 1
            return True
        if not blocking:
            if t != -1:
                raise ValueError("can't specify a timeout for a non-blocking call")
            return False
        if t < 0 and t != -1:
            raise ValueError("timeout value must be a non-negative number")
        return self.wait(t)

    def release(self):
        if not self.held:
            raise RuntimeError("release unlocked lock")
        self.held = 0

    def locked(self):
        return bool(self.held)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.held = 0

    def __repr__(self):
        return f"<gpudash._core.Lock {'locked' if self.held else 'unlocked'}>"


# ------------------------------------------------------------------------------ journal
cdef extern from *:
    """
    #if defined(__linux__)
    #include <sys/mman.h>
    #include <unistd.h>
    #include <stdint.h>
    #ifndef MADV_POPULATE_WRITE
    #define MADV_POPULATE_WRITE 23
    #endif
    /* Map a new buffer's pages in one call: a batch's buffer is written once, front to
       back, and a page fault per 4 KiB page costs more than the records written there
       (about 3.6 us a page on a virtual machine here, against 1.6 us this way). Kernels
       before 5.14 refuse the advice; the pages are then mapped as they are touched. */
    static void gpudash_prefault(void *p, size_t n) {
        uintptr_t page = 4096, a = ((uintptr_t)p + page - 1) & ~(page - 1);
        uintptr_t e = ((uintptr_t)p + n) & ~(page - 1);
        if (n >= (64u << 10) && e > a)
            (void)madvise((void *)a, e - a, MADV_POPULATE_WRITE);
    }
    #else
    static void gpudash_prefault(void *p, size_t n) { (void)p; (void)n; }
    #endif
    """
    void prefault "gpudash_prefault"(void* p, size_t n) noexcept nogil

cdef char* _FMT_Q = "q"

cdef class Journal:
    """The event journal: a flat int64 array, 8 ints per operation, that reads as the list
    the pure-Python models keep (``len``, indexing, slices as lists, ``extend``, ``count``,
    iteration) and exposes its ints through the buffer protocol (``np.frombuffer``).

    It also counts the events its records expand into beyond one each (an alloc's split, a
    free's merges), so that a batch's events are known without reading it again."""

    cdef int64_t* d
    cdef Py_ssize_t n
    cdef Py_ssize_t cap
    cdef Py_ssize_t more   # events beyond one per whole record
    cdef int exports
    # Records from index `raw` on carry ticks() stamps, not yet time.time_ns() values;
    # (tick0, ns0) is one reading of both clocks taken before any of them.
    cdef Py_ssize_t raw
    cdef int64_t tick0, ns0

    def __cinit__(self, values=None, Py_ssize_t cap=8192):
        self.cap = cap if cap > 8 else 8
        self.n = 0
        self.more = 0
        self.exports = 0
        self.raw = 0
        self.anchor()
        self.d = <int64_t*>PyMem_Malloc(self.cap * sizeof(int64_t))
        if self.d == NULL:
            raise MemoryError()
        prefault(self.d, self.cap * sizeof(int64_t))
        if values is not None:
            self.extend(values)

    def __dealloc__(self):
        PyMem_Free(self.d)

    cdef int grow(self, Py_ssize_t need) except -1:
        cdef Py_ssize_t cap = self.cap
        cdef int64_t* d
        if self.exports:
            raise BufferError("the journal is being read through a buffer")
        while cap < need:
            cap *= 2
        d = <int64_t*>PyMem_Realloc(self.d, cap * sizeof(int64_t))
        if d == NULL:
            raise MemoryError()
        self.d = d
        self.cap = cap
        return 0

    cdef inline void anchor(self) noexcept:
        """Read both clocks, as close together as they can be read."""
        cdef int64_t t0, t1
        if not USE_TSC:
            self.tick0 = self.ns0 = 0
            return
        t0 = tsc()
        self.ns0 = now_ns()
        t1 = tsc()
        self.tick0 = t0 + ((t1 - t0) >> 1)

    cdef void settle(self) noexcept:
        """Turn the stamps of the records from ``raw`` on into time.time_ns() values: each
        placed between the last reading of both clocks and a new one, in proportion to its
        ticks (the counter runs at a constant rate), kept within the two readings and never
        before the record ahead of it. Every read of the records comes through here."""
        cdef Py_ssize_t i
        cdef int64_t tick0 = self.tick0, ns0 = self.ns0, lo = ns0, hi, t
        cdef double scale
        cdef int64_t* d = self.d
        if self.raw >= self.n:
            return
        if not USE_TSC:
            self.raw = self.n
            return
        self.anchor()
        hi = self.ns0
        scale = <double>(hi - ns0) / <double>(self.tick0 - tick0) if self.tick0 > tick0 else 0.0
        # the records that start at or after `raw` (one a Python extend began is its own)
        for i in range((self.raw + 7) & ~(<Py_ssize_t>7), self.n, 8):
            t = d[i] - tick0
            t = ns0 + <int64_t>(<double>t * scale) if t > 0 else ns0
            if t < lo:
                t = lo
            elif t > hi:
                t = hi
            d[i] = lo = t
        self.raw = self.n

    cdef inline int push(self, int64_t code, int64_t ptr, int64_t size,
                         int64_t req, int64_t a, int64_t b, int64_t c,
                         Py_ssize_t extra) except -1:
        """One record, stamped with ticks() (read as time.time_ns() through settle), that
        expands into ``1 + extra`` events: the caller knows whether its alloc split (a != 0)
        and how many neighbours its free merged ((b > 0) + (c > 0)), as more_in counts."""
        cdef int64_t* p
        if self.n + 8 > self.cap:
            self.grow(self.n + 8)
        p = self.d + self.n
        p[0] = ticks()
        p[1] = code
        p[2] = ptr
        p[3] = size
        p[4] = req
        p[5] = a
        p[6] = b
        p[7] = c
        self.n += 8
        self.more += extra
        return 0

    cdef Py_ssize_t more_in(self, Py_ssize_t i, Py_ssize_t stop) noexcept:
        """Events beyond one per record in the whole records from index i (a record's
        start) up to stop."""
        cdef Py_ssize_t m = 0
        cdef int64_t code
        cdef const int64_t* d = self.d
        while i + 8 <= stop:
            code = d[i + 1]
            if code == K_ALLOC:
                m += d[i + 5] != 0
            elif code == K_FREE:
                m += (d[i + 6] > 0) + (d[i + 7] > 0)
            i += 8
        return m

    cdef Py_ssize_t events(self) noexcept:
        """The events the whole records expand into."""
        return (self.n >> 3) + self.more

    def extend(self, values):
        cdef Py_ssize_t k, first
        self.settle()
        k = self.n
        first = k & ~(<Py_ssize_t>7)   # a record extend may complete
        for v in values:
            if k + 1 > self.cap:
                self.n = k
                self.grow(k + 1)
            self.d[k] = v
            k += 1
        self.n = self.raw = k
        self.more += self.more_in(first, k)

    def append(self, value):
        self.extend((value,))

    def __len__(self):
        return self.n

    def __bool__(self):
        return self.n > 0

    def __getitem__(self, idx):
        cdef Py_ssize_t i, start, stop, step, length
        self.settle()
        if isinstance(idx, slice):
            start, stop, step = idx.indices(self.n)
            return [self.d[i] for i in range(start, stop, step)]
        i = idx
        if i < 0:
            i += self.n
        if i < 0 or i >= self.n:
            raise IndexError("journal index out of range")
        return self.d[i]

    def __iter__(self):
        cdef Py_ssize_t i
        self.settle()
        for i in range(self.n):
            yield self.d[i]

    def code_counts(self):
        """How many records of each code (a list indexed by code, 0..8), in one pass."""
        cdef int64_t c[9]
        cdef Py_ssize_t i
        cdef int64_t code
        memset(c, 0, sizeof(c))
        for i in range(1, self.n, 8):
            code = self.d[i]
            if 0 <= code <= 8:
                c[code] += 1
        return [c[i] for i in range(9)]

    def count(self, value):
        cdef Py_ssize_t i, c = 0
        self.settle()
        for i in range(self.n):
            if self.d[i] == value:
                c += 1
        return c

    def tolist(self):
        cdef Py_ssize_t i
        self.settle()
        return [self.d[i] for i in range(self.n)]

    def __eq__(self, other):
        try:
            return self.tolist() == list(other)
        except TypeError:
            return NotImplemented

    def __repr__(self):
        return f"Journal({self.tolist()!r})"

    def __getbuffer__(self, Py_buffer* buf, int flags):
        self.settle()
        buf.buf = <char*>self.d
        buf.obj = self
        buf.len = self.n * sizeof(int64_t)
        buf.readonly = 1
        buf.itemsize = sizeof(int64_t)
        buf.format = _FMT_Q if (flags & PyBUF_FORMAT) else NULL
        buf.ndim = 1
        buf.shape = &self.n if (flags & PyBUF_ND) else NULL
        buf.strides = &buf.itemsize if (flags & PyBUF_STRIDES) == PyBUF_STRIDES else NULL
        buf.suboffsets = NULL
        buf.internal = NULL
        self.exports += 1

    def __releasebuffer__(self, Py_buffer* buf):
        self.exports -= 1


cdef inline Journal as_journal(value):
    """What ``self._journal = value`` stores: None, or a Journal (a list's ints copied; an
    empty one made large enough for a whole batch, so that it never grows)."""
    if value is None or isinstance(value, Journal):
        return value
    if not value:
        return Journal(None, JOURNAL_FLUSH + 64)
    return Journal(value)


# ------------------------------------------------------------------------------ sorted keys
# A sorted set of (a, b, c) keys in blocks of at most SS_CAP, as sortedcontainers keeps a
# list of lists: a search is a binary search over the blocks' last keys, then within one.

cdef struct Key:
    uint64_t a
    uint64_t b
    uint64_t c


cdef enum:
    SS_CAP = 64
    SS_HALF = 32
    SS_LOW = 8
    SS_COPY = 8   # moves of up to this many keys are copied one by one, not by memmove


cdef struct SSet:
    Key** blk
    int* nb
    int nblk
    int cblk
    Py_ssize_t size


cdef extern from *:
    """
    /* (xa, xb, xc) < (ya, yb, yc) without branches: a search's steps go either way at
       random, and a mispredicted branch costs more than a few instructions. (b, c) is
       compared as one 128-bit number where the compiler has them. */
    static inline int gd_key_lt(uint64_t xa, uint64_t xb, uint64_t xc,
                                uint64_t ya, uint64_t yb, uint64_t yc) {
    #if defined(__SIZEOF_INT128__)
        unsigned __int128 x = ((unsigned __int128)xb << 64) | xc;
        unsigned __int128 y = ((unsigned __int128)yb << 64) | yc;
        return (xa < ya) | ((xa == ya) & (x < y));
    #else
        return (xa < ya) | ((xa == ya) & ((xb < yb) | ((xb == yb) & (xc < yc))));
    #endif
    }
    """
    bint gd_key_lt(uint64_t xa, uint64_t xb, uint64_t xc,
                   uint64_t ya, uint64_t yb, uint64_t yc) nogil


cdef inline bint klt(const Key* x, const Key* y) noexcept nogil:
    return gd_key_lt(x.a, x.b, x.c, y.a, y.b, y.c)


cdef inline bint keq(const Key* x, const Key* y) noexcept nogil:
    return x.a == y.a and x.b == y.b and x.c == y.c


cdef int ss_init(SSet* s) except -1:
    s.cblk = 4
    s.blk = <Key**>PyMem_Malloc(s.cblk * sizeof(Key*))
    s.nb = <int*>PyMem_Malloc(s.cblk * sizeof(int))
    if s.blk == NULL or s.nb == NULL:
        raise MemoryError()
    s.blk[0] = <Key*>PyMem_Malloc(SS_CAP * sizeof(Key))
    if s.blk[0] == NULL:
        raise MemoryError()
    s.nb[0] = 0
    s.nblk = 1
    s.size = 0
    return 0


cdef void ss_free(SSet* s) noexcept:
    cdef int i
    if s.blk != NULL:
        for i in range(s.nblk):
            PyMem_Free(s.blk[i])
        PyMem_Free(s.blk)
        PyMem_Free(s.nb)
    s.blk = NULL
    s.nb = NULL
    s.nblk = 0
    s.size = 0


cdef inline int ss_block_for(const SSet* s, const Key* k) noexcept nogil:
    """The first block whose last key is >= k (s.nblk when none)."""
    cdef int lo = 0, hi = s.nblk, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if klt(&s.blk[mid][s.nb[mid] - 1], k):
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline int lb_in(const Key* arr, int n, const Key* k) noexcept nogil:
    """The first index of arr[:n] whose key is >= k (n when none): a binary search whose
    steps are conditional moves, not branches."""
    cdef const Key* base = arr
    cdef int half
    if n == 0:
        return 0
    while n > 1:
        half = n >> 1
        base = base + half if klt(&base[half - 1], k) else base
        n -= half
    return <int>(base - arr) + klt(base, k)


cdef inline bint ss_lower_bound(const SSet* s, const Key* k, int* bi, int* i) noexcept nogil:
    """Position of the first key >= k; False when there is none."""
    cdef int b = 0
    if s.nblk > 1:
        b = ss_block_for(s, k)
        if b == s.nblk:
            return False
    elif s.size == 0 or klt(&s.blk[0][s.nb[0] - 1], k):
        return False
    bi[0] = b
    i[0] = lb_in(s.blk[b], s.nb[b], k)
    return True


cdef inline bint ss_next(const SSet* s, int* bi, int* i) noexcept nogil:
    """Advance a position; False at the end."""
    i[0] += 1
    if i[0] >= s.nb[bi[0]]:
        bi[0] += 1
        i[0] = 0
        if bi[0] >= s.nblk:
            return False
    return True


cdef inline bint ss_prev(const SSet* s, int* bi, int* i) noexcept nogil:
    """Step a position back; False before the start."""
    if i[0] > 0:
        i[0] -= 1
        return True
    if bi[0] == 0:
        return False
    bi[0] -= 1
    i[0] = s.nb[bi[0]] - 1
    return True


cdef inline void keys_up(Key* arr, int i, int n) noexcept nogil:
    """arr[i:n] one place up (to make room at i). A few keys are copied one by one: a
    block's moves are mostly short, and memmove's own dispatch on the length costs more."""
    if n - i > SS_COPY:
        memmove(&arr[i + 1], &arr[i], (n - i) * sizeof(Key))
        return
    while n > i:
        arr[n] = arr[n - 1]
        n -= 1


cdef inline void keys_down(Key* arr, int i, int n) noexcept nogil:
    """arr[i + 1:n] one place down (over the key at i)."""
    if n - i - 1 > SS_COPY:
        memmove(&arr[i], &arr[i + 1], (n - i - 1) * sizeof(Key))
        return
    i += 1
    while i < n:
        arr[i - 1] = arr[i]
        i += 1


cdef int ss_split(SSet* s, int b) except -1:
    cdef Key* nw
    cdef int keep
    if s.nblk == s.cblk:
        s.cblk *= 2
        s.blk = <Key**>PyMem_Realloc(s.blk, s.cblk * sizeof(Key*))
        s.nb = <int*>PyMem_Realloc(s.nb, s.cblk * sizeof(int))
        if s.blk == NULL or s.nb == NULL:
            raise MemoryError()
    nw = <Key*>PyMem_Malloc(SS_CAP * sizeof(Key))
    if nw == NULL:
        raise MemoryError()
    memmove(&s.blk[b + 2], &s.blk[b + 1], (s.nblk - b - 1) * sizeof(Key*))
    memmove(&s.nb[b + 2], &s.nb[b + 1], (s.nblk - b - 1) * sizeof(int))
    keep = s.nb[b] >> 1
    memcpy(nw, &s.blk[b][keep], (s.nb[b] - keep) * sizeof(Key))
    s.blk[b + 1] = nw
    s.nb[b + 1] = s.nb[b] - keep
    s.nb[b] = keep
    s.nblk += 1
    return 0


cdef inline int ss_insert(SSet* s, Key k) except -1:
    cdef int b, i
    cdef Key* arr
    if s.size == 0:
        s.blk[0][0] = k
        s.nb[0] = 1
        s.size = 1
        return 0
    b = 0
    if s.nblk > 1:
        b = ss_block_for(s, &k)
        if b == s.nblk:
            b -= 1
    arr = s.blk[b]
    i = lb_in(arr, s.nb[b], &k)
    keys_up(arr, i, s.nb[b])
    arr[i] = k
    s.nb[b] += 1
    s.size += 1
    if s.nb[b] == SS_CAP:
        ss_split(s, b)
    return 0


cdef inline void ss_erase_at(SSet* s, int b, int i) noexcept:
    keys_down(s.blk[b], i, s.nb[b])
    s.nb[b] -= 1
    s.size -= 1
    if s.nb[b] < SS_LOW and s.nblk > 1:
        ss_sparse(s, b)


cdef void ss_sparse(SSet* s, int b) noexcept:
    """A sparse block joins a neighbour when both fit in half a block (or goes if empty)."""
    cdef Key* arr = s.blk[b]
    cdef int o
    if s.nb[b] == 0:
        PyMem_Free(arr)
        memmove(&s.blk[b], &s.blk[b + 1], (s.nblk - b - 1) * sizeof(Key*))
        memmove(&s.nb[b], &s.nb[b + 1], (s.nblk - b - 1) * sizeof(int))
        s.nblk -= 1
        return
    o = b + 1 if b + 1 < s.nblk else b - 1
    if s.nb[b] + s.nb[o] > SS_HALF:
        return
    if o < b:
        b, o = o, b
    memcpy(&s.blk[b][s.nb[b]], s.blk[o], s.nb[o] * sizeof(Key))
    s.nb[b] += s.nb[o]
    PyMem_Free(s.blk[o])
    memmove(&s.blk[o], &s.blk[o + 1], (s.nblk - o - 1) * sizeof(Key*))
    memmove(&s.nb[o], &s.nb[o + 1], (s.nblk - o - 1) * sizeof(int))
    s.nblk -= 1


cdef bint ss_load(SSet* s, const Key* keys, Py_ssize_t n) noexcept:
    """Make s (not yet initialised) hold n > 0 sorted keys, its blocks filled half way;
    False, s left empty and freed, when the memory for it cannot be had. It raises nothing,
    so that the code around a call stays free of exception handling."""
    cdef Py_ssize_t nblk = (n + SS_HALF - 1) // SS_HALF, j, take
    cdef bint ok
    s.nblk = 0
    s.size = 0
    s.cblk = <int>nblk
    s.blk = <Key**>PyMem_Calloc(nblk, sizeof(Key*))
    s.nb = <int*>PyMem_Calloc(nblk, sizeof(int))
    ok = s.blk != NULL and s.nb != NULL
    j = 0
    while ok and j < nblk:
        s.blk[j] = <Key*>PyMem_Malloc(SS_CAP * sizeof(Key))
        ok = s.blk[j] != NULL
        s.nblk = <int>(j + 1)
        if ok:
            take = n - j * SS_HALF if n - j * SS_HALF < SS_HALF else SS_HALF
            memcpy(s.blk[j], &keys[j * SS_HALF], take * sizeof(Key))
            s.nb[j] = <int>take
        j += 1
    if not ok:
        if s.blk == NULL:
            PyMem_Free(s.nb)
        ss_free(s)
        return False
    s.size = n
    return True


cdef inline bint ss_erase(SSet* s, Key k) noexcept:
    """Remove the key at k's lower bound (as ``del lst[bisect_left(lst, k)]``)."""
    cdef int b, i
    if not ss_lower_bound(s, &k, &b, &i):
        return False
    ss_erase_at(s, b, i)
    return True


cdef inline Key* ss_at(const SSet* s, int b, int i) noexcept nogil:
    return &s.blk[b][i]


cdef inline Key ss_pop_first(SSet* s) noexcept:
    cdef Key k = s.blk[0][0]
    ss_erase_at(s, 0, 0)
    return k


cdef inline Key* ss_last(const SSet* s) noexcept nogil:
    return &s.blk[s.nblk - 1][s.nb[s.nblk - 1] - 1]


# ------------------------------------------------------------------------------ hash map
# uint64 -> int64, open addressing with linear probing and backward-shift deletion; key 0
# has a slot of its own.

cdef struct PMap:
    uint64_t* k
    int64_t* v
    size_t cap
    size_t n
    int shift
    bint has0
    int64_t v0


cdef inline size_t pm_slot(const PMap* m, uint64_t key) noexcept nogil:
    return <size_t>((key * <uint64_t>0x9E3779B97F4A7C15ULL) >> m.shift)


cdef int pm_init(PMap* m, size_t cap) except -1:
    cdef int bits = 3
    while (<size_t>1 << bits) < cap:
        bits += 1
    m.cap = <size_t>1 << bits
    m.shift = 64 - bits
    m.n = 0
    m.has0 = 0
    m.v0 = 0
    m.k = <uint64_t*>PyMem_Calloc(m.cap, sizeof(uint64_t))
    m.v = <int64_t*>PyMem_Malloc(m.cap * sizeof(int64_t))
    if m.k == NULL or m.v == NULL:
        raise MemoryError()
    return 0


cdef void pm_free(PMap* m) noexcept:
    PyMem_Free(m.k)
    PyMem_Free(m.v)
    m.k = NULL
    m.v = NULL
    m.n = 0
    m.has0 = 0


cdef inline bint pm_get(const PMap* m, uint64_t key, int64_t* out) noexcept nogil:
    cdef size_t i, msk
    cdef uint64_t kk
    if key == 0:
        if m.has0:
            out[0] = m.v0
        return m.has0
    msk = m.cap - 1
    i = pm_slot(m, key)
    while True:
        kk = m.k[i]
        if kk == key:
            out[0] = m.v[i]
            return True
        if kk == 0:
            return False
        i = (i + 1) & msk


cdef int pm_grow(PMap* m) except -1:
    cdef uint64_t* ok = m.k
    cdef int64_t* ov = m.v
    cdef size_t ocap = m.cap, j, i, msk
    cdef int bits = 64 - m.shift + 1
    m.cap = ocap * 2
    m.shift = 64 - bits
    m.k = <uint64_t*>PyMem_Calloc(m.cap, sizeof(uint64_t))
    m.v = <int64_t*>PyMem_Malloc(m.cap * sizeof(int64_t))
    if m.k == NULL or m.v == NULL:
        raise MemoryError()
    msk = m.cap - 1
    for j in range(ocap):
        if ok[j] != 0:
            i = pm_slot(m, ok[j])
            while m.k[i] != 0:
                i = (i + 1) & msk
            m.k[i] = ok[j]
            m.v[i] = ov[j]
    PyMem_Free(ok)
    PyMem_Free(ov)
    return 0


cdef inline int pm_put(PMap* m, uint64_t key, int64_t val) except -1:
    cdef size_t i, msk
    if key == 0:
        if not m.has0:
            m.n += 1
        m.has0 = 1
        m.v0 = val
        return 0
    if (m.n + 1) * 2 > m.cap:
        pm_grow(m)
    msk = m.cap - 1
    i = pm_slot(m, key)
    while True:
        if m.k[i] == key:
            m.v[i] = val
            return 0
        if m.k[i] == 0:
            m.k[i] = key
            m.v[i] = val
            m.n += 1
            return 0
        i = (i + 1) & msk


cdef inline bint pm_del(PMap* m, uint64_t key, int64_t* out) noexcept:
    """Remove key (its value in out); False when absent."""
    cdef size_t i, j, h, msk
    if key == 0:
        if not m.has0:
            return False
        out[0] = m.v0
        m.has0 = 0
        m.n -= 1
        return True
    msk = m.cap - 1
    i = pm_slot(m, key)
    while True:
        if m.k[i] == key:
            break
        if m.k[i] == 0:
            return False
        i = (i + 1) & msk
    out[0] = m.v[i]
    m.n -= 1
    # backward shift: move later entries of the run into the hole when their home allows
    j = i
    while True:
        j = (j + 1) & msk
        if m.k[j] == 0:
            break
        h = pm_slot(m, m.k[j])
        if (j > i and (h <= i or h > j)) or (j < i and (h <= i and h > j)):
            m.k[i] = m.k[j]
            m.v[i] = m.v[j]
            i = j
    m.k[i] = 0
    return True


cdef int pm_copy(PMap* dst, const PMap* src) except -1:
    dst.cap = src.cap
    dst.shift = src.shift
    dst.n = src.n
    dst.has0 = src.has0
    dst.v0 = src.v0
    dst.k = <uint64_t*>PyMem_Malloc(src.cap * sizeof(uint64_t))
    dst.v = <int64_t*>PyMem_Malloc(src.cap * sizeof(int64_t))
    if dst.k == NULL or dst.v == NULL:
        raise MemoryError()
    memcpy(dst.k, src.k, src.cap * sizeof(uint64_t))
    memcpy(dst.v, src.v, src.cap * sizeof(int64_t))
    return 0


cdef class KeyMap:
    """A replay's trace key -> pointer map (a dict of ints, in C): ``pop``, ``get``,
    item access, ``len``, ``items``, ``copy``."""

    cdef PMap m

    def __cinit__(self):
        pm_init(&self.m, 64)

    def __dealloc__(self):
        pm_free(&self.m)

    def __len__(self):
        return self.m.n

    def __setitem__(self, key, value):
        pm_put(&self.m, <uint64_t><int64_t>key, <int64_t><uint64_t>value)

    def __getitem__(self, key):
        cdef int64_t v
        if not pm_get(&self.m, <uint64_t><int64_t>key, &v):
            raise KeyError(key)
        return <uint64_t>v

    def __contains__(self, key):
        cdef int64_t v
        return pm_get(&self.m, <uint64_t><int64_t>key, &v)

    def get(self, key, default=None):
        cdef int64_t v
        if not pm_get(&self.m, <uint64_t><int64_t>key, &v):
            return default
        return <uint64_t>v

    def pop(self, key, default=None):
        cdef int64_t v
        if not pm_del(&self.m, <uint64_t><int64_t>key, &v):
            return default
        return <uint64_t>v

    def items(self):
        cdef size_t i
        out = []
        if self.m.has0:
            out.append((0, <uint64_t>self.m.v0))
        for i in range(self.m.cap):
            if self.m.k[i] != 0:
                out.append((<int64_t>self.m.k[i], <uint64_t>self.m.v[i]))
        return out

    def copy(self):
        cdef KeyMap new = KeyMap.__new__(KeyMap)
        pm_free(&new.m)
        pm_copy(&new.m, &self.m)
        return new

    def __repr__(self):
        return f"KeyMap({dict(self.items())!r})"


# ------------------------------------------------------------------------------ expansion
cdef inline int bin_of(int64_t size) noexcept nogil:
    """BinNumForSize: min(floor(log2(max(size, 256) >> 8)), 20)."""
    cdef uint64_t v = <uint64_t>(size if size > 256 else 256) >> 8
    cdef int b = 63 - __builtin_clzll(v)
    return b if b < 20 else 20


cdef Py_ssize_t region_index_of(const int64_t* rp, Py_ssize_t nr,
                                int64_t ptr) noexcept nogil:
    cdef Py_ssize_t lo = 0, hi = nr, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if rp[mid] <= ptr:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


cdef int64_t region_of(const int64_t* rp, const int64_t* re, Py_ssize_t nr,
                       int64_t ptr) noexcept nogil:
    cdef Py_ssize_t lo = 0, hi = nr, mid
    while lo < hi:   # searchsorted(rp, ptr, side="right")
        mid = (lo + hi) >> 1
        if rp[mid] <= ptr:
            lo = mid + 1
        else:
            hi = mid
    lo -= 1
    if lo >= 0 and ptr < re[lo]:
        return rp[lo]
    return 0


def count_journal_events(journal, Py_ssize_t start=0, end=None):
    """``_eventsource.count_events`` over a Journal, in C (anything else goes to it)."""
    cdef Journal j
    cdef Py_ssize_t stop
    if not isinstance(journal, Journal):
        return _eventsource.count_events(journal, start, end)
    j = journal
    if start < 0 or start & 7:
        raise ValueError(f"start must be a record's first index; got {start}")
    if start == 0 and end is None:
        return j.events()
    stop = j.n if end is None else min(<Py_ssize_t>end, j.n)
    if stop > start:   # the whole records that start before stop
        stop = min(start + ((stop - start + 7) & ~(<Py_ssize_t>7)), j.n & ~(<Py_ssize_t>7))
    return ((stop - start) >> 3) + j.more_in(start, stop) if stop > start else 0


def keep_journal(journal, Py_ssize_t pos):
    """A flushed journal as a ``JournalBatch`` keeps it, and the events of its records from
    ``pos`` on: the Journal itself when at least half of its buffer is used (a full batch),
    else a compact int64 copy (a flush of a few operations must not hold a whole batch's
    buffer)."""
    cdef Journal j
    if not isinstance(journal, Journal):
        return _eventsource.EventSource._keep_journal(journal, pos)
    j = journal
    n = count_journal_events(j, pos)
    if 2 * j.n >= j.cap:
        return j, n
    return np.frombuffer(j, dtype=np.int64).copy(), n


def expand_journal(journal, int64_t seq0, int64_t next_aid, region_ptrs, region_ends,
                   int device):
    """``_eventsource.expand_records`` over a journal, in C: the same columns."""
    cdef const int64_t[::1] recs
    if isinstance(journal, Journal):
        recs = np.frombuffer(journal, dtype=np.int64)
    else:
        recs = np.asarray(journal, dtype=np.int64)
    cdef Py_ssize_t nrec = recs.shape[0] // 8, r, j, total = 0, nr, nrel = 0, k = 0
    cdef int64_t code, n_alloc = 0
    cdef const int64_t* R = &recs[0] if recs.shape[0] else NULL
    cdef const int64_t* q
    for r in range(nrec):
        code = R[8 * r + 1]
        if code == K_ALLOC:
            total += 2 if R[8 * r + 5] > 0 else 1
            n_alloc += 1
        elif code == K_FREE:
            total += 1 + (R[8 * r + 6] > 0) + (R[8 * r + 7] > 0)
        else:
            total += 1
            nrel += code == K_RELEASE
    cdef int64_t[::1] rpv = np.ascontiguousarray(region_ptrs, dtype=np.int64).reshape(-1)
    cdef int64_t[::1] rev = np.ascontiguousarray(region_ends, dtype=np.int64).reshape(-1)
    nr = rpv.shape[0]
    cdef const int64_t* rp = &rpv[0] if nr else NULL
    cdef const int64_t* re = &rev[0] if nr else NULL
    cdef Py_ssize_t[::1] relv = np.empty(nrel + 1, dtype=np.intp)
    cdef Py_ssize_t* rel = &relv[0]
    nrel = 0
    for r in range(nrec):
        if R[8 * r + 1] == K_RELEASE:
            rel[nrel] = r
            nrel += 1
    seq_a = np.arange(seq0, seq0 + total, dtype=np.int64)
    time_a = np.empty(total, dtype=np.int64)
    kind_a = np.empty(total, dtype=np.int8)
    ptr_a = np.empty(total, dtype=np.int64)
    size_a = np.empty(total, dtype=np.int64)
    req_a = np.empty(total, dtype=np.int64)
    bin_a = np.empty(total, dtype=np.int8)
    reg_a = np.empty(total, dtype=np.int64)
    aid_a = np.empty(total, dtype=np.int64)
    dev_a = np.full(total, device, dtype=np.int16)
    if total == 0:
        return {"seq": seq_a, "time_ns": time_a, "kind": kind_a, "ptr": ptr_a,
                "size": size_a, "requested": req_a, "bin": bin_a, "region": reg_a,
                "alloc_id": aid_a, "device": dev_a}
    cdef int64_t[::1] Tv = time_a, Pv = ptr_a, Sv = size_a, Qv = req_a, Gv = reg_a, Av = aid_a
    cdef int8_t[::1] Kv = kind_a, Bv = bin_a
    cdef int64_t* T = &Tv[0]
    cdef int64_t* P = &Pv[0]
    cdef int64_t* S = &Sv[0]
    cdef int64_t* Q = &Qv[0]
    cdef int64_t* G = &Gv[0]
    cdef int64_t* A = &Av[0]
    cdef int8_t* K = &Kv[0]
    cdef int8_t* B = &Bv[0]
    cdef int64_t t, ptr, size, req, a, b, c, rg, rs, rl, aid = next_aid - n_alloc
    cdef int64_t lo_hit = 0, hi_hit = 0, at_hit = 0   # the last region found (a cache)
    cdef Py_ssize_t e = 0
    for r in range(nrec):
        q = R + 8 * r
        t = q[0]
        code = q[1]
        ptr = q[2]
        size = q[3]
        req = q[4]
        a = q[5]
        b = q[6]
        c = q[7]
        if code == K_ALLOC or code == K_FREE:
            # the region table now, or the first release after the record covering it
            if ptr >= lo_hit and ptr < hi_hit:
                rg = at_hit
            else:
                rg = 0
                if nr:
                    j = region_index_of(rp, nr, ptr)
                    if j >= 0 and ptr < re[j]:
                        rg = lo_hit = at_hit = rp[j]
                        hi_hit = re[j]
            if nrel:
                while k < nrel and rel[k] <= r:
                    k += 1
                for j in range(k, nrel):
                    rs = R[8 * rel[j] + 2]
                    rl = R[8 * rel[j] + 3]
                    if ptr >= rs and ptr < rs + rl:
                        rg = rs
                        break
            if code == K_ALLOC:
                if a > 0:
                    T[e] = t; K[e] = K_SPLIT; P[e] = ptr + size; S[e] = a; Q[e] = size
                    B[e] = bin_of(a); G[e] = rg; A[e] = -1
                    e += 1
                T[e] = t; K[e] = K_ALLOC; P[e] = ptr; S[e] = size; Q[e] = req
                B[e] = bin_of(size); G[e] = rg; A[e] = aid
                aid += 1
                e += 1
            else:
                T[e] = t; K[e] = K_FREE; P[e] = ptr; S[e] = size; Q[e] = req
                B[e] = bin_of(size); G[e] = rg; A[e] = a
                e += 1
                if b > 0:
                    T[e] = t; K[e] = K_MERGE; P[e] = ptr; S[e] = size + b; Q[e] = b
                    B[e] = -1; G[e] = rg; A[e] = -1
                    e += 1
                if c > 0:
                    T[e] = t; K[e] = K_MERGE; P[e] = ptr - c; S[e] = c + size + b
                    Q[e] = size + b; B[e] = -1; G[e] = rg; A[e] = -1
                    e += 1
        else:
            T[e] = t; K[e] = <int8_t>code; P[e] = ptr; S[e] = size; Q[e] = req
            B[e] = bin_of(size) if (code == K_OOM or code == K_SPLIT) else -1
            G[e] = ptr if (code == K_EXTEND or code == K_RELEASE) else 0
            A[e] = -1
            e += 1
    return {"seq": seq_a, "time_ns": time_a, "kind": kind_a, "ptr": ptr_a, "size": size_a,
            "requested": req_a, "bin": bin_a, "region": reg_a, "alloc_id": aid_a,
            "device": dev_a}
