# The pickle check of a PyTorch memory snapshot, compiled: the twin of
# gpudash.trace.torch_snapshot._check_pickle (the readable reference, and the pure-Python
# path), with the same verdicts and the same messages, byte offsets included.
#
# The opcodes are walked in C, without the GIL, over the caller's buffer (bytes, an mmap of
# the file, a memoryview: read in place, never copied), the state in locals during the walk.
# What the Python check keeps in lists is kept in growable C arrays: per stack item whether
# it is a str (a byte), the marks (their stack depths) and per memo entry whether it holds a
# str (a bit). Each grows by at most one item per opcode (the memo by at most 257 entries
# per 5-byte LONG_BINPUT, as the rule allows), so their size is bounded by the size of the
# pickle (at worst 8 bytes of marks per byte); no recursion, so no nesting is too deep, and
# running out of memory is a MemoryError. The one rare case left to Python is a protocol-0
# PUT or GET whose index is not a plain run of at most 18 digits: Python's int() reads it
# (signs, spaces, underscores, its digit limit), and the walk goes on from the next opcode.

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdlib cimport free as pc_free, realloc as pc_realloc
from libc.string cimport memchr as pc_memchr, memset as pc_memset

from ._errors import TraceFormatError as _TraceFormatError

# How each opcode's argument is read (the Python check's _ARG): a fixed number of bytes
# (>= 0), a length of 1, 4 or 8 bytes then that many bytes (-1, -4, -8), text lines (-10:
# one, -20: two); PC_NONE: an opcode no snapshot holds.
cdef enum:
    PC_NONE = -128

cdef signed char PC_ARG[256]


cdef void _pc_init_table() noexcept:
    cdef int k
    for k in range(256):
        PC_ARG[k] = PC_NONE
    for k in b"(.012Nadle]s)ut\x85\x86\x87\x88\x89\x8f\x90\x91\x94\x93Q}":
        PC_ARG[k] = 0
    for k in b"FILSVgpP":
        PC_ARG[k] = -10
    PC_ARG[ord("c")] = -20
    for k in b"Jjr":
        PC_ARG[k] = 4
    for k in b"Khq\x80":
        PC_ARG[k] = 1
    PC_ARG[ord("M")] = 2
    PC_ARG[ord("G")] = 8
    PC_ARG[0x95] = 8
    for k in b"TXB\x8b":
        PC_ARG[k] = -4
    for k in b"UC\x8c\x8a":
        PC_ARG[k] = -1
    for k in b"\x8d\x8e\x96":
        PC_ARG[k] = -8


_pc_init_table()

# What one walk ends with
cdef enum:
    PC_END = 0          # the end of the data, a STOP, or an opcode the unpickler refuses
    PC_KEY = 1          # a dict key that is not a string
    PC_SETELEM = 2      # a set element that is not a string
    PC_MEMO = 3         # a memo index out of range (in .k)
    PC_OPCODE = 4       # an opcode no snapshot holds (in .op)
    PC_NOEOL = 5        # a text argument with no end of line
    PC_PAST = 6         # an argument past the end
    PC_TEXT_MEMO = 7    # a protocol-0 PUT/GET for Python's int() (.op, .j, .end)
    PC_NOMEM = 8        # out of memory


cdef struct PickScan:
    const unsigned char* data
    Py_ssize_t n
    Py_ssize_t i            # the opcode being read (the offset errors name)
    Py_ssize_t j            # its argument: data[j:end]
    Py_ssize_t end
    int op
    int64_t k               # the memo index of PC_MEMO
    unsigned char* stack    # per stack item: 1 if a str
    Py_ssize_t nstack
    Py_ssize_t capstack
    Py_ssize_t* marks
    Py_ssize_t nmarks
    Py_ssize_t capmarks
    unsigned char* memo     # a bit per memo entry: 1 if it holds a str
    Py_ssize_t nmemo
    Py_ssize_t capmemo      # in bytes


cdef unsigned char* _pc_grow(unsigned char* p, Py_ssize_t* cap, Py_ssize_t need) noexcept nogil:
    """``p`` (``*cap`` bytes) grown to at least ``need`` bytes, the new ones zero; NULL when
    out of memory (``p`` is then left as it was)."""
    cdef Py_ssize_t c = cap[0] * 2 if cap[0] else 4096
    cdef unsigned char* grown
    if c < need:
        c = need
    grown = <unsigned char*>pc_realloc(p, <size_t>c)
    if grown != NULL:
        pc_memset(grown + cap[0], 0, <size_t>(c - cap[0]))
        cap[0] = c
    return grown


cdef inline uint64_t _pc_le(const unsigned char* p, Py_ssize_t count) noexcept nogil:
    """int.from_bytes(p[:count], "little"), unsigned."""
    cdef uint64_t v = 0
    cdef Py_ssize_t b
    for b in range(count - 1, -1, -1):
        v = (v << 8) | p[b]
    return v


cdef int _pc_scan(PickScan* s) noexcept nogil:
    """Walk from ``s.i`` to a verdict (PC_*). Every step is the Python check's. The state
    lives in locals (registers) during the walk and goes back to ``s`` at its end."""
    cdef const unsigned char* data = s.data
    cdef Py_ssize_t n = s.n, i = s.i, j = 0, end = 0, k, length
    cdef unsigned char* stack = s.stack
    cdef Py_ssize_t ns = s.nstack, cs = s.capstack
    cdef unsigned char* memo = s.memo
    cdef Py_ssize_t nm = s.nmemo, cm = s.capmemo
    cdef Py_ssize_t* marks = s.marks
    cdef Py_ssize_t nk = s.nmarks, ck = s.capmarks
    cdef unsigned char* grown
    cdef Py_ssize_t* grown_marks
    cdef const unsigned char* nl
    cdef int op = 0, a, rc = PC_END
    cdef int64_t sv = 0
    cdef uint64_t uv
    while i < n:
        if ns == cs:                    # room for the one item an opcode may push
            grown = _pc_grow(stack, &cs, cs + 1)
            if grown == NULL:
                rc = PC_NOMEM
                break
            stack = grown
        op = data[i]
        # the most frequent opcodes of a snapshot first
        if op == 0x68:                  # BINGET
            k = data[i + 1] if i + 1 < n else 0
            stack[ns] = (memo[k >> 3] >> (k & 7)) & 1 if k < nm else 0
            ns += 1
            i += 2
        elif op == 0x6a:                # LONG_BINGET (a short tail reads what is there)
            if n - i < 5:
                k = <Py_ssize_t>_pc_le(data + i + 1, n - i - 1)
                stack[ns] = (memo[k >> 3] >> (k & 7)) & 1 if k < nm else 0
                ns += 1
                i += 5
                continue
            while True:                 # a run of them (a list of shared frames) at once
                k = (<Py_ssize_t>data[i + 1] | (<Py_ssize_t>data[i + 2] << 8)
                     | (<Py_ssize_t>data[i + 3] << 16) | (<Py_ssize_t>data[i + 4] << 24))
                stack[ns] = (memo[k >> 3] >> (k & 7)) & 1 if k < nm else 0
                ns += 1
                i += 5
                if n - i < 5 or data[i] != 0x6a or ns == cs:
                    break
        elif op == 0x94:                # MEMOIZE
            if (nm >> 3) >= cm:
                grown = _pc_grow(memo, &cm, (nm >> 3) + 1)
                if grown == NULL:
                    rc = PC_NOMEM
                    break
                memo = grown
            if ns and stack[ns - 1]:
                memo[nm >> 3] |= <unsigned char>(1 << (nm & 7))
            nm += 1
            i += 1
        elif op == 0x8c:                # SHORT_BINUNICODE: a str
            if i + 1 >= n or data[i + 1] > n - i - 2:
                s.i = i
                rc = PC_PAST
                break
            stack[ns] = 1
            ns += 1
            i += 2 + data[i + 1]
        elif op == 0x28:                # MARK
            if nk == ck:
                ck = ck * 2 if ck else 1024
                grown_marks = <Py_ssize_t*>pc_realloc(marks, <size_t>ck * sizeof(Py_ssize_t))
                if grown_marks == NULL:
                    ck = nk
                    rc = PC_NOMEM
                    break
                marks = grown_marks
            marks[nk] = ns
            nk += 1
            i += 1
        elif op == 0x75 or op == 0x65:  # SETITEMS APPENDS
            k = 0
            if nk:
                nk -= 1
                k = marks[nk]
            if op == 0x75:
                j = k
                while j < ns and stack[j]:
                    j += 2
                if j < ns:
                    s.i = i
                    rc = PC_KEY
                    break
            if k < ns:
                ns = k
            i += 1
        elif op == 0x4b:                # BININT1
            if i + 2 > n:
                s.i = i
                rc = PC_PAST
                break
            stack[ns] = 0
            ns += 1
            i += 2
        else:
            a = PC_ARG[op]
            if a == PC_NONE:
                s.i, s.op = i, op
                rc = PC_OPCODE
                break
            j = i + 1
            if a > 0:
                end = j + a
            elif a == 0:
                end = j
            elif a >= -8:
                length = -a
                if length > n - j:      # the length itself is cut: its value ends past it
                    s.i = i
                    rc = PC_PAST
                    break
                if op == 0x8b:          # LONG4: a signed length
                    sv = <int32_t><uint32_t>_pc_le(data + j, 4)
                    j += 4
                    if sv < 0 or sv > n - j:
                        s.i = i
                        rc = PC_PAST
                        break
                    end = j + <Py_ssize_t>sv
                else:
                    uv = _pc_le(data + j, length)
                    j += length
                    if uv > <uint64_t>(n - j):
                        s.i = i
                        rc = PC_PAST
                        break
                    end = j + <Py_ssize_t>uv
            else:
                end = j
                nl = data + end         # -10: one line, -20: two
                for k in range(-a // 10):
                    nl = <const unsigned char*>pc_memchr(data + end, b"\n", <size_t>(n - end))
                    if nl == NULL:
                        break
                    end = (nl - data) + 1
                if nl == NULL:
                    s.i = i
                    rc = PC_NOEOL
                    break
            if end > n:
                s.i = i
                rc = PC_PAST
                break
            if (op == 0x53 or op == 0x56 or op == 0x58 or op == 0x54 or op == 0x55
                    or op == 0x8d):     # the other opcodes that push a str
                stack[ns] = 1
                ns += 1
            elif op == 0x71 or op == 0x72 or op == 0x70 or op == 0x67:
                # BINPUT LONG_BINPUT, and PUT GET of protocol 0 (a line of digits)
                if op == 0x71 or op == 0x72:
                    sv = <int64_t>_pc_le(data + j, end - j)
                else:
                    length = end - 1 - j
                    sv = 0
                    if 1 <= length <= 18:
                        for k in range(j, end - 1):
                            if data[k] < 0x30 or data[k] > 0x39:
                                length = 0
                                break
                            sv = sv * 10 + (data[k] - 0x30)
                    if not 1 <= length <= 18:   # anything else: Python's int() reads it
                        s.i, s.j, s.end, s.op = i, j, end, op
                        rc = PC_TEXT_MEMO
                        break
                if op == 0x67:
                    stack[ns] = (memo[sv >> 3] >> (sv & 7)) & 1 if sv < nm else 0
                    ns += 1
                else:
                    if sv > nm + 256:
                        s.i, s.k = i, sv
                        rc = PC_MEMO
                        break
                    if (sv >> 3) >= cm:
                        grown = _pc_grow(memo, &cm, <Py_ssize_t>(sv >> 3) + 1)
                        if grown == NULL:
                            rc = PC_NOMEM
                            break
                        memo = grown
                    if sv >= nm:
                        nm = <Py_ssize_t>sv + 1   # new entries are False: still 0 bits
                    if ns and stack[ns - 1]:
                        memo[sv >> 3] |= <unsigned char>(1 << (sv & 7))
                    else:
                        memo[sv >> 3] &= <unsigned char>~(1 << (sv & 7))
            elif (op == 0x90 or op == 0x91 or op == 0x64 or op == 0x6c or op == 0x74
                  or op == 0x31):
                # ADDITEMS FROZENSET DICT LIST TUPLE POP_MARK: back to the mark
                k = 0
                if nk:
                    nk -= 1
                    k = marks[nk]
                if op == 0x64 or op == 0x90 or op == 0x91:
                    j = k
                    while j < ns and stack[j]:
                        j += 2 if op == 0x64 else 1
                    if j < ns:
                        s.i = i
                        rc = PC_KEY if op == 0x64 else PC_SETELEM
                        break
                if k < ns:
                    ns = k
                if op != 0x90 and op != 0x31:
                    stack[ns] = 0
                    ns += 1
            elif op == 0x73:            # SETITEM
                if ns >= 2 and not stack[ns - 2]:
                    s.i = i
                    rc = PC_KEY
                    break
                ns = ns - 2 if ns >= 2 else 0
            elif op == 0x61 or op == 0x30:  # APPEND POP
                if ns:
                    ns -= 1
            elif op == 0x85 or op == 0x86 or op == 0x87:    # TUPLE1..3
                # del stack[len(stack) - c:], Python's slice: a start below 0 counts from
                # the end again (a stack of 2 under TUPLE3 keeps 1 item)
                k = ns - (op - 0x84)
                if k < 0:
                    k += ns
                    if k < 0:
                        k = 0
                ns = k
                stack[ns] = 0
                ns += 1
            elif op == 0x32:            # DUP
                stack[ns] = stack[ns - 1] if ns else 0
                ns += 1
            elif op == 0x2e:            # STOP
                break
            elif op == 0x63 or op == 0x93 or op == 0x50 or op == 0x51:
                break                   # refused by the unpickler, with its own message
            elif op != 0x80 and op != 0x95:
                stack[ns] = 0           # a number, bytes, None, a bool, an empty container
                ns += 1
            i = end
    s.stack, s.nstack, s.capstack = stack, ns, cs
    s.memo, s.nmemo, s.capmemo = memo, nm, cm
    s.marks, s.nmarks, s.capmarks = marks, nk, ck
    return rc


def check_pickle(data, name):
    """The compiled twin of ``gpudash.trace.torch_snapshot._check_pickle``: refuse, before
    it is unpickled, a pickle that would take gigabytes or hours to load although it is
    small (a memo index far past the entries stored, a dict key or set element that is not
    a string, an opcode no snapshot holds, a length past the end), with the Python check's
    verdicts and messages. ``data``: any buffer of the pickle's bytes (bytes, an mmap, a
    memoryview), read in place without the GIL."""
    cdef Py_buffer buf
    cdef PickScan s
    cdef int rc
    PyObject_GetBuffer(data, &buf, PyBUF_SIMPLE)
    pc_memset(&s, 0, sizeof(PickScan))
    s.data = <const unsigned char*>buf.buf
    s.n = buf.len
    try:
        while True:
            with nogil:
                rc = _pc_scan(&s)
            if rc == PC_END:
                return None
            if rc == PC_TEXT_MEMO:
                _pc_text_memo(&s, name)
                continue
            if rc == PC_NOMEM:
                raise MemoryError(f"checking the pickle {name}: out of memory")
            if rc == PC_KEY:
                raise _pc_refuse(name, "a dict key that is not a string", s.i)
            if rc == PC_SETELEM:
                raise _pc_refuse(name, "a set element that is not a string", s.i)
            if rc == PC_MEMO:
                raise _pc_refuse(name, f"the memo index {s.k:,} with {s.nmemo:,} entries "
                                 "stored", s.i)
            if rc == PC_OPCODE:
                raise _pc_unreadable(name, f"the opcode {bytes([s.op])!r}, which no snapshot "
                                     "holds: it builds an object other than builtin data, or "
                                     "is no opcode", s.i)
            if rc == PC_NOEOL:
                raise _pc_unreadable(name, "a text argument with no end of line", s.i)
            raise _pc_unreadable(name, "an argument that runs past the end of the file", s.i)
    finally:
        pc_free(s.stack)
        pc_free(s.marks)
        pc_free(s.memo)
        PyBuffer_Release(&buf)


cdef _pc_refuse(name, why, i):
    return _TraceFormatError(f"refusing to load {name}: {why} at byte {i:,} of the pickle "
                             "(a PyTorch memory snapshot holds only dicts keyed by "
                             "strings, lists, strings and numbers)")


cdef _pc_unreadable(name, why, i):
    return _TraceFormatError(f"{name}: neither JSON nor a readable pickle ({why} at byte "
                             f"{i:,})")


cdef bint _pc_push(PickScan* s, unsigned char v) noexcept nogil:
    cdef unsigned char* grown
    if s.nstack == s.capstack:
        grown = _pc_grow(s.stack, &s.capstack, s.capstack + 1)
        if grown == NULL:
            return False
        s.stack = grown
    s.stack[s.nstack] = v
    s.nstack += 1
    return True


cdef unsigned char _pc_memo_at(PickScan* s, int64_t k) noexcept nogil:
    """The memo entry ``k`` (0 <= k), False past the entries stored."""
    return (s.memo[k >> 3] >> (k & 7)) & 1 if k < s.nmemo else 0


cdef bint _pc_memo_set(PickScan* s, int64_t k, unsigned char v) noexcept nogil:
    """memo[k] = v, the memo grown with False entries up to k (0 <= k <= nmemo + 256)."""
    cdef unsigned char* grown
    if (k >> 3) >= s.capmemo:
        grown = _pc_grow(s.memo, &s.capmemo, <Py_ssize_t>(k >> 3) + 1)
        if grown == NULL:
            return False
        s.memo = grown
    if k >= s.nmemo:
        s.nmemo = <Py_ssize_t>k + 1     # new entries are False: their bits are still 0
    if v:
        s.memo[k >> 3] |= <unsigned char>(1 << (k & 7))
    else:
        s.memo[k >> 3] &= <unsigned char>~(1 << (k & 7))
    return True


cdef _pc_text_memo(PickScan* s, name):
    """A protocol-0 PUT or GET whose index Python's int() reads (signs, spaces,
    underscores, its digit limit), as the Python check does; the walk goes on after it."""
    text = (<const char*>s.data)[s.j:s.end]
    if s.op == 0x70:                    # PUT
        try:
            k = int(text)
        except ValueError:
            raise _pc_unreadable(name, "a memo index that is not a number", s.i) from None
        if not 0 <= k <= s.nmemo + 256:
            raise _pc_refuse(name, f"the memo index {k:,} with {s.nmemo:,} entries stored",
                             s.i)
        if not _pc_memo_set(s, k, s.stack[s.nstack - 1] if s.nstack else 0):
            raise MemoryError(f"checking the pickle {name}: out of memory")
    else:                               # GET
        try:
            k = int(text)
        except ValueError:
            k = -1
        if not _pc_push(s, _pc_memo_at(s, k) if 0 <= k < s.nmemo else 0):
            raise MemoryError(f"checking the pickle {name}: out of memory")
    s.i = s.end
