"""Stand-ins for ``torch`` where no GPU is: shadow mode (:func:`gpudash.torch.attach`), the
PyTorch monitor and their notebook run against them as against a CUDA build of PyTorch.

- :class:`ModelTorch`: PyTorch's CUDA caching allocator as gpudash's model of it, recording
  its history as PyTorch 2.11 does (a bounded ring that wraps, Python stacks, the settings
  calls, the out-of-memory observer): what shadow mode follows, without a GPU.
- :class:`StandInTorch`: the API shape gpudash's PyTorch monitor uses (see below).
- :class:`InstalledSegments`: for install mode over host memory, the device of a Python
  model run beside the C core's hooks, handing it the segments the core got (what the tests
  and ``benchmarks/fuzz_install.py`` hold the two to each other with).

>>> from gpudash.testing import ModelTorch, MiB
>>> torch = ModelTorch()
>>> torch.cuda.device_count(), torch.cuda.get_device_properties(0).name
(1, 'Stand-in GPU')
>>> p = torch.allocate(3 * MiB)
>>> torch.cuda.memory_stats(0)["allocated_bytes.all.current"] == 3 * MiB
True

:class:`StandInTorch` is a stand-in with the API shape gpudash's PyTorch monitor uses, for
machines without a CUDA build of PyTorch: the monitor's thread, feeds and stop run for real
against it.

It keeps a small caching-allocator state per device (segments of whole 2 MiB granules, each
holding one block, then free space), answers ``torch.cuda.memory_stats`` with the flat keys
PyTorch uses and ``torch.cuda.memory_snapshot`` with its documented segment/block dicts, turns
the allocator history on and off (``torch.cuda.memory._record_memory_history``), and calls the
out-of-memory observer attached through ``torch._C`` when an allocation does not fit.

Either call can be held: ``hold("snapshot")`` / ``hold("stats")`` makes the calls that start
afterwards wait (their thread blocked inside the call, as a stuck framework call is) until
``release(...)``; ``waiting[name]`` is set while one waits. Every call is logged in
``calls`` as ``(time.monotonic(), thread name, what)``.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any
from ._accel import extension
from ._errors import ConfigError, OutOfMemoryError
from .caching import CachingAllocator
from .torch_install import segments_of
from .devices import SimulatedDevice

__all__ = ["ModelTorch", "StandInTorch", "InstalledSegments", "installed_segments", "MiB",
           "GiB"]

MiB = 1 << 20
GiB = 1 << 30


class StandInTorch:
    __version__ = "2.9.0+standin"

    def __init__(self, devices: int = 1, total: int = 16 * GiB, available: bool = True,
                 include_traces: bool = True) -> None:
        self.version = SimpleNamespace(cuda="12.8" if available else None)
        self.cuda = _Cuda(self, devices, total, available, include_traces)
        self._C = SimpleNamespace(_cuda_attach_out_of_memory_observer=self._attach)
        self.observers: list = []
        self.calls: list[tuple[float, str, str]] = []
        self.history: list[dict] = []  # each _record_memory_history call's arguments
        self._lock = threading.Lock()
        self._gates = {"snapshot": threading.Event(), "stats": threading.Event()}
        for gate in self._gates.values():
            gate.set()
        self.waiting = {"snapshot": threading.Event(), "stats": threading.Event()}

    # ------------------------------------------------------------------ test controls
    def hold(self, what: str) -> None:
        """Make the calls of ``what`` ("snapshot" or "stats") that start from now wait."""
        self._gates[what].clear()

    def release(self, what: str) -> None:
        self._gates[what].set()

    def allocate(self, nbytes: int, device: int = 0) -> int:
        return self.cuda._devices[device].allocate(nbytes)

    def free(self, handle: int, device: int = 0) -> None:
        self.cuda._devices[device].free(handle)

    def calls_of(self, what: str) -> list[tuple[float, str]]:
        return [(t, thread) for t, thread, w in self.calls if w == what]

    # ------------------------------------------------------------------ internals
    def _attach(self, observer: Any) -> None:
        self.observers.append(observer)

    def _call(self, what: str) -> None:
        with self._lock:
            self.calls.append((time.monotonic(), threading.current_thread().name, what))
        gate = self._gates.get(what)
        if gate is not None and not gate.is_set():
            self.waiting[what].set()
            gate.wait()
            self.waiting[what].clear()


class _Device:
    def __init__(self, torch: StandInTorch, index: int, total: int) -> None:
        self.torch = torch
        self.index = index
        self.total = total
        self.lock = threading.Lock()
        self.segments: dict[int, dict] = {}  # address -> segment
        self.next_address = 0x7F0000000000 + index * (1 << 40)
        self.allocated = self.freed = self.ooms = 0
        self.in_use = self.peak_in_use = self.reserved = self.peak_reserved = 0

    def allocate(self, nbytes: int) -> int:
        size = max(512, -(-nbytes // 512) * 512)
        seg_size = -(-size // (2 * MiB)) * (2 * MiB)
        with self.lock:
            fits = self.reserved + seg_size <= self.total
            if fits:
                address = self.next_address
                self.next_address += seg_size
                blocks = [{"address": address, "size": size, "requested_size": nbytes,
                           "state": "active_allocated"}]
                if seg_size > size:
                    blocks.append({"address": address + size, "size": seg_size - size,
                                   "requested_size": 0, "state": "inactive"})
                self.segments[address] = {"device": self.index, "address": address,
                                          "total_size": seg_size, "stream": 0,
                                          "segment_type": "large", "blocks": blocks}
                self.allocated += 1
                self.in_use += size
                self.reserved += seg_size
                self.peak_in_use = max(self.peak_in_use, self.in_use)
                self.peak_reserved = max(self.peak_reserved, self.reserved)
                return address
            self.ooms += 1
            args = (self.index, size, self.in_use, self.total - self.reserved)
        for observer in list(self.torch.observers):  # outside the lock, as PyTorch does
            observer(*args)
        raise MemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")

    def free(self, address: int) -> None:
        with self.lock:
            seg = self.segments.pop(address)
            self.freed += 1
            self.in_use -= seg["blocks"][0]["size"]
            self.reserved -= seg["total_size"]

    def stats(self) -> dict:
        with self.lock:
            return {"allocation.all.allocated": self.allocated,
                    "allocation.all.freed": self.freed,
                    "allocated_bytes.all.current": self.in_use,
                    "allocated_bytes.all.peak": self.peak_in_use,
                    "reserved_bytes.all.current": self.reserved,
                    "reserved_bytes.all.peak": self.peak_reserved,
                    "num_ooms": self.ooms, "num_alloc_retries": 0,
                    "inactive_split_bytes.all.current": 0}

    def snapshot(self) -> list[dict]:
        with self.lock:
            return [dict(seg, blocks=[dict(b) for b in seg["blocks"]])
                    for seg in self.segments.values()]


class _Cuda:
    def __init__(self, torch: StandInTorch, devices: int, total: int, available: bool,
                 include_traces: bool) -> None:
        self._torch = torch
        self._available = available
        self._devices = [_Device(torch, i, total) for i in range(devices)]
        self.memory = SimpleNamespace(_record_memory_history=self._record_memory_history,
                                      _dump_snapshot=lambda path: None)
        if include_traces:
            def memory_snapshot(mempool_id=None, include_traces=True):
                return self._snapshot()
        else:  # PyTorch before include_traces
            def memory_snapshot(mempool_id=None):
                return self._snapshot()
        self.memory_snapshot = memory_snapshot

    def is_available(self) -> bool:
        return self._available

    def device_count(self) -> int:
        return len(self._devices) if self._available else 0

    def get_device_properties(self, i: int) -> Any:
        return SimpleNamespace(name="Stand-in GPU", total_memory=self._devices[i].total,
                               uuid=None)

    def get_per_process_memory_fraction(self, i: int) -> float:
        return 1.0

    def memory_stats(self, device: int = 0) -> dict:
        self._torch._call("stats")
        return self._devices[device].stats()

    def _snapshot(self) -> list[dict]:
        self._torch._call("snapshot")
        return [seg for dev in self._devices for seg in dev.snapshot()]

    def _record_memory_history(self, enabled: Any = "all", max_entries: int = 0,
                               stacks: str = "all", **kwargs: Any) -> None:
        self._torch._call("history")
        self._torch.history.append({"enabled": enabled, "max_entries": max_entries,
                                    "stacks": stacks, "time": time.monotonic(),
                                    "thread": threading.current_thread().name})


class ModelTorch(StandInTorch):
    """A stand-in whose CUDA allocator is gpudash's model of PyTorch's caching allocator
    (:class:`gpudash.CachingAllocator` on a simulated device), made to record history as
    PyTorch 2.11 does, where no GPU is:

    - ``torch.cuda.memory._record_memory_history(enabled="all", context="all",
      stacks="python", max_entries=N)``: one bounded ring of trace entries per device that
      wraps (the oldest entries overwritten); ``enabled=None`` turns it off and clears it;
      ``clear_history=True`` clears it. Each entry is PyTorch's dict (``action``, ``addr``
      or ``device_free`` for ``oom``, ``size``, ``stream``, ``time_us``, ``frames``: the
      calling Python stack, innermost first, while stacks are recorded).
    - ``torch.cuda.memory._snapshot()``: ``segments`` (with blocks), ``device_traces`` (a
      ``snapshot`` entry is added first, as PyTorch records one per snapshot while
      recording), ``allocator_settings``, ``external_annotations``.
    - ``torch._C._accelerator_setAllocatorSettings(s)`` (2.9 on) and
      ``torch.cuda.memory._set_allocator_settings(s)``: the whole settings string; what it
      leaves out of ``max_split_size_mb``, ``roundup_power2_divisions`` and
      ``garbage_collection_threshold`` goes back to its default, ``expandable_segments``
      keeps its value (PyTorch's ``AcceleratorAllocatorConfig::parseArgs``). A ``backend``
      other than the one loaded raises PyTorch's ``RuntimeError``; so does a bad value.
    - ``torch.cuda.set_per_process_memory_fraction`` (``ValueError`` outside [0, 1]),
      ``torch.cuda.empty_cache()``, the OOM observers (called after the ``oom`` entry is
      recorded, outside the allocator's lock, before the error is raised).

    ``allocate``/``free`` are the job's tensors; ``step_annotation`` records a
    ``record_function``-like ``ProfilerStep#N`` annotation."""

    __version__ = "2.11.0+model"

    def __init__(self, devices: int = 1, total: int = 16 * GiB, conf: str | None = None,
                 fraction: float | None = None, version: str = "2.11.0") -> None:
        super().__init__(devices=devices, total=total)
        self.__version__ = version + "+model"
        self.cuda = _ModelCuda(self, devices, total, conf, fraction)
        self._C = SimpleNamespace(_cuda_attach_out_of_memory_observer=self._attach)
        if tuple(int(x) for x in version.split(".")[:2]) >= (2, 9):
            self._C._accelerator_setAllocatorSettings = self.cuda._set_allocator_settings
        self.settings_calls: list[tuple[str, str]] = []  # (which call, string)

    def allocate(self, nbytes: int, device: int = 0, stream: int = 0) -> int:
        return self.cuda.allocate(nbytes, device, stream)

    def free(self, handle: int, device: int = 0) -> None:
        self.cuda.free(handle, device)

    def step_annotation(self, step: int, stage: str = "START") -> None:
        """A ``ProfilerStep#<step>`` range boundary, as ``record_function`` annotates the
        allocator's history (``external_annotations``)."""
        self.cuda.annotations.append({"device": 0, "stage": stage,
                                      "name": f"ProfilerStep#{step}",
                                      "time_us": time.time_ns() // 1000})


def _python_frames(skip: int) -> list[dict]:
    """The calling Python stack as PyTorch records it (``stacks="python"``), innermost
    first, without the stand-in's own frames."""
    import sys

    f = sys._getframe(skip)
    out = []
    while f is not None and len(out) < 64:
        if f.f_code.co_filename != __file__:
            out.append({"filename": f.f_code.co_filename, "line": f.f_lineno,
                        "name": f.f_code.co_name})
        f = f.f_back
    return out


class _ModelCuda(_Cuda):
    def __init__(self, torch: ModelTorch, devices: int, total: int, conf: str | None,
                 fraction: float | None) -> None:
        from collections import deque

        super().__init__(torch, devices, total, True, True)
        self.allocators = [CachingAllocator(SimulatedDevice(total), conf, fraction=fraction,
                                            device=i) for i in range(devices)]
        for a in self.allocators:   # the model's entries, moved into the rings after each call
            a.record_history(True, 1 << 40)
        self.rings: list[deque] = [deque(maxlen=1) for _ in range(devices)]
        self.recording = False
        self.stacks = True
        self.annotations: list[dict] = []
        self.backend = "native"
        self.memory._snapshot = self._full_snapshot
        self.memory._set_allocator_settings = self._set_allocator_settings
        self.memory_snapshot = lambda mempool_id=None, include_traces=True: self._snapshot()
        self._op = threading.RLock()   # one call at a time, its entries moved in order

    def _drain(self, frames: list[dict] | None) -> None:
        for d, a in enumerate(self.allocators):
            h = a._history
            ring = self.rings[d]
            for _ in range(len(h)):
                action, addr, size, stream, t_us = h.popleft()
                if not self.recording:
                    continue
                entry = {"action": action, "size": size, "stream": stream, "time_us": t_us,
                         "frames": list(frames) if (frames and self.stacks) else [],
                         "compile_context": "N/A", "user_metadata": ""}
                entry["device_free" if action == "oom" else "addr"] = addr
                ring.append(entry)

    def allocate(self, nbytes: int, device: int = 0, stream: int = 0) -> int:
        alloc = self.allocators[device]
        frames = _python_frames(2)
        with self._op:
            try:
                p = alloc.allocate(nbytes, stream)
                failed = None
            except OutOfMemoryError as exc:
                failed = exc
            self._drain(frames)
        if failed is None:
            return p
        limit = alloc.memory_limit if alloc.fraction is not None else alloc.device_total
        for observer in list(self._torch.observers):   # outside the lock, as PyTorch does
            observer(device, nbytes, alloc.bytes_in_use, limit - alloc.pool_bytes)
        raise failed

    def free(self, handle: int, device: int = 0) -> None:
        frames = _python_frames(2)
        with self._op:
            self.allocators[device].deallocate(handle)
            self._drain(frames)

    def memory_stats(self, device: int = 0) -> dict:
        self._torch._call("stats")
        return self.allocators[device].memory_stats()

    def _snapshot(self) -> list[dict]:
        self._torch._call("snapshot")
        with self._op:
            return [seg for a in self.allocators for seg in a.segments()]

    def _full_snapshot(self) -> dict:
        self._torch._call("snapshot")
        with self._op:
            segs = [a.segments() for a in self.allocators]
            traces = []
            for d, ring in enumerate(self.rings):
                if self.recording:
                    active = sum(s["active_size"] for s in segs[d])
                    ring.append({"action": "snapshot", "addr": 0, "size": active, "stream": 0,
                                 "time_us": time.time_ns() // 1000, "frames": [],
                                 "compile_context": "N/A", "user_metadata": ""})
                traces.append([dict(e) for e in ring])
            return {"segments": [seg for s in segs for seg in s], "device_traces": traces,
                    "allocator_settings": self.allocators[0].config.snapshot_settings(),
                    "external_annotations": [dict(a) for a in self.annotations]}

    def get_per_process_memory_fraction(self, i: int = 0) -> float:
        frac = self.allocators[i].fraction
        return 1.0 if frac is None else frac

    def set_per_process_memory_fraction(self, fraction: float, device: int = 0) -> None:
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        with self._op:
            self.allocators[device].set_memory_fraction(fraction)
            self._drain(None)

    def empty_cache(self) -> None:
        with self._op:
            for a in self.allocators:
                a.empty_cache()
            self._drain(_python_frames(2))

    def _set_allocator_settings(self, env: str) -> None:
        """PyTorch's parse of a settings string on the live allocator (all or nothing)."""
        self._torch.settings_calls.append(("set", env))
        parts = [p.strip() for p in env.split(",") if p.strip()]
        rest = []
        for part in parts:
            key, _, value = part.partition(":")
            if key.strip() == "backend":
                if value.strip() != self.backend:
                    raise RuntimeError(
                        "Allocator async backend parsed at runtime != allocator async backend "
                        f"parsed at load time, {int(value.strip() != 'native')} != "
                        f"{int(self.backend != 'native')}")
                continue
            rest.append(part)
        try:
            for a in self.allocators:   # checked on a copy first: nothing changes on error
                a.config.copy().apply(",".join(rest))
        except ConfigError as exc:
            raise RuntimeError(str(exc)) from None
        with self._op:
            for a in self.allocators:
                a.set_allocator_settings(",".join(rest))
            self._drain(None)

    def _record_memory_history(self, enabled: Any = "all", context: Any = "all",
                               stacks: str = "all", max_entries: int = 1 << 62,
                               device: Any = None, clear_history: bool = False,
                               **kwargs: Any) -> None:
        from collections import deque

        _Cuda._record_memory_history(self, enabled, max_entries, stacks, context=context)
        with self._op:
            self._drain(None)
            if enabled is None:
                self.recording = False
                self.rings = [deque(maxlen=1) for _ in self.rings]
                return
            if enabled not in ("all", "state"):
                raise ValueError(f"enabled must be None, 'state' or 'all'; got {enabled!r}")
            keep = max(1, int(max_entries)) if enabled == "all" else 1
            self.recording = True
            self.stacks = context is not None and stacks in ("python", "all")
            self.rings = [deque([] if clear_history else list(r)[-keep:], maxlen=keep)
                          for r in self.rings]


# ------------------------------------------------------------------------------ install mode
def installed_segments(device: int = 0) -> dict[int, int]:
    """The segments install mode's C core holds on a device: ``{address: size}``."""
    _seg, starts, sizes = segments_of(
        extension("install mode").pluggable_state(device, "columns")["blocks"])
    return dict(zip(starts.tolist(), sizes.tolist()))


class InstalledSegments:
    """The device of a Python model (``gpudash.caching.CachingAllocator``,
    ``gpudash.bfc.BFCAllocator``) run beside install mode's C hooks over host memory: it
    hands out the segment the C core got for the same call (the one of the asked size the
    core holds and the model does not yet), so both place blocks at the same addresses,
    and refuses as the core's host backend does, past ``total`` bytes held.

    Raises ``AssertionError`` where the core holds more than one such segment (the two have
    parted: nothing tells which is meant)."""

    def __init__(self, total: int, device: int = 0) -> None:
        self.total = total
        self.device = device
        self.live: dict[int, int] = {}

    def alloc(self, n: int) -> int:
        if sum(self.live.values()) + n > self.total:
            raise MemoryError(n)
        fresh = [p for p, size in installed_segments(self.device).items()
                 if size == n and p not in self.live]
        if not fresh:
            raise MemoryError(n)
        assert len(fresh) == 1, f"the core holds {len(fresh)} new segments of {n} bytes"
        self.live[fresh[0]] = n
        return fresh[0]

    def free(self, ptr: int, n: int) -> None:
        assert self.live.pop(ptr) == n, f"free of {ptr:#x}: not {n} bytes"
