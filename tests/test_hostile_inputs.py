"""Hostile inputs to every reader and to the commands that read them: special files, lines
built to make a pattern backtrack, pickles that repeat objects by reference, odd metadata,
device indices out of range, odd floats, and traces of thousands of devices.

Every one is refused with one TraceFormatError naming the file (exit code 1 from the
command line, one line on stderr), or read correctly; none blocks, none takes minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import gpudash.trace as gt
from gpudash import TraceFormatError
from gpudash.cli import main
from gpudash.formats import io as trace_io
from gpudash.formats import tf_dump, torch_snapshot
from gpudash.trace.replay import trace_settings

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``gpudash ARGS`` in a fresh interpreter (a hang is cut off by ``timeout``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "gpudash", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT, check=False)


def _one_line_error(proc: subprocess.CompletedProcess, path: Path) -> None:
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("gpudash: error: ") and str(path) in proc.stderr


# ------------------------------------------------------------------ 1. special files
READERS = {
    "read_dumps": tf_dump.read_dumps,
    "read_log_dumps": tf_dump.read_log_dumps,
    "read_memory_dump_pb": tf_dump.read_memory_dump_pb,
    "read_trace": gt.read_trace,
    "load_trace": gt.load_trace,
    "sniff_format": trace_io.sniff_format,
    "load_tf_log": gt.load_tf_log,
    "load_tf_vectors": gt.load_tf_vectors,
    "load_torch_snapshot": gt.load_torch_snapshot,
    "load_rmm_csv": gt.load_rmm_csv,
    "load_cupy_hook": gt.load_cupy_hook,
    "load_xplane": gt.load_xplane,
}


def _call_unblocking(fn, path: Path):
    """``fn(path)`` in a thread; if it is still waiting on the FIFO after 10 s, the test
    opens and closes both ends (so the thread ends) and the call counts as blocked."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn(path)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(10)
    blocked = t.is_alive()
    while t.is_alive():
        fds = []
        for flags in (os.O_RDONLY, os.O_WRONLY):   # a waiting writer, a waiting reader
            try:
                fds.append(os.open(path, flags | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(0.1)
        for fd in fds:
            os.close(fd)
    assert not blocked, f"{fn.__name__} blocked on a FIFO"
    return out


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_refuses_a_fifo_at_once_naming_it(tmp_path, reader):
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)
    out = _call_unblocking(READERS[reader], fifo)
    err = out.get("error")
    assert isinstance(err, TraceFormatError), out
    assert str(fifo) in str(err) and "FIFO" in str(err) and "\n" not in str(err)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
@pytest.mark.parametrize("command", ["explain", "replay", "convert"])
def test_commands_refuse_a_fifo_with_exit_code_1(tmp_path, capsys, command):
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)
    args = [command, str(fifo)] + ([str(tmp_path / "out.gdtrace")] if command == "convert"
                                   else [])
    out = _call_unblocking(lambda _path: main(args), fifo)
    assert out.get("value") == 1, out
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(fifo) in err and "FIFO" in err


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
@pytest.mark.parametrize("reader", ["read_dumps", "read_trace", "load_tf_log", "load_rmm_csv",
                                    "load_torch_snapshot"])
def test_a_device_is_refused_not_read_forever(reader):
    with pytest.raises(TraceFormatError, match="/dev/zero: is a device"):
        READERS[reader](Path("/dev/zero"))


@pytest.mark.parametrize("reader", ["read_trace", "load_tf_log", "load_torch_snapshot",
                                    "read_dumps", "load_tf_vectors"])
def test_a_directory_given_to_a_file_reader_is_refused(tmp_path, reader):
    with pytest.raises(TraceFormatError, match="is a directory"):
        READERS[reader](tmp_path)


def test_a_profile_directory_still_reads_as_a_profile(tmp_path):
    run = tmp_path / "plugins" / "profile" / "2025_01_01_00_00_00"
    run.mkdir(parents=True)
    (run / "host.xplane.pb").write_bytes((DATA / "real" / "tf_mlp_training.xplane.pb")
                                         .read_bytes())
    assert len(gt.load_trace(tmp_path)) == len(gt.load_xplane(run / "host.xplane.pb"))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_writing_over_a_fifo_is_refused(tmp_path):
    fifo = tmp_path / "out.gdtrace"
    os.mkfifo(fifo)
    trace = gt.read_trace(DATA / "traces" / "golden_v1.gdtrace")
    out = _call_unblocking(lambda p: gt.write_trace(trace, p, overwrite=True), fifo)
    assert isinstance(out.get("error"), TraceFormatError), out
    assert "FIFO" in str(out["error"])


# ------------------------------------------------------------------ 2. hostile long lines
def test_the_source_tag_is_the_last_one_of_the_first_run_that_has_one():
    body = tf_dump._body
    assert body("I0000 00:00:1796282022.689252   12639 bfc_allocator.cc:1049] Bin (256): x\n"
                ) == "Bin (256): x"
    assert body("I tensorflow/core/common_runtime/bfc_allocator.cc:685] InUse at 1") == \
        "InUse at 1"
    assert body("x.cc:1]y.cc:2] rest") == "rest"        # as a greedy \S+ reads it
    assert body("x.cc:1] y.cc:2] rest") == "y.cc:2] rest"
    assert body("  no tag here  \n") == "no tag here"
    assert body("a.c" * 400) == "a.c" * 400


_GLOG = "I0000 00:00:1796221057.331741   10338 bfc_allocator.cc:176] "


@pytest.mark.parametrize("command,head,unit,tail", [
    ("explain", "", "Allocator (", ""),                        # 440 KB took > 40 s
    ("explain", "", "Allocator (", ") ran out of memory trying to allocate"),
    ("replay", _GLOG, "Extending allocation by ", ""),         # 480 KB took > 40 s
    ("replay", _GLOG, "Allocator (", ""),
])
def test_a_one_megabyte_hostile_line_is_read_in_linear_time(tmp_path, command, head, unit,
                                                            tail):
    """Lines made of one pattern's prefix, repeated: each failed attempt used to rescan the
    rest of the line (a 1 MB line: minutes). The command now answers at once (the limit
    below only cuts off a hang)."""
    path = tmp_path / "hostile.log"
    path.write_text(head + unit * (1_000_000 // len(unit)) + tail + "\n")
    proc = _cli(command, str(path), timeout=120)
    _one_line_error(proc, path)


# ------------------------------------------------------------------ 3. pickles that repeat
_ENTRY = {"action": "alloc", "addr": 1 << 32, "size": 512, "stream": 0, "time_us": 1,
          "frames": []}


def _pickle(tmp_path, obj, name="snap.pickle"):
    import pickle

    path = tmp_path / name
    path.write_bytes(pickle.dumps(obj, protocol=4))
    return path


def test_a_pickle_whose_entries_repeat_by_reference_is_refused_by_its_size(tmp_path):
    """600,000 trace entries in 200 KB (one entry repeated by reference, one list repeated
    for six devices): under the old bound of 20,000,000 it was imported entry by entry (a 2
    MB file: 6,000,000 entries, minutes and 2 GB); now it is refused at once, before any
    entry is read, as more than one entry per 8 bytes of the file."""
    path = _pickle(tmp_path, {"segments": [], "device_traces": [[_ENTRY] * 100_000] * 6})
    assert path.stat().st_size < 250_000
    with pytest.raises(TraceFormatError) as info:
        gt.load_trace(path)
    msg = str(info.value)
    assert str(path) in msg and "one per 8 bytes" in msg and "\n" not in msg
    with pytest.raises(TraceFormatError, match="one per 8 bytes"):
        gt.load_torch_snapshot(path)


def test_allocator_settings_that_repeat_by_reference_are_refused(tmp_path):
    """A million values by reference in the settings, which the metadata would copy."""
    row = list(range(1000))
    path = _pickle(tmp_path, {"segments": [], "device_traces": [[_ENTRY]],
                              "allocator_settings": {"x": [row] * 1000}})
    with pytest.raises(TraceFormatError, match=r"allocator_settings hold more than 10,000"):
        gt.load_trace(path)


def test_an_action_that_is_not_a_string_is_refused_not_printed(tmp_path):
    huge = [[0] * 1000] * 1000        # str() of it: 3 MB, once per entry
    path = _pickle(tmp_path, {"segments": [], "device_traces": [
        [dict(_ENTRY, action=huge)] * 100]})
    with pytest.raises(TraceFormatError, match=r"device_traces\[0\]\[0\]: expected a dict "
                                               "with an 'action' string"):
        gt.load_torch_snapshot(path)


def test_expandable_segment_maps_are_read_in_n_log_n(tmp_path):
    """Thousands of maps, then unmaps of what was mapped and of what was not: the ranges
    mapped before the trace are exactly the unmapped ones never mapped, found in one pass
    (a range set with bisection, not a list rebuilt per entry)."""
    import time

    import numpy as np

    from gpudash.trace.torch_replay import ACTIONS, TorchTrace, start_state

    n = 20_000
    entries = [("segment_map", i << 21, 1 << 21) for i in range(n)]
    entries += [("segment_unmap", i << 21, 1 << 21) for i in range(2 * n)]
    entries.append(("segment_unmap", (1 << 21) + 5, 3 << 21))
    act = np.array([ACTIONS[a] for a, _, _ in entries], dtype=np.int8)
    addr = np.array([p for _, p, _ in entries], dtype=np.int64)
    size = np.array([s for _, _, s in entries], dtype=np.int64)
    tt = TorchTrace(0, act, addr, size, np.zeros(len(act), dtype=np.int64), final=[])
    t0 = time.perf_counter()
    state, counts = start_state(tt)
    assert time.perf_counter() - t0 < 5.0
    got = [(seg.address, seg.size) for seg in state]
    # pages n..2n-1 were unmapped without a map before: one mapped range (adjacent pages
    # join). The odd last unmap, inside pages that were unmapped already, says nothing
    # consistent about the start (walking back, the page maps undo it)
    assert got == [(n << 21, n << 21)]
    small = TorchTrace(0, np.array([ACTIONS["segment_map"], ACTIONS["segment_unmap"]],
                                   dtype=np.int8), np.array([0, 50], dtype=np.int64),
                       np.array([100, 100], dtype=np.int64), np.zeros(2, dtype=np.int64),
                       final=[])
    assert [(seg.address, seg.size) for seg in start_state(small)[0]] == [(100, 50)]


from shared_files import EXTERNAL  # noqa: E402


@pytest.mark.skipif(not EXTERNAL.is_dir(), reason="needs ../shared/reference/external")
def test_every_real_snapshot_is_within_the_bound_per_byte():
    files = sorted(p for p in EXTERNAL.iterdir() if p.suffix in (".pickle", ".pkl"))
    assert files
    for path in files:
        snap = torch_snapshot.load_torch_snapshot_dict(path)
        items = len(snap.get("segments") or []) + sum(
            len(s.get("blocks") or []) for s in snap.get("segments") or []) + sum(
            len(t) for t in snap.get("device_traces") or [])
        assert items * torch_snapshot.BYTES_PER_ITEM * 4 < path.stat().st_size, path
        assert len(gt.load_trace(path)) > 0


# ------------------------------------------------------------------ 4. negative requested sizes
def test_a_negative_cupy_size_is_refused(tmp_path):
    path = tmp_path / "hook.jsonl"
    path.write_text('{"hook":"malloc","device_id":0,"size":-1,"mem_size":512,"mem_ptr":4096}\n')
    with pytest.raises(TraceFormatError, match=r"hook.jsonl, line 1: 'malloc' record with size "
                                               r"-1; expected 0 \.\."):
        gt.load_trace(path)
    t = gt.load_cupy_hook(path, strict=False)            # skipped when asked to skip
    assert len(t) == 0 and t.meta["skipped_lines"] == 1


@pytest.mark.parametrize("where", ["entry", "free", "block"])
def test_a_negative_pytorch_requested_size_is_refused(tmp_path, where):
    seg = {"device": 0, "address": 1 << 40, "total_size": 2 << 20, "blocks": [
        {"address": 1 << 40, "size": 2 << 20, "state": "active_allocated",
         "requested_size": -1 if where == "block" else 100}]}
    entries = [dict(_ENTRY, requested_size=-1 if where == "entry" else 100)]
    if where == "free":
        entries.append(dict(_ENTRY, action="free_completed", requested_size=-1))
    path = tmp_path / "snap.json"
    path.write_text(json.dumps({"segments": [seg], "device_traces": [entries]}))
    with pytest.raises(TraceFormatError, match=r"a negative requested_size \(-1\)") as info:
        gt.load_trace(path)
    assert str(path) in str(info.value)


def _trace_with(**changes):
    from gpudash.workloads import training_loop

    t = training_loop(steps=1, layers=2, hidden=64)
    for col, (row, value) in changes.items():
        t.columns[col][row] = value
    return t


@pytest.mark.parametrize("col,value,message", [
    ("requested", -1, r"event 3 has a negative requested size \(-1 B\)"),
    ("size", -256, r"event 3 has a negative size \(-256 B\)"),
    ("device", -1, r"event 3 has device -1; devices are 0 \.\. 32767"),
])
def test_a_gdtrace_with_negative_values_is_refused(tmp_path, col, value, message):
    t = _trace_with(**{col: (3, value)})
    path = tmp_path / "t.gdtrace"
    gt.write_trace(t, path)
    for reader in (gt.read_trace, gt.load_trace):
        with pytest.raises(TraceFormatError, match=message) as info:
            reader(path)
        assert str(path) in str(info.value)


@pytest.mark.core
def test_a_limit_row_keeps_its_old_value_in_requested(tmp_path):
    from gpudash import BFCAllocator, Recorder
    from gpudash.devices import SimulatedDevice

    alloc = BFCAllocator(SimulatedDevice(1 << 30), 1 << 29)
    with Recorder(alloc) as rec:
        p = alloc.allocate(1000)
        alloc.set_memory_limit(1 << 28)
        alloc.deallocate(p)
    path = tmp_path / "t.gdtrace"
    gt.write_trace(rec.to_trace(), path)
    t = gt.load_trace(path)
    assert (t.select("limit").requested == 1 << 29).all()


# ------------------------------------------------------------------ 5. tf-vectors metadata
@pytest.mark.parametrize("field,text,message", [
    ("memory_limit", '"x"', r"'memory_limit' is 'x'; expected a whole number of bytes"),
    ("memory_limit", "NaN", r"'memory_limit' is nan; expected a whole number"),
    ("memory_limit", "Infinity", r"'memory_limit' is inf; expected a whole number"),
    ("memory_limit", "1.5", r"'memory_limit' is 1.5; expected a whole number"),
    ("memory_limit", "-1", r"'memory_limit' is -1; expected a whole number"),
    ("memory_limit", "true", r"'memory_limit' is True; expected a whole number"),
    ("allow_growth", '"yes"', r"'allow_growth' is 'yes' \(a string\); expected true or "),
    ("allow_growth", '"false"', r"'allow_growth' is 'false' \(a string\); expected true or"),
    ("garbage_collection", "1", r"'garbage_collection' is 1; expected true or false"),
])
def test_tf_vectors_metadata_is_checked(tmp_path, field, text, message):
    path = tmp_path / "vectors.json"
    path.write_text('{"%s": %s, "steps": [["region", 4096, 1048576]]}' % (field, text))
    with pytest.raises(TraceFormatError, match=message) as info:
        gt.load_trace(path)
    assert str(path) in str(info.value)
    _one_line_error(_cli("replay", str(path)), path)


def test_tf_vectors_growth_given_as_a_boolean_is_recorded_as_one(tmp_path):
    path = tmp_path / "vectors.json"
    path.write_text('{"memory_limit": 1048576, "allow_growth": false, '
                    '"steps": [["region", 4096, 1048576], ["alloc", 100, 4096]]}')
    t = gt.load_trace(path)
    assert t.meta["allow_growth"] is False
    assert t.devices[0]["options"]["allow_growth"] is False
    assert trace_settings(t)["allow_growth"] is False


# ------------------------------------------------------------------ 6. damaged .npy headers
def _rebuilt(tmp_path, trace, mutate):
    """``trace`` written, its records changed by ``mutate`` and their CRCs made valid."""
    from gpudash.formats import format as fmt

    good = tmp_path / "good.gdtrace"
    fmt.write_trace(trace, good, overwrite=True)
    data = good.read_bytes()
    off, records = len(fmt.MAGIC), []
    while off < len(data):
        (rtype, js, payload, off), _ = fmt._parse_record(data, off)
        records.append([rtype, json.loads(js), bytes(payload)])
    mutate(records)
    out = tmp_path / "crafted.gdtrace"
    out.write_bytes(fmt.MAGIC + b"".join(fmt._record(t, h, p) for t, h, p in records))
    return out


@pytest.mark.parametrize("header", [
    b"{'descr': \"\"\"<i8', 'fortran_order': False, 'shape': (3,), }",   # TokenError
    b"{'descr': '<i8', 'fortran_order': False, 'shape': (3,, }",          # TokenError
    b"{'descr': '<i8', 'fortran_order': False, 'shape': (3,), '",         # SyntaxError
    b"{'descr': '<i8', 'fortran_order': False, 'shape': (1e999,), }",
])
def test_a_batch_whose_npy_header_numpy_cannot_parse_is_a_damaged_batch(tmp_path, header):
    from gpudash.workloads import training_loop

    def spoil(records):
        rtype, head, payload = records[1]
        name, start, _nbytes = head["columns"][0]
        hlen = int.from_bytes(payload[start + 8:start + 10], "little")
        body = header.ljust(hlen - 1) + b"\n"
        records[1][2] = payload[:start + 10] + body + payload[start + 10 + hlen:]

    path = _rebuilt(tmp_path, training_loop(steps=1, layers=2, hidden=64), spoil)
    for reader in (gt.read_trace, gt.load_trace):
        with pytest.raises(TraceFormatError, match=r"record 1 \(event batch\).*column 'seq' "
                                                   "is not valid .npy data") as info:
            reader(path)
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------ 7, 8. trace metadata
def _with_meta(tmp_path, **meta):
    from gpudash.workloads import training_loop

    t = training_loop(steps=1, layers=2, hidden=64)
    t.meta.update(meta)
    path = tmp_path / "t.gdtrace"
    gt.write_trace(t, path, overwrite=True)
    return path


_DEV = {"index": 0, "name": "GPU_0_bfc", "capacity": 1 << 30, "memory_limit": 1 << 29,
        "options": {"allow_growth": True, "garbage_collection": False}}


@pytest.mark.parametrize("devices,message", [
    (5, r"metadata 'devices' is 5; expected a list of objects"),
    (True, r"metadata 'devices' is True; expected a list"),
    (["x"], r"metadata devices\[0\] is 'x'; expected an object with an 'index'"),
    ([{"index": "0"}], r"devices\[0\]: 'index' is '0'; expected an integer 0 \.\. 32767"),
    ([{"index": 40000}], r"devices\[0\]: 'index' is 40000; expected an integer"),
    ([{"index": -1}], r"devices\[0\]: 'index' is -1"),
    ([{"index": True}], r"devices\[0\]: 'index' is True"),
    ([dict(_DEV, name=7)], r"devices\[0\]: 'name' is 7; expected a string"),
    ([dict(_DEV, capacity="x")], r"'capacity' is 'x'; expected a whole number of bytes"),
    ([dict(_DEV, options=[])], r"'options' is list; expected an object"),
    ([dict(_DEV, options={"allow_growth": "yes"})],
     r"'options.allow_growth' is 'yes' \(a string\); expected true or false"),
    ([dict(_DEV, options={"allow_growth": "false"})],
     r"'options.allow_growth' is 'false' \(a string\); expected true or false"),
    ([dict(_DEV, options={"garbage_collection": 1})],
     r"'options.garbage_collection' is 1; expected true or false"),
    ([dict(_DEV, options={"memory_limit": 1e30})], r"'options.memory_limit' is 1e\+30"),
])
def test_trace_metadata_devices_are_checked_when_read(tmp_path, devices, message):
    path = _with_meta(tmp_path, devices=devices)
    for reader in (gt.read_trace, gt.load_trace):
        with pytest.raises(TraceFormatError, match=message) as info:
            reader(path)
        assert str(path) in str(info.value)
    for command in ("replay", "convert"):
        args = [command, str(path)] + ([str(tmp_path / "out.json")] if command == "convert"
                                       else [])
        _one_line_error(_cli(*args), path)


@pytest.mark.core
@pytest.mark.parametrize("devices", [5, ["x"], True, [{"index": "x"}, None], {"index": 0}])
def test_odd_metadata_devices_in_memory_do_not_break_replay(devices):
    from gpudash.trace.replay import device_label, replay

    t = _trace_with()
    t.meta["devices"] = devices
    assert trace_settings(t) == {"device": 0}
    assert device_label(t, 0) == "device 0"
    assert replay(t).calls == len(t.calls())
    assert gt.replay_devices(t)[0].calls == len(t.calls())
    assert len(gt.Trace.concat([t, t])) == 2 * len(t)
    assert t[0].allocator == "" and [d["index"] for d in t.devices] == [0]


@pytest.mark.core
@pytest.mark.parametrize("given", [False, True])
def test_recorded_growth_is_replayed_as_recorded(tmp_path, given):
    """A JSON boolean is taken as it is (bool() of the string "false" was True: a trace
    recorded without growth replayed with it); a string is refused when the file is read
    (test above), as the live settings refuse allow_growth="false"."""
    path = _with_meta(tmp_path, devices=[dict(_DEV, options={"allow_growth": given})])
    t = gt.load_trace(path)
    assert trace_settings(t)["allow_growth"] is given
    assert gt.replay(t, options="trace").options["allow_growth"] is given
    proc = _cli("replay", str(path))
    assert proc.returncode in (0, 3), proc.stderr
    assert f"allow_growth={given}" in proc.stdout


def test_recorded_growth_that_is_not_a_boolean_is_refused_in_memory_too():
    from gpudash import ConfigError

    t = _trace_with()
    t.meta["devices"] = [dict(_DEV, options={"allow_growth": "no"})]
    with pytest.raises(ConfigError, match=r"device 0: the trace records options.allow_growth "
                                          r"= 'no' \(a string\); expected true or false"):
        trace_settings(t)
    t.meta["devices"] = [dict(_DEV, options={"allow_growth": "false"})]
    with pytest.raises(ConfigError, match=r"records options.allow_growth = 'false'"):
        gt.replay(t, options="trace")
    for given in ("false", "maybe", 1):
        with pytest.raises(ConfigError, match=f"allow_growth is {given!r}"):
            gt.replay(_trace_with(), allow_growth=given)


# ------------------------------------------------------------------ 9. device indices
def _profile(path: Path, allocators: int, double: float | None = None,
             per_allocator: int = 2) -> Path:
    """A profile with ``allocators`` allocators, each allocating and freeing a block
    (``per_allocator`` events); with ``double``, the first event's allocation_bytes is that
    double instead of an integer."""
    from gpudash.proto import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    stats = ["allocator_name", "bytes_allocated", "requested_bytes", "allocation_bytes",
             "addr"]
    for i, name in enumerate(stats, 1):
        plane.stat_metadata[i].id = i
        plane.stat_metadata[i].name = name
    first = len(stats) + 1
    for d in range(allocators):
        plane.stat_metadata[first + d].id = first + d
        plane.stat_metadata[first + d].name = f"GPU_{d}_bfc"
    plane.event_metadata[1].name = "MemoryAllocation"
    plane.event_metadata[2].name = "MemoryDeallocation"
    line = plane.lines.add(name="stream", timestamp_ns=1_700_000_000_000_000_000)
    t = 0
    for kind in (1, 2)[:per_allocator]:
        for d in range(allocators):
            ev = line.events.add(offset_ps=t * 1000, metadata_id=kind)
            t += 1
            ev.stats.add(metadata_id=1, ref_value=first + d)
            ev.stats.add(metadata_id=2, int64_value=1024 if kind == 1 else 0)
            ev.stats.add(metadata_id=3, int64_value=1000)
            if double is not None and t == 1:
                ev.stats.add(metadata_id=4, double_value=double)
            else:
                ev.stats.add(metadata_id=4, int64_value=1024)
            ev.stats.add(metadata_id=5, int64_value=0x7F0000000000 + 4096 * (d % 7))
    path.write_bytes(space.SerializeToString())
    return path


def test_a_profile_with_more_allocators_than_device_indices_is_refused(tmp_path):
    path = _profile(tmp_path / "many.xplane.pb", 32_769, per_allocator=1)
    with pytest.raises(TraceFormatError, match=r"32,769 allocators; a trace holds at most "
                                               r"32,768 devices") as info:
        gt.load_trace(path)
    assert str(path) in str(info.value)


def test_a_profile_with_32768_allocators_loads_with_every_index(tmp_path):
    t = gt.load_trace(_profile(tmp_path / "full.xplane.pb", 32_768, per_allocator=1))
    assert int(t.device.min()) == 0 and int(t.device.max()) == 32_767
    assert t.devices[-1]["name"] == "GPU_32767_bfc"


@pytest.mark.parametrize("text,message", [
    ("-1", r"line 2: Device ID '-1' is not a device index 0 \.\. 32767"),
    ("32768", r"line 2: Device ID '32768' is not a device index"),
    ("1e3", r"line 2: Device ID '1e3' is not a device index"),
])
def test_an_rmm_012_device_id_outside_the_range_is_refused(tmp_path, text, message):
    path = tmp_path / "rmm.csv"
    path.write_text("Event Type,Device ID,Address,Stream,Size (bytes),Free Memory,Total Memory,"
                    f"Current Allocs,Start,End,Elapsed,Location\nAlloc,{text},0x7f00,0x0,1024,"
                    "0,0,0,0.000001,0.000001,0,x.py:1\n")
    with pytest.raises(TraceFormatError, match=message) as info:
        gt.load_trace(path)
    assert str(path) in str(info.value)


def test_an_rmm_device_outside_the_range_is_refused(tmp_path):
    from gpudash import ConfigError

    good = DATA / "traces" / "rmm_log.dev1.csv"
    with pytest.raises(ConfigError, match=r"device must be an integer 0 \.\. 32767; got -1"):
        gt.load_rmm_csv(good, device=-1)
    path = tmp_path / "rmm_log.dev40000.csv"
    path.write_bytes(good.read_bytes())
    with pytest.raises(TraceFormatError, match=r"rmm_log.dev40000.csv: the file name's "
                                               r"\.dev40000 is above device 32767"):
        gt.load_trace(path)


@pytest.mark.parametrize("device", [-1, 32768])
def test_a_cupy_device_id_outside_the_range_is_refused(tmp_path, device):
    path = tmp_path / "hook.jsonl"
    path.write_text('{"hook":"alloc","device_id":%d,"mem_size":512,"mem_ptr":4096}\n' % device)
    with pytest.raises(TraceFormatError, match=rf"line 1: 'alloc' record with device_id "
                                               rf"{device}; expected 0 \.\. 32,767") as info:
        gt.load_trace(path)
    assert str(path) in str(info.value)


def test_pytorch_traces_beyond_device_32767_are_refused(tmp_path):
    path = tmp_path / "snap.json"
    path.write_text(json.dumps({"segments": [], "device_traces": [[]] * 32768 + [[_ENTRY]]}))
    with pytest.raises(TraceFormatError, match=r"device_traces\[32768\] has entries; device "
                                               r"indices go up to 32,767"):
        gt.load_trace(path)


def test_ranks_that_add_up_to_more_than_32768_devices_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    one = _profile(tmp_path / "a" / "rank0.xplane.pb", 20_000, per_allocator=1)
    other = tmp_path / "a" / "rank1.xplane.pb"
    other.write_bytes(one.read_bytes())
    with pytest.raises(TraceFormatError, match=r"rank1.xplane.pb: the ranks up to this file "
                                               r"hold 40,000 devices"):
        gt.load_ranks([one, other])


# ------------------------------------------------------------------ 10. odd doubles
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_a_profile_double_that_is_no_byte_count_is_refused_without_a_warning(tmp_path,
                                                                               value):
    import warnings

    path = _profile(tmp_path / "odd.xplane.pb", 2, double=value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # numpy's RuntimeWarning would raise here
        with pytest.raises(TraceFormatError, match=r"event data damaged \(a stat holds the "
                                                   r"double .*; expected a finite number"):
            gt.load_trace(path)
    proc = _cli("replay", str(path))
    _one_line_error(proc, path)
    assert "RuntimeWarning" not in proc.stderr


def test_a_profile_double_that_is_a_byte_count_is_read(tmp_path):
    t = gt.load_trace(_profile(tmp_path / "ok.xplane.pb", 2, double=1024.0))
    assert t.select("alloc").size.tolist() == [1024, 1024]


# ------------------------------------------------------------------ 11. many devices
def _many_devices(n_dev: int = 5, seed: int = 0):
    """A trace of ``n_dev`` devices with interleaved regions, allocations and frees (alloc
    ids that collide across devices), built by gpudash's importer conventions."""
    import numpy as np

    from gpudash.formats.format import EventBuilder

    rng = np.random.default_rng(seed)
    b = EventBuilder()
    live: dict[int, list[int]] = {d: [] for d in range(n_dev)}
    for d in range(n_dev):
        b.add_device(d, f"GPU_{d}_bfc", 1 << 30, {"allow_growth": bool(d % 2)})
    t = 0
    for _ in range(60 * n_dev):
        d = int(rng.integers(n_dev))
        t += 1
        r = rng.random()
        if r < 0.1:
            b.extend(t, d, int(rng.integers(1, 64)) << 24, 1 << 22)
        elif r < 0.6 or not live[d]:
            p = (int(rng.integers(1, 64)) << 24) + int(rng.integers(0, 1 << 16)) * 256
            if p not in live[d]:
                b.alloc(t, d, p, int(rng.integers(1, 1 << 20)))
                live[d].append(p)
        else:
            b.free(t, d, live[d].pop(int(rng.integers(len(live[d])))))
    return b.build({"source": "test"})


@pytest.mark.core
def test_replay_devices_scans_the_trace_once_and_matches_replay(monkeypatch):
    """Replaying each device used to scan every row once per device (devices x events);
    the calls are now found once and split by device."""
    from gpudash.trace.replay import replay

    t = _many_devices(6)
    one_by_one = {d: replay(t, device=d, record=False) for d in range(6)}
    scans = []
    real = gt.Trace.calls
    monkeypatch.setattr(gt.Trace, "calls", lambda self, device=None: (
        scans.append(device), real(self, device))[1])
    together = gt.replay_devices(t, record=False)
    assert scans == [None]
    assert sorted(together) == list(range(6))
    for d, r in together.items():
        mine = one_by_one[d]
        assert (r.calls, r.events, r.oom_count, r.peak_bytes_in_use, r.peak_pool_bytes,
                r.options) == (mine.calls, mine.events, mine.oom_count,
                               mine.peak_bytes_in_use, mine.peak_pool_bytes, mine.options)
        for k, v in r.per_call.items():
            assert v.tolist() == mine.per_call[k].tolist()


@pytest.mark.core
def test_the_replay_command_scans_a_trace_of_many_devices_once(tmp_path, monkeypatch,
                                                                capsys):
    t = _many_devices(4)
    path = tmp_path / "four.gdtrace"
    gt.write_trace(t, path)
    scans = []
    real = gt.Trace.calls
    monkeypatch.setattr(gt.Trace, "calls", lambda self, device=None: (
        scans.append(device), real(self, device))[1])
    assert main(["replay", str(path)]) in (0, 3)      # 3: a replay ran out of memory
    out = capsys.readouterr().out
    assert scans == [None]
    for d in range(4):   # each device replayed with the growth it recorded
        assert f"device {d} (GPU_{d}_bfc):" in out
    assert out.count("allow_growth=True") == 2 and out.count("allow_growth=False") == 2


@pytest.mark.core
def test_the_devices_metadata_is_read_once_however_many_devices_replay(monkeypatch):
    """Each device's replay asks for its name (its caveats, its label): the metadata's
    device list is read once, not once per device (which made a trace of 8,000 devices take
    over 30 s)."""
    from gpudash.formats import format as fmt

    t = _many_devices(200)
    reads = []
    real = fmt._has_index
    monkeypatch.setattr(fmt, "_has_index", lambda e: (reads.append(1), real(e))[1])
    fmt._ENTRIES_SEEN.clear()
    gt.replay_devices(t, record=False, per_call=False)
    assert 0 < len(reads) <= 2 * 200


def test_explain_on_json_nested_past_the_stack_is_one_line(tmp_path, capsys):
    path = tmp_path / "nested.pickle"
    path.write_text('{"segments": ' + "[" * 5000 + "]" * 5000 + "}")
    assert main(["explain", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "nested too deeply" in err[0]


def test_regions_and_peaks_of_many_devices_match_a_device_by_device_count():
    import numpy as np

    from gpudash.events import EventKind
    from gpudash.formats.format import row_regions

    for seed in range(5):
        t = _many_devices(7, seed)
        c = t.columns
        want = np.zeros(len(t), dtype=np.int64)
        for i in range(len(t)):          # the containing region, row by row
            k, d, p = int(c["kind"][i]), int(c["device"][i]), int(c["ptr"][i])
            if k in (EventKind.EXTEND, EventKind.RELEASE):
                want[i] = p
            elif k in (EventKind.ALLOC, EventKind.FREE):
                ext = [(int(c["ptr"][j]), j) for j in range(len(t))
                       if c["kind"][j] == EventKind.EXTEND and c["device"][j] == d
                       and c["ptr"][j] <= p]
                if ext:
                    start, j = max(ext)
                    if p < start + int(c["size"][j]):
                        want[i] = start
        assert row_regions(c).tolist() == want.tolist()
        s = t.summary()
        for d in range(7):
            mine = t.select(device=d)
            running = np.cumsum(np.where(mine.kind == EventKind.ALLOC, mine.requested, 0)
                                - np.where(mine.kind == EventKind.FREE, mine.requested, 0))
            assert s["peak_requested_bytes_by_device"][d] == max(0, int(running.max()))
            assert s["peak_allocated_bytes_by_device"][d] == \
                mine.summary()["peak_allocated_bytes"]
