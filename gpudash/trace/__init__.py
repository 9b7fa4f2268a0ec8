"""Questions asked of an allocation trace: replay, what-if, and who holds the memory.

The trace itself, its file format, the importers and the exporters are the layer below,
:mod:`gpudash.formats`; the loaders and :class:`Trace` are re-exported here, so
``gpudash.trace.load_trace`` and ``from gpudash.trace import Trace`` keep working.

- replay: :mod:`~gpudash.trace.replay` (either allocator model, a trace's calls made again),
  :mod:`~gpudash.trace.torch_replay` (PyTorch snapshots replayed decision by decision);
- what-if: :mod:`~gpudash.trace.whatif` (the smallest fraction that fits, settings sweeps) over
  the units of work in :mod:`~gpudash.trace.tasks`, and what a trace cannot tell
  (:mod:`~gpudash.trace.caveats`);
- attribution: :mod:`~gpudash.trace.holders` (who holds the memory at a moment),
  :mod:`~gpudash.trace.diff` (what changed), :mod:`~gpudash.trace.categories` (what each
  allocation is for), :mod:`~gpudash.trace.callers` (the user's frame of each stack).
"""

from __future__ import annotations

import sys as _sys

from .. import workloads as _workloads
from ..formats import perfetto as _perfetto
from ..formats import stacks as _stacks
from ..formats import torch_profile as _torch_profile
from ..formats import torch_snapshot as _torch_snapshot
from ..formats.cupy_hook import load_cupy_hook
from ..formats.format import Trace, TraceWriter, read_trace, write_trace
from ..formats.io import load_ranks, load_trace, save_trace
from ..formats.rmm_csv import load_rmm_csv
from ..formats.tf_dump import read_dumps
from ..formats.tf_log import load_tf_log
from ..formats.tf_vectors import load_tf_vectors, load_vector_json
from ..formats.torch_snapshot import load_torch_snapshot, save_torch_snapshot
from ..formats.xplane import load_xplane
from .diff import diff_holders, leaks
from .holders import top_holders
from .replay import ReplayResult, replay, replay_devices
from .whatif import MinFractionResult, SweepTable, min_fraction, sweep

# Modules that lived here before gpudash.formats and gpudash.workloads, under the names that
# earlier docs gave them (``from gpudash.trace.torch_snapshot import load_torch_snapshot``):
# the same module objects, importable by either name.
for _old, _module in (("perfetto", _perfetto), ("stacks", _stacks),
                      ("torch_profile", _torch_profile), ("torch_snapshot", _torch_snapshot),
                      ("workloads", _workloads)):
    _sys.modules.setdefault(f"{__name__}.{_old}", _module)
del _old, _module

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
