"""Run a workload in a background thread, so the notebook's controls stay usable.

While a cell runs, the kernel handles no widget messages: a slider moved during a long cell
acts only when the cell ends. A workload started with :func:`run_in_background` runs in a
daemon thread instead; the cell returns at once, the kernel keeps handling the dashboard's
controls, and the live views (updated from their own thread) show the workload as it runs.

>>> from gpudash.background import run_in_background
>>> task = run_in_background(sum, [1, 2, 3])
>>> task.result(timeout=5)
6
"""

from __future__ import annotations

import inspect
import math
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from ._comm_routing import follow_the_page
from ._errors import ConfigError

__all__ = ["run_in_background", "BackgroundTask", "CancelledError"]


def _check_timeout(timeout: Any) -> float | None:
    """A wait in seconds: None or +inf (or anything beyond what threads can wait) waits
    without limit; nan, negatives, strings and bools are refused by name."""
    if timeout is None:
        return None
    if isinstance(timeout, (bool, str, bytes)):
        raise ConfigError(f"timeout must be a number of seconds >= 0 or None; got {timeout!r}")
    try:
        t = float(timeout)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"timeout must be a number of seconds >= 0 or None; got "
                          f"{timeout!r}") from None
    if math.isnan(t) or t < 0:
        raise ConfigError(f"timeout must be a number of seconds >= 0 or None; got {timeout!r}")
    if t >= threading.TIMEOUT_MAX:
        return None
    return t


class CancelledError(Exception):
    """Raised by :meth:`BackgroundTask.result` for a task cancelled before it started."""


def _accepts_stop_event(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return "stop_event" in params


class BackgroundTask:
    """A function running in a daemon thread (made by :func:`run_in_background`).

    Attributes
    ----------
    name : str
    stop_event : threading.Event
        Set by :meth:`cancel`; handed to the function as ``stop_event=`` when it accepts that
        argument, so it can stop early.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict,
                 name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"run_in_background needs a callable; got {fn!r}")
        self.name = name or getattr(fn, "__name__", "task")
        self.stop_event = threading.Event()
        self._fn = fn
        self._args = args
        self._kwargs = dict(kwargs)
        if "stop_event" not in self._kwargs and _accepts_stop_event(fn):
            self._kwargs["stop_event"] = self.stop_event
        self._done = threading.Event()
        self._result: Any = None
        self._exc: BaseException | None = None
        self._started: float | None = None
        self._finished: float | None = None
        self._widget: Any = None
        self._thread = threading.Thread(target=self._run, name=f"gpudash-bg-{self.name}",
                                        daemon=True)

    def _start(self) -> BackgroundTask:
        self._thread.start()
        return self

    def _run(self) -> None:
        self._started = time.perf_counter()
        try:
            if self.stop_event.is_set():
                raise CancelledError(f"task {self.name!r} was cancelled before it started")
            self._result = self._fn(*self._args, **self._kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._exc = exc
        finally:
            self._finished = time.perf_counter()
            self._done.set()
            self._update_widget()

    # ------------------------------------------------------------------ state
    @property
    def done(self) -> bool:
        """True once the function returned or raised."""
        return self._done.is_set()

    @property
    def running(self) -> bool:
        return self._started is not None and not self.done

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        return self.stop_event.is_set()

    @property
    def elapsed(self) -> float:
        """Seconds the function has run (so far, or in all once done)."""
        if self._started is None:
            return 0.0
        end = self._finished if self._finished is not None else time.perf_counter()
        return end - self._started

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the function to end; True if it did within ``timeout`` (seconds >= 0;
        None or ``inf`` waits without limit)."""
        return self._done.wait(_check_timeout(timeout))

    def result(self, timeout: float | None = None) -> Any:
        """The function's return value, waiting for it; re-raises its exception.

        Raises
        ------
        TimeoutError
            If it is still running after ``timeout`` seconds.
        """
        if not self._done.wait(_check_timeout(timeout)):
            raise TimeoutError(f"task {self.name!r} still running after {timeout} s")
        if self._exc is not None:
            raise self._exc
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The exception the function raised (None if it returned), waiting for it."""
        if not self._done.wait(_check_timeout(timeout)):
            raise TimeoutError(f"task {self.name!r} still running after {timeout} s")
        return self._exc

    def cancel(self) -> None:
        """Ask the function to stop: sets :attr:`stop_event` (a function that accepts
        ``stop_event`` should check it); it is not interrupted otherwise."""
        self.stop_event.set()
        self._update_widget()

    # ------------------------------------------------------------------ display
    def status(self) -> str:
        """``running``, ``cancelling``, ``done``, ``failed`` or ``cancelled``."""
        if not self.done:
            return "cancelling" if self.cancelled else "running"
        if self._exc is not None:
            return "cancelled" if isinstance(self._exc, CancelledError) else "failed"
        return "cancelled" if self.cancelled else "done"

    def _status_text(self) -> str:
        text = f"{self.name}: {self.status()} ({self.elapsed:.1f} s)"
        if self._exc is not None and not isinstance(self._exc, CancelledError):
            text += f" - {type(self._exc).__name__}: {self._exc}"
        return text

    def widget(self) -> Any:
        """An ipywidgets status line with a Cancel button (updated when the task ends)."""
        if self._widget is None:
            import ipywidgets as widgets

            label = widgets.HTML(self._status_text())
            button = widgets.Button(description="Cancel", icon="stop",
                                    disabled=self.done, layout=widgets.Layout(width="90px"))
            button.on_click(lambda _b: self.cancel())
            self._widget = widgets.HBox([button, label])
            self._widget_parts = (button, label)
            follow_the_page(self._widget)   # updated from the task's thread
        return self._widget

    def _update_widget(self) -> None:
        if self._widget is None:
            return
        button, label = self._widget_parts
        label.value = self._status_text()
        button.disabled = self.done or self.cancelled

    def format_exception(self) -> str:
        """The worker's traceback as text ("" if it did not raise)."""
        if self._exc is None:
            return ""
        return "".join(traceback.format_exception(self._exc))

    def __repr__(self) -> str:
        return f"<BackgroundTask {self.name!r} {self.status()} {self.elapsed:.2f}s>"


def run_in_background(fn: Callable[..., Any], *args: Any, name: str | None = None,
                      **kwargs: Any) -> BackgroundTask:
    """Start ``fn(*args, **kwargs)`` in a daemon thread and return its task at once.

    If ``fn`` accepts a ``stop_event`` argument it receives the task's
    :class:`threading.Event`, set by :meth:`BackgroundTask.cancel`.

    Examples
    --------
    >>> import time
    >>> def work(n, stop_event):
    ...     for i in range(n):
    ...         if stop_event.is_set():
    ...             return i
    ...         time.sleep(0.01)
    ...     return n
    >>> task = run_in_background(work, 1000)
    >>> task.cancel(); task.result(timeout=5) < 1000
    True
    """
    return BackgroundTask(fn, args, kwargs, name=name)._start()
