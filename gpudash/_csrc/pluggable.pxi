# Install mode: PyTorch's caching allocator as the C functions PyTorch's
# torch.cuda.memory.CUDAPluggableAllocator loads from this shared object, so that a job's
# CUDA allocations run on gpudash's allocator. Included by _core.pyx.
#
# PyTorch calls these from any of its threads, with or without the GIL (its op bindings and
# the autograd engine release it). So nothing below touches a Python object: the state of
# each device is a C struct under a pthread mutex, the device memory comes from cudaMalloc
# and cudaFree reached through function pointers (libcudart, dlopen'ed by pl_bind_cuda at
# install; no CUDA headers or libraries at build time), or from the host (posix_memalign) for
# the tests. CachingCore (caching.pxi) cannot serve here: it holds the GIL for a whole
# operation (its Lock, the journal, the history and the sub-allocator are Python objects).
# This is the same model, decision for decision (gpudash.caching.CachingAllocator's _malloc,
# _get_free_block, _alloc_found_block, _alloc_block, _free, _release_*), without expandable
# segments, garbage_collection_threshold or roundup_power2_divisions; tests/
# test_torch_install.py holds the two to the same addresses and statistics. No journal: the
# counters and a ring of the last out-of-memory failures are read by the dashboard's feed.
# pluggable_setup(allocator="bfc") makes the same hooks run TensorFlow's BFC instead (the
# section "the BFC" below, held to gpudash.bfc.BFCAllocator the same way).

from libc.stdlib cimport malloc as c_malloc, free as c_free, realloc as c_realloc
from libc.stdlib cimport calloc as c_calloc

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t* m, void* attr)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)

cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char* path, int flags)
    void* dlsym(void* handle, const char* name)
    char* dlerror()
    enum:
        RTLD_NOW
        RTLD_GLOBAL

cdef extern from "<stdio.h>" nogil:
    ctypedef struct FILE:
        pass
    FILE* stderr
    int fprintf(FILE* f, const char* fmt, ...)
    int fflush(FILE* f)

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** out, size_t alignment, size_t size)
    void abort()

cdef enum:
    PL_MAX_DEVICES = 64
    PL_BACKEND_NONE = 0
    PL_BACKEND_HOST = 1
    PL_BACKEND_CUDA = 2
    PL_OOM_RING = 64
    PL_ON_OOM_NULL = 0
    PL_ON_OOM_ABORT = 1
    PL_KIND_TORCH = 0
    PL_KIND_BFC = 1

# the statistics, each 12 numbers as gpudash.caching._Stats keeps them: [current, peak,
# allocated, freed] for all, the small pool and the large pool
cdef enum:
    PS_ALLOCATION = 0
    PS_SEGMENT = 1
    PS_INACTIVE_SPLIT = 2
    PS_ALLOCATED_BYTES = 3
    PS_RESERVED_BYTES = 4
    PS_INACTIVE_SPLIT_BYTES = 5
    PS_REQUESTED_BYTES = 6
    PS_N = 7

_PL_STAT_NAMES = ("allocation", "segment", "inactive_split", "allocated_bytes",
                  "reserved_bytes", "inactive_split_bytes", "requested_bytes")

cdef struct PLBlock:
    uint64_t ptr
    int64_t size
    int64_t requested
    uint64_t stream
    uint64_t use_stream     # record_stream: the other stream (when uses == 1)
    int32_t prev            # neighbours in the segment (slots; -1: none)
    int32_t next
    int32_t uses            # record_stream calls naming another stream
    int64_t aid             # the BFC's allocation id (-1: free)
    int8_t pool             # 0 small, 1 large (the BFC: 1)
    int8_t allocated
    int8_t live

cdef struct PLKey:          # a free block in its pool: ordered by (stream, size, ptr)
    uint64_t stream
    uint64_t size
    uint64_t ptr
    int32_t slot

cdef struct PLPool:
    PLKey* k
    int32_t n, cap

cdef struct PLDev:
    PLBlock* bk
    int32_t nbk, cap_bk
    int32_t* free_slots
    int32_t nfree, cap_free
    uint64_t* hk            # address -> slot: open addressing, linear probing
    int32_t* hv
    size_t hcap, hn
    PLPool pools[2]
    int64_t st[7][12]
    int64_t over_alloc[4]
    int64_t over_seg[4]
    int64_t n_retries, n_ooms, n_sync, n_dev_alloc, n_dev_free
    int64_t reserved, peak_reserved, allowed, total
    int64_t n_alloc_calls, n_free_calls, n_stream_syncs
    uint64_t mss            # max_split_size; all ones: unset
    int64_t tol             # max_non_split_rounding_size
    double fraction
    bint set_fraction, ready
    int64_t oom_t[64]       # the last PL_OOM_RING failures: time_ns, rounded, requested
    int64_t oom_rounded[64]
    int64_t oom_requested[64]
    int64_t oom_count
    # allocator="bfc" (pluggable_bfc below): TensorFlow's BFC, its free chunks in pools[1]
    # ordered by (size, address) (bins are size ranges: one ordered set is the same walk)
    int64_t bf_limit, bf_curr, bf_max_frag, bf_next_aid, bf_num_allocs, bf_largest
    int64_t bf_default_limit
    bint bf_growth, bf_gc, bf_backpedal, bf_capped, bf_limit_set


cdef PLDev pl_devs[64]
cdef pthread_mutex_t pl_locks[64]
cdef int pl_backend = PL_BACKEND_NONE
cdef int pl_kind = 0          # PL_KIND_TORCH or PL_KIND_BFC
cdef int pl_on_oom = PL_ON_OOM_ABORT
cdef int64_t pl_host_total = 0
cdef uint64_t pl_default_mss = <uint64_t>-1
cdef int64_t pl_default_tol = 20 << 20

# libcudart, reached through pointers (pl_bind_cuda)
ctypedef int (*cuda_malloc_t)(void** p, size_t n) noexcept nogil
ctypedef int (*cuda_free_t)(void* p) noexcept nogil
ctypedef int (*cuda_meminfo_t)(size_t* free, size_t* total) noexcept nogil
ctypedef int (*cuda_getdev_t)(int* d) noexcept nogil
ctypedef int (*cuda_setdev_t)(int d) noexcept nogil
ctypedef int (*cuda_sync_t)(void* stream) noexcept nogil
ctypedef int (*cuda_devsync_t)() noexcept nogil
cdef cuda_malloc_t cu_malloc = NULL
cdef cuda_free_t cu_free = NULL
cdef cuda_meminfo_t cu_meminfo = NULL
cdef cuda_getdev_t cu_getdev = NULL
cdef cuda_setdev_t cu_setdev = NULL
cdef cuda_sync_t cu_stream_sync = NULL
cdef cuda_devsync_t cu_dev_sync = NULL

cdef int _pl_i
for _pl_i in range(PL_MAX_DEVICES):
    pthread_mutex_init(&pl_locks[_pl_i], NULL)
    memset(&pl_devs[_pl_i], 0, sizeof(PLDev))


# ------------------------------------------------------------------------------ statistics
cdef inline void pl_inc(int64_t* s, int t, int64_t n) noexcept nogil:
    cdef int j = t << 2
    s[0] += n
    if s[0] > s[1]:
        s[1] = s[0]
    s[2] += n
    s[j] += n
    if s[j] > s[j + 1]:
        s[j + 1] = s[j]
    s[j + 2] += n

cdef inline void pl_dec(int64_t* s, int t, int64_t n) noexcept nogil:
    cdef int j = t << 2
    s[0] -= n
    s[3] += n
    s[j] -= n
    s[j + 3] += n

cdef inline void pl_inc1(int64_t* s, int64_t n) noexcept nogil:
    s[0] += n
    if s[0] > s[1]:
        s[1] = s[0]
    s[2] += n

cdef inline void pl_dec1(int64_t* s, int64_t n) noexcept nogil:
    s[0] -= n
    s[3] += n


# ------------------------------------------------------------------------------ address map
cdef inline size_t pl_hash(uint64_t p, size_t cap) noexcept nogil:
    return <size_t>((p >> 9) * <uint64_t>0x9E3779B97F4A7C15ULL >> 20) & (cap - 1)

cdef int32_t pl_get(PLDev* d, uint64_t p) noexcept nogil:
    cdef size_t i
    if d.hcap == 0:
        return -1
    i = pl_hash(p, d.hcap)
    while d.hk[i] != 0:
        if d.hk[i] == p:
            return d.hv[i]
        i = (i + 1) & (d.hcap - 1)
    return -1

cdef bint pl_put(PLDev* d, uint64_t p, int32_t s) noexcept nogil:
    """map[p] = s; False when memory runs out."""
    cdef size_t i, j, cap
    cdef uint64_t* ok = d.hk
    cdef int32_t* ov = d.hv
    if (d.hn + 1) * 2 > d.hcap:
        cap = d.hcap * 2 if d.hcap else 1024
        d.hk = <uint64_t*>c_calloc(cap, sizeof(uint64_t))
        d.hv = <int32_t*>c_malloc(cap * sizeof(int32_t))
        if d.hk == NULL or d.hv == NULL:
            c_free(d.hk)
            c_free(d.hv)
            d.hk, d.hv = ok, ov
            return False
        for j in range(d.hcap):
            if ok[j] != 0:
                i = pl_hash(ok[j], cap)
                while d.hk[i] != 0:
                    i = (i + 1) & (cap - 1)
                d.hk[i] = ok[j]
                d.hv[i] = ov[j]
        c_free(ok)
        c_free(ov)
        d.hcap = cap
    i = pl_hash(p, d.hcap)
    while d.hk[i] != 0:
        if d.hk[i] == p:
            d.hv[i] = s
            return True
        i = (i + 1) & (d.hcap - 1)
    d.hk[i] = p
    d.hv[i] = s
    d.hn += 1
    return True

cdef void pl_del(PLDev* d, uint64_t p) noexcept nogil:
    """Remove p (backward-shift deletion: no tombstones)."""
    cdef size_t i, j, h, m = d.hcap - 1
    if d.hcap == 0:
        return
    i = pl_hash(p, d.hcap)
    while d.hk[i] != p:
        if d.hk[i] == 0:
            return
        i = (i + 1) & m
    j = i
    while True:
        j = (j + 1) & m
        if d.hk[j] == 0:
            break
        h = pl_hash(d.hk[j], d.hcap)
        # move j back to i when its home is not within (i, j]
        if (j > i and (h <= i or h > j)) or (j < i and (h <= i and h > j)):
            d.hk[i] = d.hk[j]
            d.hv[i] = d.hv[j]
            i = j
    d.hk[i] = 0
    d.hn -= 1


# ------------------------------------------------------------------------------ pools
cdef inline bint pl_klt(uint64_t s1, uint64_t z1, uint64_t p1,
                        uint64_t s2, uint64_t z2, uint64_t p2) noexcept nogil:
    if s1 != s2:
        return s1 < s2
    if z1 != z2:
        return z1 < z2
    return p1 < p2

cdef inline int32_t pl_lower(const PLPool* pool, uint64_t s, uint64_t z,
                             uint64_t p) noexcept nogil:
    cdef int32_t lo = 0, hi = pool.n, mid
    cdef const PLKey* k
    while lo < hi:
        mid = (lo + hi) >> 1
        k = &pool.k[mid]
        if pl_klt(k.stream, k.size, k.ptr, s, z, p):
            lo = mid + 1
        else:
            hi = mid
    return lo

cdef bint pl_pool_insert(PLPool* pool, const PLBlock* b, int32_t slot) noexcept nogil:
    cdef int32_t i, cap
    cdef PLKey* nk
    if pool.n == pool.cap:
        cap = pool.cap * 2 if pool.cap else 64
        nk = <PLKey*>c_realloc(pool.k, cap * sizeof(PLKey))
        if nk == NULL:
            return False
        pool.k = nk
        pool.cap = cap
    i = pl_lower(pool, b.stream, <uint64_t>b.size, b.ptr)
    memmove(&pool.k[i + 1], &pool.k[i], (pool.n - i) * sizeof(PLKey))
    pool.k[i].stream = b.stream
    pool.k[i].size = <uint64_t>b.size
    pool.k[i].ptr = b.ptr
    pool.k[i].slot = slot
    pool.n += 1
    return True

cdef inline void pl_pool_erase_at(PLPool* pool, int32_t i) noexcept nogil:
    memmove(&pool.k[i], &pool.k[i + 1], (pool.n - i - 1) * sizeof(PLKey))
    pool.n -= 1

cdef void pl_pool_erase(PLPool* pool, const PLBlock* b) noexcept nogil:
    cdef int32_t i = pl_lower(pool, b.stream, <uint64_t>b.size, b.ptr)
    if i < pool.n and pool.k[i].ptr == b.ptr:
        pl_pool_erase_at(pool, i)


# ------------------------------------------------------------------------------ records
cdef int32_t pl_new_block(PLDev* d, uint64_t ptr, int64_t size, uint64_t stream,
                          int pool) noexcept nogil:
    cdef int32_t s, cap
    cdef PLBlock* nb
    if d.nfree:
        d.nfree -= 1
        s = d.free_slots[d.nfree]
    else:
        if d.nbk == d.cap_bk:
            cap = d.cap_bk * 2 if d.cap_bk else 256
            nb = <PLBlock*>c_realloc(d.bk, cap * sizeof(PLBlock))
            if nb == NULL:
                return -1
            d.bk = nb
            d.cap_bk = cap
        s = d.nbk
        d.nbk += 1
    nb = &d.bk[s]
    memset(nb, 0, sizeof(PLBlock))
    nb.ptr = ptr
    nb.size = size
    nb.stream = stream
    nb.prev = -1
    nb.next = -1
    nb.pool = pool
    nb.live = 1
    return s

cdef void pl_drop_block(PLDev* d, int32_t s) noexcept nogil:
    cdef int32_t cap
    cdef int32_t* nf
    d.bk[s].live = 0
    if d.nfree == d.cap_free:
        cap = d.cap_free * 2 if d.cap_free else 256
        nf = <int32_t*>c_realloc(d.free_slots, cap * sizeof(int32_t))
        if nf == NULL:
            return      # the slot is lost, nothing else
        d.free_slots = nf
        d.cap_free = cap
    d.free_slots[d.nfree] = s
    d.nfree += 1


# ------------------------------------------------------------------------------ backend
cdef uint64_t pl_dev_alloc(PLDev* d, int device, int64_t n) noexcept nogil:
    """A segment of n bytes from the device (0 when it refuses)."""
    cdef void* p = NULL
    cdef int cur = -1
    if pl_backend == PL_BACKEND_HOST:
        if d.reserved + n > pl_host_total:
            return 0
        if posix_memalign(&p, 512, <size_t>n) != 0:
            return 0
        return <uint64_t>p
    if pl_backend == PL_BACKEND_CUDA:
        cu_getdev(&cur)
        if cur != device:
            cu_setdev(device)
        if cu_malloc(&p, <size_t>n) != 0:
            p = NULL
        if cur != device:
            cu_setdev(cur)
        return <uint64_t>p
    return 0

cdef void pl_dev_free(PLDev* d, int device, uint64_t p) noexcept nogil:
    cdef int cur = -1
    if pl_backend == PL_BACKEND_HOST:
        c_free(<void*>p)
    elif pl_backend == PL_BACKEND_CUDA:
        cu_getdev(&cur)
        if cur != device:
            cu_setdev(device)
        cu_free(<void*>p)     # synchronizes the device, as cudaFree does for PyTorch
        if cur != device:
            cu_setdev(cur)

cdef void pl_wait_uses(PLDev* d, PLBlock* b) noexcept nogil:
    """A block record_stream named other streams for: wait for them before it is reused
    (PyTorch records events and frees later; this waits at once)."""
    d.n_stream_syncs += 1
    if pl_backend == PL_BACKEND_CUDA:
        if b.uses == 1:
            cu_stream_sync(<void*>b.use_stream)
        else:
            cu_dev_sync()
    b.uses = 0
    b.use_stream = 0


# ------------------------------------------------------------------------------ allocate
cdef inline int64_t pl_allocation_size(int64_t size) noexcept nogil:
    if size <= (1 << 20):
        return 2 << 20
    if size < (10 << 20):
        return 20 << 20
    return (size + (2 << 20) - 1) // (2 << 20) * (2 << 20)

cdef int32_t pl_get_free_block(PLDev* d, int pool, uint64_t stream,
                               int64_t size) noexcept nogil:
    """_get_free_block: the best fit of the stream (stream, size, address order), taken
    from its pool; -1 when none."""
    cdef PLPool* ps = &d.pools[pool]
    cdef int32_t i = pl_lower(ps, stream, <uint64_t>size, 0), b
    if i == ps.n or ps.k[i].stream != stream:
        return -1
    b = ps.k[i].slot
    if <uint64_t>d.bk[b].size >= d.mss or <uint64_t>size >= d.mss:
        if <uint64_t>size < d.mss and <uint64_t>d.bk[b].size >= d.mss:
            return -1
        if <uint64_t>size >= d.mss and d.bk[b].size >= size + d.tol:
            return -1
    pl_pool_erase_at(ps, i)
    return b

cdef int32_t pl_alloc_block(PLDev* d, int device, int pool, uint64_t stream,
                            int64_t alloc_size, bint is_retry) noexcept nogil:
    """_alloc_block: a new segment; -1 when the limit or the device refuses."""
    cdef uint64_t p
    cdef int32_t s
    if is_retry:
        d.n_retries += 1
    if d.set_fraction and d.reserved + alloc_size > d.allowed:
        return -1
    p = pl_dev_alloc(d, device, alloc_size)
    if p == 0:
        return -1
    s = pl_new_block(d, p, alloc_size, stream, pool)
    if s < 0 or not pl_put(d, p, s):
        pl_dev_free(d, device, p)
        return -1
    d.reserved += alloc_size
    if d.reserved > d.peak_reserved:
        d.peak_reserved = d.reserved
    pl_inc(d.st[PS_SEGMENT], pool + 1, 1)
    pl_inc(d.st[PS_RESERVED_BYTES], pool + 1, alloc_size)
    if d.mss != pl_default_mss and <uint64_t>alloc_size >= d.mss:
        pl_inc1(d.over_seg, 1)
    d.n_dev_alloc += 1
    return s

cdef void pl_release_block(PLDev* d, int device, int32_t s) noexcept nogil:
    """_release_block: cudaFree of a whole free segment (already out of its pool)."""
    cdef PLBlock* b = &d.bk[s]
    cdef int pool = b.pool
    d.n_dev_free += 1
    pl_dev_free(d, device, b.ptr)
    d.reserved -= b.size
    pl_dec(d.st[PS_SEGMENT], pool + 1, 1)
    pl_dec(d.st[PS_RESERVED_BYTES], pool + 1, b.size)
    if d.mss != pl_default_mss and <uint64_t>b.size >= d.mss:
        pl_dec1(d.over_seg, 1)
    pl_del(d, b.ptr)
    pl_drop_block(d, s)

cdef bint pl_release_available(PLDev* d, int device, int pool, uint64_t stream,
                               int64_t size) noexcept nogil:
    """_release_available_cached_blocks (max_split_size set): free oversize cached blocks
    of this pool and stream, the smallest that covers the request, else from the largest
    down."""
    cdef PLPool* ps = &d.pools[pool]
    cdef uint64_t target
    cdef int32_t i, s
    cdef int64_t released = 0
    if d.mss == pl_default_mss:
        return False
    target = <uint64_t>size if <uint64_t>size > d.mss else d.mss
    i = pl_lower(ps, stream, target, 0)
    if i == ps.n or ps.k[i].stream != stream:
        if i == 0:
            return False
        i -= 1
        while <uint64_t>released < target:
            s = ps.k[i].slot
            if <uint64_t>d.bk[s].size < d.mss or d.bk[s].stream != stream:
                break
            released += d.bk[s].size
            pl_pool_erase_at(ps, i)
            pl_release_block(d, device, s)
            if i == 0:
                break
            i -= 1
        return <uint64_t>released >= target
    s = ps.k[i].slot
    pl_pool_erase_at(ps, i)
    pl_release_block(d, device, s)
    return True

cdef void pl_release_pool(PLDev* d, int device, int pool) noexcept nogil:
    cdef PLPool* ps = &d.pools[pool]
    cdef int32_t i = 0, s
    while i < ps.n:
        s = ps.k[i].slot
        if d.bk[s].prev < 0 and d.bk[s].next < 0:
            pl_pool_erase_at(ps, i)
            pl_release_block(d, device, s)
        else:
            i += 1

cdef void pl_release_cached(PLDev* d, int device) noexcept nogil:
    """_release_cached_blocks (empty_cache): every whole free segment, large pool first."""
    d.n_sync += 1
    pl_release_pool(d, device, 1)
    pl_release_pool(d, device, 0)

cdef uint64_t pl_alloc_found(PLDev* d, int32_t blk, int pool, int64_t size, int64_t orig,
                             uint64_t stream) noexcept nogil:
    """_alloc_found_block: split if it should be (the allocation takes the front)."""
    cdef PLBlock* b = &d.bk[blk]
    cdef int t = pool + 1
    cdef bint already_split = b.prev >= 0 or b.next >= 0, split
    cdef int64_t rem = b.size - size
    cdef int32_t r, nx
    cdef uint64_t at
    if pool == 0:
        split = rem >= 512
    else:
        split = <uint64_t>size < d.mss and rem > (1 << 20)
    if split:
        at = b.ptr + <uint64_t>size
        r = pl_new_block(d, at, rem, b.stream, pool)
        b = &d.bk[blk]         # the records may have moved (b is not read before this)
        if r >= 0 and not pl_put(d, at, r):
            pl_drop_block(d, r)
            r = -1
        if r < 0:
            split = False      # out of host memory for the records: take the whole block
        else:
            nx = b.next
            d.bk[r].prev = blk
            d.bk[r].next = nx
            if nx >= 0:
                d.bk[nx].prev = r
            b.next = r
            b.size = size
            b.stream = stream
            pl_pool_insert(&d.pools[pool], &d.bk[r], r)
            if already_split:
                pl_dec(d.st[PS_INACTIVE_SPLIT_BYTES], t, size)
            else:
                pl_inc(d.st[PS_INACTIVE_SPLIT_BYTES], t, rem)
                pl_inc(d.st[PS_INACTIVE_SPLIT], t, 1)
    if not split and already_split:
        pl_dec(d.st[PS_INACTIVE_SPLIT_BYTES], t, b.size)
        pl_dec(d.st[PS_INACTIVE_SPLIT], t, 1)
    b.allocated = 1
    b.requested = orig
    pl_inc(d.st[PS_ALLOCATION], t, 1)
    pl_inc(d.st[PS_ALLOCATED_BYTES], t, b.size)
    pl_inc(d.st[PS_REQUESTED_BYTES], t, orig)
    if <uint64_t>b.size >= d.mss:
        pl_inc1(d.over_alloc, 1)
    return b.ptr

cdef void pl_oom(PLDev* d, int64_t size, int64_t orig) noexcept nogil:
    cdef int64_t i = d.oom_count % PL_OOM_RING
    d.n_ooms += 1
    d.oom_t[i] = now_ns()
    d.oom_rounded[i] = size
    d.oom_requested[i] = orig
    d.oom_count += 1

cdef uint64_t pl_malloc(PLDev* d, int device, int64_t n, uint64_t stream,
                        int64_t* rounded) noexcept nogil:
    """_malloc under the device's lock: the address, or 0 (out of memory)."""
    cdef int64_t size = (n + 511) & ~(<int64_t>511), alloc_size
    cdef int pool = 0 if size <= (1 << 20) else 1
    cdef int32_t blk = pl_get_free_block(d, pool, stream, size)
    rounded[0] = size
    d.n_alloc_calls += 1
    if blk < 0:
        alloc_size = pl_allocation_size(size)
        blk = pl_alloc_block(d, device, pool, stream, alloc_size, False)
        if blk < 0:
            if pl_release_available(d, device, pool, stream, size):
                blk = pl_alloc_block(d, device, pool, stream, alloc_size, False)
            if blk < 0:
                pl_release_cached(d, device)
                blk = pl_alloc_block(d, device, pool, stream, alloc_size, True)
        if blk < 0:
            pl_oom(d, size, n)
            return 0
    return pl_alloc_found(d, blk, pool, size, n, stream)

cdef bint pl_free(PLDev* d, uint64_t ptr) noexcept nogil:
    """_free: uncount, merge with free neighbours (the previous one first), cache. False:
    not a live block here."""
    cdef int32_t s = pl_get(d, ptr), p, nx
    cdef PLBlock* b
    cdef int t, pool
    cdef int64_t bsize, req, prev_size = 0, next_size = 0, net_blocks, net_bytes
    if s < 0 or not d.bk[s].allocated:
        return False
    b = &d.bk[s]
    if b.uses:
        pl_wait_uses(d, b)
    d.n_free_calls += 1
    pool = b.pool
    t = pool + 1
    bsize = b.size
    req = b.requested
    b.allocated = 0
    pl_dec(d.st[PS_ALLOCATION], t, 1)
    pl_dec(d.st[PS_ALLOCATED_BYTES], t, bsize)
    if <uint64_t>bsize >= d.mss:
        pl_dec1(d.over_alloc, 1)
    p = b.prev
    if p >= 0 and not d.bk[p].allocated:
        pl_pool_erase(&d.pools[pool], &d.bk[p])
        pl_del(d, b.ptr)
        b.ptr = d.bk[p].ptr
        pl_put(d, b.ptr, s)       # replaces p's entry: no growth
        b.prev = d.bk[p].prev
        if b.prev >= 0:
            d.bk[b.prev].next = s
        prev_size = d.bk[p].size
        b.size += prev_size
        pl_drop_block(d, p)
    nx = b.next
    if nx >= 0 and not d.bk[nx].allocated:
        pl_pool_erase(&d.pools[pool], &d.bk[nx])
        pl_del(d, d.bk[nx].ptr)
        b.next = d.bk[nx].next
        if b.next >= 0:
            d.bk[b.next].prev = s
        next_size = d.bk[nx].size
        b.size += next_size
        pl_drop_block(d, nx)
    pl_pool_insert(&d.pools[pool], b, s)
    net_blocks = -(prev_size > 0) - (next_size > 0)
    net_bytes = -prev_size - next_size
    if b.prev >= 0 or b.next >= 0:
        net_blocks += 1
        net_bytes += b.size
    if net_blocks > 0:
        pl_inc(d.st[PS_INACTIVE_SPLIT], t, net_blocks)
    elif net_blocks < 0:
        pl_dec(d.st[PS_INACTIVE_SPLIT], t, -net_blocks)
    if net_bytes > 0:
        pl_inc(d.st[PS_INACTIVE_SPLIT_BYTES], t, net_bytes)
    elif net_bytes < 0:
        pl_dec(d.st[PS_INACTIVE_SPLIT_BYTES], t, -net_bytes)
    pl_dec(d.st[PS_REQUESTED_BYTES], t, req)
    return True

cdef void pl_set_fraction(PLDev* d, double fraction) noexcept nogil:
    d.fraction = fraction
    d.allowed = <int64_t>(fraction * <double>d.total)
    d.set_fraction = True

cdef bint pl_ready(int device) noexcept nogil:
    if device < 0 or device >= PL_MAX_DEVICES or pl_backend == PL_BACKEND_NONE:
        return False
    if not pl_devs[device].ready:
        pl_init_device(device)
    return pl_devs[device].ready

cdef void pl_init_device(int device) noexcept nogil:
    """The device's total memory, once (under its lock)."""
    cdef PLDev* d = &pl_devs[device]
    cdef size_t free_b = 0, total_b = 0
    cdef int cur = -1
    pthread_mutex_lock(&pl_locks[device])
    if not d.ready:
        if pl_backend == PL_BACKEND_HOST:
            d.total = pl_host_total
        elif pl_backend == PL_BACKEND_CUDA:
            cu_getdev(&cur)
            if cur != device:
                cu_setdev(device)
            if cu_meminfo(&free_b, &total_b) == 0:
                d.total = <int64_t>total_b
            if cur != device:
                cu_setdev(cur)
        if d.mss == 0:
            d.mss = pl_default_mss
            d.tol = pl_default_tol
        if d.set_fraction:     # a fraction given before the device was first used
            pl_set_fraction(d, d.fraction)
        if pl_kind == PL_KIND_BFC:
            # TensorFlow's limit: the memory free when the device is first used (all of
            # the host backend's), or the fraction of the total
            d.bf_default_limit = <int64_t>free_b if pl_backend == PL_BACKEND_CUDA \
                else pl_host_total
            d.bf_growth = pl_bf_growth_default
            d.bf_gc = pl_bf_gc_default
            bf_construct(d, d.allowed if d.set_fraction else d.bf_default_limit)
        d.ready = True
    pthread_mutex_unlock(&pl_locks[device])


# ------------------------------------------------------------------------------ the BFC
# install(allocator="bfc"): TensorFlow's BFC allocator (gpudash.bfc.BFCAllocator, decision for
# decision: _take, _extend with its doubling and once-only backpedal, _free_locked's
# next-then-previous merge, _deallocate_free_regions, set_memory_limit's live cap,
# set_allow_growth) on the same records as the caching allocator above: chunks are PLBlocks
# (pool 1), a region is a run of chunks from a head (prev -1), the free chunks sit in
# pools[1] ordered by (size, address) with stream 0. TensorFlow's bins are ranges of size,
# so the first key >= (rounded, 0) is FindChunkPtr's best fit. Statistics are kept in
# PyTorch's layout (all in the large pool): regions are segments, chunks are blocks.
cdef int pl_bf_growth_default = 1
cdef int pl_bf_gc_default = 0
cdef float BF_BACKPEDAL = 0.9          # a C float, as TensorFlow's kBackpedalFactor
cdef const char* BF_GC_MESSAGE = (
    "gpudash install mode (bfc): garbage collection: deallocate free memory regions so "
    "that a larger region can be allocated (TensorFlow's DeallocateFreeRegions)\n")

cdef inline int64_t bf_rounded(int64_t n) noexcept nogil:
    return (n + 255) & ~(<int64_t>255)

cdef void bf_construct(PLDev* d, int64_t limit) noexcept nogil:
    """The BFC's constructor: the limit, the first region's size; nothing allocated."""
    d.bf_limit = limit
    d.bf_curr = bf_rounded(min(limit, <int64_t>(2 << 20))) if d.bf_growth else bf_rounded(limit)
    d.bf_max_frag = 128 << 20
    d.bf_capped = False
    if d.bf_next_aid == 0:
        d.bf_next_aid = 1

cdef void bf_set_cap(PLDev* d) noexcept nogil:
    d.bf_capped = d.reserved > d.bf_limit
    d.bf_max_frag = 1 if d.bf_capped else (128 << 20)

cdef void bf_inactive(PLDev* d, int64_t net_blocks, int64_t net_bytes) noexcept nogil:
    if net_blocks > 0:
        pl_inc(d.st[PS_INACTIVE_SPLIT], 2, net_blocks)
    elif net_blocks < 0:
        pl_dec(d.st[PS_INACTIVE_SPLIT], 2, -net_blocks)
    if net_bytes > 0:
        pl_inc(d.st[PS_INACTIVE_SPLIT_BYTES], 2, net_bytes)
    elif net_bytes < 0:
        pl_dec(d.st[PS_INACTIVE_SPLIT_BYTES], 2, -net_bytes)

cdef uint64_t bf_take(PLDev* d, int64_t n, int64_t rounded, uint64_t stream) noexcept nogil:
    """FindChunkPtr with SplitChunk: the smallest free chunk >= rounded, lowest address on
    ties; 0 when none."""
    cdef PLPool* ps = &d.pools[1]
    cdef int32_t i, s, r, nx
    cdef PLBlock* b
    cdef int64_t size, rem = 0
    cdef bint was_split
    if d.bf_capped and d.st[PS_ALLOCATED_BYTES][0] + rounded > d.bf_limit:
        return 0
    i = pl_lower(ps, 0, <uint64_t>rounded, 0)
    if i == ps.n:
        return 0
    s = ps.k[i].slot
    pl_pool_erase_at(ps, i)
    b = &d.bk[s]
    size = b.size
    was_split = b.prev >= 0 or b.next >= 0
    if size >= rounded * 2 or size - rounded >= d.bf_max_frag:
        r = pl_new_block(d, b.ptr + <uint64_t>rounded, size - rounded, 0, 1)
        b = &d.bk[s]    # the records may have moved (b is not read before this)
        if r >= 0 and not pl_put(d, b.ptr + <uint64_t>rounded, r):
            pl_drop_block(d, r)
            r = -1
        if r >= 0:      # else out of host memory for the records: the whole chunk
            d.bk[r].aid = -1
            nx = b.next
            d.bk[r].prev = s
            d.bk[r].next = nx
            if nx >= 0:
                d.bk[nx].prev = r
            b.next = r
            rem = size - rounded
            b.size = size = rounded
            pl_pool_insert(ps, &d.bk[r], r)
    bf_inactive(d, <int64_t>(rem > 0) - <int64_t>was_split, rem - (b.size + rem if was_split else 0))
    b.allocated = 1
    b.requested = n
    b.stream = stream
    b.aid = d.bf_next_aid
    d.bf_next_aid += 1
    d.bf_num_allocs += 1
    if size > d.bf_largest:
        d.bf_largest = size
    pl_inc(d.st[PS_ALLOCATION], 2, 1)
    pl_inc(d.st[PS_ALLOCATED_BYTES], 2, size)
    pl_inc(d.st[PS_REQUESTED_BYTES], 2, n)
    return b.ptr

cdef bint bf_add_region(PLDev* d, int device, uint64_t p, int64_t nbytes) noexcept nogil:
    cdef int32_t s = pl_new_block(d, p, nbytes, 0, 1)
    if s < 0 or not pl_put(d, p, s):
        if s >= 0:
            pl_drop_block(d, s)
        pl_dev_free(d, device, p)
        return False
    d.bk[s].aid = -1
    pl_pool_insert(&d.pools[1], &d.bk[s], s)
    d.reserved += nbytes
    if d.reserved > d.peak_reserved:
        d.peak_reserved = d.reserved
    pl_inc(d.st[PS_SEGMENT], 2, 1)
    pl_inc(d.st[PS_RESERVED_BYTES], 2, nbytes)
    d.n_dev_alloc += 1
    return True

cdef bint bf_extend(PLDev* d, int device, int64_t rounded) noexcept nogil:
    """Extend: one more region, doubling (growth on) or what the limit leaves (off); one
    backpedal by 0.9 in the allocator's life when the device refuses."""
    cdef int64_t available = d.bf_limit - d.reserved, nbytes, smaller
    cdef bint increased = False
    cdef uint64_t p
    available = (available // 256) * 256 if available > 0 else 0
    if rounded > available:
        return False
    if d.bf_curr <= 0:
        d.bf_curr = bf_rounded(min(d.bf_limit, <int64_t>(2 << 20)) if d.bf_growth
                               else d.bf_limit)
        if d.bf_curr < 256:
            d.bf_curr = 256
    while rounded > d.bf_curr:
        d.bf_curr *= 2
        increased = True
    nbytes = min(d.bf_curr, available)
    p = pl_dev_alloc(d, device, nbytes)
    if p == 0 and not d.bf_backpedal:
        d.bf_backpedal = True
        while p == 0:
            smaller = bf_rounded(<int64_t>(<float>nbytes * BF_BACKPEDAL))
            nbytes = smaller if smaller < nbytes else nbytes - 256
            if nbytes < rounded:
                break
            p = pl_dev_alloc(d, device, nbytes)
    if p == 0:
        return False
    if not increased:
        d.bf_curr *= 2
    return bf_add_region(d, device, p, nbytes)

cdef int32_t bf_free_regions(PLDev* d, int32_t* out) noexcept nogil:
    """The wholly free regions (one free chunk each: frees merge at once), by address,
    into out (room for pools[1].n); their number."""
    cdef PLPool* ps = &d.pools[1]
    cdef int32_t i, j, n = 0, s, t
    for i in range(ps.n):
        s = ps.k[i].slot
        if d.bk[s].prev < 0 and d.bk[s].next < 0:
            j = n
            while j > 0 and d.bk[out[j - 1]].ptr > d.bk[s].ptr:
                out[j] = out[j - 1]
                j -= 1
            out[j] = s
            n += 1
    return n

cdef int64_t bf_release(PLDev* d, int device, int32_t* slots, int32_t n) noexcept nogil:
    """DeallocateRegions: these whole free regions back to the device; the bytes."""
    cdef int32_t i
    cdef int64_t freed = 0
    for i in range(n):
        freed += d.bk[slots[i]].size
        pl_pool_erase(&d.pools[1], &d.bk[slots[i]])
        pl_release_block(d, device, slots[i])
    if d.bf_capped and d.reserved <= d.bf_limit:
        bf_set_cap(d)
    return freed

cdef int64_t bf_release_all(PLDev* d, int device) noexcept nogil:
    """release_free_regions (empty_cache): every wholly free region; the bytes."""
    cdef int32_t n
    cdef int64_t freed
    cdef int32_t* slots
    if d.pools[1].n == 0:
        return 0
    slots = <int32_t*>c_malloc(d.pools[1].n * sizeof(int32_t))
    if slots == NULL:
        return 0
    n = bf_free_regions(d, slots)
    freed = bf_release(d, device, slots, n)
    c_free(slots)
    return freed

cdef bint bf_collect(PLDev* d, int device, int64_t rounded) noexcept nogil:
    """DeallocateFreeRegions (garbage_collection before an OOM)."""
    cdef int32_t n, i
    cdef int64_t total_free = 0
    cdef int32_t* slots
    if d.pools[1].n == 0:
        return False
    slots = <int32_t*>c_malloc(d.pools[1].n * sizeof(int32_t))
    if slots == NULL:
        return False
    n = bf_free_regions(d, slots)
    for i in range(n):
        total_free += d.bk[slots[i]].size
    if total_free == 0 or rounded > d.bf_limit - d.reserved + total_free:
        c_free(slots)
        return False
    fprintf(stderr, BF_GC_MESSAGE)
    bf_release(d, device, slots, n)
    c_free(slots)
    return True

cdef uint64_t bf_malloc(PLDev* d, int device, int64_t n, uint64_t stream,
                        int64_t* rounded) noexcept nogil:
    """try_allocate under the device's lock: the address, or 0 (out of memory)."""
    cdef int64_t r = bf_rounded(n)
    cdef uint64_t p
    rounded[0] = r
    d.n_alloc_calls += 1
    p = bf_take(d, n, r, stream)
    if p:
        return p
    if bf_extend(d, device, r):
        p = bf_take(d, n, r, stream)
        if p:
            return p
    if d.bf_gc and bf_collect(d, device, r) and bf_extend(d, device, r):
        p = bf_take(d, n, r, stream)
        if p:
            return p
    pl_oom(d, r, n)
    return 0

cdef bint bf_free(PLDev* d, int device, uint64_t ptr) noexcept nogil:
    """FreeAndMaybeCoalesce: the next chunk merged first, then the previous one; while the
    pool is above a limit lowered live, a region goes back as soon as it is wholly free."""
    cdef int32_t s = pl_get(d, ptr), p, nx
    cdef PLBlock* b
    cdef int64_t size, prev_size = 0, next_size = 0, net_blocks, net_bytes
    if s < 0 or not d.bk[s].allocated:
        return False
    b = &d.bk[s]
    if b.uses:
        pl_wait_uses(d, b)
    d.n_free_calls += 1
    size = b.size
    b.allocated = 0
    b.aid = -1
    b.stream = 0
    pl_dec(d.st[PS_ALLOCATION], 2, 1)
    pl_dec(d.st[PS_ALLOCATED_BYTES], 2, size)
    pl_dec(d.st[PS_REQUESTED_BYTES], 2, b.requested)
    nx = b.next
    if nx >= 0 and not d.bk[nx].allocated:
        pl_pool_erase(&d.pools[1], &d.bk[nx])
        pl_del(d, d.bk[nx].ptr)
        b.next = d.bk[nx].next
        if b.next >= 0:
            d.bk[b.next].prev = s
        next_size = d.bk[nx].size
        b.size += next_size
        pl_drop_block(d, nx)
    p = b.prev
    if p >= 0 and not d.bk[p].allocated:
        pl_pool_erase(&d.pools[1], &d.bk[p])
        prev_size = d.bk[p].size
        d.bk[p].next = b.next
        if b.next >= 0:
            d.bk[b.next].prev = p
        d.bk[p].size += b.size
        pl_del(d, b.ptr)
        pl_drop_block(d, s)
        s = p
        b = &d.bk[s]
    pl_pool_insert(&d.pools[1], b, s)
    net_blocks = -(prev_size > 0) - (next_size > 0)
    net_bytes = -prev_size - next_size
    if b.prev >= 0 or b.next >= 0:
        net_blocks += 1
        net_bytes += size + prev_size + next_size
    bf_inactive(d, net_blocks, net_bytes)
    if d.bf_capped and b.prev < 0 and b.next < 0:
        bf_release(d, device, &s, 1)
    return True

cdef void bf_set_limit(PLDev* d, int device, int64_t nbytes) noexcept nogil:
    """set_memory_limit, live: raising lets later regions grow further; lowering returns
    whole free regions, largest first, until the pool fits, and caps the rest."""
    cdef int32_t n, i, j, k, t
    cdef int64_t excess
    cdef int32_t* slots
    d.bf_limit = nbytes
    d.bf_limit_set = True
    d.bf_max_frag = 128 << 20
    if not d.bf_growth and bf_rounded(nbytes) > d.bf_curr:
        d.bf_curr = bf_rounded(nbytes)
    if d.reserved > nbytes and d.pools[1].n:
        slots = <int32_t*>c_malloc(d.pools[1].n * sizeof(int32_t))
        if slots != NULL:
            n = bf_free_regions(d, slots)
            # largest first (address on ties): a stable insertion sort of the address order
            for i in range(1, n):
                t = slots[i]
                j = i
                while j > 0 and d.bk[slots[j - 1]].size < d.bk[t].size:
                    slots[j] = slots[j - 1]
                    j -= 1
                slots[j] = t
            excess = d.reserved - nbytes
            k = 0
            while k < n and excess > 0:
                excess -= d.bk[slots[k]].size
                k += 1
            # released in address order, as the model does
            for i in range(1, k):
                t = slots[i]
                j = i
                while j > 0 and d.bk[slots[j - 1]].ptr > d.bk[t].ptr:
                    slots[j] = slots[j - 1]
                    j -= 1
                slots[j] = t
            bf_release(d, device, slots, k)
            c_free(slots)
    bf_set_cap(d)

cdef void bf_set_growth(PLDev* d, bint growth) noexcept nogil:
    """set_allow_growth: on, regions start again at 2 MiB and double; off, the next region
    is what the limit leaves."""
    if growth == d.bf_growth:
        return
    d.bf_growth = growth
    d.bf_curr = bf_rounded(min(d.bf_limit, <int64_t>(2 << 20))) if growth \
        else bf_rounded(d.bf_limit)

cdef inline int64_t pl_limit(PLDev* d) noexcept nogil:
    """The bytes the device may hold: the BFC's limit, or the fraction's, or all."""
    if pl_kind == PL_KIND_BFC:
        return d.bf_limit
    return d.allowed if d.set_fraction else d.total


# ------------------------------------------------------------------------------ the hooks
cdef const char* PL_OOM_FORMAT = (
    "gpudash install mode: CUDA out of memory on cuda:%d: tried to allocate %lld bytes "
    "(%lld rounded); %lld bytes reserved, limit %lld. PyTorch's pluggable allocator cannot "
    "raise OutOfMemoryError%s\n")
cdef const char* PL_OOM_ABORTS = (
    ": stopping the process (install(on_oom='null') returns a null pointer instead)")
cdef const char* PL_OOM_NULLS = "; the tensor gets a null pointer"
cdef const char* PL_BAD_FREE = (
    "gpudash install mode: free of %p on cuda:%d, which is not a live block of gpudash's "
    "allocator (ignored)\n")

cdef public void* gpudash_torch_malloc(size_t size, int device, void* stream) noexcept nogil:
    """alloc_fn of CUDAPluggableAllocator: ``void* fn(size_t, int, cudaStream_t)``."""
    cdef uint64_t p
    cdef int64_t rounded = 0
    cdef PLDev* d
    cdef const char* how
    if size == 0 or not pl_ready(device):
        return NULL
    d = &pl_devs[device]
    if size >= (<size_t>1 << 60):
        pthread_mutex_lock(&pl_locks[device])
        pl_oom(d, <int64_t>size, <int64_t>size)
        pthread_mutex_unlock(&pl_locks[device])
        p = 0
        rounded = <int64_t>size
    else:
        pthread_mutex_lock(&pl_locks[device])
        if pl_kind == PL_KIND_BFC:
            p = bf_malloc(d, device, <int64_t>size, <uint64_t>stream, &rounded)
        else:
            p = pl_malloc(d, device, <int64_t>size, <uint64_t>stream, &rounded)
        pthread_mutex_unlock(&pl_locks[device])
    if p == 0:
        how = PL_OOM_ABORTS if pl_on_oom == PL_ON_OOM_ABORT else PL_OOM_NULLS
        fprintf(stderr, PL_OOM_FORMAT, device, <long long>size, <long long>rounded,
                <long long>d.reserved, <long long>pl_limit(d), how)
        fflush(stderr)
        if pl_on_oom == PL_ON_OOM_ABORT:
            abort()
    return <void*>p

cdef public void gpudash_torch_free(void* ptr, size_t size, int device,
                                    void* stream) noexcept nogil:
    """free_fn: ``void fn(void* ptr, size_t size, int device, cudaStream_t stream)``."""
    cdef bint ok
    if ptr == NULL or device < 0 or device >= PL_MAX_DEVICES:
        return
    pthread_mutex_lock(&pl_locks[device])
    if pl_kind == PL_KIND_BFC:
        ok = bf_free(&pl_devs[device], device, <uint64_t>ptr)
    else:
        ok = pl_free(&pl_devs[device], <uint64_t>ptr)
    pthread_mutex_unlock(&pl_locks[device])
    if not ok:
        fprintf(stderr, PL_BAD_FREE, ptr, device)

cdef public void gpudash_torch_init(int device_count) noexcept nogil:
    """init_fn: ``void fn(int device_count)``: read each device's total memory."""
    cdef int i
    for i in range(min(device_count, <int>PL_MAX_DEVICES)):
        pl_ready(i)

cdef public void gpudash_torch_reset() noexcept nogil:
    """reset_fn (``torch.cuda.empty_cache``): every whole free segment back to the device,
    on every device."""
    cdef int i
    for i in range(PL_MAX_DEVICES):
        if pl_devs[i].ready:
            pthread_mutex_lock(&pl_locks[i])
            if pl_kind == PL_KIND_BFC:
                bf_release_all(&pl_devs[i], i)
            else:
                pl_release_cached(&pl_devs[i], i)
            pthread_mutex_unlock(&pl_locks[i])

cdef public void gpudash_torch_memory_fraction(double fraction, int device) noexcept nogil:
    """memory_fraction_fn: ``void fn(double fraction, int device)``."""
    if fraction < 0.0 or fraction > 1.0 or not pl_ready(device):
        return
    pthread_mutex_lock(&pl_locks[device])
    pl_set_fraction(&pl_devs[device], fraction)
    if pl_kind == PL_KIND_BFC:
        bf_set_limit(&pl_devs[device], device, pl_devs[device].allowed)
    pthread_mutex_unlock(&pl_locks[device])

cdef public void* gpudash_torch_base_alloc(void* ptr, size_t* size) noexcept nogil:
    """base_alloc_fn: ``void* fn(void* ptr, size_t* size)``: the segment holding ptr (its
    base, and its size in *size); ptr itself when gpudash did not allocate it."""
    cdef int i
    cdef int32_t s, h
    cdef int64_t total
    cdef void* out = ptr
    for i in range(PL_MAX_DEVICES):
        if not pl_devs[i].ready:
            continue
        pthread_mutex_lock(&pl_locks[i])
        s = pl_get(&pl_devs[i], <uint64_t>ptr)
        if s >= 0:
            h = s
            while pl_devs[i].bk[h].prev >= 0:
                h = pl_devs[i].bk[h].prev
            out = <void*>pl_devs[i].bk[h].ptr
            total = 0
            while h >= 0:
                total += pl_devs[i].bk[h].size
                h = pl_devs[i].bk[h].next
            if size != NULL:
                size[0] = <size_t>total
        pthread_mutex_unlock(&pl_locks[i])
        if s >= 0:
            break
    return out

cdef public void gpudash_torch_record_stream(void* ptr, void* stream) noexcept nogil:
    """record_stream_fn: ``void fn(void* ptr, cudaStream_t stream)``: the block is used on
    another stream; its free waits for that stream."""
    cdef int i
    cdef int32_t s
    cdef PLBlock* b
    for i in range(PL_MAX_DEVICES):
        if not pl_devs[i].ready:
            continue
        pthread_mutex_lock(&pl_locks[i])
        s = pl_get(&pl_devs[i], <uint64_t>ptr)
        if s >= 0:
            b = &pl_devs[i].bk[s]
            if b.allocated and <uint64_t>stream != b.stream and (
                    b.uses == 0 or b.use_stream != <uint64_t>stream):
                b.uses += 1
                b.use_stream = <uint64_t>stream
        pthread_mutex_unlock(&pl_locks[i])
        if s >= 0:
            return


# ------------------------------------------------------------------------------ Python side
#: The names PyTorch's CUDAPluggableAllocator loads, by hook.
PLUGGABLE_SYMBOLS = {
    "alloc": "gpudash_torch_malloc", "free": "gpudash_torch_free",
    "init": "gpudash_torch_init", "reset": "gpudash_torch_reset",
    "memory_fraction": "gpudash_torch_memory_fraction",
    "base_alloc": "gpudash_torch_base_alloc", "record_stream": "gpudash_torch_record_stream",
}


def pluggable_bind_cuda(path):
    """Reach libcudart at ``path`` (the one PyTorch loaded) through function pointers."""
    global cu_malloc, cu_free, cu_meminfo, cu_getdev, cu_setdev, cu_stream_sync, cu_dev_sync
    cdef bytes b = str(path).encode()
    cdef void* h = dlopen(b, RTLD_NOW | RTLD_GLOBAL)
    if h == NULL:
        raise BackendUnavailableError(f"cannot load the CUDA runtime {path}: "
                                      f"{(<bytes>dlerror()).decode(errors='replace')}")
    names = (b"cudaMalloc", b"cudaFree", b"cudaMemGetInfo", b"cudaGetDevice",
             b"cudaSetDevice", b"cudaStreamSynchronize", b"cudaDeviceSynchronize")
    found = {}
    for name in names:
        sym = dlsym(h, <const char*>name)
        if sym == NULL:
            raise BackendUnavailableError(f"the CUDA runtime {path} has no {name.decode()}")
        found[name] = <size_t>sym
    cu_malloc = <cuda_malloc_t><size_t>found[b"cudaMalloc"]
    cu_free = <cuda_free_t><size_t>found[b"cudaFree"]
    cu_meminfo = <cuda_meminfo_t><size_t>found[b"cudaMemGetInfo"]
    cu_getdev = <cuda_getdev_t><size_t>found[b"cudaGetDevice"]
    cu_setdev = <cuda_setdev_t><size_t>found[b"cudaSetDevice"]
    cu_stream_sync = <cuda_sync_t><size_t>found[b"cudaStreamSynchronize"]
    cu_dev_sync = <cuda_devsync_t><size_t>found[b"cudaDeviceSynchronize"]


def pluggable_setup(backend, total=0, on_oom="abort", allocator="torch", allow_growth=True,
                    garbage_collection=False):
    """Choose the backend (``"cuda"``: pluggable_bind_cuda first; ``"host"``: host memory,
    ``total`` bytes a device), what an out-of-memory does (``"abort"`` or ``"null"``) and
    the allocator the hooks run: ``"torch"`` (PyTorch's caching allocator) or ``"bfc"``
    (TensorFlow's, with ``allow_growth`` and ``garbage_collection``). Refused while any
    device holds memory."""
    global pl_backend, pl_host_total, pl_on_oom, pl_kind, pl_bf_growth_default
    global pl_bf_gc_default
    cdef int i
    if backend not in ("cuda", "host"):
        raise ValueError(f"backend must be 'cuda' or 'host'; got {backend!r}")
    if allocator not in ("torch", "bfc"):
        raise ValueError(f"allocator must be 'torch' or 'bfc'; got {allocator!r}")
    if on_oom not in ("abort", "null"):
        raise ValueError(f"on_oom must be 'abort' or 'null'; got {on_oom!r}")
    if backend == "cuda" and cu_malloc == NULL:
        raise BackendUnavailableError("the CUDA runtime is not bound (pluggable_bind_cuda)")
    for i in range(PL_MAX_DEVICES):
        if pl_devs[i].reserved:
            raise GpudashError(f"gpudash's installed allocator holds memory on cuda:{i}; "
                               "its backend cannot change now")
    pl_on_oom = PL_ON_OOM_ABORT if on_oom == "abort" else PL_ON_OOM_NULL
    if backend == "host":
        if int(total) <= 0:
            raise ValueError(f"total must be > 0 bytes for the host backend; got {total!r}")
        pl_host_total = int(total)
    for i in range(PL_MAX_DEVICES):
        pl_reset_device(i)
    pl_kind = PL_KIND_BFC if allocator == "bfc" else PL_KIND_TORCH
    pl_bf_growth_default = bool(allow_growth)
    pl_bf_gc_default = bool(garbage_collection)
    pl_backend = PL_BACKEND_HOST if backend == "host" else PL_BACKEND_CUDA


cdef void pl_reset_device(int i) noexcept:
    cdef PLDev* d = &pl_devs[i]
    c_free(d.bk)
    c_free(d.free_slots)
    c_free(d.hk)
    c_free(d.hv)
    c_free(d.pools[0].k)
    c_free(d.pools[1].k)
    memset(d, 0, sizeof(PLDev))


def pluggable_settings(int device, max_split_size=None, max_non_split_rounding_size=None,
                       fraction=None, memory_limit=None, allow_growth=None,
                       garbage_collection=None):
    """Change a device's settings live: ``max_split_size`` (bytes, None: unset; blocks
    already cached stay as they are), ``max_non_split_rounding_size``, ``fraction``; for
    the BFC, ``fraction`` sets the limit to that share of the device's total, or
    ``memory_limit`` in bytes (before the first allocation: as the BFC is constructed;
    after: gpudash.bfc.BFCAllocator.set_memory_limit's live rule), ``allow_growth`` and
    ``garbage_collection``."""
    cdef PLDev* d
    cdef bint bfc = pl_kind == PL_KIND_BFC, fresh
    cdef int64_t limit = -1
    if device < 0 or device >= PL_MAX_DEVICES:
        raise ValueError(f"device must be 0..{PL_MAX_DEVICES - 1}; got {device}")
    if fraction is not None and not (0.0 <= float(fraction) <= 1.0):
        raise ValueError(f"fraction must be in [0, 1]; got {fraction}")
    if not bfc and (memory_limit is not None or allow_growth is not None or
                    garbage_collection is not None):
        raise ValueError("memory_limit, allow_growth and garbage_collection are the BFC's "
                         "settings (pluggable_setup(allocator='bfc'))")
    if bfc and max_split_size is not None:
        raise ValueError("max_split_size is PyTorch's caching allocator's setting; the BFC "
                         "has none")
    if memory_limit is not None:
        limit = int(memory_limit)
        if limit < 0 or limit > (1 << 62):
            raise ValueError(f"memory_limit must be 0..2**62 bytes; got {memory_limit}")
    if max_split_size is not None and int(max_split_size) <= (20 << 20):
        raise ValueError("max_split_size must be more than 20 MiB (PyTorch's "
                         f"max_split_size_mb > 20); got {max_split_size}")
    pl_ready(device)
    d = &pl_devs[device]
    with nogil:
        pthread_mutex_lock(&pl_locks[device])
    try:
        if d.mss == 0:
            d.mss = pl_default_mss
            d.tol = pl_default_tol
        d.mss = pl_default_mss if max_split_size is None else <uint64_t>int(max_split_size)
        if max_non_split_rounding_size is not None:
            d.tol = int(max_non_split_rounding_size)
        if fraction is not None:
            d.fraction = float(fraction)
            d.set_fraction = True
            if d.ready:
                pl_set_fraction(d, d.fraction)
                if limit < 0:
                    limit = d.allowed
        if bfc and d.ready:
            fresh = d.reserved == 0 and d.n_alloc_calls == 0
            if allow_growth is not None:
                if fresh:
                    d.bf_growth = bool(allow_growth)
                    bf_construct(d, d.bf_limit)
                else:
                    bf_set_growth(d, bool(allow_growth))
            if garbage_collection is not None:
                d.bf_gc = bool(garbage_collection)
            if limit >= 0:
                if fresh:
                    bf_construct(d, limit)
                else:
                    bf_set_limit(d, device, limit)
    finally:
        pthread_mutex_unlock(&pl_locks[device])


cdef list pl_stat_list(const int64_t* s, int n):
    return [s[i] for i in range(n)]


def pluggable_state(int device, blocks="rows"):
    """One consistent reading of a device: its statistics (gpudash.caching._Stats' numbers),
    counters, settings and blocks, the last out-of-memory failures, and (``"bfc"``) the
    BFC's own figures and settings.

    ``blocks``: ``"rows"`` gives the blocks as tuples ``(ptr, size, requested, stream, pool,
    allocated, segment_head, allocation_id)``, by address (the id is the BFC's, -1 when free
    or for the caching allocator); ``"columns"`` the same as numpy arrays by those names
    (``ptr``, ``size``, ``requested``, ``aid``: int64; ``stream``: uint64; ``pool``: int8;
    ``allocated``, ``head``: bool), by address, read in C (what a dashboard's refresh
    takes: ~1 ms for 30,000 blocks, where rows take ~30); ``None`` reads no block (the
    figures alone)."""
    cdef PLDev* d
    cdef PLDev copy
    cdef PLBlock* bl = NULL
    cdef int32_t i, nb = 0, nlive = 0, j
    cdef int64_t k, first
    cdef bint want = blocks is not None
    cdef int64_t[::1] c_ptr, c_size, c_req, c_aid
    cdef uint64_t[::1] c_stream
    cdef int8_t[::1] c_pool, c_alloc, c_head
    if blocks not in ("rows", "columns", None):
        raise ValueError(f"blocks must be 'rows', 'columns' or None; got {blocks!r}")
    if device < 0 or device >= PL_MAX_DEVICES:
        raise ValueError(f"device must be 0..{PL_MAX_DEVICES - 1}; got {device}")
    d = &pl_devs[device]
    with nogil:
        pthread_mutex_lock(&pl_locks[device])
        copy = d[0]
        if want and d.nbk:
            bl = <PLBlock*>c_malloc(d.nbk * sizeof(PLBlock))
            if bl != NULL:
                memcpy(bl, d.bk, d.nbk * sizeof(PLBlock))
                nb = d.nbk
        pthread_mutex_unlock(&pl_locks[device])
    if want and copy.nbk and bl == NULL:
        raise MemoryError()
    rows = None
    try:
        if blocks == "rows":
            rows = []
            for i in range(nb):
                if bl[i].live:
                    rows.append((bl[i].ptr, bl[i].size, bl[i].requested,
                                 bl[i].stream, bl[i].pool, bool(bl[i].allocated),
                                 bl[i].prev < 0,
                                 bl[i].aid if bl[i].allocated and pl_kind == PL_KIND_BFC
                                 else -1))
            rows.sort()
        elif blocks == "columns":
            for i in range(nb):
                nlive += bl[i].live
            cols = {"ptr": np.empty(nlive, np.int64), "size": np.empty(nlive, np.int64),
                    "requested": np.empty(nlive, np.int64),
                    "stream": np.empty(nlive, np.uint64), "pool": np.empty(nlive, np.int8),
                    "allocated": np.empty(nlive, np.int8), "head": np.empty(nlive, np.int8),
                    "aid": np.empty(nlive, np.int64)}
            c_ptr, c_size, c_req, c_aid = cols["ptr"], cols["size"], cols["requested"], \
                cols["aid"]
            c_stream, c_pool, c_alloc, c_head = cols["stream"], cols["pool"], \
                cols["allocated"], cols["head"]
            j = 0
            for i in range(nb):
                if not bl[i].live:
                    continue
                c_ptr[j] = <int64_t>bl[i].ptr
                c_size[j] = bl[i].size
                c_req[j] = bl[i].requested
                c_stream[j] = bl[i].stream
                c_pool[j] = bl[i].pool
                c_alloc[j] = bl[i].allocated != 0
                c_head[j] = bl[i].prev < 0
                c_aid[j] = bl[i].aid if bl[i].allocated and pl_kind == PL_KIND_BFC else -1
                j += 1
            order = np.argsort(cols["ptr"], kind="stable")
            rows = {name: (a[order].astype(bool) if name in ("allocated", "head")
                           else a[order]) for name, a in cols.items()}
    finally:
        c_free(bl)
    first = copy.oom_count - PL_OOM_RING if copy.oom_count > PL_OOM_RING else 0
    ooms = [(copy.oom_t[k % PL_OOM_RING], copy.oom_rounded[k % PL_OOM_RING],
             copy.oom_requested[k % PL_OOM_RING]) for k in range(first, copy.oom_count)]
    return {
        "ready": bool(copy.ready),
        "backend": {PL_BACKEND_HOST: "host", PL_BACKEND_CUDA: "cuda"}.get(pl_backend),
        "stats": {name: pl_stat_list(copy.st[j], 12) for j, name in enumerate(_PL_STAT_NAMES)},
        "oversize_allocations": pl_stat_list(copy.over_alloc, 4),
        "oversize_segments": pl_stat_list(copy.over_seg, 4),
        "num_alloc_retries": copy.n_retries, "num_ooms": copy.n_ooms,
        "num_sync_all_streams": copy.n_sync, "num_device_alloc": copy.n_dev_alloc,
        "num_device_free": copy.n_dev_free,
        "reserved": copy.reserved, "peak_reserved": copy.peak_reserved,
        "total": copy.total, "allowed": copy.allowed if copy.set_fraction else None,
        "fraction": copy.fraction if copy.set_fraction else None,
        "max_split_size": (None if copy.mss == 0 or copy.mss == pl_default_mss
                           else copy.mss),
        "max_non_split_rounding_size": copy.tol or pl_default_tol,
        "allocs": copy.n_alloc_calls, "frees": copy.n_free_calls,
        "stream_waits": copy.n_stream_syncs, "oom_count": copy.oom_count,
        "ooms": ooms, "blocks": rows,
        "allocator": "bfc" if pl_kind == PL_KIND_BFC else "torch",
        "bfc": None if pl_kind != PL_KIND_BFC else {
            "memory_limit": copy.bf_limit, "allow_growth": bool(copy.bf_growth),
            "garbage_collection": bool(copy.bf_gc),
            "curr_region_allocation_bytes": copy.bf_curr,
            "pool_over_limit": bool(copy.bf_capped), "num_allocs": copy.bf_num_allocs,
            "largest_alloc_size": copy.bf_largest, "next_allocation_id": copy.bf_next_aid,
            "default_limit": copy.bf_default_limit},
    }


def pluggable_reset_peaks(int device):
    """``reset_peak_memory_stats``: every peak back to its current value."""
    cdef PLDev* d = &pl_devs[device]
    cdef int j, t
    with nogil:
        pthread_mutex_lock(&pl_locks[device])
        for j in range(PS_N):
            for t in range(3):
                d.st[j][4 * t + 1] = d.st[j][4 * t]
        d.over_alloc[1] = d.over_alloc[0]
        d.over_seg[1] = d.over_seg[0]
        d.peak_reserved = d.reserved
        pthread_mutex_unlock(&pl_locks[device])


def pluggable_empty_cache(int device=-1):
    """``empty_cache`` on one device (or all, -1), the GIL released; the bytes returned."""
    cdef int64_t before = 0, after = 0
    cdef int i
    with nogil:
        for i in range(PL_MAX_DEVICES):
            if (device < 0 or i == device) and pl_devs[i].ready:
                pthread_mutex_lock(&pl_locks[i])
                before += pl_devs[i].reserved
                if pl_kind == PL_KIND_BFC:
                    bf_release_all(&pl_devs[i], i)
                else:
                    pl_release_cached(&pl_devs[i], i)
                after += pl_devs[i].reserved
                pthread_mutex_unlock(&pl_locks[i])
    return before - after


def pluggable_bench(int64_t pairs, int device=0):
    """benchmarks/bench_install.py: ns per alloc/free pair through the hooks, driven from a
    C loop with the GIL released (sizes cycling over both pools, one in 8 kept live for 64
    pairs, so blocks split and merge)."""
    cdef int64_t i, t0, t1, k
    cdef size_t n
    cdef size_t sizes[8]
    cdef void* keep[64]
    cdef size_t keep_n[64]
    cdef void* p
    sizes[:] = [512, 4096, 65536, 300000, 2 << 20, 6 << 20, 24 << 20, 1000]
    memset(keep, 0, sizeof(keep))
    with nogil:
        t0 = now_ns()
        for i in range(pairs):
            n = sizes[i & 7]
            p = gpudash_torch_malloc(n, device, NULL)
            if i & 7 == 0:
                k = (i >> 3) & 63
                if keep[k] != NULL:
                    gpudash_torch_free(keep[k], keep_n[k], device, NULL)
                keep[k] = p
                keep_n[k] = n
            else:
                gpudash_torch_free(p, n, device, NULL)
        t1 = now_ns()
        for k in range(64):
            if keep[k] != NULL:
                gpudash_torch_free(keep[k], keep_n[k], device, NULL)
    return (t1 - t0) / <double>pairs if pairs > 0 else 0.0
