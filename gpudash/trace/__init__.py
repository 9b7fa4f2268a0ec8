"""Allocation traces: gpudash's own file format, importers of other allocators' logs, export.

Every importer returns a :class:`Trace`, a columnar table of allocator events
(:mod:`gpudash.events`) that replay and the views understand.
"""

from __future__ import annotations

from .cupy_hook import load_cupy_hook
from .format import Trace, TraceWriter, read_trace, write_trace
from .io import load_ranks, load_trace, save_trace
from .rmm_csv import load_rmm_csv
from .tf_log import load_tf_log
from .tf_vectors import load_tf_vectors, load_vector_json
from .torch_snapshot import load_torch_snapshot, save_torch_snapshot
from .xplane import load_xplane
from .tf_dump import read_dumps
from .holders import top_holders
from .diff import diff_holders, leaks
from .replay import ReplayResult, replay, replay_devices
from .whatif import MinFractionResult, SweepTable, min_fraction, sweep

__all__ = [
    "Trace",
    "TraceWriter",
    "read_trace",
    "write_trace",
    "load_trace",
    "load_ranks",
    "save_trace",
    "load_tf_log",
    "load_tf_vectors",
    "load_vector_json",
    "load_torch_snapshot",
    "save_torch_snapshot",
    "load_rmm_csv",
    "load_cupy_hook",
    "load_xplane",
    "read_dumps",
    "top_holders",
    "diff_holders",
    "leaks",
    "replay",
    "replay_devices",
    "ReplayResult",
    "min_fraction",
    "MinFractionResult",
    "sweep",
    "SweepTable",
]
