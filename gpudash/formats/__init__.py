"""Allocation traces as data: the in-memory :class:`Trace`, gpudash's ``.gdtrace`` file, the
importers of other allocators' logs and profiles, and the exporters.

Every importer reads a file into a :class:`Trace`, a columnar table of allocator events
(:mod:`gpudash.events`) with interned call stacks (:mod:`gpudash.formats.stacks`):

- :mod:`~gpudash.formats.format` (the trace, ``.gdtrace``) and :mod:`~gpudash.formats.io`
  (:func:`load_trace` sniffs any format);
- PyTorch: :mod:`~gpudash.formats.torch_snapshot` (memory snapshots, read and written),
  :mod:`~gpudash.formats.torch_trace` (a snapshot's device trace as arrays),
  :mod:`~gpudash.formats.torch_profile` (profiler traces);
- TensorFlow, JAX, XLA: :mod:`~gpudash.formats.tf_log`, :mod:`~gpudash.formats.tf_dump`,
  :mod:`~gpudash.formats.tf_vectors`, :mod:`~gpudash.formats.xplane`;
- RMM and CuPy: :mod:`~gpudash.formats.rmm_csv`, :mod:`~gpudash.formats.cupy_hook`;
- export: :mod:`~gpudash.formats.perfetto` (Chrome trace JSON for Perfetto).

This layer knows nothing of replay or attribution: the questions asked of a trace live in
:mod:`gpudash.trace`, which re-exports the names below.
"""

from __future__ import annotations

from .cupy_hook import load_cupy_hook
from .format import Trace, TraceWriter, read_trace, write_trace
from .io import load_ranks, load_trace, save_trace
from .rmm_csv import load_rmm_csv
from .tf_dump import read_dumps
from .tf_log import load_tf_log
from .tf_vectors import load_tf_vectors, load_vector_json
from .torch_snapshot import load_torch_snapshot, save_torch_snapshot
from .xplane import load_xplane

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
]
