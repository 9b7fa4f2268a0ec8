"""JAX's monitor: ``jax.Device.memory_stats()`` per GPU."""

from __future__ import annotations

import os
from typing import Any

from .._errors import ConfigError
from ..options import installed_jaxlib_version, jax_settings_from_env, restart_lines
from ._base import FrameworkFeed, Monitor, Poll, require_installed
from ._parse import stats_from_jax_memory_stats
from ..nvml import device_facts

__all__ = ["JaxMonitor"]

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


class JaxMonitor(Monitor):
    """Polls ``device.memory_stats()`` for each of JAX's GPUs (its BFC's ``bytes_in_use``,
    ``peak_bytes_in_use``, ``bytes_limit``, ``pool_bytes``, ``largest_free_block_bytes``,
    ``num_allocs``...; no layout).

    Creating it initialises JAX's backend if nothing did yet (which preallocates, as JAX
    does at its first operation).

    Raises
    ------
    ConfigError
        JAX not installed, or no GPU among its devices (on a CPU, ``memory_stats()`` is
        None: there is nothing to watch).
    """

    framework = "jax"
    controls_reason = ("JAX fixes its allocator's settings when its backend starts: set "
                       "XLA_PYTHON_CLIENT_MEM_FRACTION / XLA_PYTHON_CLIENT_PREALLOCATE and "
                       "restart")

    def _open(self, devices: Any) -> None:
        require_installed("jax")
        import jax

        local = jax.local_devices()
        gpus = [d for d in local if d.platform in _GPU_PLATFORMS]
        if not gpus:
            have = ", ".join(f"{d.platform}:{d.id}" for d in local) or "none"
            raise ConfigError(
                f"cannot watch jax: JAX has no GPU here (its devices: {have}; memory_stats() "
                "is None without one); watch needs a CUDA or ROCm jaxlib on a GPU machine")
        if devices is not None:
            ids = [devices] if isinstance(devices, int) else list(devices)
            by_id = {d.id: d for d in gpus}
            for i in ids:
                if i not in by_id:
                    raise ConfigError(f"JAX has no GPU with id {i!r}; accepted: "
                                      f"{', '.join(str(k) for k in by_id)}")
            gpus = [by_id[i] for i in ids]
        self._devices = gpus
        try:
            self.jax_settings = jax_settings_from_env(
                os.environ, jaxlib_version=installed_jaxlib_version())
        except ConfigError:  # JAX started anyway (the variables changed since?)
            self.jax_settings = None
        for i, d in enumerate(gpus):
            stats = d.memory_stats() or {}
            capacity = self._total(i, stats)
            self.feeds.append(FrameworkFeed(self, i, f"jax {d.platform}:{d.id}", capacity,
                                            self.controls_reason))
        self._last_allocs = [None] * len(gpus)

    def _total(self, i: int, stats: dict) -> int:
        try:
            facts = device_facts(self._nvml_index(i))
        except ConfigError:
            facts = []
        if facts and isinstance(facts[0].total, int):
            return facts[0].total
        limit = stats.get("bytes_limit", 0)
        if limit and self.jax_settings is not None and self.jax_settings.uses_bfc:
            return int(limit / self.jax_settings.effective_fraction)
        return 0

    def _nvml_index(self, i: int) -> int:
        return int(getattr(self._devices[i], "local_hardware_id", None) or self._devices[i].id)

    def _poll_device(self, i: int) -> Poll:
        raw = self._devices[i].memory_stats()
        if raw is None:
            raise ConfigError(f"{self.feeds[i].name}: memory_stats() returned None")
        stats, missing = stats_from_jax_memory_stats(raw)
        last = self._last_allocs[i]
        self._last_allocs[i] = stats.num_allocs
        allocs = max(0, stats.num_allocs - last) if last is not None else 0
        extra = {k: int(raw[k]) for k in ("bytes_reserved", "bytes_reservable_limit")
                 if k in raw and raw[k]}
        return Poll(stats, missing, allocs=allocs, extra=extra)

    def device_settings(self, i: int) -> dict:
        out = super().device_settings(i)
        s = self.jax_settings
        latest = self.feeds[i].latest
        limit = latest.stats.bytes_limit if latest is not None and latest.stats.bytes_limit \
            else None
        if s is not None:
            out.update(fraction=s.memory_fraction, allow_growth=s.allow_growth,
                       allocator=s.allocator)
        out.update(limit=limit, names={"fraction": s.fraction_variable if s and
                                       s.fraction_variable else "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                       "allow_growth": "XLA_PYTHON_CLIENT_PREALLOCATE",
                                       "allocator": "XLA_PYTHON_CLIENT_ALLOCATOR"})
        return out

    def restart_lines(self, fraction: float | None = None, allow_growth: bool | None = None,
                      form: str = "env", device: int = 0) -> list[str]:
        if fraction is None and allow_growth is None and self.jax_settings is not None:
            fraction = self.jax_settings.memory_fraction
            allow_growth = self.jax_settings.allow_growth
        return restart_lines("jax", fraction=fraction, allow_growth=allow_growth, form=form)
