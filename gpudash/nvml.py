"""Device facts from NVML: name, UUID, memory, this process's usage, compute capability.

NVML (the ``pynvml`` module of nvidia-ml-py) is loaded lazily and initialised once, under a
lock, the first time a fact is asked for; ``nvmlShutdown`` runs at exit. A machine without an
NVIDIA driver is a fact to report, not an error: :func:`nvml_available` says why, and
:func:`device_facts` returns an empty list. A query that fails on one device gives :data:`NA`
for that field only.

:func:`gpu_processes` lists every process on each device with its memory (NVML's compute and
graphics lists), marking this process.

NVML sees devices in its own (PCI) order and ignores ``CUDA_VISIBLE_DEVICES``; its index is
not necessarily CUDA's. NVML knows nothing of allocators: ``used`` counts every process,
CUDA contexts and memory cached by allocators.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import threading
import uuid as _uuid
from typing import Any

from ._errors import ConfigError
from ._units import format_bytes

__all__ = ["NA", "DeviceFacts", "ProcessInfo", "device_facts", "format_processes",
           "gpu_processes", "nvml_available", "nvml_index_of_uuid", "simulated_facts"]


class _NAType:
    """The "not available" value of a fact: falsy, prints as ``N/A``, one instance."""

    __slots__ = ()
    _instance: _NAType | None = None

    def __new__(cls):  # always the one instance
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "N/A"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        try:
            return format("N/A", spec)
        except ValueError:  # a numeric spec such as ",d"
            return "N/A"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "NA"


#: A fact that could not be read.
NA: Any = _NAType()

# The pynvml-like library to use; None means "import pynvml" on first use. Tests replace it
# through _use_library().
_nvml: Any = None

_lock = threading.RLock()
_state: tuple[bool, str] | None = None
_lib: Any = None
_atexit_registered = False

# NVML return codes (nvml.h); read from the library when it defines them.
_ERRORS = {
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
}


def _code(lib: Any, name: str) -> int:
    return getattr(lib, name, _ERRORS[name])


def _errors(lib: Any) -> tuple[type[BaseException], ...]:
    """What a failing NVML call raises: the library's NVMLError, or a missing or
    mismatched function (an old pynvml, an old driver), or the shared library itself."""
    err = getattr(lib, "NVMLError", None)
    base = (err,) if isinstance(err, type) and issubclass(err, BaseException) else ()
    return (*base, OSError, AttributeError, TypeError, ValueError)


def _reason(lib: Any, exc: BaseException) -> str:
    value = getattr(exc, "value", None)
    if value == _code(lib, "NVML_ERROR_LIBRARY_NOT_FOUND"):
        return "NVML library not found (no NVIDIA driver)"
    if value == _code(lib, "NVML_ERROR_DRIVER_NOT_LOADED"):
        return "NVIDIA driver not loaded"
    if value == _code(lib, "NVML_ERROR_NO_PERMISSION"):
        return "no permission to use NVML"
    return f"NVML could not be initialised: {exc}"


def _init() -> tuple[bool, str]:
    """Initialise NVML once; return (ok, reason). Never raises."""
    global _state, _lib, _atexit_registered
    with _lock:
        if _state is not None:
            return _state
        lib = _nvml
        if lib is None:
            try:
                import pynvml as lib
            except ImportError as exc:
                _state = (False, f"nvidia-ml-py (pynvml) is not installed: {exc}")
                return _state
        try:
            lib.nvmlInit()
        except _errors(lib) as exc:
            _state = (False, _reason(lib, exc))
            return _state
        _lib = lib
        _state = (True, "")
        if not _atexit_registered:
            atexit.register(_shutdown)
            _atexit_registered = True
        return _state


def _shutdown() -> None:
    """``nvmlShutdown`` if NVML was initialised; the next query initialises it again."""
    global _state, _lib
    with _lock:
        lib, _lib, _state = _lib, None, None
        if lib is not None:
            with contextlib.suppress(*_errors(lib)):  # at exit nothing useful can be done
                lib.nvmlShutdown()


def _use_library(lib: Any) -> None:
    """Use ``lib`` (a pynvml-like object; None = the real pynvml) from now on (tests)."""
    global _nvml
    with _lock:
        _shutdown()
        _nvml = lib


def nvml_available() -> tuple[bool, str]:
    """Whether NVML can be used, and why not.

    Returns
    -------
    (bool, str)
        ``(True, "")``, or ``(False, reason)`` such as
        ``"NVML library not found (no NVIDIA driver)"``. Never raises.
    """
    return _init()


@dataclasses.dataclass
class DeviceFacts:
    """What is known about one device. A field that could not be read is :data:`NA`.

    Attributes
    ----------
    index : int
        NVML's device index (or the simulated device's index).
    name : str
        Product name (``"NVIDIA H100 80GB HBM3"``).
    uuid : str
        ``GPU-...`` (simulated devices: ``SIM-...``, stable for a name and index).
    total, free, used : int
        Device memory in bytes, all processes together.
    process_used : int
        Bytes this process holds on the device, from the compute processes NVML lists. In a
        container without ``--pid=host`` NVML reports host PIDs, so this reads 0.
    compute_capability : tuple of int
        ``(major, minor)``.
    source : str
        ``"nvml"`` or ``"simulated"``.
    """

    index: int
    name: Any
    uuid: Any
    total: Any
    free: Any
    used: Any
    process_used: Any
    compute_capability: Any
    source: str = "nvml"


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _query(lib: Any, index: int, handle: Any) -> DeviceFacts:
    errors = _errors(lib)

    def get(fn: str, *args: Any) -> Any:
        try:
            return getattr(lib, fn)(*args)
        except errors:
            return NA

    name = get("nvmlDeviceGetName", handle)
    uid = get("nvmlDeviceGetUUID", handle)
    mem = get("nvmlDeviceGetMemoryInfo", handle)
    if mem is NA:
        total = free = used = NA
    else:
        total, free, used = int(mem.total), int(mem.free), int(mem.used)

    procs = get("nvmlDeviceGetComputeRunningProcesses", handle)
    process_used: Any = NA
    if procs is not NA:
        pid = os.getpid()
        process_used = 0
        for p in procs:
            if getattr(p, "pid", None) == pid:
                mine = getattr(p, "usedGpuMemory", None)
                if mine is None:  # NVML_VALUE_NOT_AVAILABLE (WDDM, some containers)
                    process_used = NA
                    break
                process_used += int(mine)

    cc = get("nvmlDeviceGetCudaComputeCapability", handle)
    if cc is not NA:
        cc = (int(cc[0]), int(cc[1]))

    return DeviceFacts(
        index=index,
        name=NA if name is NA else _text(name),
        uuid=NA if uid is NA else _text(uid),
        total=total, free=free, used=used,
        process_used=process_used,
        compute_capability=cc,
        source="nvml",
    )


def device_facts(index: int | None = None) -> list[DeviceFacts]:
    """Facts about every NVML device, or about one.

    Parameters
    ----------
    index : int, optional
        One NVML device index; None for all.

    Returns
    -------
    list of DeviceFacts
        Empty when NVML is not available (no driver) or cannot count the devices.

    Raises
    ------
    ConfigError
        If ``index`` is given and NVML sees no such device.
    """
    ok, _ = _init()
    if not ok:
        return []
    with _lock:
        lib = _lib
    if lib is None:  # shut down meanwhile
        return []
    try:
        count = int(lib.nvmlDeviceGetCount())
    except _errors(lib):
        return []
    if index is None:
        indices = range(count)
    elif isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ConfigError(
            f"device index must be an integer in [0, {count}) (NVML sees {count} "
            f"device(s)); got {index!r}"
        )
    else:
        indices = range(index, index + 1)
    facts = []
    for i in indices:
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(i)
        except _errors(lib):
            facts.append(DeviceFacts(i, NA, NA, NA, NA, NA, NA, NA, "nvml"))
            continue
        facts.append(_query(lib, i, handle))
    return facts


def simulated_facts(device: Any) -> DeviceFacts:
    """The facts of a :class:`~gpudash.SimulatedDevice`, in the same shape as NVML's.

    ``process_used`` is the device's ``used`` (the simulated device belongs to this process).
    """
    uid = _uuid.uuid5(_uuid.NAMESPACE_URL, f"gpudash-simulated:{device.name}:{device.index}")
    free, total = device.memory_info()
    return DeviceFacts(
        index=device.index,
        name=device.name,
        uuid=f"SIM-{uid}",
        total=total,
        free=free,
        used=device.used,
        process_used=device.used,
        compute_capability=tuple(device.compute_capability),
        source="simulated",
    )


# --------------------------------------------------------------------------------------------
# Who else is on the GPU


@dataclasses.dataclass
class ProcessInfo:
    """One process NVML lists on a device.

    Attributes
    ----------
    pid : int
        As NVML reports it (a host PID: in a container without ``--pid=host`` it does not
        match the container's PIDs, and ``is_self`` is then never True).
    kind : str
        ``"compute"``, ``"graphics"`` or ``"compute+graphics"``.
    used : int
        Device memory NVML attributes to the process (:data:`NA` when the driver cannot
        say: WDDM, some containers, MIG without permissions).
    name : str
        The process name (NVML's, else ``/proc/PID/comm``), or :data:`NA`.
    is_self : bool
        This process (the one running gpudash).
    framework : str or None
        For this process, the framework being watched in it (``"jax"``...), else None.
    """

    pid: int
    kind: str
    used: Any
    name: Any
    is_self: bool = False
    framework: str | None = None

    @property
    def label(self) -> str:
        """``"python (this process: gpudash, jax)"`` and the like."""
        name = str(self.name)
        if self.is_self:
            who = "gpudash" + (f", {self.framework}" if self.framework else "")
            return f"{name} (this process: {who})"
        return name


def _process_name(lib: Any, pid: int) -> Any:
    try:
        return _text(lib.nvmlSystemGetProcessName(pid))
    except _errors(lib):
        pass
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip() or NA
    except OSError:
        return NA


def gpu_processes(index: int | None = None, framework: str | None = None
                  ) -> dict[int, list[ProcessInfo]]:
    """Every process on each device, with its memory: NVML's compute and graphics lists.

    Parameters
    ----------
    index : int, optional
        One NVML device; default all.
    framework : str, optional
        The framework watched in this process (marks this process's rows).

    Returns
    -------
    dict of int to list of ProcessInfo
        NVML index -> processes, largest memory first (a process in both lists appears once,
        as ``compute+graphics``). Empty when NVML is not available
        (:func:`nvml_available` says why). A device whose lists cannot be read maps to
        ``[]``.

    Raises
    ------
    ConfigError
        If ``index`` is given and NVML sees no such device.
    """
    facts = device_facts(index)  # validates index, initialises NVML
    with _lock:
        lib = _lib
    if lib is None or not facts:
        return {}
    errors = _errors(lib)
    me = os.getpid()
    out: dict[int, list[ProcessInfo]] = {}
    for f in facts:
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(f.index)
        except errors:
            out[f.index] = []
            continue
        rows: dict[int, ProcessInfo] = {}
        for kind, fn in (("compute", "nvmlDeviceGetComputeRunningProcesses"),
                         ("graphics", "nvmlDeviceGetGraphicsRunningProcesses")):
            try:
                procs = getattr(lib, fn)(handle)
            except errors:
                continue
            for p in procs:
                pid = int(getattr(p, "pid", -1))
                used = getattr(p, "usedGpuMemory", None)
                used = NA if used is None else int(used)
                row = rows.get(pid)
                if row is None:
                    rows[pid] = ProcessInfo(pid, kind, used, _process_name(lib, pid),
                                            is_self=pid == me,
                                            framework=framework if pid == me else None)
                else:  # in both lists: the same memory, counted once
                    row.kind = "compute+graphics"
                    if row.used is NA:
                        row.used = used
        out[f.index] = sorted(rows.values(),
                              key=lambda r: (-(r.used if r.used is not NA else -1), r.pid))
    return out


def nvml_index_of_uuid(uuid: str) -> int | None:
    """The NVML index of the device with this UUID (``GPU-...``, or the bare hex form that
    ``torch.cuda.get_device_properties(i).uuid`` prints); None when unknown."""
    want = str(uuid).lower().removeprefix("gpu-")
    for f in device_facts():
        if isinstance(f.uuid, str) and f.uuid.lower().removeprefix("gpu-") == want:
            return f.index
    return None


def format_processes(processes: dict[int, list[ProcessInfo]], indent: str = "    ") -> list[str]:
    """Text lines for :func:`gpu_processes`' result (``gpudash info``)."""
    lines = []
    for index, rows in processes.items():
        if not rows:
            lines.append(f"{indent}GPU {index}: no processes")
            continue
        lines.append(f"{indent}GPU {index}: {len(rows)} process(es)")
        for r in rows:
            used = _fmt_bytes(r.used)
            lines.append(f"{indent}  pid {r.pid:>7}  {used:>11}  {r.kind:<16} {r.label}")
    return lines


def _fmt_bytes(value: Any) -> str:
    return format_bytes(value) if isinstance(value, int) and not isinstance(value, bool) \
        else "N/A"
