"""Import TensorFlow's step-by-step allocator vectors (the JSON ``steps`` format).

Each file is one run of TensorFlow's real BFC allocator, recorded call by call::

    {"source": "...", "workload": "random", "seed": 101, "memory_limit": 68719476736,
     "allow_growth": true, "garbage_collection": false,
     "steps": [["region", ptr, size], ["alloc", nbytes, ptr], ["free", ptr],
               ["oom", nbytes], ["stats", bytes_in_use, peak_bytes_in_use], ...]}

``region`` becomes an ``extend`` event, ``alloc``/``free``/``oom`` their events; ``stats`` steps
go to ``meta["stats"]`` as ``[row, bytes_in_use, peak_bytes_in_use]`` where ``row`` is the
index of the last event before the step (-1 when none). The files carry no times: an event's
``time_ns`` is its step index * 1000.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from .._errors import TraceFormatError
from .format import Trace, EventBuilder, parse_byte_count, parse_flag, open_regular, source_name

__all__ = ["load_tf_vectors", "load_vector_json"]

#: Name TensorFlow gives the CPU BFC allocator these vectors were recorded from.
ALLOCATOR_NAME = "bfc_cpu_allocator_for_gpu"

_ARITY = {"region": 2, "alloc": 2, "free": 1, "oom": 1, "stats": 2}


def load_vector_json(path_or_file: str | os.PathLike | IO) -> dict:
    """The raw dict of a vector file (checked to have a ``steps`` list).

    Raises
    ------
    TraceFormatError
        Not JSON, or no ``steps`` list.
    """
    name = source_name(path_or_file)
    try:
        if isinstance(path_or_file, (str, os.PathLike)):
            with open_regular(path_or_file) as f:
                data = json.load(f)
        else:
            data = json.load(path_or_file)
    except TraceFormatError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{name}: not a JSON vector file ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise TraceFormatError(f"{name}: expected a JSON object with a 'steps' list")
    return data


def load_tf_vectors(path_or_file: str | os.PathLike | IO | dict) -> Trace:
    """Load a vector file (or its already-parsed dict) as a :class:`Trace`.

    Parameters
    ----------
    path_or_file : str, os.PathLike, file object or dict

    Returns
    -------
    Trace
        One device (``bfc_cpu_allocator_for_gpu``, capacity = ``memory_limit``); meta has
        ``source="tf-vectors"``, the file's own ``source`` as ``source_detail``, its
        ``workload``, ``seed``, ``memory_limit``, ``allow_growth``, ``garbage_collection`` and
        ``stats``.

    Raises
    ------
    TraceFormatError
        A step that is not one of the five forms (names the step index and what was
        expected), a ``memory_limit`` that is not a whole number of bytes, or an
        ``allow_growth``/``garbage_collection`` that is not true or false.
    """
    if isinstance(path_or_file, dict):
        name, data = "<dict>", path_or_file
        if not isinstance(data.get("steps"), list):
            raise TraceFormatError(f"{name}: expected a JSON object with a 'steps' list")
    else:
        name, data = source_name(path_or_file), load_vector_json(path_or_file)
    settings = _settings(data, name)
    b = EventBuilder()
    limit = settings.get("memory_limit")
    b.add_device(0, data.get("allocator_name", ALLOCATOR_NAME), limit, settings or None)
    stats: list[list[int]] = []
    for i, step in enumerate(data["steps"]):
        if (not isinstance(step, list) or not step or step[0] not in _ARITY
                or len(step) != _ARITY[step[0]] + 1
                or not all(isinstance(v, int) for v in step[1:])):
            raise TraceFormatError(
                f"{name}: step {i} is {_short(step)}; expected one of [\"region\", ptr, size], "
                "[\"alloc\", nbytes, ptr], [\"free\", ptr], [\"oom\", nbytes], "
                "[\"stats\", bytes_in_use, peak]")
        op, t = step[0], i * 1000
        if op == "alloc":
            b.alloc(t, 0, step[2], step[1])
        elif op == "free":
            b.free(t, 0, step[1])
        elif op == "region":
            b.extend(t, 0, step[1], step[2])
        elif op == "oom":
            b.oom(t, 0, step[1])
        else:
            stats.append([len(b) - 1, step[1], step[2]])
    meta: dict[str, Any] = {"source": "tf-vectors", "allocator_name": ALLOCATOR_NAME}
    if "source" in data:
        meta["source_detail"] = data["source"]
    for k in ("workload", "seed"):
        if k in data:
            meta[k] = data[k]
    meta.update(settings)
    meta["stats"] = stats
    return b.build(meta)


def _settings(data: dict, name: str) -> dict[str, Any]:
    """The file's ``memory_limit`` (bytes, an integer >= 0), ``allow_growth`` and
    ``garbage_collection`` (JSON true or false), those it has; a TraceFormatError naming
    the file and field for other values (the string "false" included)."""
    out: dict[str, Any] = {}
    for key, check in (("memory_limit", parse_byte_count), ("allow_growth", parse_flag),
                       ("garbage_collection", parse_flag)):
        if key in data:
            try:
                out[key] = check(data[key])
            except ValueError as exc:
                raise TraceFormatError(f"{name}: '{key}' is {exc}") from None
    allocator = data.get("allocator_name", ALLOCATOR_NAME)
    if not isinstance(allocator, str):
        raise TraceFormatError(f"{name}: 'allocator_name' is {_short(allocator)}; expected a "
                               "string")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."
