"""Install mode: a PyTorch job's CUDA allocations on gpudash's compiled allocator.

``gpudash.torch.install()`` hands PyTorch the C functions ``gpudash._core`` exports
(``gpudash_torch_malloc``, and the 4-argument ``gpudash_torch_free``) through
``torch.cuda.memory.CUDAPluggableAllocator`` and ``change_current_allocator``. From then on
every CUDA tensor's memory comes from gpudash's model of PyTorch's caching allocator
(``allocator="torch"``: best fit by stream and size, blocks split and merged, 2 MiB / 20 MiB
/ rounded segments, ``max_split_size``, the memory fraction) or of TensorFlow's BFC
(``allocator="bfc"``: best fit by size over regions that grow by doubling, or one region of
the whole limit without growth; the limit, garbage collection), run in C with no Python and
no GIL on the path, over ``cudaMalloc``/``cudaFree`` reached in the CUDA runtime PyTorch
loaded.

PyTorch's pluggable allocator answers only ``alloc`` and ``free`` from Python (its init,
reset, fraction and record_stream hooks can be set from C++ only), and it has no
statistics or snapshot. So while installed, gpudash answers for it:
``torch.cuda.memory_stats()`` (and ``memory_allocated``, ``memory_reserved``,
``max_memory_allocated``..., which read it), ``torch.cuda.memory._snapshot()`` and
``memory_snapshot()`` (PyTorch's segment and block layout: memory_viz opens it),
``torch.cuda.empty_cache()``, ``torch.cuda.set_per_process_memory_fraction()`` and
``torch.cuda.reset_peak_memory_stats()``. :meth:`InstalledAllocator.uninstall` puts
PyTorch's functions back; the allocator itself stays for the life of the process (PyTorch
cannot swap an allocator that has allocated).

Limits, said at install too (:data:`LIMITS`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

from ._accel import extension
from ._errors import ConfigError
from .options import require_installed
from ._eventsource import bin_num_for_size
from .bfc import AllocatorStats
from .live.feeds import DeviceFeed, FeedSample
from .live.views import open_view
from .models import TORCH, model_for

__all__ = ["install", "installed", "InstalledAllocator", "LIMITS", "memory_stats_of",
           "load_hooks"]

#: What PyTorch's pluggable allocator, and so install mode, cannot do.
LIMITS = (
    "CUDA graphs: graph capture's private memory pools are not supported (PyTorch's "
    "pluggable allocator has no pool hooks from Python); torch.cuda.graphs and "
    "torch.compile(mode='reduce-overhead') fail or allocate outside the graph pool",
    "CUDA IPC: tensors cannot be shared with other processes (shareIpcHandle is not "
    "supported), so torch.multiprocessing's CUDA sharing and DataLoader workers that "
    "return CUDA tensors fail",
    "cuDNN benchmark workspace queries: with torch.backends.cudnn.benchmark=True, cuDNN "
    "asks for large trial workspaces; they come from gpudash's allocator and are cached "
    "like any block, and the out-of-memory retries PyTorch does for them are not made",
    "an out-of-memory cannot be raised as torch.OutOfMemoryError: gpudash stops the "
    "process with a message (on_oom='abort', the default) or returns a null pointer "
    "(on_oom='null')",
    "expandable_segments, garbage_collection_threshold and roundup_power2_divisions are "
    "not modelled; record_stream makes a block's free wait for the other stream",
)

#: What allocator="bfc" adds to :data:`LIMITS`.
BFC_LIMITS = (
    "allocator='bfc' does not tell streams apart (TensorFlow's BFC serves one compute "
    "stream): a block freed on one stream is reused at once by any other, so a job that "
    "allocates on side streams should call record_stream or stay on one stream",
    "allocator='bfc' takes PyTorch's words where they fit: the fraction is the BFC's memory "
    "limit, empty_cache returns wholly free regions; max_split_size_mb and the other "
    "PyTorch settings do not apply to it",
)



@dataclass(frozen=True)
class _Installable:
    """What differs between the two allocators install mode can load: its words, its
    limits beyond :data:`LIMITS`, and which options it takes."""
    title: str
    short: str
    model: str                      # the allocator model it runs (gpudash.models)
    limits: tuple = ()
    torch_settings: bool = False    # PyTorch's allocator settings (max_split_size_mb...)
    region_options: bool = False    # the BFC's allow_growth and garbage_collection
    #: settings of its model's controls it does not apply, with the reason (its limits)
    unmodelled: tuple = ()


#: install(allocator=...): the allocators the compiled core's hooks can run.
INSTALLABLE = {
    "torch": _Installable(
        "PyTorch's caching allocator", "caching allocator", "torch", torch_settings=True,
        unmodelled=(("expandable_segments",
                     "install mode does not model expandable_segments: its segments are "
                     "plain cudaMalloc ones (install mode's limits); PyTorch's own allocator "
                     "has it"),
                    ("garbage_collection_threshold",
                     "install mode does not model garbage_collection_threshold (install "
                     "mode's limits); empty cache returns the wholly free segments now"))),
    "bfc": _Installable(
        "TensorFlow's BFC allocator", "BFC", "bfc", limits=BFC_LIMITS, region_options=True,
        unmodelled=(("deferred_deletion_bytes",
                     "the BFC in install mode frees at once: PyTorch orders frees on its "
                     "stream, there is no EventMgr; deferred_deletion_bytes does not "
                     "apply"),)),
}

_PY_STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
             "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
_STAT_TYPES = ("all", "small_pool", "large_pool")
_PATCHED = ("memory_stats", "_snapshot", "memory_snapshot", "empty_cache",
            "set_per_process_memory_fraction", "get_per_process_memory_fraction",
            "reset_peak_memory_stats")
_installed: InstalledAllocator | None = None


def _core() -> Any:
    try:
        core = extension("install mode")
    except ImportError as exc:
        raise ConfigError(str(exc)) from None
    if not hasattr(core, "pluggable_setup"):
        raise ConfigError("gpudash._core was built without install mode; rebuild it "
                          "(python setup.py build_ext --inplace)")
    return core


def load_hooks() -> Any:
    """The compiled core as a ``ctypes.CDLL`` with the hooks' C signatures declared, as
    PyTorch's ``CUDAPluggableAllocator`` loads them: ``gpudash_torch_malloc(size, device,
    stream) -> void*``, ``gpudash_torch_free(ptr, size, device, stream)``,
    ``gpudash_torch_init(device_count)``, ``gpudash_torch_reset()``,
    ``gpudash_torch_memory_fraction(fraction, device)``, ``gpudash_torch_base_alloc(ptr,
    size*) -> void*`` and ``gpudash_torch_record_stream(ptr, stream)``. For driving them
    from Python over the host backend (the tests and benchmarks do)."""
    import ctypes

    lib = ctypes.CDLL(_core().__file__)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name, res, args in (
            ("gpudash_torch_malloc", vp, [sz, ctypes.c_int, vp]),
            ("gpudash_torch_free", None, [vp, sz, ctypes.c_int, vp]),
            ("gpudash_torch_init", None, [ctypes.c_int]),
            ("gpudash_torch_reset", None, []),
            ("gpudash_torch_memory_fraction", None, [ctypes.c_double, ctypes.c_int]),
            ("gpudash_torch_base_alloc", vp, [vp, ctypes.POINTER(sz)]),
            ("gpudash_torch_record_stream", None, [vp, vp])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def _cudart_path() -> str:
    """The CUDA runtime library this process loaded (PyTorch's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    raise ConfigError("cannot find the CUDA runtime (libcudart) PyTorch loaded; install mode "
                      "needs a CUDA build of PyTorch (pip's torch wheels bring one)")


def _is_initialized(torch: Any) -> bool:
    probe = getattr(torch.cuda, "is_initialized", None)
    return bool(probe()) if callable(probe) else False


def install(allocator: str = "torch", *, fraction: float | None = None,
            max_split_size_mb: int | None = None, allow_growth: bool = True,
            garbage_collection: bool = False, on_oom: str = "abort",
            quiet: bool = False, torch: Any = None, backend: str = "cuda",
            total: int | None = None) -> InstalledAllocator:
    """Run this process's PyTorch CUDA allocations on gpudash's compiled allocator.

    Call it first, before anything touches CUDA (a tensor on the GPU, ``torch.cuda.
    device_count()`` is fine, ``torch.cuda.init()`` is not).

    Parameters
    ----------
    allocator : "torch" or "bfc"
        gpudash's model of PyTorch's caching allocator, or of TensorFlow's BFC allocator
        (``gpudash.bfc.BFCAllocator``) running PyTorch's allocations.
    fraction : float, optional
        ``set_per_process_memory_fraction`` for every device, from the start. For the BFC,
        its memory limit is this share of the device's memory; without it, the memory free
        when the device is first used (TensorFlow's default).
    max_split_size_mb : int, optional
        PyTorch's ``max_split_size_mb`` (> 20); ``allocator="torch"`` only.
    allow_growth, garbage_collection : bool
        The BFC's options (``allocator="bfc"`` only): with growth (the default here;
        TensorFlow's is off) regions start at 2 MiB and double; without it the first
        allocation takes one region of the whole limit. Garbage collection returns wholly
        free regions before an allocation would fail, and extends again.
    on_oom : "abort" or "null"
        What an allocation that cannot be served does (see :data:`LIMITS`).
    quiet : bool
        Do not print the limits.
    torch, backend, total
        For tests: a stand-in ``torch``, ``backend="host"`` (host memory, ``total`` bytes
        a device) instead of the GPU.

    Returns
    -------
    InstalledAllocator

    Raises
    ------
    ConfigError
        CUDA is already initialised ("too late"), an unknown allocator or setting, install
        mode already on, or no compiled core.
    """
    global _installed
    kind = INSTALLABLE.get(allocator) if isinstance(allocator, str) else None
    if kind is None:
        raise ConfigError(f"allocator must be {' or '.join(map(repr, INSTALLABLE))}; got "
                          f"{allocator!r}")
    for name, flag in (("allow_growth", allow_growth),
                       ("garbage_collection", garbage_collection)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True or False; got {flag!r}")
    if not kind.region_options and (allow_growth is not True or garbage_collection):
        raise ConfigError("allow_growth and garbage_collection are the BFC's options "
                          "(allocator='bfc'); PyTorch's caching allocator always grows on "
                          "demand and has no region garbage collection")
    if not kind.torch_settings and max_split_size_mb is not None:
        raise ConfigError("max_split_size_mb is PyTorch's caching allocator's setting; "
                          "TensorFlow's BFC (allocator='bfc') has none: it splits a chunk "
                          "when the rest would be at least as large, or 128 MiB")
    if _installed is not None:
        raise ConfigError("gpudash's allocator is already installed in this process")
    if fraction is not None and (isinstance(fraction, bool) or not 0.0 <= float(fraction) <= 1):
        raise ConfigError(f"fraction must be a number in [0, 1]; got {fraction!r}")
    if max_split_size_mb is not None and (isinstance(max_split_size_mb, bool) or
                                          not isinstance(max_split_size_mb, int) or
                                          max_split_size_mb <= 20):
        raise ConfigError("max_split_size_mb must be an integer > 20 (PyTorch's rule); got "
                          f"{max_split_size_mb!r}")
    if torch is None:
        require_installed("torch")
        import torch
    if _is_initialized(torch):
        raise ConfigError(
            "too late: CUDA is already initialised in this process, and PyTorch cannot "
            "swap its allocator once it has allocated. Call gpudash.torch.install() first, "
            "before any tensor goes to the GPU (restart the kernel, then install, then the "
            "job)")
    core = _core()
    kw = dict(on_oom=on_oom, allocator=allocator, allow_growth=allow_growth,
              garbage_collection=garbage_collection)
    if backend == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"install mode needs a CUDA device; torch {torch.__version__} "
                              "sees none")
        core.pluggable_bind_cuda(_cudart_path())
        core.pluggable_setup("cuda", **kw)
    elif backend == "host":
        core.pluggable_setup("host", total=total or (16 << 30), **kw)
    else:
        raise ConfigError(f"backend must be 'cuda' or 'host'; got {backend!r}")
    n = int(torch.cuda.device_count()) or 1
    mss = None if max_split_size_mb is None else max_split_size_mb << 20
    for d in range(n):
        core.pluggable_settings(d, max_split_size=mss, fraction=fraction)
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(
        core.__file__, core.PLUGGABLE_SYMBOLS["alloc"], core.PLUGGABLE_SYMBOLS["free"])
    torch.cuda.memory.change_current_allocator(pluggable)
    handle = InstalledAllocator(torch, core, n, pluggable, allocator)
    handle._patch()
    _installed = handle
    if not quiet:
        warnings.warn(handle.limits_text(), stacklevel=2)
    return handle


def memory_stats_of(s: dict) -> dict[str, int]:
    """``torch.cuda.memory_stats()`` of a C core reading (``pluggable_state``): PyTorch's
    flat keys, sorted."""
    out: dict[str, int] = {}
    for name in _PY_STATS:
        flat = s["stats"][{"active": "allocation",
                           "active_bytes": "allocated_bytes"}.get(name, name)]
        for ti, tname in enumerate(_STAT_TYPES):
            cur, peak, alloc, freed = flat[4 * ti:4 * ti + 4]
            out[f"{name}.{tname}.current"] = cur
            out[f"{name}.{tname}.peak"] = peak
            out[f"{name}.{tname}.allocated"] = alloc
            out[f"{name}.{tname}.freed"] = freed
    for name in ("oversize_allocations", "oversize_segments"):
        cur, peak, alloc, freed = s[name]
        out.update({f"{name}.current": cur, f"{name}.peak": peak,
                    f"{name}.allocated": alloc, f"{name}.freed": freed})
    for name in ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                 "num_device_alloc", "num_device_free"):
        out[name] = s[name]
    out["max_split_size"] = -1 if s["max_split_size"] is None else s["max_split_size"]
    return dict(sorted(out.items()))


def segments_of(blocks: dict) -> tuple[Any, Any, Any]:
    """The segments of a C core reading's block columns (``pluggable_state(device,
    "columns")["blocks"]``, by address): each block's segment number, and each segment's
    address and size."""
    import numpy as np

    seg = np.cumsum(blocks["head"]) - 1
    starts = blocks["ptr"][blocks["head"]]
    sizes = np.bincount(seg, weights=blocks["size"], minlength=len(starts)).astype(np.int64)
    return seg, starts, sizes


class InstalledAllocator:
    """gpudash's allocator as this process's PyTorch CUDA allocator (from :func:`install`).

    Its figures are PyTorch's keys (:meth:`memory_stats`, :meth:`snapshot`); :meth:`feed`
    gives the dashboard a controllable device; :meth:`uninstall` gives PyTorch its own
    ``memory_stats``, ``_snapshot``, ``empty_cache`` and fraction functions back."""

    def __init__(self, torch: Any, core: Any, devices: int, pluggable: Any,
                 allocator: str = "torch") -> None:
        self.allocator = allocator
        self.kind = INSTALLABLE[allocator]
        self._torch = torch
        self._core = core
        self.devices = devices
        self.pluggable = pluggable
        self._saved: list[tuple[Any, str, Any]] = []
        self.installed = True

    # ------------------------------------------------------------------ figures
    def state(self, device: int = 0, blocks: str | None = "rows") -> dict:
        """The C core's reading of a device (statistics, counters, blocks, OOMs); ``blocks``
        as ``gpudash._core.pluggable_state`` takes it (``"rows"``, ``"columns"``, or None
        for the figures alone)."""
        return self._core.pluggable_state(self._device(device), blocks)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: PyTorch's flat keys, sorted."""
        return memory_stats_of(self.state(self._device(device), None))

    def segments(self, device: int = 0) -> list[dict]:
        """The segments as ``torch.cuda.memory_snapshot()`` lists them, by address."""
        out: list[dict] = []
        seg: dict | None = None
        for ptr, size, req, stream, pool, allocated, head, _aid in \
                self.state(device)["blocks"]:
            if head or seg is None:
                seg = {"device": device, "address": ptr, "total_size": 0,
                       "allocated_size": 0, "active_size": 0, "requested_size": 0,
                       "stream": stream, "segment_type": "small" if pool == 0 else "large",
                       "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                       "blocks": []}
                out.append(seg)
            seg["blocks"].append({"address": ptr, "size": size, "requested_size": req,
                                  "state": "active_allocated" if allocated else "inactive",
                                  "frames": []})
            seg["total_size"] += size
            if allocated:
                seg["allocated_size"] += size
                seg["active_size"] += size
                seg["requested_size"] += req
        return out

    def snapshot(self, mempool_id: Any = None) -> dict:
        """``torch.cuda.memory._snapshot()``: segments of every device, no traces (install
        mode keeps no history), the settings; memory_viz opens it."""
        segs = [s for d in range(self.devices) for s in self.segments(d)]
        s0 = self.state(0, None)
        settings = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": s0["max_split_size"]
                    if s0["max_split_size"] is not None else -1,
                    "garbage_collection_threshold": 0.0, "expandable_segments": False,
                    "allocator": "gpudash install mode"}
        if s0["bfc"] is not None:
            b = s0["bfc"]
            settings.update(allocator="gpudash install mode (TensorFlow's BFC)",
                            memory_limit=b["memory_limit"], allow_growth=b["allow_growth"],
                            garbage_collection=b["garbage_collection"])
        return {"segments": segs, "device_traces": [[] for _ in range(self.devices)],
                "allocator_settings": settings, "external_annotations": []}

    # ------------------------------------------------------------------ controls
    def empty_cache(self, device: int = -1) -> int:
        """``torch.cuda.empty_cache()``: whole free segments back; the bytes returned."""
        return self._core.pluggable_empty_cache(device)

    def set_fraction(self, fraction: float, device: Any = None) -> None:
        """``torch.cuda.set_per_process_memory_fraction``: live."""
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or \
                not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"fraction must be a number in [0, 1]; got {fraction!r}")
        self._settings(self._device(device), fraction=float(fraction))

    def set_allocator_settings(self, conf: str, device: Any = None) -> None:
        """PyTorch's settings string, live, with PyTorch's rule that what it leaves out
        returns to its default: ``max_split_size_mb`` and ``max_non_split_rounding_mb``
        are applied; the others install mode does not model are refused. The BFC
        (``allocator="bfc"``) has none of PyTorch's settings: any is refused (an empty
        string changes nothing)."""
        if not self.kind.torch_settings:
            parts = [p.strip() for p in str(conf).split(",") if p.strip()]
            if parts:
                raise ConfigError(
                    f"install mode's BFC (allocator='bfc') cannot apply {parts[0]!r}: "
                    "PyTorch's allocator settings do not apply to TensorFlow's BFC; its "
                    "settings are the limit (set_per_process_memory_fraction or "
                    "set_memory_limit) and growth (set_allow_growth)")
            return
        mss = None
        tol = 20 << 20
        for part in filter(None, (p.strip() for p in str(conf).split(","))):
            key, sep, value = part.partition(":")
            key = key.strip()
            if not sep:
                raise ConfigError(f"allocator setting {part!r} is not key:value")
            try:
                number = int(value)
            except ValueError:
                number = None
            if key == "max_split_size_mb" and number is not None and number > 20:
                mss = number << 20
            elif key == "max_non_split_rounding_mb" and number is not None and number >= 0:
                tol = number << 20
            else:
                raise ConfigError(
                    f"install mode cannot apply {part!r}: it models max_split_size_mb (> 20) "
                    "and max_non_split_rounding_mb only")
        for d in self._devices(device):   # what PyTorch would take live and later pay for
            TORCH.check_live_split(self._table(d), self.state(d, None)["max_split_size"], mss,
                                   f"cuda:{d}", " (here gpudash's own allocator would free it)")
        for d in self._devices(device):
            self._core.pluggable_settings(d, max_split_size=mss,
                                          max_non_split_rounding_size=tol)

    def _table(self, device: int) -> dict:
        """The blocks' segments as a chunk table has them (``region``, ``regions``)."""
        import numpy as np

        seg, starts, sizes = segments_of(self.state(device, "columns")["blocks"])
        return {"region": starts[seg], "regions": np.stack([starts, sizes], axis=1)}

    def set_memory_limit(self, nbytes: int, device: Any = None) -> None:
        """The BFC's memory limit in bytes, live (``allocator="bfc"``): raising it lets
        later regions grow further; lowering it returns wholly free regions, largest first,
        until the pool fits, and while the pool stays above the limit, allocations that
        would take bytes in use past it are refused and regions go back as they empty
        (``gpudash.bfc.BFCAllocator.set_memory_limit``)."""
        self._require_bfc("set_memory_limit")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ConfigError(f"memory limit must be an integer number of bytes >= 0; got "
                              f"{nbytes!r}")
        for d in self._devices(device):
            self._core.pluggable_settings(d, memory_limit=nbytes)

    def set_allow_growth(self, allow_growth: bool, device: Any = None) -> None:
        """The BFC's growth, live (``allocator="bfc"``): on, the next regions start again at
        2 MiB and double; off, the next region is everything the limit leaves."""
        self._require_bfc("set_allow_growth")
        if not isinstance(allow_growth, bool):
            raise ConfigError(f"allow_growth must be True or False; got {allow_growth!r}")
        for d in self._devices(device):
            self._core.pluggable_settings(d, allow_growth=allow_growth)

    def pending_release(self, device: Any = None) -> tuple[int, int]:
        """``(bytes, regions)``: how far the BFC's pool is above a limit lowered live, and
        the regions still holding memory in use (each goes back as it empties); ``(0, 0)``
        when the pool fits, and always for ``allocator="torch"``."""
        import numpy as np

        device = self._device(device)
        s = self.state(device, None)
        if s["bfc"] is None or s["reserved"] <= s["bfc"]["memory_limit"]:
            return 0, 0
        s = self.state(device, "columns")       # the regions, read with the figures
        excess = s["reserved"] - s["bfc"]["memory_limit"]
        if excess <= 0:
            return 0, 0
        seg = segments_of(s["blocks"])[0]
        return excess, int(len(np.unique(seg[s["blocks"]["allocated"]])))

    def fraction(self, device: Any = None) -> float:
        """``torch.cuda.get_per_process_memory_fraction``: the fraction set, else 1.0 (the
        BFC: its limit over the device's memory)."""
        s = self.state(self._device(device), None)
        if s["fraction"] is not None:
            return s["fraction"]
        if s["bfc"] is not None and s["total"]:
            return s["bfc"]["memory_limit"] / s["total"]
        return 1.0

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._core.pluggable_reset_peaks(self._device(device))

    def feed(self, device: int = 0) -> Any:
        """A controllable :class:`~gpudash.live.feeds.DeviceFeed` of a device
        (``InstallFeed``), in the installed allocator's words and controls."""
        return _feed_class()(self, self._device(device))

    def dashboard(self, **options: Any) -> Any:
        """The live dashboard of every device (one feed each, a device picker): the chunk
        map, heatmap and timeline of the installed allocator, and its controls acting on it
        live (the fraction, ``max_split_size_mb`` or the BFC's growth, empty cache), each
        answering in its framework's words. *options* go to the dashboard (``device``,
        ``rate_hz``, ``views``...). ``%gpudash --attach torch`` opens it while install
        mode is on. The views register the dashboard (:mod:`gpudash.live.views`)."""
        if not self.installed:
            raise ConfigError("install mode's functions were given back to PyTorch "
                              "(uninstall()); its allocator still runs, but the dashboard "
                              "follows an installed one")
        feeds = [self.feed(d) for d in range(max(self.devices, 1))]
        return open_view("dashboard", None, feeds=feeds, **options)

    def limits_text(self) -> str:
        limits = LIMITS + self.kind.limits
        return (f"gpudash's allocator ({self.kind.title}, compiled) is installed for PyTorch's CUDA "
                "memory. Limits: "
                + "; ".join(f"({i}) {text}" for i, text in enumerate(limits, 1)))

    # ------------------------------------------------------------------ internals
    def _require_bfc(self, what: str) -> None:
        if not self.kind.region_options:
            raise ConfigError(f"{what}() is the BFC's (install(allocator='bfc')); PyTorch's "
                              "caching allocator takes set_per_process_memory_fraction")

    def _settings(self, device: int, **kw: Any) -> None:
        s = self.state(device, None)
        self._core.pluggable_settings(device, max_split_size=s["max_split_size"],
                                      max_non_split_rounding_size=s[
                                          "max_non_split_rounding_size"], **kw)

    def _device(self, device: Any) -> int:
        if device is None:
            return 0
        index = getattr(device, "index", device)
        if index is None:
            return 0
        if isinstance(device, str):
            index = int(device.rpartition(":")[2] or 0)
        if isinstance(index, bool) or not isinstance(index, int) or \
                not 0 <= index < max(self.devices, 1):
            raise ConfigError(f"no CUDA device {device!r} (install mode sees "
                              f"{self.devices})")
        return index

    def _devices(self, device: Any) -> list[int]:
        return list(range(self.devices)) if device is None else [self._device(device)]

    def _patch(self) -> None:
        torch = self._torch
        mine = {
            "memory_stats": lambda device=None: self.memory_stats(device),
            "_snapshot": lambda mempool_id=None, *a, **k: self.snapshot(mempool_id),
            "memory_snapshot": lambda mempool_id=None, *a, **k: self.snapshot()["segments"],
            "empty_cache": lambda: self.empty_cache(),
            "set_per_process_memory_fraction":
                lambda fraction, device=None: self.set_fraction(fraction, device),
            "get_per_process_memory_fraction": lambda device=None: self.fraction(device),
            "reset_peak_memory_stats":
                lambda device=None: self.reset_peak_memory_stats(device),
        }
        for space in (torch.cuda, getattr(torch.cuda, "memory", None)):
            if space is None:
                continue
            for name in _PATCHED:
                self._saved.append((space, name, space.__dict__.get(name, _MISSING)
                                    if hasattr(space, "__dict__") else getattr(space, name)))
                setattr(space, name, mine[name])

    def uninstall(self) -> None:
        """PyTorch's own functions back (``memory_stats``, ``_snapshot``, ``empty_cache``,
        the fraction, the peaks). The allocator stays: PyTorch cannot swap one that has
        allocated, so the job's memory still comes from gpudash until the process ends."""
        global _installed
        for space, name, old in reversed(self._saved):
            if old is _MISSING:
                try:
                    delattr(space, name)
                except AttributeError:
                    pass
            else:
                setattr(space, name, old)
        self._saved.clear()
        self.installed = False
        if _installed is self:
            _installed = None

    def __repr__(self) -> str:
        s = self.state(0, None)
        return (f"InstalledAllocator(allocator={self.allocator!r}, devices={self.devices}, "
                f"reserved={s['reserved']}, "
                f"allocated={s['stats']['allocated_bytes'][0]}, installed={self.installed})")


_MISSING = object()


def installed() -> InstalledAllocator | None:
    """The allocator :func:`install` put in place, or None."""
    return _installed


def _reset_for_tests() -> None:
    global _installed
    if _installed is not None:
        _installed.uninstall()
    _installed = None


# ------------------------------------------------------------------------------ the feed
def _make_feed_class() -> type:
    class InstallFeed(DeviceFeed):
        """One device of the installed allocator, for a live model: samples from the C
        core's counters and blocks, controls that act on the real allocator, as a CuPy
        session routed through ``sess.install()``: the fraction live and ``empty_cache``;
        with ``allocator="bfc"`` the fraction is the BFC's memory limit, growth switches
        live, and a limit lowered below the pool says what waits to be returned."""

        kind = "torch"
        controls = None

        def __init__(self, owner: InstalledAllocator, device: int) -> None:
            self._owner = owner
            self.device = device
            self.model = model_for(owner.kind.model)
            self.name = f"cuda:{device} (gpudash installed, {owner.kind.short})"
            s = owner.state(device, None)
            self.capacity = s["total"]
            self._seen = (s["allocs"], s["frees"], s["oom_count"])
            self._settings_log: list = []

        def sample(self) -> Any:
            import numpy as np

            s = self._owner.state(self.device, "columns")
            bfc = s["bfc"]
            allocs, frees, ooms = self._seen
            new_ooms = tuple((t, r, q) for t, r, q in s["ooms"][-(s["oom_count"] - ooms):]
                             ) if s["oom_count"] > ooms else ()
            self._seen = (s["allocs"], s["frees"], s["oom_count"])
            b = s["blocks"]
            ptr, size, used = b["ptr"], b["size"], b["allocated"]
            seg_id, starts, seg_sizes = segments_of(b)
            free_sizes = size[~used]
            in_use = int(s["stats"]["allocated_bytes"][0])
            free = s["reserved"] - in_use
            largest = int(free_sizes.max()) if len(free_sizes) else 0
            if bfc is not None:
                limit = bfc["memory_limit"]
                num_allocs, largest_alloc = bfc["num_allocs"], bfc["largest_alloc_size"]
                bins = np.full(len(ptr), -1, dtype=np.int8)
                bins[~used] = [bin_num_for_size(int(n)) for n in free_sizes]
            else:
                limit = s["allowed"] if s["allowed"] is not None else s["total"]
                num_allocs, largest_alloc = int(s["stats"]["allocation"][2]), 0
                bins = b["pool"]
            stats = AllocatorStats(
                num_allocs=num_allocs, bytes_in_use=in_use,
                peak_bytes_in_use=int(s["stats"]["allocated_bytes"][1]),
                largest_alloc_size=largest_alloc, bytes_limit=limit,
                pool_bytes=s["reserved"], peak_pool_bytes=s["peak_reserved"],
                largest_free_block_bytes=largest,
                fragmentation=(free - largest) / free if free > 0 else 0.0)
            table = {"ptr": ptr, "size": size,
                     "requested": np.where(used, b["requested"], 0),
                     "alloc_id": b["aid"], "bin": bins, "region": starts[seg_id],
                     "in_use": used, "expandable": np.zeros(len(ptr), dtype=bool),
                     "regions": np.stack([starts, seg_sizes], axis=1)}
            settings, self._settings_log = tuple(self._settings_log), []
            return FeedSample(time_ms=time.time() * 1000.0, stats=stats, table=table,
                              allocs=s["allocs"] - allocs, frees=s["frees"] - frees,
                              events=(s["allocs"] - allocs) + (s["frees"] - frees),
                              ooms=new_ooms, settings=settings,
                              extra={"reserved": s["reserved"],
                                     "stream_waits": s["stream_waits"]})

        def settings(self) -> dict:
            s = self._owner.state(self.device, None)
            if s["bfc"] is not None:
                return {"fraction": self._owner.fraction(self.device),
                        "allow_growth": s["bfc"]["allow_growth"],
                        "deferred_deletion_bytes": None, "limit": s["bfc"]["memory_limit"],
                        "total": s["total"] or None}
            mss = s["max_split_size"]
            return {"fraction": s["fraction"], "allow_growth": None,
                    "deferred_deletion_bytes": None, "limit": s["allowed"] or s["total"],
                    "total": s["total"] or None, "expandable_segments": False,
                    "max_split_size_mb": None if mss is None else mss >> 20,
                    "max_non_split_rounding_mb": s["max_non_split_rounding_size"] >> 20,
                    "garbage_collection_threshold": 0.0, "conf": self._conf(s)}

        @staticmethod
        def _conf(s: dict, max_split: Any = False) -> str:
            """PyTorch's whole settings string for what install mode applies (its
            ``_set_allocator_settings`` resets what a string leaves out)."""
            mss = s["max_split_size"] >> 20 if s["max_split_size"] is not None else None
            mss = mss if max_split is False else max_split
            tol = s["max_non_split_rounding_size"] >> 20
            parts = ([f"max_split_size_mb:{mss}"] if mss is not None else []) + \
                ([f"max_non_split_rounding_mb:{tol}"] if tol != 20 else [])
            return ",".join(parts)

        def unavailable(self) -> dict[str, str]:
            """The controls install mode cannot apply, by name, with the reason."""
            reasons = dict(self._owner.kind.unmodelled)
            return {c.name: reasons[c.setting] for c in self.model.controls
                    if c.setting in reasons}

        def figures(self) -> dict:
            """The installed allocator's ``memory_stats()`` figures its model's answers
            use (PyTorch's keys), and its segment count."""
            owner, device = self._owner, self.device
            stats = self.model.figures(_Stats(lambda: owner.memory_stats(device)))
            segments = owner.state(device, None)["stats"]["segment"][0]
            return {**stats, "regions": int(segments)}

        def pending_release(self) -> tuple[int, int]:
            """``(bytes, regions)`` above a BFC limit lowered live (the dashboard's
            warning); ``(0, 0)`` for PyTorch's caching allocator."""
            return self._owner.pending_release(self.device)

        def configure(self, **changes: Any) -> None:
            """The settings of the installed allocator's model's controls (PyTorch's or
            TensorFlow's names), checked by that model, all or none; each applied live to
            the C allocator, or refused saying why where install mode cannot apply it."""
            model, owner, device = self.model, self._owner, self.device
            known = [c.setting for c in model.controls if c.setting]
            for name, value in changes.items():
                model.check_setting(name, value)    # the model's words first
            unknown = sorted(set(changes) - set(known))
            if unknown:
                raise ConfigError(f"unknown setting(s) {unknown} for {model.title}; its "
                                  f"live settings: {', '.join(known)}")
            bfc = owner.kind.region_options
            growth = changes.get("allow_growth")
            reasons = dict(owner.kind.unmodelled)
            for setting, value in changes.items():
                if value not in (None, 0, 0.0, False) and setting in reasons:
                    raise ConfigError(reasons[setting])
            now = time.time_ns()
            s = owner.state(device, None)
            frac = changes.get("per_process_gpu_memory_fraction")
            if "max_split_size_mb" in changes:
                old = self.settings()["max_split_size_mb"]
                owner.set_allocator_settings(self._conf(s, changes["max_split_size_mb"]),
                                             device)
                self._settings_log.append((now, "max_split_size_mb", old,
                                           changes["max_split_size_mb"]))
            if frac is not None:
                old = owner.fraction(device) if bfc else s["fraction"]
                owner.set_fraction(frac, device)
                self._settings_log.append((now, "fraction", old, float(frac)))
            if bfc and growth is not None:
                old = s["bfc"]["allow_growth"]
                owner.set_allow_growth(growth, device)
                self._settings_log.append((now, "allow_growth", old, growth))

        def release_free_regions(self) -> int:
            return self._owner.empty_cache(self.device)

        def flush_deferred(self) -> int:
            return 0

    return InstallFeed


class _Stats:
    """What a model's ``figures()`` reads of an allocator: its ``memory_stats()``."""

    def __init__(self, memory_stats: Any) -> None:
        self.memory_stats = memory_stats


_FEED: list = []


def _feed_class() -> type:
    if not _FEED:
        _FEED.append(_make_feed_class())
    return _FEED[0]


def __getattr__(name: str) -> Any:
    # InstallFeed is made on first use: the live layer is imported only then
    if name == "InstallFeed":
        return _feed_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
