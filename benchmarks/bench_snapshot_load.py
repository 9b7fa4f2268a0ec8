"""Loading big PyTorch memory snapshots: gpudash's ``load_trace`` against ``pickle.load``.

For each size (``--sizes``, in MB; default 50, 250 and 1000), a realistic snapshot made by
``make_big_snapshot.py`` (cached under the temp directory, never in the repository) is
measured three ways, each in a fresh subprocess so that its peak memory is its own:

- ``pickle.load`` of the file (what a user's script does first);
- ``gpudash.trace.load_trace`` of it (unpickle, columns, stacks, starting state);
- ``load_trace`` then ``replay`` (PyTorch's allocator, exact: the snapshot's own addresses,
  with the recording and the model's snapshot, as ``replay(trace)`` does by default).

Each child imports gpudash first, so the three peaks share the same interpreter baseline
(about 40 MB: numpy, gpudash); the time is of the measured call only. Peak memory is the
child's ``ru_maxrss``. With ``--repeat R`` the three are run R times, alternating, and the
fastest of each is kept (the machine may be shared). One table is printed: seconds, seconds
per MB, peak RSS (MB), and each as a ratio to ``pickle.load`` of the same file.

The snapshots start mid-run (the model's weights allocated before the history was on, as
in most real ones: the replay makes that starting state first); ``--start empty`` measures
ones recorded from the first allocation.

Run: ``python benchmarks/bench_snapshot_load.py [--sizes 50,250,1000] [--repeat R]
[--start mid-run|empty]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_big_snapshot import cached_snapshot

_CHILD = r"""
import json, resource, sys, time, pickle
import gpudash.trace
from gpudash.trace import load_trace, replay
mode, path = sys.argv[1], sys.argv[2]
out = {}
t0 = time.perf_counter()
if mode == "pickle":
    with open(path, "rb") as f:
        snap = pickle.load(f)
    out["entries"] = sum(len(t) for t in snap.get("device_traces") or [])
elif mode == "load":
    t = load_trace(path)
    out["rows"] = len(t)
    out["stacks"] = len(t.stacks)
else:
    t = load_trace(path)
    t1 = time.perf_counter()
    r = replay(t)
    out["replay_s"] = time.perf_counter() - t1
    out["exact"] = bool(r.fidelity.exact)
    out["start"] = r.fidelity.start
out["seconds"] = time.perf_counter() - t0
out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def _child(mode: str, path: Path) -> dict:
    env = dict(os.environ)
    root = str(HERE.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                else "")
    done = subprocess.run([sys.executable, "-c", _CHILD, mode, str(path)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{mode} of {path} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="50,250,1000",
                    help="snapshot sizes in MB, comma-separated (default 50,250,1000)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each measurement, alternating; the fastest is kept")
    ap.add_argument("--start", choices=("mid-run", "empty"), default="mid-run",
                    help="snapshots whose trace starts mid-run (as most do) or empty")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    say = lambda msg: print(msg, file=sys.stderr)
    rows = []
    for mb in sizes:
        path = cached_snapshot(mb, say=say, start=args.start)
        best: dict[str, dict] = {}
        for _ in range(max(1, args.repeat)):
            for mode in ("pickle", "load", "replay"):
                got = _child(mode, path)
                say(f"{mb} MB {mode}: {got['seconds']:.2f} s, {got['peak_mb']:,.0f} MB")
                if mode not in best or got["seconds"] < best[mode]["seconds"]:
                    best[mode] = got
        rows.append((mb, path.stat().st_size / 1e6, best))
    head = (f"{'size':>6} {'entries':>10} | {'pickle.load':>17} | {'load_trace':>25} | "
            f"{'load + replay':>25} | {'peak RSS, MB':>21}")
    print(head)
    print(f"{'MB':>6} {'':>10} | {'s':>7} {'s/MB':>9} | {'s':>7} {'s/MB':>9} {'x':>7} | "
          f"{'s':>7} {'s/MB':>9} {'x':>7} | {'pickle':>6} {'load':>6} {'x':>7}")
    for mb, real_mb, b in rows:
        p, ld, rp = b["pickle"], b["load"], b["replay"]
        print(f"{real_mb:>6.0f} {p['entries']:>10,} | {p['seconds']:>7.2f} "
              f"{p['seconds'] / real_mb:>9.4f} | {ld['seconds']:>7.2f} "
              f"{ld['seconds'] / real_mb:>9.4f} {ld['seconds'] / p['seconds']:>6.2f}x | "
              f"{rp['seconds']:>7.2f} {rp['seconds'] / real_mb:>9.4f} "
              f"{rp['seconds'] / p['seconds']:>6.2f}x | {p['peak_mb']:>6.0f} "
              f"{ld['peak_mb']:>6.0f} {ld['peak_mb'] / p['peak_mb']:>6.2f}x")
    for mb, _, b in rows:
        rp = b["replay"]
        print(f"# {mb} MB: replay {rp['replay_s']:.2f} s of it ({rp['start']} start, exact: "
              f"{rp['exact']}); load_trace peak {b['load']['peak_mb']:,.0f} MB, load + replay "
              f"peak {rp['peak_mb']:,.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
