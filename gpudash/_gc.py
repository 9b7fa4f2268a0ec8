"""Python's cyclic garbage collector, paused for work that makes millions of objects and no
cycles.

A PyTorch snapshot is millions of dicts and lists; an exact replay keeps millions of trace
entries (the model's history, then its snapshot). Each full collection of the oldest
generation walks them all, and making them sets off dozens: more than half of
``pickle.load``'s time on a large snapshot. Neither holds a cycle, so nothing is left for
the collector to find.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off for the block (back on after, if it was on)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
