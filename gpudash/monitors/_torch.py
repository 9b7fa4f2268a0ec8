"""PyTorch's monitor: ``torch.cuda.memory_stats`` per device, and the real layout from
``torch.cuda.memory_snapshot()`` at a lower rate."""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

from .._errors import ConfigError
from ..options import restart_lines
from ._base import FrameworkFeed, Monitor, Poll
from ._parse import stats_from_table, stats_from_torch_memory_stats, torch_chunk_table

__all__ = ["TorchMonitor"]


class TorchMonitor(Monitor):
    """Polls ``torch.cuda.memory_stats(device)`` every ``interval`` and reads the
    segment/block layout (``torch.cuda.memory_snapshot()``) every ``snapshot_interval``,
    so the chunk map, bins and heatmap show PyTorch's real blocks. Turns on the
    allocator's history (a ring of ``history`` entries) and records OOMs through PyTorch's
    out-of-memory observer.

    Raises
    ------
    ConfigError
        PyTorch not installed, or no CUDA device.
    """

    framework = "torch"
    controls_reason = ("gpudash only watches PyTorch's caching allocator: change it in your "
                       "code (torch.cuda.set_per_process_memory_fraction, "
                       "PYTORCH_CUDA_ALLOC_CONF before the first CUDA call)")

    def __init__(self, interval: float = 0.25, devices: Any = None,
                 snapshot_interval: float = 2.0, history: int = 100_000) -> None:
        if isinstance(snapshot_interval, bool) or not isinstance(
                snapshot_interval, (int, float)) or snapshot_interval < 0:
            raise ConfigError(f"snapshot_interval must be seconds >= 0 (0 = no layout); "
                              f"got {snapshot_interval!r}")
        self.snapshot_interval = float(snapshot_interval)
        self._history_entries = history
        super().__init__(interval=interval, devices=devices)

    def _open(self, devices: Any) -> None:
        from ..torch import _listen, _require_cuda, record_history

        torch = _require_cuda("watch torch")
        self._torch = torch
        count = torch.cuda.device_count()
        ids = list(range(count)) if devices is None else (
            [devices] if isinstance(devices, int) else list(devices))
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count:
                raise ConfigError(f"PyTorch has no CUDA device {i!r}; accepted: 0..{count - 1}")
        self._ids = ids
        self._history_on = False
        if self._history_entries:
            record_history(self._history_entries)
            self._history_on = True
        try:
            params = inspect.signature(torch.cuda.memory_snapshot).parameters
        except (TypeError, ValueError):
            params = {}
        self._snap_kwargs = {"include_traces": False} if "include_traces" in params else {}
        self._last_snapshot = 0.0
        self._tables: dict[int, dict] = {}
        self._last_counts: dict[int, tuple[int, int, int]] = {}
        self._ooms: dict[int, list] = {i: [] for i in ids}
        self._oom_lock = threading.Lock()
        has_layout = self.snapshot_interval > 0
        for k, i in enumerate(ids):
            props = torch.cuda.get_device_properties(i)
            self.feeds.append(FrameworkFeed(self, k, f"torch cuda:{i}", int(props.total_memory),
                                            self.controls_reason, has_layout=has_layout))
        _listen(self, "watch torch")

    def _on_oom(self, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        if not self._closed and device in self._ooms:
            with self._oom_lock:
                self._ooms[device].append((time.time_ns(), int(alloc), int(alloc)))

    def _nvml_index(self, k: int) -> int:
        from ..nvml import nvml_index_of_uuid

        uuid = getattr(self._torch.cuda.get_device_properties(self._ids[k]), "uuid", None)
        found = nvml_index_of_uuid(str(uuid)) if uuid is not None else None
        return found if found is not None else self._ids[k]

    def _limit(self, i: int, total: int) -> int:
        get = getattr(self._torch.cuda, "get_per_process_memory_fraction", None)
        fraction = get(i) if get is not None else 1.0
        return int(fraction * total)

    def poll(self) -> None:
        with self._poll_lock:
            now = time.monotonic()
            if self.snapshot_interval and now - self._last_snapshot >= self.snapshot_interval:
                self._last_snapshot = now
                segments = self._torch.cuda.memory_snapshot(**self._snap_kwargs)
                self._tables = {i: torch_chunk_table(segments, device=i) for i in self._ids}
            try:
                super().poll()
            finally:
                self._tables = {}

    def _poll_device(self, k: int) -> Poll:
        i = self._ids[k]
        raw = self._torch.cuda.memory_stats(i)
        stats, missing = stats_from_torch_memory_stats(
            raw, self._limit(i, self.feeds[k].capacity))
        allocated = int(raw.get("allocation.all.allocated", 0))
        freed = int(raw.get("allocation.all.freed", 0))
        n_ooms = int(raw.get("num_ooms", 0))
        last = self._last_counts.get(i)
        self._last_counts[i] = (allocated, freed, n_ooms)
        allocs = frees = 0
        ooms: list = []
        if last is not None:
            allocs, frees = max(0, allocated - last[0]), max(0, freed - last[1])
        with self._oom_lock:
            seen, self._ooms[i] = self._ooms[i], []
        ooms.extend(seen)
        if last is not None and n_ooms - last[2] > len(seen):  # counted but not observed
            ooms.extend([(time.time_ns(), 0, 0)] * (n_ooms - last[2] - len(seen)))
        table = self._tables.get(i)
        if table is not None:
            stats = stats_from_table(table, stats)
            missing = tuple(m for m in missing if m not in (
                "largest_free_block_bytes", "largest_alloc_size"))
        extra = {"retries": int(raw.get("num_alloc_retries", 0)),
                 "inactive split": int(raw.get("inactive_split_bytes.all.current", 0))}
        return Poll(stats, missing, table=table, allocs=allocs, frees=frees, ooms=tuple(ooms),
                    extra=extra)

    def device_settings(self, k: int) -> dict:
        out = super().device_settings(k)
        get = getattr(self._torch.cuda, "get_per_process_memory_fraction", None)
        fraction = get(self._ids[k]) if get is not None else None
        total = self.feeds[k].capacity
        out.update(fraction=fraction, allow_growth=True,
                   limit=int(fraction * total) if fraction is not None else None,
                   names={"fraction": "set_per_process_memory_fraction"})
        return out

    def restart_lines(self, fraction: float | None = None, allow_growth: bool | None = None,
                      form: str = "env", device: int = 0) -> list[str]:
        if fraction is None and allow_growth is None:
            fraction = self.device_settings(device)["fraction"]
        return restart_lines("torch", fraction=fraction, allow_growth=allow_growth, form=form)

    def _closing(self) -> None:
        if self._history_on:
            try:
                self._torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:  # noqa: BLE001
                pass
            self._history_on = False
