"""Live, read-only monitors of a real framework's allocator: TensorFlow, JAX, PyTorch.

A :class:`Monitor` polls the framework's own figures a few times a second in a thread of its
own and exposes one :class:`~gpudash.live.feeds.DeviceFeed` per device
(:attr:`Monitor.feeds`), the source a live model's devices take, next to gpudash's own
allocators:

=============  ==============================================  =========================
framework      polled                                          layout (chunk map, bins)
=============  ==============================================  =========================
tensorflow     ``tf.config.experimental.get_memory_info``       none (in use, peak only)
jax            ``device.memory_stats()``                        none (BFC totals)
torch          ``torch.cuda.memory_stats()``                    ``memory_snapshot()``, every
                                                                ``snapshot_interval`` s, in
                                                                a thread of its own
=============  ==============================================  =========================

Their controls are disabled (``feed.controls`` says why: a framework fixes its settings when
it starts); ``feed.restart_lines()`` / :meth:`Monitor.restart_lines` give the settings to
restart with, and :meth:`Monitor.driver_view` sets the framework's pool against what the
driver (NVML) counts for the process. A call into the framework that has not returned after
``poll_timeout`` seconds is said on the feeds (``feed.error``, and the dashboard's status
line), and :meth:`Monitor.stop` does not wait for it. Nothing here imports a framework until
a monitor is created.
"""

from __future__ import annotations

import importlib
from typing import Any

from .._errors import ConfigError
from ..options import check_framework, require_installed

__all__ = ["Monitor", "FrameworkFeed", "TensorFlowMonitor", "JaxMonitor", "TorchMonitor",
           "watch", "monitor_class"]

_LAZY = {
    "Monitor": "gpudash.monitors._base",
    "FrameworkFeed": "gpudash.monitors._base",
    "TensorFlowMonitor": "gpudash.monitors._tf",
    "JaxMonitor": "gpudash.monitors._jax",
    "TorchMonitor": "gpudash.monitors._torch",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpudash.monitors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def monitor_class(framework: str) -> type:
    """The monitor class of ``"tensorflow"``, ``"jax"`` or ``"torch"`` (aliases ``tf``,
    ``pytorch``)."""
    name = check_framework(framework)
    return __getattr__({"tensorflow": "TensorFlowMonitor", "jax": "JaxMonitor",
                        "torch": "TorchMonitor"}[name])


def watch(framework: str, *, interval: float = 0.25, devices: Any = None,
          poll_timeout: float = 5.0, **options: Any) -> Any:
    """Watch a framework's allocator live: create and start its monitor.

    Parameters
    ----------
    framework : {"torch", "jax", "tensorflow"}
    interval : float
        Seconds between polls (default 0.25: four a second).
    devices : optional
        Which devices (default: every GPU the framework sees); see each monitor.
    poll_timeout : float
        Seconds after which a call into the framework that has not returned is reported
        on the feeds (``feed.error``, and the dashboard's status line); default 5.
    **options
        PyTorch: ``snapshot_interval`` (seconds between layouts, default 2; 0 = none),
        ``history`` (the allocator-history ring turned on, default 100,000 entries; 0 =
        leave it) and ``module`` (the ``torch`` to watch; default ``import torch``).

    Returns
    -------
    Monitor
        Running; ``monitor.feeds`` are its devices and ``monitor.dashboard()`` shows them
        live (``%gpudash --watch FRAMEWORK`` does both). Closing that dashboard stops the
        monitor.

    Raises
    ------
    ConfigError
        An unknown framework, one that is not installed, or one that has no GPU here; the
        message names it and what is accepted.
    """
    try:
        name = check_framework(framework)
    except ConfigError:
        raise ConfigError(f"watch accepts torch, jax or tensorflow; got {framework!r}") from None
    if name != "torch" or options.get("module") is None:
        require_installed(name)
    cls = monitor_class(name)
    if options and name != "torch":
        raise ConfigError(f"watch({name!r}) takes interval, devices and poll_timeout; got "
                          f"{', '.join(sorted(options))}")
    monitor = cls(interval=interval, devices=devices, poll_timeout=poll_timeout, **options)
    monitor.start()
    return monitor
