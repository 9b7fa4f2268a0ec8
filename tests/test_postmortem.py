"""Post-mortems (allocator dumps, explain), profiles (xplane), holders, and bad input, on real
TensorFlow files (tests/data/real, see its README) and, where present, ../shared's external
files."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpudash
import gpudash.trace as gt
from gpudash import GpudashWarning, TraceFormatError
from gpudash.events import EventKind
from gpudash.proto import bfc_memory_map_pb2, xplane_pb2
from gpudash.formats.format import PRE_EXISTING_HOLDER
from gpudash.formats.io import sniff_format
from gpudash.formats.tf_dump import read_dumps, read_log_dumps

DATA = Path(__file__).parent / "data"
REAL = DATA / "real"
from shared_files import EXTERNAL  # noqa: E402
needs_external = pytest.mark.skipif(not EXTERNAL.is_dir(), reason="../shared is absent")


def gpudash_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpudash", *args], capture_output=True,
                          text=True, cwd=cwd)


# ---------------------------------------------------------------------------- the worked example
def test_worked_example_tf_oom_mixed_log():
    e = gpudash.explain(REAL / "tf_oom_mixed.log", device="16GiB")
    d = e.dump
    in_use = [c for c in d.chunks if c.in_use]
    free = [c for c in d.chunks if not c.in_use]
    assert len(in_use) == 51 and sum(c.size for c in in_use) == 48_120_832 == e.in_use
    assert len(free) == 3 and sum(c.size for c in free) == 2_210_816 == e.free
    assert max(c.size for c in free) == 1_048_576 == e.largest_free
    assert e.request == e.rounded == 3_145_728 and e.op == "Empty"
    assert e.pool == e.limit == 48 << 20 == d.memory_limit == d.stats.pool_bytes
    assert e.cause == "limit reached"
    assert e.smallest_limit == (48 << 20) + 3_145_728
    # TensorFlow's CPU allocator (TF_CPU_ALLOCATOR_USE_BFC): limited in MiB, not by a fraction
    assert e.host and e.fraction is None and e.limit_mib == 51
    assert e.setting == "TF_CPU_BFC_MEM_LIMIT_IN_MB"
    assert all(c["agrees"] for c in d.extra["checks"]) and len(d.extra["checks"]) > 80
    text = str(e)
    assert "limit reached" in text and "48,120,832" in text and "53,477,376" in text
    assert "TF_CPU_BFC_MEM_LIMIT_IN_MB=51" in text and "fraction 0." not in text


def test_log_dump_equals_tensorflows_own_memorydump_protobuf():
    log = read_dumps(REAL / "tf_oom_mixed.log")[0]
    pb = read_dumps(REAL / "tf_oom_mixed.memdump.pb")[0]
    # TensorFlow's own protobuf, read with the runtime alone, chunk for chunk
    md = bfc_memory_map_pb2.MemoryDump.FromString((REAL / "tf_oom_mixed.memdump.pb").read_bytes())
    assert [(c.address, c.size, c.in_use) for c in log.chunks] == \
        [(c.address, c.size, c.in_use) for c in sorted(md.chunk, key=lambda c: c.address)]
    assert [(c.address, c.size, c.in_use, c.bin) for c in log.chunks] == \
        [(c.address, c.size, c.in_use, c.bin) for c in pb.chunks]
    assert [(r.ptr, r.size) for r in log.regions] == [(r.ptr, r.size) for r in pb.regions]
    assert log.stats.bytes_in_use == pb.stats.bytes_in_use == md.stats.bytes_in_use
    assert [b.total_bytes_in_bin for b in log.bins] == [b.total_bytes_in_bin for b in pb.bins]
    assert pb.extra["requested_known"] and sum(c.requested_size for c in pb.chunks) > 0
    assert log.stats.num_allocs == md.stats.num_allocs == 181


def test_fragmentation_oom_where_free_bytes_exceed_the_request():
    dumps = read_dumps(REAL / "tf_oom_fragment.log")
    assert [d.extra["request"]["bytes"] for d in dumps] == [1 << 20, 3 << 20]
    e = gpudash.explain(REAL / "tf_oom_fragment.log")
    assert e.index == 1 and e.count == 2
    assert e.free > e.rounded == 3 << 20 and e.largest_free < e.rounded
    assert e.cause == "fragmentation" and e.headroom == 0
    assert e.smallest_limit == e.pool + (3 << 20)
    pb = gpudash.explain(REAL / "tf_oom_fragment.memdump.pb", request="3MiB", limit="16MiB")
    assert (pb.in_use, pb.free, pb.cause) == (e.in_use, e.free, "fragmentation")


def test_another_limit_is_read_and_its_rounding_reported():
    e = gpudash.explain(REAL / "tf_oom_limit32.log")
    assert e.limit == 32 << 20 and not e.dump.extra["limit_exact"]
    assert any("rounded" in w for w in e.warnings)
    assert e.cause == "fragmentation"         # 2 MiB below the limit, 1.29 MiB chunks, 3 MiB
    pb = read_dumps(REAL / "tf_oom_limit32.memdump.pb")[0]
    assert pb.stats.bytes_in_use == e.in_use


def test_explain_cli_text_and_html(tmp_path):
    out = tmp_path / "e.html"
    r = gpudash_cli("explain", str(REAL / "tf_oom_mixed.log"), "--device", "16GiB",
                    "--html", str(out))
    assert r.returncode == 0, r.stderr
    assert "cause" in r.stdout and "limit reached" in r.stdout and "fraction" in r.stdout
    html = out.read_text()
    assert "Chunk map" in html and "Bin occupancy" in html and "explain-summary" in html
    r = gpudash_cli("explain", str(REAL / "tf_oom_mixed.log"), "--html", str(out))
    assert r.returncode == 1 and "exists" in r.stderr


def test_holders_named_by_a_dump_are_ranked():
    text = (REAL / "tf_oom_mixed.log").read_text()
    # a MEM_DEBUG build names the op of every chunk: "by op X action_count N step S"
    named = text.replace("of size 3145728 next", "of size 3145728 by op big action_count 1 "
                         "step 0 next").replace("of size 1048576 next", "of size 1048576 by op "
                                                "mid action_count 1 step 0 next")
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "gpudash_named_dump.log"
    path.write_text(named)
    try:
        e = gpudash.explain(path)
    finally:
        path.unlink()
    assert [(h, n) for h, _, n in e.holders] == [("big", 6), ("mid", 4)]
    assert e.holders[0][1] == 6 * 3145728
    assert "held by" in str(e)


# ---------------------------------------------------------------------------- logs from outside
@needs_external
def test_external_dumps_bytes_and_completeness():
    xla = read_dumps(EXTERNAL / "xla_reactant_bfc_dump_2025.log")[0]
    assert xla.allocator_name == "GPU_0_bfc" and xla.stats.bytes_in_use == 16_000_000_000
    assert xla.memory_limit == 18_995_773_440 and xla.extra["complete"]
    tf14 = read_dumps(EXTERNAL / "tf14_alexnet_oom_2017.log")[0]
    assert tf14.memory_limit == 285_474_816 and tf14.stats.bytes_in_use == 208_404_480
    assert sum(c.in_use for c in tf14.chunks) == 20 and sum(not c.in_use for c in tf14.chunks) == 4
    elided = read_dumps(EXTERNAL / "tf22_windows_oom_elided_2020.log")[0]
    assert not elided.extra["complete"] and elided.stats.bytes_in_use == 568_350_976
    assert any("missing" in w for w in elided.extra["warnings"])
    old = read_dumps(EXTERNAL / "tf08_mnist_oom_2016.log")[0]
    assert old.extra["request"]["bytes"] == round(29.91 * (1 << 20))
    assert old.memory_limit == 1_490_198_528
    jax = read_dumps(EXTERNAL / "jax_pi0_two_gpu_oom_2025.log")
    assert [d.allocator_name for d in jax] == ["GPU_0_bfc", "GPU_1_bfc"]


@pytest.mark.core
@needs_external
def test_external_logs_load_as_traces():
    tf14 = gt.load_trace(EXTERNAL / "tf14_alexnet_oom_2017.log")
    r = gt.replay(tf14)
    assert r.memory_limit == 285_474_816 and not r.fits      # the log's limit is used
    assert sniff_format(EXTERNAL / "xla_reactant_bfc_dump_2025.log") == "tf-log"
    xla = gt.load_trace(EXTERNAL / "xla_reactant_bfc_dump_2025.log")
    assert len(xla.select("oom")) == 1 and xla.meta["dump_states"] == ["GPU_0_bfc"]
    warn = gt.load_trace(EXTERNAL / "tf2x_gsate_yolo_oom_warnings_2021.log")
    assert len(warn.select("oom")) == 0 and len(warn.meta["declined_allocations"]) == 10
    assert warn.devices[0]["memory_limit"] == 688 << 20      # "Created TensorFlow device"
    glued = gt.load_trace(EXTERNAL / "tf22_windows_oom_elided_2020.log")
    assert glued.select("oom").requested.tolist() == [115200]
    old = gt.load_trace(EXTERNAL / "tf08_mnist_oom_2016.log")
    assert len(old.select("oom")) == 1
    jax = gt.load_trace(EXTERNAL / "jax_pi0_two_gpu_oom_2025.log")
    assert [d["name"] for d in jax.devices] == ["GPU_0_bfc", "GPU_1_bfc"]
    r = gpudash_cli("replay", str(EXTERNAL / "jax_pi0_two_gpu_oom_2025.log"))
    assert r.returncode == 0 and "device 0 (GPU_0_bfc)" in r.stdout \
        and "device 1 (GPU_1_bfc)" in r.stdout
    r = gpudash_cli("replay", str(EXTERNAL / "jax_pi0_two_gpu_oom_2025.log"), "--allocator",
                    "GPU_1_bfc")
    assert r.returncode == 0 and "GPU_0_bfc" not in r.stdout
    r = gpudash_cli("whatif", str(EXTERNAL / "jax_pi0_two_gpu_oom_2025.log"), "--device-index",
                    "3", "--fractions", "0.5")
    assert r.returncode == 1 and "no device 3" in r.stderr and "GPU_1_bfc" in r.stderr


@pytest.mark.core
def test_replay_of_a_dump_log_rebuilds_the_state_and_fails_at_the_request():
    t = gt.load_trace(REAL / "tf_oom_mixed.log")
    assert t.devices[0]["memory_limit"] == 48 << 20
    r = gt.replay(t)
    assert r.memory_limit == 48 << 20 and r.oom_count == 1
    assert r.first_oom[1] == 3_145_728
    calls = t.calls()
    assert r.first_oom[0] == len(calls) - 1              # the failed request, nothing before
    r = gpudash_cli("replay", str(REAL / "tf_oom_mixed.log"))
    assert r.returncode == 3 and "(from the log)" in r.stdout and "OUT OF MEMORY" in r.stdout


# ---------------------------------------------------------------------------- profiles
def test_mlp_profile_counts_and_peak_equal_tensorflows():
    t = gt.load_trace(REAL / "tf_mlp_training.xplane.pb")
    s = t.summary()
    assert (s["allocations"], s["frees"]) == (1489, 1481)
    assert s["peak_allocated_bytes"] == 9_318_144
    assert t.meta["source"] == "xplane" and t.devices[0]["name"] == "bfc_cpu_allocator_for_gpu"
    assert t.devices[0]["pre_existing_bytes"] == 5_863_680
    assert t.calls().unmatched_frees == 0


def reference_events(path: Path) -> list[dict]:
    """Every memory event, decoded by the protobuf runtime itself, in time order."""
    space = xplane_pb2.XSpace.FromString(path.read_bytes())
    out = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.stat_metadata.items()}
        kinds = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                kind = kinds.get(ev.metadata_id)
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for st in ev.stats:
                    which = st.WhichOneof("value")
                    value = getattr(st, which)
                    stats[names[st.metadata_id]] = names[value] if which == "ref_value" else value
                out.append({"t": line.timestamp_ns * 1000 + ev.offset_ps, "kind": kind, **stats})
    out.sort(key=lambda e: e["t"])
    return out


@pytest.mark.parametrize("name", ["tf_mlp_training.xplane.pb", "tf_cnn_training.xplane.pb"])
def test_profile_bulk_decoding_matches_the_protobuf_runtime(name):
    ref = reference_events(REAL / name)
    t = gt.load_trace(REAL / name)
    pre = t.summary()["pre_existing_allocations"]
    real = t[t.holder != t.holders.index(PRE_EXISTING_HOLDER)] if pre else t
    # the synthesized allocations come first; the frees of pre-existing blocks keep their
    # rows: compare the profile's own events, in order
    rows = np.flatnonzero(~((t.kind == 1) & (t.holder == t.holders.index(PRE_EXISTING_HOLDER))))
    own = t[rows]
    assert len(own) == len(ref)
    assert own.kind.tolist() == [1 if e["kind"] == "MemoryAllocation" else 2 for e in ref]
    assert own.ptr.tolist() == [e["addr"] for e in ref]
    assert own.size.tolist() == [e["allocation_bytes"] for e in ref]
    assert own.requested.tolist() == [e["requested_bytes"] for e in ref]
    assert own.time_ns.tolist() == [e["t"] // 1000 for e in ref]
    # after every event, bytes in use equal TensorFlow's bytes_allocated
    delta = np.where(t.kind == 1, t.size, -t.size)
    running = np.cumsum(delta)[rows]
    assert running.tolist() == [e["bytes_allocated"] for e in ref]
    # holders: op dtype[shape] of the allocation
    allocs = [e for e in ref if e["kind"] == "MemoryAllocation"]
    names = own[own.kind == 1].holder_names().tolist()
    for e, h in zip(allocs, names):
        assert h.startswith(e["tf_op"]) if e.get("tf_op") else h == ""
    assert len(real) <= len(t)


def test_cnn_profile_peak_equals_tensorflows_memory_info():
    t = gt.load_trace(REAL / "tf_cnn_training.xplane.pb")
    # the script printed tf.config.experimental.get_memory_info("CPU:0")["peak"]
    assert t.summary()["peak_allocated_bytes"] == 34_916_352


def synthetic_profile(path: Path, events: list[tuple], *, allocator="GPU_0_bfc",
                      extra_plane=False) -> None:
    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/device:GPU:0")
    names = ["allocator_name", "addr", "allocation_bytes", "requested_bytes", "bytes_allocated",
             "tf_op", "shape", "data_type", allocator, "my/op", "[2,3]"]
    for i, n in enumerate(names, 1):
        plane.stat_metadata[i].id = i
        plane.stat_metadata[i].name = n
    plane.event_metadata[1].name = "MemoryAllocation"
    plane.event_metadata[2].name = "MemoryDeallocation"
    plane.event_metadata[3].name = "SomethingElse"
    line = plane.lines.add(name="stream", timestamp_ns=1_000)
    for k, (kind, addr, size, in_use) in enumerate(events):
        ev = line.events.add(metadata_id=kind, offset_ps=1000 * k + 7)
        ev.stats.add(metadata_id=1, ref_value=9)
        ev.stats.add(metadata_id=2, uint64_value=addr)       # uint64 here, int64 in TF's
        ev.stats.add(metadata_id=3, int64_value=size)
        ev.stats.add(metadata_id=4, int64_value=size - 1)
        ev.stats.add(metadata_id=5, int64_value=in_use)
        ev.stats.add(metadata_id=6, str_value="inline/op")   # an inline string
        ev.stats.add(metadata_id=7, ref_value=11)
        ev.stats.add(metadata_id=8, int64_value=1)
        if k == 0:
            other = line.events.add(metadata_id=3, offset_ps=5)
            other.stats.add(metadata_id=4, double_value=1.5)
    if extra_plane:
        space.planes.add(name="/host:CPU")
    path.write_bytes(space.SerializeToString())


def test_synthetic_profile_log_directory_and_newest_run(tmp_path):
    base = tmp_path / "logs" / "plugins" / "profile"
    evs = [(1, 0x1000, 512, 512 + 4096), (1, 0x2000, 256, 768 + 4096), (2, 0x1000, 512, 256 + 4096),
           (2, 0x9000, 4096, 256)]
    (base / "2025_01_01_00_00_00").mkdir(parents=True)
    (base / "2025_02_01_00_00_00").mkdir(parents=True)
    synthetic_profile(base / "2025_01_01_00_00_00" / "host.xplane.pb", evs[:1])
    synthetic_profile(base / "2025_02_01_00_00_00" / "host.xplane.pb", evs, extra_plane=True)
    t = gt.load_trace(tmp_path / "logs")                       # the newest run
    assert t.meta["run"] == "2025_02_01_00_00_00"
    s = t.summary()
    assert (s["allocations"], s["frees"], s["pre_existing_allocations"]) == (2, 2, 1)
    assert s["peak_allocated_bytes"] == 768 + 4096
    assert t.holders[t.holder[t.kind == 1][-1]] == "inline/op float[2,3]"
    older = gt.load_xplane(tmp_path / "logs", run="2025_01_01_00_00_00")
    assert older.summary()["allocations"] == 1
    with pytest.raises(TraceFormatError, match="no profile run named 'nope'"):
        gt.load_xplane(tmp_path / "logs", run="nope")
    top = gt.top_holders(t, at="peak")
    assert sum(h.bytes for h in top) == 768 + 4096
    assert top[0].holder == PRE_EXISTING_HOLDER and top[0].bytes == 4096


@pytest.mark.core
def test_pre_existing_memory_is_replayed_and_freed():
    t = gt.load_trace(REAL / "tf_mlp_training.xplane.pb")
    r = gt.replay(t, memory_limit="64MiB")
    assert r.fits and r.skipped_frees == 0
    # every byte in use at the profile's start is allocated at the start of the replay
    start = int(np.count_nonzero(t.holder[:10] == t.holders.index(PRE_EXISTING_HOLDER)))
    assert r.per_call["in_use"][start - 1] >= 5_863_680
    # too small a limit fails on the memory that was already there
    assert not gt.replay(t, memory_limit="4MiB", record=False).fits


# ---------------------------------------------------------------------------- holders
def test_holders_survive_gdtrace_and_golden_v1_still_loads(tmp_path):
    old = gt.read_trace(DATA / "traces" / "golden_v1.gdtrace")
    assert len(old) > 0 and (old.holder == -1).all() and old.holders == []
    t = gt.load_trace(REAL / "tf_mlp_training.xplane.pb")
    path = tmp_path / "h.gdtrace"
    gt.write_trace(t, path)
    assert path.read_bytes().startswith(b"GPUDASH-TRACE 2\n")
    back = gt.read_trace(path)
    assert back == t and back.holder_names().tolist() == t.holder_names().tolist()
    # batches written by a writer with holders appearing over time
    with gt.TraceWriter(tmp_path / "b.gdtrace", t.meta, batch_events=500) as w:
        for lo in range(0, len(t), 700):
            w.append(t[lo:lo + 700])
    again = gt.read_trace(tmp_path / "b.gdtrace")
    assert again.holder_names().tolist() == t.holder_names().tolist()
    assert gt.Trace.concat([t[:100], t[100:]]).holder_names().tolist() == \
        t.holder_names().tolist()


def test_top_holders_at_any_event():
    t = gt.load_trace(REAL / "tf_mlp_training.xplane.pb")
    peak = gt.top_holders(t)
    assert sum(h.bytes for h in peak) == 9_318_144
    assert peak == sorted(peak, key=lambda h: (-h.bytes, h.holder))
    end = gt.top_holders(t, at="end")
    assert sum(h.bytes for h in end) == 5_865_728          # the last bytes_allocated
    assert gpudash.top_holders(t, at=5, limit=1)[0].bytes > 0
    with pytest.raises(ValueError, match="at must be"):
        gt.top_holders(t, at="middle")


def test_holder_column_api():
    t = gt.Trace.empty()
    assert t.holder.dtype == np.int32 and len(t.holders) == 0
    t = gt.load_trace(REAL / "tf_oom_mixed.log")
    oom = np.flatnonzero(t.kind == int(EventKind.OOM))[0]
    assert t.holder_of(int(oom)) == "Empty"
    t.set_holders(["x"] * len(t))
    assert set(t.holder_names().tolist()) == {"x"}
    assert t.holders[t.intern_holder("x")] == "x" and t.intern_holder("") == -1
    with pytest.raises(TraceFormatError, match="holder"):
        gt.Trace(t.columns, holder=np.zeros(len(t), dtype=np.int32), holders=[])


# ---------------------------------------------------------------------------- bad input
BAD_PROFILES = {
    "truncated": lambda: (REAL / "tf_mlp_training.xplane.pb").read_bytes()[:5000],
    "random": lambda: np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
}


@pytest.mark.parametrize("kind", sorted(BAD_PROFILES))
def test_bad_profiles_one_line_error_exit_1(tmp_path, kind):
    path = tmp_path / f"{kind}.xplane.pb"
    path.write_bytes(BAD_PROFILES[kind]())
    with pytest.raises(TraceFormatError) as err:
        gt.load_trace(path)
    assert str(path) in str(err.value)
    out = tmp_path / "out.html"
    r = gpudash_cli("replay", str(path), "--html", str(out))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not out.exists()


def test_profile_without_memory_events(tmp_path):
    path = tmp_path / "none.xplane.pb"
    space = xplane_pb2.XSpace()
    space.planes.add(name="/host:CPU").lines.add(name="python").events.add(metadata_id=1)
    path.write_bytes(space.SerializeToString())
    r = gpudash_cli("replay", str(path))
    assert r.returncode == 1 and "no MemoryAllocation" in r.stderr and str(path) in r.stderr


def test_damaged_event_bytes_inside_a_valid_profile(tmp_path):
    good = tmp_path / "g.xplane.pb"
    synthetic_profile(good, [(1, 0x1000, 512, 512)])
    raw = xplane_pb2.XSpaceRaw.FromString(good.read_bytes())
    ev = bytearray(raw.planes[0].lines[0].events[0])
    ev[-1] = 0xFF                                             # a varint that never ends
    raw.planes[0].lines[0].events[0] = bytes(ev) + b"\xff\xff"
    bad = tmp_path / "b.xplane.pb"
    bad.write_bytes(raw.SerializeToString())
    with pytest.raises(TraceFormatError, match="damaged"):
        gt.load_trace(bad)


def test_bad_dumps_and_logs(tmp_path):
    cut = tmp_path / "cut.log"
    lines = (REAL / "tf_oom_mixed.log").read_text().splitlines(keepends=True)
    cut.write_text("".join(lines[:40]))                       # cut inside the chunk lines
    e = gpudash.explain(cut)
    assert not e.dump.extra["complete"] and any("missing" in w for w in e.warnings)
    r = gpudash_cli("explain", str(cut))
    assert r.returncode == 0 and "warning:" in r.stdout
    none = tmp_path / "none.log"
    none.write_text("hello\nI0101 00:00:00.000000 1 x.cc:1] nothing\n")
    r = gpudash_cli("explain", str(none))
    assert r.returncode == 1 and "no allocator dump found" in r.stderr and str(none) in r.stderr
    truncated = tmp_path / "t.memdump"
    truncated.write_bytes((REAL / "tf_oom_mixed.memdump.pb").read_bytes()[:300])
    r = gpudash_cli("explain", str(truncated))
    assert r.returncode == 1 and "Traceback" not in r.stderr and str(truncated) in r.stderr


@pytest.mark.parametrize("line, what", [
    ("I0101 00:00:00.000000 1 bfc_allocator.cc:329] [mem-debug] AllocateRaw,GPU_0_bfc,"
     + "9" * 400 + ",0x7f0000000000,", "400 digits"),
    ("I0101 00:00:00.000000 1 bfc_allocator.cc:329] [mem-debug] AllocateRaw,GPU_0_bfc,"
     "16,0x8000000000000000,", "pointer"),
    ("I0101 00:00:00.000000 1 bfc_allocator.cc:329] [mem-debug] AllocateRaw,GPU_0_bfc,"
     "9223372036854775808,0x7f0000000000,", "size"),
    ("I0000 00:00:99999999999.000000 1 bfc_allocator.cc:329] [mem-debug] AllocateRaw,"
     "GPU_0_bfc,16,0x7f0000000000,", "time"),
    ("I0101 00:00:00.000000 1 gpu_device.cc:1] Created device /job:localhost/replica:0/task:0/"
     "device:GPU:40000 with 100 MB memory", "device index"),
])
def test_tf_log_impossible_numbers_name_file_and_line(line, what):
    text = "I0101 00:00:00.000000 1 bfc_allocator.cc:89] Creating new BFCAllocator named: " \
           "GPU_0_bfc\n" + line + "\n"
    with pytest.raises(TraceFormatError) as err:
        gt.load_tf_log(io.StringIO(text))
    msg = str(err.value)
    assert "line 2" in msg and "<stream>" in msg
    assert isinstance(err.value, ValueError)          # old except clauses still catch it
    with pytest.raises(TraceFormatError, match="line 1: address"):
        read_log_dumps(io.StringIO("InUse at " + "f" * 20 + " of size 10 next 1\n"))
    with pytest.raises(TraceFormatError, match="line 1: chunk size .* 400 digits"):
        read_log_dumps(io.StringIO("InUse at 7f0000000000 of size " + "9" * 400 + " next 2\n"))


def test_xla_chunk_lines_with_tags_and_the_occupancy_line():
    text = (
        "W0105 09:48:28.754214 1 bfc_allocator.cc:501] Allocator (GPU_0_bfc) ran out of memory "
        "trying to allocate 1.00KiB (rounded to 1024) from the lower end requested by op fusion\n"
        "I0105 09:48:28.754302 1 bfc_allocator.cc:1058] BFCAllocator dump for GPU_0_bfc\n"
        "I0105 09:48:28.754850 1 bfc_allocator.cc:1094] Next region of size 2048\n"
        "I0105 09:48:28.754874 1 bfc_allocator.cc:1114] InUse at 7972f0000000 of size 1024 tag "
        "lower allocation_annotation jit_f / fusion{k=v} next 1\n"
        "I0105 09:48:28.754874 1 bfc_allocator.cc:1114] Free  at 7972f0000400 of size 1024 tag "
        "central_gap next 18446744073709551615\n"
        "I0105 09:48:28.755 1 bfc_allocator.cc:1122] 1 Chunks of size 1024 totalling 1.0KiB\n"
        "I0105 09:48:28.755 1 bfc_allocator.cc:1126] Sum Total of in-use chunks: 1.0KiB\n"
        "I0105 09:48:28.755 1 bfc_allocator.cc:1128] Allocator memory summary: rounded request "
        "1.0KiB, total free in pool 1.0KiB, largest free chunk usable by lower end 1.0KiB, "
        "unallocated bytes 0B, pool size 2.0KiB, pool limit 2.0KiB\n"
        "W0105 09:48:28.755 1 bfc_allocator.cc:512] " + "*" * 50 + "_" * 50 + "\n")
    d = read_log_dumps(io.StringIO(text))[0]
    assert [(c.size, c.in_use) for c in d.chunks] == [(1024, True), (1024, False)]
    assert d.memory_limit == 2048 and d.extra["limit_exact"]
    assert d.extra["occupancy"] == "*" * 50 + "_" * 50
    assert d.extra["request"]["op"] == "fusion" and d.extra["complete"]
    assert all(c["agrees"] for c in d.extra["checks"])
