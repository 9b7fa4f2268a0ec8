# The replay loops a replay engine (gpudash.trace.replay._Engine) runs, over numpy columns
# (ops int8, the rest int64), in C. Each mirrors its model's Python loop
# (gpudash.models.bfc.run_plain, run_deferred; gpudash.models.torch.run_torch) call for
# call. Included by _core.pyx.

cdef inline object _samples(Py_ssize_t n):
    return (np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64),
            np.empty(n, dtype=np.int64))


cdef inline void _keep_samples(object sample, object arrays, Py_ssize_t made):
    cdef int k
    for k in range(3):
        sample[k].append(arrays[k][:made])


def run_bfc(BFCCore a, ops, keys, nbytes, Py_ssize_t start, Py_ssize_t stop, KeyMap ptrs,
            list oom_calls, sample, Py_ssize_t max_ooms):
    """``gpudash.models.bfc.run_plain``: returns (the calls made up to, frees of unknown keys).
    ``sample``: None, or three lists that each get one int64 array (in use, pool, largest
    free after every call)."""
    cdef const int8_t[::1] O = ops
    cdef const int64_t[::1] K = keys
    cdef const int64_t[::1] N = nbytes
    cdef int64_t[::1] S0, S1, S2
    cdef Py_ssize_t i, made = 0, skipped = 0
    cdef int op
    cdef int64_t n, v
    cdef uint64_t p
    cdef bint sampling = sample is not None
    arrays = None
    if sampling:
        arrays = _samples(stop - start)
        S0, S1, S2 = arrays
    for i in range(start, stop):
        op = O[i]
        if op == 2:
            if pm_del(&ptrs.m, <uint64_t>K[i], &v):
                a.replay_free(<uint64_t>v)
            else:
                skipped += 1
        else:
            n = N[i]
            p = a.replay_alloc(n, True)   # 0 when refused: an oom event, no memory log
            if p or not n:
                if op == 1:
                    pm_put(&ptrs.m, <uint64_t>K[i], <int64_t>p)
                else:   # an allocation the source refused, served now: give it back
                    a.replay_free(p)
            else:
                oom_calls.append(i)
                if len(oom_calls) >= max_ooms:
                    stop = i + 1
                    if sampling:
                        S0[made] = a._in_use
                        S1[made] = a._pool
                        S2[made] = a.largest_free()
                    made += 1
                    break
        if sampling:
            S0[made] = a._in_use
            S1[made] = a._pool
            S2[made] = a.largest_free()
        made += 1
    if sampling:
        _keep_samples(sample, arrays, made)
    return stop, skipped


def run_bfc_deferred(BFCCore a, ops, keys, nbytes, Py_ssize_t start, Py_ssize_t stop,
                     KeyMap ptrs, list oom_calls, sample, Py_ssize_t max_ooms, list held,
                     int64_t threshold, int64_t held_bytes):
    """``gpudash.models.bfc.run_deferred``: returns (calls made up to, frees of unknown keys,
    allocations served after applying held frees, bytes held)."""
    cdef const int8_t[::1] O = ops
    cdef const int64_t[::1] K = keys
    cdef const int64_t[::1] N = nbytes
    cdef int64_t[::1] S0, S1, S2
    cdef Py_ssize_t i, made = 0, skipped = 0, retried = 0
    cdef int op
    cdef int64_t n, v
    cdef uint64_t p
    cdef bint sampling = sample is not None
    arrays = None
    if sampling:
        arrays = _samples(stop - start)
        S0, S1, S2 = arrays
    for i in range(start, stop):
        op = O[i]
        n = N[i]
        if op == 2:
            if not pm_del(&ptrs.m, <uint64_t>K[i], &v):
                skipped += 1
            else:
                held.append(<uint64_t>v)
                held_bytes += n
                if held_bytes >= threshold:
                    for q in held:
                        a.replay_free(q)
                    del held[:]
                    held_bytes = 0
        else:
            # With frees held, the first attempt is quiet: EventMgr flushes them and the
            # allocator retries, and only a refusal of the retry is an oom event.
            p = a.replay_alloc(n, not held)
            if not p and n and held:
                for q in held:
                    a.replay_free(q)
                del held[:]
                held_bytes = 0
                p = a.replay_alloc(n, True)
                if p:
                    retried += 1
            if p or not n:
                if op == 1:
                    pm_put(&ptrs.m, <uint64_t>K[i], <int64_t>p)
                else:
                    a.replay_free(p)
            else:
                oom_calls.append(i)
                if len(oom_calls) >= max_ooms:
                    if sampling:
                        S0[made] = a._in_use
                        S1[made] = a._pool
                        S2[made] = a.largest_free()
                    made += 1
                    stop = i + 1
                    break
        if sampling:
            S0[made] = a._in_use
            S1[made] = a._pool
            S2[made] = a.largest_free()
        made += 1
    if sampling:
        _keep_samples(sample, arrays, made)
    return stop, skipped, retried, held_bytes


def run_torch(CachingCore a, ops, keys, nbytes, streams, Py_ssize_t start, Py_ssize_t stop,
              KeyMap ptrs, list oom_calls, sample, Py_ssize_t max_ooms):
    """``gpudash.models.torch.run_torch``: returns (calls made up to, frees of unknown keys).
    ``streams``: None (all 0) or a uint64 array."""
    cdef const int8_t[::1] O = ops
    cdef const int64_t[::1] K = keys
    cdef const int64_t[::1] N = nbytes
    cdef const uint64_t[::1] T
    cdef int64_t[::1] S0, S1, S2
    cdef Py_ssize_t i, made = 0, skipped = 0
    cdef int op
    cdef int64_t n, v
    cdef uint64_t p
    cdef bint sampling = sample is not None, streamed = streams is not None
    if streamed:
        T = streams
    arrays = None
    if sampling:
        arrays = _samples(stop - start)
        S0, S1, S2 = arrays
    for i in range(start, stop):
        op = O[i]
        if op == 2:
            if pm_del(&ptrs.m, <uint64_t>K[i], &v):
                a.replay_free(<uint64_t>v)
            else:
                skipped += 1
        elif op == 9:
            a.empty_cache_c()
        else:
            n = N[i]
            p = a.replay_alloc(n, T[i] if streamed else 0)
            if p or not n:
                if op == 1:
                    pm_put(&ptrs.m, <uint64_t>K[i], <int64_t>p)
                elif p:
                    a.replay_free(p)   # a request the source refused, served now
            else:
                oom_calls.append(i)
                if len(oom_calls) >= max_ooms:
                    stop = i + 1
                    if sampling:
                        S0[made] = a.st[ST_ALLOCATED_BYTES][0]
                        S1[made] = a._reserved
                        S2[made] = a.largest_free()
                    made += 1
                    break
        if sampling:
            S0[made] = a.st[ST_ALLOCATED_BYTES][0]
            S1[made] = a._reserved
            S2[made] = a.largest_free()
        made += 1
    if sampling:
        _keep_samples(sample, arrays, made)
    return stop, skipped
