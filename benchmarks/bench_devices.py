"""Time in the number of devices: traces of 2,000 / 4,000 / 8,000 allocators.

Each device has a handful of events (an allocation and its free), so the work that should
grow is the per-device replay itself; a step that scans every row once per device
(``trace.calls(device)``, ``np.unique`` of the device column, a mask over all rows) makes
the total grow with devices x events instead: about 4x per doubling.

Three inputs per size, each read and replayed as the command line does:

- an ``*.xplane.pb`` profile with one allocator name per device (``load_trace``, then
  ``gpudash replay``, in-process, its output discarded);
- an RMM 0.12 CSV with one ``Device ID`` per device (``load_trace``, ``gpudash replay``);
- the xplane trace replayed with :func:`gpudash.trace.replay_devices`.

Run: ``python benchmarks/bench_devices.py [--devices 2000 4000 8000] [--big]``. ``--big``
adds the 30,000-allocator profile (1.4 MB) of the report this benchmark came from. Prints
one table (seconds; the ratio is time / time at the previous size).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_xplane(path: str, devices: int, events_per_device: int = 2) -> None:
    """A profile with ``devices`` allocators (``GPU_i_bfc``), each allocating and freeing
    ``events_per_device // 2`` blocks, on one line, interleaved across allocators."""
    from gpudash.proto import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    names = ["allocator_name", "bytes_allocated", "requested_bytes", "allocation_bytes",
             "addr"]
    sid = {}
    for i, name in enumerate(names, 1):
        plane.stat_metadata[i].id = i
        plane.stat_metadata[i].name = name
        sid[name] = i
    first_alloc = len(names) + 1
    for d in range(devices):
        plane.stat_metadata[first_alloc + d].id = first_alloc + d
        plane.stat_metadata[first_alloc + d].name = f"GPU_{d}_bfc"
    plane.event_metadata[1].name = "MemoryAllocation"
    plane.event_metadata[2].name = "MemoryDeallocation"
    line = plane.lines.add(name="stream", timestamp_ns=1_700_000_000_000_000_000)
    t = 0
    for k in range(events_per_device // 2):
        for kind in (1, 2):
            for d in range(devices):
                ev = line.events.add(offset_ps=t * 1000, metadata_id=kind)
                t += 1
                st = ev.stats
                st.add(metadata_id=sid["allocator_name"], ref_value=first_alloc + d)
                st.add(metadata_id=sid["bytes_allocated"], int64_value=1024 if kind == 1
                       else 0)
                st.add(metadata_id=sid["requested_bytes"], int64_value=1000)
                st.add(metadata_id=sid["allocation_bytes"], int64_value=1024)
                st.add(metadata_id=sid["addr"], int64_value=0x7F0000000000 + k * 4096)
    with open(path, "wb") as f:
        f.write(space.SerializeToString())


def make_rmm012(path: str, devices: int) -> None:
    """An RMM 0.12 ``csv_log()`` with an allocation and its free on each of ``devices``
    device ids."""
    rows = ["Event Type,Device ID,Address,Stream,Size (bytes),Free Memory,Total Memory,"
            "Current Allocs,Start,End,Elapsed,Location"]
    t = 0.0
    for kind in ("Alloc", "Free"):
        for d in range(devices):
            t += 1e-6
            rows.append(f"{kind},{d},0x7f0000000000,0x0,1024,0,0,0,{t:.6f},{t:.6f},0,x.py:1")
    Path(path).write_text("\n".join(rows) + "\n")


def _cli_replay(path: str) -> float:
    from gpudash.cli import main

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["replay", path])
    took = time.perf_counter() - t0
    if code not in (0, 3):   # 3: a replay ran out of memory
        raise SystemExit(f"gpudash replay {path} exited {code}")
    return took


def measure(devices: int, tmp: str) -> dict[str, float]:
    from gpudash.trace import load_trace, replay_devices

    xp = os.path.join(tmp, f"d{devices}.xplane.pb")
    make_xplane(xp, devices)
    csv = os.path.join(tmp, f"d{devices}.csv")
    make_rmm012(csv, devices)
    out: dict[str, float] = {"xplane MB": os.path.getsize(xp) / 1e6}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        trace = load_trace(xp)
        out["xplane load"] = time.perf_counter() - t0
        out["xplane replay (CLI)"] = _cli_replay(xp)
        t0 = time.perf_counter()
        replay_devices(trace, record=False, per_call=False)
        out["replay_devices"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_trace(csv)
        out["rmm-0.12 load"] = time.perf_counter() - t0
        out["rmm-0.12 replay (CLI)"] = _cli_replay(csv)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[2000, 4000, 8000])
    ap.add_argument("--big", action="store_true",
                    help="also a 30,000-allocator profile (load and replay)")
    args = ap.parse_args(argv)
    sizes = list(args.devices) + ([30_000] if args.big else [])
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            for k, v in measure(n, tmp).items():
                rows.setdefault(k, []).append(v)
    print(f"{'devices':<24}" + "".join(f"{n:>16,}" for n in sizes))
    for k, vals in rows.items():
        cells = []
        for i, v in enumerate(vals):
            ratio = "" if i == 0 or k.endswith("MB") or vals[i - 1] <= 0 else \
                f" (x{v / vals[i - 1]:.1f})"
            cells.append(f"{v:.2f}{ratio}")
        print(f"{k:<24}" + "".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
