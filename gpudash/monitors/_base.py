"""The monitor machinery shared by the framework monitors: a polling thread and its feeds."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .._errors import BackendUnavailableError, ConfigError
from ..options import FRAMEWORK_MODULES, require_installed  # noqa: F401 - re-exported
from ..bfc import AllocatorStats
from ..live.feeds import DeviceFeed, FeedSample
from ..live.views import open_view
from ..nvml import gpu_processes, NA, nvml_available

__all__ = ["Monitor", "FrameworkFeed", "Poll", "FRAMEWORK_MODULES", "require_installed"]

logger = logging.getLogger("gpudash")

#: Timeline points a feed keeps for :attr:`FrameworkFeed.history`.
HISTORY_POINTS = 3600
#: Seconds :meth:`Monitor.stop` waits for a poll in progress before leaving it behind.
STOP_GRACE = 2.0


def _clock(t: float) -> str:
    """``time.time()`` as the hour, minutes and seconds of the local clock."""
    return time.strftime("%H:%M:%S", time.localtime(t))


class Poll:
    """What one poll of one device found (built in the monitor's thread)."""

    __slots__ = ("stats", "missing", "table", "allocs", "frees", "ooms", "extra")

    def __init__(self, stats: AllocatorStats, missing: tuple[str, ...] = (),
                 table: dict | None = None, allocs: int = 0, frees: int = 0,
                 ooms: tuple = (), extra: dict | None = None) -> None:
        self.stats = stats
        self.missing = missing
        self.table = table
        self.allocs = allocs
        self.frees = frees
        self.ooms = ooms
        self.extra = extra or {}


class FrameworkFeed(DeviceFeed):
    """One device of a framework, as a :class:`~gpudash.live.feeds.DeviceFeed`.

    Read-only: :attr:`controls` says why (the framework fixes its allocator's settings when
    it starts); :meth:`restart_lines` gives the settings to restart with.

    Attributes
    ----------
    has_layout : bool
        True when the framework gives a memory layout (PyTorch's snapshot). Its samples then
        carry a ``table`` when a new layout was read (every ``snapshot_interval``), and
        ``table=None`` in between: the previous layout still stands.
    missing : tuple of str
        Stats fields the framework does not report (0 in the samples).
    history : deque of (time_ms, bytes_in_use, pool_bytes, bytes_limit)
        The last points polled, kept by the feed itself.
    latest : FeedSample or None
        The newest poll, as it was read (its ``table`` is None unless that poll brought a
        new layout); ``latest`` and ``history[-1]`` are the same point.
    error : str or None
        Why the figures are not current, in words: the framework's call that has not
        returned after the monitor's ``poll_timeout`` (the poll, or PyTorch's layout read),
        or the failure of the last poll of this device; None when all is well.
    """

    def __init__(self, monitor: "Monitor", index: int, name: str, capacity: int,
                 controls: str, has_layout: bool = False) -> None:
        self.name = name
        self.kind = monitor.framework
        self.capacity = int(capacity or 0)
        self.controls = controls
        self.index = index
        self.has_layout = has_layout
        self.missing: tuple[str, ...] = ()
        self.history: deque = deque(maxlen=HISTORY_POINTS)
        self.latest: FeedSample | None = None
        self._monitor = monitor
        self._lock = threading.Lock()
        # samples not taken yet, oldest first: at most a layout (with its own stats) and
        # the newer figures merged after it
        self._pending: list[FeedSample] = []
        self._failure: str | None = None  # the last poll of this device failed: why
        self._error_sent: str | None = None  # the error as of the last sample handed over
        self._wake: Callable[[], None] | None = None
        self._started = False

    # ------------------------------------------------------------------ DeviceFeed
    def start(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._started = True
        self._monitor.start()

    @property
    def error(self) -> str | None:
        return self._monitor._feed_error(self)

    def sample(self) -> FeedSample | None:
        """The oldest sample not taken yet: a layout comes with its own stats, and the
        figures polled after it follow at the next call. While nothing new comes, a change
        of :attr:`error` (a poll stuck, or back) is handed over as the latest figures, so
        that a live model shows it."""
        error = self.error
        with self._lock:
            sample = self._pending.pop(0) if self._pending else None
            changed = error != self._error_sent
            self._error_sent = error
            latest = self.latest
        if sample is None and changed:
            sample = FeedSample(time_ms=time.time() * 1000.0,
                                stats=latest.stats if latest is not None else AllocatorStats(),
                                extra=dict(latest.extra) if latest is not None else {})
        return sample

    def stop(self) -> None:
        """Stop feeding; when every started feed of the monitor has stopped (the live model
        over them closed), the monitor stops too."""
        was = self._started
        self._wake = None
        self._started = False
        if was:
            self._monitor._feed_stopped()

    def settings(self) -> dict:
        return self._monitor.device_settings(self.index)

    def restart_lines(self, fraction: float | None = None, allow_growth: bool | None = None,
                      form: str = "env") -> list[str]:
        """The lines to paste to restart the framework with these settings (default: the
        settings in force)."""
        return self._monitor.restart_lines(fraction=fraction, allow_growth=allow_growth,
                                           form=form, device=self.index)

    # ------------------------------------------------------------------ monitor side
    def _publish(self, poll: Poll, time_ms: float) -> None:
        sample = FeedSample(time_ms=time_ms, stats=poll.stats, table=poll.table,
                            allocs=poll.allocs, frees=poll.frees, events=poll.allocs + poll.frees,
                            ooms=tuple(poll.ooms), extra=dict(poll.extra))
        self.missing = poll.missing
        s = poll.stats
        with self._lock:
            self.history.append((time_ms, s.bytes_in_use, s.pool_bytes, s.bytes_limit))
            self.latest = sample
            self._failure = None
            pending = self._pending
            if sample.table is not None or not pending:
                # a new layout stands for everything before it: it carries their counts
                self._pending = [_merged(pending + [sample])]
            elif pending[-1].table is None:  # newer figures after newer figures
                pending[-1] = _merged(pending[-1:] + [sample])
            else:  # a layout not taken yet keeps its own stats; the new figures follow it
                pending.append(sample)
        self._wake_listener()

    def _failed(self, text: str) -> None:
        with self._lock:
            self._failure = text
        self._wake_listener()

    def _wake_listener(self) -> None:
        wake = self._wake
        if wake is not None:
            try:
                wake()
            except Exception:  # noqa: BLE001 - a listener's failure must not stop polling
                logger.exception("gpudash: a feed's wake callback failed")


def _merged(samples: list[FeedSample]) -> FeedSample:
    """One sample for several polls: the last one's figures (and layout), everyone's counts."""
    if len(samples) == 1:
        return samples[0]
    last = samples[-1]
    return FeedSample(
        time_ms=last.time_ms, stats=last.stats, table=last.table,
        allocs=sum(x.allocs for x in samples), frees=sum(x.frees for x in samples),
        events=sum(x.events for x in samples),
        ooms=tuple(o for x in samples for o in x.ooms), extra=last.extra)


class Monitor:
    """A live, read-only source of a framework's memory figures.

    A thread polls the framework's own figures every ``interval`` seconds (off the
    kernel's main thread) and hands them to one :class:`FrameworkFeed` per device
    (:attr:`feeds`), the form a live model's devices take.

    A call into the framework can block (a lock held elsewhere in the process): a poll
    that has not returned after ``poll_timeout`` seconds is reported on the feeds
    (:attr:`FrameworkFeed.error`, which the dashboard shows in its status line), and
    :meth:`stop` does not wait for it; what the monitor has to give back to the framework
    (PyTorch's allocator history) is given back when that call returns.

    Subclasses implement ``_open(devices)`` (find the devices; raise ConfigError naming
    the framework when it has none), ``_poll_device(i)`` (one :class:`Poll`),
    ``device_settings(i)`` and ``restart_lines(...)``.

    Attributes
    ----------
    polls : int
        Polls completed.
    errors : deque of (time, where, text)
        The last failures: polls that raised, and polls that took longer than
        ``poll_timeout`` (reported when they return).
    """

    framework = ""
    #: The reason shown on the disabled controls.
    controls_reason = ""

    def __init__(self, interval: float = 0.25, devices: Any = None,
                 poll_timeout: float = 5.0) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (
                0.01 <= interval <= 60):
            raise ConfigError(f"interval must be a number of seconds in [0.01, 60]; "
                              f"got {interval!r}")
        if isinstance(poll_timeout, bool) or not isinstance(poll_timeout, (int, float)) or not (
                0.1 <= poll_timeout <= 3600):
            raise ConfigError(f"poll_timeout must be a number of seconds in [0.1, 3600] (how "
                              f"long a poll may take before it is reported); got "
                              f"{poll_timeout!r}")
        self.interval = float(interval)
        self.poll_timeout = float(poll_timeout)
        self.feeds: list[FrameworkFeed] = []
        self.polls = 0
        self.errors: deque = deque(maxlen=20)
        self.poll_seconds = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._poll_lock = threading.RLock()
        self._closed = False
        # the poll in progress: (time.monotonic() and time.time() at its start, the feed
        # being polled), or None
        self._in_poll: tuple[float, float, FrameworkFeed | None] | None = None
        self._state = threading.Lock()  # the thread's end, and what stop() leaves to it
        self._thread_running = False
        self._close_left_to_thread = False
        self._open(devices)

    # ------------------------------------------------------------------ subclass API
    def _open(self, devices: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _poll_device(self, i: int) -> Poll:  # pragma: no cover - abstract
        raise NotImplementedError

    def device_settings(self, i: int) -> dict:
        """Settings in force on device ``i`` (``fraction``, ``allow_growth``,
        ``deferred_deletion_bytes``, ``limit``, ``total``; None where unknown), plus the
        framework's own names under ``"names"``."""
        feed = self.feeds[i]
        return {"fraction": None, "allow_growth": None, "deferred_deletion_bytes": None,
                "limit": None, "total": feed.capacity or None, "names": {}}

    def restart_lines(self, fraction: float | None = None, allow_growth: bool | None = None,
                      form: str = "env", device: int = 0) -> list[str]:  # pragma: no cover
        raise NotImplementedError

    def _closing(self) -> None:
        """Release what ``_open`` took (history recording...)."""

    def _feed_stopped(self) -> None:
        if not self._closed and not any(f._started for f in self.feeds):
            self.stop()

    # ------------------------------------------------------------------ polling
    def poll(self) -> None:
        """Poll every device once (the thread does this every ``interval``).

        Raises
        ------
        BackendUnavailableError
            When a poll in progress (the thread's) has not returned after ``poll_timeout``:
            the framework is not answering.
        """
        if not self._poll_lock.acquire(timeout=self.poll_timeout):
            raise BackendUnavailableError(
                self._stuck_text() or f"{self.framework}: a poll in progress has not "
                f"returned after {self.poll_timeout:g} s (poll_timeout)")
        try:
            self._poll_all()
        finally:
            self._poll_lock.release()

    def _poll_all(self) -> None:
        """Poll each device and publish (under the poll lock)."""
        t0 = time.perf_counter()
        start = (time.monotonic(), time.time())
        try:
            for feed in self.feeds:
                self._in_poll = (*start, feed)
                try:
                    poll = self._poll_device(feed.index)
                except Exception as exc:  # noqa: BLE001 - a failed poll is reported, not fatal
                    if not self.errors:
                        logger.warning("gpudash: polling %s %s failed: %r", self.framework,
                                       feed.name, exc)
                    self.errors.append((time.time(), feed.name, repr(exc)))
                    feed._failed(f"{feed.name}: the last poll failed: {exc!r}")
                    continue
                feed._publish(poll, time.time() * 1000.0)
        finally:
            self._in_poll = None
        took = time.monotonic() - start[0]
        if took > self.poll_timeout:
            self.errors.append((time.time(), self.framework,
                                f"a poll took {took:.1f} s (poll_timeout {self.poll_timeout:g} s)"))
        self.polls += 1
        self.poll_seconds += time.perf_counter() - t0

    def _stuck_text(self) -> str | None:
        """The poll in progress, in words, once it has run longer than ``poll_timeout``."""
        now = self._in_poll
        if now is None:
            return None
        started, wall, feed = now
        waited = time.monotonic() - started
        if waited < self.poll_timeout:
            return None
        where = feed.name if feed is not None else self.framework
        return (f"{where}: the poll has not returned after {waited:.1f} s (since "
                f"{_clock(wall)}; poll_timeout {self.poll_timeout:g} s): {self.framework} "
                "is not answering, and the figures shown are from before it")

    def _feed_error(self, feed: FrameworkFeed) -> str | None:
        """:attr:`FrameworkFeed.error` of ``feed``."""
        return self._stuck_text() or feed._failure

    def _tick(self) -> None:
        """What the thread does every ``interval`` (subclasses add to it)."""
        self.poll()

    def _run(self) -> None:
        try:
            next_t = time.perf_counter()
            while not self._stop.is_set():
                try:
                    self._tick()
                except BackendUnavailableError:
                    pass  # a poll of another thread is stuck: the feeds say so
                except Exception as exc:  # noqa: BLE001 - the thread goes on, and says why
                    logger.exception("gpudash: the %s monitor's poll failed", self.framework)
                    self.errors.append((time.time(), self.framework, repr(exc)))
                    for feed in self.feeds:
                        feed._failed(f"{feed.name}: polling failed: {exc!r}")
                next_t += self.interval
                delay = next_t - time.perf_counter()
                if delay < 0:  # fell behind: do not try to catch up
                    next_t = time.perf_counter()
                    delay = 0
                self._stop.wait(delay)
        finally:
            with self._state:
                self._thread_running = False
                close = self._close_left_to_thread
            if close:  # stop() did not wait for this thread's poll: give back what we took
                self._closing()

    def start(self) -> "Monitor":
        """Start the polling thread (once); returns the monitor."""
        if self._closed:
            raise ConfigError(f"this {self.framework} monitor is stopped; create a new one "
                              "with gpudash.watch()")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"gpudash-{self.framework}-monitor")
            self._thread_running = True
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and release what the monitor took. Idempotent.

        Waits at most a few seconds for a poll in progress; a poll stuck in the framework
        is left behind (reported in :attr:`errors`), and its thread releases what the
        monitor took when the call returns.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=min(STOP_GRACE, self.poll_timeout))
        for feed in self.feeds:
            feed.stop()
        with self._state:
            left = self._thread_running and thread is not threading.current_thread()
            self._close_left_to_thread = left
        if left:
            text = (self._stuck_text() or f"{self.framework}: a poll in progress") + \
                "; stopped without waiting for it"
            self.errors.append((time.time(), self.framework, text))
            logger.warning("gpudash: %s", text)
        else:
            self._closing()

    close = stop

    def dashboard(self, **options: Any) -> Any:
        """The live dashboard of this monitor's devices, ``gpudash.Dashboard(monitor)`` (over
        :attr:`feeds`): read-only views, disabled controls that say why, and a button that
        prints the settings to restart with. Closing it stops the monitor. *options* go to
        the dashboard (``rate_hz``, ``views``, ``device``...). The views register the
        dashboard (:mod:`gpudash.live.views`); this layer does not import them."""
        if self._closed:
            raise ConfigError(f"this {self.framework} monitor is stopped; create a new one "
                              "with gpudash.watch()")
        return open_view("dashboard", self, **options)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> "Monitor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ who else is on the GPU
    def driver_view(self) -> dict:
        """The framework's pools set against what the driver (NVML) says of this process.

        Returns
        -------
        dict
            ``{"available": bool, "reason": str, "devices": [...]}``; each device row has
            ``feed`` (its name), ``nvml_index``, ``pool`` (the framework's pool, or bytes in
            use where it reports no pool), ``driver`` (what NVML counts for this process,
            :data:`~gpudash.nvml.NA` when it cannot say), ``outside_pool`` (driver - pool:
            CUDA context, libraries' workspaces, other allocators) and ``processes`` (every
            process on that GPU, this one marked ``is_self`` and ``framework``).
        """
        ok, reason = nvml_available()
        out: dict = {"available": ok, "reason": reason, "devices": []}
        if not ok:
            return out
        procs = gpu_processes(framework=self.framework)
        for feed in self.feeds:
            nvml_index = self._nvml_index(feed.index)
            rows = procs.get(nvml_index, [])
            mine = [p for p in rows if p.is_self]
            driver: Any = NA
            if mine and all(p.used is not NA for p in mine):
                driver = sum(int(p.used) for p in mine)
            latest = feed.latest
            pool = 0
            if latest is not None:
                s = latest.stats
                pool = s.pool_bytes if "pool_bytes" not in feed.missing else s.bytes_in_use
            outside = driver - pool if driver is not NA else NA
            out["devices"].append({"feed": feed.name, "nvml_index": nvml_index, "pool": pool,
                                   "driver": driver, "outside_pool": outside, "processes": rows})
        return out

    def _nvml_index(self, i: int) -> int:
        """The NVML index of device ``i`` (the same index unless a subclass knows better)."""
        return i

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped" if self._closed else "idle"
        return (f"{type(self).__name__}({len(self.feeds)} device(s), {state}, "
                f"every {self.interval:g} s, {self.polls} polls)")
