"""Feeds: where the devices of a :class:`~gpudash.live.LiveModel` get their data.

A live model shows devices. A gpudash session's allocators it watches itself (it attaches to
their events); every other device is fed by one :class:`DeviceFeed`: a Dask worker's event
stream (``gpudash.dask``), a framework monitor (TensorFlow, JAX, PyTorch). Views never see
feeds: they read the model, which asks each feed for a :class:`FeedSample` at most
``rate_hz`` times a second and turns samples into the states the dashboard draws (timeline,
heatmap, bins, chunk map), and they act through the model (:meth:`LiveModel.act
<gpudash.live.LiveModel.act>`), which calls the feed's control methods.

A feed

- says what it is (``name``, ``kind``, ``capacity``) and whether the controls can act on
  it (``controls``: ``None`` when they can, otherwise the reason shown on the disabled
  controls);
- is started with a ``wake`` callable, which it may call from any thread when new data is
  ready (the refresher then runs before its next tick);
- hands over what changed since its previous sample from :meth:`DeviceFeed.sample`, called
  in the model's refresher thread only; ``None`` means nothing changed;
- is stopped once, by the model's ``close()``.

A feed may name the allocator model it speaks (``model``, one of :mod:`gpudash.models`):
the views then draw its layout in that model's words (PyTorch's segments and pools), the
controls are that model's, and :meth:`DeviceFeed.configure` takes that model's settings
(PyTorch's ``expandable_segments``, ``max_split_size_mb``...). A feed that names none is
drawn, and acted on, as the BFC model, in neutral words (:data:`CONTROL_NAMES`).

A feed without a memory layout (a framework that reports only totals) has
``has_layout = False`` and returns ``table=None``: the views that need chunks say so in words
instead of drawing an empty plot. A feed with a layout may read it less often than its
totals (PyTorch's snapshots are costly): then ``table=None`` in a sample means "the previous
layout still stands", and the model keeps drawing the last table it got.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..bfc import AllocatorStats
from ..models import BFC

__all__ = ["FeedSample", "DeviceFeed", "CONTROL_NAMES"]

#: Changes a controllable feed's :meth:`DeviceFeed.configure` accepts when it names no model:
#: the settings of the BFC model's controls (such a feed is drawn, and acted on, as the BFC
#: model):
#: ``per_process_gpu_memory_fraction``, ``allow_growth``, ``deferred_deletion_bytes``.
CONTROL_NAMES = tuple(c.setting for c in BFC.controls if c.setting)


@dataclasses.dataclass(frozen=True, eq=False)
class FeedSample:
    """What one device looks like now, plus what happened since the previous sample.

    Attributes
    ----------
    time_ms : float
        When the sample was taken, in ms since the epoch (the source's clock; a remote
        source converts to the local clock before handing the sample over).
    stats : AllocatorStats
        ``bytes_in_use``, ``pool_bytes``, ``bytes_limit``, peaks, ``largest_free_block_bytes``
        and ``fragmentation`` as the source knows them. With a ``table`` they must agree with
        it.
    table : dict of numpy arrays, or None
        The layout, in the form of :meth:`gpudash.BFCAllocator.chunk_table` (``ptr``,
        ``size``, ``requested``, ``alloc_id``, ``bin``, ``region``, ``in_use``, ``regions``);
        optional extra columns of the same length (``holder``) may follow. ``None`` when the
        source has no layout, or (``has_layout`` feeds) when the layout was not read again
        since the previous sample.
    allocs, frees, events : int
        Counts since the previous sample.
    ooms : tuple of (time_ns, rounded, requested)
        Failed allocations since the previous sample.
    settings : tuple of (time_ns, setting, old, new)
        Setting changes since the previous sample.
    extra : dict
        Source-specific figures shown beside the stats (``{"reserved": 123}``), names to
        numbers or short strings.
    """

    time_ms: float
    stats: AllocatorStats
    table: dict | None = None
    allocs: int = 0
    frees: int = 0
    events: int = 0
    ooms: tuple = ()
    settings: tuple = ()
    extra: dict = dataclasses.field(default_factory=dict)


class DeviceFeed:
    """The base of feeds; subclasses override what they support.

    Attributes
    ----------
    name : str
        The device's name as shown (``GPU_0_bfc``, ``tcp://10.0.0.2:4000 GPU_0_bfc``).
    kind : str
        ``"gpudash"``, ``"dask"``, ``"tensorflow"``, ``"jax"`` or ``"torch"``.
    capacity : int
        The device's memory in bytes (what the heatmap's rows split); 0 when unknown.
    has_layout : bool
        Whether samples carry chunk tables (chunk map, bins, heatmap); otherwise those views
        say the source gives no layout.
    controls : str or None
        ``None`` when :meth:`configure`, :meth:`release_free_regions` and
        :meth:`flush_deferred` act; otherwise the reason the controls are disabled
        ("TensorFlow fixes its allocator's settings at start: set them and restart").
    model : AllocatorModel or None
        The allocator model whose words, layout and controls the device has; ``None``: the
        BFC model's neutral ones.
    error : str or None
        Why the figures are not current, in words (a framework call that has not
        returned, a failed poll), shown in the dashboard's status line; None when all is
        well. A feed whose error changes hands over a sample, so that the change is shown.
    """

    name: str = "device"
    kind: str = "gpudash"
    capacity: int = 0
    has_layout: bool = True
    controls: str | None = "this source cannot be controlled"
    model: Any = None
    error: str | None = None

    def start(self, wake: Callable[[], None]) -> None:
        """Begin feeding; call ``wake()`` (from any thread) when new data is ready."""

    def sample(self) -> FeedSample | None:
        """What changed since the previous call, or ``None`` (refresher thread only)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop feeding and release what :meth:`start` took. Called once."""

    def history(self) -> dict | None:
        """Optional: the device's timeline points from before the first sample (``time_ms``,
        ``in_use``, ``pool``, ``limit`` arrays, oldest first), read once after :meth:`start`;
        the model's timeline starts with them. ``None``: no history."""
        return None

    # ----------------------------------------------------------- controls (optional)
    def settings(self) -> dict:
        """Settings in force: ``fraction``, ``allow_growth``, ``deferred_deletion_bytes``,
        ``limit`` and ``total`` (``None`` where unknown)."""
        return {"fraction": None, "allow_growth": None, "deferred_deletion_bytes": None,
                "limit": None, "total": self.capacity or None}

    def unavailable(self) -> dict[str, str]:
        """Optional: the controls of the feed's model that cannot act on this source, by
        control name, each with the reason (install mode: PyTorch's ``expandable_segments``,
        which it does not model). The dashboard draws them disabled with the reason, and
        :meth:`configure` refuses them with it. ``{}``: every control acts."""
        return {}

    def figures(self) -> dict:
        """Optional: the allocator's own figures under its framework's names (what
        :meth:`~gpudash.models.AllocatorModel.figures` gives for an allocator; PyTorch's
        ``memory_stats()`` keys), for the controls' answers. ``{}``: none."""
        return {}

    def configure(self, **changes: Any) -> None:
        """Apply changes to the settings of the feed's model's controls (:data:`CONTROL_NAMES`
        for a feed that names no model), all or none (raise ``ConfigError``)."""
        raise NotImplementedError(self.controls or "configure")

    def release_free_regions(self) -> int:
        """Return wholly free regions; the bytes returned."""
        raise NotImplementedError(self.controls or "release_free_regions")

    def flush_deferred(self) -> int:
        """Return deferred frees now; the bytes returned."""
        raise NotImplementedError(self.controls or "flush_deferred")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, kind={self.kind!r})"
