"""Who holds the memory: bytes in use by holder at any event of a trace.

A trace's events may carry a holder (:attr:`gpudash.trace.Trace.holder`, an index into
:attr:`~gpudash.trace.Trace.holders`): the op that allocated (profiles: ``"op dtype[shape]"``;
logs: "requested by op"), or a label. :func:`top_holders` adds up the allocations live after a
given event by holder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._units import format_bytes
from .format import Trace

__all__ = ["top_holders", "HolderBytes", "UNNAMED"]

#: The name :func:`top_holders` gives allocations without a holder.
UNNAMED = "(no holder)"


@dataclass(frozen=True)
class HolderBytes:
    """Bytes one holder has in use at an event."""

    holder: str
    bytes: int
    allocations: int

    def __str__(self) -> str:
        return f"{self.holder}: {format_bytes(self.bytes)} in {self.allocations} allocation(s)"


def _event_index(trace: Trace, at: Any, rows: np.ndarray) -> int:
    """The row (in ``rows``' numbering of the trace) that ``at`` names."""
    c = trace.columns
    if isinstance(at, str):
        if at == "end":
            return len(rows) - 1
        if at != "peak":
            raise ValueError(f"at must be 'peak', 'end' or an event index; got {at!r}")
        kind = c["kind"][rows]
        size = c["size"][rows]
        delta = np.where(kind == 1, size, np.where(kind == 2, -size, 0))
        return int(np.argmax(np.cumsum(delta))) if len(rows) else -1
    i = int(at)
    n = len(trace)
    if not -n <= i < n:
        raise IndexError(f"event index {at} out of range for a trace of {n} events")
    i = i + n if i < 0 else i
    return int(np.searchsorted(rows, i, side="right")) - 1


def top_holders(trace: Trace, at: int | str = "peak", *, device: int | None = None,
                limit: int | None = None) -> list[HolderBytes]:
    """Bytes in use by holder just after an event, largest first.

    Parameters
    ----------
    trace : Trace
    at : "peak", "end" or int, default "peak"
        The event: the one after which bytes in use (allocated chunk bytes, as
        :meth:`Trace.summary` counts them) are highest, the last one, or an event index
        (a row of ``trace``).
    device : int, optional
        Only this device's allocations (and its peak); default all devices.
    limit : int, optional
        Keep the first ``limit`` holders.

    Returns
    -------
    list of HolderBytes
        ``holder`` is :data:`UNNAMED` for allocations without one. Their bytes add up to the
        bytes in use at that event (chunk bytes).
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"top_holders needs a gpudash.trace.Trace; got {type(trace).__name__}")
    c = trace.columns
    mask = np.isin(c["kind"], (1, 2))
    if device is not None:
        mask &= c["device"] == device
    rows = np.flatnonzero(mask)
    last = _event_index(trace, at, rows)
    if last < 0:
        return []
    upto = rows[:last + 1]
    kind = c["kind"][upto]
    aid = c["alloc_id"][upto]
    dev = c["device"][upto].astype(np.int64)
    key = (dev << 48) | (aid & ((1 << 48) - 1))
    a = kind == 1
    freed = np.isin(key[a], key[(kind == 2) & (aid > 0)])
    live = upto[a][~freed]
    if not len(live):
        return []
    holder = trace.holder[live]
    size = c["size"][live]
    uniq, inv = np.unique(holder, return_inverse=True)
    total = np.bincount(inv, weights=size.astype(np.float64), minlength=len(uniq))
    count = np.bincount(inv, minlength=len(uniq))
    exact = [int(size[inv == k].sum()) for k in range(len(uniq))] if len(uniq) < 4096 \
        else total.astype(np.int64).tolist()
    out = [HolderBytes(trace.holders[h] if h >= 0 else UNNAMED, int(b), int(n))
           for h, b, n in zip(uniq.tolist(), exact, count.tolist())]
    out.sort(key=lambda x: (-x.bytes, x.holder))
    return out[:limit] if limit is not None else out
