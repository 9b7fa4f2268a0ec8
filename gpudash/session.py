"""Sessions: TensorFlow's ``ConfigProto``/``GPUOptions`` over gpudash's BFC allocators.

A :class:`Session` gives each visible device its own :class:`~gpudash.BFCAllocator` (named
like TensorFlow's, ``GPU_0_bfc``), with the memory limit TensorFlow would compute, and, unlike
TensorFlow, lets the fraction, growth and deferred-deletion settings change while it runs
(:meth:`Session.configure`).

Frees go through deferred deletion, TensorFlow's ``EventMgr`` model: freed blocks wait in a
per-device queue until their bytes reach ``deferred_deletion_bytes``; the queue is then
flushed as one batch that reaches the allocator once the device reports the work done (a CUDA
event recorded on the stream at flush time; on simulated devices at the next poll). A batch
is also flushed when an allocation would otherwise fail (flush, then retry). One background
thread per session polls every ``polling_active_delay_usecs`` while batches are in flight and
every ``polling_inactive_delay_msecs`` otherwise.

Threading: every allocator has its own lock; the session's lock guards the deferred queues
and makes :meth:`Session.configure` atomic with respect to other configure calls.

Where the compiled core (:mod:`gpudash._core`) is built, :meth:`Session.allocate` and
:meth:`Session.free` run in C for their common case (an open session of this class on the
compiled BFC allocator, no labels or recorded stacks, no placement log; for ``free`` one
device and an int address): the same steps, under the same lock. Every other case, every
error, and every subclass (:class:`TorchSession` among them) runs the Python methods, which
stay the reference (:data:`PY_SESSION_METHODS`; ``GPUDASH_PURE_PYTHON=1`` runs only them).
The session's lock is then the core's reentrant lock, and the set of queued addresses the
core's set of ints.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np

from ._accel import twin
from ._cells import display_name
from ._errors import (
    BackendUnavailableError,
    ConfigError,
    GpudashWarning,
    InvalidPointerError,
    warn_user,
)
from ._units import format_bytes, parse_bytes
from .bfc import AllocatorStats, BFCAllocator
from .devices import CudaMemory, HostMemory, SimulatedDevice, cuda_device_count
from .models import TORCH, AllocatorModel, model_for, model_of
from .options import (
    ConfigProto,
    GPUOptions,
    allow_growth_from_env,
    check_framework,
    garbage_collection_from_env,
    jax_memory_limit,
    jax_settings_from_env,
    memory_limit,
    resolve_visible_devices,
    simulated_devices_from_env,
)
from ._torch_conf import CachingAllocatorConfig
from .caching import CachingAllocator

__all__ = ["Session", "TorchSession", "Device", "TorchDevice", "CudaMallocAllocator",
           "DEFAULT_SIMULATED_BYTES", "default_session", "set_default_session"]

logger = logging.getLogger("gpudash")

#: Capacity of the simulated device used when no GPU is present and nothing else is asked.
DEFAULT_SIMULATED_BYTES = 16 << 30
#: TensorFlow's host BFC limit (``1 << 17`` MB).
HOST_BFC_LIMIT = (1 << 17) << 20

_said_once: set[str] = set()


def _say_once(key: str, message: str) -> None:
    """Log a notice once per process (the simulated-device fallback, for example)."""
    if key not in _said_once:
        _said_once.add(key)
        logger.warning(message)


class CudaMallocAllocator(BFCAllocator):
    """``allocator_type="cuda_malloc"``: no pooling, for comparison.

    Every allocation is a region of exactly its rounded size, asked of the sub-allocator at
    once and returned to it at free, like TensorFlow's ``GPUcudaMallocAllocator``. It keeps
    the BFC allocator's interface (stats, snapshots, events), so views work unchanged.
    """

    def _extend(self, rounded: int) -> bool:
        available = self._limit - self._pool
        if rounded > available:
            return False
        ptr = self._sub_alloc(rounded)
        if ptr is None:
            return False
        self._add_region(ptr, rounded, rounded)
        return True

    def preallocate(self) -> int:
        """Nothing to preallocate: this allocator holds no pool."""
        return 0

    def deallocate(self, ptr: int) -> None:
        super().deallocate(ptr)
        if not ptr:
            return
        with self._lock:
            region = self._region_for(ptr)
            if region is not None and region.first.aid < 0 and region.first.next is None:
                journal = self._journal
                start = len(journal) if journal is not None else 0
                self._deallocate_regions([region])
                if journal is not None:
                    self._after_op(start)


#: The set of queued addresses: where gpudash._core is built, its ``AddressSet`` (a set of
#: ints in a C hash table; a block address's low bits are all zero, which a Python set
#: hashes poorly), else a set.
_AddressSet = twin("AddressSet", set)


@dataclass(slots=True)
class _Deferred:
    """One device's deferred-deletion queue (TensorFlow's EventMgr, per stream)."""

    threshold: int
    pending: list = field(default_factory=list)  # pointers freed, not yet flushed
    queued: set = field(default_factory=_AddressSet)  # every pointer pending or in flight
    pending_bytes: int = 0
    inflight: deque = field(default_factory=deque)  # (marker, [ptrs], bytes)
    flushes: int = 0
    completed_bytes: int = 0


#: The session's lock: where gpudash._core is built, its reentrant lock (GIL-guarded, usable
#: by threading.Condition), else threading.RLock.
_SessionLock = twin("RLock", threading.RLock)


class Device:
    """One gpudash device of a session: backend, allocator, limit and deferred frees.

    Attributes
    ----------
    index : int
        gpudash's id (``/device:GPU:<index>``).
    visible_id : int
        The id among visible devices that it maps to (``visible_device_list``).
    backend : SimulatedDevice or CudaMemory
        The sub-allocator under the BFC allocator.
    allocator : BFCAllocator
        The device's allocator, named ``GPU_<index>_bfc``.
    total, available : int
        Device memory and free memory when the session started.
    options : GPUOptions
        The settings now in force on this device.
    """

    # slots: what Session.allocate and Session.free read (the compiled core's fast paths
    # read them by offset)
    __slots__ = ("allocator", "_deferred", "__dict__", "__weakref__")

    def __init__(self, index: int, visible_id: int, backend: Any, allocator: BFCAllocator,
                 total: int, available: int, cc_major: int, options: GPUOptions,
                 deferred_threshold: int) -> None:
        self.index = index
        self.visible_id = visible_id
        self.backend = backend
        self.allocator = allocator
        self.total = total
        self.available = available
        self.cc_major = cc_major
        self.options = options
        self._deferred = _Deferred(threshold=deferred_threshold)
        # live block -> (label, stack id): Session.label's innermost label ("" for none) and
        # the id of its allocating stack in Session.stacks (-1 for none)
        self._holders: dict[int, tuple[str, int]] = {}

    @property
    def name(self) -> str:
        return f"/device:GPU:{self.index}"

    @property
    def kind(self) -> str:
        """``"simulated"`` or ``"cuda"``."""
        return getattr(self.backend, "kind", "simulated")

    @property
    def memory_limit(self) -> int:
        return self.allocator.memory_limit

    @property
    def over_limit(self) -> bool:
        """True while memory in use exceeds the limit (after the fraction was lowered)."""
        return self.allocator.over_limit

    @property
    def deferred_bytes(self) -> int:
        """Bytes freed but not yet returned to the allocator (queued or in flight)."""
        d = self._deferred
        return d.pending_bytes + sum(b for _, _, b in d.inflight)

    @property
    def model(self) -> AllocatorModel:
        """The allocator's model (:data:`gpudash.models.BFC` or ``TORCH``)."""
        return model_of(self.allocator)

    def settings(self) -> dict[str, Any]:
        """The settings in force, by the names of the model's controls: ``fraction``,
        ``allow_growth``, ``deferred_deletion_bytes`` (effective), ``limit`` and ``total``
        bytes."""
        opts = self.options
        return {"limit": self.allocator.memory_limit, "total": self.total,
                "allow_growth": self.allocator.allow_growth,
                "fraction": opts.per_process_gpu_memory_fraction,
                "deferred_deletion_bytes": opts.effective_deferred_deletion_bytes}

    def settings_text(self) -> str:
        """The settings in force, in one line (``%gpudash_config``)."""
        fraction = self.options.per_process_gpu_memory_fraction
        return (f"{self.name} fraction={fraction:g}{' (auto)' if not fraction else ''}"
                f", limit {format_bytes(self.memory_limit)}, "
                f"allow_growth={self.allocator.allow_growth}, "
                f"deferred_deletion_bytes={format_bytes(self._deferred.threshold)}")

    def stats(self) -> AllocatorStats:
        return self.allocator.stats()

    def __repr__(self) -> str:
        return (f"Device({self.name}, {self.kind}, total={format_bytes(self.total)}, "
                f"limit={format_bytes(self.memory_limit)}, allocator={self.allocator.name!r})")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

#: Frames a session keeps of each allocating stack (``record_stacks=True``), innermost first.
STACK_DEPTH = 32


class SessionStacks:
    """The allocating call stacks of a session's blocks, interned (``record_stacks=True``).

    Each distinct frame ``(filename, line, function)`` is kept once in :attr:`frames`, each
    distinct stack once in :attr:`stacks` (a tuple of frame ids, innermost first: the
    caller's frames, gpudash's own left out wherever they are, at most :attr:`depth` of
    them); a live block keeps
    the id of its stack (an index into :attr:`stacks`). The ids are those of a
    :class:`gpudash.formats.stacks.StackTable` made from the two lists in order
    (``StackTable(frames, [(ids, "", "") for ids in stacks])``), which is how the Recorder
    and the live views read them: the session layer keeps plain lists and imports nothing
    from the trace layer above it.

    Both lists only grow, so a reader may take ``len()`` of one and read that prefix
    without a lock; new entries are added under a lock (lookups take none).

    Cost: a frame met before is one dictionary lookup by its code object and instruction
    (the code objects seen are kept, so their ids stay theirs); Python's frames are walked
    one by one, so a stack costs about a quarter of a microsecond a frame
    (``benchmarks/bench_dashboard.py`` (f)).

    Attributes
    ----------
    frames : list of (str, int, str)
    stacks : list of tuple of int
    depth : int
    """

    __slots__ = ("frames", "stacks", "depth", "_frame_ids", "_stack_ids", "_sites", "_codes",
                 "_lock")

    def __init__(self, depth: int = STACK_DEPTH) -> None:
        self.frames: list[tuple[str, int, str]] = []
        self.stacks: list[tuple[int, ...]] = []
        self.depth = int(depth)
        self._frame_ids: dict[tuple[str, int, str], int] = {}
        self._stack_ids: dict[tuple[int, ...], int] = {}
        # (id of a code object, instruction offset) -> frame id (-1: gpudash's own): a frame
        # met again costs a lookup, not a line number (which Python finds by scanning the
        # code's line table) and a new tuple; the code objects are kept, so an id stays theirs
        self._sites: dict[tuple[int, int], int] = {}
        self._codes: dict[int, Any] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.stacks)

    def __repr__(self) -> str:
        return f"SessionStacks(frames={len(self.frames)}, stacks={len(self.stacks)})"

    def capture(self) -> int:
        """The id of the calling thread's stack, gpudash's own frames left out (-1: none)."""
        f = sys._getframe(1)
        get = self._sites.get
        ids = []
        append = ids.append
        left = self.depth
        while f is not None and left:
            code = f.f_code
            i = get((id(code), f.f_lasti))
            if i is None:
                i = self._site(f)
            if i >= 0:
                append(i)
                left -= 1
            f = f.f_back
        if not ids:
            return -1
        key = tuple(ids)
        i = self._stack_ids.get(key)
        if i is None:
            i = self._new(self._stack_ids, self.stacks, key)
        return i

    def _site(self, f: Any) -> int:
        """The frame id of a frame's code and instruction, met for the first time (-1 for
        gpudash's own frames, a magic's too, which stacks leave out)."""
        code = f.f_code
        filename = code.co_filename
        if filename.startswith(_PACKAGE_DIR):
            i = -1
        else:
            key = (filename, f.f_lineno, code.co_name)
            i = self._frame_ids.get(key)
            if i is None:
                i = self._new(self._frame_ids, self.frames, key)
        with self._lock:
            self._codes[id(code)] = code
            self._sites[(id(code), f.f_lasti)] = i
        return i

    def _new(self, index: dict, table: list, key: Any) -> int:
        with self._lock:
            i = index.get(key)
            if i is None:
                # the list first: a reader that finds the id in the dict finds its entry
                table.append(key)
                i = index[key] = len(table) - 1
            return i

    def where(self, stack_id: int) -> str:
        """``file.py:LINE function`` of a stack's innermost frame ("" for -1)."""
        if stack_id < 0:
            return ""
        filename, line, name = self.frames[self.stacks[stack_id][0]]
        return f"{display_name(filename)}:{line} {name}"


def _null_or_bug(ptr: Any, what: str) -> None:
    """A falsy address: 0 (nullptr) is a no-op, as in TensorFlow; None, False, "", {} are
    a caller's bug and raise."""
    if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)):
        raise InvalidPointerError(f"{what}() expects an int address; got {ptr!r}")


class _Release:
    """Owner object handed to CuPy: when CuPy drops the memory, the block is freed (through
    deferred deletion) on the session that gave it."""

    __slots__ = ("session", "ptr", "device", "__weakref__")

    def __init__(self, session: "Session", ptr: int, device: int) -> None:
        self.session = weakref.ref(session)
        self.ptr = ptr
        self.device = device

    def __del__(self) -> None:
        sess = self.session()
        if sess is not None and not sess.closed and self.ptr:
            try:
                sess.free(self.ptr, device=self.device)
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass


def _parse_device(device: Any, n: int) -> int:
    if device is None:
        return 0
    if isinstance(device, Device):
        return device.index
    if isinstance(device, str):
        text = device.strip().lower().rsplit(":", 1)
        try:
            device = int(text[-1])
        except ValueError:
            raise ConfigError(
                f"device must be an index or a name like 'GPU:0' or '/device:GPU:0'; "
                f"got {device!r}") from None
    if isinstance(device, bool) or not isinstance(device, int):
        raise ConfigError(f"device must be an integer index; got {device!r}")
    if not 0 <= device < n:
        raise ConfigError(f"device {device} does not exist: this session has {n} device(s) "
                          f"(0..{n - 1})")
    return device


def _simulate_sizes(simulate: Any) -> list[int]:
    """``simulate=`` argument: True, a size, a count x size string, or a list of sizes."""
    if simulate is True:
        return [DEFAULT_SIMULATED_BYTES]
    if isinstance(simulate, (list, tuple)):
        return [parse_bytes(s, name="a simulated device size") for s in simulate]
    if isinstance(simulate, str) and "x" in simulate.lower().replace("0x", ""):
        sizes = simulated_devices_from_env({"GPUDASH_SIMULATE": simulate})
        return sizes or [DEFAULT_SIMULATED_BYTES]
    return [parse_bytes(simulate, name="the simulated device size")]


class PySession:
    """A set of devices, each with its own BFC allocator, configured like TensorFlow.

    Parameters
    ----------
    config : ConfigProto, GPUOptions, dict or TensorFlow ConfigProto, optional
        The options. A ``GPUOptions`` (or a dict of its fields) is taken as
        ``ConfigProto(gpu_options=...)``.
    simulate : bool, int, str or list, optional
        Run on simulated devices: ``True`` (one of 16 GiB), a size (``"8GiB"``), a count and
        size (``"2x16GiB"``) or a list of sizes. Default: ``GPUDASH_SIMULATE`` if set, else
        real GPUs when CUDA is usable, else one simulated 16 GiB device (see Notes).
    environ : mapping, optional
        Environment to read (default ``os.environ``): ``TF_FORCE_GPU_ALLOW_GROWTH``,
        ``TF_ENABLE_GPU_GARBAGE_COLLECTION``, ``GPUDASH_SIMULATE``, ``CUDA_VISIBLE_DEVICES``
        (applied by CUDA itself to real devices).
    poll : bool
        Start the deferred-deletion polling thread (default True). It returns batches of
        frees once their CUDA event has completed; a simulated device's batch has nothing to
        wait for and is returned by the free that completes it. With ``poll=False`` batches
        wait for :meth:`poll` or :meth:`flush` (deterministic, for tests).
    record_stacks : bool
        Keep the allocating Python stack of each live block: the caller's frames (gpudash's
        own left out), innermost first, at most :data:`STACK_DEPTH`, interned once per
        session (:attr:`stacks`, :class:`SessionStacks`). The chunk map's hover and
        :meth:`holders` name a block by its innermost frame; :meth:`stack_of` gives the
        frames; the dashboard's holders view and a :class:`~gpudash.Recorder` attached to
        the session (its trace's ``stack`` column) use the whole stack.
    allocator : {"bfc", "torch"}, optional
        ``"torch"`` (or ``"pytorch"``) makes a :class:`TorchSession`: PyTorch's caching
        allocator on each device, configured from ``PYTORCH_CUDA_ALLOC_CONF`` (``config`` is
        then that string; see :class:`TorchSession`). Default: TensorFlow's BFC.

    Notes
    -----
    Without a usable GPU: with no ``config`` the session falls back to a simulated device
    and says so once (a ``gpudash`` logger warning). With a ``config`` whose
    ``allow_soft_placement`` is True it does the same; with ``allow_soft_placement=False``
    it raises :class:`~gpudash.ConfigError` saying how to use a simulated device.

    Examples
    --------
    >>> import gpudash
    >>> config = gpudash.ConfigProto(allow_soft_placement=True)
    >>> config.gpu_options.per_process_gpu_memory_fraction = 0.5
    >>> with gpudash.Session(config=config, simulate="16GiB") as sess:
    ...     p = sess.allocate(1 << 20)
    ...     sess.devices[0].memory_limit
    8589934592
    """

    # slots: what allocate and free read (the compiled core's fast paths read them by offset)
    __slots__ = ("devices", "_lock", "_closed", "_track_holders", "_log_placement", "__dict__",
                 "__weakref__")

    def __new__(cls, *args: Any, allocator: Any = None, **kwargs: Any) -> "Session":
        # Session(..., allocator="torch") is a TorchSession: the session class of the model
        if cls is Session and allocator is not None:
            cls = Session.class_for(allocator)
        return super().__new__(cls)

    #: The session class of each model that has its own (a subclass names its ``model``).
    _BY_MODEL: dict[str, type] = {}
    #: Whether its ``config`` is a ``ConfigProto`` (TensorFlow's; :func:`get_default_session`
    #: starts one from it) rather than the model's own settings string.
    takes_config_proto = True
    #: Whether :meth:`install` routes CuPy's allocations through it (TensorFlow's sessions).
    routes_cupy = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        model = cls.__dict__.get("model")
        if isinstance(model, AllocatorModel):
            Session._BY_MODEL.setdefault(model.name, cls)

    @staticmethod
    def class_for(allocator: Any) -> type:
        """The session class of an allocator model (a name: ``"torch"``, ``"jax"``...):
        the subclass that names it (:class:`TorchSession` for PyTorch's), else
        :class:`Session`."""
        return Session._BY_MODEL.get(model_for(allocator).name, Session)

    def __init__(self, config: Any = None, *, simulate: Any = None,
                 environ: Mapping[str, str] | None = None, poll: bool = True,
                 record_stacks: bool = False, allocator: Any = None) -> None:
        if allocator is not None and model_for(allocator) is not self.model:
            raise ConfigError(f"allocator={allocator!r} is not this session's "
                              f"({self.model.title}); use gpudash.Session(allocator=...)")
        env = os.environ if environ is None else environ
        if not isinstance(record_stacks, bool):
            raise ConfigError(f"record_stacks must be True or False; got {record_stacks!r}")
        # who holds each live block: a label (label()) and/or the allocating Python stack
        self._record_stacks = record_stacks
        self._track_holders = record_stacks
        self._stacks: SessionStacks | None = SessionStacks() if record_stacks else None
        self._holder_sinks: list = []
        self._label_local = threading.local()
        self._environ = env
        self._config = self._to_config(config)
        gpu = self._config.gpu_options
        self._allocator_type = gpu.normalized_allocator_type
        self._log_placement = self._config.log_device_placement
        self._allow_growth = allow_growth_from_env(gpu.allow_growth, env)
        self._garbage_collection = garbage_collection_from_env(env)
        self._lock = _SessionLock()
        self._closed = False
        self._installed: dict | None = None
        self.devices: list[Device] = []
        self.host_allocator: BFCAllocator | None = None
        self._build_devices(config is not None, simulate, env)
        if self._allow_growth != gpu.allow_growth:
            self._config.gpu_options.allow_growth = self._allow_growth
        if gpu.force_gpu_compatible:
            self._build_host_allocator()
        self._wake = threading.Condition(self._lock)
        self._poller: threading.Thread | None = None
        if poll:
            self._poller = threading.Thread(target=Session._poll_loop, args=(weakref.ref(self),),
                                            name="gpudash-event-poller", daemon=True)
            self._poller.start()

    #: The framework whose semantics this session follows (:meth:`from_env`).
    framework = "tensorflow"
    #: The model of the devices' allocators (:mod:`gpudash.models`).
    model: AllocatorModel = model_for("bfc")
    #: JAX's settings as read by :meth:`from_env` (None for a TensorFlow session).
    jax_settings = None

    @classmethod
    def from_env(cls, framework: str = "tensorflow", *, config: Any = None, simulate: Any = None,
                 environ: Mapping[str, str] | None = None, poll: bool = True,
                 jaxlib_version: Any = None, torch_version: Any = None) -> "Session":
        """A session with a framework's semantics, configured from its environment variables.

        Parameters
        ----------
        framework : {"tensorflow", "jax", "torch"}
            ``"torch"`` (or ``"pytorch"``): a :class:`TorchSession`, PyTorch's caching
            allocator configured from ``PYTORCH_ALLOC_CONF`` (PyTorch 2.9's name, which wins)
            or ``PYTORCH_CUDA_ALLOC_CONF``; frees reach the allocator at once.
            ``"tensorflow"``: exactly ``Session(config, ...)`` (``TF_FORCE_GPU_ALLOW_GROWTH``,
            ``TF_ENABLE_GPU_GARBAGE_COLLECTION``, ``TF_DEVICE_MIN_SYS_MEMORY_IN_MB``...).
            ``"jax"``: JAX's GPU client, from ``XLA_PYTHON_CLIENT_MEM_FRACTION`` /
            ``XLA_CLIENT_MEM_FRACTION`` (a fraction of total memory, default 0.75, in single
            precision as XLA uses it; the limit rounded up to 2 MiB from jaxlib 0.10.2),
            ``XLA_PYTHON_CLIENT_PREALLOCATE`` (false = growth),
            ``XLA_PYTHON_CLIENT_ALLOCATOR`` and ``TF_FORCE_UNIFIED_MEMORY``; garbage
            collection off; TensorFlow's variables are ignored, as JAX ignores them. Frees
            reach the allocator as soon as the device is done with them
            (``deferred_deletion_bytes=1``). See docs/frameworks.md.
        config : optional
            TensorFlow only: the ``ConfigProto`` to start from.
        simulate, environ, poll
            As for :class:`Session` (``GPUDASH_SIMULATE`` and ``CUDA_VISIBLE_DEVICES`` are
            read for both frameworks).
        jaxlib_version : str, optional
            JAX only: apply this jaxlib's rules (:func:`gpudash.options.jax_settings_from_env`).
        torch_version : str, optional
            PyTorch only: apply this PyTorch's rules (default 2.11): the settings it accepts
            and the decisions that changed between versions.

        Raises
        ------
        ConfigError
            For an unknown framework, a bad or conflicting variable (naming it and what is
            accepted), or a JAX allocator kind gpudash does not run (``cuda_async``, ``vmm``).
        """

        framework = check_framework(framework, ("tensorflow", "jax", "torch"))
        env = os.environ if environ is None else environ
        own = Session.class_for(framework)
        if own is not Session:   # a model with its own session (PyTorch's) reads its variables
            return own._from_framework_env(config, simulate=simulate, environ=env,
                                           torch_version=torch_version)
        if torch_version is not None:
            raise ConfigError("torch_version= is for Session.from_env('torch')")
        if framework == "tensorflow":
            return cls(config, simulate=simulate, environ=env, poll=poll)
        if config is not None:
            raise ConfigError("Session.from_env('jax') takes its settings from the environment; "
                              "config= is for TensorFlow sessions (got a config)")
        settings = jax_settings_from_env(env, jaxlib_version=jaxlib_version)
        gpu = settings.gpu_options()
        gpu.deferred_deletion_bytes = 1
        # JAX reads none of TensorFlow's variables: keep only the device ones, and turn off
        # garbage collection (XLA leaves BFCAllocator's default, off).
        jax_env = {k: env[k] for k in ("GPUDASH_SIMULATE", "CUDA_VISIBLE_DEVICES") if k in env}
        jax_env["TF_ENABLE_GPU_GARBAGE_COLLECTION"] = "false"
        sess = cls.__new__(cls)
        sess.framework = "jax"
        sess.jax_settings = settings  # read while the devices are built: XLA's limit
        sess.__init__(ConfigProto(gpu_options=gpu, allow_soft_placement=True),
                      simulate=simulate, environ=jax_env, poll=poll)
        return sess

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _to_config(config: Any) -> ConfigProto:
        if config is None:
            return ConfigProto()
        if isinstance(config, ConfigProto):
            return config.copy()
        if isinstance(config, GPUOptions):
            return ConfigProto(gpu_options=config.copy())
        if isinstance(config, Mapping):
            if set(config) <= set(GPUOptions().as_dict()):
                return ConfigProto(gpu_options=dict(config))
            return ConfigProto.from_dict(config)
        if hasattr(config, "gpu_options"):
            return ConfigProto.from_tf(config)
        if hasattr(config, "per_process_gpu_memory_fraction"):
            return ConfigProto(gpu_options=GPUOptions.from_tf(config))
        raise ConfigError(
            f"config must be a gpudash.ConfigProto, GPUOptions, dict or TensorFlow ConfigProto; "
            f"got {type(config).__name__}")

    def _build_devices(self, explicit_config: bool, simulate: Any,
                       env: Mapping[str, str]) -> None:
        gpu = self._config.gpu_options
        sizes = None
        if simulate is not None and simulate is not False:
            sizes = _simulate_sizes(simulate)
        else:
            sizes = simulated_devices_from_env(env)
        if sizes is None:
            ok, reason = CudaMemory.available()
            if ok:
                self._build_cuda_devices()
                return
            if explicit_config and not self._config.allow_soft_placement:
                raise ConfigError(
                    f"no CUDA GPU can be used here ({reason}) and allow_soft_placement is "
                    "False. To run on a simulated device pass simulate='16GiB' (or "
                    "'2x16GiB'), set GPUDASH_SIMULATE=1x16GiB, or set "
                    "config.allow_soft_placement = True to fall back automatically.")
            _say_once("simulated-fallback",
                      f"gpudash: no CUDA GPU here ({reason}); using a simulated "
                      f"{format_bytes(DEFAULT_SIMULATED_BYTES)} device.")
            sizes = [DEFAULT_SIMULATED_BYTES]
        unified = gpu.per_process_gpu_memory_fraction > 1.0
        ids = resolve_visible_devices(gpu.visible_device_list, len(sizes))
        for index, vid in enumerate(ids):
            backend = SimulatedDevice(sizes[vid], name=f"sim{vid}", index=vid, unified=unified)
            cc = backend.compute_capability[0]
            self._add_device(index, vid, backend, sizes[vid], sizes[vid], cc)

    def _build_cuda_devices(self) -> None:
        gpu = self._config.gpu_options
        unified = gpu.per_process_gpu_memory_fraction > 1.0
        ids = resolve_visible_devices(gpu.visible_device_list, cuda_device_count())
        for index, vid in enumerate(ids):
            backend = CudaMemory(vid, managed=unified)
            free, total = backend.memory_info()
            self._add_device(index, vid, backend, total, free, backend.compute_capability[0])

    def _add_device(self, index: int, vid: int, backend: Any, total: int, available: int,
                    cc_major: int) -> None:
        gpu = self._config.gpu_options
        limit = self._memory_limit(total, available, gpu.per_process_gpu_memory_fraction,
                                   cc_major)
        cls = CudaMallocAllocator if self._allocator_type == "cuda_malloc" else BFCAllocator
        alloc = cls(backend, limit, allow_growth=self._allow_growth,
                    garbage_collection=self._garbage_collection, name=f"GPU_{index}_bfc")
        alloc.device_index = index
        self.devices.append(Device(index, vid, backend, alloc, total, available, cc_major,
                                   gpu.copy(allow_growth=self._allow_growth),
                                   gpu.effective_deferred_deletion_bytes))

    def _memory_limit(self, total: int, available: int, fraction: float, cc_major: int) -> int:
        """A device's BFC limit: TensorFlow's rule, or XLA's for a JAX session (a fraction
        of the total in single precision, rounded up to 2 MiB from jaxlib 0.10.2)."""
        limit = memory_limit(total, available, fraction, cc_major, environ=self._environ)
        if self.jax_settings is not None and fraction > 0:
            limit = jax_memory_limit(total, fraction,
                                     jaxlib_version=self.jax_settings.jaxlib_version)
        return limit

    def _build_host_allocator(self) -> None:
        if self.devices and self.devices[0].kind == "cuda":
            backend: Any = CudaMemory(self.devices[0].visible_id, pinned_host=True)
        else:
            backend = HostMemory()
        self.host_allocator = BFCAllocator(backend, HOST_BFC_LIMIT, allow_growth=True,
                                           name="gpu_host_bfc")

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> ConfigProto:
        """The configuration now in force (a copy; change it with :meth:`configure`)."""
        return self._config.copy()

    @property
    def gpu_options(self) -> GPUOptions:
        return self._config.gpu_options.copy()

    @property
    def allocators(self) -> list[BFCAllocator]:
        """Each device's allocator, in device order."""
        return [d.allocator for d in self.devices]

    def allocator(self, device: Any = 0) -> BFCAllocator:
        return self.devices[_parse_device(device, len(self.devices))].allocator

    def device(self, device: Any = 0) -> Device:
        return self.devices[_parse_device(device, len(self.devices))]

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def simulated(self) -> bool:
        """True when the devices are simulated."""
        return all(d.kind == "simulated" for d in self.devices)

    def __repr__(self) -> str:
        kind = "simulated" if self.simulated else "cuda"
        state = "closed" if self._closed else "open"
        return f"Session({len(self.devices)} {kind} device(s), {state}, {self._config!r})"

    def stats(self, device: Any = None) -> AllocatorStats | dict[int, AllocatorStats]:
        """Allocator stats of one device, or of all devices as ``{index: stats}``."""
        if device is not None:
            return self.device(device).stats()
        return {d.index: d.stats() for d in self.devices}

    # ------------------------------------------------------------------ allocation
    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this session is closed; create a new gpudash.Session()")

    def allocate(self, nbytes: int, device: Any = 0) -> int:
        """Allocate on a device; if the allocator is out of memory, flush the device's
        deferred frees and retry once before raising :class:`~gpudash.OutOfMemoryError`."""
        if self._closed:
            self._check_open()
        devices = self.devices
        if type(device) is int and 0 <= device < len(devices):  # the common case, fast
            dev = devices[device]
        else:
            dev = devices[_parse_device(device, len(devices))]
        ptr = self._allocate_on(dev, nbytes)
        if self._track_holders and ptr:
            self._note_holder(dev, ptr)
        if self._log_placement and ptr:
            logger.info("gpudash: allocate %d bytes on %s at %#x (%s)", nbytes, dev.name, ptr,
                        dev.allocator.name)
        return ptr

    def _allocate_on(self, dev: Device, nbytes: int) -> int:
        """One allocation on ``dev``: if the allocator is out of memory, flush the deferred
        frees and make the real attempt (which raises OutOfMemoryError, logged and
        recorded once, if memory is still short)."""
        ptr = dev.allocator.try_allocate(nbytes)
        if not ptr and nbytes:
            self._drain(dev)
            ptr = dev.allocator.allocate(nbytes)
        return ptr

    # ------------------------------------------------------------------ holders
    @contextmanager
    def label(self, name: str) -> Iterator[None]:
        """Mark the allocations made inside the block (in this thread) as held by ``name``:
        ``with sess.label("forward"): ...``. Labels nest (the innermost wins); the chunk map
        shows them on hover and :meth:`holders` lists them."""
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"a label is a non-empty string; got {name!r}")
        self._track_holders = True
        stack = getattr(self._label_local, "stack", None)
        if stack is None:
            stack = self._label_local.stack = []
        stack.append(name)
        try:
            yield
        finally:
            stack.pop()

    def _note_holder(self, dev: Device, ptr: int) -> None:
        """Keep who holds a new block: the innermost label of this thread and, with
        ``record_stacks``, the id of the allocating stack; tell the holder sinks (a
        Recorder) with the block's allocation id."""
        labels = getattr(self._label_local, "stack", None)
        label = labels[-1] if labels else ""
        sid = self._stacks.capture() if self._stacks is not None else -1
        if not label and sid < 0:
            return
        dev._holders[ptr] = (label, sid)
        sinks = self._holder_sinks
        if sinks:
            alloc = dev.allocator
            aid = alloc.allocation_id(ptr)
            for sink in list(sinks):
                try:
                    sink(alloc, aid, label, sid)
                except Exception as exc:  # noqa: BLE001 - never break an allocation
                    warnings.warn(f"gpudash: holder sink {sink!r} raised {exc!r}; the session "
                                  "goes on", GpudashWarning, stacklevel=3)

    def _holder_text(self, holder: tuple[str, int]) -> str:
        """A block's holder in words: ``label``, ``file.py:42 step`` (its allocating frame)
        or ``label @ file.py:42 step``."""
        label, sid = holder
        where = self._stacks.where(sid) if sid >= 0 and self._stacks is not None else ""
        return f"{label} @ {where}" if label and where else (label or where)

    @property
    def stacks(self) -> SessionStacks | None:
        """The interned allocating stacks of this session's blocks (``record_stacks=True``),
        else None."""
        return self._stacks

    def _add_holder_sink(self, sink: Any) -> Any:
        """Call ``sink(allocator, allocation_id, label, stack_id)`` for every block given a
        holder from now on (a label or a recorded stack; ``label`` "" and ``stack_id`` -1
        for none); returns ``remove``. For the Recorder, which writes them into its trace."""
        self._holder_sinks.append(sink)

        def remove() -> None:
            try:
                self._holder_sinks.remove(sink)
            except ValueError:
                pass

        return remove

    def holder_of(self, ptr: int, device: Any = None) -> str | None:
        """The label or allocating frame of a live block, or None when it has none."""
        dev = self._device_of(ptr) if device is None else self.device(device)
        holder = dev._holders.get(ptr)
        return None if holder is None else self._holder_text(holder)

    def stack_of(self, ptr: int, device: Any = None) -> list[tuple[str, int, str]]:
        """The allocating stack of a live block as ``(filename, line, function)`` frames,
        innermost first (``record_stacks=True``; [] when none was recorded)."""
        dev = self._device_of(ptr) if device is None else self.device(device)
        holder = dev._holders.get(ptr)
        if holder is None or holder[1] < 0 or self._stacks is None:
            return []
        frames = self._stacks.frames
        return [frames[f] for f in self._stacks.stacks[holder[1]]]

    def holders(self, device: Any = 0) -> dict[str, tuple[int, int]]:
        """``{holder: (bytes, blocks)}`` of a device's live blocks that have a holder,
        largest first."""
        dev = self.device(device)
        out: dict[str, list[int]] = {}
        alloc = dev.allocator
        texts: dict[tuple[str, int], str] = {}
        for ptr, holder in list(dev._holders.items()):
            try:
                size = alloc.allocated_size(ptr)
            except InvalidPointerError:
                continue
            text = texts.get(holder)
            if text is None:
                text = texts[holder] = self._holder_text(holder)
            rec = out.setdefault(text, [0, 0])
            rec[0] += size
            rec[1] += 1
        return {h: (b, n) for h, (b, n) in sorted(out.items(), key=lambda kv: -kv[1][0])}

    def free(self, ptr: int, device: Any = None) -> None:
        """Free through deferred deletion (the block reaches the allocator later).

        Raises
        ------
        InvalidPointerError
            For an address not allocated here, already freed or already queued.
        ConfigError
            After :meth:`close` (which returned every block), as :meth:`allocate` does."""
        if not ptr:
            _null_or_bug(ptr, "free")
            return
        devices = self.devices
        if device is None and len(devices) == 1 and type(ptr) is int:
            dev = devices[0]  # one device: the allocator's own table validates the pointer
            # (after close() nothing is live: the slow path says the session is closed)
            size = dev.allocator._live_size(ptr) or self._allocated_size(dev, ptr)
        else:
            if self._closed:
                self._check_open()
            dev = self._device_of(ptr) if device is None else self.device(device)
            size = dev.allocator.allocated_size(ptr)  # validates the pointer now
        d = dev._deferred
        queued = d.queued
        with self._lock:
            n = len(queued)
            queued.add(ptr)
            if len(queued) == n:
                raise InvalidPointerError(
                    f"{dev.allocator.name}: free({ptr:#x}): this address is already queued for "
                    "deletion (double free?)")
            d.pending.append(ptr)
            pending = d.pending_bytes = d.pending_bytes + size
            if pending >= d.threshold:
                self._flush_pending(dev)

    def free_now(self, ptr: int, device: Any = None) -> None:
        """Free at once, bypassing deferred deletion.

        Raises
        ------
        InvalidPointerError
            For an address not allocated here, already freed, or already queued by
            :meth:`free` (it reaches the allocator at the next flush: freeing it again now
            would be a double free).
        ConfigError
            After :meth:`close`."""
        if not ptr:
            _null_or_bug(ptr, "free_now")
            return
        if self._closed:
            self._check_open()
        dev = self._device_of(ptr) if device is None else self.device(device)
        with self._lock:
            if ptr in dev._deferred.queued:
                raise InvalidPointerError(
                    f"{dev.allocator.name}: free_now({ptr:#x}): this address is already queued "
                    "for deletion by free() (double free?); flush() returns it now")
            dev.allocator.deallocate(ptr)
            dev._holders.pop(ptr, None)

    def _allocated_size(self, dev: Device, ptr: int) -> int:
        """The size of a live block of ``dev``; a ConfigError once the session is closed
        (its allocators are empty then), else the allocator's InvalidPointerError."""
        if self._closed:
            self._check_open()
        return dev.allocator.allocated_size(ptr)

    def _device_of(self, ptr: int) -> Device:
        for dev in self.devices:
            if dev.allocator.owns(ptr):
                return dev
        # Let the first allocator raise its precise InvalidPointerError.
        self.devices[0].allocator.allocated_size(ptr)
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ deferred deletion
    def _marker(self, dev: Device) -> Any:
        """A completion marker for work queued so far: a CUDA event on the current stream,
        or None on a simulated device (complete at the next poll)."""
        if dev.kind != "cuda":
            return None
        import cupy

        with cupy.cuda.Device(dev.visible_id):
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record()
        return event

    def _flush_pending(self, dev: Device) -> None:
        """Lock held: queued frees become one in-flight batch (TensorFlow's QueueTensors).

        A CUDA batch waits for its event, and the poller thread returns it. A simulated
        device has no work to wait for: the poller would return the batch at its next
        poll, within ``polling_active_delay_usecs`` (10 µs), so with a poller running the
        batch is returned here and now, which spares a thread handoff per batch. Without a
        poller (``poll=False``) it waits for :meth:`poll` or :meth:`flush`."""
        d = dev._deferred
        if not d.pending:
            return
        marker = self._marker(dev)
        d.inflight.append((marker, d.pending, d.pending_bytes))
        d.pending = []
        d.pending_bytes = 0
        d.flushes += 1
        if marker is None and self._poller is not None:
            self._complete(dev, wait=False)
        else:
            self._wake.notify_all()

    def _complete(self, dev: Device, wait: bool) -> int:
        """Return finished in-flight batches to the allocator; ``wait`` blocks on CUDA
        events. Returns the bytes returned.

        The frees happen under the session lock, so a concurrent :meth:`flush` or a
        flush-and-retry never sees a batch that has left the queue but not yet reached
        the allocator."""
        with self._lock:
            d = dev._deferred
            freed = 0
            while d.inflight:
                marker, ptrs, nbytes = d.inflight[0]
                if marker is not None:
                    if wait:
                        marker.synchronize()
                    elif not marker.done:
                        break
                d.inflight.popleft()
                failed = []
                d.queued.difference_update(ptrs)
                holders = dev._holders
                if holders:
                    for ptr in ptrs:
                        holders.pop(ptr, None)
                # One lock round for the batch; one bad pointer never keeps the rest of it.
                failed = dev.allocator._deallocate_batch(ptrs)
                if failed:
                    warnings.warn(f"gpudash: {len(failed)} deferred free(s) failed and were "
                                  f"dropped: {failed[0]}", GpudashWarning, stacklevel=2)
                freed += nbytes
            d.completed_bytes += freed
        return freed

    def _drain(self, dev: Device) -> int:
        """Flush and complete everything queued on ``dev``; the bytes returned."""
        with self._lock:
            self._flush_pending(dev)
            return self._complete(dev, wait=True)

    def flush(self, device: Any = None) -> int:
        """Return every deferred free to its allocator now (all devices by default);
        returns the bytes returned."""
        devices = self.devices if device is None else [self.device(device)]
        total = 0
        for dev in devices:
            with self._lock:
                self._flush_pending(dev)
            total += self._complete(dev, wait=True)
        return total

    def poll(self) -> int:
        """One poll, as the background thread does: finished batches reach the allocator."""
        return sum(self._complete(dev, wait=False) for dev in self.devices)

    @staticmethod
    def _poll_loop(ref: "weakref.ref[Session]") -> None:
        """The poller thread. It holds only a weak reference between polls, so a session
        that is dropped without close() is still collected (and the thread ends)."""
        while True:
            sess = ref()
            if sess is None:
                return
            with sess._lock:
                if sess._closed:
                    return
                busy = any(d._deferred.inflight for d in sess.devices)
                gpu = sess._config.gpu_options
                if busy:
                    timeout = gpu.effective_polling_active_delay_usecs / 1e6
                else:
                    timeout = gpu.effective_polling_inactive_delay_msecs / 1e3
                wake = sess._wake
            del sess
            with wake:
                wake.wait(timeout)
            sess = ref()
            if sess is None or sess._closed:
                return
            try:
                sess.poll()
            except Exception as exc:  # noqa: BLE001 - the poller must survive
                warnings.warn(f"gpudash: deferred-deletion poll failed: {exc!r}", GpudashWarning)
            del sess

    # ------------------------------------------------------------------ live reconfiguration
    def configure(self, per_process_gpu_memory_fraction: float | None = None,
                  allow_growth: bool | None = None, deferred_deletion_bytes: int | None = None,
                  device: Any = None) -> None:
        """Change settings of the running session (all devices, or one).

        Every value is validated before anything changes (a bad one raises
        :class:`~gpudash.ConfigError` and changes nothing).

        - Raising the fraction raises the limit; without growth the new headroom is taken
          at once. Lowering it returns wholly free regions until the pool fits. Memory in
          use is never moved or freed: while the pool stays above the new limit, an
          allocation that would take bytes in use past the limit is refused
          (``OutOfMemoryError``, saying the limit was lowered live) and each region goes
          back as soon as it empties (:meth:`gpudash.BFCAllocator.set_memory_limit`).
          ``Device.over_limit`` says when bytes in use exceed the limit.
        - Growth off to on stops preallocating and lets free regions go; on to off
          preallocates up to the limit.
        - Lowering ``deferred_deletion_bytes`` flushes what is queued above it.

        Each change is recorded as a ``limit`` event with its old and new value.
        """
        self._check_open()
        changes = {}
        if per_process_gpu_memory_fraction is not None:
            changes["per_process_gpu_memory_fraction"] = per_process_gpu_memory_fraction
        if allow_growth is not None:
            changes["allow_growth"] = allow_growth
        if deferred_deletion_bytes is not None:
            changes["deferred_deletion_bytes"] = deferred_deletion_bytes
        if not changes:
            return
        with self._lock:  # one configure at a time: each builds on the options in force
            self._configure_locked(changes, device)

    def _configure_locked(self, changes: dict, device: Any) -> None:
        targets = self.devices if device is None else [self.device(device)]
        # Validate everything first.
        new_opts = {dev.index: dev.options.copy(**changes) for dev in targets}
        limits = {}
        for dev in targets:
            opts = new_opts[dev.index]
            fraction = opts.per_process_gpu_memory_fraction
            if fraction > 1.0 and not getattr(dev.backend, "unified", False) and not getattr(
                    dev.backend, "managed", False):
                raise ConfigError(
                    f"per_process_gpu_memory_fraction={fraction} oversubscribes {dev.name}, "
                    "which needs unified memory; create the session with a fraction above 1 "
                    "to use unified memory, or choose a fraction <= 1")
            limits[dev.index] = self._memory_limit(dev.total, dev.available, fraction,
                                                   dev.cc_major)
        with self._lock:
            for dev in targets:
                opts = new_opts[dev.index]
                old = dev.options
                alloc = dev.allocator
                if "per_process_gpu_memory_fraction" in changes:
                    alloc.set_memory_limit(limits[dev.index])
                    alloc.note_setting("per_process_gpu_memory_fraction",
                                       old.per_process_gpu_memory_fraction,
                                       opts.per_process_gpu_memory_fraction)
                if "allow_growth" in changes and opts.allow_growth != old.allow_growth:
                    alloc.set_allow_growth(opts.allow_growth)
                    if opts.allow_growth:
                        alloc.release_free_regions()
                if not opts.allow_growth and (
                        "allow_growth" in changes
                        or limits.get(dev.index, 0) > alloc.pool_bytes):
                    alloc.preallocate()
                if "deferred_deletion_bytes" in changes:
                    d = dev._deferred
                    d.threshold = opts.effective_deferred_deletion_bytes
                    alloc.note_setting("deferred_deletion_bytes",
                                       old.effective_deferred_deletion_bytes, d.threshold)
                    if d.pending_bytes >= d.threshold:
                        self._flush_pending(dev)
                dev.options = opts
            if device is None:
                self._config.gpu_options = self._config.gpu_options.copy(**changes)

    def release_free_regions(self, device: Any = None) -> int:
        """Return wholly free regions to the devices; the bytes returned."""
        devices = self.devices if device is None else [self.device(device)]
        return sum(d.allocator.release_free_regions() for d in devices)

    # ------------------------------------------------------------------ CuPy
    def install(self) -> "Session":
        """Route CuPy's allocations through this session's allocators.

        Frees go through deferred deletion; with ``force_gpu_compatible`` pinned host memory
        comes from the session's pinned-memory BFC. :meth:`uninstall` restores what was there.

        Raises
        ------
        BackendUnavailableError
            When CuPy cannot be imported, or the session runs on simulated devices (their
            addresses have no memory behind them).
        """
        self._check_open()
        if self._installed is not None:
            return self
        if self.simulated:
            raise BackendUnavailableError(
                "install() routes CuPy's real allocations, but this session runs on simulated "
                "devices (no memory behind their addresses); use a machine with a CUDA GPU")
        try:
            import cupy
        except ImportError as exc:  # pragma: no cover - cupy is a test dependency
            raise BackendUnavailableError(
                "install() needs CuPy: pip install 'gpudash[cuda12]'") from exc
        state = {"allocator": cupy.cuda.get_allocator(), "pinned": False}
        cupy.cuda.set_allocator(self._cupy_malloc)
        if self.host_allocator is not None:
            cupy.cuda.set_pinned_memory_allocator(self._cupy_pinned_malloc)
            state["pinned"] = True
        self._installed = state
        return self

    def uninstall(self) -> None:
        """Restore CuPy's allocators as they were before :meth:`install`."""
        state, self._installed = self._installed, None
        if state is None:
            return
        import cupy

        cupy.cuda.set_allocator(state["allocator"])
        if state["pinned"]:
            cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)

    @property
    def installed(self) -> bool:
        return self._installed is not None

    @contextmanager
    def as_default(self) -> Iterator["Session"]:
        """``with sess.as_default():`` CuPy allocates through this session inside the block."""
        was = self.installed
        self.install()
        try:
            yield self
        finally:
            if not was:
                self.uninstall()

    def _device_for_cuda_id(self, cuda_id: int) -> Device:
        for dev in self.devices:
            if dev.visible_id == cuda_id:
                return dev
        raise BackendUnavailableError(
            f"CuPy allocated on CUDA device {cuda_id}, which this session does not manage "
            f"(its devices map to CUDA ids {[d.visible_id for d in self.devices]})")

    def _cupy_malloc(self, size: int) -> Any:
        import cupy

        dev = self._device_for_cuda_id(cupy.cuda.runtime.getDevice())
        ptr = self.allocate(size, device=dev.index)
        owner = _Release(self, ptr, dev.index)
        mem = cupy.cuda.memory.UnownedMemory(ptr, size, owner, dev.visible_id)
        return cupy.cuda.memory.MemoryPointer(mem, 0)

    def _cupy_pinned_malloc(self, size: int) -> Any:
        import cupy

        host = self.host_allocator
        ptr = host.allocate(size)
        mem = _PinnedBlock(host, ptr, size)
        return cupy.cuda.pinned_memory.PinnedMemoryPointer(mem, 0)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Drain deferred frees, return every region, stop the poller, uninstall from CuPy.

        Nothing leaks: afterwards every backend holds no block from this session.
        """
        if self._closed:
            return
        self.uninstall()
        self.flush()
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=5)
        for dev in self.devices:
            dev.allocator.close()
        if self.host_allocator is not None:
            self.host_allocator.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                with self._lock:
                    self._closed = True
                    self._wake.notify_all()
        except Exception:  # noqa: BLE001
            pass


#: A set of devices configured like TensorFlow, the class gpudash uses: where the compiled
#: core runs (gpudash._accel), ``class Session(PySession)`` built by
#: ``gpudash._core.bind_session``, whose ``allocate`` and ``free`` are the fast paths of
#: ``_csrc/session.pxi`` (``session_allocate``, ``session_free``: the common case in C,
#: every other case handed to :data:`PY_SESSION_METHODS`); else :class:`PySession` above.
Session = twin("bind_session", PySession, device=Device, deferred=_Deferred)

#: Session's Python methods that the compiled core has fast paths for: the reference, what
#: runs on the pure-Python path, and what each fast path hands every case but the common one.
PY_SESSION_METHODS = {"allocate": PySession.allocate, "free": PySession.free}


class TorchDevice(Device):
    """One device of a :class:`TorchSession`: PyTorch's caching allocator (``cuda:<index>``).

    ``options`` is None (TensorFlow's ``GPUOptions`` do not apply); :meth:`settings` gives
    the fraction and the caching allocator's settings in force."""

    @property
    def name(self) -> str:
        return f"cuda:{self.index}"

    @property
    def over_limit(self) -> bool:
        """True while allocated bytes exceed the limit (after the fraction was lowered)."""
        alloc = self.allocator
        return alloc.bytes_in_use > alloc.memory_limit

    def settings(self) -> dict[str, Any]:
        """``fraction`` (None: never set), ``expandable_segments``, ``max_split_size_mb``,
        ``garbage_collection_threshold``, ``conf`` (the settings string), ``limit`` and
        ``total`` bytes."""
        return {**TORCH.live_settings(self.allocator), "total": self.total}

    def settings_text(self) -> str:
        """``cuda:0 fraction not set, limit 16.00 GiB, PYTORCH_CUDA_ALLOC_CONF=...``."""
        alloc = self.allocator
        fraction = alloc.fraction
        conf = alloc.config.as_conf()
        return (f"{self.name} fraction {'not set' if fraction is None else f'{fraction:g}'}, "
                f"limit {format_bytes(self.memory_limit)}, "
                f"PYTORCH_CUDA_ALLOC_CONF={conf!r}" + ("" if conf else " (the defaults)"))


class TorchSession(Session):
    """A session with PyTorch's semantics: every device runs PyTorch's caching allocator
    (:class:`~gpudash.CachingAllocator`, named ``cuda:<index>``), configured as PyTorch
    configures it, and changed live as PyTorch allows.

    Made by ``gpudash.Session(..., allocator="torch")`` or ``Session.from_env("torch")``.

    Parameters
    ----------
    config : str, CachingAllocatorConfig or dict, optional
        The allocator's settings, as ``PYTORCH_CUDA_ALLOC_CONF`` would give them
        (``"expandable_segments:True,max_split_size_mb:128"``, a
        :class:`~gpudash.CachingAllocatorConfig`, or a dict of its settings by name). Default:
        the environment's ``PYTORCH_ALLOC_CONF`` (PyTorch 2.9's name, which wins) or
        ``PYTORCH_CUDA_ALLOC_CONF``.
    simulate, environ, record_stacks
        As for :class:`Session` (``GPUDASH_SIMULATE`` and ``CUDA_VISIBLE_DEVICES`` are read;
        TensorFlow's variables are not, as PyTorch ignores them).
    poll : bool
        No effect: PyTorch frees a block at once, so there is no deferred deletion to poll.
    fraction : float, optional
        ``torch.cuda.set_per_process_memory_fraction`` on every device from the start
        (default: not set, as in PyTorch: segments may take the whole device).
    torch_version : str, optional
        The PyTorch whose rules apply (default 2.11).

    Notes
    -----
    What changes live, and when (:meth:`configure`), as PyTorch applies it:

    - the fraction (``torch.cuda.set_per_process_memory_fraction``, per device): new
      segments are refused past it at once; segments already held stay, and nothing is
      given back until :meth:`empty_cache` or a request that needs a new segment (which
      frees the cached ones first);
    - ``expandable_segments`` (``torch.cuda.memory._set_allocator_settings``, every device):
      segments made from then on; segments already held stay as they are;
    - ``max_split_size_mb``, ``garbage_collection_threshold``,
      ``roundup_power2_divisions``: from the next request; blocks already split stay split.
      Garbage collection acts only while a fraction is set;
    - ``conf=`` is ``_set_allocator_settings(conf)`` itself: settings the string leaves out
      go back to their defaults (expandable segments excepted), as in PyTorch.

    TensorFlow's settings (``allow_growth``, ``deferred_deletion_bytes``) are refused by name,
    with what PyTorch has instead. :meth:`install` (CuPy routing) is TensorFlow's only.

    Examples
    --------
    >>> import gpudash
    >>> with gpudash.Session("expandable_segments:True", allocator="torch",
    ...                      simulate="16GiB") as sess:
    ...     p = sess.allocate(1000)
    ...     sess.configure(fraction=0.5)
    ...     sess.devices[0].memory_limit, sess.devices[0].allocator.config.expandable_segments
    (8589934592, True)
    """

    framework = "torch"
    model = TORCH
    takes_config_proto = False
    routes_cupy = False

    @classmethod
    def _from_framework_env(cls, config: Any, *, simulate: Any, environ: Mapping[str, str],
                            torch_version: Any) -> "TorchSession":
        """:meth:`Session.from_env` ``("torch")``: ``PYTORCH_ALLOC_CONF`` /
        ``PYTORCH_CUDA_ALLOC_CONF`` from ``environ``."""
        if config is not None:
            raise ConfigError("Session.from_env('torch') takes its settings from "
                              "PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF; config= is for "
                              "TensorFlow sessions (got a config)")
        return cls(simulate=simulate, environ=environ, torch_version=torch_version)

    def __init__(self, config: Any = None, *, simulate: Any = None,
                 environ: Mapping[str, str] | None = None, poll: bool = True,
                 record_stacks: bool = False, allocator: Any = "torch",
                 fraction: float | None = None, torch_version: Any = None) -> None:

        env = os.environ if environ is None else environ
        if config is None:
            conf = CachingAllocatorConfig.from_env(env, version=torch_version)
        elif isinstance(config, CachingAllocatorConfig):
            conf = config.copy()
            if torch_version is not None:
                conf = CachingAllocatorConfig(conf.as_conf(), version=torch_version)
        elif isinstance(config, str):
            conf = CachingAllocatorConfig(config, version=torch_version)
        elif isinstance(config, Mapping):
            conf = CachingAllocatorConfig(version=torch_version, **config)
        else:
            raise ConfigError(
                f"a PyTorch session's config is a PYTORCH_CUDA_ALLOC_CONF string, a "
                f"CachingAllocatorConfig or a dict of its settings; got "
                f"{type(config).__name__} (ConfigProto and GPUOptions are TensorFlow's)")
        if fraction is not None:
            TORCH.check_setting("fraction", fraction)
        if conf.unsupported() is not None:   # PyTorch's rule, as what-if and the dashboard
            warn_user(conf.unsupported())
        self._torch_conf = conf
        self._torch_fraction = fraction
        device_env = {k: env[k] for k in ("GPUDASH_SIMULATE", "CUDA_VISIBLE_DEVICES")
                      if k in env}
        super().__init__(ConfigProto(allow_soft_placement=True), simulate=simulate,
                         environ=device_env, poll=False, record_stacks=record_stacks,
                         allocator=allocator)

    def _add_device(self, index: int, vid: int, backend: Any, total: int, available: int,
                    cc_major: int) -> None:

        alloc = CachingAllocator(backend, self._torch_conf, fraction=self._torch_fraction,
                                 name=f"cuda:{index}", device=index)
        self.devices.append(TorchDevice(index, vid, backend, alloc, total, available,
                                        cc_major, None, 1))

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> Any:
        """The caching allocator's settings in force (a ``CachingAllocatorConfig`` copy;
        change them with :meth:`configure`)."""
        return self._torch_conf.copy()

    @property
    def gpu_options(self) -> GPUOptions:
        raise ConfigError("a PyTorch session has no GPUOptions (TensorFlow's); its settings "
                          "are .config (PYTORCH_CUDA_ALLOC_CONF) and each device's fraction")

    def __repr__(self) -> str:
        kind = "simulated" if self.simulated else "cuda"
        state = "closed" if self._closed else "open"
        fracs = {d.allocator.fraction for d in self.devices}
        frac = "" if fracs == {None} else f", fraction={'/'.join(map(str, fracs))}"
        return (f"TorchSession({len(self.devices)} {kind} device(s), {state}, "
                f"PYTORCH_CUDA_ALLOC_CONF={self._torch_conf.as_conf()!r}{frac})")

    # ------------------------------------------------------------------ allocation
    def _allocate_on(self, dev: Device, nbytes: int) -> int:
        """PyTorch's malloc: no deferred frees to wait for (it raises PyTorch's
        OutOfMemoryError itself)."""
        return dev.allocator.allocate(nbytes)

    def free(self, ptr: int, device: Any = None) -> None:
        """Free at once, as PyTorch does (the block is cached for the next request of its
        stream; :meth:`empty_cache` returns wholly free segments to the device).

        Raises
        ------
        InvalidPointerError
            For an address not allocated here or already freed.
        ConfigError
            After :meth:`close`."""
        self.free_now(ptr, device)

    # ------------------------------------------------------------------ live settings
    def configure(self, per_process_gpu_memory_fraction: float | None = None,
                  allow_growth: bool | None = None, deferred_deletion_bytes: int | None = None,
                  device: Any = None, *, fraction: float | None = None,
                  conf: str | None = None, **parts: Any) -> None:
        """Change settings live, as PyTorch takes them (see the class notes for what takes
        effect when).

        Parameters
        ----------
        per_process_gpu_memory_fraction, fraction : float, optional
            ``torch.cuda.set_per_process_memory_fraction`` (in [0, 1]), on ``device`` or
            every device.
        conf : str, optional
            ``torch.cuda.memory._set_allocator_settings(conf)`` on every device.
        **parts
            Settings by name, the others kept: ``expandable_segments``,
            ``max_split_size_mb`` (None: unset), ``garbage_collection_threshold`` (0: off),
            ``roundup_power2_divisions``, ``max_non_split_rounding_mb``. PyTorch's settings
            are process-wide: they apply to every device whatever ``device`` says.
        allow_growth, deferred_deletion_bytes
            TensorFlow's: refused, saying what PyTorch has instead.

        Raises
        ------
        ConfigError
            A bad or TensorFlow-only value, naming it; every value is checked first and
            nothing changes unless all are good.
        """
        self._check_open()
        for key, value in (("allow_growth", allow_growth),
                           ("deferred_deletion_bytes", deferred_deletion_bytes)):
            if value is not None:
                TORCH.check_setting(key, value)
        if per_process_gpu_memory_fraction is not None and fraction is not None and \
                per_process_gpu_memory_fraction != fraction:
            raise ConfigError(f"fraction={fraction!r} and per_process_gpu_memory_fraction="
                              f"{per_process_gpu_memory_fraction!r} disagree: give one")
        frac = fraction if fraction is not None else per_process_gpu_memory_fraction
        if frac is not None:
            TORCH.check_setting("fraction", frac)
        for key, value in parts.items():
            TORCH.check_setting(key, value)
        new = self._torch_conf.copy()
        if conf is not None:
            new.apply(conf)
        if parts:
            new.update(**parts)
        if (conf is not None or parts) and new.unsupported() is not None:
            warn_user(new.unsupported())
        for dev in self.devices:      # what PyTorch would take live and later pay for
            TORCH.check_live_split(dev.allocator.chunk_table(), self._torch_conf.max_split_size,
                                   new.max_split_size, dev.name)
        targets = self.devices if device is None else [self.device(device)]
        with self._lock:
            if conf is not None or parts:
                for dev in self.devices:
                    if conf is not None:
                        dev.allocator.set_allocator_settings(conf)
                    if parts:
                        dev.allocator.configure(**parts)
                self._torch_conf = new
            if frac is not None:
                for dev in targets:
                    dev.allocator.set_memory_fraction(float(frac))
                if device is None:
                    self._torch_fraction = float(frac)

    def empty_cache(self, device: Any = None) -> int:
        """``torch.cuda.empty_cache()``: every wholly free cached segment (and the free pages
        of expandable segments) goes back to its device (every device by default); the
        bytes returned."""
        self._check_open()
        devices = self.devices if device is None else [self.device(device)]
        return sum(d.allocator.release_free_regions() for d in devices)

    def install(self) -> "Session":
        """Not for a PyTorch session: CuPy routing is TensorFlow's sessions' (see below).

        Raises
        ------
        BackendUnavailableError
            Always: PyTorch's model gives expandable segments virtual addresses that no CUDA
            mapping backs (gpudash maps no virtual memory), and PyTorch code allocates
            through PyTorch's own allocator, which ``gpudash.watch("torch")`` watches."""
        raise BackendUnavailableError(
            "install() routes CuPy through a TensorFlow-style session (gpudash.Session()); a "
            "PyTorch session models PyTorch's caching allocator, whose expandable segments get "
            "virtual addresses no CUDA mapping backs here. To see PyTorch's real allocator "
            "use gpudash.watch('torch'); to route CuPy use gpudash.Session()")


class _PinnedBlock:
    """Pinned host memory handed to CuPy; returned to the host BFC when CuPy drops it."""

    def __init__(self, allocator: BFCAllocator, ptr: int, size: int) -> None:
        self.allocator = allocator
        self.ptr = ptr
        self.size = size

    def __int__(self) -> int:
        return self.ptr

    def __del__(self) -> None:
        try:
            self.allocator.deallocate(self.ptr)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


_default: Session | None = None
_default_lock = threading.Lock()


def default_session(create: bool = True, **kwargs: Any) -> Session | None:
    """The session ``%gpudash`` and the notebooks share; created on first use (with
    ``allow_soft_placement=True``, so it falls back to a simulated device without a GPU).

    Parameters
    ----------
    create : bool
        Create one when there is none (or it was closed); else return None.
    **kwargs
        Passed to :class:`Session` when one is created (``allocator="torch"`` makes a
        :class:`TorchSession`, from the environment's ``PYTORCH_CUDA_ALLOC_CONF``).
    """
    global _default
    with _default_lock:
        if (_default is None or _default.closed) and create:
            # a PyTorch session's config is a PYTORCH_CUDA_ALLOC_CONF string, no ConfigProto
            made = Session.class_for(kwargs.get("allocator") or "tensorflow")
            if "config" not in kwargs and made.takes_config_proto:
                kwargs["config"] = ConfigProto(allow_soft_placement=True)
            _default = Session(**kwargs)
        if _default is not None and _default.closed:
            return None
        return _default


def set_default_session(session: Session | None) -> None:
    """Make ``session`` the default session (None forgets it)."""
    global _default
    with _default_lock:
        _default = session
