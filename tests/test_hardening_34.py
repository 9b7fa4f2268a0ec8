"""The third hardening round (issue 34): small inputs that hung the snapshot loader or took
gigabytes, a compiled core that crashed where the Python model raises, settings refused but
kept, cores that disagreed on huge settings, a sweep that outlived Ctrl-C, the allocator
configuration read unlike PyTorch, and an internal error on a damaged JSON snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import test_widgets_model as shared

from gpudash import TraceFormatError
from gpudash.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
comms = shared.comms     # the dashboard's comm log (a fixture)


# ------------------------------------------------------------------ pickle bombs (9 B - 1 KB)
def _memo_bomb() -> bytes:
    """PROTO 2, None, LONG_BINPUT 2**27, STOP: the unpickler's memo array grows to 2**28
    pointers (2 GiB) to store one None."""
    return b"\x80\x02N" + b"r" + (1 << 27).to_bytes(4, "little") + b"."


def _hash_bomb(depth: int = 60) -> bytes:
    """t0 = (); t[k+1] = (t[k], t[k]), every level shared through the memo; then
    {t[depth]: None}: hashing the key walks 2**depth tuples."""
    out = bytearray(b"\x80\x02)q\x00")
    for k in range(depth):
        out += b"h" + bytes([k]) + b"h" + bytes([k]) + b"\x86q" + bytes([k + 1])
    out += b"}h" + bytes([depth]) + b"Ns."
    return bytes(out)


def _repr_bomb(depth: int = 60) -> bytes:
    """A snapshot whose one frame is a dict that is not a frame, holding l0 = [],
    l[k+1] = [l[k], l[k]] shared at every level: its full repr has 2**depth parts."""
    import pickle

    head = pickle.dumps({"segments": [], "device_traces": [[{
        "action": "alloc", "addr": 1 << 32, "size": 512, "stream": 0, "time_us": 1,
        "frames": [{"filename": "LIST", "line": 1, "name": "f"}]}]]}, protocol=2)
    # the protocol-2 pickler memoises with BINPUT/LONG_BINPUT; build the chain by hand with
    # memo slots from 200 up, then put it where the filename string was
    chain = bytearray(b"]q\xc80")                   # l0 = [] -> memo[200], popped
    for k in range(depth):
        a = bytes([200 + k]) if 200 + k < 256 else None
        get = (b"h" + a) if a else (b"j" + (200 + k).to_bytes(4, "little"))
        put_i = 201 + k
        put = (b"q" + bytes([put_i])) if put_i < 256 else \
            (b"r" + put_i.to_bytes(4, "little"))
        chain += b"](" + get + get + b"e" + put + (b"0" if k < depth - 1 else b"")
    text = b"X\x04\x00\x00\x00LIST"
    assert text in head
    return head.replace(text, bytes(chain), 1)


def _run_load(tmp_path: Path, data: bytes, name: str, timeout: float = 120) -> str:
    """Load ``data`` in a process of its own (a hang or 2 GB must not take the test run
    with it): the error's text, or 'LOADED'."""
    path = tmp_path / name
    path.write_bytes(data)
    code = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_DATA, (1 << 30, 1 << 30))
        from gpudash import TraceFormatError
        from gpudash.trace import load_trace
        try:
            load_trace({str(path)!r}, format="torch-pickle")
            print("LOADED")
        except TraceFormatError as e:
            print("TraceFormatError:", e)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading {name} ({len(data)} bytes) hung for more than {timeout} s")
    return r.stdout + r.stderr


def test_a_memo_index_of_2_27_is_refused_before_the_memo_grows(tmp_path):
    data = _memo_bomb()
    assert len(data) == 9
    out = _run_load(tmp_path, data, "memo.pickle")
    assert "TraceFormatError:" in out and "memo index 134,217,728" in out, out


def test_a_shared_tuple_chain_used_as_a_dict_key_is_refused_unhashed(tmp_path):
    data = _hash_bomb()
    assert len(data) < 1024
    out = _run_load(tmp_path, data, "hash.pickle", timeout=60)
    assert "TraceFormatError:" in out and "a dict key that is not a string" in out, out


def test_a_shared_nested_list_in_an_error_message_is_shown_bounded(tmp_path):
    data = _repr_bomb()
    assert len(data) < 1024
    out = _run_load(tmp_path, data, "repr.pickle", timeout=60)
    assert "TraceFormatError:" in out and "frames[0]: expected a frame" in out, out
    assert len(out) < 600, out


@pytest.mark.parametrize("data, what", [
    (b"\x80\x02Np" + b"999999999\n.", "memo index"),                 # PUT, protocol 0
    (b"\x80\x04\x8f(K\x01\x90.", "set element that is not a string"),  # {1}
    (b"\x80\x02}(K\x01Nu.", "dict key that is not a string"),        # {1: None}
    (b"\x80\x02X\xff\xff\xff\x7fabc.", "past the end"),               # a 2 GB string claimed
    (b"\x80\x02N]R.", "opcode b'R'"),                                 # REDUCE, no global
])
def test_what_the_pickle_check_refuses(tmp_path, data, what):
    path = tmp_path / "x.pickle"
    path.write_bytes(data)
    with pytest.raises(TraceFormatError, match="refusing to load|nor a readable pickle") as e:
        load_trace(path, format="torch-pickle")
    assert what in str(e.value)


def test_real_and_written_snapshots_pass_the_pickle_check(tmp_path):
    """Every shape a real pickle takes: protocols 0 to 5, memoised keys, tuples as values,
    PUT/GET in text and binary forms."""
    import pickle

    from gpudash.formats.torch_snapshot import _check_pickle, load_torch_snapshot

    snap = {"segments": [{"device": 0, "address": 1 << 40, "total_size": 2 << 20,
                          "segment_pool_id": (0, 0), "blocks": [
                              {"size": 2 << 20, "state": "inactive", "frames": []}] * 3}],
            "device_traces": [[{"action": "alloc", "addr": 1 << 40, "size": 512,
                                "stream": 0, "time_us": 1.5, "frames": []}] * 300]}
    rows = len(load_torch_snapshot(snap))
    for proto in range(6):
        data = pickle.dumps(snap, protocol=proto)
        _check_pickle(data, "x")
        path = tmp_path / f"p{proto}.pickle"
        path.write_bytes(data)
        assert len(load_trace(path, format="torch-pickle")) == rows


# ------------------------------------------------------- a device that hands out overlaps
class _Overlapping:
    """A device whose second region starts inside its first."""

    def __init__(self):
        self.given, self.freed = [], []

    def alloc(self, nbytes):
        ptr = (1 << 20) + len(self.given) * 4096
        self.given.append((ptr, nbytes))
        return ptr

    def free(self, ptr, nbytes):
        self.freed.append((ptr, nbytes))


@pytest.mark.core
def test_a_bfc_region_over_an_earlier_one_is_refused_not_a_crash():
    """The compiled BFC core indexed a region by address and crashed (SIGSEGV) when a
    device's region overlapped an earlier one; both cores now refuse it alike."""
    from gpudash import InvalidPointerError
    from gpudash.bfc import BFCAllocator

    dev = _Overlapping()
    a = BFCAllocator(dev, memory_limit=1 << 30, allow_growth=True)
    p = a.allocate(2 << 20)
    with pytest.raises(InvalidPointerError, match="overlaps the region 0x100000"):
        a.allocate(8 << 20)
    assert dev.freed == [dev.given[1]]      # the refused range went back to the device
    a.deallocate(p)
    a.check()
    assert a.pool_bytes == dev.given[0][1]


@pytest.mark.core
def test_the_overlap_fuzz_case_does_not_crash_the_process():
    """The case that crashed the compiled core (regions from six addresses, at random)."""
    code = textwrap.dedent("""
        import random
        from gpudash.bfc import BFCAllocator
        rng = random.Random(2)
        class Dev:
            def alloc(self, n):
                return rng.choice([1 << 20, (1 << 20) + 512, 2 << 20, 3 << 20, 8 << 20,
                                   (1 << 20) - 512])
            def free(self, p, n):
                pass
        a = BFCAllocator(Dev(), memory_limit=rng.choice([1 << 30, 64 << 20]),
                         garbage_collection=rng.random() < 0.5)
        live = []
        for _ in range(300):
            r = rng.random()
            try:
                if r < 0.5 or not live:
                    live.append(a.allocate(rng.choice([512, 4096, 1 << 20, 2 << 20, 3 << 20,
                                                       11 << 20, 30 << 20])))
                elif r < 0.8:
                    a.deallocate(live.pop(rng.randrange(len(live))))
                else:
                    a.release_free_regions()
            except Exception:
                pass
        print("survived")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stderr[-500:])


# ------------------------------------------------- huge settings and streams, both cores
def _caching(conf=""):
    from gpudash.caching import CachingAllocator
    from gpudash.devices import SimulatedDevice

    return CachingAllocator(SimulatedDevice("8GiB"), conf)


@pytest.mark.core
@pytest.mark.parametrize("how", ["string", "by name"])
@pytest.mark.parametrize("key", ["max_split_size_mb", "max_non_split_rounding_mb"])
def test_a_setting_beyond_int64_is_held_whole_not_half_applied(how, key):
    """max_split_size_mb of 2**43 MiB or more: the compiled core raised OverflowError after
    the new value was stored. PyTorch keeps up to SIZE_MAX; both cores now hold it as a
    size larger than any block."""
    a = _caching()
    mib = 1 << 43
    if how == "string":
        a.set_allocator_settings(f"{key}:{mib}")
    else:
        a.configure(**{key: mib})
    p = a.allocate(300 << 20)
    assert a.allocated_size(p) == 300 << 20
    a.deallocate(p)
    q = a.allocate(100 << 20)     # the cached 300 MiB block is split (no max_split below it)
    assert q == p
    a.check()


@pytest.mark.core
def test_a_setting_the_model_cannot_hold_leaves_the_old_one(monkeypatch):
    """Whatever refuses a new setting after it was parsed, the allocator keeps the old."""
    a = _caching("max_split_size_mb:64")
    calls = []
    real = type(a)._settings_changed

    def fail_once(self):
        calls.append(1)
        if len(calls) == 1:
            raise OverflowError("refused")
        real(self)
    monkeypatch.setattr(type(a), "_settings_changed", fail_once)
    with pytest.raises(OverflowError):
        a.configure(max_split_size_mb=128)
    assert a.config.max_split_size == 64 << 20


@pytest.mark.core
@pytest.mark.parametrize("divisions", [1 << 54, 1 << 62, 1 << 63, 1 << 70])
def test_huge_roundup_divisions_round_like_the_python_model(divisions):
    """512 * divisions above any size: 512-byte rounding (the compiled core overflowed the
    product and rounded to a power of two, or raised OverflowError)."""
    a = _caching()
    a.configure(roundup_power2_divisions=divisions)
    p = a.allocate((3 << 20) + 1)
    assert a.allocated_size(p) == (3 << 20) + 512


@pytest.mark.core
@pytest.mark.parametrize("stream", [1 << 64, 1 << 70, -(1 << 63) - 1])
def test_a_stream_beyond_cudastream_t_is_refused_by_both_cores(stream):
    """The Python model took 2**64 as a stream of its own, the compiled core as stream 0."""
    from gpudash import ConfigError

    a = _caching()
    with pytest.raises(ConfigError, match="stream must be a cudaStream_t value"):
        a.allocate(1000, stream=stream)
    p = a.allocate(1000, stream=(1 << 64) - 1)
    a.deallocate(p)
    assert a.allocate(1000, stream=-1) == p      # -1 is 2**64 - 1, as a cudaStream_t


@pytest.mark.core
def test_the_dashboard_s_max_split_beyond_int64_is_held_whole(comms):
    """The dashboard's max_split control: 2**43 MiB was refused with an OverflowError and
    kept all the same; now held whole, as PyTorch does."""
    from test_widgets_dashboard import act

    import gpudash
    from gpudash.widgets import Dashboard, LiveModel

    sess = gpudash.Session(allocator="torch", simulate="16GiB")
    model = LiveModel(sess, start=False)
    dash = Dashboard(model=model)
    try:
        alloc = sess.devices[0].allocator
        reply = act(comms, dash, "max_split", 1 << 43)
        assert reply["ok"], reply["text"]
        assert alloc.config.max_split_size == (1 << 43) << 20
        p = sess.allocate(300 << 20)
        sess.free(p)
        assert sess.allocate(100 << 20) == p     # split: larger than any block
    finally:
        dash.close()
        model.close()
        sess.close()


# ------------------------------------------------------------------ Ctrl-C in sweep(jobs=2)
_SWEEP = """
import multiprocessing, signal, sys
# Python's own Ctrl-C handler, as in a terminal or a kernel, whatever the test runner's
# process left ignored (a child inherits an ignored SIGINT)
signal.signal(signal.SIGINT, signal.default_int_handler)
from gpudash.workloads import training_loop
from gpudash.trace.whatif import sweep
trace = training_loop(steps=3000, layers=8, batch=32, hidden=512)
said = []
def progress(done, total):
    if not said:
        said.append(1)
        print("STARTED", *[p.pid for p in multiprocessing.active_children()], flush=True)
sweep(trace, fractions=[0.005 * i for i in range(1, 201)], jobs=2, progress=progress)
print("FINISHED", flush=True)
"""


@pytest.mark.parametrize("group", [False, True], ids=["kernel-interrupt", "terminal-ctrl-c"])
def test_ctrl_c_stops_a_sweep_and_its_workers_at_once(group):
    """SIGINT to the process (Jupyter's interrupt) or to its group (Ctrl-C in a terminal):
    sweep(jobs=2) went on with every queued replay for 19-31 s here (200 rows); now its
    workers are ended and it raises KeyboardInterrupt at once."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", _SWEEP], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    try:
        pids = []
        for line in p.stdout:
            if line.startswith("STARTED"):
                pids = [int(x) for x in line.split()[1:]]
                break
        assert pids, "the sweep did not start"
        time.sleep(0.5)
        (os.killpg if group else os.kill)(p.pid, signal.SIGINT)
        t0 = time.monotonic()
        try:
            out = p.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            pytest.fail("the sweep went on for more than 60 s after SIGINT")
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert "KeyboardInterrupt" in out and "FINISHED" not in out, out[-500:]

    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] != "Z"
        except FileNotFoundError:
            return False
    assert not [q for q in pids if running(q)]
    # the sweep's remaining rows take 10 s and more here; stopping takes well under 1 s
    assert took < 5, f"{took:.1f} s from SIGINT to the end of the process"


# ------------------------------------------ a device that hands out overlaps: caching allocator
class _OverlappingCuda:
    """cudaMalloc that hands out a range over the first one; reserve() likewise."""

    total = 16 << 30

    def __init__(self, step: int):
        self.step = step
        self.given, self.freed, self.reserved, self.unreserved = [], [], [], []

    def alloc(self, nbytes):
        ptr = (1 << 32) + len(self.given) * self.step
        self.given.append((ptr, nbytes))
        return ptr

    def free(self, ptr, nbytes):
        self.freed.append((ptr, nbytes))

    def reserve(self, nbytes):
        base = (1 << 40) + len(self.reserved) * (20 << 20)
        self.reserved.append((base, nbytes))
        return base

    def unreserve(self, base, nbytes):
        self.unreserved.append((base, nbytes))


@pytest.mark.core
@pytest.mark.parametrize("step", [0, 4096, 20 << 20])
def test_a_caching_segment_over_an_earlier_one_is_refused(step):
    """Both caching-allocator cores took a cudaMalloc range over a live segment as a new
    segment (the Python model then failed its own checks, with KeyErrors later); both now
    refuse it with the same error and give the range back."""
    from gpudash import InvalidPointerError
    from gpudash.caching import CachingAllocator

    dev = _OverlappingCuda(step)
    a = CachingAllocator(dev)
    p = a.allocate(22 << 20)
    with pytest.raises(InvalidPointerError, match="overlaps the range 0x100000000"):
        a.allocate(40 << 20)
    assert dev.freed == [dev.given[1]]
    a.check()
    a.deallocate(p)
    a.empty_cache()
    a.check()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0


@pytest.mark.core
def test_an_expandable_reservation_over_an_earlier_one_is_refused_not_a_crash():
    """The compiled core crashed (SIGSEGV) when a device reserved a second expandable range
    over the first; both cores now refuse it alike and give it back."""
    code = textwrap.dedent("""
        from gpudash import InvalidPointerError
        from gpudash.caching import CachingAllocator
        class Dev:
            total = 16 << 30
            def __init__(self):
                self.n = 0
                self.unreserved = []
            def alloc(self, n):
                self.n += 1
                return self.n
            def free(self, p, n):
                pass
            def reserve(self, n):
                return 1 << 40
            def unreserve(self, b, n):
                self.unreserved.append((b, n))
        dev = Dev()
        a = CachingAllocator(dev, "expandable_segments:True")
        p = a.allocate(64 << 20)             # the large pool's reservation
        try:
            a.allocate(4096)                 # the small pool's: over the large one
        except InvalidPointerError as exc:
            print("refused:", "overlaps the range 0x10000000000" in str(exc))
        a.deallocate(p)
        a.check()
        print("unreserved:", len(dev.unreserved))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])
    assert "refused: True" in r.stdout and "unreserved: 1" in r.stdout, r.stdout


# ----------------------------------- a JSON snapshot whose trace does not fit its segments
def _damaged_json(tmp_path: Path, cut: int, at: int, entry: dict) -> Path:
    from gpudash.trace.torch_snapshot import load_torch_snapshot_dict

    snap = load_torch_snapshot_dict(ROOT / "tests/data/real/torch_mlp.replayed_snapshot.pickle")
    trace = list(snap["device_traces"][0])[cut:]
    trace.insert(at, dict(entry, stream=0, frames=[]))
    snap["device_traces"] = [trace]
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(snap))
    return path


@pytest.mark.parametrize("command", ["replay", "explain", "holders"])
@pytest.mark.parametrize("cut, at, entry, words", [
    # a trace that starts mid-run, with a segment_free inside a segment that lives on
    (50, 100, {"action": "segment_free", "addr": 0x7F0000305000, "size": 512},
     ["device_traces[0][100] (segment_free at 0x7f0000305000, 512 bytes)",
      "overlaps a segment at 0x7f0000200000", "held free memory"]),
    # a segment_unmap over allocated blocks of a cudaMalloc segment, mid-run
    (1000, 6, {"action": "segment_unmap", "addr": 0x7F000000A400, "size": 1 << 20},
     ["segment_unmap at 0x7f000000a400", "overlaps a segment at 0x7f0000000000"]),
    # a segment_unmap of no size (the model's state lost a segment head: KeyError)
    (0, 738, {"action": "segment_unmap", "addr": 0x7F00006DFE00, "size": 0},
     ["device_traces[0][738]: a segment_unmap of 0 bytes at 0x7f00006dfe00"]),
])
def test_a_trace_that_does_not_fit_its_segments_is_named_not_an_internal_error(
        tmp_path, capsys, command, cut, at, entry, words):
    """Such a JSON snapshot ended in "internal error: AssertionError: invariant broken" (or
    a KeyError) after the whole replay; it is now refused on reading, naming the entry and
    what the segment held there."""
    from gpudash import cli

    path = _damaged_json(tmp_path, cut, at, entry)
    rc = cli.main([command, str(path)])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "internal error" not in err and "invariant" not in err
    for w in words:
        assert w in err, err
