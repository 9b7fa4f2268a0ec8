"""gpudash's exceptions and warnings.

One root, mapped at the edges (a backend's own error is re-raised as one of these with
``raise ... from exc``)::

    GpudashError
     +-- OutOfMemoryError        (also MemoryError)   an allocation could not be served
     +-- InvalidPointerError     (also ValueError)    a pointer never allocated, or freed twice
     +-- ConfigError             (also ValueError)    a bad option value; names field and value
     +-- BackendUnavailableError (also RuntimeError)  CUDA / NVML / CuPy not usable here
     +-- TraceFormatError        (also ValueError)    a trace file that cannot be read

    GpudashWarning (UserWarning)                      gpudash's own warnings
"""

from __future__ import annotations

__all__ = [
    "GpudashError",
    "OutOfMemoryError",
    "InvalidPointerError",
    "ConfigError",
    "BackendUnavailableError",
    "TraceFormatError",
    "GpudashWarning",
]


class GpudashError(Exception):
    """Root of every error gpudash raises on purpose."""


class OutOfMemoryError(GpudashError, MemoryError):
    """An allocation could not be served.

    Attributes
    ----------
    requested : int
        Bytes the caller asked for.
    rounded : int
        The request rounded up to the allocator's 256-byte unit.
    allocator : str
        Name of the allocator (``GPU_0_bfc``).
    memory_log : str
        TensorFlow's ``DumpMemoryLog`` text at the moment of failure.
    """

    def __init__(self, message: str, *, requested: int = 0, rounded: int = 0,
                 allocator: str = "", memory_log: str = "") -> None:
        super().__init__(message)
        self.requested = requested
        self.rounded = rounded
        self.allocator = allocator
        self.memory_log = memory_log


class InvalidPointerError(GpudashError, ValueError):
    """A pointer that this allocator never handed out, or one already freed."""


class ConfigError(GpudashError, ValueError):
    """A bad configuration value. The message names the field, the value and what is accepted."""


class BackendUnavailableError(GpudashError, RuntimeError):
    """A hardware backend (CUDA through CuPy, NVML) cannot be used on this machine."""


class TraceFormatError(GpudashError, ValueError):
    """A trace file that cannot be read: names the file, the line or record, and what was expected."""


class GpudashWarning(UserWarning):
    """A warning from gpudash (a subscriber that raised, an ignored environment variable...)."""


def warn_user(message: str, category: type[Warning] = GpudashWarning) -> None:
    """``warnings.warn`` pointed at the first caller outside gpudash, however deep the call
    that warns (so the warning names the user's line, not gpudash's)."""
    import os
    import sys
    import warnings

    pkg = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(1)
    level = 2  # warnings.warn's stacklevel of sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(pkg):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
