"""Fuzz every trace reader: a trace or a TraceFormatError, never another exception.

Seeds are small valid files of every format ``load_trace`` reads (written with gpudash's own
writers, plus the samples in ``tests/data``). Each case mutates one seed: truncation, bit
flips, byte runs, huge numbers (400 digits, 2**63, 2**64, negative), NaN/Infinity, wrong JSON
types, deep nesting. Each mutant is loaded twice, sniffed and with its seed's format forced.
Any exception other than :class:`gpudash.TraceFormatError` is a failure, and so is a load
that takes more than 30 s (a hang).

Hostile families (a share of the cases, ``--hostile``) are built, not mutated, up to 2 MB:

- ``fifo``: the case is a FIFO (``--commands``: also a link to ``/dev/zero``);
- ``longline``: one line made of a prefix of a real log line repeated (what makes a
  pattern backtrack), in a log, a CSV, JSON lines;
- ``memo``: pickles that repeat entries, blocks, lists, settings or actions by reference;
- ``meta``: odd metadata and numbers: gdtrace ``devices`` and options of every wrong type,
  negative sizes, requested sizes and devices, tf-vectors limits, CuPy and RMM values;
- ``devices``: thousands of devices (RMM 0.12 device ids, profile allocators, PyTorch
  device lists, CuPy device ids), up to and beyond the 32,768 a trace holds;
- ``floats``: NaN, infinities and 1e30 where numbers are read (profile doubles, times,
  limits);
- ``npy``: a gdtrace batch whose ``.npy`` header is damaged, its CRC made valid;
- ``bomb``: pickles of 9 bytes to a few KB that cost gigabytes or hours if unpickled or
  shown naively: a memo index of up to 2**32 (PUT, BINPUT, LONG_BINPUT), a tuple chain
  shared at every level used as a dict key or set element (hashing it walks 2**depth
  tuples), a list chain shared at every level where a message would show it (a frame, a
  stream, a size, an annotation), and a number of thousands of digits in those places;
- ``oommsg``: real PyTorch out-of-memory messages (``tests/data/torch_oom``) with figures of
  hundreds to 20,000 digits or NVML's 2**64 bytes, lines broken after hyphens, repeated up
  to 2 MB (what ``gpudash explain`` reads);
- ``snapfit``: a real JSON snapshot whose trace does not fit its segments (frees of unknown
  blocks inside segments, segment frees, maps and unmaps over live blocks or of 0 bytes,
  allocs at odd addresses; mid-run or from the start; segments marked expandable).

Run: ``python benchmarks/fuzz_inputs.py [--cases N] [--seed S] [--seconds T] [--hostile P]``.
Prints the outcomes per format and mutation, the slowest load, and every failure with its
reproducer path; exits 1 on a failure.

``--commands`` (``--families a,b`` to draw hostile files from some families only) runs the
command line instead: each case through ``gpudash replay``,
``gpudash explain`` and ``gpudash convert`` in a process of its own (30 s limit), and reports
files fuzzed, command runs, tracebacks (exit code 70, a Python traceback, a warning that is not
a GpudashWarning, an error that is not one ``gpudash: error:`` line, an exit code other than
0, 1 and 3), hangs, the slowest run and the largest peak RSS (``wait4``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpudash import TraceFormatError  # noqa: E402
from gpudash.trace import Trace, load_trace, save_trace  # noqa: E402
from gpudash.workloads import training_loop  # noqa: E402

DATA = ROOT / "tests" / "data"
HUGE = ["9" * 400, str(1 << 63), str(1 << 64), "-1", "-99999999999999999999", "1e400",
        "32768", "0x" + "f" * 40]
JSON_VALUES = ["NaN", "Infinity", "-Infinity", "[]", "{}", '"x"', "null", "true", "5", "1.5",
               "[" * 5000 + "]" * 5000, str(1 << 63), "9" * 400, "-5"]


def seeds(workdir: Path) -> dict[str, bytes]:
    """Format name -> the bytes of a small valid file of that format."""
    trace = training_loop(steps=1, layers=2, batch=4, hidden=64)
    out: dict[str, bytes] = {}
    for fmt, ext in (("gdtrace", "gdtrace"), ("torch-json", "json"),
                     ("torch-pickle", "pickle")):
        path = workdir / f"seed.{ext}"
        save_trace(trace, path, format=fmt, overwrite=True)
        out[fmt] = path.read_bytes()
    files = {"rmm-csv": DATA / "traces" / "rmm_log.dev1.csv",
             "cupy-hook": DATA / "traces" / "cupy_debug.jsonl",
             "tf-log": DATA / "traces" / "tf_gpu_two_allocators.log",
             "tf-vectors": DATA / "random_101.json",
             "xplane": DATA / "real" / "tf_mlp_training.xplane.pb"}
    for fmt, path in files.items():
        if path.exists():
            data = path.read_bytes()
            out[fmt] = data[:20_000] if fmt in ("rmm-csv", "cupy-hook", "tf-log") else data
    return out


def _numbers(data: bytes) -> list[re.Match]:
    return list(re.finditer(rb"-?\d+(?:\.\d+)?|0x[0-9a-fA-F]+", data[:200_000]))


def mutate(data: bytes, rng: random.Random, fmt: str) -> tuple[str, bytes]:
    """One mutant of ``data``: (the mutation's name, the bytes)."""
    kind = rng.choice(["truncate", "bitflip", "bytes", "huge", "json", "nest", "pickle"])
    if fmt == "gdtrace" and rng.random() < 0.5:
        return "recrc", _recrc(data, rng)
    if kind == "truncate":
        return kind, data[:rng.randrange(0, len(data))]
    if kind == "bitflip":
        buf = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        return kind, bytes(buf)
    if kind == "bytes":
        i = rng.randrange(len(data))
        return kind, data[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))) \
            + data[i + rng.randint(0, 64):]
    if kind in ("huge", "json"):
        nums = _numbers(data)
        if not nums:
            return "truncate", data[:len(data) // 2]
        m = rng.choice(nums)
        pool = HUGE if kind == "huge" else JSON_VALUES
        return kind, data[:m.start()] + rng.choice(pool).encode() + data[m.end():]
    if kind == "nest":
        depth = rng.choice([100, 5000, 100_000])
        return kind, (b'{"segments": ' + b"[" * depth + b"]" * depth + b"}") if fmt.startswith(
            "torch") else data[:len(data) // 2] + b"[" * depth + b"{" * depth
    # a pickle of odd types, or one whose memo repeats a list (for pickle seeds only)
    obj = rng.choice([
        {"segments": 5}, {"segments": [{"blocks": 5}]}, {"device_traces": {}},
        {"segments": [{"device": 0, "address": 0, "total_size": 512,
                       "blocks": [{"size": 512, "state": ["x"], "history": {}}]}]},
        {"device_traces": [[{"action": "alloc", "addr": 1 << 64, "size": 5,
                             "time_us": float("nan")}]]},
        {"device_traces": [[{"action": "alloc", "addr": 256, "size": -512,
                             "time_us": float("inf")}]]},
        [[1, 2], "x"], 7, None,
    ])
    return "pickle", pickle.dumps(obj, protocol=rng.choice([0, 2, 4]))


def _recrc(data: bytes, rng: random.Random) -> bytes:
    """A .gdtrace with one record's JSON header or payload changed and its crc32 made
    valid again, so that only the reader's own checks can refuse it."""
    import struct
    import zlib

    from gpudash.formats.format import _RECORD, MAGIC

    out, off, records = bytearray(data[:len(MAGIC)]), len(MAGIC), []
    while off + _RECORD.size <= len(data):
        magic, rtype, jlen, plen, _crc = _RECORD.unpack_from(data, off)
        body = off + _RECORD.size
        records.append([rtype, bytearray(data[body:body + jlen]),
                        bytearray(data[body + jlen:body + jlen + plen])])
        off = body + jlen + plen
    if not records:
        return data
    rec = rng.choice(records)
    part = rec[1] if not rec[2] or rng.random() < 0.5 else rec[2]
    if part:
        i = rng.randrange(len(part))
        if part is rec[1] and rng.random() < 0.5:  # a number in the header changed
            nums = _numbers(bytes(part))
            if nums:
                m = rng.choice(nums)
                rec[1] = bytearray(part[:m.start()] + rng.choice(HUGE + JSON_VALUES).encode()
                                   + part[m.end():])
        else:
            part[i] = rng.randrange(256)
    for rtype, js, payload in records:
        head = _RECORD.pack(b"GDRC", rtype, len(js), len(payload), 0)[:20]
        crc = zlib.crc32(payload, zlib.crc32(js, zlib.crc32(head)))
        out += head + struct.pack("<I", crc) + js + payload
    return bytes(out)


# ============================================================================ hostile files
FAMILIES = ("fifo", "longline", "memo", "meta", "devices", "floats", "npy", "bomb", "oommsg",
            "snapfit")
MAX_BYTES = 2_000_000
_GLOG = "I0000 00:00:1796221057.331741   10338 bfc_allocator.cc:176] "
_LOG_LINES = [
    "Allocator (GPU_0_bfc) ran out of memory trying to allocate 1.00GiB (rounded to "
    "1073741824) requested by op MatMul",
    "Extending allocation by 2.00MiB bytes for GPU_0_bfc.",
    "[mem-debug] AllocateRaw,GPU_0_bfc,8,0x7f72cab1e040,1",
    "Allocated memory at 0x7f72cab1e040 to 0x7f72cad1e040",
    "Bin (256): Total Chunks: 1, Chunks in use: 1. 256B allocated for chunks. 256B in use in "
    "bin. 4B client-requested in use in bin.",
    "InUse at 7fd01adff040 of size 3145728 next 31",
    "Total size in pool: 48.00MiB memory_limit_: 48.00MiB available size: 0B",
    "Created device /job:localhost/replica:0/task:0/device:GPU:0 with 1000 MB memory",
    "Ran out of memory trying to allocate 1.00MiB",
]
_ENTRY = {"action": "alloc", "addr": 1 << 32, "size": 512, "stream": 0, "time_us": 1,
          "frames": []}
_ODD_DEVICES = [5, True, None, "x", {}, ["x"], [None], [{"index": "0"}], [{"index": 40000}],
                [{"index": -1}], [{"index": True}], [{"index": 1.5}], [{"name": "a"}],
                [{"index": 0, "name": 7}], [{"index": 0, "capacity": "x"}],
                [{"index": 0, "capacity": -1}], [{"index": 0, "memory_limit": 1e30}],
                [{"index": 0, "options": []}], [{"index": 0, "options": {"allow_growth": "no"}}],
                [{"index": 0, "options": {"allow_growth": "false"}}],
                [{"index": 0, "options": {"garbage_collection": 1}}],
                [{"index": 0, "options": {"memory_limit": "1GiB"}}]]
_ODD_VALUES = [-1, -(1 << 63), 1 << 63, 1 << 64, 32768, 40000, True, 1.5, "x", None, [],
               float("nan"), float("inf")]


def _cap(data: bytes) -> bytes:
    return data[:MAX_BYTES]


def _gdtrace_bytes(trace, workdir: Path) -> bytes:
    from gpudash.trace import write_trace

    path = workdir / "hostile-tmp.gdtrace"
    write_trace(trace, path, overwrite=True)
    data = path.read_bytes()
    path.unlink()
    return data


def _seed_trace():
    return training_loop(steps=1, layers=2, batch=4, hidden=64)


def _long_line(rng: random.Random, base: dict[str, bytes]) -> tuple[str, bytes]:
    fmt = rng.choice(["tf-log", "tf-log", "tf-log", "rmm-csv", "cupy-hook", "torch-json"])
    size = rng.choice([10_000, 200_000, 1_000_000, MAX_BYTES - 5_000])
    if fmt == "tf-log":
        lines = [ln for ln in base.get("tf-log", b"").decode("utf-8", "replace").splitlines()
                 if ln.strip()] + _LOG_LINES
        line = rng.choice(lines)
        unit = line[:rng.randint(1, len(line))]
        if rng.random() < 0.5:
            unit += rng.choice(["(", ")", " ", "a" * 40, "1" * 40, ".", ",", "a.cc:1]"])
        head = rng.choice(["", _GLOG])
        tail = rng.choice(["", ") ran out of memory trying to allocate", " bytes for X.", "B"])
        body = head + unit * max(1, (size - len(head) - len(tail)) // len(unit)) + tail
        text = "bfc_allocator.cc:1] Creating new BFCAllocator named: GPU_0_bfc\n" + body + "\n"
        return fmt, _cap(text.encode())
    if fmt == "rmm-csv":
        field = rng.choice(["9", "0x" + "f", "1:", ",", " "]) * (size // 2)
        return fmt, _cap(f"Thread,Time,Action,Pointer,Size,Stream\n1,00:00:01.0,allocate,"
                         f"0x100,{field},0x0\n".encode())
    if fmt == "cupy-hook":
        return fmt, _cap(('{"hook":"malloc","device_id":0,"size":' + "1" * size + "}\n")
                         .encode())
    return fmt, _cap(('{"segments": [' + '{"address": 1, ' * (size // 16) + "]}").encode())


def _memo(rng: random.Random) -> tuple[str, bytes]:
    e = dict(_ENTRY)
    shape = rng.choice(["entries", "blocks", "settings", "action", "strings", "history",
                        "lists"])
    if shape == "entries":
        k = rng.choice([1000, 100_000, 900_000])
        obj = {"segments": [], "device_traces": [[e] * k] * rng.choice([1, 6, 100])}
    elif shape == "blocks":
        blk = {"size": 512, "state": "active_allocated", "requested_size": 512}
        seg = {"device": 0, "address": 1 << 40, "total_size": 512,
               "blocks": [blk] * rng.choice([1000, 100_000])}
        obj = {"segments": [seg] * rng.choice([10, 1000]), "device_traces": []}
    elif shape == "settings":
        row = list(range(rng.choice([10, 1000])))
        obj = {"segments": [], "device_traces": [[e]],
               "allocator_settings": {"x": [[row] * 1000] * rng.choice([1, 100])}}
    elif shape == "action":
        obj = {"segments": [], "device_traces": [[dict(e, action=[[0] * 1000] * 1000)] * 100]}
    elif shape == "strings":
        big = "x" * 500_000
        obj = {"segments": [], "device_traces": [[dict(e, action=big)] * 10_000],
               "allocator_settings": {"a": [big] * 100}}
    elif shape == "history":
        blk = {"size": 512, "history": [{"real_size": 1}] * 500_000}
        obj = {"segments": [{"device": 0, "address": 1, "total_size": 512,
                             "blocks": [blk] * 100}]}
    else:
        obj = {"segments": [], "device_traces": [[[e] * 1000] * 1000]}
    return "torch-pickle", _cap(pickle.dumps(obj, protocol=rng.choice([2, 4])))


def _meta(rng: random.Random, workdir: Path) -> tuple[str, bytes]:
    fmt = rng.choice(["gdtrace", "gdtrace", "tf-vectors", "cupy-hook", "rmm-csv", "torch-json"])
    value = rng.choice(_ODD_VALUES)
    if fmt == "gdtrace":
        t = _seed_trace()
        if rng.random() < 0.6:
            t.meta["devices"] = rng.choice(_ODD_DEVICES)
        else:
            col = rng.choice(["size", "requested", "device", "ptr", "alloc_id", "time_ns"])
            t.columns[col][rng.randrange(len(t))] = rng.choice([-1, -256, -(1 << 15)])
        return fmt, _gdtrace_bytes(t, workdir)
    if fmt == "tf-vectors":
        key = rng.choice(["memory_limit", "allow_growth", "garbage_collection",
                          "allocator_name"])
        return fmt, json.dumps({key: value, "steps": [["region", 4096, 1 << 20],
                                                      ["alloc", 100, 4096]]}).encode()
    if fmt == "cupy-hook":
        rec = {"hook": "malloc", "device_id": 0, "size": 24, "mem_size": 512, "mem_ptr": 4096}
        rec[rng.choice(list(rec)[1:])] = value
        return fmt, (json.dumps(rec) + "\n").encode()
    if fmt == "rmm-csv":
        text = str(value)
        return fmt, ("Event Type,Device ID,Address,Stream,Size (bytes),Free Memory,Total "
                     f"Memory,Current Allocs,Start,End,Elapsed,Location\nAlloc,{text},0x7f00,"
                     f"0x0,{rng.choice(['1024', text])},0,0,0,0.000001,0.000001,0,x.py:1\n"
                     ).encode()
    entry = dict(_ENTRY)
    entry[rng.choice(["addr", "size", "requested_size", "time_us"])] = value
    seg = {"device": rng.choice([0, value]), "address": 1 << 40, "total_size": 512,
           "blocks": [{"size": 512, "state": "active_allocated", "requested_size": value}]}
    return fmt, json.dumps({"segments": [seg], "device_traces": [[entry]]}).encode()


def _profile(n_alloc: int, per_allocator: int = 1, double: float | None = None) -> bytes:
    """An xplane profile of ``n_alloc`` allocators (``per_allocator`` events each)."""
    from gpudash.proto import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    stats = ["allocator_name", "bytes_allocated", "requested_bytes", "allocation_bytes",
             "addr"]
    for i, name in enumerate(stats, 1):
        plane.stat_metadata[i].id = i
        plane.stat_metadata[i].name = name
    first = len(stats) + 1
    for d in range(n_alloc):
        plane.stat_metadata[first + d].id = first + d
        plane.stat_metadata[first + d].name = f"GPU_{d}_bfc"
    plane.event_metadata[1].name = "MemoryAllocation"
    plane.event_metadata[2].name = "MemoryDeallocation"
    line = plane.lines.add(name="stream", timestamp_ns=1_700_000_000_000_000_000)
    t = 0
    for kind in (1, 2)[:per_allocator]:
        for d in range(n_alloc):
            ev = line.events.add(offset_ps=t * 1000, metadata_id=kind)
            t += 1
            ev.stats.add(metadata_id=1, ref_value=first + d)
            ev.stats.add(metadata_id=2, int64_value=1024 if kind == 1 else 0)
            ev.stats.add(metadata_id=3, int64_value=1000)
            if double is not None and d == 0:
                ev.stats.add(metadata_id=4, double_value=double)
            else:
                ev.stats.add(metadata_id=4, int64_value=1024)
            ev.stats.add(metadata_id=5, int64_value=0x7F0000000000)
    return space.SerializeToString()


def _devices(rng: random.Random) -> tuple[str, bytes]:
    n = rng.choice([2000, 8000, 32_768, 33_000])
    fmt = rng.choice(["rmm-csv", "xplane", "torch-json", "cupy-hook"])
    if fmt == "rmm-csv":
        rows = ["Event Type,Device ID,Address,Stream,Size (bytes),Free Memory,Total Memory,"
                "Current Allocs,Start,End,Elapsed,Location"]
        rows += [f"Alloc,{d},0x7f00,0x0,1024,0,0,0,{d * 1e-6:.6f},0,0,x" for d in range(n)]
        return fmt, _cap(("\n".join(rows) + "\n").encode())
    if fmt == "xplane":
        return fmt, _cap(_profile(min(n, 33_000)))
    if fmt == "torch-json":
        return fmt, _cap(json.dumps({"segments": [], "device_traces": [[]] * n + [
            [_ENTRY]]}).encode())
    return fmt, _cap("".join(
        json.dumps({"hook": "alloc", "device_id": d, "mem_size": 512, "mem_ptr": 4096}) + "\n"
        for d in range(n)).encode())


def _floats(rng: random.Random) -> tuple[str, bytes]:
    value = rng.choice([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 1e300, -0.0,
                        1e-300, 1024.0])
    fmt = rng.choice(["xplane", "torch-pickle", "tf-vectors", "gdtrace"])
    if fmt == "xplane":
        return fmt, _profile(3, 2, double=value)
    if fmt == "torch-pickle":
        entry = dict(_ENTRY)
        entry[rng.choice(["time_us", "size", "addr", "device_free"])] = value
        entry["action"] = "oom" if "device_free" in entry and rng.random() < 0.5 else "alloc"
        return fmt, pickle.dumps({"segments": [], "device_traces": [[entry]]}, protocol=4)
    if fmt == "tf-vectors":
        return fmt, ('{"memory_limit": %s, "steps": [["region", 4096, 1048576]]}'
                     % json.dumps(value)).encode()
    return fmt, b""   # filled in by the caller (a gdtrace with a float in its metadata)


def _npy(rng: random.Random, workdir: Path) -> tuple[str, bytes]:
    import struct
    import zlib

    from gpudash.formats.format import _RECORD, MAGIC

    data = _gdtrace_bytes(_seed_trace(), workdir)
    out, off, records = bytearray(data[:len(MAGIC)]), len(MAGIC), []
    while off + _RECORD.size <= len(data):
        _magic, rtype, jlen, plen, _crc = _RECORD.unpack_from(data, off)
        body = off + _RECORD.size
        records.append([rtype, bytes(data[body:body + jlen]),
                        bytearray(data[body + jlen:body + jlen + plen])])
        off = body + jlen + plen
    batch = next(r for r in records if r[0] == 2)
    layout = json.loads(batch[1])["columns"]
    _name, start, _nbytes = rng.choice(layout)
    payload = batch[2]
    hlen = int.from_bytes(payload[start + 8:start + 10], "little")
    garbage = rng.choice([
        b"{'descr': \"\"\"<i8', 'fortran_order': False, 'shape': (3,), }",
        b"{'descr': '<i8', 'fortran_order': False, 'shape': (3,, }",
        b"{'descr': '<i8', 'fortran_order': False, 'shape': (1e999,), }",
        b"{'descr': '<i8', 'fortran_order': False, 'shape': (-1,), }",
        b"{'descr': 'O', 'fortran_order': False, 'shape': (3,), }",
        b"{'descr': '<i8', 'fortran_order': True, 'shape': (3, 3), }",
        bytes(rng.randrange(32, 127) for _ in range(hlen - 1)),
    ])
    payload[start + 10:start + 10 + hlen] = garbage[:hlen - 1].ljust(hlen - 1) + b"\n"
    for rtype, js, pl in records:
        head = _RECORD.pack(b"GDRC", rtype, len(js), len(pl), 0)[:20]
        crc = zlib.crc32(bytes(pl), zlib.crc32(js, zlib.crc32(head)))
        out += head + struct.pack("<I", crc) + js + pl
    return "gdtrace", bytes(out)


def _bomb(rng: random.Random) -> tuple[str, bytes]:
    """A small pickle that is a memo, hash or repr bomb (see the module docstring)."""
    kind = rng.choice(["memo", "hash", "repr", "digits"])
    depth = rng.choice([20, 40, 60, 200])
    if kind == "memo":
        idx = rng.choice([1 << 27, 1 << 31, (1 << 32) - 1, 300, 10 ** 12])
        put = rng.choice(["long", "text"]) if idx < 1 << 32 else "text"
        op = (b"r" + idx.to_bytes(4, "little")) if put == "long" else b"p%d\n" % idx
        return "torch-pickle", b"\x80\x02N" + op + b"."
    # a chain of tuples (hash) or lists (repr): level k+1 holds level k twice, by memo
    out = bytearray(b"\x80\x04" + (b")" if kind == "hash" else b"]") + b"\x94")
    for k in range(depth):
        get = b"j" + k.to_bytes(4, "little")
        out += (get + get + b"\x86" if kind == "hash" else b"](" + get + get + b"e") + b"\x94"
        if kind == "repr":
            out += b"0j" + (k + 1).to_bytes(4, "little")   # keep one copy on the stack
    if kind == "hash":
        where = rng.choice(["dict", "set"])
        out += (b"}j" + depth.to_bytes(4, "little") + b"Ns" if where == "dict" else
                b"\x8f(j" + depth.to_bytes(4, "little") + b"\x90")
        return "torch-pickle", bytes(out) + b"."
    value = pickle.loads(bytes(out) + b".") if kind == "repr" else 7 ** 6000  # 5,000 digits
    entry = dict(_ENTRY)
    field = rng.choice(["frames", "stream", "size", "addr", "time_us", "annotation"])
    if field == "frames":
        entry["frames"] = [{"filename": value, "line": 1, "name": "f"}]
    elif field == "annotation":
        snap = {"segments": [], "device_traces": [[entry]],
                "external_annotations": [{"name": value, "stage": "START", "device": 0,
                                          "time_us": 1}]}
        return "torch-pickle", pickle.dumps(snap, protocol=4)
    else:
        entry[field] = value
    return "torch-pickle", pickle.dumps({"segments": [], "device_traces": [[entry]]},
                                        protocol=4)


_FIGURE = re.compile(rb"\d+(?:\.\d+)?(?= ?[KMGTPE]?i?B\b)")


def _oom_message(rng: random.Random) -> tuple[str, bytes]:
    """A real PyTorch out-of-memory message (tests/data/torch_oom) with figures of hundreds
    or thousands of digits, NVML's 2**64 figure, and lines broken after hyphens, repeated
    up to 2 MB: what ``gpudash explain`` reads."""
    files = sorted((DATA / "torch_oom").glob("*.txt"))
    data = files[rng.randrange(len(files))].read_bytes() if files else \
        b"CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.90 GiB total capacity)"

    def figure(m: re.Match) -> bytes:
        return rng.choice([b"9" * rng.choice([400, 4301, 20_000]), b"17179869184.00",
                           b"1" + b"0" * 40 + b".5", m.group(0)])

    data = _FIGURE.sub(figure, data)
    kind = rng.choice(["hyphens", "repeat", "both"])
    if kind in ("hyphens", "both"):
        # each word ends its line with a hyphen (what made reading quadratic)
        data = re.sub(rb" ", lambda _m: rng.choice([b"-\n", b" -\n", b"- ", b" "]), data)
    if kind in ("repeat", "both"):
        data = (data + b"\n") * max(1, MAX_BYTES // (len(data) + 1) // rng.choice([1, 4, 40]))
    return "tf-log", data[:MAX_BYTES]


def _snapshot_misfit(rng: random.Random) -> tuple[str, bytes]:
    """A PyTorch JSON snapshot whose trace does not fit its segments: from a real snapshot
    (its trace cut to start mid-run or not), entries inserted at addresses inside live
    segments, blocks and free blocks, at segment ends, with other sizes: frees of unknown
    blocks, segment frees, unmaps and maps (of 0 bytes too), allocs; segments marked
    expandable."""
    from gpudash.trace.torch_snapshot import load_torch_snapshot_dict

    snap = load_torch_snapshot_dict(DATA / "real" / "torch_mlp.replayed_snapshot.pickle")
    trace = list(snap["device_traces"][0])
    trace = trace[rng.choice([0, 0, 1, 10, 50, 300, 1000, rng.randrange(len(trace))]):]
    points = []
    for seg in snap["segments"]:
        a, t = seg["address"], seg["total_size"]
        points += [a, a + t, a + t - 512, a + t // 2]
        for b in seg["blocks"]:
            points += [b["address"], b["address"] + 512, b["address"] + b["size"] // 2]
    actions = ["free_requested", "free_completed", "alloc", "segment_free", "segment_alloc",
               "segment_map", "segment_unmap", "oom"]
    for _ in range(rng.choice([1, 1, 2, 4])):
        at = rng.choice(points) + rng.choice([0, 0, 512, -512])
        size = rng.choice([0, 512, 4096, 1 << 20, 2 << 20, 3 << 20, 20 << 20])
        kinds = rng.choice([["free_requested", "free_completed"], ["free_completed"],
                            [rng.choice(actions)]])
        k = rng.randrange(len(trace) + 1)
        trace[k:k] = [{"action": a, "addr": at, "size": size, "stream": 0, "frames": []}
                      for a in kinds]
    snap["device_traces"] = [trace]
    if rng.random() < 0.2:
        for seg in snap["segments"]:
            seg["is_expandable"] = True
    return "torch-json", json.dumps(snap).encode()


def hostile(rng: random.Random, base: dict[str, bytes], workdir: Path,
            family: str | None = None) -> tuple[str, str, bytes | None]:
    """One hostile case: (format, family, bytes); bytes is None for a FIFO."""
    family = family or rng.choice(FAMILIES)
    if family == "fifo":
        return rng.choice(sorted(base)), family, None
    if family == "longline":
        fmt, data = _long_line(rng, base)
    elif family == "memo":
        fmt, data = _memo(rng)
    elif family == "meta":
        fmt, data = _meta(rng, workdir)
    elif family == "devices":
        fmt, data = _devices(rng)
    elif family == "floats":
        fmt, data = _floats(rng)
        if fmt == "gdtrace":
            t = _seed_trace()
            t.meta["devices"] = [{"index": 0, "capacity": float("nan"),
                                  "memory_limit": float("inf")}]
            data = _gdtrace_bytes(t, workdir)
    elif family == "bomb":
        fmt, data = _bomb(rng)
    elif family == "oommsg":
        fmt, data = _oom_message(rng)
    elif family == "snapfit":
        fmt, data = _snapshot_misfit(rng)
    else:
        fmt, data = _npy(rng, workdir)
    return fmt, family, data


def _case_path(workdir: Path, case: int, fmt: str) -> Path:
    return workdir / (f"case{case}.xplane.pb" if fmt == "xplane" else f"case{case}.{fmt}")


def _make_case(path: Path, data: bytes | None) -> None:
    if data is None:
        os.mkfifo(path)
    else:
        path.write_bytes(data)


def _unblock(path: Path) -> None:
    """Open and close both ends of a FIFO a reader or writer is waiting on."""
    fds = []
    for flags in (os.O_RDONLY, os.O_WRONLY):
        try:
            fds.append(os.open(path, flags | os.O_NONBLOCK))
        except OSError:
            pass
    time.sleep(0.05)
    for fd in fds:
        os.close(fd)


HANG_S = 30.0
# a warning that is not gpudash's own (numpy's RuntimeWarning...): gpudash's warn on purpose
_FOREIGN_WARNING = re.compile(r"\b(?!Gpudash)\w*Warning: ")


def load_one(path: Path, fmt: str | None) -> str:
    """'trace', 'TraceFormatError' or raises the unexpected exception (a TimeoutError when the
    load takes more than :data:`HANG_S` seconds: a hang; a FIFO it waits on is unblocked)."""
    out: dict = {}

    def target() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                out["value"] = load_trace(path, format=fmt)
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                out["error"] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(HANG_S)
    if worker.is_alive():
        while worker.is_alive():
            _unblock(path)
            worker.join(0.5)
        raise TimeoutError(f"the load took more than {HANG_S:.0f} s (a hang)")
    if "error" in out:
        if isinstance(out["error"], TraceFormatError):
            return "TraceFormatError"
        raise out["error"]
    if not isinstance(out.get("value"), Trace):
        raise AssertionError(f"load_trace returned {type(out.get('value')).__name__}, "
                             "not a Trace")
    return "trace"


def fuzz(cases: int = 500, seed: int = 0, seconds: float | None = None,
         workdir: Path | None = None, verbose: bool = False, hostile_share: float = 0.3,
         slowest: list | None = None) -> tuple[Counter, list[str]]:
    """Run ``cases`` cases (or until ``seconds`` pass): mutants of the seeds, and a share
    ``hostile_share`` of hostile files (:data:`FAMILIES`); (outcome counts, failures).
    ``slowest``, when given, receives ``[seconds, description]`` of the slowest load."""
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="gpudash-fuzz-")) if own else Path(workdir)
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    failures: list[str] = []
    start = time.monotonic()
    try:
        base = seeds(workdir)
        formats = sorted(base)
        for case in range(cases):
            if seconds is not None and time.monotonic() - start > seconds:
                break
            if rng.random() < hostile_share:
                fmt, kind, data = hostile(rng, base, workdir)
                if data is None and not hasattr(os, "mkfifo"):
                    continue
            else:
                fmt = formats[case % len(formats)]
                kind, data = mutate(base[fmt], rng, fmt)
            path = _case_path(workdir, case, fmt)
            _make_case(path, data)
            for forced in (None, fmt):
                t0 = time.perf_counter()
                try:
                    outcome = load_one(path, forced)
                except Exception as exc:  # noqa: BLE001 - the failure the fuzzer looks for
                    keep = workdir / f"failure{len(failures)}.{fmt}"
                    if data is not None:
                        shutil.copyfile(path, keep)
                    failures.append(f"{fmt}/{kind} format={forced}: {type(exc).__name__}: "
                                    f"{str(exc)[:200]} ({keep if data is not None else path})")
                    if verbose:
                        traceback.print_exception(exc)
                    outcome = "FAILURE"
                took = time.perf_counter() - t0
                if slowest is not None and (not slowest or took > slowest[0]):
                    slowest[:] = [took, f"{fmt}/{kind} ({len(data or b''):,} bytes)"]
                outcomes[(fmt, kind, outcome)] += 1
            path.unlink()
    finally:
        if own and not failures:
            shutil.rmtree(workdir, ignore_errors=True)
    return outcomes, failures


# ============================================================================ the commands
COMMANDS = ("replay", "explain", "convert")


def _run_command(args: list[str], timeout: float) -> tuple[int | None, str, float, int]:
    """``gpudash ARGS`` in a process of its own: (exit code or None on a hang, stderr,
    seconds, peak RSS in bytes)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "gpudash", *args], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + timeout
        code, usage = None, None
        while time.monotonic() < deadline:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.01)
        if code is None:
            proc.kill()
            _pid, _status, usage = os.wait4(proc.pid, 0)
        proc.returncode = code if code is not None else -9
        took = time.perf_counter() - t0
        err.seek(0)
        text = err.read().decode("utf-8", "replace")
    return code, text, took, usage.ru_maxrss * 1024


def commands(cases: int = 200, seed: int = 0, hostile_share: float = 0.7,
             timeout: float = HANG_S, workdir: Path | None = None,
             families: tuple[str, ...] = FAMILIES) -> dict:
    """Run every command on ``cases`` files (a share ``hostile_share`` of hostile ones, the
    rest mutants) and on a FIFO and a link to /dev/zero; a dict of the counts, the worst
    time, the peak RSS and the failures."""
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="gpudash-fuzz-cmd-")) if own else Path(workdir)
    rng = random.Random(seed)
    report = {"files": 0, "runs": 0, "tracebacks": 0, "hangs": 0, "worst_s": 0.0,
              "worst": "", "peak_rss": 0, "peak": "", "largest_input": 0, "failures": [],
              "exit_codes": Counter()}
    try:
        base = seeds(workdir)
        formats = sorted(base)
        for case in range(cases + 1):       # case 0: a FIFO (and a link to /dev/zero)
            if case == 0:
                fmt, kind, data = formats[0], "fifo", None
            elif rng.random() < hostile_share:
                fmt, kind, data = hostile(rng, base, workdir, rng.choice(families))
            else:
                fmt = formats[case % len(formats)]
                kind, data = mutate(base[fmt], rng, fmt)
            if data is None and not hasattr(os, "mkfifo"):
                continue
            path = _case_path(workdir, case, fmt)
            _make_case(path, data)
            paths = [path]
            if case == 0 and os.path.exists("/dev/zero"):
                link = workdir / "zero.log"
                link.symlink_to("/dev/zero")
                paths.append(link)
            for p in paths:
                report["files"] += 1
                report["largest_input"] = max(report["largest_input"], len(data or b""))
                for cmd in COMMANDS:
                    args = [cmd, str(p)] + ([str(workdir / "out.gdtrace"), "--overwrite"]
                                            if cmd == "convert" else [])
                    code, err, took, rss = _run_command(args, timeout)
                    report["runs"] += 1
                    report["exit_codes"][code] += 1
                    what = (f"gpudash {cmd} /dev/zero (a link to it)" if p.is_symlink() else
                            f"gpudash {cmd} {fmt}/{kind} ({len(data or b''):,} bytes)")
                    if took > report["worst_s"]:
                        report["worst_s"], report["worst"] = took, what
                    if rss > report["peak_rss"]:
                        report["peak_rss"], report["peak"] = rss, what
                    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
                    errors = [ln for ln in lines if ln.startswith("gpudash: ")]
                    # progress lines ("replay: 3/3") may come first; the error is one line
                    odd = code == 1 and (len(errors) != 1 or lines[-1] != errors[0])
                    problem = None
                    if code is None:
                        report["hangs"] += 1
                        problem = f"no answer after {timeout:.0f} s"
                    elif code == 70 or "Traceback" in err or _FOREIGN_WARNING.search(err) \
                            or odd:
                        report["tracebacks"] += 1
                        problem = f"exit {code}: {' | '.join(lines)[-300:]}"
                    elif code not in (0, 1, 3):     # 3: a replay ran out of memory
                        report["tracebacks"] += 1
                        problem = f"exit {code} (killed?): {' | '.join(lines)[-300:]}"
                    if problem:
                        keep = workdir / f"failure{len(report['failures'])}.{fmt}"
                        if data is not None:
                            shutil.copyfile(p, keep)
                        report["failures"].append(f"{what}: {problem} ({keep})")
                if p.is_symlink() or data is None:
                    p.unlink()
            if path.exists():
                path.unlink()
    finally:
        if own and not report["failures"]:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--hostile", type=float, default=None,
                    help="share of hostile files among the cases (default 0.3; --commands 0.7)")
    ap.add_argument("--commands", action="store_true",
                    help="run gpudash replay/explain/convert on each case in its own process")
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help="the hostile families --commands draws from (comma-separated)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.commands:
        families = tuple(f for f in args.families.split(",") if f)
        unknown = set(families) - set(FAMILIES)
        if unknown or not families:
            ap.error(f"--families takes some of {', '.join(FAMILIES)}")
        r = commands(args.cases, args.seed,
                     hostile_share=0.7 if args.hostile is None else args.hostile,
                     families=families)
        print(f"files fuzzed      {r['files']:>10,}  (largest {r['largest_input']:,} bytes)")
        print(f"command runs      {r['runs']:>10,}  in {time.perf_counter() - t0:.0f} s; exit "
              f"codes {dict(sorted(r['exit_codes'].items(), key=str))}")
        print(f"tracebacks        {r['tracebacks']:>10,}")
        print(f"hangs (> {HANG_S:.0f} s)     {r['hangs']:>10,}")
        print(f"worst time        {r['worst_s']:>10.2f} s  {r['worst']}")
        print(f"peak RSS          {r['peak_rss'] / 2**20:>10.0f} MiB  {r['peak']}")
        for f in r["failures"]:
            print("FAILURE", f)
        return 1 if r["failures"] else 0
    slowest: list = []
    outcomes, failures = fuzz(args.cases, args.seed, args.seconds, verbose=args.verbose,
                              hostile_share=0.3 if args.hostile is None else args.hostile,
                              slowest=slowest)
    total = sum(outcomes.values())
    print(f"{total} loads of {total // 2} cases in {time.perf_counter() - t0:.1f} s")
    by = Counter()
    for (fmt, _kind, outcome), n in outcomes.items():
        by[(fmt, outcome)] += n
    for (fmt, outcome), n in sorted(by.items()):
        print(f"  {fmt:<14}{outcome:<18}{n:>7}")
    fam = Counter()
    for (_fmt, kind, outcome), n in outcomes.items():
        if kind in FAMILIES:
            fam[(kind, outcome)] += n
    for (kind, outcome), n in sorted(fam.items()):
        print(f"  hostile {kind:<10}{outcome:<18}{n:>7}")
    if slowest:
        print(f"slowest load {slowest[0]:.2f} s: {slowest[1]}")
    for f in failures:
        print("FAILURE", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
