"""A plain best-fit-with-coalescing allocator: the yardstick for gpudash's speed.

What a careful Python programmer writes from the algorithm's description, with no event
hooks, no statistics and no TensorFlow details: 256-byte rounding, 21 bins of (size, address)
sorted lists searched with ``bisect``, a best fit from the request's bin upwards, a split
when the rest is at least as large as the request, coalescing with both neighbours on free,
and regions that start at 2 MiB and double. ``bench_ratios.py`` runs the same workload
through it and through :class:`gpudash.BFCAllocator`.
"""

from __future__ import annotations

from bisect import bisect_left, insort

MIN = 256
BINS = 21


def _bin(size: int) -> int:
    b = (size >> 8).bit_length() - 1
    return 0 if b < 0 else (20 if b > 20 else b)


class ReferenceBFC:
    """``allocate(n) -> address`` and ``deallocate(address)`` over a simulated address
    space of ``limit`` bytes."""

    def __init__(self, limit: int, first_region: int = 2 << 20) -> None:
        self.limit = limit
        self.pool = 0
        self.next_region = first_region
        self.base = 1 << 40
        # address -> [size, in_use, previous address or None, next address or None]
        self.chunks: dict[int, list] = {}
        self.bins: list[list[tuple[int, int]]] = [[] for _ in range(BINS)]

    def allocate(self, nbytes: int) -> int:
        if nbytes <= 0:
            return 0
        rounded = (nbytes + MIN - 1) & ~(MIN - 1)
        for _ in range(2):
            for b in range(_bin(rounded), BINS):
                lst = self.bins[b]
                i = bisect_left(lst, (rounded, 0))
                if i < len(lst):
                    size, ptr = lst.pop(i)
                    return self._use(ptr, size, rounded)
            if not self._extend(rounded):
                raise MemoryError(f"out of memory allocating {nbytes} bytes")
        raise MemoryError(f"out of memory allocating {nbytes} bytes")  # pragma: no cover

    def _use(self, ptr: int, size: int, rounded: int) -> int:
        c = self.chunks[ptr]
        if size - rounded >= rounded:  # split: the rest becomes a free chunk
            rest = ptr + rounded
            nxt = c[3]
            self.chunks[rest] = [size - rounded, False, ptr, nxt]
            if nxt is not None:
                self.chunks[nxt][2] = rest
            c[3] = rest
            c[0] = rounded
            insort(self.bins[_bin(size - rounded)], (size - rounded, rest))
        c[1] = True
        return ptr

    def _remove_free(self, ptr: int, size: int) -> None:
        lst = self.bins[_bin(size)]
        del lst[bisect_left(lst, (size, ptr))]

    def deallocate(self, ptr: int) -> None:
        if not ptr:
            return
        chunks = self.chunks
        c = chunks[ptr]
        if not c[1]:
            raise ValueError(f"double free of {ptr:#x}")
        c[1] = False
        nxt = c[3]
        if nxt is not None and not chunks[nxt][1]:  # merge the next chunk into this one
            n = chunks.pop(nxt)
            self._remove_free(nxt, n[0])
            c[0] += n[0]
            c[3] = n[3]
            if n[3] is not None:
                chunks[n[3]][2] = ptr
        prev = c[2]
        if prev is not None and not chunks[prev][1]:  # merge this one into the previous
            p = chunks[prev]
            self._remove_free(prev, p[0])
            p[0] += c[0]
            p[3] = c[3]
            if c[3] is not None:
                chunks[c[3]][2] = prev
            del chunks[ptr]
            ptr, c = prev, p
        insort(self.bins[_bin(c[0])], (c[0], ptr))

    def _extend(self, rounded: int) -> bool:
        size = self.next_region
        while size < rounded:
            size *= 2
        size = min(size, self.limit - self.pool)
        if size < rounded:
            return False
        self.next_region = size * 2
        ptr = self.base
        self.base += size + (1 << 30)  # regions are never adjacent
        self.pool += size
        self.chunks[ptr] = [size, False, None, None]
        insort(self.bins[_bin(size)], (size, ptr))
        return True

    @property
    def bytes_in_use(self) -> int:
        return sum(c[0] for c in self.chunks.values() if c[1])
