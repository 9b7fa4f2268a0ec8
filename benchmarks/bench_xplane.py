"""Load a profile with 1,000,000 memory events (a synthetic ``*.xplane.pb`` written with
gpudash's own XSpace definition, 14 stats per event as TensorFlow's BFC allocator records).

Usage: python benchmarks/bench_xplane.py [EVENTS] [REPEATS]. Prints one table. The profile is
made once into a temporary directory (about 120 MB for 1M events).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np


def make_profile(path: str, n: int, seed: int = 0) -> None:
    from gpudash.proto import xplane_pb2

    rng = np.random.default_rng(seed)
    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/device:GPU:0")
    names = ["allocator_name", "bytes_reserved", "bytes_allocated", "bytes_available",
             "fragmentation", "peak_bytes_in_use", "requested_bytes", "allocation_bytes", "addr",
             "tf_op", "id", "region_type", "data_type", "shape", "GPU_0_bfc", "output",
             "[64,512]", "dense/MatMul"]
    sid = {}
    for i, name in enumerate(names, 1):
        plane.stat_metadata[i].id = i
        plane.stat_metadata[i].name = name
        sid[name] = i
    plane.event_metadata[1].name = "MemoryAllocation"
    plane.event_metadata[2].name = "MemoryDeallocation"
    line = plane.lines.add(name="stream", timestamp_ns=1_700_000_000_000_000_000)
    live: list[tuple[int, int]] = []
    in_use = peak = 0
    sizes = rng.choice([256, 1024, 65536, 1 << 20], size=n)
    coin = rng.random(n)
    for i in range(n):
        ev = line.events.add(offset_ps=i * 1000)
        if live and (len(live) > 500 or coin[i] < 0.5):
            addr, size = live.pop(int(coin[i] * len(live)) % len(live))
            ev.metadata_id = 2
            in_use -= size
        else:
            size, addr = int(sizes[i]), 0x7F0000000000 + i * (1 << 20)
            live.append((addr, size))
            ev.metadata_id = 1
            in_use += size
        peak = max(peak, in_use)
        st = ev.stats
        st.add(metadata_id=sid["allocator_name"], ref_value=sid["GPU_0_bfc"])
        st.add(metadata_id=sid["bytes_reserved"], int64_value=0)
        st.add(metadata_id=sid["bytes_allocated"], int64_value=in_use)
        st.add(metadata_id=sid["bytes_available"], int64_value=1 << 34)
        st.add(metadata_id=sid["fragmentation"], double_value=0.1)
        st.add(metadata_id=sid["peak_bytes_in_use"], int64_value=peak)
        st.add(metadata_id=sid["requested_bytes"], int64_value=size - 3)
        st.add(metadata_id=sid["allocation_bytes"], int64_value=size)
        st.add(metadata_id=sid["addr"], int64_value=addr)
        st.add(metadata_id=sid["tf_op"], ref_value=sid["dense/MatMul"])
        st.add(metadata_id=sid["id"], int64_value=i)
        st.add(metadata_id=sid["region_type"], ref_value=sid["output"])
        st.add(metadata_id=sid["data_type"], int64_value=1)
        st.add(metadata_id=sid["shape"], ref_value=sid["[64,512]"])
    with open(path, "wb") as f:
        f.write(space.SerializeToString())


def main() -> None:
    from gpudash.trace import load_trace

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.xplane.pb")
        t0 = time.perf_counter()
        make_profile(path, n)
        made = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            trace = load_trace(path)
            times.append(time.perf_counter() - t0)
        s = trace.summary()
        print(f"{'memory events':<28}{n:>14,}")
        print(f"{'file size (MB)':<28}{os.path.getsize(path) / 1e6:>14.1f}")
        print(f"{'made in (s)':<28}{made:>14.1f}")
        print(f"{'load_trace best (s)':<28}{min(times):>14.2f}")
        print(f"{'load_trace all (s)':<28}{' '.join(f'{t:.2f}' for t in times):>14}")
        print(f"{'events/s (best)':<28}{n / min(times):>14,.0f}")
        print(f"{'peak (bytes)':<28}{s['peak_allocated_bytes']:>14,}")


if __name__ == "__main__":
    main()
