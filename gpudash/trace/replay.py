"""Replay a trace's allocations through gpudash's BFC allocator on a simulated device.

:func:`replay` answers "would this run fit, and how would the pool look, with these
settings?": it takes the trace's calls (:meth:`~gpudash.trace.Trace.calls`, every alloc,
free and refused allocation in order), builds a fresh :class:`~gpudash.SimulatedDevice` and
:class:`~gpudash.BFCAllocator` with the settings asked for, and makes the same calls.

Replaying a trace that gpudash recorded, with the settings it was recorded with, reproduces
it exactly (same addresses, same regions, same statistics): the allocator and the simulated
device are both deterministic.

The loop is written for speed (bound methods and plain lists, the allocator's private
counters read directly); ``benchmarks/bench_replay.py`` measures it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import ConfigError
from .._units import format_bytes, parse_bytes
from ..bfc import BFCAllocator, MemoryDump
from ..devices import SimulatedDevice
from ..events import COLUMN_DTYPES, COLUMNS
from ..options import GPUOptions, memory_limit as _tf_memory_limit
from .format import Trace, _byte_count, _device_entries, _flag

__all__ = ["replay", "replay_devices", "ReplayResult", "resolve_settings", "trace_settings",
           "source_limit", "device_label", "DeviceIndex", "DEFAULT_DEVICE_BYTES"]

#: Device size replay assumes when none is given: 16 GiB.
DEFAULT_DEVICE_BYTES = 16 << 30

_CHUNK = 1 << 16  # calls per inner loop: progress is reported between chunks

# Settings replay understands, with their defaults.
_DEFAULTS: dict[str, Any] = {
    "device_bytes": DEFAULT_DEVICE_BYTES,
    "fraction": None,
    "memory_limit": None,
    "allow_growth": True,
    "garbage_collection": False,
    "fragmentation_fraction": 0.0,
    "deferred_deletion_bytes": 0,
    "device": None,
    "cc_major": 8,
}
# GPUOptions fields that map onto replay settings; the others do not affect a replay.
_FROM_GPU_OPTIONS = {
    "per_process_gpu_memory_fraction": "fraction",
    "allow_growth": "allow_growth",
    "deferred_deletion_bytes": "deferred_deletion_bytes",
}


# ---------------------------------------------------------------------------------- settings
def _meta_devices(trace: Trace) -> dict[int, dict]:
    """``meta["devices"]`` by index; odd entries left out (see ``_device_entries``)."""
    return _device_entries(trace.meta)


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
            out["device_bytes"] = _byte_count(entry["capacity"])
        field = "memory_limit"
        if entry.get("memory_limit"):
            out["memory_limit"] = _byte_count(entry["memory_limit"])
        elif opts.get("memory_limit"):
            field = "options.memory_limit"
            out["memory_limit"] = _byte_count(opts["memory_limit"])
        for key in ("allow_growth", "garbage_collection"):
            field = f"options.{key}"
            flag = _flag(opts.get(key))
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
                import warnings

                from .._errors import GpudashWarning

                others = ", ".join(self.label(d) for d in devs[1:])
                warnings.warn(f"the trace has {len(devs)} devices; using "
                              f"{self.label(devs[0])}, not {others}: pass device= "
                              "to choose (or replay_devices() for all)", GpudashWarning,
                              stacklevel=5)
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

    def source_limit(self, device: int) -> int | None:
        """:func:`source_limit` of ``device``."""
        if self.trace.meta.get("source") != "tensorflow-log":
            return None
        return self.settings(device).get("memory_limit")

    def calls(self, device: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The calls of ``device`` (op, key, nbytes as numpy columns) and its event count."""
        if self._calls is None:
            calls = self.trace.calls()
            order = np.argsort(calls.device, kind="stable")
            sorted_dev = calls.device[order]
            self._calls = (calls, order, sorted_dev)
        calls, order, sorted_dev = self._calls
        lo = np.searchsorted(sorted_dev, device, side="left")
        hi = np.searchsorted(sorted_dev, device, side="right")
        rows = order[lo:hi]
        return calls.op[rows], calls.key[rows], calls.nbytes[rows], self._events.get(device, 0)

    def replay(self, device: int, **kwargs: Any) -> ReplayResult:
        """:func:`replay` of ``device`` (``kwargs``: replay's other arguments)."""
        _check_replay_args(kwargs)
        return _replay(self.trace, self, device=device, **kwargs)


def resolve_settings(trace: Trace | None = None, options: Any = None,
                     **explicit: Any) -> dict[str, Any]:
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
    dict
        Every setting of :func:`replay`, plus ``memory_limit`` resolved to bytes.

    Raises
    ------
    ConfigError
        An unknown setting (the message lists the known ones) or an invalid value.
    """
    index = DeviceIndex(trace) if trace is not None else None
    return _resolve(trace, index, options, explicit)


def _resolve(trace: Trace | None, index: DeviceIndex | None, options: Any,
             explicit: dict[str, Any]) -> dict[str, Any]:
    """:func:`resolve_settings` with the trace's devices already looked up."""
    s = dict(_DEFAULTS)
    if isinstance(options, str):
        if options != "trace":
            raise ConfigError(f"options must be a GPUOptions, a dict or 'trace'; got {options!r}")
        if trace is None:
            raise ConfigError("options='trace' needs a trace")
        dev = explicit.get("device", _UNSET)
        s.update(index.settings(None if dev is _UNSET else dev))
    elif isinstance(options, GPUOptions):
        for f, key in _FROM_GPU_OPTIONS.items():
            s[key] = getattr(options, f)
    elif isinstance(options, Mapping):
        for k, v in options.items():
            if k in _FROM_GPU_OPTIONS:
                s[_FROM_GPU_OPTIONS[k]] = v
            elif k in _DEFAULTS or k == "name":
                s[k] = v
            elif k in GPUOptions.FIELDS:
                continue  # a GPUOptions field that does not change a replay
            else:
                raise ConfigError(
                    f"unknown replay setting {k!r}; known: {sorted(_DEFAULTS)} and the "
                    f"GPUOptions fields {list(GPUOptions.FIELDS)}")
    elif options is not None:
        raise ConfigError(f"options must be a GPUOptions, a dict or 'trace'; got {options!r}")
    for k, v in explicit.items():
        if k not in _DEFAULTS and k != "name":
            raise ConfigError(f"unknown replay setting {k!r}; known: {sorted(_DEFAULTS)}")
        if v is not _UNSET:
            s[k] = v
    if explicit.get("fraction", _UNSET) is not _UNSET \
            and explicit.get("memory_limit", _UNSET) is _UNSET:
        s["memory_limit"] = None  # the fraction asked for decides the limit
    elif (trace is not None and options is None and s["memory_limit"] is None
          and explicit.get("fraction", _UNSET) is _UNSET
          and explicit.get("memory_limit", _UNSET) is _UNSET):
        # a TensorFlow log says what limit its allocator had: replay with it
        dev = explicit.get("device", _UNSET)
        picked = index.pick(None if dev is _UNSET else dev)
        limit = index.source_limit(picked)
        if limit is not None:
            s["memory_limit"] = limit
            s["device"] = picked
            s["device_bytes"] = max(parse_bytes(s["device_bytes"], name="device_bytes"),
                                    limit)

    s["device_bytes"] = parse_bytes(s["device_bytes"], name="device_bytes")
    if s["device_bytes"] <= 0:
        raise ConfigError(f"device_bytes must be > 0; got {s['device_bytes']}")
    frac = s["fraction"]
    if frac is not None:
        frac = float(frac)
        if not frac >= 0.0:
            raise ConfigError(f"fraction must be >= 0 (0 or None: TensorFlow's default); "
                              f"got {frac}")
        s["fraction"] = frac
    if s["memory_limit"] is not None:
        s["memory_limit"] = parse_bytes(s["memory_limit"], name="memory_limit")
    else:
        s["memory_limit"] = _tf_memory_limit(s["device_bytes"], s["device_bytes"], frac or 0.0,
                                             int(s["cc_major"]), environ={})
    for key in ("allow_growth", "garbage_collection"):
        try:
            s[key] = bool(_flag(s[key]))
        except ValueError as exc:
            raise ConfigError(f"{key} is {exc}") from None
    s["fragmentation_fraction"] = float(s["fragmentation_fraction"])
    ddb = s["deferred_deletion_bytes"]
    s["deferred_deletion_bytes"] = parse_bytes(ddb or 0, name="deferred_deletion_bytes")
    if trace is not None:
        s["device"] = index.pick(s["device"])
    elif s["device"] is None:
        s["device"] = 0
    return s


class _Unset:
    def __repr__(self) -> str:
        return "<default>"


_UNSET: Any = _Unset()


# ---------------------------------------------------------------------------------- engine
class _CountingSub:
    """A sub-allocator that counts the regions it hands out and takes back."""

    __slots__ = ("dev", "extensions", "releases")

    def __init__(self, dev: SimulatedDevice) -> None:
        self.dev = dev
        self.extensions = 0
        self.releases = 0

    def alloc(self, nbytes: int) -> int:
        ptr = self.dev.alloc(nbytes)  # raises MemoryError when it cannot
        self.extensions += 1
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        self.dev.free(ptr, nbytes)
        self.releases += 1

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
        out = _CountingSub(new_dev)
        out.extensions = self.extensions
        out.releases = self.releases
        return out


class _QuietGC(logging.Filter):
    """Drops the allocator's garbage-collection warning during a replay."""

    def filter(self, record: logging.LogRecord) -> bool:
        from ..bfc import _GC_MESSAGE

        return record.msg != _GC_MESSAGE


def _sample_now(alloc: BFCAllocator, sample: list) -> None:
    """Append in use, pool and largest free block now to the three sample lists."""
    sample[0].append(alloc._in_use)
    sample[1].append(alloc._pool)
    sample[2].append(alloc._largest_free_chunk())


class _Engine:
    """A BFC allocator on a simulated device, the key -> pointer map of a replay, and the
    frees held back by deferred deletion. ``pos`` is the number of calls made so far.

    The loops bind everything they touch to locals and read the allocator's private
    counters (``_in_use``, ``_pool``, ``_mask``/``_bins`` for the largest free chunk, as
    ``BFCAllocator._largest_free_chunk`` does) instead of calling ``stats()``, which would
    take the lock and build a dataclass per call.
    """

    # Allocator fields that _clone_allocator knows how to copy.
    _KNOWN = frozenset({
        "_sub", "_name", "_allow_growth", "_gc", "_frag_fraction", "_retry_timeout", "_limit",
        "_max_frag", "_curr_region", "_started_backpedal", "_capped", "_lock", "_cond", "_waiters",
        "_bins", "_mask", "_by_ptr", "_spare", "_n_handles", "_regions", "_region_ptrs",
        "_pool", "_next_aid", "_num_allocs", "_in_use", "_peak", "_largest", "_peak_pool",
        "_failure_logs", "_journal", "_journal_seq", "_journal_extra", "_counted", "_flush_at",
        "_callbacks", "_sinks", "_raw_sinks", "_dispatch_lock", "device_index",
    })

    def __init__(self, settings: dict[str, Any], ops: list[int], keys: list[int],
                 nbytes: list[int], name: str | None = None) -> None:
        self.settings = settings
        self.ops, self.keys, self.nbytes = ops, keys, nbytes
        dev_index = int(settings["device"])
        frac = settings["fraction"]
        device = SimulatedDevice(settings["device_bytes"], index=dev_index,
                                 unified=bool(frac is not None and frac > 1.0),
                                 compute_capability=(int(settings["cc_major"]), 0))
        self.sub = _CountingSub(device)
        self.alloc = BFCAllocator(
            self.sub, settings["memory_limit"], allow_growth=settings["allow_growth"],
            garbage_collection=settings["garbage_collection"],
            fragmentation_fraction=settings["fragmentation_fraction"],
            name=name or settings.get("name") or f"GPU_{dev_index}_bfc")
        self.alloc.device_index = dev_index
        self.ptrs: dict[int, int] = {}
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
        if self.settings["deferred_deletion_bytes"] > 0:
            self._run_deferred(self.pos, stop, None)
        else:
            self._run_plain(self.pos, stop, None)

    def _run_plain(self, start: int, stop: int, sample: list | None,
                   max_ooms: int = sys.maxsize) -> None:
        alloc = self.alloc
        allocate, deallocate = alloc.try_allocate, alloc.deallocate
        ptrs = self.ptrs
        pop = ptrs.pop
        oom_calls = self.oom_calls
        skipped = 0
        ops = _part(self.ops, start, stop)
        keys = _part(self.keys, start, stop)
        nbytes = _part(self.nbytes, start, stop)
        if sample is not None:
            s_in, s_pool, s_lf = (lst.append for lst in sample)
            bins = alloc._bins
        i = start
        for op, key, n in zip(ops, keys, nbytes):
            if op == 2:
                p = pop(key, None)
                if p is None:
                    skipped += 1
                else:
                    deallocate(p)
            else:
                p = allocate(n, True)  # 0 when refused: an oom event, no memory log
                if p or not n:
                    if op == 1:
                        ptrs[key] = p
                    else:  # an allocation the source refused, served now: give it back
                        deallocate(p)
                else:
                    oom_calls.append(i)
                    if len(oom_calls) >= max_ooms:
                        stop = i + 1
                        if sample is not None:
                            _sample_now(alloc, sample)
                        break
            i += 1
            if sample is not None:
                s_in(alloc._in_use)
                s_pool(alloc._pool)
                m = alloc._mask
                s_lf(bins[m.bit_length() - 1][-1] >> 64 if m else 0)
        self.skipped_frees += skipped
        self.pos = stop

    def _run_deferred(self, start: int, stop: int, sample: list | None,
                      max_ooms: int = sys.maxsize) -> None:
        alloc = self.alloc
        allocate, deallocate = alloc.try_allocate, alloc.deallocate
        ptrs = self.ptrs
        pop = ptrs.pop
        oom_calls = self.oom_calls
        held = self.held
        threshold = self.settings["deferred_deletion_bytes"]
        held_bytes = self.held_bytes
        if sample is not None:
            s_in, s_pool, s_lf = (lst.append for lst in sample)
            bins = alloc._bins
        ops = _part(self.ops, start, stop)
        keys = _part(self.keys, start, stop)
        nbytes = _part(self.nbytes, start, stop)
        for i in range(start, stop):
            op = ops[i - start]
            n = nbytes[i - start]
            if op == 2:
                p = pop(keys[i - start], None)
                if p is None:
                    self.skipped_frees += 1
                else:
                    held.append(p)
                    held_bytes += n
                    if held_bytes >= threshold:
                        for q in held:
                            deallocate(q)
                        held.clear()
                        held_bytes = 0
            else:
                # With frees held, the first attempt is quiet: EventMgr flushes them and
                # the allocator retries, and only a refusal of the retry is an oom event.
                p = allocate(n, not held)
                if not p and n and held:
                    for q in held:
                        deallocate(q)
                    held.clear()
                    held_bytes = 0
                    p = allocate(n, True)
                    if p:
                        self.retried += 1
                if p or not n:
                    if op == 1:
                        ptrs[keys[i - start]] = p
                    else:
                        deallocate(p)
                else:
                    oom_calls.append(i)
                    if len(oom_calls) >= max_ooms:
                        if sample is not None:
                            _sample_now(alloc, sample)
                        stop = i + 1
                        break
            if sample is not None:
                s_in(alloc._in_use)
                s_pool(alloc._pool)
                m = alloc._mask
                s_lf(bins[m.bit_length() - 1][-1] >> 64 if m else 0)
        self.held_bytes = held_bytes
        self.pos = stop

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
            When the allocator has state this copy does not know (a newer BFCAllocator),
            or listeners; callers then fall back to replaying from the start.
        """
        new = object.__new__(_Engine)
        new.settings = self.settings
        new.ops, new.keys, new.nbytes = self.ops, self.keys, self.nbytes
        new.sub = self.sub.clone()
        new.alloc = _clone_allocator(self.alloc, new.sub)
        new.ptrs = dict(self.ptrs)
        new.held = list(self.held)
        new.held_bytes = self.held_bytes
        new.pos = self.pos
        new.oom_calls = list(self.oom_calls)
        new.skipped_frees = self.skipped_frees
        new.retried = self.retried
        return new


def _clone_allocator(a: BFCAllocator, sub: Any) -> BFCAllocator:
    """A deep copy of an idle, unobserved allocator (BFCAllocator has no clone of its own;
    ``copy.deepcopy`` would recurse along the chunk list and cannot copy locks)."""
    import threading

    from ..bfc import _Chunk, _Region

    unknown = set(a.__dict__) - _Engine._KNOWN
    if unknown:
        raise NotImplementedError(f"cannot clone a BFCAllocator with fields {sorted(unknown)}")
    if a._journal is not None or a._callbacks or a._sinks or a._raw_sinks:
        raise NotImplementedError("cannot clone an allocator that has listeners")
    new = object.__new__(BFCAllocator)
    d = new.__dict__
    d.update(a.__dict__)
    d["_sub"] = sub
    d["_lock"] = lock = threading.Lock()
    d["_cond"] = threading.Condition(lock)
    d["_dispatch_lock"] = threading.RLock()
    d["_callbacks"] = []
    d["_sinks"] = []
    d["_raw_sinks"] = []
    d["_journal_extra"] = {}
    d["_bins"] = [list(b) for b in a._bins]
    d["_region_ptrs"] = list(a._region_ptrs)

    def copy_chunk(c: _Chunk) -> _Chunk:
        n = _Chunk(c.handle)
        n.ptr, n.size, n.requested, n.aid, n.bin = c.ptr, c.size, c.requested, c.aid, c.bin
        return n

    by_ptr: dict[int, _Chunk] = {}
    regions = []
    for r in a._regions:
        nr = _Region(r.ptr, r.size)
        c = r.first
        prev = None
        while c is not None:
            n = copy_chunk(c)
            n.region = nr
            n.prev = prev
            if prev is None:
                nr.first = n
            else:
                prev.next = n
            by_ptr[n.ptr] = n
            prev = n
            c = c.next
        regions.append(nr)
    d["_regions"] = regions
    d["_by_ptr"] = by_ptr
    d["_spare"] = [copy_chunk(c) for c in a._spare]
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
        Every event of the replay (``record=True``).
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
        return (f"ReplayResult({verdict}, limit={format_bytes(self.memory_limit)}, "
                f"peak_pool={format_bytes(self.peak_pool_bytes)}, "
                f"peak_in_use={format_bytes(self.peak_bytes_in_use)}, "
                f"extensions={self.extensions}, calls={self.calls}, "
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
def _part(seq: Any, start: int, stop: int) -> list:
    """``seq[start:stop]`` as a list: calls are kept as numpy columns (17 bytes a call) and
    turned into Python ints one chunk at a time, not all at once (~90 bytes a call)."""
    part = seq[start:stop]
    return part.tolist() if isinstance(part, np.ndarray) else part


def _calls_lists(trace: Trace, device: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The calls of ``device`` as numpy columns (op, key, nbytes) and its event count."""
    calls = trace.calls(device)
    n_events = int(np.count_nonzero(trace.columns["device"] == device))
    return calls.op, calls.key, calls.nbytes, n_events


def replay(trace: Trace, *, device_bytes: int | str = _UNSET, fraction: float | None = _UNSET,
           memory_limit: int | str | None = _UNSET, allow_growth: bool = _UNSET,
           garbage_collection: bool = _UNSET, fragmentation_fraction: float = _UNSET,
           deferred_deletion_bytes: int = _UNSET, device: int | None = _UNSET,
           options: Any = None, record: bool = True, per_call: bool = True,
           max_ooms: int | None = None, progress: Any = None) -> ReplayResult:
    """Replay a trace's allocations through a fresh BFC allocator on a simulated device.

    Parameters
    ----------
    trace : Trace
        Any trace (recorded by gpudash, imported, synthetic).
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
    options : GPUOptions, dict or "trace", optional
        Settings in bulk (see :func:`resolve_settings`); ``"trace"`` takes them from the
        trace's metadata. Explicit keyword arguments win.
    record : bool, default True
        Record the replay's events (:attr:`ReplayResult.recording`).
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
    >>> from gpudash.trace.workloads import training_loop
    >>> r = replay(training_loop(steps=2, layers=2, hidden=512), device_bytes="1GiB",
    ...            fraction=0.5)
    >>> r.fits, r.memory_limit
    (True, 536870912)
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"replay needs a gpudash.trace.Trace; got {type(trace).__name__}")
    return _replay(trace, None, device_bytes=device_bytes, fraction=fraction,
                   memory_limit=memory_limit, allow_growth=allow_growth,
                   garbage_collection=garbage_collection,
                   fragmentation_fraction=fragmentation_fraction,
                   deferred_deletion_bytes=deferred_deletion_bytes, device=device,
                   options=options, record=record, per_call=per_call, max_ooms=max_ooms,
                   progress=progress)


#: The arguments of :func:`replay` but ``trace`` (and ``device``, which replay_devices and
#: DeviceIndex.replay choose).
_REPLAY_ARGS = frozenset({"device_bytes", "fraction", "memory_limit", "allow_growth",
                          "garbage_collection", "fragmentation_fraction",
                          "deferred_deletion_bytes", "options", "record", "per_call",
                          "max_ooms", "progress"})


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
    if index is None:
        ops, keys, nbytes, n_events = _calls_lists(trace, settings["device"])
    else:
        ops, keys, nbytes, n_events = index.calls(settings["device"])
    return _replay_lists(settings, ops, keys, nbytes, n_events, record=record,
                         per_call=per_call, max_ooms=max_ooms,
                         progress=_progress_fn(progress, "replay"))


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
                  progress: Callable[[int, int], None] | None) -> ReplayResult:
    eng = _Engine(settings, ops, keys, nbytes)
    alloc = eng.alloc
    total = len(ops)
    rec = _Collected(alloc) if record else None
    sample = [[], [], []] if per_call else None
    parts: list[list[np.ndarray]] = [[], [], []]  # the samples, as int64 arrays per chunk
    run = eng._run_deferred if settings["deferred_deletion_bytes"] > 0 else eng._run_plain
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
                    parts[k].append(np.array(sample[k], dtype=np.int64))
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
            parts[k].append(np.array(sample[k], dtype=np.int64))
        in_use, pool, lf = (np.concatenate(p) for p in parts)
        free = pool - in_use
        with np.errstate(divide="ignore", invalid="ignore"):
            frag = np.where(free > 0, 1.0 - lf / np.where(free > 0, free, 1), 0.0)
        pc = {"in_use": in_use, "pool": pool, "largest_free": lf, "fragmentation": frag}
    stats = alloc.stats()
    done = eng.pos
    events = n_events if done == total else int(round(n_events * done / max(total, 1)))
    return ReplayResult(
        oom_count=len(ooms), first_oom=first, ooms=ooms,
        peak_pool_bytes=stats.peak_pool_bytes, peak_bytes_in_use=stats.peak_bytes_in_use,
        extensions=eng.sub.extensions, releases=eng.sub.releases,
        memory_limit=alloc.memory_limit, options=_settings_for_meta(settings), per_call=pc,
        recording=recording, final_snapshot=alloc.snapshot(), calls=done, events=events,
        skipped_frees=eng.skipped_frees, retried=eng.retried, stopped_early=stopped,
        elapsed_s=elapsed, events_per_second=events / elapsed if elapsed > 0 else float("inf"))


class _Collected:
    """A replay's events: the allocator's event batches, kept as they come and joined once
    at the end, column by column. Memory is the events made (about 60 bytes each), not a
    ring buffer sized ahead for the most a replay could make."""

    def __init__(self, alloc: BFCAllocator) -> None:
        self.batches: list[dict[str, np.ndarray]] = []
        self._remove = alloc._add_sink(lambda columns, extra: self.batches.append(columns))

    def to_trace(self, alloc: BFCAllocator, meta: dict) -> Trace:
        from .._version import __version__
        from ..recorder import Recorder

        alloc.flush_events()
        self._remove()
        columns = {}
        for name in COLUMNS:  # each batch's column is dropped as soon as it is copied
            columns[name] = np.concatenate(
                [b.pop(name) for b in self.batches] or [np.zeros(0, COLUMN_DTYPES[name])])
        self.batches = []
        m = {"gpudash_version": __version__, "source": "gpudash",
             "devices": [Recorder._device_meta(alloc)], "dropped": 0, **meta}
        return Trace(columns=columns, meta=m)


def _settings_for_meta(settings: dict) -> dict:
    """The replay settings as a JSON-friendly dict (what :attr:`ReplayResult.options` holds)."""
    keys = ("device_bytes", "fraction", "memory_limit", "allow_growth", "garbage_collection",
            "fragmentation_fraction", "deferred_deletion_bytes", "device")
    return {k: settings[k] for k in keys}
