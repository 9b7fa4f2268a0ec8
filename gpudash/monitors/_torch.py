"""PyTorch's monitor: ``torch.cuda.memory_stats`` per device, and the real layout from
``torch.cuda.memory_snapshot()`` at a lower rate."""

from __future__ import annotations

import inspect
import math
import threading
import time
from typing import Any

from .._errors import ConfigError
from .._torch_hooks import listen, require_cuda, set_history
from ..options import restart_lines
from ._base import FrameworkFeed, Monitor, Poll, _clock
from ._parse import stats_from_table, stats_from_torch_memory_stats, torch_chunk_table
from ..formats.torch_snapshot import load_torch_snapshot
from ..nvml import nvml_index_of_uuid
from ..trace.replay import replay

__all__ = ["TorchMonitor"]


class TorchMonitor(Monitor):
    """Polls ``torch.cuda.memory_stats(device)`` every ``interval`` and reads the
    segment/block layout (``torch.cuda.memory_snapshot()``) every ``snapshot_interval``,
    so the chunk map, bins and heatmap show PyTorch's real blocks. Turns on the
    allocator's history (a ring of ``history`` entries) and records OOMs through PyTorch's
    out-of-memory observer.

    The layout is read in a thread of its own (``gpudash-torch-layout``): a snapshot is
    slow with a long history, and may block; the figures keep coming meanwhile, a layout
    is attached to the poll after it arrives, and a read that has not returned after
    ``poll_timeout`` is reported on the feeds (:attr:`FrameworkFeed.error`).

    Parameters
    ----------
    interval, devices, poll_timeout
        As for :class:`~gpudash.monitors.Monitor`.
    snapshot_interval : float
        Seconds between layouts (default 2; 0 = no layout).
    history : int
        Entries of the allocator-history ring turned on (default 100,000; 0 = leave it).
    module : optional
        The ``torch`` module to watch (default: ``import torch``); anything with its API
        (``cuda.memory_stats``, ``cuda.memory_snapshot``,
        ``cuda.memory._record_memory_history``, ``cuda.get_device_properties``,
        ``_C._cuda_attach_out_of_memory_observer``...) will do: the tests run the monitor
        against such a stand-in where PyTorch has no GPU.

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
                 snapshot_interval: float = 2.0, history: int = 100_000,
                 poll_timeout: float = 5.0, module: Any = None) -> None:
        if isinstance(snapshot_interval, bool) or not isinstance(
                snapshot_interval, (int, float)) or snapshot_interval < 0:
            raise ConfigError(f"snapshot_interval must be seconds >= 0 (0 = no layout); "
                              f"got {snapshot_interval!r}")
        self.snapshot_interval = float(snapshot_interval)
        self._history_entries = history
        self._module = module
        super().__init__(interval=interval, devices=devices, poll_timeout=poll_timeout)

    def _open(self, devices: Any) -> None:
        torch = require_cuda("watch torch", self._module)
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
            set_history(torch, self._history_entries)
            self._history_on = True
        try:
            params = inspect.signature(torch.cuda.memory_snapshot).parameters
        except (TypeError, ValueError):
            params = {}
        self._snap_kwargs = {"include_traces": False} if "include_traces" in params else {}
        self._last_snapshot = -math.inf  # time.monotonic() when the last read started
        self._tables: dict[int, dict] = {}
        # the layout thread: the read in progress (monotonic and wall start), the tables
        # read and not attached yet, when the newest layout was read, why the last failed
        self._layout_lock = threading.Lock()
        self._layout_reading: tuple[float, float] | None = None
        self._layout_done: dict[int, dict] | None = None
        self._layout_wall: float | None = None
        self._layout_failure: str | None = None
        self._history_left_to_layout = False
        self._last_counts: dict[int, tuple[int, int, int]] = {}
        self._ooms: dict[int, list] = {i: [] for i in ids}
        self._oom_lock = threading.Lock()
        has_layout = self.snapshot_interval > 0
        for k, i in enumerate(ids):
            props = torch.cuda.get_device_properties(i)
            self.feeds.append(FrameworkFeed(self, k, f"torch cuda:{i}", int(props.total_memory),
                                            self.controls_reason, has_layout=has_layout))
        listen(self, "watch torch", torch)

    def _on_oom(self, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        if not self._closed and device in self._ooms:
            with self._oom_lock:
                self._ooms[device].append((time.time_ns(), int(alloc), int(alloc)))

    def _nvml_index(self, k: int) -> int:
        uuid = getattr(self._torch.cuda.get_device_properties(self._ids[k]), "uuid", None)
        found = nvml_index_of_uuid(str(uuid)) if uuid is not None else None
        return found if found is not None else self._ids[k]

    def _limit(self, i: int, total: int) -> int:
        get = getattr(self._torch.cuda, "get_per_process_memory_fraction", None)
        fraction = get(i) if get is not None else 1.0
        return int(fraction * total)

    # ------------------------------------------------------------------ the layout
    def poll(self) -> None:
        """Poll every device once; when a layout is due, read it first (in the layout
        thread, waiting for it at most ``poll_timeout``), so that this poll carries it."""
        reader = self._read_layout_if_due()
        if reader is not None:
            reader.join(self.poll_timeout)
        super().poll()

    def _tick(self) -> None:
        self._read_layout_if_due()  # the thread does not wait for it
        super().poll()

    def _poll_all(self) -> None:
        with self._layout_lock:
            tables, self._layout_done = self._layout_done, None
        self._tables = tables or {}
        try:
            super()._poll_all()
        finally:
            self._tables = {}

    def _read_layout_if_due(self) -> threading.Thread | None:
        """Start a layout read when one is due and none is in progress; the reader."""
        if not self.snapshot_interval or self._closed:
            return None
        now = time.monotonic()
        with self._layout_lock:
            if self._layout_reading is not None or (
                    now - self._last_snapshot < self.snapshot_interval):
                return None
            self._last_snapshot = now
            self._layout_reading = (now, time.time())
        reader = threading.Thread(target=self._read_layout, daemon=True,
                                  name="gpudash-torch-layout")
        reader.start()
        return reader

    def _read_layout(self) -> None:
        tables = failure = None
        try:
            segments = self._torch.cuda.memory_snapshot(**self._snap_kwargs)
            tables = {i: torch_chunk_table(segments, device=i) for i in self._ids}
        except Exception as exc:  # noqa: BLE001 - reported on the feeds, not fatal
            failure = f"torch.cuda.memory_snapshot() failed: {exc!r}; the layout is not current"
            self.errors.append((time.time(), "torch layout", repr(exc)))
        with self._layout_lock:
            started = self._layout_reading
            self._layout_reading = None
            if tables is not None:
                self._layout_done = tables
                self._layout_wall = started[1] if started is not None else time.time()
            self._layout_failure = failure
            give_back = self._history_left_to_layout
        took = time.monotonic() - started[0] if started is not None else 0.0
        if took > self.poll_timeout:
            self.errors.append((time.time(), "torch layout",
                                f"torch.cuda.memory_snapshot() took {took:.1f} s "
                                f"(poll_timeout {self.poll_timeout:g} s)"))
        for feed in self.feeds:  # an error cleared or set: a live model shows it
            feed._wake_listener()
        if give_back:  # stop() did not wait for this read
            self._history_off()

    def _feed_error(self, feed: FrameworkFeed) -> str | None:
        error = super()._feed_error(feed)
        if error is not None:
            return error
        with self._layout_lock:
            reading, failure, wall = self._layout_reading, self._layout_failure, \
                self._layout_wall
        if reading is not None:
            waited = time.monotonic() - reading[0]
            if waited >= self.poll_timeout:
                shown = (f"the layout shown is from {_clock(wall)}" if wall is not None
                         else "no layout yet")
                return (f"{feed.name}: torch.cuda.memory_snapshot() has not returned after "
                        f"{waited:.1f} s (since {_clock(reading[1])}; poll_timeout "
                        f"{self.poll_timeout:g} s): {shown}; the figures are current")
        return failure

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

    # ------------------------------------------------------------------ replay
    def snapshot(self) -> dict:
        """PyTorch's own memory snapshot now (``torch.cuda.memory._snapshot()``): every
        device's segments and blocks, the allocator history this monitor turned on
        (``device_traces``) and the allocator's settings (PyTorch 2.4 on)."""
        if self._closed:  # stop() turned the history off, which clears it in PyTorch
            raise ConfigError("this torch monitor is stopped (its allocator history went with "
                              "it); create a new one with gpudash.watch('torch')")
        get = getattr(getattr(self._torch.cuda, "memory", None), "_snapshot", None)
        if get is None:
            raise ConfigError(f"torch {getattr(self._torch, '__version__', '?')} has no "
                              "torch.cuda.memory._snapshot() to read the allocator's history "
                              "from (PyTorch 2.1 on has)")
        return get()

    def replay(self, device: int | None = None, *, snapshot: dict | None = None,
               **options: Any) -> Any:
        """Replay what PyTorch's allocator did through gpudash's model of it.

        Reads :meth:`snapshot` (or takes ``snapshot``), imports it
        (:func:`gpudash.formats.torch_snapshot.load_torch_snapshot`) and replays one device
        with :func:`gpudash.trace.replay.replay`: exactly (the snapshot's own segment
        addresses and release points), on the device's total memory, with the fraction
        PyTorch reports (``torch.cuda.get_per_process_memory_fraction``, where one below 1
        was set) and the snapshot's ``allocator_settings``. The result's ``fidelity`` says
        how closely the model followed PyTorch (segment events and final layout matched);
        a history ring that wrapped starts mid-run, and its fidelity says so.

        Parameters
        ----------
        device : int, optional
            The CUDA device (its PyTorch index; default the first watched).
        snapshot : dict, optional
            A snapshot read earlier (:meth:`snapshot`).
        **options
            More :func:`~gpudash.trace.replay.replay` settings (``conf``, ``fraction``,
            ``exact``, ``record``...); given ones win.

        Raises
        ------
        ConfigError
            A device this monitor does not watch, or a snapshot without history (the
            monitor was started with ``history=0``).
        """
        i = self._ids[0] if device is None else device
        if isinstance(i, bool) or not isinstance(i, int) or i not in self._ids:
            raise ConfigError(f"this monitor watches CUDA device(s) {self._ids}; got {device!r}")
        snap = self.snapshot() if snapshot is None else snapshot
        traces = snap.get("device_traces") or []
        if i >= len(traces) or not traces[i]:
            why = ("the monitor was started with history=0" if not self._history_entries
                   else "PyTorch recorded no history for it")
            raise ConfigError(f"the snapshot of cuda:{i} has no allocator history to replay "
                              f"({why}): watch with history > 0, or record it "
                              "(torch.cuda.memory._record_memory_history)")
        trace = load_torch_snapshot(snap)
        k = self._ids.index(i)
        settings = {"device": i, "allocator": "torch", "exact": True,
                    "device_bytes": self.feeds[k].capacity}
        get = getattr(self._torch.cuda, "get_per_process_memory_fraction", None)
        fraction = get(i) if get is not None else None
        if fraction is not None and fraction < 1.0:
            settings["fraction"] = float(fraction)
        settings.update(options)
        return replay(trace, **settings)

    def restart_lines(self, fraction: float | None = None, allow_growth: bool | None = None,
                      form: str = "env", device: int = 0) -> list[str]:
        if fraction is None and allow_growth is None:
            fraction = self.device_settings(device)["fraction"]
        return restart_lines("torch", fraction=fraction, allow_growth=allow_growth, form=form)

    def _closing(self) -> None:
        with self._layout_lock:  # a layout read stuck in PyTorch gives the history back
            left = self._layout_reading is not None
            self._history_left_to_layout = left
        if not left:
            self._history_off()

    def _history_off(self) -> None:
        if self._history_on:
            self._history_on = False
            try:
                self._torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:  # noqa: BLE001
                pass
