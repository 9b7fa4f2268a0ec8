"""Replay a trace's allocations through an allocator model on a simulated device.

:func:`replay` answers "would this run fit, and how would the pool look, with these
settings?": it takes the trace's calls (:meth:`~gpudash.trace.Trace.calls`, every alloc,
free and refused allocation in order), builds a fresh :class:`~gpudash.SimulatedDevice` and
the allocator of the trace's model (TensorFlow's and JAX's BFC, PyTorch's caching allocator:
:func:`gpudash.models.trace_model`, or ``allocator=``) with the settings asked for, and
makes the same calls. What differs between the models (how their settings resolve, the loop
that runs the calls, whether a replay's state can be copied) each model's module says
(:class:`gpudash.models.AllocatorModel`).

Replaying a trace that gpudash recorded, with the settings it was recorded with, reproduces
it exactly (same addresses, same regions, same statistics): the allocator and the simulated
device are both deterministic.

The loops are written for speed (bound methods and plain lists, the allocator's private
counters read directly); ``benchmarks/bench_replay.py`` measures them.
"""

from __future__ import annotations

import array
import functools
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._accel import twin
from .._errors import ConfigError, warn_user
from .._version import __version__
from .._gc import collector_paused
from .._units import format_bytes
from ..bfc import _GC_MESSAGE, BFCAllocator, MemoryDump
from ..devices import SimulatedDevice
from ..events import (
    COLUMN_DTYPES, COLUMNS, ALLOC as _ALLOC, FREE as _FREE, EXTEND as _EXTEND,
    RELEASE as _RELEASE, OOM as _OOM, EventKind,
)
from ..models import (AllocatorModel, ReplaySettings, default_model, device_meta, model_for,
                      trace_model)
from ..models.base import UNSET as _UNSET
from ..models.bfc import DEFAULT_DEVICE_BYTES  # a name this module has always offered
from ..formats.format import Trace, parse_byte_count, device_entries, parse_flag
from ..formats.torch_snapshot import _with_stacks
from ..formats.torch_trace import A_ALLOC, A_OOM
from .caveats import trace_warnings
from .torch_replay import from_trace, replay_exact

__all__ = ["replay", "replay_devices", "ReplayResult", "resolve_settings", "trace_settings",
           "source_limit", "device_label", "DeviceIndex", "DEFAULT_DEVICE_BYTES"]

# The compiled core's replay loops (_csrc/replay.pxi) and key -> pointer map, used when the
# replayed allocator is compiled; None on the pure-Python path (the Python loops run).
_KeyMap = twin("KeyMap", None)

#: Device size replay assumes when none is given: 16 GiB.
_CHUNK = 1 << 16  # calls per inner loop: progress is reported between chunks



# ---------------------------------------------------------------------------------- settings
def _meta_devices(trace: Trace) -> dict[int, dict]:
    """``meta["devices"]`` by index; odd entries left out (see ``device_entries``)."""
    return device_entries(trace.meta)


def _recorded(entry: dict | None, dev: int) -> dict[str, Any]:
    """The settings one ``meta["devices"]`` entry records (see :func:`trace_settings`)."""
    out: dict[str, Any] = {"device": dev}
    if entry is None:
        return out
    opts = entry.get("options")
    opts = opts if isinstance(opts, dict) else {}
    field = ""
    try:
        field = "capacity"
        if entry.get("capacity"):
            out["device_bytes"] = parse_byte_count(entry["capacity"])
        field = "memory_limit"
        if entry.get("memory_limit"):
            out["memory_limit"] = parse_byte_count(entry["memory_limit"])
        elif opts.get("memory_limit"):
            field = "options.memory_limit"
            out["memory_limit"] = parse_byte_count(opts["memory_limit"])
        for key in ("allow_growth", "garbage_collection"):
            field = f"options.{key}"
            flag = parse_flag(opts.get(key))
            if flag is not None:
                out[key] = flag
    except ValueError as exc:
        raise ConfigError(f"device {dev}: the trace records {field} = {exc}") from None
    name = entry.get("name")
    if name:
        out["name"] = str(name)
    return out


def trace_settings(trace: Trace, device: int | None = None) -> dict[str, Any]:
    """The settings a trace says it was recorded with (from ``meta["devices"]``).

    Parameters
    ----------
    trace : Trace
    device : int, optional
        Device index; default the trace's first device.

    Returns
    -------
    dict
        Some of ``device``, ``device_bytes`` (the device's ``capacity``),
        ``memory_limit``, ``allow_growth`` and ``garbage_collection``: only what the
        metadata holds (a trace recorded by gpudash holds them all; an imported one may hold
        none). ``allow_growth`` and ``garbage_collection`` are taken only as booleans (JSON
        true/false).

    Raises
    ------
    ConfigError
        A recorded value that is none of these (``allow_growth: "false"``, a string; a
        ``capacity`` of ``"x"``): the message names the device and the field.
    """
    dev = _pick_device(trace, device)
    return _recorded(_meta_devices(trace).get(dev), dev)


def source_limit(trace: Trace, device: int) -> int | None:
    """The memory limit a TensorFlow log says its allocator had (the ``memory_limit`` of
    the device's metadata in a trace imported from a log), else None."""
    if trace.meta.get("source") != "tensorflow-log":
        return None
    return trace_settings(trace, device).get("memory_limit")


def _label(device: int, entry: dict | None) -> str:
    name = entry.get("name") if entry is not None else None
    return f"device {device} ({name})" if name else f"device {device}"


def device_label(trace: Trace, device: int) -> str:
    """``"device 1 (GPU_1_bfc)"``."""
    return _label(device, _meta_devices(trace).get(int(device)))


def _pick_device(trace: Trace, device: int | None, devices: DeviceIndex | None = None) -> int:
    index = devices if devices is not None else DeviceIndex(trace)
    return index.pick(device)


class DeviceIndex:
    """The devices of one trace, looked up once, for work on many of them.

    :func:`replay` of one device scans the whole trace (its devices, its calls); replaying
    each of thousands of devices that way takes time devices x events. A ``DeviceIndex``
    finds the devices with events and the metadata of each once, and, on the first
    :meth:`replay`, every device's calls with one pass (a stable sort of the trace's call
    list by device): all devices then take time linear in devices + events.
    :func:`replay_devices` and ``gpudash replay`` use it.

    Parameters
    ----------
    trace : Trace

    Attributes
    ----------
    devices : list of int
        The device indices with events, in order (``[]`` for a trace without events).
    """

    def __init__(self, trace: Trace) -> None:
        if not isinstance(trace, Trace):
            raise TypeError(f"DeviceIndex needs a gpudash.trace.Trace; got "
                            f"{type(trace).__name__}")
        self.trace = trace
        col = trace.columns["device"]
        uniq, counts = np.unique(col, return_counts=True)
        self.devices: list[int] = uniq.tolist()
        self._events = dict(zip(self.devices, counts.tolist()))
        self._meta = _meta_devices(trace)
        self._calls: tuple | None = None

    def pick(self, device: int | None) -> int:
        """The device a replay of ``device`` uses (see :func:`replay`'s ``device``)."""
        devs = self.devices
        if device is None:
            if len(devs) > 1:

                others = ", ".join(self.label(d) for d in devs[1:])
                warn_user(f"the trace has {len(devs)} devices; using {self.label(devs[0])}, "
                          f"not {others}: pass device= to choose (or replay_devices() for "
                          "all)")
            if devs:
                return devs[0]
            return next(iter(self._meta), 0)
        device = int(device)
        if devs and device not in self._events:
            raise ValueError(f"the trace has no events of device {device}; its devices are "
                             f"{devs}")
        return device

    def label(self, device: int) -> str:
        """``"device 1 (GPU_1_bfc)"`` (:func:`device_label`)."""
        return _label(device, self._meta.get(int(device)))

    def settings(self, device: int | None = None) -> dict[str, Any]:
        """:func:`trace_settings` of ``device``."""
        dev = self.pick(device)
        return _recorded(self._meta.get(dev), dev)

    def recorded(self, device: int) -> dict:
        """The trace's ``meta["devices"]`` entry of ``device`` (``{}`` when none)."""
        return self._meta.get(device) or {}

    def capacity(self, device: int) -> tuple[int, str] | None:
        """:func:`torch_capacity` of ``device``."""
        return torch_capacity(self.trace, device)

    def peak_reserved(self, device: int) -> int:
        """The most memory the trace's regions (segments) held at once on ``device``."""
        return _peak_reserved(self.trace, device)

    def source_limit(self, device: int) -> int | None:
        """:func:`source_limit` of ``device``."""
        if self.trace.meta.get("source") != "tensorflow-log":
            return None
        return self.settings(device).get("memory_limit")

    def calls(self, device: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The calls of ``device`` (op, key, nbytes as numpy columns) and its event count."""
        calls, rows = self._device_calls(device)
        return calls.op[rows], calls.key[rows], calls.nbytes[rows], self._events.get(device, 0)

    def _device_calls(self, device: int) -> tuple[Any, np.ndarray]:
        """The trace's calls and the positions of ``device``'s among them."""
        if self._calls is None:
            calls = self.trace.calls()
            order = np.argsort(calls.device, kind="stable")
            sorted_dev = calls.device[order]
            self._calls = (calls, order, sorted_dev)
        calls, order, sorted_dev = self._calls
        lo = np.searchsorted(sorted_dev, device, side="left")
        hi = np.searchsorted(sorted_dev, device, side="right")
        return calls, order[lo:hi]

    def torch_calls(self, device: int) -> tuple:
        """:func:`torch_calls` of ``device``."""
        calls, rows = self._device_calls(device)
        return _torch_calls(self.trace, device, calls.op[rows], calls.key[rows],
                            calls.nbytes[rows], calls.row[rows], self._events.get(device, 0))

    def replay(self, device: int, **kwargs: Any) -> ReplayResult:
        """:func:`replay` of ``device`` (``kwargs``: replay's other arguments)."""
        _check_replay_args(kwargs)
        return _replay(self.trace, self, device=device, **kwargs)


def resolve_settings(trace: Trace | None = None, options: Any = None,
                     **explicit: Any) -> ReplaySettings:
    """Merge defaults, ``options`` and explicit settings (explicit ones win).

    Parameters
    ----------
    trace : Trace, optional
        Needed when ``options == "trace"`` and to choose the default device.
    options : GPUOptions, dict or "trace", optional
        A :class:`~gpudash.GPUOptions` (its ``per_process_gpu_memory_fraction``,
        ``allow_growth`` and ``deferred_deletion_bytes``), a dict of replay settings or
        GPUOptions fields, or ``"trace"`` for the settings the trace was recorded with
        (:func:`trace_settings`).
    **explicit
        Settings given by name; they win over ``options``. An explicit ``fraction`` also
        drops a ``memory_limit`` that came from ``options`` (an explicit ``memory_limit``
        wins over everything).

    Returns
    -------
    ReplaySettings
        The model's settings (:class:`~gpudash.models.BFCReplaySettings`,
        :class:`~gpudash.models.TorchReplaySettings`): every setting of :func:`replay`,
        ``memory_limit`` resolved to bytes. They read as a dict (``s["memory_limit"]``,
        ``s["allocator"]``) and change by ``s.replace(...)``.

    Raises
    ------
    ConfigError
        An unknown setting (the message lists the known ones) or an invalid value.
    """
    index = DeviceIndex(trace) if trace is not None else None
    return _resolve(trace, index, options, explicit)


def _model(trace: Trace | None, options: Any, explicit: dict[str, Any]) -> AllocatorModel:
    """The model a replay runs: ``allocator=`` (also in ``options``), else the trace's own."""
    name = explicit.get("allocator", _UNSET)
    if (name is _UNSET or name is None) and isinstance(options, Mapping):
        name = options.get("allocator", _UNSET)
    if name is _UNSET or name is None:
        return trace_model(trace) if trace is not None else default_model()
    return model_for(name)


def _resolve(trace: Trace | None, index: DeviceIndex | None, options: Any,
             explicit: dict[str, Any]) -> ReplaySettings:
    """:func:`resolve_settings` with the trace's devices already looked up: the model's
    resolution of its settings, as its :class:`~gpudash.models.ReplaySettings`."""
    model = _model(trace, options, explicit)
    s = model.resolve(trace, index, options, explicit)
    kind = model.settings_type
    s["assumed"] = tuple(s.get("assumed") or ())
    return kind(**{k: s[k] for k in kind.names() if k in s})


def torch_capacity(trace: Trace, device: int) -> tuple[int, str] | None:
    """The device memory a PyTorch trace shows, and how: from an ``oom`` entry (the free
    bytes the driver reported plus the segments PyTorch held then: what PyTorch could use),
    or from the spacing of expandable segments' address reservations (PyTorch reserves
    1 1/8 x the device's total memory for each). None when it shows neither."""

    c = trace.columns
    rows = np.flatnonzero(c["device"] == device)
    if not len(rows):
        return None
    kind = c["kind"][rows]
    sizes = c["size"][rows]
    oom_free = trace.meta.get("oom_device_free")
    if isinstance(oom_free, list) and oom_free:
        free_at = {int(r): int(b) for r, b in (x for x in oom_free
                                               if isinstance(x, list) and len(x) == 2)}
        held = np.cumsum(np.where(kind == int(EventKind.EXTEND), sizes,
                                  np.where(kind == int(EventKind.RELEASE), -sizes, 0)))
        best = 0
        for k in np.flatnonzero(kind == int(EventKind.OOM)).tolist():
            free = free_at.get(int(rows[k]))
            if free:
                best = max(best, int(held[k]) + free)
        if best:
            return best, ("from the oom entry (the driver's free bytes plus what PyTorch held: "
                          "what PyTorch could use)")
    settings = trace.meta.get("allocator_settings")
    if isinstance(settings, Mapping) and settings.get("expandable_segments") is True:
        ext = rows[kind == int(EventKind.EXTEND)]
        starts = c["ptr"][ext].tolist()
        ends = (c["ptr"][ext] + c["size"][ext]).tolist()
        bases: list[int] = []
        tops: list[int] = []
        for lo, hi in zip(starts, ends):
            for k, (b, t) in enumerate(zip(bases, tops)):
                if b <= lo <= t:
                    tops[k] = max(t, hi)
                    break
            else:
                bases.append(lo)
                tops.append(hi)
        bases.sort()
        gaps = [b - a for a, b in zip(bases, bases[1:]) if b > a]
        if gaps:
            total = min(gaps) * 8 // 9
            return total, ("estimated from the spacing of expandable segments' address "
                           "reservations (1 1/8 x the device's memory each)")
    return None


def _peak_reserved(trace: Trace, device: int) -> int:
    """The most memory the trace's segments held at once on ``device``."""

    c = trace.columns
    on = c["device"] == device
    kind = c["kind"][on]
    size = c["size"][on]
    held = np.cumsum(np.where(kind == int(EventKind.EXTEND), size,
                              np.where(kind == int(EventKind.RELEASE), -size, 0)))
    return int(held.max()) if len(held) else 0


# ---------------------------------------------------------------------------------- engine
class _CountingSub:
    """The replay's sub-allocator: a simulated device, the regions it handed out and took
    back (``extensions``, ``releases``: the device table's own counts, so that segments the
    compiled PyTorch model places without Python count too), and the physical pages of
    expandable segments."""

    __slots__ = ("dev", "page_bytes", "_next_page", "_base")

    def __init__(self, dev: SimulatedDevice, extensions: int = 0, releases: int = 0) -> None:
        self.dev = dev
        self.page_bytes = 0  # physical pages of expandable segments, counted not placed
        self._next_page = 1
        table = dev._blocks
        self._base = (extensions - table.placed, releases - table.removed)

    @property
    def extensions(self) -> int:
        return self.dev._blocks.placed + self._base[0]

    @property
    def releases(self) -> int:
        return self.dev._blocks.removed + self._base[1]

    @property
    def _placement(self) -> Any:
        """The device's compiled table (see ``SimulatedDevice._placement``): the pages'
        bytes are the table's ``extra``, so a segment placed there meets :meth:`_room` too."""
        return self.dev._placement

    def alloc(self, nbytes: int) -> int:
        # raises MemoryError when it cannot: the pages count there too (the table's extra)
        return self.dev.alloc(nbytes)

    def _room(self, nbytes: int) -> None:
        dev = self.dev
        left = dev.capacity - dev.used - self.page_bytes
        if nbytes > left:
            raise MemoryError(
                f"{dev.name}: cannot allocate {nbytes} bytes: {dev.used + self.page_bytes} "
                f"bytes used of {dev.capacity} bytes capacity, {max(0, left)} bytes left")

    def _pages_changed(self) -> None:
        # pages count against a device's capacity, not against unified memory's 2x
        self.dev._blocks.extra = 0 if self.dev.unified else self.page_bytes

    def create_page(self, nbytes: int) -> int:
        """One physical page of an expandable segment (``cuMemCreate``): only its bytes
        count, since pages have no address until mapped into the segment's range."""
        if not self.dev.unified:
            self._room(nbytes)
        self.page_bytes += nbytes
        self._pages_changed()
        handle = self._next_page
        self._next_page += 1
        return handle

    def release_page(self, handle: int, nbytes: int) -> None:
        self.page_bytes -= nbytes
        self._pages_changed()

    def free(self, ptr: int, nbytes: int) -> None:
        self.dev.free(ptr, nbytes)

    @property
    def total(self) -> int:
        return self.dev.total

    def clone(self) -> _CountingSub:
        d = self.dev
        new_dev = SimulatedDevice(d.capacity, d.name, index=d.index, base=d.base,
                                  alignment=d.alignment, unified=d.unified,
                                  compute_capability=d.compute_capability)
        for ptr, size in d.blocks():
            new_dev._blocks.add(ptr, size)
        out = _CountingSub(new_dev, self.extensions, self.releases)
        out.page_bytes = self.page_bytes
        out._pages_changed()
        out._next_page = self._next_page
        return out


class _QuietGC(logging.Filter):
    """Drops the allocator's garbage-collection warning during a replay."""

    def filter(self, record: logging.LogRecord) -> bool:

        return record.msg != _GC_MESSAGE


class _Engine:
    """The allocator a model builds on a simulated device, the key -> pointer map of a
    replay, and the frees held back by deferred deletion. ``pos`` is the number of calls made
    so far.

    The loops that run over it are the model's (:meth:`runner`: ``run_plain``,
    ``run_deferred`` in :mod:`gpudash.models.bfc`, ``run_torch`` in
    :mod:`gpudash.models.torch`, and their compiled twins).
    """

    def __init__(self, settings: dict[str, Any], ops: list[int], keys: list[int],
                 nbytes: list[int], name: str | None = None, streams: Any = None) -> None:
        settings = ReplaySettings.of(settings)   # a dict of them: converted once, here
        self.settings = settings
        self.ops, self.keys, self.nbytes = ops, keys, nbytes
        self.streams = streams   # a PyTorch trace's streams, per call (None: all 0)
        dev_index = int(settings["device"])
        frac = settings["fraction"]
        device = SimulatedDevice(settings["device_bytes"], index=dev_index,
                                 unified=bool(frac is not None and frac > 1.0),
                                 compute_capability=(int(settings["cc_major"]), 0))
        self.sub = _CountingSub(device)
        self.model = settings.model
        if name is not None:
            settings = settings.replace(name=name)
        self.alloc = self.model.build(settings, self.sub)
        # the compiled core's loops (gpudash._core) keep the key -> pointer map in C
        self.compiled = getattr(self.alloc, "compiled", False)
        self._columns: tuple | None = None
        self.ptrs: Any = _KeyMap() if self.compiled else {}
        self.held: list[int] = []  # pointers whose free is deferred
        self.held_bytes = 0
        self.pos = 0
        self.oom_calls: list[int] = []
        self.skipped_frees = 0
        self.retried = 0  # allocations served only after applying deferred frees

    # -- running ---------------------------------------------------------------------------
    def run_to(self, stop: int) -> None:
        """Make calls ``pos .. stop-1`` (no sampling: used for scrubbing)."""
        stop = min(stop, len(self.ops))
        if stop <= self.pos:
            return
        self.runner()(self.pos, stop, None)

    def runner(self) -> Callable:
        """The loop for this engine's model and settings: the model's pure-Python loop or
        its compiled twin (:meth:`~gpudash.models.AllocatorModel.runner`), as
        ``run(start, stop, sample, max_ooms=...)`` over this engine."""
        return functools.partial(self.model.runner(self.settings, self.compiled), self)

    def _core_columns(self) -> tuple:
        """ops (int8, as a trace's calls keep them: no copy), keys and nbytes (int64), and
        streams (uint64) as arrays for the compiled loops."""
        if self._columns is None:
            cols = [np.ascontiguousarray(self.ops, dtype=np.int8)]
            cols += [np.ascontiguousarray(c, dtype=np.int64) for c in (self.keys, self.nbytes)]
            cols.append(None if self.streams is None else
                        np.ascontiguousarray(np.asarray(self.streams).astype(np.uint64)))
            self._columns = tuple(cols)
        return self._columns

    def dump(self) -> MemoryDump:
        """The allocator's state as gpudash's neutral :class:`~gpudash.MemoryDump` (PyTorch's
        with its pools as ``extra["layout"] == "pools"``)."""
        return self.model.dump(self.alloc)

    def flush_held(self) -> None:
        """Apply the frees deferred deletion still holds."""
        for q in self.held:
            self.alloc.deallocate(q)
        self.held.clear()
        self.held_bytes = 0

    # -- cloning (checkpoints for scrubbing) -------------------------------------------------
    def clone(self) -> _Engine:
        """An independent copy of the engine and its allocator's whole state.

        Raises
        ------
        NotImplementedError
            When the model has no copy (:meth:`~gpudash.models.AllocatorModel.clone`) or
            this allocator cannot be copied (listeners); callers then fall back to
            replaying from the start.
        """
        if not self.model.checkpoints:
            raise NotImplementedError(f"replays through {self.model.title} have no "
                                      "checkpoints")
        new = object.__new__(_Engine)
        new.settings = self.settings
        new.model = self.model
        new.streams = self.streams
        new.ops, new.keys, new.nbytes = self.ops, self.keys, self.nbytes
        new.sub = self.sub.clone()
        new.alloc = self.model.clone(self.alloc, new.sub)
        new.ptrs = self.ptrs.copy()
        new.compiled = self.compiled
        new._columns = self._columns
        new.held = list(self.held)
        new.held_bytes = self.held_bytes
        new.pos = self.pos
        new.oom_calls = list(self.oom_calls)
        new.skipped_frees = self.skipped_frees
        new.retried = self.retried
        return new


# ---------------------------------------------------------------------------------- result
@dataclass(eq=False)
class ReplayResult:
    """What a :func:`replay` found.

    Attributes
    ----------
    oom_count : int
        Allocations refused (the allocation is skipped, and later its free).
    first_oom : tuple of (int, int) or None
        ``(call index, bytes requested)`` of the first refusal.
    ooms : numpy.ndarray of int64
        Call indices of every refusal.
    peak_pool_bytes, peak_bytes_in_use : int
        The allocator's peaks (regions held; chunk bytes in use).
    extensions : int
        Regions the allocator obtained from the device.
    releases : int
        Regions it gave back (garbage collection).
    memory_limit : int
        The allocator's limit in bytes.
    options : dict
        The settings of the replay (device_bytes, fraction, memory_limit, allow_growth,
        garbage_collection, fragmentation_fraction, deferred_deletion_bytes, device).
    per_call : dict of numpy.ndarray
        Sampled after every call: ``in_use``, ``pool``, ``largest_free`` (bytes, int64) and
        ``fragmentation`` (``1 - largest_free / free`` with ``free = pool - in_use``; 0 when
        nothing is free). Empty when the replay ran with ``per_call=False``.
    recording : Trace or None
        Every event of the replay (``record=True``). When the trace has call stacks
        (:attr:`Trace.stack`), each event carries the stack of the trace row its call
        replays (an alloc or oom its request's, a free its free's, an extend its
        allocation's), sharing the trace's stack table; ``snapshot`` carries them as
        ``frames``.
    final_snapshot : MemoryDump
        The allocator's state at the end (after any deferred frees were applied).
    calls : int
        Calls replayed.
    events : int
        Events of the replayed device in the trace.
    skipped_frees : int
        Frees of refused allocations, not made.
    retried : int
        Allocations refused at first and served after applying deferred frees.
    stopped_early : bool
        True when ``max_ooms`` ended the replay before the last call.
    elapsed_s : float
        Wall time of the replay loop.
    events_per_second : float
        ``events / elapsed_s``.
    warnings : list of str
        What the trace lacks to answer for the job that made it (an incomplete or missing
        dump, no events): :func:`gpudash.trace.caveats.trace_warnings`. With any, ``fits``
        and the peaks hold for the calls the trace has, not for the job.
    allocator : str
        The model replayed: ``"bfc"`` (TensorFlow's and JAX's) or ``"torch"`` (PyTorch's
        caching allocator). For ``"torch"``, ``peak_pool_bytes`` is PyTorch's peak
        reserved, ``peak_bytes_in_use`` its peak allocated, ``extensions`` and
        ``releases`` its ``num_device_alloc`` / ``num_device_free`` (segments, or maps and
        unmaps), ``memory_limit`` what ``set_per_process_memory_fraction`` allows (the
        device without one).
    snapshot : dict or None
        PyTorch's replay only: the model's own ``torch.cuda.memory._snapshot()`` at the end,
        with ``device_traces`` when the replay recorded (MemoryViz opens it).
    fidelity : ExactReplay or None
        An exact PyTorch replay only: how many segment events, addresses and OOMs of the
        trace the model reproduced, and whether the final layout is the snapshot's
        (:class:`gpudash.trace.torch_replay.ExactReplay`).
    assumed : list of str
        What the replay assumed that the trace does not say (the device's size...).
    limit_floor : int or None
        The lowest limit at which this replay runs the same, call for call: under any
        limit from ``limit_floor`` to ``memory_limit`` (the other settings unchanged) the
        allocator makes every decision as it did here, so the refusals, peaks and final
        state are these. It is the least limit that allows everything the limit allowed
        here (each region or segment obtained); what it refused, a lower limit refuses too.
        Equal to ``memory_limit`` where a decision depends on the exact limit (BFC without
        growth or with ``fragmentation_fraction``, PyTorch's garbage collection). None
        where not known. :func:`~gpudash.trace.whatif.min_fraction` uses it to skip
        replays whose answer it already has.
    """

    oom_count: int
    first_oom: tuple[int, int] | None
    ooms: np.ndarray
    peak_pool_bytes: int
    peak_bytes_in_use: int
    extensions: int
    releases: int
    memory_limit: int
    options: dict
    per_call: dict[str, np.ndarray] = field(repr=False)
    recording: Trace | None = field(repr=False)
    final_snapshot: MemoryDump = field(repr=False)
    calls: int = 0
    events: int = 0
    skipped_frees: int = 0
    retried: int = 0
    stopped_early: bool = False
    elapsed_s: float = 0.0
    events_per_second: float = 0.0
    warnings: list[str] = field(default_factory=list)
    allocator: str = "bfc"
    snapshot: dict | None = field(default=None, repr=False)
    fidelity: Any = field(default=None, repr=False)
    assumed: list[str] = field(default_factory=list)
    limit_floor: int | None = None

    @property
    def fits(self) -> bool:
        """True when no allocation was refused."""
        return self.oom_count == 0

    @property
    def worst_fragmentation(self) -> float:
        """The highest sampled external fragmentation (0.0 without samples)."""
        f = self.per_call.get("fragmentation")
        return float(f.max()) if f is not None and len(f) else 0.0

    def __repr__(self) -> str:
        if self.fits:
            verdict = "fits"
        else:
            first = self.first_oom[0] if self.first_oom else "?"
            verdict = f"{self.oom_count} OOMs (first at call {first})"
        if self.warnings:
            verdict += f" of an incomplete trace ({len(self.warnings)} warning(s): .warnings)"
        sizes = model_for(self.allocator).result_sizes(self)  # the framework's own words
        return (f"ReplayResult({verdict}, {self.allocator}, "
                f"limit={format_bytes(self.memory_limit)}, {sizes}, calls={self.calls}, "
                f"{self.events_per_second:,.0f} events/s)")


# ---------------------------------------------------------------------------------- progress
class _TextProgress:
    """``label: done/total (pct)`` on stderr, at most every 0.5 s, and a final line."""

    def __init__(self, label: str, stream: Any = None, interval: float = 0.5) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self._last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        final = done >= total
        if not final and now - self._last < self.interval:
            return
        self._last = now
        pct = 100.0 * done / total if total else 100.0
        self.stream.write(f"\r{self.label}: {done:,}/{total:,} ({pct:5.1f}%)")
        if final:
            self.stream.write("\n")
        self.stream.flush()


def _progress_fn(progress: Any, label: str) -> Callable[[int, int], None] | None:
    if progress is None or progress is False:
        return None
    if progress is True:
        return _TextProgress(label)
    if callable(progress):
        return progress
    raise TypeError(f"progress must be None, True or a callable(done, total); got {progress!r}")


# ---------------------------------------------------------------------------------- replay
def _calls_lists(trace: Trace, device: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The calls of ``device`` as numpy columns (op, key, nbytes) and its event count."""
    op, key, nbytes = trace._call_columns(device)
    n_events = int(np.count_nonzero(trace.columns["device"] == device))
    return op, key, nbytes, n_events


def _model_calls(trace: Trace, settings: dict, index: DeviceIndex | None = None, *,
                 with_rows: bool = False) -> tuple:
    """The calls a replay with ``settings`` makes, for either model: ``(op, key, nbytes,
    streams, n_events)`` as numpy columns (``streams`` None for BFC, which has none); with
    ``with_rows``, the trace row of each call after them."""
    settings = ReplaySettings.of(settings)
    dev = settings["device"]
    streams = settings.model.streams   # calls on streams, with empty_cache() among them
    if with_rows:
        if streams:
            return torch_calls(trace, dev, with_rows=True)
        calls = trace.calls(dev)
        n_events = int(np.count_nonzero(trace.columns["device"] == dev))
        return calls.op, calls.key, calls.nbytes, None, n_events, calls.row
    if streams:
        return torch_calls(trace, dev) if index is None else index.torch_calls(dev)
    op, key, nbytes, n_events = (_calls_lists(trace, dev) if index is None
                                 else index.calls(dev))
    return op, key, nbytes, None, n_events


def limit_for(settings: dict, fraction: float | None) -> int:
    """The limit a replay with ``settings`` gets at ``fraction``: TensorFlow's rule for BFC
    (None or 0: its default), ``fraction * device`` for PyTorch's
    ``set_per_process_memory_fraction`` (None: the whole device)."""
    return ReplaySettings.of(settings).limit(fraction)


#: The op of an ``empty_cache()`` call in a PyTorch trace's call list.
EMPTY_CACHE = 9


def torch_calls(trace: Trace, device: int, *, with_rows: bool = False) -> tuple:
    """The calls a replay through PyTorch's allocator makes for ``device``:
    ``(op, key, nbytes, stream, n_events)`` as numpy columns.

    Besides the allocations (op 1, on their streams), frees (2) and failed requests (7),
    a PyTorch trace shows ``torch.cuda.empty_cache()`` calls only by what they did: a run of
    ``segment_free``/``segment_unmap`` entries. Each such run becomes an ``empty_cache()``
    call (op 9) where it stands, except a run right before a failed request (the
    allocator's own release before it gave up). A release the allocator made because the
    driver refused memory looks the same and is replayed as a call too: it only returns
    cached memory, so it never makes a replay fail (gpudash's exact replay tells the two
    apart; see :mod:`gpudash.trace.torch_replay`).

    With ``with_rows``, a sixth column: the trace row of each call (an ``empty_cache()``
    call: the first release row of its run).
    """
    calls = trace.calls(device)
    n_events = int(np.count_nonzero(trace.columns["device"] == device))
    out = _torch_calls(trace, device, calls.op, calls.key, calls.nbytes, calls.row, n_events,
                       with_rows=with_rows)
    return out


def _torch_calls(trace: Trace, device: int, op: np.ndarray, key: np.ndarray,
                 nbytes: np.ndarray, rows: np.ndarray, n_events: int,
                 with_rows: bool = False) -> tuple:

    c = trace.columns
    streams = trace.streams()[rows] if trace.stream is not None else None
    rel = np.flatnonzero((c["kind"] == int(EventKind.RELEASE)) & (c["device"] == device))
    if not len(rel):
        return (op, key, nbytes, streams, n_events) + ((rows,) if with_rows else ())
    # the call each release precedes; one empty_cache() per run (same next call)
    at = np.searchsorted(rows, rel)
    runs, first = np.unique(at, return_index=True)
    first_rel = rel[first]
    before_oom = np.zeros(len(runs), dtype=bool)
    inside = runs < len(op)
    before_oom[inside] = op[runs[inside]] == 7
    runs = runs[~before_oom]
    first_rel = first_rel[~before_oom]
    n = len(op) + len(runs)
    pos = runs + np.arange(len(runs))            # where each empty_cache() lands
    keep = np.ones(n, dtype=bool)
    keep[pos] = False
    new_op = np.full(n, EMPTY_CACHE, dtype=op.dtype)
    new_key = np.zeros(n, dtype=key.dtype)
    new_nbytes = np.zeros(n, dtype=nbytes.dtype)
    new_op[keep], new_key[keep], new_nbytes[keep] = op, key, nbytes
    new_streams = None
    if streams is not None:
        new_streams = np.zeros(n, dtype=streams.dtype)
        new_streams[keep] = streams
    if not with_rows:
        return new_op, new_key, new_nbytes, new_streams, n_events
    new_rows = np.empty(n, dtype=rows.dtype)
    new_rows[keep] = rows
    new_rows[pos] = first_rel
    return new_op, new_key, new_nbytes, new_streams, n_events, new_rows


def replay(trace: Trace, *, allocator: str | None = _UNSET,
           device_bytes: int | str = _UNSET, fraction: float | None = _UNSET,
           memory_limit: int | str | None = _UNSET, allow_growth: bool = _UNSET,
           garbage_collection: bool = _UNSET, fragmentation_fraction: float = _UNSET,
           deferred_deletion_bytes: int = _UNSET, device: int | None = _UNSET,
           conf: Any = _UNSET, expandable_segments: bool | None = _UNSET,
           max_split_size_mb: int | None = _UNSET,
           garbage_collection_threshold: float | None = _UNSET,
           roundup_power2_divisions: Any = _UNSET, max_non_split_rounding_mb: int | None = _UNSET,
           torch_version: Any = _UNSET, exact: bool | None = _UNSET,
           options: Any = None, record: bool = True, per_call: bool = True,
           max_ooms: int | None = None, progress: Any = None) -> ReplayResult:
    """Replay a trace's allocations through a fresh allocator on a simulated device.

    Parameters
    ----------
    trace : Trace
        Any trace (recorded by gpudash, imported, synthetic).
    allocator : {"bfc", "torch"}, optional
        The model: TensorFlow's and JAX's BFC (``"bfc"``; also ``"tensorflow"``, ``"jax"``)
        or PyTorch's caching allocator (``"torch"``; also ``"pytorch"``). Default: the one
        that made the trace (PyTorch's for a PyTorch snapshot, else the BFC). PyTorch's
        takes its own settings (below) and no TensorFlow ones.
    device_bytes : int or str, default 16 GiB
        Size of the simulated device (``16 << 30`` or ``"16GiB"``).
    fraction : float or None, default None
        ``per_process_gpu_memory_fraction``: the limit is ``int(device_bytes * fraction)``.
        None (or 0) applies TensorFlow's default: the free memory minus the system reserve
        (:func:`gpudash.options.memory_limit` with fraction 0, compute capability 8; the
        ``TF_DEVICE_MIN_SYS_MEMORY_IN_MB`` variable is not read, so replays are
        reproducible). Above 1 the device oversubscribes as unified memory.
    memory_limit : int or str, optional
        The allocator's limit in bytes; when given it wins over ``fraction``. When neither
        is given, a trace imported from a TensorFlow log that states its allocator's limit
        (the dump's ``Limit:``, "Created device ... with N MB memory") replays at that limit
        (and the device is at least that large).
    allow_growth : bool, default True
    garbage_collection : bool, default False
    fragmentation_fraction : float, default 0.0
        Passed to :class:`~gpudash.BFCAllocator`.
    deferred_deletion_bytes : int, default 0
        When > 0, frees are held back (as TensorFlow's EventMgr holds freed tensors) until
        the bytes they requested reach this threshold, then applied together; an allocation
        that fails while frees are held applies them and retries before it counts as an OOM.
        Frees still held at the end are applied before the final snapshot. (GPUOptions'
        0 = "8 MiB" rule is not applied here: pass 8 MiB to model it.)
    device : int, optional
        Which device of a multi-device trace; default the first, with a
        :class:`~gpudash.GpudashWarning` naming it when there are several
        (:func:`replay_devices` replays them all). The simulated device gets this index (and
        so the addresses TensorFlow's device of that index would get).
    conf : str or CachingAllocatorConfig, optional
        PyTorch only: ``PYTORCH_CUDA_ALLOC_CONF``. Default: what the snapshot says it ran
        with (its ``allocator_settings``), else PyTorch's defaults.
    expandable_segments, max_split_size_mb, garbage_collection_threshold, \
roundup_power2_divisions, max_non_split_rounding_mb : optional
        PyTorch only: one setting, over ``conf``.
    torch_version : str, optional
        PyTorch only: whose rules (default: the snapshot's layout's, else 2.11).
    exact : bool, optional
        PyTorch only: replay with the trace's own segment addresses and release points and
        report in :attr:`ReplayResult.fidelity` how closely the model followed every
        decision. Default: for a PyTorch snapshot replayed with its recorded settings. With
        other settings (a fraction, another conf) the replay runs on a simulated device of
        ``device_bytes`` (default: what the trace shows, see :func:`torch_capacity`, else
        assumed and said so in :attr:`ReplayResult.assumed`).
    options : GPUOptions, dict or "trace", optional
        Settings in bulk (see :func:`resolve_settings`); ``"trace"`` takes them from the
        trace's metadata. Explicit keyword arguments win.
    record : bool, default True
        Record the replay's events (:attr:`ReplayResult.recording`), with the stacks of the
        calls they replay where the trace has stacks.
    per_call : bool, default True
        Sample in use, pool and largest free block after every call.
    max_ooms : int, optional
        Stop after this many refusals (``stopped_early``); bisections use 1.
    progress : callable or True, optional
        ``progress(done, total)`` in calls, every 65,536 calls and at the end; True prints
        a line on stderr at most every 0.5 s.

    Returns
    -------
    ReplayResult

    Notes
    -----
    Calls are made in order: an alloc calls ``allocate(requested)``; a refusal
    (:class:`~gpudash.OutOfMemoryError`) is counted and the allocation skipped, and so is its
    later free. A free calls ``deallocate``. An OOM row of the source (an allocation the
    original run could not serve) is attempted too, and freed at once if it succeeds now.
    Setting changes recorded in the trace (``limit`` rows) are not replayed.

    Examples
    --------
    >>> from gpudash.workloads import training_loop
    >>> r = replay(training_loop(steps=2, layers=2, hidden=512), device_bytes="1GiB",
    ...            fraction=0.5)
    >>> r.fits, r.memory_limit
    (True, 536870912)
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"replay needs a gpudash.trace.Trace; got {type(trace).__name__}")
    return _replay(trace, None, allocator=allocator, device_bytes=device_bytes,
                   fraction=fraction, memory_limit=memory_limit, allow_growth=allow_growth,
                   garbage_collection=garbage_collection,
                   fragmentation_fraction=fragmentation_fraction,
                   deferred_deletion_bytes=deferred_deletion_bytes, device=device, conf=conf,
                   expandable_segments=expandable_segments,
                   max_split_size_mb=max_split_size_mb,
                   garbage_collection_threshold=garbage_collection_threshold,
                   roundup_power2_divisions=roundup_power2_divisions,
                   max_non_split_rounding_mb=max_non_split_rounding_mb,
                   torch_version=torch_version, exact=exact, options=options, record=record,
                   per_call=per_call, max_ooms=max_ooms, progress=progress)


#: The arguments of :func:`replay` but ``trace`` (and ``device``, which replay_devices and
#: DeviceIndex.replay choose).
_REPLAY_ARGS = frozenset({"allocator", "device_bytes", "fraction", "memory_limit",
                          "allow_growth", "garbage_collection", "fragmentation_fraction",
                          "deferred_deletion_bytes", "options", "record", "per_call",
                          "max_ooms", "progress", "conf", "expandable_segments",
                          "max_split_size_mb", "garbage_collection_threshold",
                          "roundup_power2_divisions", "max_non_split_rounding_mb",
                          "torch_version", "exact"})


def _check_replay_args(kwargs: Mapping[str, Any]) -> None:
    for k in kwargs:
        if k not in _REPLAY_ARGS:
            raise TypeError(f"replay() got an unexpected keyword argument {k!r}")


def _replay(trace: Trace, index: DeviceIndex | None, *, options: Any = None,
            record: bool = True, per_call: bool = True, max_ooms: int | None = None,
            progress: Any = None, **explicit: Any) -> ReplayResult:
    """:func:`replay`; with ``index``, the trace's devices and calls come from it (looked up
    once for all the devices replayed), else from the trace (one device's calls)."""
    settings = _resolve(trace, index if index is not None else DeviceIndex(trace), options,
                        explicit)
    if max_ooms is not None and max_ooms < 1:
        raise ValueError(f"max_ooms must be >= 1 or None; got {max_ooms}")

    dev = settings["device"]
    report = _progress_fn(progress, "replay")
    if settings.get("exact"):   # a PyTorch snapshot's own segments
        with collector_paused():
            result = _replay_exact(trace, settings, record=record, per_call=per_call,
                                   progress=report)
    elif record and trace.stack is not None:   # the recording carries the calls' stacks
        ops, keys, nbytes, streams, n_events, rows = _model_calls(trace, settings,
                                                                  with_rows=True)
        result = _replay_lists(settings, ops, keys, nbytes, n_events, record=record,
                               per_call=per_call, max_ooms=max_ooms, progress=report,
                               streams=streams)
        ops = np.asarray(ops)[:result.calls]
        nb = np.asarray(nbytes)[:result.calls]
        cand = np.flatnonzero(((ops == 1) | (ops == 7)) & (nb > 0))
        free_rows = _free_rows_by_key(np.asarray(keys)[:result.calls], ops, rows, cand)
        _carry_stacks(result, trace, rows[cand], nb[cand], free_rows, dev)
    else:
        ops, keys, nbytes, streams, n_events = _model_calls(trace, settings, index)
        result = _replay_lists(settings, ops, keys, nbytes, n_events, record=record,
                               per_call=per_call, max_ooms=max_ooms, progress=report,
                               streams=streams)
    result.warnings = trace_warnings(trace, dev)
    return result


# ------------------------------------------------------------------ stacks of a replay's calls
def _free_rows_by_key(keys: np.ndarray, ops: np.ndarray, rows: np.ndarray,
                      cand: np.ndarray) -> np.ndarray:
    """The trace row of the free call of each allocation call ``cand`` (paired by key; -1
    for a refused request the replay served and gave back, or one never freed)."""
    frees = np.flatnonzero(ops == 2)
    out = np.full(len(cand), -1, dtype=np.int64)
    if not len(frees) or not len(cand):
        return out
    fk = keys[frees]
    order = np.argsort(fk, kind="stable")
    fk = fk[order]
    ck = keys[cand]
    j = np.minimum(np.searchsorted(fk, ck), len(fk) - 1)
    hit = (fk[j] == ck) & (ops[cand] == 1)
    out[hit] = rows[frees[order[j[hit]]]]
    return out


def _free_rows_by_id(trace: Trace, alloc_rows: np.ndarray) -> np.ndarray:
    """The trace row of the free of each alloc row (paired by ``alloc_id``; -1: none)."""
    c = trace.columns
    out = np.full(len(alloc_rows), -1, dtype=np.int64)
    frees = np.flatnonzero((c["kind"] == _FREE) & (c["alloc_id"] > 0))
    if not len(frees) or not len(alloc_rows):
        return out
    fid = c["alloc_id"][frees]
    order = np.argsort(fid, kind="stable")
    fid = fid[order]
    aid = c["alloc_id"][alloc_rows]
    j = np.minimum(np.searchsorted(fid, aid), len(fid) - 1)
    hit = (fid[j] == aid) & (c["kind"][alloc_rows] == _ALLOC) & (aid > 0)
    out[hit] = frees[order[j[hit]]]
    return out


def _carry_stacks(result: ReplayResult, trace: Trace, cand_rows: np.ndarray,
                  cand_nbytes: np.ndarray, free_rows: np.ndarray, device: int,
                  start: dict[int, int] | None = None,
                  start_frees: np.ndarray | None = None,
                  same_rows: np.ndarray | None = None) -> None:
    """Give ``result``'s recording (and PyTorch-layout snapshot) the stacks of the trace rows
    its calls replay.

    ``cand_rows`` are the trace rows of the allocation calls made (each an ``alloc`` or an
    ``oom`` event of the replay, in order), ``cand_nbytes`` their requests, ``free_rows``
    the row of each one's free. An alloc or oom event takes its call's stack, a free its
    free call's, an extend the stack of the allocation it was made for; releases have none.
    Where the replay's events do not line up with its calls (a request the allocator
    refused without an event), the recording keeps no stacks and its metadata says so.
    ``start``: stack ids of blocks allocated before the replay began, by address (an
    exact replay's rebuilt starting state), for the snapshot's final blocks;
    ``start_frees``: the trace rows of their frees, in order (the replay's frees of blocks
    it did not allocate take them when they free the same addresses in the same order).
    ``same_rows``: an exact replay's trace rows; where the replay made the same events of a
    kind at the same addresses (an exact replay does), each takes its row's stack, releases
    included (PyTorch records the stack of the call that released).
    """
    rec = result.recording
    if rec is None or trace.stack is None:
        return
    k = rec.columns["kind"]
    ev = np.flatnonzero((k == _ALLOC) | (k == _OOM))
    sids = trace.stack_ids()
    if len(ev) > len(cand_rows) or not np.array_equal(rec.columns["requested"][ev],
                                                      cand_nbytes[:len(ev)]):
        rec.meta["stacks"] = ("not carried: the replay's allocation events do not line up "
                              "with the trace's calls")
        return
    col = np.full(len(rec), -1, dtype=np.int32)
    col[ev] = sids[cand_rows[:len(ev)]]
    # frees: by the recording's allocation id, to their allocation's call's free
    is_a = k[ev] == _ALLOC
    a_rows, a_cand = ev[is_a], np.flatnonzero(is_a)
    f_rows = np.flatnonzero(k == _FREE)
    if len(a_rows) and len(f_rows):
        aid = rec.columns["alloc_id"][a_rows]
        order = np.argsort(aid, kind="stable")
        saids = aid[order]
        faid = rec.columns["alloc_id"][f_rows]
        j = np.minimum(np.searchsorted(saids, faid), len(saids) - 1)
        hit = saids[j] == faid
        ci = a_cand[order[j[hit]]]
        fr = free_rows[ci]
        col[f_rows[hit]] = sids[np.where(fr >= 0, fr, cand_rows[ci])]
        f_rows = f_rows[~hit]
    if start_frees is not None and len(f_rows) == len(start_frees) and np.array_equal(
            rec.columns["ptr"][f_rows], trace.columns["ptr"][start_frees]):
        col[f_rows] = sids[start_frees]     # frees of blocks allocated before the replay
    # extends: the allocation (or refusal) they were made for, the next one
    x_rows = np.flatnonzero(k == _EXTEND)
    if len(x_rows) and len(ev):
        nxt = np.searchsorted(ev, x_rows)
        ok = nxt < len(ev)
        col[x_rows[ok]] = col[ev[nxt[ok]]]
    if same_rows is not None:    # an exact replay: each event is a trace row, kind by kind
        tk = trace.columns["kind"][same_rows]
        for kind in (_ALLOC, _FREE, _EXTEND, _RELEASE, _OOM):
            mine, theirs = np.flatnonzero(k == kind), same_rows[tk == kind]
            if len(mine) == len(theirs) and np.array_equal(rec.columns["ptr"][mine],
                                                           trace.columns["ptr"][theirs]):
                col[mine] = sids[theirs]
    result.recording = Trace(rec.columns, rec.meta, rec.settings, holder=rec.holder,
                             holders=rec.holders, stream=rec.stream, stack=col,
                             stacks=trace.stacks)
    if result.snapshot is not None:

        _with_stacks(result.snapshot, result.recording, device, start or {})


def _replay_exact(trace: Trace, settings: dict, *, record: bool, per_call: bool,
                  progress: Callable[[int, int], None] | None) -> ReplayResult:
    """A PyTorch trace replayed with its own addresses and release points
    (:func:`gpudash.trace.torch_replay.replay_exact`), as a :class:`ReplayResult`."""

    tt = from_trace(trace, settings["device"])
    # samples as int64 arrays grown in place: no Python int kept per call
    sample = [array.array("q") for _ in range(3)] if per_call else None
    rec: list = []
    t0 = time.perf_counter()
    fid = replay_exact(tt, conf=settings["conf"], fraction=settings["fraction"],
                       device_total=settings["device_bytes"], sample=sample, progress=progress,
                       attach=(lambda a: rec.append(_Collected(a))) if record else None)
    elapsed = time.perf_counter() - t0
    alloc = fid.allocator
    recording = None
    if rec:
        recording = rec[0].to_trace(alloc, {"replay_of": _settings_for_meta(settings),
                                            "source": "gpudash"})
    pc = _per_call(sample) if sample is not None else {}
    st = alloc.memory_stats()
    ooms = np.array([i for i, _ in fid.oom_calls], dtype=np.int64)
    n_events = int(np.count_nonzero(trace.columns["device"] == settings["device"]))
    stats = alloc.stats()
    result = ReplayResult(
        oom_count=len(ooms), first_oom=fid.oom_calls[0] if fid.oom_calls else None, ooms=ooms,
        peak_pool_bytes=stats.peak_pool_bytes, peak_bytes_in_use=stats.peak_bytes_in_use,
        extensions=st["num_device_alloc"], releases=st["num_device_free"],
        memory_limit=alloc.memory_limit, options=_settings_for_meta(settings), per_call=pc,
        recording=recording, final_snapshot=alloc.memory_dump(), calls=fid.calls,
        events=n_events, elapsed_s=elapsed,
        events_per_second=n_events / elapsed if elapsed > 0 else float("inf"),
        allocator="torch", snapshot=fid.snapshot, fidelity=fid,
        assumed=list(settings.get("assumed") or []))
    if recording is not None and trace.stack is not None and tt.rows is not None:
        cand = np.flatnonzero(((tt.action == A_ALLOC) | (tt.action == A_OOM)) & (tt.size > 0))
        cand_rows = tt.rows[cand]
        c = trace.columns
        prefix = _prefix_rows(trace, settings["device"])
        start = prefix[c["kind"][prefix] == _ALLOC]
        start_frees = _free_rows_by_id(trace, start)
        _carry_stacks(result, trace, cand_rows, tt.size[cand], _free_rows_by_id(
            trace, cand_rows), settings["device"],
            dict(zip(c["ptr"][start].tolist(), trace.stack_ids()[start].tolist())),
            np.sort(start_frees[start_frees >= 0]), tt.rows)
    return result



def _prefix_rows(trace: Trace, device: int) -> np.ndarray:
    """The rows of ``device`` that hold an imported PyTorch snapshot's rebuilt starting state
    (``meta["torch"]["prefix"]``; none for other traces)."""
    torch_meta = trace.meta.get("torch") if isinstance(trace.meta.get("torch"), dict) else {}
    prefix = torch_meta.get("prefix") if isinstance(torch_meta.get("prefix"), dict) else {}
    p = prefix.get(str(device), 0)
    rows = np.flatnonzero(trace.columns["device"] == device)
    return rows[:p] if isinstance(p, int) and 0 < p <= len(rows) else rows[:0]


def replay_devices(trace: Trace, **kwargs: Any) -> dict[int, ReplayResult]:
    """:func:`replay` of every device of a trace, each with its own allocator.

    Parameters
    ----------
    trace : Trace
    **kwargs
        :func:`replay`'s settings (not ``device``), the same for every device; a TensorFlow
        log's own limit applies per device (see :func:`replay`).

    Returns
    -------
    dict of int to ReplayResult
        By device index, in order.
    """
    if "device" in kwargs:
        raise TypeError("replay_devices replays every device; use replay(device=...) for one")
    _check_replay_args(kwargs)
    if not isinstance(trace, Trace):
        raise TypeError(f"replay needs a gpudash.trace.Trace; got {type(trace).__name__}")
    index = DeviceIndex(trace)
    return {d: _replay(trace, index, device=d, **kwargs) for d in index.devices or [0]}


def _replay_lists(settings: dict, ops: list[int], keys: list[int], nbytes: list[int],
                  n_events: int, *, record: bool, per_call: bool, max_ooms: int | None,
                  progress: Callable[[int, int], None] | None,
                  streams: Any = None) -> ReplayResult:
    eng = _Engine(settings, ops, keys, nbytes, streams=streams)
    alloc = eng.alloc
    model = eng.model
    if record:
        model.keep_history(alloc, max(1, 4 * len(ops) + 16))
    total = len(ops)
    rec = _Collected(alloc) if record else None
    sample = [[], [], []] if per_call else None
    parts: list[list[np.ndarray]] = [[], [], []]  # the samples, as int64 arrays per chunk
    run = eng.runner()
    quiet = _QuietGC()
    logger = logging.getLogger("gpudash")
    logger.addFilter(quiet)
    stopped = False
    t0 = time.perf_counter()
    try:
        limit = sys.maxsize if max_ooms is None else max_ooms
        pos = 0
        while pos < total:
            run(pos, min(pos + _CHUNK, total), sample, limit)
            if sample is not None:  # per-call samples kept compact: 24 bytes a call
                for k in range(3):
                    parts[k].append(_sample_array(sample[k]))
                    sample[k].clear()
            pos = eng.pos
            if len(eng.oom_calls) >= limit:
                stopped = pos < total
                break
            if progress is not None and pos % _CHUNK == 0 and pos < total:
                progress(pos, total)
        eng.flush_held()
        elapsed = time.perf_counter() - t0
    finally:
        logger.removeFilter(quiet)
    if progress is not None:
        progress(total, total)
    recording = None
    if rec is not None:
        recording = rec.to_trace(alloc, {"replay_of": _settings_for_meta(settings)})
    ooms = np.array(eng.oom_calls, dtype=np.int64)
    first = (int(ooms[0]), int(nbytes[ooms[0]])) if len(ooms) else None
    pc: dict[str, np.ndarray] = {}
    if sample is not None:
        for k in range(3):  # anything sampled after the last chunk (an early stop)
            parts[k].append(_sample_array(sample[k]))
        pc = _per_call([np.concatenate(p) for p in parts])
    stats = alloc.stats()
    done = eng.pos
    events = n_events if done == total else int(round(n_events * done / max(total, 1)))
    extensions, releases = model.device_calls(alloc, eng.sub)
    return ReplayResult(
        oom_count=len(ooms), first_oom=first, ooms=ooms,
        peak_pool_bytes=stats.peak_pool_bytes, peak_bytes_in_use=stats.peak_bytes_in_use,
        extensions=extensions, releases=releases,
        memory_limit=alloc.memory_limit, options=_settings_for_meta(settings), per_call=pc,
        recording=recording,
        final_snapshot=model.dump(alloc), calls=done,
        events=events, skipped_frees=eng.skipped_frees, retried=eng.retried,
        stopped_early=stopped, elapsed_s=elapsed,
        events_per_second=events / elapsed if elapsed > 0 else float("inf"),
        allocator=model.name, snapshot=model.history(alloc),
        assumed=list(settings.get("assumed") or []),
        limit_floor=min(alloc.limit_floor, alloc.memory_limit))


def _sample_array(values: list) -> np.ndarray:
    """One chunk's samples as int64: Python ints (the Python loops) or int64 arrays (the
    compiled loops)."""
    if values and isinstance(values[0], np.ndarray):
        return np.concatenate(values)
    return np.array(values, dtype=np.int64)


def _per_call(samples: list) -> dict[str, np.ndarray]:
    """Per-call samples (in use, pool, largest free) as arrays, with fragmentation."""
    in_use, pool, lf = (np.asarray(x, dtype=np.int64) for x in samples)
    free = pool - in_use
    with np.errstate(divide="ignore", invalid="ignore"):
        frag = np.where(free > 0, 1.0 - lf / np.where(free > 0, free, 1), 0.0)
    return {"in_use": in_use, "pool": pool, "largest_free": lf, "fragmentation": frag}


class _Collected:
    """A replay's events: the allocator's event batches, kept as they come and joined once
    at the end, column by column. Memory is the events made (about 60 bytes each), not a
    ring buffer sized ahead for the most a replay could make."""

    def __init__(self, alloc: BFCAllocator) -> None:
        self.batches: list[dict[str, np.ndarray]] = []
        self._remove = alloc._add_sink(lambda columns, extra: self.batches.append(columns))

    def to_trace(self, alloc: BFCAllocator, meta: dict) -> Trace:
        alloc.flush_events()
        self._remove()
        columns = {}
        for name in COLUMNS:  # each batch's column is dropped as soon as it is copied
            columns[name] = np.concatenate(
                [b.pop(name) for b in self.batches] or [np.zeros(0, COLUMN_DTYPES[name])])
        self.batches = []
        m = {"gpudash_version": __version__, "source": "gpudash",
             "devices": [device_meta(alloc)], "dropped": 0, **meta}
        return Trace(columns=columns, meta=m)


def _settings_for_meta(settings: Any) -> dict:
    """The replay settings as a JSON-friendly dict (what :attr:`ReplayResult.options` holds):
    :meth:`~gpudash.models.ReplaySettings.for_meta`, in the model's own terms."""
    return ReplaySettings.of(settings).for_meta()
