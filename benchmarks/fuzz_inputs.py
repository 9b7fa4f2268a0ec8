"""Fuzz every trace reader: a trace or a TraceFormatError, never another exception.

Seeds are small valid files of every format ``load_trace`` reads (written with gpudash's own
writers, plus the samples in ``tests/data``). Each case mutates one seed: truncation, bit
flips, byte runs, huge numbers (400 digits, 2**63, 2**64, negative), NaN/Infinity, wrong JSON
types, deep nesting. Each mutant is loaded twice, sniffed and with its seed's format forced.
Any exception other than :class:`gpudash.TraceFormatError` is a failure.

Run: ``python benchmarks/fuzz_inputs.py [--cases N] [--seed S] [--seconds T]``.
Prints the outcomes per format and mutation, and every failure with its reproducer path;
exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpudash import TraceFormatError  # noqa: E402
from gpudash.trace import Trace, load_trace, save_trace  # noqa: E402
from gpudash.trace.workloads import training_loop  # noqa: E402

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

    from gpudash.trace.format import _RECORD, MAGIC

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


def load_one(path: Path, fmt: str | None) -> str:
    """'trace', 'TraceFormatError' or raises the unexpected exception."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = load_trace(path, format=fmt)
        except TraceFormatError:
            return "TraceFormatError"
    if not isinstance(result, Trace):
        raise AssertionError(f"load_trace returned {type(result).__name__}, not a Trace")
    return "trace"


def fuzz(cases: int = 500, seed: int = 0, seconds: float | None = None,
         workdir: Path | None = None, verbose: bool = False) -> tuple[Counter, list[str]]:
    """Run ``cases`` mutants (or until ``seconds`` pass); (outcome counts, failures)."""
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
            fmt = formats[case % len(formats)]
            kind, data = mutate(base[fmt], rng, fmt)
            path = workdir / (f"case{case}.xplane.pb" if fmt == "xplane" else
                              f"case{case}.{fmt}")
            path.write_bytes(data)
            for forced in (None, fmt):
                try:
                    outcome = load_one(path, forced)
                except Exception as exc:  # noqa: BLE001 - the failure the fuzzer looks for
                    keep = workdir / f"failure{len(failures)}.{fmt}"
                    shutil.copyfile(path, keep)
                    failures.append(f"{fmt}/{kind} format={forced}: {type(exc).__name__}: "
                                    f"{str(exc)[:200]} ({keep})")
                    if verbose:
                        traceback.print_exc()
                    outcome = "FAILURE"
                outcomes[(fmt, kind, outcome)] += 1
            path.unlink()
    finally:
        if own and not failures:
            shutil.rmtree(workdir, ignore_errors=True)
    return outcomes, failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    outcomes, failures = fuzz(args.cases, args.seed, args.seconds, verbose=args.verbose)
    total = sum(outcomes.values())
    print(f"{total} loads of {total // 2} mutants in {time.perf_counter() - t0:.1f} s")
    by = Counter()
    for (fmt, _kind, outcome), n in outcomes.items():
        by[(fmt, outcome)] += n
    for (fmt, outcome), n in sorted(by.items()):
        print(f"  {fmt:<14}{outcome:<18}{n:>7}")
    for f in failures:
        print("FAILURE", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
