# A simulated device's live blocks and its first-fit placement, in C: the table behind
# gpudash.devices.SimulatedDevice on the compiled path. The readable reference is
# gpudash.devices._FirstFitTable; tests/test_core_diff.py holds the two to the same
# addresses. The compiled PyTorch model places each new segment here without Python
# (CachingCore.placement). Included by _core.pyx.

# addresses stay below this (gpudash.devices.ADDRESS_END)
cdef int64_t FF_ADDRESS_END = (<int64_t>1) << 62


cdef inline int64_t ff_align_up(int64_t x, int64_t alignment) noexcept nogil:
    return (x + alignment - 1) & -alignment


cdef class FirstFit:
    """``_FirstFitTable`` in C: blocks sorted by address in two arrays, the first-fit scan's
    summary (widest gap, end) kept while the blocks stay as they were. Every method runs
    with the GIL held and calls no Python, so each is atomic."""

    cdef int64_t* ptrs
    cdef int64_t* sizes
    cdef Py_ssize_t n, cap
    cdef readonly int64_t first, alignment, used, version, placed, removed
    cdef public int64_t limit, extra
    cdef int64_t fit_version, fit_widest, fit_end   # fit_version -1: no summary

    def __cinit__(self, first, alignment, limit):
        self.first = first
        self.alignment = alignment
        self.limit = limit
        self.fit_version = -1
        self.cap = 16
        self.ptrs = <int64_t*>PyMem_Malloc(self.cap * sizeof(int64_t))
        self.sizes = <int64_t*>PyMem_Malloc(self.cap * sizeof(int64_t))
        if self.ptrs == NULL or self.sizes == NULL:
            raise MemoryError()

    def __dealloc__(self):
        PyMem_Free(self.ptrs)
        PyMem_Free(self.sizes)

    cdef inline Py_ssize_t lower(self, int64_t p) noexcept:
        """The index of the first block at or after address p (n when none)."""
        cdef Py_ssize_t lo = 0, hi = self.n, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if self.ptrs[mid] < p:
                lo = mid + 1
            else:
                hi = mid
        return lo

    cdef int insert(self, int64_t p, int64_t nbytes) except -1:
        """``add``: a block at p (bisect.insort after any block at the same address)."""
        cdef Py_ssize_t i, cap
        cdef int64_t* np_
        cdef int64_t* ns
        if self.n == self.cap:
            cap = self.cap * 2
            np_ = <int64_t*>PyMem_Realloc(self.ptrs, cap * sizeof(int64_t))
            if np_ == NULL:
                raise MemoryError()
            self.ptrs = np_
            ns = <int64_t*>PyMem_Realloc(self.sizes, cap * sizeof(int64_t))
            if ns == NULL:
                raise MemoryError()
            self.sizes = ns
            self.cap = cap
        i = self.lower(p + 1) if p < INT64_MAX else self.n
        memmove(&self.ptrs[i + 1], &self.ptrs[i], (self.n - i) * sizeof(int64_t))
        memmove(&self.sizes[i + 1], &self.sizes[i], (self.n - i) * sizeof(int64_t))
        self.ptrs[i] = p
        self.sizes[i] = nbytes
        self.n += 1
        self.used += nbytes
        self.version += 1
        return 0

    cdef void survey(self) noexcept:
        """The first-fit scan over every block: the widest gap and the end."""
        cdef int64_t cursor = self.first, widest = 0, e
        cdef Py_ssize_t i
        for i in range(self.n):
            if self.ptrs[i] - cursor > widest:
                widest = self.ptrs[i] - cursor
            e = ff_align_up(self.ptrs[i] + self.sizes[i], self.alignment)
            if e > cursor:
                cursor = e
        self.fit_version = self.version
        self.fit_widest = widest
        self.fit_end = cursor

    cdef int64_t c_place(self, int64_t nbytes) except -1:
        """``place`` of nbytes > 0: the new block's address; 0 when it does not fit."""
        cdef int64_t cursor, e
        cdef Py_ssize_t i
        if self.used + self.extra + nbytes > self.limit:
            return 0
        if self.fit_version != self.version:
            self.survey()
        if nbytes > self.fit_widest:
            # no gap is wide enough: the first fit is past the last block
            cursor = self.fit_end
            if cursor + nbytes > FF_ADDRESS_END:
                return 0
            self.insert(cursor, nbytes)
            self.fit_version = self.version
            self.fit_end = ff_align_up(cursor + nbytes, self.alignment)
        else:
            cursor = self.first
            for i in range(self.n):
                if self.ptrs[i] - cursor >= nbytes:
                    break
                e = ff_align_up(self.ptrs[i] + self.sizes[i], self.alignment)
                if e > cursor:
                    cursor = e
            self.insert(cursor, nbytes)
        self.placed += 1
        return cursor

    cdef int c_remove(self, int64_t p, int64_t nbytes) noexcept:
        """``remove`` of a live block of exactly nbytes at p: 1; 0 (nothing changed) when
        there is none, for the Python method to say why."""
        cdef Py_ssize_t i = self.lower(p)
        if i == self.n or self.ptrs[i] != p or self.sizes[i] != nbytes:
            return 0
        memmove(&self.ptrs[i], &self.ptrs[i + 1], (self.n - i - 1) * sizeof(int64_t))
        memmove(&self.sizes[i], &self.sizes[i + 1], (self.n - i - 1) * sizeof(int64_t))
        self.n -= 1
        self.used -= nbytes
        self.version += 1
        self.removed += 1
        return 1

    def place(self, nbytes):
        if nbytes > INT64_MAX:
            return 0
        return self.c_place(nbytes)

    def add(self, ptr, nbytes):
        self.insert(ptr, nbytes)

    def remove(self, owner, ptr, nbytes):
        cdef Py_ssize_t i
        p = int(ptr) if isinstance(ptr, _Integral) else None
        size = None
        if p is not None and 0 <= p <= INT64_MAX:
            i = self.lower(p)
            if i < self.n and self.ptrs[i] == p:
                size = self.sizes[i]
        if size is None:
            shown = f"{ptr:#x}" if p is not None else repr(ptr)
            raise InvalidPointerError(
                f"{owner}: free of {shown}, which is not a live block of this device "
                "(never allocated here, or already freed)")
        if size != nbytes:
            raise ValueError(
                f"{owner}: free of {ptr:#x} with nbytes={nbytes}, but the block was "
                f"allocated with {size} bytes")
        self.c_remove(p, size)

    def items(self):
        cdef Py_ssize_t i
        return [(self.ptrs[i], self.sizes[i]) for i in range(self.n)]

    def clear(self):
        self.n = 0
        self.used = 0
        self.version += 1

    def __len__(self):
        return self.n

