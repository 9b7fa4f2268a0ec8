"""A stand-in for ``torch`` with the API shape gpudash's PyTorch monitor uses, for machines
without a CUDA build of PyTorch: the monitor's thread, feeds and stop run for real against it.

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
    (:class:`gpudash.CachingAllocator` on a simulated device): ``memory_stats``,
    ``memory_snapshot`` and ``memory._snapshot()`` (segments, ``device_traces`` while the
    history is on, ``allocator_settings``) come in PyTorch's exact layout, so a watched run
    can be replayed and its fidelity checked where no GPU is. ``allocate`` raises what the
    model raises (gpudash's ``OutOfMemoryError``, PyTorch's message) after the
    out-of-memory observers ran, as PyTorch calls them."""

    __version__ = "2.11.0+model"

    def __init__(self, devices: int = 1, total: int = 16 * GiB, conf: str | None = None,
                 fraction: float | None = None) -> None:
        super().__init__(devices=devices, total=total)
        self.cuda = _ModelCuda(self, devices, total, conf, fraction)

    def allocate(self, nbytes: int, device: int = 0) -> int:
        return self.cuda.allocate(nbytes, device)

    def free(self, handle: int, device: int = 0) -> None:
        self.cuda.allocators[device].deallocate(handle)


class _ModelCuda(_Cuda):
    def __init__(self, torch: ModelTorch, devices: int, total: int, conf: str | None,
                 fraction: float | None) -> None:
        from gpudash import CachingAllocator, SimulatedDevice

        super().__init__(torch, devices, total, True, True)
        self.allocators = [CachingAllocator(SimulatedDevice(total), conf, fraction=fraction,
                                            device=i) for i in range(devices)]
        self.memory._snapshot = self._full_snapshot
        self.memory_snapshot = lambda mempool_id=None, include_traces=True: self._snapshot()

    def allocate(self, nbytes: int, device: int = 0) -> int:
        from gpudash import OutOfMemoryError

        alloc = self.allocators[device]
        try:
            return alloc.allocate(nbytes)
        except OutOfMemoryError:
            for observer in list(self._torch.observers):
                observer(device, nbytes, alloc.bytes_in_use, alloc.device_total - alloc.pool_bytes)
            raise

    def memory_stats(self, device: int = 0) -> dict:
        self._torch._call("stats")
        return self.allocators[device].memory_stats()

    def _snapshot(self) -> list[dict]:
        self._torch._call("snapshot")
        return [seg for a in self.allocators for seg in a.segments()]

    def _full_snapshot(self) -> dict:
        self._torch._call("snapshot")
        snaps = [a.snapshot() for a in self.allocators]
        return {"segments": [seg for s in snaps for seg in s["segments"]],
                "device_traces": [s["device_traces"][i] for i, s in enumerate(snaps)],
                "allocator_settings": snaps[0]["allocator_settings"],
                "external_annotations": []}

    def get_per_process_memory_fraction(self, i: int) -> float:
        frac = self.allocators[i].fraction
        return 1.0 if frac is None else frac

    def set_per_process_memory_fraction(self, fraction: float, device: int = 0) -> None:
        self.allocators[device].set_memory_fraction(fraction)

    def empty_cache(self) -> None:
        for a in self.allocators:
            a.empty_cache()

    def _record_memory_history(self, enabled: Any = "all", max_entries: int = 0,
                               stacks: str = "all", **kwargs: Any) -> None:
        super()._record_memory_history(enabled, max_entries, stacks, **kwargs)
        for a in self.allocators:
            a.record_history(enabled is not None, max_entries or 1_000_000)
