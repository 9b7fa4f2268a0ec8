"""TensorFlow's monitor: ``tf.config.experimental.get_memory_info`` per device."""

from __future__ import annotations

import os
from typing import Any

from .._errors import ConfigError
from ..options import allow_growth_from_env, restart_lines
from ._base import FrameworkFeed, Monitor, Poll, require_installed
from ._parse import stats_from_tf_memory_info
from ..nvml import device_facts

__all__ = ["TensorFlowMonitor"]


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 0


class TensorFlowMonitor(Monitor):
    """Polls ``tf.config.experimental.get_memory_info(device)`` (bytes in use and their
    peak: all TensorFlow reports; no layout, no pool).

    Parameters
    ----------
    interval : float
        Seconds between polls (default 0.25).
    devices : list of str, optional
        TensorFlow device names (``"GPU:0"``); default every logical GPU. ``["CPU:0"]``
        watches the CPU allocator (a BFC with ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before
        TensorFlow starts), which is how gpudash tests this monitor without a GPU.

    Raises
    ------
    ConfigError
        TensorFlow not installed, no GPU (and no ``devices``), or an unknown device.
    """

    framework = "tensorflow"
    controls_reason = ("TensorFlow fixes its allocator's settings when it creates its devices: "
                       "set them and restart")

    def _open(self, devices: Any) -> None:
        require_installed("tensorflow")
        import tensorflow as tf

        self._tf = tf
        logical = tf.config.list_logical_devices()
        if devices is None:
            names = [d.name for d in logical if d.device_type == "GPU"]
            if not names:
                have = ", ".join(d.name.replace("/device:", "") for d in logical) or "none"
                raise ConfigError(
                    f"cannot watch tensorflow: TensorFlow sees no GPU here (its devices: {have}); "
                    "watch needs a GPU, or devices=['CPU:0'] to watch the CPU allocator (a BFC "
                    "when TF_CPU_ALLOCATOR_USE_BFC=true is set before TensorFlow starts)")
        else:
            if isinstance(devices, str):
                devices = [devices]
            known = {d.name.replace("/device:", "").upper(): d.name for d in logical}
            names = []
            for dev in devices:
                key = str(dev).replace("/device:", "").replace("/physical_device:", "").upper()
                if key not in known:
                    raise ConfigError(
                        f"TensorFlow has no device {dev!r}; accepted: "
                        f"{', '.join(sorted(known))}")
                names.append(known[key])
        self._names = [n.replace("/device:", "") for n in names]
        physical = {p.name.replace("/physical_device:", ""): p
                    for p in tf.config.list_physical_devices()}
        self._physical = [physical.get(n) for n in self._names]
        for i, name in enumerate(self._names):
            capacity = _host_memory() if name.upper().startswith("CPU") else self._gpu_total(i)
            self.feeds.append(FrameworkFeed(self, i, f"tensorflow {name}", capacity,
                                            self.controls_reason))

    def _gpu_total(self, i: int) -> int:
        try:
            facts = device_facts(self._nvml_index(i))
        except ConfigError:
            return 0
        total = facts[0].total if facts else 0
        return total if isinstance(total, int) else 0

    def _nvml_index(self, i: int) -> int:
        return int(self._names[i].rsplit(":", 1)[-1])

    def _limit(self, i: int) -> int:
        phys = self._physical[i]
        if phys is None or phys.device_type != "GPU":
            return 0
        try:
            configs = self._tf.config.get_logical_device_configuration(phys)
        except Exception:  # noqa: BLE001 - older TensorFlow
            return 0
        if configs and getattr(configs[0], "memory_limit", None):
            return int(configs[0].memory_limit) << 20
        return 0

    def _poll_device(self, i: int) -> Poll:
        info = self._tf.config.experimental.get_memory_info(self._names[i])
        stats, missing = stats_from_tf_memory_info(info, self._limit(i))
        return Poll(stats, missing)

    def device_settings(self, i: int) -> dict:
        out = super().device_settings(i)
        phys = self._physical[i]
        growth = None
        if phys is not None and phys.device_type == "GPU":
            try:
                growth = bool(self._tf.config.experimental.get_memory_growth(phys))
            except Exception:  # noqa: BLE001
                growth = None
            growth = allow_growth_from_env(bool(growth)) if growth is not None else None
        limit = self._limit(i) or None
        out.update(allow_growth=growth, limit=limit,
                   fraction=(limit / self.feeds[i].capacity) if limit and self.feeds[i].capacity
                   else None,
                   names={"allow_growth": "allow_growth",
                          "fraction": "per_process_gpu_memory_fraction",
                          "limit": "memory_limit (MiB, tf.config)"})
        return out

    def restart_lines(self, fraction: float | None = None, allow_growth: bool | None = None,
                      form: str = "env", device: int = 0) -> list[str]:
        s = self.device_settings(device)
        if fraction is None and allow_growth is None:
            fraction, allow_growth = s["fraction"], s["allow_growth"]
        return restart_lines("tensorflow", fraction=fraction, allow_growth=allow_growth,
                             total=self.feeds[device].capacity or None, form=form)
