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
from .format import Trace, _EventBuilder, _open_regular, _source_name

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
    name = _source_name(path_or_file)
    try:
        if isinstance(path_or_file, (str, os.PathLike)):
            with _open_regular(path_or_file) as f:
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
        expected).
    """
    if isinstance(path_or_file, dict):
        name, data = "<dict>", path_or_file
        if not isinstance(data.get("steps"), list):
            raise TraceFormatError(f"{name}: expected a JSON object with a 'steps' list")
    else:
        name, data = _source_name(path_or_file), load_vector_json(path_or_file)
    b = _EventBuilder()
    limit = data.get("memory_limit")
    options = {k: data[k] for k in ("memory_limit", "allow_growth", "garbage_collection")
               if k in data}
    b.add_device(0, data.get("allocator_name", ALLOCATOR_NAME), limit, options or None)
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
    for k in ("workload", "seed", "memory_limit", "allow_growth", "garbage_collection"):
        if k in data:
            meta[k] = data[k]
    meta["stats"] = stats
    return b.build(meta)


def _short(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."
