# TensorFlow's BFC allocator: the state of gpudash.bfc.BFCAllocator in C arrays, and every
# operation that changes it. Included by _core.pyx; gpudash.bfc.PyBFCAllocator is the
# reference it is held to, decision for decision.

cdef struct Chunk:
    uint64_t ptr
    int64_t size
    int64_t requested
    int64_t aid          # -1: free
    int32_t prev         # handles; -1: none
    int32_t next
    int32_t bin          # the bin a free chunk sits in; -1 in use
    int32_t pad
    uint64_t region      # the region's address (0: none)


cdef struct Region:
    uint64_t ptr
    int64_t size
    int32_t first


cdef enum:
    NUM_BINS = 21


cdef inline int64_t rounded_bytes(int64_t n) noexcept nogil:
    return (n + 255) & ~(<int64_t>255)


cdef class BFCCore:
    """The compiled state and operations of :class:`gpudash.bfc.BFCAllocator`."""

    cdef Chunk* ch
    cdef int32_t nh
    cdef int32_t cap_h
    cdef int32_t* spare
    cdef int32_t nspare
    cdef int32_t cap_spare
    cdef SSet bins[21]
    cdef uint32_t mask
    cdef PMap byptr
    cdef Region* regs
    cdef int32_t nreg
    cdef int32_t cap_reg
    cdef int64_t curr_base      # _curr_region = curr_base << curr_shift
    cdef int curr_shift
    cdef uint64_t version       # bumped by every change of chunks or regions
    cdef object mat             # the Python view of the state at `version`
    cdef Journal jr
    cdef readonly Lock _lock
    cdef public int64_t _limit, _max_frag, _pool, _next_aid, _num_allocs, _in_use, _peak
    cdef public int64_t _largest, _peak_pool, _failure_logs, _waiters, _flush_at, _limit_floor
    cdef public bint _started_backpedal, _capped, _allow_growth, _gc
    cdef public double _retry_timeout, _frag_fraction
    cdef public object _sub, _name, _cond
    cdef bint py_extend         # a subclass has its own _extend (session's cuda_malloc)

    def __cinit__(self, *args, **kwargs):
        cdef int b
        self._lock = Lock()
        self.cap_h = 64
        self.ch = <Chunk*>PyMem_Malloc(self.cap_h * sizeof(Chunk))
        self.cap_spare = 64
        self.spare = <int32_t*>PyMem_Malloc(self.cap_spare * sizeof(int32_t))
        self.cap_reg = 8
        self.regs = <Region*>PyMem_Malloc(self.cap_reg * sizeof(Region))
        if self.ch == NULL or self.spare == NULL or self.regs == NULL:
            raise MemoryError()
        for b in range(NUM_BINS):
            ss_init(&self.bins[b])
        pm_init(&self.byptr, 64)
        self._flush_at = JOURNAL_FLUSH
        self._next_aid = 1

    def __dealloc__(self):
        cdef int b
        PyMem_Free(self.ch)
        PyMem_Free(self.spare)
        PyMem_Free(self.regs)
        for b in range(NUM_BINS):
            ss_free(&self.bins[b])
        pm_free(&self.byptr)

    def _init_state(self):
        """The empty state (the C arrays are made with the object); the condition on the
        lock that waiting allocations use."""
        self._cond = threading.Condition(self._lock)
        self._waiters = 0
        self.py_extend = type(self)._extend is not BFCCore._extend

    # ------------------------------------------------------------------ attributes
    @property
    def _journal(self):
        return self.jr

    @_journal.setter
    def _journal(self, value):
        self.jr = as_journal(value)

    @property
    def _curr_region(self):
        return (<object>self.curr_base) << self.curr_shift

    @_curr_region.setter
    def _curr_region(self, value):
        value = int(value)
        shift = 0
        while value >= (1 << 62) and not value & 1:
            value >>= 1
            shift += 1
        self.curr_base = value
        self.curr_shift = shift

    @property
    def _mask(self):
        return self.mask

    @property
    def _n_handles(self):
        return self.nh

    @property
    def _regions(self):
        return self.view()[1]

    @property
    def _by_ptr(self):
        return self.view()[2]

    @property
    def _bins(self):
        return self.view()[3]

    @property
    def _spare(self):
        return self.view()[4]

    @property
    def _region_ptrs(self):
        return self.view()[5]

    cdef object rec(self, dict made, int32_t h):
        o = made.get(h)
        if o is None:
            o = made[h] = _PyChunk(h)
            o.ptr = self.ch[h].ptr
            o.size = self.ch[h].size
            o.requested = self.ch[h].requested
            o.aid = self.ch[h].aid
            o.bin = self.ch[h].bin
        return o

    cdef object view(self):
        """The state as the pure-Python model keeps it (``_Chunk``/``_Region`` records, the
        address table, the bins' key lists), made once per change: for the readers the two
        models share (snapshot, memory log, check)."""
        cdef int32_t h, r, c
        cdef int b, bi, i
        cdef size_t j
        cdef Key* k
        if self.mat is not None and self.mat[0] == self.version:
            return self.mat
        made = {}
        regions = []
        for r in range(self.nreg):
            reg = _PyRegion(self.regs[r].ptr, self.regs[r].size)
            c = self.regs[r].first
            if c >= 0:
                reg.first = self.rec(made, c)
            while c >= 0:
                self.rec(made, c).region = reg
                c = self.ch[c].next
            regions.append(reg)
        by_ptr = {}
        if self.byptr.has0:
            by_ptr[0] = self.rec(made, <int32_t>self.byptr.v0)
        for j in range(self.byptr.cap):
            if self.byptr.k[j] != 0:
                by_ptr[self.byptr.k[j]] = self.rec(made, <int32_t>self.byptr.v[j])
        for hh, o in list(made.items()):
            h = hh
            if self.ch[h].prev >= 0:
                o.prev = self.rec(made, self.ch[h].prev)
            if self.ch[h].next >= 0:
                o.next = self.rec(made, self.ch[h].next)
        bins = []
        for b in range(NUM_BINS):
            keys = []
            for bi in range(self.bins[b].nblk):
                for i in range(self.bins[b].nb[bi]):
                    k = &self.bins[b].blk[bi][i]
                    keys.append(((<object>k.b) << 64) | k.c)
            bins.append(keys)
        spare = []
        for i in range(self.nspare):
            o = _PyChunk(self.spare[i])
            spare.append(o)
        self.mat = (self.version, regions, by_ptr, bins, spare, [rg.ptr for rg in regions])
        return self.mat

    # ------------------------------------------------------------------ chunks
    cdef inline int32_t new_handle(self) except -1:
        """AllocateChunk: the most recently deleted handle, else a new one."""
        cdef Chunk* nc
        if self.nspare:
            self.nspare -= 1
            return self.spare[self.nspare]
        if self.nh == self.cap_h:
            nc = <Chunk*>PyMem_Realloc(self.ch, 2 * self.cap_h * sizeof(Chunk))
            if nc == NULL:
                raise MemoryError()
            self.ch = nc
            self.cap_h *= 2
        self.ch[self.nh].requested = 0
        self.ch[self.nh].aid = -1
        self.ch[self.nh].bin = -1
        self.ch[self.nh].prev = -1
        self.ch[self.nh].next = -1
        self.ch[self.nh].region = 0
        self.nh += 1
        return self.nh - 1

    cdef inline int delete_chunk(self, int32_t h) except -1:
        """DeleteChunk: forget the address, recycle the handle."""
        cdef int64_t v
        cdef int32_t* ns
        pm_del(&self.byptr, self.ch[h].ptr, &v)
        self.ch[h].aid = -1
        self.ch[h].bin = -1
        self.ch[h].prev = -1
        self.ch[h].next = -1
        self.ch[h].region = 0
        if self.nspare == self.cap_spare:
            ns = <int32_t*>PyMem_Realloc(self.spare, 2 * self.cap_spare * sizeof(int32_t))
            if ns == NULL:
                raise MemoryError()
            self.spare = ns
            self.cap_spare *= 2
        self.spare[self.nspare] = h
        self.nspare += 1
        return 0

    cdef inline int insert_free(self, int32_t h) except -1:
        cdef Chunk* c = &self.ch[h]
        cdef int b = bin_of(c.size)
        cdef Key k
        c.bin = b
        k.a = 0
        k.b = <uint64_t>c.size
        k.c = c.ptr
        ss_insert(&self.bins[b], k)
        self.mask |= (<uint32_t>1) << b
        return 0

    cdef inline void remove_free(self, int32_t h) noexcept:
        cdef Chunk* c = &self.ch[h]
        cdef int b = c.bin
        cdef Key k
        k.a = 0
        k.b = <uint64_t>c.size
        k.c = c.ptr
        ss_erase(&self.bins[b], k)
        if self.bins[b].size == 0:
            self.mask ^= (<uint32_t>1) << b
        c.bin = -1

    cdef inline int32_t region_index(self, uint64_t ptr) noexcept:
        """The region holding ``ptr`` (-1: none)."""
        cdef int32_t lo = 0, hi = self.nreg, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if self.regs[mid].ptr <= ptr:
                lo = mid + 1
            else:
                hi = mid
        lo -= 1
        if lo >= 0 and ptr < self.regs[lo].ptr + <uint64_t>self.regs[lo].size:
            return lo
        return -1

    cdef inline int64_t largest_free(self) noexcept:
        if not self.mask:
            return 0
        return <int64_t>ss_last(&self.bins[31 - __builtin_clz(self.mask)]).b

    # ------------------------------------------------------------------ allocate
    cdef uint64_t take(self, int64_t nbytes, int64_t rounded, int b) except? 1:
        """FindChunkPtr: best fit from bin b upwards, the split rule; 0 if none fits."""
        cdef uint32_t m
        cdef int nb, bi, i, rb
        cdef Key key, want
        cdef int64_t size, remainder = 0, v = 0, in_use
        cdef uint64_t ptr, rest
        cdef int32_t h, new, nbr
        cdef Chunk* c
        cdef Chunk* n
        if self._capped and self._in_use + rounded > self._limit:
            return 0
        m = self.mask >> b
        if not m:
            return 0
        if m & 1:
            want.a = 0
            want.b = <uint64_t>rounded
            want.c = 0
            if ss_lower_bound(&self.bins[b], &want, &bi, &i):
                key = self.bins[b].blk[bi][i]
                ss_erase_at(&self.bins[b], bi, i)
                if self.bins[b].size == 0:
                    self.mask ^= (<uint32_t>1) << b
            else:
                m ^= 1
                if not m:
                    return 0
                nb = b + __builtin_ctz(m)
                key = ss_pop_first(&self.bins[nb])
                if self.bins[nb].size == 0:
                    self.mask ^= (<uint32_t>1) << nb
        else:
            nb = b + __builtin_ctz(m)
            key = ss_pop_first(&self.bins[nb])
            if self.bins[nb].size == 0:
                self.mask ^= (<uint32_t>1) << nb
        self.version += 1
        ptr = key.c
        pm_get(&self.byptr, ptr, &v)
        h = <int32_t>v
        size = <int64_t>key.b
        if <uint64_t>size >= (<uint64_t>rounded) << 1 or size - rounded >= self._max_frag:
            # SplitChunk: the rest becomes a free chunk after this one
            remainder = size - rounded
            new = self.new_handle()
            c = &self.ch[h]
            n = &self.ch[new]
            rest = ptr + <uint64_t>rounded
            n.ptr = rest
            n.size = remainder
            n.region = c.region
            pm_put(&self.byptr, rest, new)
            nbr = c.next
            n.prev = h
            n.next = nbr
            c.next = new
            if nbr >= 0:
                self.ch[nbr].prev = new
            rb = bin_of(remainder)
            n.bin = rb
            key.b = <uint64_t>remainder
            key.c = rest
            ss_insert(&self.bins[rb], key)
            self.mask |= (<uint32_t>1) << rb
            c.size = size = rounded
        c = &self.ch[h]
        c.requested = nbytes
        c.aid = self._next_aid
        self._next_aid += 1
        c.bin = -1
        self._num_allocs += 1
        in_use = self._in_use = self._in_use + size
        if in_use > self._peak:
            self._peak = in_use
        if size > self._largest:
            self._largest = size
        if self.jr is not None:
            self.jr.push(K_ALLOC, <int64_t>ptr, size, nbytes, remainder, 0, 0, remainder != 0)
        return ptr

    cdef uint64_t allocate_slow(self, int64_t nbytes, int64_t rounded, int b) except? 1:
        """AllocateRawInternal after the first FindChunkPtr missed (lock held)."""
        cdef uint64_t ptr
        if self.grow(rounded):
            ptr = self.take(nbytes, rounded, b)
            if ptr:
                return ptr
        if self._gc and self.deallocate_free_regions(rounded) and self.grow(rounded):
            ptr = self.take(nbytes, rounded, b)
            if ptr:
                return ptr
        return 0

    cdef inline int check_size(self, object nbytes, int64_t* out) except -1:
        """An allocation size: 1 for a size to serve (in out), 0 for 0 bytes, 2 for one above
        MAX_ALLOCATION; TypeError/ValueError as the pure model raises them."""
        cdef int overflow = 0
        cdef long long n
        if type(nbytes) is not int:
            nbytes = _coerce_size(nbytes)
        n = PyLong_AsLongLongAndOverflow(nbytes, &overflow)
        if overflow > 0:
            return 2
        if overflow < 0 or n < 0:
            raise _negative_size(nbytes)
        if n == 0:
            return 0
        if n > MAX_ALLOCATION:
            return 2
        out[0] = n
        return 1

    def allocate(self, nbytes):
        cdef int64_t n, rounded, start = 0
        cdef int b, kind
        cdef uint64_t ptr
        cdef Lock lk = self._lock
        cdef bint listening, ok = False
        kind = self.check_size(nbytes, &n)
        if kind != 1:
            if kind == 0:
                return 0
            raise self._too_large(nbytes)
        rounded = (n + 255) & ~(<int64_t>255)
        b = bin_of(rounded)
        lk.take()
        try:
            listening = self.jr is not None
            if listening:
                start = self.jr.n
            ptr = self.take(n, rounded, b)
            if ptr:
                if listening and start >= self._flush_at:
                    self._after_op(start)
                ok = True
            else:
                ptr = self.allocate_slow(n, rounded, b)
                exc = None if ptr or self._retry_timeout else self._oom_locked(n, rounded)
                if listening:
                    self._after_op(start)
        finally:
            lk.give()
        if ok or ptr:
            return ptr
        if exc is not None:
            raise exc
        return self._retry(n, rounded, b)

    cdef uint64_t c_try_allocate(self, object nbytes, bint record_oom) except? 1:
        cdef int64_t n
        if self.check_size(nbytes, &n) != 1:
            return 0
        return self.try_alloc_n(n, record_oom)

    cdef uint64_t try_alloc_n(self, int64_t n, bint record_oom) except? 1:
        """try_allocate of n > 0 bytes (n <= MAX_ALLOCATION)."""
        cdef int64_t rounded, start = 0
        cdef int b
        cdef uint64_t ptr
        cdef Lock lk = self._lock
        cdef bint listening
        rounded = (n + 255) & ~(<int64_t>255)
        b = bin_of(rounded)
        lk.take()
        try:
            listening = self.jr is not None
            if listening:
                start = self.jr.n
            ptr = self.take(n, rounded, b)
            if not ptr:
                ptr = self.allocate_slow(n, rounded, b)
            if listening:
                if not ptr and record_oom:
                    self.jr.push(K_OOM, 0, rounded, n, 0, 0, 0, 0)
                if self._flush_at == 0 or self.jr.n >= JOURNAL_FLUSH:
                    self._after_op(start)
        finally:
            lk.give()
        return ptr

    cdef uint64_t replay_alloc(self, int64_t n, bint record_oom) except? 1:
        """try_allocate(n, record_oom) for a replay's int64 size."""
        if n <= 0:
            if n == 0:
                return 0
            raise _negative_size(n)
        if n > MAX_ALLOCATION:
            return 0
        return self.try_alloc_n(n, record_oom)

    cdef int replay_free(self, uint64_t p) except -1:
        """deallocate(p) for a replay's pointer (0: nothing)."""
        cdef int64_t v
        cdef Lock lk
        if p == 0:
            return 0
        lk = self._lock
        lk.take()
        try:
            if not pm_get(&self.byptr, p, &v) or self.ch[v].aid < 0:
                raise self._invalid_pointer(p, "deallocate")
            self.free_locked(p, <int32_t>v)
            if self._waiters:
                self._cond.notify_all()
        finally:
            lk.give()
        return 0

    def try_allocate(self, nbytes, record_oom=False):
        return self.c_try_allocate(nbytes, record_oom)

    def _take(self, nbytes, rounded, b):
        return self.take(nbytes, rounded, b)

    def _allocate_slow(self, nbytes, rounded, b):
        return self.allocate_slow(nbytes, rounded, b)

    # ------------------------------------------------------------------ deallocate
    cdef int free_locked(self, uint64_t ptr, int32_t h) except -1:
        """FreeAndMaybeCoalesce: the next chunk merged first, then the previous one."""
        cdef Chunk* c = &self.ch[h]
        cdef int64_t freed, size, aid, requested, next_size = 0, prev_size = 0, start
        cdef int32_t n, p, nn
        cdef Py_ssize_t merged = 0   # neighbours merged: the free's events beyond one
        cdef int b
        cdef Key k
        freed = size = c.size
        self._in_use -= size
        aid = c.aid
        requested = c.requested
        c.aid = -1
        self.version += 1
        n = c.next
        if n >= 0 and self.ch[n].aid < 0:
            next_size = self.ch[n].size
            self.remove_free(n)
            nn = c.next = self.ch[n].next
            if nn >= 0:
                self.ch[nn].prev = h
            size += next_size
            self.delete_chunk(n)
            merged = 1
        p = c.prev
        if p >= 0 and self.ch[p].aid < 0:
            prev_size = self.ch[p].size
            self.remove_free(p)
            nn = self.ch[p].next = c.next
            if nn >= 0:
                self.ch[nn].prev = p
            size += prev_size
            self.delete_chunk(h)
            h = p
            merged += 1
        c = &self.ch[h]
        c.size = size
        b = bin_of(size)
        c.bin = b
        k.a = 0
        k.b = <uint64_t>size
        k.c = c.ptr
        ss_insert(&self.bins[b], k)
        self.mask |= (<uint32_t>1) << b
        if self.jr is not None:
            start = self.jr.n
            self.jr.push(K_FREE, <int64_t>ptr, freed, requested, aid, next_size,
                         prev_size, merged)
            if self._capped and c.prev < 0 and c.next < 0:
                self.release_region(self.region_index(c.ptr))
            if start >= self._flush_at:
                self._after_op(start)
        elif self._capped and c.prev < 0 and c.next < 0:
            self.release_region(self.region_index(c.ptr))
        return 0

    cdef inline int32_t live_handle(self, object ptr) except -2:
        """The handle of the live allocation at ``ptr``; -1 when there is none."""
        cdef int64_t v
        cdef uint64_t p
        if type(ptr) is not int:
            ptr = _pointer_or_none(ptr)
            if ptr is None:
                return -1
        p = as_address(ptr)
        if p == 0 or not pm_get(&self.byptr, p, &v) or self.ch[v].aid < 0:
            return -1
        return <int32_t>v

    cdef int c_deallocate(self, object ptr) except -1:
        cdef int32_t h
        cdef Lock lk
        cdef uint64_t p
        cdef int64_t v
        if type(ptr) is not int:
            return self.deallocate_odd(ptr)
        p = as_address(ptr)
        if p == 0:
            return self.deallocate_odd(ptr)
        lk = self._lock
        lk.take()
        try:
            if not pm_get(&self.byptr, p, &v) or self.ch[v].aid < 0:
                raise self._invalid_pointer(ptr, "deallocate")
            self.free_locked(p, <int32_t>v)
            if self._waiters:
                self._cond.notify_all()
        finally:
            lk.give()
        return 0

    cdef int deallocate_odd(self, object ptr) except -1:
        """deallocate of anything but a positive int below 2**64."""
        cdef int32_t h
        cdef Lock lk
        if not ptr:
            if not isinstance(ptr, bool) and isinstance(ptr, (int, np.integer)):
                return 0
            raise InvalidPointerError(
                f"{self._name}: deallocate() expects an int address; got {ptr!r}")
        lk = self._lock
        lk.take()
        try:
            h = self.live_handle(ptr)
            if h < 0:
                raise self._invalid_pointer(ptr, "deallocate")
            self.free_locked(self.ch[h].ptr, h)
            if self._waiters:
                self._cond.notify_all()
        finally:
            lk.give()
        return 0

    def deallocate(self, ptr):
        self.c_deallocate(ptr)

    def _deallocate_batch(self, ptrs):
        cdef int32_t h
        cdef Lock lk
        failed = []
        cls = type(self)
        if cls.deallocate is not BFCCore.deallocate or "deallocate" in self.__dict__:
            for ptr in ptrs:   # a subclass's (or a wrapper's) own rules
                try:
                    self.deallocate(ptr)
                except InvalidPointerError as exc:
                    failed.append(str(exc))
            return failed
        lk = self._lock
        lk.take()
        try:
            for ptr in ptrs:
                if type(ptr) is not int:
                    ptr = _pointer_or_none(ptr)
                h = self.live_handle(ptr)
                if h < 0:
                    failed.append(str(self._invalid_pointer(ptr, "deallocate")))
                    continue
                self.free_locked(self.ch[h].ptr, h)
            if self._waiters:
                self._cond.notify_all()
        finally:
            lk.give()
        return failed

    cdef int32_t looked_up(self, object ptr, str what) except -1:
        """Lock held: the live allocation's handle, else the pure model's error."""
        cdef int32_t h = self.live_handle(ptr) if type(ptr) is int else -1
        if h < 0:
            raise self._invalid_pointer(ptr, what)
        return h

    def requested_size(self, ptr):
        cdef Lock lk = self._lock
        lk.take()
        try:
            return self.ch[self.looked_up(ptr, "requested_size")].requested
        finally:
            lk.give()

    def allocated_size(self, ptr):
        cdef Lock lk = self._lock
        lk.take()
        try:
            return self.ch[self.looked_up(ptr, "allocated_size")].size
        finally:
            lk.give()

    def allocation_id(self, ptr):
        cdef Lock lk = self._lock
        lk.take()
        try:
            return self.ch[self.looked_up(ptr, "allocation_id")].aid
        finally:
            lk.give()

    def owns(self, ptr):
        cdef int64_t v
        cdef uint64_t p
        if type(ptr) is not int:
            c = self._by_ptr.get(ptr)
            return c is not None and c.aid >= 0
        p = as_address(ptr)
        return p != 0 and pm_get(&self.byptr, p, &v) and self.ch[v].aid >= 0

    def _live_size(self, ptr):
        """The size of the live allocation at ``ptr``; 0 when there is none."""
        cdef int64_t v
        cdef uint64_t p
        if type(ptr) is not int:
            c = self._by_ptr.get(ptr)
            return c.size if c is not None and c.aid >= 0 else 0
        p = as_address(ptr)
        if p != 0 and pm_get(&self.byptr, p, &v) and self.ch[v].aid >= 0:
            return self.ch[v].size
        return 0

    # ------------------------------------------------------------------ regions
    cdef int extend(self, int64_t rounded) except -1:
        """Extend: one more region from the sub-allocator (1), or none (0)."""
        cdef int64_t available = self._limit - self._pool, nbytes, smaller
        cdef bint increased = False
        cdef float f
        available = (available // 256) * 256 if available > 0 else 0
        if rounded > available:
            return 0
        if self.curr_base <= 0:   # the limit was 0 when it was set: start as TF would now
            self.curr_base = rounded_bytes(
                min(self._limit, K_FIRST_GROWTH_REGION) if self._allow_growth else self._limit)
            self.curr_shift = 0
            if self.curr_base < 256:
                self.curr_base = 256
            if self._limit > self._limit_floor:
                self._limit_floor = self._limit
        while not self.curr_at_least(rounded):
            self.curr_shift += 1
            increased = True
        nbytes = available if self.curr_at_least(available) else (
            self.curr_base << self.curr_shift)
        if self._pool + nbytes > self._limit_floor:   # the least limit that leaves nbytes
            self._limit_floor = self._pool + nbytes
        ptr = self._sub_alloc(nbytes)
        if ptr is None and not self._started_backpedal:
            self._started_backpedal = True
            while ptr is None:
                f = <float>(<double>nbytes)
                smaller = rounded_bytes(<int64_t>(f * <float>0.9))
                nbytes = smaller if smaller < nbytes else nbytes - 256
                if nbytes < rounded:
                    break
                ptr = self._sub_alloc(nbytes)
        if ptr is None:
            return 0
        if not increased:
            self.curr_shift += 1
        self.add_region(ptr, nbytes, rounded)
        return 1

    cdef inline int grow(self, int64_t rounded) except -1:
        """Extend, or a subclass's own ``_extend``."""
        if self.py_extend:
            return 1 if self._extend(rounded) else 0
        return self.extend(rounded)

    cdef inline bint curr_at_least(self, int64_t n) noexcept:
        """_curr_region >= n (n >= 0)."""
        if self.curr_shift >= 63 or self.curr_base > (INT64_MAX >> self.curr_shift):
            return True
        return (self.curr_base << self.curr_shift) >= n

    cdef int add_region(self, uint64_t ptr, int64_t nbytes, int64_t rounded) except -1:
        cdef int32_t lo = 0, hi = self.nreg, mid, h, clash
        cdef Region* nr
        while lo < hi:   # bisect_left over region addresses
            mid = (lo + hi) >> 1
            if self.regs[mid].ptr < ptr:
                lo = mid + 1
            else:
                hi = mid
        # a region over one handed out before: refused, as bfc._check_disjoint does
        clash = -1
        if lo > 0 and self.regs[lo - 1].ptr + <uint64_t>self.regs[lo - 1].size > ptr:
            clash = lo - 1
        elif lo < self.nreg and self.regs[lo].ptr < ptr + <uint64_t>nbytes:
            clash = lo
        if clash >= 0:
            self._sub.free(ptr, nbytes)
            raise InvalidPointerError(
                f"{self._name}: the sub-allocator handed out {ptr:#x}..{ptr + nbytes:#x}, "
                f"which overlaps the region {self.regs[clash].ptr:#x}.."
                f"{self.regs[clash].ptr + <uint64_t>self.regs[clash].size:#x} it handed out "
                "before; a device must hand out disjoint ranges")
        if self.nreg == self.cap_reg:
            nr = <Region*>PyMem_Realloc(self.regs, 2 * self.cap_reg * sizeof(Region))
            if nr == NULL:
                raise MemoryError()
            self.regs = nr
            self.cap_reg *= 2
        memmove(&self.regs[lo + 1], &self.regs[lo], (self.nreg - lo) * sizeof(Region))
        self.nreg += 1
        self.version += 1
        self._pool += nbytes
        if self._pool > self._peak_pool:
            self._peak_pool = self._pool
        h = self.new_handle()
        self.regs[lo].ptr = ptr
        self.regs[lo].size = nbytes
        self.regs[lo].first = h
        self.ch[h].ptr = ptr
        self.ch[h].size = nbytes
        self.ch[h].aid = -1
        self.ch[h].prev = -1
        self.ch[h].next = -1
        self.ch[h].region = ptr
        pm_put(&self.byptr, ptr, h)
        self.insert_free(h)
        if self.jr is not None:
            self.jr.push(K_EXTEND, <int64_t>ptr, nbytes, rounded, 0, 0, 0, 0)
        return 0

    def _add_region(self, ptr, nbytes, rounded):
        self.add_region(ptr, nbytes, rounded)

    def _extend(self, rounded):
        return bool(self.extend(rounded))

    cdef int64_t release_one(self, int32_t ri) except -1:
        """One region of DeallocateRegions: its chunks deleted, its memory returned."""
        cdef int32_t c, nxt
        cdef uint64_t ptr = self.regs[ri].ptr
        cdef int64_t size = self.regs[ri].size
        c = self.regs[ri].first
        while c >= 0:
            nxt = self.ch[c].next
            if self.ch[c].bin >= 0:
                self.remove_free(c)
            self.delete_chunk(c)
            c = nxt
        self.version += 1
        self._sub.free(ptr, size)
        ri = self.region_index(ptr)   # the sub-allocator ran Python code: look again
        self._pool -= size
        memmove(&self.regs[ri], &self.regs[ri + 1], (self.nreg - ri - 1) * sizeof(Region))
        self.nreg -= 1
        if self.jr is not None:
            self.jr.push(K_RELEASE, <int64_t>ptr, size, 0, 0, 0, 0, 0)
        return size

    cdef int64_t release_region(self, int32_t ri) except -1:
        """DeallocateRegions of one region (then the cap is looked at again)."""
        cdef int64_t freed = self.release_one(ri)
        if self._capped and self._pool <= self._limit:
            self._set_cap()
        return freed

    cdef int64_t release_regions(self, list ptrs) except -1:
        cdef int64_t freed = 0
        cdef int32_t ri
        for p in ptrs:
            ri = self.region_index(p)
            if ri < 0 or self.regs[ri].ptr != <uint64_t>p:
                raise ValueError(f"{self._name}: no region at {p:#x}")
            freed += self.release_one(ri)
        if self._capped and self._pool <= self._limit:
            self._set_cap()
        return freed

    def _deallocate_regions(self, regions):
        """DeallocateRegions: return whole free regions (records with ``ptr``)."""
        return self.release_regions([r.ptr for r in regions])

    cdef list free_region_ptrs(self):
        cdef int32_t r, c
        out = []
        for r in range(self.nreg):
            c = self.regs[r].first
            while c >= 0 and self.ch[c].aid < 0:
                c = self.ch[c].next
            if c < 0:
                out.append(self.regs[r].ptr)
        return out

    cdef bint deallocate_free_regions(self, int64_t rounded) except -1:
        """DeallocateFreeRegions (garbage collection before an out-of-memory error)."""
        cdef int64_t total_free = 0
        cdef int32_t ri
        ptrs = self.free_region_ptrs()
        for p in ptrs:
            ri = self.region_index(p)
            total_free += self.regs[ri].size
        if total_free == 0:
            return False
        if rounded > self._limit - self._pool + total_free:
            return False
        if rounded + self._pool - total_free > self._limit_floor:
            self._limit_floor = rounded + self._pool - total_free
        _logger.warning(_GC_MESSAGE)
        self.release_regions(ptrs)
        return True

    def _deallocate_free_regions(self, rounded):
        return self.deallocate_free_regions(rounded)

    def _largest_free_chunk(self):
        return self.largest_free()

    def _region_table(self):
        cdef int32_t r
        return ([self.regs[r].ptr for r in range(self.nreg)],
                [self.regs[r].ptr + <uint64_t>self.regs[r].size for r in range(self.nreg)])

    def _region_at(self, ptr):
        cdef int32_t r
        if type(ptr) is not int or ptr < 0 or ptr > 0xFFFFFFFFFFFFFFFF:
            return 0
        r = self.region_index(ptr)
        return self.regs[r].ptr if r >= 0 else 0

    # ------------------------------------------------------------------ teardown, copies
    def close(self):
        """Return every region to the sub-allocator (TensorFlow's destructor)."""
        cdef Lock lk = self._lock
        cdef int32_t r, c
        cdef int64_t start = 0
        lk.take()
        try:
            listening = self.jr is not None
            if listening:
                start = self.jr.n
            for r in range(self.nreg):
                c = self.regs[r].first
                while c >= 0:
                    if self.ch[c].aid >= 0:
                        self._in_use -= self.ch[c].size
                        self.ch[c].aid = -1
                    c = self.ch[c].next
            self.version += 1
            self.release_regions([self.regs[r].ptr for r in range(self.nreg)])
            if listening:
                self._after_op(start)
        finally:
            lk.give()
        self.flush_events()

    def _copy_core(self, sub):
        """A deep copy over ``sub`` of an idle allocator with no listeners (replay
        checkpoints)."""
        cdef BFCCore new
        cdef int b, bi, i
        if self.jr is not None:
            raise NotImplementedError("cannot clone an allocator that has listeners")
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        PyMem_Free(new.ch)
        PyMem_Free(new.spare)
        PyMem_Free(new.regs)
        new.ch = <Chunk*>PyMem_Malloc(self.cap_h * sizeof(Chunk))
        new.spare = <int32_t*>PyMem_Malloc(self.cap_spare * sizeof(int32_t))
        new.regs = <Region*>PyMem_Malloc(self.cap_reg * sizeof(Region))
        if new.ch == NULL or new.spare == NULL or new.regs == NULL:
            raise MemoryError()
        memcpy(new.ch, self.ch, self.nh * sizeof(Chunk))
        memcpy(new.spare, self.spare, self.nspare * sizeof(int32_t))
        memcpy(new.regs, self.regs, self.nreg * sizeof(Region))
        new.nh, new.cap_h = self.nh, self.cap_h
        new.nspare, new.cap_spare = self.nspare, self.cap_spare
        new.nreg, new.cap_reg = self.nreg, self.cap_reg
        for b in range(NUM_BINS):
            ss_free(&new.bins[b])
            ss_init(&new.bins[b])
            for bi in range(self.bins[b].nblk):
                for i in range(self.bins[b].nb[bi]):
                    ss_insert(&new.bins[b], self.bins[b].blk[bi][i])
        new.mask = self.mask
        pm_free(&new.byptr)
        pm_copy(&new.byptr, &self.byptr)
        new.curr_base, new.curr_shift = self.curr_base, self.curr_shift
        new._limit, new._max_frag, new._pool = self._limit, self._max_frag, self._pool
        new._next_aid, new._num_allocs, new._in_use = self._next_aid, self._num_allocs, \
            self._in_use
        new._peak, new._largest, new._peak_pool = self._peak, self._largest, self._peak_pool
        new._failure_logs, new._flush_at = self._failure_logs, self._flush_at
        new._limit_floor = self._limit_floor
        new._started_backpedal, new._capped = self._started_backpedal, self._capped
        new._allow_growth, new._gc = self._allow_growth, self._gc
        new._retry_timeout, new._frag_fraction = self._retry_timeout, self._frag_fraction
        new._name = self._name
        new._sub = sub
        new.py_extend = self.py_extend
        new._waiters = 0
        new._cond = threading.Condition(new._lock)
        new._reset_listeners()
        return new
