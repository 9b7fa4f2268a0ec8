# PyTorch's CUDA caching allocator: the state of gpudash.caching.CachingAllocator in C
# arrays, and every operation that changes it. Included by _core.pyx;
# gpudash.caching.PyCachingAllocator is the reference it is held to, decision for decision
# (each method below names the Python one it mirrors).

cdef struct TBlock:
    uint64_t ptr
    int64_t size
    int64_t requested
    uint64_t stream
    int64_t gc_base
    int64_t aid
    int64_t ins         # when its address entered the address table (dict order)
    int32_t prev        # slots; -1: none
    int32_t next
    int32_t es          # expandable segment slot; -1: a cudaMalloc segment
    int8_t pool         # 0 small, 1 large
    int8_t allocated
    int8_t mapped
    int8_t live         # the slot holds a block
    int16_t pbin        # while in its pool: its bin there
    int32_t ppos        # its place in that bin; -1: not in its pool; PPOS_SORTED: a sorted bin


cdef struct TES:
    uint64_t base
    int64_t page
    int64_t max_pages
    uint64_t stream
    int8_t pool
    int8_t live
    int64_t nh          # len(handles): the last mapped page + 1
    int64_t cap
    uint64_t* handles   # 0: not mapped


cdef enum:
    ST_ALLOCATION = 0
    ST_SEGMENT = 1
    ST_INACTIVE_SPLIT = 2
    ST_ALLOCATED_BYTES = 3
    ST_RESERVED_BYTES = 4
    ST_INACTIVE_SPLIT_BYTES = 5
    ST_REQUESTED_BYTES = 6
    N_STATS = 7

cdef int64_t KMIN_BLOCK = 512
cdef int64_t KSMALL_SIZE = 1 << 20
cdef int64_t KSMALL_BUFFER = 2 << 20
cdef int64_t KLARGE_BUFFER = 20 << 20
cdef int64_t KMIN_LARGE_ALLOC = 10 << 20
cdef int64_t KROUND_LARGE = 2 << 20
cdef int64_t K_ONE_EXA = 1 << 60

# the names of DeviceStats' per-pool statistics, in _Stats.pool's order
_STAT_NAMES = ("allocation", "segment", "inactive_split", "allocated_bytes",
               "reserved_bytes", "inactive_split_bytes", "requested_bytes")
_A_ALLOC = "alloc"
_A_FREE_REQ = "free_requested"
_A_FREE_DONE = "free_completed"
_A_SEG_ALLOC = "segment_alloc"
_A_SEG_FREE = "segment_free"
_A_SEG_MAP = "segment_map"
_A_SEG_UNMAP = "segment_unmap"
_A_OOM = "oom"


# A statistic of DeviceStats (current, peak, allocated, freed for the aggregate and each
# stat type) is kept in ST_WIDTH numbers: the aggregate's current and peak, then for each
# type (1 small, 2 large, at st_at(t)) its current, peak, allocated and a base, its freed
# being allocated - current + base. Every change moves the aggregate and one type together,
# so the aggregate's allocated and freed are the types' sums (st_read gives all twelve).
cdef enum:
    ST_WIDTH = 10


cdef inline int st_at(int t) noexcept nogil:
    return (t << 2) - 2


cdef extern from *:
    """
    /* st_inc (a statistic up by n for the aggregate and stat type t), in C so that it is
       inlined everywhere: a free or an allocation moves three to five statistics, and the
       compiler's inlining budget for the operations that call it is otherwise spent. */
    #if defined(__GNUC__)
    #define GD_ALWAYS_INLINE static inline __attribute__((always_inline))
    #else
    #define GD_ALWAYS_INLINE static inline
    #endif
    GD_ALWAYS_INLINE void gd_st_inc(int64_t *s, int t, int64_t n) {
        int64_t c = s[0] + n;
        int j = (t << 2) - 2;
        s[0] = c;
        if (c > s[1]) s[1] = c;
        c = s[j] + n;
        s[j] = c;
        if (c > s[j + 1]) s[j + 1] = c;
        s[j + 2] += n;
    }
    """
    # _inc: a statistic up by n for the aggregate and stat type t (1 small, 2 large): its
    # current and peak, and the type's current, peak and allocated (st_at)
    void st_inc "gd_st_inc"(int64_t* s, int t, int64_t n) noexcept nogil


cdef inline void st_dec(int64_t* s, int t, int64_t n) noexcept nogil:
    """_dec: a statistic down by n (freed up by n) for the aggregate and stat type t."""
    s[0] -= n
    s[st_at(t)] -= n


cdef list st_read(const int64_t* s):
    """A statistic's twelve numbers as the pure model keeps them: (current, peak, allocated,
    freed) for the aggregate, small and large."""
    cdef int64_t a1 = s[4], a2 = s[8]
    cdef int64_t f1 = s[4] - s[2] + s[5], f2 = s[8] - s[6] + s[9]
    return [s[0], s[1], a1 + a2, f1 + f2, s[2], s[3], a1, f1, s[6], s[7], a2, f2]


cdef inline void st_inc1(int64_t* s, int64_t n) noexcept:
    cdef int64_t c = s[0] + n
    s[0] = c
    if c > s[1]:
        s[1] = c
    s[2] += n


cdef inline void st_dec1(int64_t* s, int64_t n) noexcept:
    s[0] -= n
    s[3] += n


cdef inline int64_t allocation_size(int64_t size) noexcept:
    if size <= KSMALL_SIZE:
        return KSMALL_BUFFER
    if size < KMIN_LARGE_ALLOC:
        return KLARGE_BUFFER
    return (size + KROUND_LARGE - 1) // KROUND_LARGE * KROUND_LARGE


cdef inline Key bkey(const TBlock* b) noexcept:
    """A free mapped block's key in its pool: (stream, size, address)."""
    cdef Key k
    k.a = b.stream
    k.b = <uint64_t>b.size
    k.c = b.ptr
    return k


cdef inline Key ukey(uint64_t stream, uint64_t ptr) noexcept:
    """An unmapped stretch's key: (stream, address)."""
    cdef Key k
    k.a = stream
    k.b = ptr
    k.c = 0
    return k


# ------------------------------------------------------------------------------ pools
# A pool's free blocks, as PyTorch's BlockPool orders them: by (stream, size, address). They
# are kept in bins by size (sixteen to a power of two), each bin an unordered array of
# entries: a block records its bin and its place there, so it joins and leaves a bin in a
# few instructions (the bin's last entry takes the place of one that leaves), without a
# search. A bin remembers its least entry and the next least; when both have left, the next
# question finds them again in one pass. Every question the allocator asks of a pool is
# about one stream: the least key of that stream at or after a size, the next key of the
# stream, the last one below a key. The bin of the size answers from its least entry or the
# next least, else from all its entries; the non-empty bins after it (a bit mask says which)
# from their least entry. The answers are those of the one sorted set, which the pool's
# readers see (ps_sorted sorts the entries). Sixteen bins to a power of two, not four: the
# sizes that share a bin then differ by less than a sixteenth, so a bin holds fewer entries
# to look through again when its least two have left (on `finetune` those passes cost 30
# instructions an event, 41 with four bins; 8 bins gave 585.6 instructions an event in all,
# 16 581.0, 4 600.1); the bins of a pool take 32 KiB. The moves of entries and of the
# remembered indexes are selections, not branches: which entry leaves a bin is data the
# branch predictor cannot learn.
#
# A bin that grows past pb_big entries (256: many cached blocks of one size; real snapshots
# hold 100 to 300 in one bin, a model of many small tensors thousands) keeps its keys sorted
# instead (an SSet, as the BFC's bins), so that finding its least entries again is not a
# pass over all of them: every question is then a binary search. Its blocks record
# PPOS_SORTED for their place, a place in it is a negative PPos.i, and a key's block is
# found by its address (the allocator's address table, PoolSet.addr). Its array's capacity
# is kept equal to its entries, so that an insert meets it in the branch an array takes when
# it is full (an insert into an array tests nothing more; a search tests the bin's form, or
# the sign of PPos.i). The bin goes back to an array when it empties.

cdef extern from *:
    """
    /* a condition the hot paths seldom meet (a sorted bin): its branch laid out of line */
    #define gd_rare(x) __builtin_expect(!!(x), 0)
    """
    bint gd_rare(bint) nogil


cdef enum:
    PS_BINS = 1024
    PS_WORDS = 16
    PPOS_SORTED = 0x7FFFFFFF    # TBlock.ppos of a block in a sorted bin


cdef struct PEnt:
    Key k               # (stream, size, address)
    int64_t slot        # the block's record


cdef struct PBin:
    PEnt* e
    int32_t n           # entries, in either form
    int32_t cap
    int32_t lo          # the least entry's index (meaningful while n > 0); -1: not known
    int32_t lo2         # the next least entry's index; -1: not known (or none)
    SSet* sorted        # NULL: the entries are e[:n], unordered; else their keys, sorted


cdef struct PoolSet:
    PBin bins[1024]     # arrays made on first use (e NULL until then)
    uint64_t mask[16]   # the non-empty bins
    Py_ssize_t size
    int64_t largest     # the largest size of a key (0: none); -1: not known
    const PMap* addr    # address -> block slot: the blocks of sorted bins


cdef struct PPos:
    int bin
    int i               # the place in the bin's array; in a sorted bin's set: ~((block << 6)
                        # | place in the block), negative, so that a test of i tells which


cdef inline int ps_bin(uint64_t size) noexcept nogil:
    """The bin of a size: sixteen per power of two, in the order of sizes."""
    cdef int l
    if size < 16:
        return <int>size
    l = 63 - __builtin_clzll(size)
    return (l << 4) | <int>((size >> (l - 4)) & 15)


cdef inline int ps_next_bin(const PoolSet* p, int b) noexcept nogil:
    """The first non-empty bin after b; -1 when none."""
    cdef int w
    cdef uint64_t m
    b += 1
    if b >= PS_BINS:
        return -1
    w = b >> 6
    m = p.mask[w] & ((~<uint64_t>0) << (b & 63))
    while True:
        if m:
            return (w << 6) | __builtin_ctzll(m)
        w += 1
        if w == PS_WORDS:
            return -1
        m = p.mask[w]


cdef inline int ps_prev_bin(const PoolSet* p, int b) noexcept nogil:
    """The last non-empty bin before b; -1 when none."""
    cdef int w, sh
    cdef uint64_t m
    b -= 1
    if b < 0:
        return -1
    w = b >> 6
    sh = 63 - (b & 63)
    m = (p.mask[w] << sh) >> sh
    while True:
        if m:
            return (w << 6) | (63 - __builtin_clzll(m))
        w -= 1
        if w < 0:
            return -1
        m = p.mask[w]


cdef void ps_free(PoolSet* p) noexcept:
    cdef int b
    for b in range(PS_BINS):
        PyMem_Free(p.bins[b].e)
        p.bins[b].e = NULL
        p.bins[b].n = p.bins[b].cap = 0
        pb_unsort(&p.bins[b])
    memset(p.mask, 0, sizeof(p.mask))
    p.size = 0
    p.largest = 0


cdef void pb_unsort(PBin* pb) noexcept:
    """An emptied sorted bin becomes an array again."""
    if pb.sorted != NULL:
        ss_free(pb.sorted)
        PyMem_Free(pb.sorted)
        pb.sorted = NULL
        pb.lo = pb.lo2 = -1
        pb.cap = 0


cdef bint pb_sort(PBin* pb, TBlock* bk) noexcept:
    """A full bin of pb_big entries or more keeps them sorted from now on. False (the bin
    stays an array) when the memory for it cannot be had."""
    cdef int32_t i, n = pb.n
    cdef Key* keys = <Key*>PyMem_Malloc(n * sizeof(Key))
    cdef SSet* ss = <SSet*>PyMem_Calloc(1, sizeof(SSet))
    cdef bint ok = keys != NULL and ss != NULL
    if ok:
        for i in range(n):
            keys[i] = pb.e[i].k
        qsort(keys, n, sizeof(Key), key_cmp)
        ok = ss_load(ss, keys, n)
    PyMem_Free(keys)
    if not ok:
        PyMem_Free(ss)
        return False
    for i in range(n):
        bk[pb.e[i].slot].ppos = PPOS_SORTED
    pb.sorted = ss
    PyMem_Free(pb.e)
    pb.e = NULL
    pb.cap = pb.n     # a sorted bin keeps cap == n: every insert takes ps_insert's rare branch
    return True


cdef inline Key* pb_key(const PBin* pb, int32_t i) noexcept nogil:
    """The key at place i of a bin (of either form)."""
    if pb.sorted == NULL:
        return &pb.e[i].k
    return &pb.sorted.blk[i >> 6][i & 63]


cdef inline int32_t ps_slot_of(const PoolSet* p, const Key* k) noexcept nogil:
    """The block of a key in a sorted bin, by its address."""
    cdef int64_t v = -1
    pm_get(p.addr, k.c, &v)
    return <int32_t>v


cdef inline bint pb_lower(const PBin* pb, const Key* want, int32_t* i) noexcept nogil:
    """A sorted bin's place of the first key at or after want; False when none."""
    cdef int bi, j
    if not ss_lower_bound(pb.sorted, want, &bi, &j):
        return False
    i[0] = (bi << 6) | j
    return True


cdef int32_t pb_next_sorted(const PBin* pb, uint64_t stream, int32_t i) noexcept nogil:
    """The place after i in a sorted bin when its key is of this stream; -1 when not (this
    stream's next key, if any, is in a later bin)."""
    cdef int bi = i >> 6, j = i & 63
    if ss_next(pb.sorted, &bi, &j) and pb.sorted.blk[bi][j].a == stream:
        return (bi << 6) | j
    return -1


cdef bint ps_first_sorted(const PoolSet* p, int b, uint64_t stream, uint64_t size,
                          PPos* at) noexcept nogil:
    """Sorted bin b's first key at or after (stream, size, 0), when it is of this stream
    (out of line: the common case is an array)."""
    cdef const PBin* pb = &p.bins[b]
    cdef int32_t i
    cdef Key want
    want.a = stream
    want.b = size
    want.c = 0
    if not pb_lower(pb, &want, &i) or pb_key(pb, i).a != stream:
        return False
    at.bin = b
    at.i = ~i
    return True


cdef int pb_grow(PBin* pb) except -1:
    cdef int32_t cap = pb.cap * 2 if pb.cap else 4
    cdef PEnt* e = <PEnt*>PyMem_Realloc(pb.e, cap * sizeof(PEnt))
    if e == NULL:
        raise MemoryError()
    if pb.cap == 0:
        pb.lo = pb.lo2 = -1    # an empty bin knows no least entries
    pb.e = e
    pb.cap = cap
    return 0


cdef inline void ps_joined(PoolSet* p, const TBlock* blk, int b) noexcept:
    """The pool's mask, size and largest size after block blk joined bin b."""
    cdef int64_t largest = p.largest
    p.mask[b >> 6] |= (<uint64_t>1) << (b & 63)
    p.size += 1
    p.largest = blk.size if largest >= 0 and blk.size > largest else largest


cdef int ps_insert_sorted(PoolSet* p, TBlock* bk, int32_t s, int b) except -1:
    """ps_insert into a sorted bin (out of line: the common case is an array)."""
    cdef PBin* pb = &p.bins[b]
    ss_insert(pb.sorted, bkey(&bk[s]))
    pb.n += 1
    pb.cap = pb.n
    bk[s].pbin = <int16_t>b
    bk[s].ppos = PPOS_SORTED
    ps_joined(p, &bk[s], b)
    return 0


# A bin's array (4, 8, 16, ... entries) that is full with at least this many is sorted
# instead of grown. Tests set it lower (_set_sorted_bins_at), so that bins change form often.
cdef int32_t pb_big = 256


def _set_sorted_bins_at(int32_t n):
    """Sort a pool's bin from now on when its full array holds ``n`` entries or more (256 by
    default; at least 4); the old value."""
    global pb_big
    if n < 4:
        raise ValueError(f"the sorted-bin size must be at least 4; got {n}")
    old = pb_big
    pb_big = n
    return old


cdef int pb_full(PoolSet* p, TBlock* bk, int32_t s, int b) except -1:
    """An insert into bin b when its array is full (or it is sorted): the array grows (0),
    or, at pb_big entries, the bin is sorted from now on; a sorted bin takes the key (1)."""
    cdef PBin* pb = &p.bins[b]
    if pb.sorted == NULL and (pb.n < pb_big or not pb_sort(pb, bk)):
        pb_grow(pb)
        return 0
    ps_insert_sorted(p, bk, s, b)
    return 1


# ps_insert calls pb_full through this pointer: a direct call would be inlined (its only
# caller), and ps_insert, with the sorting inside it, would grow from 150 machine
# instructions to 550 and cost its every call more
cdef int (*pb_full_at)(PoolSet*, TBlock*, int32_t, int) except -1
pb_full_at = pb_full


cdef inline int ps_insert(PoolSet* p, TBlock* bk, int32_t s) except -1:
    """Block s joins its pool (its key made from its record)."""
    cdef TBlock* blk = &bk[s]
    cdef int b = ps_bin(<uint64_t>blk.size)
    cdef PBin* pb = &p.bins[b]
    cdef int32_t i = pb.n, lo = pb.lo, lo2
    cdef PEnt* e
    if i == pb.cap and pb_full_at(p, bk, s, b):
        return 0
    e = &pb.e[i]
    e.k = bkey(blk)
    e.slot = s
    pb.n = i + 1
    if lo >= 0:
        # the new entry may be the least, or the next least (when that one is known)
        if klt(&e.k, &pb.e[lo].k):
            pb.lo2 = lo
            pb.lo = i
        else:
            lo2 = pb.lo2
            if lo2 >= 0 and klt(&e.k, &pb.e[lo2].k):
                pb.lo2 = i
    else:
        pb.lo = -(i != 0)     # the only entry of a bin is its least
    blk.pbin = <int16_t>b
    blk.ppos = i
    ps_joined(p, blk, b)
    return 0


cdef inline void ps_remove(PoolSet* p, TBlock* bk, int b, int32_t i) noexcept:
    """The entry at (b, i) leaves its bin; the bin's last entry takes its place."""
    cdef PBin* pb = &p.bins[b]
    cdef int32_t last = pb.n - 1, lo = pb.lo, lo2 = pb.lo2
    cdef int64_t s = pb.e[i].slot
    cdef bint gone = lo == i
    p.largest = -1 if <int64_t>pb.e[i].k.b == p.largest else p.largest
    # the least entries: the leaving one forgotten (the next least becomes the least), the
    # last entry's index now i; written as selections, not branches
    lo = lo2 if gone else lo
    lo2 = -1 if gone or lo2 == i else lo2
    pb.lo = i if lo == last else lo
    pb.lo2 = i if lo2 == last else lo2
    pb.e[i] = pb.e[last]
    bk[pb.e[i].slot].ppos = i
    bk[s].ppos = -1
    pb.n = last
    p.size -= 1
    p.mask[b >> 6] &= ~((<uint64_t>(last == 0)) << (b & 63))


cdef void ps_remove_sorted(PoolSet* p, TBlock* bk, int b, int32_t i, int32_t s) noexcept:
    """The key at place i of sorted bin b, block s's, leaves it."""
    cdef PBin* pb = &p.bins[b]
    cdef Key* k = pb_key(pb, i)
    p.largest = -1 if <int64_t>k.b == p.largest else p.largest
    ss_erase_at(pb.sorted, i >> 6, i & 63)
    bk[s].ppos = -1
    pb.n -= 1
    pb.cap = pb.n
    p.size -= 1
    if pb.n == 0:
        pb_unsort(pb)
        p.mask[b >> 6] &= ~((<uint64_t>1) << (b & 63))


cdef void ps_erase_sorted(PoolSet* p, TBlock* bk, int32_t s) noexcept:
    """ps_erase from a sorted bin: the block's key found by a search (out of line)."""
    cdef int32_t i = 0
    cdef Key k = bkey(&bk[s])
    pb_lower(&p.bins[bk[s].pbin], &k, &i)
    ps_remove_sorted(p, bk, bk[s].pbin, i, s)


cdef void ps_drop(PoolSet* p, TBlock* bk, int32_t s) noexcept:
    """ps_erase's work, out of line (the merges of a free call it twice)."""
    cdef int32_t i = bk[s].ppos
    if i == PPOS_SORTED:
        ps_erase_sorted(p, bk, s)
    else:
        ps_remove(p, bk, bk[s].pbin, i)


cdef inline bint ps_erase(PoolSet* p, TBlock* bk, int32_t s) noexcept:
    """Block s leaves its pool (``del keys[bisect_left(keys, key)]``); False when it is not
    in it."""
    if bk[s].ppos < 0:
        return False
    ps_drop(p, bk, s)
    return True


cdef inline Key* ps_at(const PoolSet* p, const PPos* at) noexcept nogil:
    return pb_key(&p.bins[at.bin], ~at.i if at.i < 0 else at.i)


cdef int32_t ps_slot_sorted(const PoolSet* p, const PPos* at) noexcept nogil:
    """The block of a place in a sorted bin, by its address (out of line)."""
    return ps_slot_of(p, pb_key(&p.bins[at.bin], ~at.i))


cdef inline int32_t ps_slot(const PoolSet* p, const PPos* at) noexcept nogil:
    if gd_rare(at.i < 0):
        return ps_slot_sorted(p, at)
    return <int32_t>p.bins[at.bin].e[at.i].slot


cdef void ps_erase_at_sorted(PoolSet* p, TBlock* bk, const PPos* at) noexcept:
    ps_remove_sorted(p, bk, at.bin, ~at.i, ps_slot_sorted(p, at))


cdef inline void ps_erase_at(PoolSet* p, TBlock* bk, const PPos* at) noexcept:
    if gd_rare(at.i < 0):
        ps_erase_at_sorted(p, bk, at)
    else:
        ps_remove(p, bk, at.bin, at.i)


cdef void pb_rescan(PBin* pb) noexcept nogil:
    """Find a non-empty bin's least and next least entries again (out of line: the callers
    inline the common case, where they are known)."""
    cdef int32_t i, best = 0, second = -1
    for i in range(1, pb.n):
        if klt(&pb.e[i].k, &pb.e[best].k):
            second = best
            best = i
        elif second < 0 or klt(&pb.e[i].k, &pb.e[second].k):
            second = i
    pb.lo = best
    pb.lo2 = second


cdef inline int32_t pb_lo(PBin* pb) noexcept nogil:
    """The index of a non-empty bin's least entry (found again, with the next least, when
    both have left)."""
    if pb.lo < 0:
        pb_rescan(pb)
    return pb.lo


cdef int32_t pb_min_from(const PBin* pb, const Key* want, bint strict) noexcept nogil:
    """The index of the least entry of stream want.a at or after ``want`` (after it, when
    ``strict``); -1 when none."""
    cdef int32_t i, best = -1
    cdef const Key* k
    for i in range(pb.n):
        k = &pb.e[i].k
        if k.a != want.a:
            continue
        if strict:
            if not klt(want, k):
                continue
        elif klt(k, want):
            continue
        if best < 0 or klt(k, &pb.e[best].k):
            best = i
    return best


cdef int32_t pb_max_below(const PBin* pb, const Key* below) noexcept nogil:
    """The index of the greatest entry of stream below.a before ``below``; -1 when none."""
    cdef int32_t i, best = -1
    cdef const Key* k
    cdef int bi, j
    if pb.sorted != NULL:
        if ss_lower_bound(pb.sorted, below, &bi, &j):
            if not ss_prev(pb.sorted, &bi, &j):
                return -1
        else:
            bi = pb.sorted.nblk - 1
            j = pb.sorted.nb[bi] - 1
        if pb.sorted.blk[bi][j].a != below.a:
            return -1
        return (bi << 6) | j
    for i in range(pb.n):
        k = &pb.e[i].k
        if k.a != below.a or not klt(k, below):
            continue
        if best < 0 or klt(&pb.e[best].k, k):
            best = i
    return best


cdef inline bint ps_first_of(PoolSet* p, int b, uint64_t stream, PPos* at) noexcept nogil:
    """The least key of stream in bin b (a non-empty bin): mostly the bin's least entry,
    when one stream is in use."""
    cdef PBin* pb = &p.bins[b]
    cdef int32_t i
    cdef uint64_t a0
    cdef Key want
    if gd_rare(pb.sorted != NULL):
        return ps_first_sorted(p, b, stream, 0, at)
    i = pb_lo(pb)
    a0 = pb.e[i].k.a
    if a0 != stream:
        if a0 > stream:
            return False
        want.a = stream
        want.b = 0
        want.c = 0
        i = pb_min_from(pb, &want, False)
        if i < 0:
            return False
    at.bin = b
    at.i = i
    return True


cdef inline bint ps_find(PoolSet* p, uint64_t stream, uint64_t size, PPos* at) noexcept nogil:
    """The first key at or after (stream, size, 0), when it is of this stream (the lower
    bound of the one sorted set); False when there is none."""
    cdef Key want
    cdef int b = ps_bin(size)
    cdef PBin* pb = &p.bins[b]
    cdef int32_t i, lo2
    cdef const Key* k
    if gd_rare(pb.sorted != NULL):
        if ps_first_sorted(p, b, stream, size, at):
            return True
    elif pb.n:
        # the least entry, else the next least (the least of the rest), else a search
        i = pb_lo(pb)
        k = &pb.e[i].k
        if not (k.a == stream and k.b >= size):
            lo2 = pb.lo2
            i = -1
            if lo2 >= 0:
                k = &pb.e[lo2].k
                if k.a == stream and k.b >= size:
                    i = lo2
            if i < 0 and pb.n > (2 if lo2 >= 0 else 1):
                want.a = stream
                want.b = size
                want.c = 0
                i = pb_min_from(pb, &want, False)
        if i >= 0:
            at.bin = b
            at.i = i
            return True
    # a later bin holds only larger sizes: its least key of this stream
    b = ps_next_bin(p, b)
    while b >= 0:
        if ps_first_of(p, b, stream, at):
            return True
        b = ps_next_bin(p, b)
    return False


cdef inline bint ps_next_same(PoolSet* p, uint64_t stream, PPos* at) noexcept nogil:
    """Step to the next key of the sorted set when it is of this stream; False (``at``
    unchanged) when it is not, or there is none."""
    cdef PBin* pb = &p.bins[at.bin]
    cdef int32_t i
    cdef int b
    if gd_rare(at.i < 0):
        i = pb_next_sorted(pb, stream, ~at.i)
        if i >= 0:
            at.i = ~i
            return True
    else:
        i = pb_min_from(pb, &pb.e[at.i].k, True)
        if i >= 0:
            at.i = i
            return True
    # this stream's next key, if any, is in a later bin (of larger sizes)
    b = ps_next_bin(p, at.bin)
    while b >= 0:
        if ps_first_of(p, b, stream, at):
            return True
        b = ps_next_bin(p, b)
    return False


cdef inline bint ps_prev_below(const PoolSet* p, uint64_t stream, const Key* probe,
                               PPos* at) noexcept nogil:
    """The key just before ``probe`` in the sorted set (probe of this stream), when it is of
    this stream; False when it is not, or there is none."""
    cdef Key below
    cdef int b = ps_bin(probe.b)
    cdef int32_t i = pb_max_below(&p.bins[b], probe)
    if i < 0:
        # the bins below hold smaller sizes: this stream's greatest key there, if any
        below.a = stream
        below.b = 0xFFFFFFFFFFFFFFFF
        below.c = 0xFFFFFFFFFFFFFFFF
        b = ps_prev_bin(p, b)
        while b >= 0:
            i = pb_max_below(&p.bins[b], &below)
            if i >= 0:
                break
            b = ps_prev_bin(p, b)
        if i < 0:
            return False
    at.bin = b
    at.i = ~i if p.bins[b].sorted != NULL else i
    return True


cdef inline int64_t ps_largest(PoolSet* p) noexcept nogil:
    """The largest size of a key (0: none): remembered, and found again in the last
    non-empty bin when a key of that size has left (a sampled replay asks after every
    call)."""
    cdef int b, bi, j
    cdef int32_t i
    cdef const PBin* pb
    cdef const Key* k
    cdef Key first
    cdef int64_t best = 0
    if p.largest >= 0:
        return p.largest
    b = ps_prev_bin(p, PS_BINS)
    if b >= 0:
        pb = &p.bins[b]
        if pb.sorted != NULL:
            # each stream's last key has its largest size: from the last key, stream by
            # stream down
            bi = pb.sorted.nblk - 1
            j = pb.sorted.nb[bi] - 1
            while True:
                k = &pb.sorted.blk[bi][j]
                if <int64_t>k.b > best:
                    best = <int64_t>k.b
                first.a = k.a
                first.b = 0
                first.c = 0
                ss_lower_bound(pb.sorted, &first, &bi, &j)
                if not ss_prev(pb.sorted, &bi, &j):
                    break
        else:
            for i in range(pb.n):
                if <int64_t>pb.e[i].k.b > best:
                    best = <int64_t>pb.e[i].k.b
    p.largest = best
    return best


cdef int key_cmp(const void* x, const void* y) noexcept nogil:
    if klt(<const Key*>x, <const Key*>y):
        return -1
    return 1 if klt(<const Key*>y, <const Key*>x) else 0


cdef Key* ps_sorted(const PoolSet* p) except? NULL:
    """The keys in the sorted set's order, in a new array of p.size keys (the caller frees
    it); NULL when there are none."""
    cdef Key* out
    cdef Py_ssize_t n = 0
    cdef int b, j
    cdef int32_t i
    cdef const PBin* pb
    if p.size == 0:
        return NULL
    out = <Key*>PyMem_Malloc(p.size * sizeof(Key))
    if out == NULL:
        raise MemoryError()
    b = ps_next_bin(p, -1)
    while b >= 0:
        pb = &p.bins[b]
        if pb.sorted != NULL:
            for j in range(pb.sorted.nblk):
                memcpy(&out[n], pb.sorted.blk[j], pb.sorted.nb[j] * sizeof(Key))
                n += pb.sorted.nb[j]
        else:
            for i in range(pb.n):
                out[n] = pb.e[i].k
                n += 1
        b = ps_next_bin(p, b)
    qsort(out, n, sizeof(Key), key_cmp)
    return out


cdef class CachingCore:
    """The compiled state and operations of :class:`gpudash.caching.CachingAllocator`."""

    cdef TBlock* bk
    cdef int32_t nbk
    cdef int32_t cap_bk
    cdef int32_t* free_slots
    cdef int32_t nfree
    cdef int32_t cap_free
    cdef PMap blocks
    cdef int64_t ins_next
    cdef PoolSet keys[2]            # the pools' free blocks (stream, size, address)
    cdef SSet unmapped[2]
    cdef int64_t calls[2]
    cdef SSet segs                  # (0, base, size) of cudaMalloc segments
    cdef TES* es
    cdef int32_t nes_slots
    cdef int32_t cap_es
    cdef list es_order              # expandable segment slots, oldest first
    cdef int64_t st[7][10]        # ST_WIDTH numbers a statistic (st_read)
    cdef int64_t over_alloc[4]
    cdef int64_t over_seg[4]
    cdef int64_t n_retries, n_ooms, n_sync, n_dev_alloc, n_dev_free
    # the settings the operations read (refreshed by _settings_changed)
    cdef bint expandable_on, v21, v26, old_round, mss_set
    cdef int64_t mss_val, tol
    cdef uint64_t mss
    cdef double gc_threshold
    cdef int64_t divs[16]
    cdef uint64_t version
    cdef object mat
    cdef Journal jr
    cdef FirstFit _ff               # the sub-allocator's compiled table (None: call it)
    cdef object _ff_sub             # the sub-allocator _ff was found for
    cdef readonly Lock _lock
    cdef public bint _plain_round, _split_any, _gc_on, _set_fraction
    cdef public int64_t _reserved, _allowed, _next_aid, _peak_reserved, _largest, _flush_at
    cdef public int64_t _limit_floor
    cdef public uint64_t _va_next
    cdef public object _history

    def __cinit__(self, *args, **kwargs):
        cdef int p
        self._lock = Lock()
        self.cap_bk = 64
        self.bk = <TBlock*>PyMem_Malloc(self.cap_bk * sizeof(TBlock))
        self.cap_free = 64
        self.free_slots = <int32_t*>PyMem_Malloc(self.cap_free * sizeof(int32_t))
        self.cap_es = 4
        self.es = <TES*>PyMem_Calloc(self.cap_es, sizeof(TES))
        if self.bk == NULL or self.free_slots == NULL or self.es == NULL:
            raise MemoryError()
        for p in range(2):
            ss_init(&self.unmapped[p])
        ss_init(&self.segs)
        pm_init(&self.blocks, 64)
        for p in range(2):
            self.keys[p].addr = &self.blocks
        self.es_order = []
        self._flush_at = JOURNAL_FLUSH
        self._next_aid = 1
        self.mss = 0xFFFFFFFFFFFFFFFF
        self.tol = KLARGE_BUFFER

    def __dealloc__(self):
        cdef int p
        cdef int32_t e
        PyMem_Free(self.bk)
        PyMem_Free(self.free_slots)
        if self.es != NULL:
            for e in range(self.nes_slots):
                PyMem_Free(self.es[e].handles)
            PyMem_Free(self.es)
        for p in range(2):
            ps_free(&self.keys[p])
            ss_free(&self.unmapped[p])
        ss_free(&self.segs)
        pm_free(&self.blocks)

    def _init_state(self):
        """The empty state (the C arrays are made with the object)."""

    def _settings_changed(self):
        """The pure model's, then the settings the C operations read."""
        cdef int i
        _PyCaching._settings_changed(self)
        conf = self._conf
        self.expandable_on = bool(conf.expandable_segments)
        self.v21 = conf.version >= (2, 1)
        self.v26 = conf.version >= (2, 6)
        self.old_round = conf.version < (2, 4)
        mss = conf.max_split_size
        self.mss_set = mss is not None
        # beyond int64 (PyTorch keeps up to SIZE_MAX): larger than any block all the same
        self.mss_val = min(mss, INT64_MAX) if mss is not None else 0
        self.mss = 0xFFFFFFFFFFFFFFFF if mss is None else <uint64_t>min(mss,
                                                                        0xFFFFFFFFFFFFFFFF)
        # block sizes stay below 2**60: a larger tolerance is as good as 2**62, and size +
        # tol cannot overflow
        self.tol = min(self._non_split_tolerance(), 1 << 62)
        self.gc_threshold = conf.garbage_collection_threshold
        for i in range(16):
            self.divs[i] = min(conf.roundup_power2_divisions[i], INT64_MAX)
        self.version += 1

    # ------------------------------------------------------------------ attributes
    @property
    def _journal(self):
        return self.jr

    @_journal.setter
    def _journal(self, value):
        self.jr = as_journal(value)

    @property
    def _mss(self):
        return (1 << 64) if self.mss == 0xFFFFFFFFFFFFFFFF else self.mss

    @_mss.setter
    def _mss(self, value):
        self.mss = 0xFFFFFFFFFFFFFFFF if value >= 0xFFFFFFFFFFFFFFFF else value

    @property
    def bytes_in_use(self):
        """Bytes of blocks allocated (``allocated_bytes.all.current``)."""
        return self.st[ST_ALLOCATED_BYTES][0]

    @property
    def _stats(self):
        """The statistics as the pure model keeps them (a copy)."""
        cdef int i, j
        out = _PyStats()
        for i in range(N_STATS):
            out.pool[_STAT_NAMES[i]] = st_read(self.st[i])
        out.oversize_allocations = [self.over_alloc[j] for j in range(4)]
        out.oversize_segments = [self.over_seg[j] for j in range(4)]
        out.num_alloc_retries = self.n_retries
        out.num_ooms = self.n_ooms
        out.num_sync_all_streams = self.n_sync
        out.num_device_alloc = self.n_dev_alloc
        out.num_device_free = self.n_dev_free
        return out

    @property
    def _blocks(self):
        return self.view()[1]

    @property
    def _small(self):
        return self.view()[2]

    @property
    def _large(self):
        return self.view()[3]

    @property
    def _segments(self):
        return self.view()[4]

    @property
    def _expandable(self):
        return self.view()[5]

    @property
    def _spare(self):
        return []

    cdef object view(self):
        """The state as the pure model keeps it (``_Block``, ``_Pool`` and
        ``_ExpandableSegment`` records, the address table in its order, the segments), made
        once per change: for the readers the two models share."""
        cdef int32_t s, e
        cdef int p, bi, i
        cdef size_t j
        cdef Key* k
        cdef Key* sk
        cdef TES* t
        cdef SSet* ss
        cdef TBlock* b
        if self.mat is not None and self.mat[0] == self.version:
            return self.mat
        pools = []
        for p in range(2):
            pool = _PyPool(p == 0)
            pool.calls = self.calls[p]
            keys = []
            sk = ps_sorted(&self.keys[p])
            try:
                for j in range(<size_t>self.keys[p].size):
                    k = &sk[j]
                    keys.append(((<object>k.a) << 128) | ((<object>k.b) << 64) | k.c)
            finally:
                PyMem_Free(sk)
            pool.keys = keys
            unmapped = []
            ss = &self.unmapped[p]
            for bi in range(ss.nblk):
                for i in range(ss.nb[bi]):
                    k = &ss.blk[bi][i]
                    unmapped.append(((<object>k.a) << 64) | k.b)
            pool.unmapped = unmapped
            pools.append(pool)
        ess = {}
        expandable = []
        for e in self.es_order:
            t = &self.es[e]
            o = _PyES(t.base, t.page, t.max_pages, t.stream, pools[t.pool])
            o.handles = [t.handles[i] if t.handles[i] else None for i in range(t.nh)]
            ess[e] = o
            expandable.append(o)
        made = {}
        for s in self.table_order():
            b = &self.bk[s]
            o = _PyBlock(b.ptr, b.size, b.stream, pools[b.pool],
                         ess[b.es] if b.es >= 0 else None, bool(b.mapped))
            o.requested = b.requested
            o.allocated = bool(b.allocated)
            o.gc_base = b.gc_base
            o.aid = b.aid
            made[s] = o
        for s, o in made.items():
            if self.bk[s].prev >= 0:
                o.prev = made.get(self.bk[s].prev)
            if self.bk[s].next >= 0:
                o.next = made.get(self.bk[s].next)
        blocks = {o.ptr: o for o in made.values()}
        segments = {}
        ss = &self.segs
        for bi in range(ss.nblk):
            for i in range(ss.nb[bi]):
                segments[ss.blk[bi][i].b] = ss.blk[bi][i].c
        self.mat = (self.version, blocks, pools[0], pools[1], segments, expandable)
        return self.mat

    cdef list table_order(self):
        """The slots of the address table's blocks, in the table's (a dict's) order."""
        cdef size_t j
        order = []
        for j in range(self.blocks.cap):
            if self.blocks.k[j] != 0:
                order.append((self.bk[self.blocks.v[j]].ins, self.blocks.v[j]))
        if self.blocks.has0:
            order.append((self.bk[self.blocks.v0].ins, self.blocks.v0))
        order.sort()
        return [s for _, s in order]

    # ------------------------------------------------------------------ records
    @cython.final
    cdef int grow_blocks(self) except -1:
        cdef TBlock* nb = <TBlock*>PyMem_Realloc(self.bk, 2 * self.cap_bk * sizeof(TBlock))
        if nb == NULL:
            raise MemoryError()
        self.bk = nb
        self.cap_bk *= 2
        return 0

    @cython.final
    cdef inline int32_t new_block(self, uint64_t ptr, int64_t size, uint64_t stream, int pool,
                                  int32_t es, bint mapped) except -1:
        """_Block(ptr, size, stream, pool, es, mapped) in a free slot."""
        cdef int32_t s
        cdef TBlock* nb
        if self.nfree:
            self.nfree -= 1
            s = self.free_slots[self.nfree]
        else:
            if self.nbk == self.cap_bk:
                self.grow_blocks()
            s = self.nbk
            self.nbk += 1
        nb = &self.bk[s]
        nb.ptr = ptr
        nb.size = size
        nb.requested = 0
        nb.stream = stream
        nb.gc_base = 0
        nb.aid = -1
        nb.ins = 0
        nb.prev = -1
        nb.next = -1
        nb.es = es
        nb.pool = pool
        nb.allocated = 0
        nb.mapped = mapped
        nb.live = 1
        nb.pbin = 0
        nb.ppos = -1
        return s

    @cython.final
    cdef int drop_block(self, int32_t s) except -1:
        cdef int32_t* nf
        self.bk[s].live = 0
        self.bk[s].prev = -1
        self.bk[s].next = -1
        if self.nfree == self.cap_free:
            nf = <int32_t*>PyMem_Realloc(self.free_slots, 2 * self.cap_free * sizeof(int32_t))
            if nf == NULL:
                raise MemoryError()
            self.free_slots = nf
            self.cap_free *= 2
        self.free_slots[self.nfree] = s
        self.nfree += 1
        return 0

    @cython.final
    cdef inline int put(self, uint64_t ptr, int32_t s) except -1:
        """``_blocks[ptr] = block``: a new address goes last in the table's order; a block
        put at an address already there takes that entry's place."""
        cdef int64_t v
        if pm_get(&self.blocks, ptr, &v):
            self.bk[s].ins = self.bk[v].ins
        else:
            self.ins_next += 1
            self.bk[s].ins = self.ins_next
        pm_put(&self.blocks, ptr, s)
        return 0

    @cython.final
    cdef inline void unput(self, uint64_t ptr) noexcept:
        cdef int64_t v
        pm_del(&self.blocks, ptr, &v)

    @cython.final
    cdef inline int32_t at(self, uint64_t ptr) noexcept:
        cdef int64_t v
        if pm_get(&self.blocks, ptr, &v):
            return <int32_t>v
        return -1

    @cython.final
    cdef inline int trace(self, str action, uint64_t addr, int64_t size,
                          uint64_t stream) except -1:
        self._history.append((action, addr, size, stream, now_ns() // 1000))
        return 0

    # ------------------------------------------------------------------ sizes
    @cython.final
    cdef inline int64_t round_size(self, int64_t n) noexcept:
        """round_size (the roundup_power2_divisions path)."""
        cdef int i
        cdef int64_t d, floor, step, f
        if n < KMIN_BLOCK:
            return KMIN_BLOCK
        i = 63 - __builtin_clzll(<uint64_t>n) - 20
        if i < 0:
            i = 0
        elif i > 15:
            i = 15
        d = self.divs[i]
        # n > 512 * d, without overflowing for d above 2**54 (never true there)
        if ((d > 0) if self.old_round else (d > 1)) and d <= (INT64_MAX >> 9) \
                and n > KMIN_BLOCK * d:
            if self.old_round and d <= 1:
                return n
            if n & (n - 1) == 0:
                return n
            floor = (<int64_t>1) << (63 - __builtin_clzll(<uint64_t>n))
            step = floor >> (63 - __builtin_clzll(<uint64_t>d))
            if step == 0:
                return floor << 1
            f = n & ~(step - 1)
            return n if f == n else f + step
        return (n + 511) & ~(<int64_t>511)

    # ------------------------------------------------------------------ allocate
    cdef uint64_t malloc(self, object nbytes, object stream, bint raise_oom) except? 1:
        """_malloc."""
        cdef int64_t n
        cdef uint64_t strm
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = self._check_request(nbytes)
            if not nbytes:
                return 0
        if type(stream) is not int or not 0 <= stream <= 0xFFFFFFFFFFFFFFFF:
            stream = _stream_of(stream)
        if nbytes >= K_ONE_EXA:
            if raise_oom:
                raise OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate more than 1EB memory.",
                    requested=nbytes, rounded=nbytes, allocator=self._name)
            return 0
        n = nbytes
        strm = stream & 0xFFFFFFFFFFFFFFFF
        return self.malloc_c(n, strm, raise_oom)

    @cython.final
    cdef uint64_t malloc_c(self, int64_t n, uint64_t strm, bint raise_oom) except? 1:
        """_malloc of 0 < n < 1 EiB bytes on stream strm, under the lock."""
        cdef int64_t size, alloc_size, start = 0
        cdef uint64_t ptr
        cdef int pool
        cdef int32_t blk
        cdef Lock lk
        cdef bint listening
        lk = self._lock
        lk.take()
        try:
            listening = self.jr is not None
            if listening:
                start = self.jr.n
            size = ((n + 511) & ~(<int64_t>511)) if self._plain_round else self.round_size(n)
            pool = 0 if size <= KSMALL_SIZE else 1
            blk = self.get_free_block(pool, strm, size)
            if blk < 0:
                alloc_size = allocation_size(size)
                if self._gc_on:
                    self.garbage_collect()
                blk = self.alloc_block(pool, strm, size, alloc_size, False)
                if blk < 0:
                    if self.release_available(pool, strm, size):
                        blk = self.alloc_block(pool, strm, size, alloc_size, False)
                    if blk < 0:
                        self.release_cached()
                        blk = self.alloc_block(pool, strm, size, alloc_size, True)
                if blk < 0:
                    exc = self.oom(n, size, alloc_size, strm, raise_oom)
                    if listening:
                        self._after_op(start)
                    if exc is not None:
                        raise exc
                    return 0
            ptr = self.alloc_found(blk, pool, size, n, strm)
            if listening and start >= self._flush_at:
                self._after_op(start)
            return ptr
        finally:
            lk.give()

    def allocate(self, nbytes, stream=0):
        return self.malloc(nbytes, stream, True)

    def try_allocate(self, nbytes, record_oom=True, stream=0):
        return self.malloc(nbytes, stream, False)

    def _malloc(self, nbytes, stream, raise_oom):
        return self.malloc(nbytes, stream, raise_oom)

    @cython.final
    cdef int32_t get_free_block(self, int pool, uint64_t stream, int64_t size) except -2:
        """_get_free_block(take=True): the one best-fit candidate, taken from its pool; -1
        when there is none."""
        cdef PoolSet* ks = &self.keys[pool]
        cdef PPos at, nxt
        cdef int32_t b, nb, nx
        cdef int64_t cur_exp, nexp
        if self._gc_on:
            self.calls[pool] += 1
            self.version += 1
        if not ps_find(ks, stream, <uint64_t>size, &at):
            return -1
        b = ps_slot(ks, &at)
        if self.bk[b].es >= 0:
            nxt = at
            if self.expandable_on:
                nx = self.bk[b].next
                cur_exp = self.bk[b].size + (self.bk[nx].size if nx >= 0 and
                                             not self.bk[nx].mapped else 0)
                while self.bk[b].es >= 0 and ps_next_same(ks, stream, &nxt):
                    nb = ps_slot(ks, &nxt)
                    nx = self.bk[nb].next
                    nexp = self.bk[nb].size + (self.bk[nx].size if nx >= 0 and
                                               not self.bk[nx].mapped else 0)
                    if not nexp < cur_exp:
                        break
                    b, at, cur_exp = nb, nxt, nexp
            else:
                while True:
                    if not ps_next_same(ks, stream, &nxt):
                        return -1
                    nb = ps_slot(ks, &nxt)
                    if self.bk[nb].es < 0:
                        break
                at = nxt
                b = nb
        if <uint64_t>self.bk[b].size >= self.mss or <uint64_t>size >= self.mss:
            if <uint64_t>size < self.mss and <uint64_t>self.bk[b].size >= self.mss:
                return -1
            if <uint64_t>size >= self.mss and self.bk[b].size >= size + self.tol:
                return -1
        ps_erase_at(ks, self.bk, &at)
        self.version += 1
        return b

    @cython.final
    cdef uint64_t alloc_found(self, int32_t blk, int pool, int64_t size, int64_t orig,
                              uint64_t stream) except? 1:
        """_alloc_found_block: split if it should be (the allocation takes the front), mark
        allocated, count."""
        cdef int t = pool + 1
        cdef int32_t remaining, nx
        cdef bint already_split = self.bk[blk].prev >= 0 or self.bk[blk].next >= 0, split
        cdef int64_t remainder = 0, rem = self.bk[blk].size - size, bsize, c
        cdef uint64_t rptr
        cdef int64_t* sb
        cdef TBlock* b
        if pool == 0 or self._split_any:
            split = rem >= KMIN_BLOCK
        else:
            split = <uint64_t>size < self.mss and rem > KSMALL_SIZE
        self.version += 1
        if split:
            # The allocation takes the front, the rest stays free. PyTorch gives the front a
            # new record and the old one becomes the rest; here the old record stays the
            # front's (its address, its place in the address table) and a new one is the
            # rest's, with what the old record carried (its requested figure). The same
            # blocks either way, one address-table entry fewer to rewrite.
            rptr = self.bk[blk].ptr + <uint64_t>size
            remaining = self.new_block(rptr, rem, self.bk[blk].stream, pool, self.bk[blk].es,
                                       True)
            nx = self.bk[blk].next
            self.bk[remaining].prev = blk
            self.bk[remaining].next = nx
            if nx >= 0:
                self.bk[nx].prev = remaining
            self.bk[blk].next = remaining
            self.bk[remaining].requested = self.bk[blk].requested
            self.bk[remaining].gc_base = self.calls[pool]
            self.bk[blk].size = size
            self.bk[blk].stream = stream
            self.bk[blk].gc_base = 0
            remainder = rem
            self.ins_next += 1    # put(rptr, remaining): a new address, last in the order
            self.bk[remaining].ins = self.ins_next
            pm_put(&self.blocks, rptr, remaining)
            ps_insert(&self.keys[pool], self.bk, remaining)
            if self.bk[blk].es < 0:
                sb = self.st[ST_INACTIVE_SPLIT_BYTES]
                if already_split:
                    # an already-split inactive block shrinks by `size` bytes
                    st_dec(sb, t, size)
                else:
                    # a new split inactive block of `remainder` bytes
                    st_inc(sb, t, remainder)
                    st_inc(self.st[ST_INACTIVE_SPLIT], t, 1)
        elif already_split and self.bk[blk].es < 0:
            st_dec(self.st[ST_INACTIVE_SPLIT_BYTES], t, self.bk[blk].size)
            st_dec(self.st[ST_INACTIVE_SPLIT], t, 1)
        b = &self.bk[blk]
        b.allocated = 1
        b.requested = orig
        b.aid = self._next_aid
        self._next_aid += 1
        bsize = b.size
        if bsize > self._largest:
            self._largest = bsize
        st_inc(self.st[ST_ALLOCATION], t, 1)
        st_inc(self.st[ST_ALLOCATED_BYTES], t, bsize)
        st_inc(self.st[ST_REQUESTED_BYTES], t, orig)
        if <uint64_t>bsize >= self.mss:
            st_inc1(self.over_alloc, 1)
        if self._history is not None:
            self.trace(_A_ALLOC, b.ptr, orig, stream)
            b = &self.bk[blk]
        if self.jr is not None:
            self.jr.push(K_ALLOC, <int64_t>b.ptr, bsize, orig, remainder, 0, 0, remainder != 0)
        return b.ptr

    # ------------------------------------------------------------------ new memory
    @cython.final
    cdef int32_t alloc_block(self, int pool, uint64_t stream, int64_t size,
                             int64_t alloc_size, bint is_retry) except -2:
        """_alloc_block: a new segment (or mapped pages); -1 when the device refuses."""
        cdef int32_t blk
        cdef uint64_t p
        cdef Key k
        if is_retry:
            self.n_retries += 1
        if self._set_fraction:
            if self._reserved + alloc_size > self._allowed:
                return -1
            if self._reserved + alloc_size > self._limit_floor:
                self._limit_floor = self._reserved + alloc_size
        if self.expandable_on and self.v21:
            return self.try_allocate_expandable(pool, stream, size)
        ff = self.placement()
        if ff is not None:
            p = <uint64_t>ff.c_place(alloc_size)
            if p == 0:
                return -1
        else:
            try:
                ptr = self._sub.alloc(alloc_size)
            except MemoryError:
                return -1
            if not ptr:
                return -1
            p = int(ptr)
            self.refuse_overlap(p, alloc_size, False)
        self._reserved += alloc_size
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        blk = self.new_block(p, alloc_size, stream, pool, -1, True)
        self.put(p, blk)
        k.a = 0
        k.b = p
        k.c = <uint64_t>alloc_size
        ss_insert(&self.segs, k)
        self.version += 1
        st_inc(self.st[ST_SEGMENT], pool + 1, 1)
        st_inc(self.st[ST_RESERVED_BYTES], pool + 1, alloc_size)
        if self.mss_set and alloc_size >= self.mss_val:
            st_inc1(self.over_seg, 1)
        self.n_dev_alloc += 1
        if self._history is not None:
            self.trace(_A_SEG_ALLOC, p, alloc_size, stream)
        if self.jr is not None:
            self.jr.push(K_EXTEND, <int64_t>p, alloc_size, size, 0, 0, 0, 0)
        return blk

    @cython.final
    cdef int refuse_overlap(self, uint64_t p, int64_t n, bint reserved) except -1:
        """_clash and _overlap_error: refuse a range over a segment or an expandable
        reservation handed out before, giving the new range back first."""
        cdef Key k
        cdef Key* q
        cdef int bi = 0, i = 0, e
        cdef bint found, clash = False
        cdef uint64_t c0 = 0, c1 = 0, esz
        k.a = 0
        k.b = p
        k.c = 0
        found = ss_lower_bound(&self.segs, &k, &bi, &i)
        if found:
            q = ss_at(&self.segs, bi, i)
            if q.b - p < <uint64_t>n:
                clash, c0, c1 = True, q.b, q.c
            elif ss_prev(&self.segs, &bi, &i):
                q = ss_at(&self.segs, bi, i)
                if p - q.b < q.c:
                    clash, c0, c1 = True, q.b, q.c
        elif self.segs.size:
            q = ss_last(&self.segs)
            if p - q.b < q.c:
                clash, c0, c1 = True, q.b, q.c
        if not clash and not getattr(self._sub, "recorded_addresses", False):
            # a replay's reservations are sized by an assumed device (caching.py: _clash)
            for e in self.es_order:
                esz = <uint64_t>(self.es[e].page * self.es[e].max_pages)
                if (p >= self.es[e].base and p - self.es[e].base < esz) or \
                        (self.es[e].base >= p and self.es[e].base - p < <uint64_t>n):
                    clash, c0, c1 = True, self.es[e].base, esz
                    break
        if not clash:
            return 0
        if reserved:
            unreserve = getattr(self._sub, "unreserve", None)
            if callable(unreserve):
                unreserve(p, n)
        else:
            self._sub.free(p, n)
        raise InvalidPointerError(
            f"{self._name}: the sub-allocator {'reserved' if reserved else 'handed out'} "
            f"{p:#x}..{int(p) + n:#x}, which overlaps the range {c0:#x}..{int(c0) + c1:#x} "
            "it gave this allocator before; a device must hand out disjoint ranges (the new "
            "range went back to it)")

    @cython.final
    cdef FirstFit placement(self):
        """The sub-allocator's compiled block table when it has one (a simulated device on
        the compiled path: ``_placement``), for a segment's cudaMalloc and cudaFree without
        Python; None: call its ``alloc`` and ``free``."""
        sub = self._sub
        if sub is not self._ff_sub:
            found = getattr(sub, "_placement", None)
            self._ff = found if type(found) is FirstFit else None
            self._ff_sub = sub
        return self._ff

    cdef int release_block(self, int32_t blk) except -1:
        """_release_block: cudaFree of a whole free segment."""
        cdef uint64_t ptr = self.bk[blk].ptr, stream = self.bk[blk].stream
        cdef int64_t size = self.bk[blk].size
        cdef int pool = self.bk[blk].pool
        cdef Key k
        if self.bk[blk].es >= 0:
            raise GpudashError(
                f"{self._name}: PyTorch fails here with an internal assert "
                "(TORCH_INTERNAL_ASSERT(!block->expandable_segment_) in release_block, "
                "pytorch/pytorch#123548): max_split_size_mb with expandable_segments:True "
                "released an expandable block under memory pressure. PyTorch does not "
                "support this combination; drop one of the two settings")
        self.n_dev_free += 1
        if self._history is not None:
            self.trace(_A_SEG_FREE, ptr, size, stream)
        if self.jr is not None:
            self.jr.push(K_RELEASE, <int64_t>ptr, size, 0, 0, 0, 0, 0)
        ff = self.placement()
        if ff is None or not ff.c_remove(<int64_t>ptr, size):
            self._sub.free(ptr, size)
        self._reserved -= size
        st_dec(self.st[ST_SEGMENT], pool + 1, 1)
        st_dec(self.st[ST_RESERVED_BYTES], pool + 1, size)
        if self.mss_set and size >= self.mss_val:
            st_dec1(self.over_seg, 1)
        blk = self.at(ptr)
        ps_erase(&self.keys[pool], self.bk, blk)
        self.unput(ptr)
        k.a = 0
        k.b = ptr
        k.c = <uint64_t>size
        ss_erase(&self.segs, k)
        self.drop_block(blk)
        self.version += 1
        return 0

    cdef list pool_slots(self, int pool):
        """The blocks of a pool's key list, in its order (``list(pool.keys)``)."""
        cdef size_t j
        cdef Key* sk = ps_sorted(&self.keys[pool])
        out = []
        try:
            for j in range(<size_t>self.keys[pool].size):
                out.append(sk[j].c)
        finally:
            PyMem_Free(sk)
        return out

    cdef int garbage_collect(self) except -1:
        """garbage_collect_cached_blocks: release aged whole free large segments until
        ``total - threshold * allowed`` bytes are reclaimed (full passes)."""
        cdef int64_t gc_threshold = <int64_t>(self.gc_threshold * <double>self._allowed)
        cdef int64_t target, reclaimed = 0, freeable = 0, age
        cdef double total_age = 0.0, threshold
        cdef bint freed
        cdef int32_t b
        cdef int64_t v
        if self._allowed > self._limit_floor:   # a threshold that scales with the limit
            self._limit_floor = self._allowed
        if self._reserved <= gc_threshold:
            return 0
        target = self._reserved - gc_threshold
        for p in self.pool_slots(1):
            pm_get(&self.blocks, p, &v)
            b = <int32_t>v
            if self.bk[b].prev < 0 and self.bk[b].next < 0:
                total_age += self.calls[1] - self.bk[b].gc_base
                freeable += 1
        if freeable == 0:
            return 0
        freed = True
        while reclaimed < target and freed and freeable > 0:
            threshold = total_age / freeable
            freed = False
            for p in self.pool_slots(1):
                if not pm_get(&self.blocks, p, &v):
                    continue
                b = <int32_t>v
                if self.bk[b].prev >= 0 or self.bk[b].next >= 0 or self.bk[b].allocated:
                    continue
                age = self.calls[1] - self.bk[b].gc_base
                if age >= threshold:
                    freed = True
                    reclaimed += self.bk[b].size
                    total_age -= age
                    freeable -= 1
                    self.release_block(b)
        return 0

    cdef bint release_available(self, int pool, uint64_t stream, int64_t size) except -1:
        """_release_available_cached_blocks: free oversize cached blocks of this pool and
        stream, the smallest that covers the request, else from the largest down."""
        cdef int64_t target, released = 0, v
        cdef Key probe
        cdef PPos at
        cdef PoolSet* ks = &self.keys[pool]
        cdef int32_t b
        if not self.mss_set:
            return False
        target = size if size > self.mss_val else self.mss_val
        if ps_find(ks, stream, <uint64_t>target, &at):
            self.release_block(ps_slot(ks, &at))
            return True
        # from the key just below the probe, downwards, while they are of this stream
        probe.a = stream
        probe.b = <uint64_t>target
        probe.c = 0
        while released < target:
            if not ps_prev_below(ks, stream, &probe, &at):
                break
            b = ps_slot(ks, &at)
            if self.bk[b].size < self.mss_val:
                break
            probe = ps_at(ks, &at)[0]
            released += self.bk[b].size
            self.release_block(b)
        return released >= target

    cdef int release_cached(self) except -1:
        """_release_cached_blocks (empty_cache): large pool first, then small."""
        self.n_sync += 1
        self.release_blocks(1)
        self.release_blocks(0)
        return 0

    cdef int release_blocks(self, int pool) except -1:
        cdef int64_t v
        cdef int32_t b
        to_unmap = []
        for p in self.pool_slots(pool):
            if not pm_get(&self.blocks, p, &v):
                continue
            b = <int32_t>v
            if self.bk[b].es >= 0:
                to_unmap.append(b)
            elif self.bk[b].prev < 0 and self.bk[b].next < 0:
                self.release_block(b)
        for b in to_unmap:
            self.unmap_block(b)
            if self.bk[b].prev < 0 and self.bk[b].next < 0:
                self.release_expandable_segment(b)
        return 0

    def _release_cached_blocks(self):
        self.release_cached()

    # ------------------------------------------------------------------ expandable segments
    cdef int32_t new_expandable(self, int pool, uint64_t stream) except -1:
        """_new_expandable: a reserved range of 1 1/8 x the device."""
        cdef int64_t page = KSMALL_BUFFER if pool == 0 else KLARGE_BUFFER, max_pages, nbytes
        cdef int32_t e
        cdef TES* ne
        total = self.device_total
        if total <= 0:
            raise BackendUnavailableError(
                f"{self._name}: expandable segments reserve 1 1/8 x the device's total memory, "
                "and this device does not say how much it has")
        max_pages = (total + total // 8 + page - 1) // page
        nbytes = max_pages * page
        reserve = getattr(self._sub, "reserve", None)
        if callable(reserve):
            base = int(reserve(nbytes))
            self.refuse_overlap(<uint64_t>base, nbytes, True)
        else:
            if getattr(self._sub, "kind", "") == "cuda":
                raise BackendUnavailableError(
                    f"{self._name}: expandable segments map pages with CUDA's virtual "
                    "memory API, which gpudash does not drive through CuPy; use "
                    "expandable_segments:False here, or a simulated device")
            base = self._va_next
            self._va_next += nbytes + (1 << 30)
        e = -1
        for i in range(self.nes_slots):
            if not self.es[i].live:
                e = i
                break
        if e < 0:
            if self.nes_slots == self.cap_es:
                ne = <TES*>PyMem_Realloc(self.es, 2 * self.cap_es * sizeof(TES))
                if ne == NULL:
                    raise MemoryError()
                self.es = ne
                memset(&self.es[self.cap_es], 0, self.cap_es * sizeof(TES))
                self.cap_es *= 2
            e = self.nes_slots
            self.nes_slots += 1
        ne = &self.es[e]
        ne.base = base
        ne.page = page
        ne.max_pages = max_pages
        ne.stream = stream
        ne.pool = pool
        ne.live = 1
        ne.nh = 0
        self.es_order.append(e)
        self.version += 1
        return e

    cdef int es_room(self, int32_t e, int64_t n) except -1:
        """handles extended with None up to n entries."""
        cdef TES* t = &self.es[e]
        cdef int64_t cap
        cdef uint64_t* h
        if n > t.cap:
            cap = t.cap * 2 if t.cap else 16
            while cap < n:
                cap *= 2
            h = <uint64_t*>PyMem_Realloc(t.handles, cap * sizeof(uint64_t))
            if h == NULL:
                raise MemoryError()
            t.handles = h
            t.cap = cap
        while t.nh < n:
            t.handles[t.nh] = 0
            t.nh += 1
        return 0

    cdef inline void es_trim(self, int32_t e) noexcept:
        cdef TES* t = &self.es[e]
        while t.nh and t.handles[t.nh - 1] == 0:
            t.nh -= 1

    cdef int map_pages(self, int32_t e, uint64_t ptr, int64_t size, uint64_t* mptr,
                       int64_t* msize) except -1:
        """_map_pages: whole pages over [ptr, ptr+size); msize 0 when the device has no
        memory for them (the pages made by this call are given back)."""
        cdef int64_t page = self.es[e].page, begin, end, i, j
        cdef uint64_t base = self.es[e].base, h
        begin = <int64_t>(ptr - base) // page
        end = (<int64_t>(ptr - base) + size + page - 1) // page
        self.es_room(e, end)
        create, release = self._page_calls()
        for i in range(begin, end):
            try:
                got = create(page)
            except MemoryError:
                got = None
            if not got:
                for j in range(begin, i):
                    h = self.es[e].handles[j]
                    self.es[e].handles[j] = 0
                    release(h, page)
                self.es_trim(e)
                mptr[0] = 0
                msize[0] = 0
                return 0
            self.es[e].handles[i] = int(got)
        mptr[0] = base + <uint64_t>(begin * page)
        msize[0] = (end - begin) * page
        return 0

    cdef int unmap_pages(self, int32_t e, uint64_t ptr, int64_t size, uint64_t* uptr,
                         int64_t* usize) except -1:
        """_unmap_pages: the whole pages inside [ptr, ptr+size)."""
        cdef int64_t page = self.es[e].page, begin, end, i
        cdef uint64_t base = self.es[e].base, h
        begin = (<int64_t>(ptr - base) + page - 1) // page
        end = (<int64_t>(ptr - base) + size) // page
        if begin >= end:
            uptr[0] = ptr
            usize[0] = 0
            return 0
        release = self._page_calls()[1]
        for i in range(begin, end):
            h = self.es[e].handles[i]
            self.es[e].handles[i] = 0
            release(h if h else None, page)
        self.es_trim(e)
        uptr[0] = base + <uint64_t>(begin * page)
        usize[0] = (end - begin) * page
        return 0

    cdef int32_t find_expandable_block(self, int pool, uint64_t stream,
                                       int64_t size) except -1:
        cdef SSet* un = &self.unmapped[pool]
        cdef Key want = ukey(stream, 0)
        cdef int bi, i
        cdef int32_t c, p, b, e
        cdef int64_t got, v
        if ss_lower_bound(un, &want, &bi, &i):
            while True:
                if ss_at(un, bi, i).a != stream:
                    break
                pm_get(&self.blocks, ss_at(un, bi, i).b, &v)
                c = <int32_t>v
                p = self.bk[c].prev
                if p >= 0 and not self.bk[p].allocated:
                    c = p
                b = c
                got = 0
                while got < size and b >= 0 and not self.bk[b].allocated:
                    got += self.bk[b].size
                    b = self.bk[b].next
                if got >= size:
                    return c
                if not ss_next(un, &bi, &i):
                    break
        e = self.new_expandable(pool, stream)
        c = self.new_block(self.es[e].base, self.es[e].page * self.es[e].max_pages, stream,
                           pool, e, False)
        self.put(self.bk[c].ptr, c)
        ss_insert(un, ukey(stream, self.bk[c].ptr))
        self.version += 1
        return c

    cdef bint map_block(self, int32_t to_map, int64_t size, int64_t rounded) except -1:
        cdef int32_t e = self.bk[to_map].es, rest, nxt
        cdef uint64_t mptr
        cdef int64_t msize, merged_prev, merged_next
        cdef int pool = self.bk[to_map].pool
        self.map_pages(e, self.bk[to_map].ptr, size, &mptr, &msize)
        if msize == 0:
            return False
        ss_erase(&self.unmapped[pool], ukey(self.bk[to_map].stream, self.bk[to_map].ptr))
        self.bk[to_map].mapped = 1
        self.version += 1
        if msize < self.bk[to_map].size:
            rest = self.new_block(self.bk[to_map].ptr + <uint64_t>msize,
                                  self.bk[to_map].size - msize, self.bk[to_map].stream, pool, e,
                                  False)
            nxt = self.bk[to_map].next
            self.bk[rest].prev = to_map
            self.bk[rest].next = nxt
            self.bk[to_map].next = rest
            if nxt >= 0:
                self.bk[nxt].prev = rest
            self.put(self.bk[rest].ptr, rest)
            ss_insert(&self.unmapped[pool], ukey(self.bk[rest].stream, self.bk[rest].ptr))
            self.bk[to_map].size = msize
        self._reserved += msize
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        st_inc(self.st[ST_RESERVED_BYTES], pool + 1, msize)
        self.n_dev_alloc += 1
        if self._history is not None:
            self.trace(_A_SEG_MAP, mptr, msize, self.bk[to_map].stream)
        if self.jr is not None:
            self.jr.push(K_EXTEND, <int64_t>mptr, msize, rounded, 0, 0, 0, 0)
        # the new pages join free mapped neighbours (merge events say so)
        merged_prev = self.try_merge(to_map, self.bk[to_map].prev)
        merged_next = self.try_merge(to_map, self.bk[to_map].next)
        if self.jr is not None:
            if merged_prev:
                self.jr.push(K_MERGE, <int64_t>self.bk[to_map].ptr,
                             self.bk[to_map].size, merged_prev, 0, 0, 0, 0)
            if merged_next:
                self.jr.push(K_MERGE, <int64_t>self.bk[to_map].ptr,
                             self.bk[to_map].size, merged_next, 0, 0, 0, 0)
        self.bk[to_map].gc_base = self.calls[pool]
        ps_insert(&self.keys[pool], self.bk, to_map)
        return True

    cdef int32_t try_allocate_expandable(self, int pool, uint64_t stream,
                                         int64_t size) except -2:
        cdef int32_t cand = self.find_expandable_block(pool, stream, size), new
        cdef int64_t remaining
        if not self.bk[cand].mapped and not self.map_block(
                cand, min(self.bk[cand].size, size), size):
            return -1
        while self.bk[cand].size < size:
            remaining = size - self.bk[cand].size
            new = self.bk[cand].next
            if not self.map_block(new, min(remaining, self.bk[new].size), size):
                return -1
            cand = new
        ps_erase(&self.keys[pool], self.bk, cand)
        self.version += 1
        return cand

    cdef int unmap_block(self, int32_t block) except -1:
        cdef int32_t e = self.bk[block].es, bf, af, p, n
        cdef uint64_t uptr
        cdef int64_t usize, before, after
        cdef int pool = self.bk[block].pool
        self.unmap_pages(e, self.bk[block].ptr, self.bk[block].size, &uptr, &usize)
        if usize == 0:
            return 0
        self.version += 1
        ps_erase(&self.keys[pool], self.bk, block)
        self.unput(self.bk[block].ptr)
        before = <int64_t>(uptr - self.bk[block].ptr)
        if before > 0:
            bf = self.new_block(self.bk[block].ptr, before, self.bk[block].stream, pool, e, True)
            p = self.bk[block].prev
            self.bk[bf].prev = p
            if p >= 0:
                self.bk[p].next = bf
            self.bk[bf].next = block
            self.bk[block].prev = bf
            self.put(self.bk[bf].ptr, bf)
            self.bk[bf].gc_base = self.calls[pool]
            ps_insert(&self.keys[pool], self.bk, bf)
        after = self.bk[block].size - (before + usize)
        if after > 0:
            af = self.new_block(uptr + <uint64_t>usize, after, self.bk[block].stream, pool, e,
                                True)
            n = self.bk[block].next
            self.bk[af].next = n
            if n >= 0:
                self.bk[n].prev = af
            self.bk[af].prev = block
            self.bk[block].next = af
            self.put(self.bk[af].ptr, af)
            self.bk[af].gc_base = self.calls[pool]
            ps_insert(&self.keys[pool], self.bk, af)
        self.bk[block].ptr = uptr
        self.bk[block].size = usize
        self.bk[block].mapped = 0
        self.put(uptr, block)
        self.try_merge(block, self.bk[block].prev)
        self.try_merge(block, self.bk[block].next)
        ss_insert(&self.unmapped[pool], ukey(self.bk[block].stream, self.bk[block].ptr))
        self._reserved -= usize
        st_dec(self.st[ST_RESERVED_BYTES], pool + 1, usize)
        self.n_dev_free += 1
        if self._history is not None:
            self.trace(_A_SEG_UNMAP, uptr, usize, self.bk[block].stream)
        if self.jr is not None:
            self.jr.push(K_RELEASE, <int64_t>uptr, usize, 0, 0, 0, 0, 0)
        return 0

    cdef int release_expandable_segment(self, int32_t block) except -1:
        cdef int32_t e = self.bk[block].es
        cdef uint64_t base = self.es[e].base
        cdef int64_t size = self.es[e].page * self.es[e].max_pages
        assert self.bk[block].size == size and not self.bk[block].mapped, \
            "block disagrees with segment"
        self.es_order.remove(e)
        self.es[e].live = 0
        self.es[e].nh = 0
        ss_erase(&self.unmapped[self.bk[block].pool],
                 ukey(self.bk[block].stream, self.bk[block].ptr))
        self.unput(self.bk[block].ptr)
        self.drop_block(block)
        self.version += 1
        unreserve = getattr(self._sub, "unreserve", None)
        if callable(unreserve):
            unreserve(base, size)
        return 0

    # ------------------------------------------------------------------ merging
    cdef int64_t try_merge(self, int32_t dst, int32_t src) except -1:
        """_try_merge: absorb a free neighbour of the same mapped state."""
        cdef int pool
        cdef int32_t p, n
        cdef int64_t size
        if src < 0 or self.bk[src].allocated or self.bk[dst].mapped != self.bk[src].mapped:
            return 0
        pool = self.bk[dst].pool
        if self.bk[src].mapped:
            ps_erase(&self.keys[pool], self.bk, src)
        else:
            ss_erase(&self.unmapped[pool], ukey(self.bk[src].stream, self.bk[src].ptr))
        self.unput(self.bk[src].ptr)
        if self.bk[dst].prev == src:
            self.unput(self.bk[dst].ptr)
            self.bk[dst].ptr = self.bk[src].ptr
            self.put(self.bk[dst].ptr, dst)
            p = self.bk[dst].prev = self.bk[src].prev
            if p >= 0:
                self.bk[p].next = dst
        else:
            n = self.bk[dst].next = self.bk[src].next
            if n >= 0:
                self.bk[n].prev = dst
        size = self.bk[src].size
        self.bk[dst].size += size
        self.drop_block(src)
        self.version += 1
        return size

    # ------------------------------------------------------------------ free
    cdef inline int32_t live_at(self, object ptr) except -2:
        """The block allocated at ``ptr`` (an int, or anything ``_lookup`` takes); -1."""
        cdef int64_t v
        cdef uint64_t p
        if type(ptr) is not int:
            if isinstance(ptr, bool):
                return -1
            try:
                ptr = _index(ptr)
            except TypeError:
                return -1
        p = as_address(ptr)
        if p == 0 or not pm_get(&self.blocks, p, &v) or not self.bk[v].allocated:
            return -1
        return <int32_t>v

    cdef int c_deallocate(self, object ptr) except -1:
        cdef int32_t b
        cdef uint64_t p
        cdef int64_t v, start
        cdef Lock lk
        if type(ptr) is not int or not ptr:
            if not ptr:
                if isinstance(ptr, _Integral) and not isinstance(ptr, bool):
                    return 0  # nullptr: nothing to free, as in PyTorch
                raise InvalidPointerError(f"{self._name}: deallocate() expects an int "
                                          f"address; got {ptr!r}")
        lk = self._lock
        lk.take()
        try:
            if type(ptr) is int:
                p = as_address(ptr)
                b = <int32_t>v if (p != 0 and pm_get(&self.blocks, p, &v)
                                   and self.bk[v].allocated) else -1
            else:
                b = self.live_at(ptr)
            if b < 0:
                raise self._invalid_pointer(ptr, "deallocate")
            if self.jr is None:
                self.free(b)
                return 0
            start = self.jr.n
            self.free(b)
            if start >= self._flush_at:
                self._after_op(start)
        finally:
            lk.give()
        return 0

    def deallocate(self, ptr):
        self.c_deallocate(ptr)

    @cython.final
    cdef inline uint64_t replay_alloc(self, int64_t n, uint64_t stream) except? 1:
        """try_allocate(n, True, stream) for a replay's int64 size (inline: the replay loop
        calls it for every allocation: 11 instructions an event less on `finetune`)."""
        if n <= 0:
            if n == 0:
                return 0
            self._check_request(n)
        if n >= K_ONE_EXA:
            return 0
        return self.malloc_c(n, stream, False)

    @cython.final
    cdef int replay_free(self, uint64_t p) except -1:
        """deallocate(p) for a replay's pointer (0: nothing)."""
        cdef int64_t v, start
        cdef Lock lk
        if p == 0:
            return 0
        lk = self._lock
        lk.take()
        try:
            if not pm_get(&self.blocks, p, &v) or not self.bk[v].allocated:
                raise self._invalid_pointer(p, "deallocate")
            if self.jr is None:
                self.free(<int32_t>v)
                return 0
            start = self.jr.n
            self.free(<int32_t>v)
            if start >= self._flush_at:
                self._after_op(start)
        finally:
            lk.give()
        return 0

    @cython.final
    cdef int empty_cache_c(self) except -1:
        """empty_cache()."""
        cdef int64_t start = 0
        cdef Lock lk = self._lock
        lk.take()
        try:
            listening = self.jr is not None
            if listening:
                start = self.jr.n
            self.release_cached()
            if listening:
                self._after_op(start)
        finally:
            lk.give()
        return 0

    @cython.final
    cdef int free(self, int32_t blk) except -1:
        """_free then free_block: uncount the block, merge it with free neighbours (the
        previous one first), cache it."""
        cdef TBlock* b = &self.bk[blk]
        cdef int pool = b.pool, t = pool + 1
        cdef int64_t bsize = b.size, req = b.requested, aid = b.aid
        cdef int64_t prev_size = 0, next_size = 0, net_blocks, net_bytes
        cdef Py_ssize_t merged = 0   # neighbours merged: the free's events beyond one
        cdef uint64_t ptr = b.ptr, stream = b.stream
        cdef int32_t p, n, pp, nn
        b.allocated = 0
        b.aid = -1
        self.version += 1
        st_dec(self.st[ST_ALLOCATION], t, 1)
        st_dec(self.st[ST_ALLOCATED_BYTES], t, bsize)
        if self._history is not None:
            self.trace(_A_FREE_REQ, ptr, req, stream)
        if <uint64_t>bsize >= self.mss:
            st_dec1(self.over_alloc, 1)
        if self._history is not None:
            self.trace(_A_FREE_DONE, ptr, req, stream)
        p = self.bk[blk].prev
        n = self.bk[blk].next
        if p >= 0 and not self.bk[p].allocated and self.bk[p].mapped:
            # try_merge_blocks(block, prev), written out: block takes prev's start. PyTorch
            # keeps the block's record; here prev's record (its address, its place in the
            # address table) becomes the merged block's, with the block's requested figure
            # and stream: the same block, one address-table entry fewer to rewrite.
            ps_erase(&self.keys[pool], self.bk, p)
            self.unput(ptr)
            prev_size = self.bk[p].size
            self.bk[p].size = prev_size + bsize
            nn = self.bk[p].next = n
            if nn >= 0:
                self.bk[nn].prev = p
            self.bk[p].requested = req
            self.bk[p].stream = stream
            self.drop_block(blk)
            blk = p
            merged = 1
        if n >= 0 and not self.bk[n].allocated and self.bk[n].mapped:
            ps_erase(&self.keys[pool], self.bk, n)
            self.unput(self.bk[n].ptr)
            nn = self.bk[blk].next = self.bk[n].next
            if nn >= 0:
                self.bk[nn].prev = blk
            next_size = self.bk[n].size
            self.bk[blk].size += next_size
            self.drop_block(n)
            merged += 1
        b = &self.bk[blk]
        b.gc_base = self.calls[pool]
        ps_insert(&self.keys[pool], self.bk, blk)
        if b.es < 0:
            # inactive_split: free blocks of split segments (merged ones leave, this one
            # joins while the segment stays split)
            net_blocks = -(prev_size > 0) - (next_size > 0)
            net_bytes = -prev_size - next_size
            if b.prev >= 0 or b.next >= 0:
                net_blocks += 1
                net_bytes += b.size
            if net_blocks > 0:
                st_inc(self.st[ST_INACTIVE_SPLIT], t, net_blocks)
            elif net_blocks < 0:
                st_dec(self.st[ST_INACTIVE_SPLIT], t, -net_blocks)
            if net_bytes > 0:
                st_inc(self.st[ST_INACTIVE_SPLIT_BYTES], t, net_bytes)
            elif net_bytes < 0:
                st_dec(self.st[ST_INACTIVE_SPLIT_BYTES], t, -net_bytes)
        st_dec(self.st[ST_REQUESTED_BYTES], t, req)
        if self.jr is not None:
            self.jr.push(K_FREE, <int64_t>ptr, bsize, req, aid, next_size,
                         prev_size, merged)
        return 0

    # ------------------------------------------------------------------ queries
    cdef int32_t queried(self, object ptr, str what) except -1:
        """Lock held: the allocated block at ``ptr``, else the pure model's error."""
        cdef int32_t b = self.live_at(ptr)
        if b < 0:
            raise self._invalid_pointer(ptr, what)
        return b

    def _sorted_bins(self):
        """How many of the two pools' bins keep their keys sorted (grown past pb_big)."""
        cdef int p, b
        return sum(self.keys[p].bins[b].sorted != NULL for p in range(2)
                   for b in range(PS_BINS))

    def owns(self, ptr):
        cdef int64_t v
        cdef uint64_t p
        if type(ptr) is not int:
            b = self._blocks.get(ptr)
            return b is not None and b.allocated
        p = as_address(ptr)
        return p != 0 and pm_get(&self.blocks, p, &v) and bool(self.bk[v].allocated)

    def allocated_size(self, ptr):
        cdef Lock lk = self._lock
        lk.take()
        try:
            return self.bk[self.queried(ptr, "allocated_size")].size
        finally:
            lk.give()

    def requested_size(self, ptr):
        cdef Lock lk = self._lock
        lk.take()
        try:
            return self.bk[self.queried(ptr, "requested_size")].requested
        finally:
            lk.give()

    def allocation_id(self, ptr):
        cdef Lock lk = self._lock
        lk.take()
        try:
            return self.bk[self.queried(ptr, "allocation_id")].aid
        finally:
            lk.give()

    # ------------------------------------------------------------------ out of memory
    cdef object oom(self, int64_t nbytes, int64_t size, int64_t alloc_size, uint64_t stream,
                    bint build):
        """_oom: the trace entry, counter and event; the error when ``build``."""
        device_free = self._device_free()
        if self._history is not None:
            self._history.append((_A_OOM, device_free, size, stream, now_ns() // 1000))
        self.n_ooms += 1
        if self.jr is not None:
            self.jr.push(K_OOM, 0, size, nbytes, 0, 0, 0, 0)
        if not build:
            return None
        message = self.oom_message(alloc_size, device_free)
        return OutOfMemoryError(message, requested=nbytes, rounded=size,
                                allocator=self._name, memory_log=self._memory_summary())

    # ------------------------------------------------------------------ statistics
    def reset_peak_stats(self):
        """``torch.cuda.reset_peak_memory_stats()``: every peak back to its current value."""
        cdef int i, j
        cdef Lock lk = self._lock
        lk.take()
        try:
            for i in range(N_STATS):
                for j in (0, st_at(1), st_at(2)):
                    self.st[i][j + 1] = self.st[i][j]
            self.over_alloc[1] = self.over_alloc[0]
            self.over_seg[1] = self.over_seg[0]
            self._peak_reserved = self._reserved
        finally:
            lk.give()

    def reset_accumulated_stats(self):
        """``torch.cuda.reset_accumulated_memory_stats()``."""
        cdef int i, j
        cdef Lock lk = self._lock
        lk.take()
        try:
            for i in range(N_STATS):
                for j in (st_at(1), st_at(2)):
                    # allocated 0, freed (allocated - current + base) 0
                    self.st[i][j + 2] = 0
                    self.st[i][j + 3] = self.st[i][j]
            self.over_alloc[2] = self.over_alloc[3] = 0
            self.over_seg[2] = self.over_seg[3] = 0
            self.n_retries = self.n_ooms = self.n_sync = self.n_dev_alloc = self.n_dev_free = 0
        finally:
            lk.give()

    @cython.final
    cdef int64_t largest_free(self) noexcept:
        """_largest_free_block."""
        cdef int64_t a = ps_largest(&self.keys[0]), b = ps_largest(&self.keys[1])
        return a if a > b else b

    def _largest_free_block(self):
        return self.largest_free()

    # ------------------------------------------------------------------ layout
    cdef list heads(self):
        """_segment_heads: (start, end) of every snapshot segment, by address."""
        cdef int32_t b, e
        cdef int64_t v
        cdef int bi, i
        cdef SSet* ss = &self.segs
        out = []
        for bi in range(ss.nblk):
            for i in range(ss.nb[bi]):
                out.append((ss.blk[bi][i].b, ss.blk[bi][i].b + ss.blk[bi][i].c))
        for e in self.es_order:
            b = <int32_t>v if pm_get(&self.blocks, self.es[e].base, &v) else -1
            while b >= 0:
                if self.bk[b].mapped and (self.bk[b].prev < 0 or
                                          not self.bk[self.bk[b].prev].mapped):
                    start = self.bk[b].ptr
                    end = start
                    while b >= 0 and self.bk[b].mapped:
                        end = self.bk[b].ptr + <uint64_t>self.bk[b].size
                        b = self.bk[b].next
                    out.append((start, end))
                    continue
                b = self.bk[b].next
        out.sort()
        return out

    def _region_table(self):
        hs = self.heads()
        return [h[0] for h in hs], [h[1] for h in hs]

    def _region_at(self, ptr):
        cdef Key probe
        cdef int bi, i
        cdef int32_t b, e
        cdef int64_t v
        cdef uint64_t p
        if type(ptr) is not int or ptr < 0 or ptr >= 0xFFFFFFFFFFFFFFFF:
            return _PyCaching._region_at(self, ptr)
        p = ptr
        probe.a = 0
        probe.b = p + 1
        probe.c = 0
        if self.segs.size:
            if ss_lower_bound(&self.segs, &probe, &bi, &i):
                found = ss_prev(&self.segs, &bi, &i)
            else:
                bi = self.segs.nblk - 1
                i = self.segs.nb[bi] - 1
                found = True
            if found and p < ss_at(&self.segs, bi, i).b + ss_at(&self.segs, bi, i).c:
                return ss_at(&self.segs, bi, i).b
        for e in self.es_order:
            if self.es[e].base <= p < self.es[e].base + <uint64_t>(
                    self.es[e].page * self.es[e].max_pages):
                if not pm_get(&self.blocks, p, &v):
                    return self.es[e].base
                b = <int32_t>v
                while self.bk[b].prev >= 0 and self.bk[self.bk[b].prev].mapped:
                    b = self.bk[b].prev
                return self.bk[b].ptr
        return 0

    # ------------------------------------------------------------------ teardown
    def close(self):
        """Return every segment and page to the device (blocks still allocated are freed
        first, in the address table's order)."""
        cdef Lock lk = self._lock
        cdef int32_t s
        lk.take()
        try:
            for s in self.table_order():
                if self.bk[s].live and self.bk[s].allocated:
                    self.free(s)
            self.release_cached()
        finally:
            lk.give()
        self.flush_events()
