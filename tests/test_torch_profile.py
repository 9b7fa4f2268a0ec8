"""PyTorch profiler traces (Chrome trace JSON, ``.json`` / ``.json.gz``): the real one in
``tests/data/real`` checked against counts made straight from its JSON, stacks, holders,
annotations and leaks; synthetic ones for devices, pairing, the reserved figure a replay
reproduces, and hostile input."""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import gpudash
from gpudash import CachingAllocator, GpudashWarning, SimulatedDevice, TraceFormatError
from gpudash.cli import main
from gpudash.trace import load_trace, read_trace
from gpudash.trace.diff import leaks
from gpudash.formats.format import PRE_EXISTING_HOLDER
from gpudash.formats.io import sniff_format
from gpudash.trace.replay import replay
from gpudash.formats.stacks import Frame
from gpudash.formats.torch_profile import MAX_STACK_DEPTH, innermost, load_torch_profile

ROOT = Path(__file__).resolve().parent.parent
REAL = Path(__file__).parent / "data" / "real"
PROFILE = REAL / "torch_mlp.profile.json.gz"
SCRIPT = REAL / "record_torch_profile.py"
SCRIPT_NAME = SCRIPT.name


# ------------------------------------------------------------------ the JSON, read directly
def _raw():
    with gzip.open(PROFILE, "rt") as f:
        return json.load(f)


def _memory_events(raw):
    """The [memory] events in time order (file order for equal times), as the profiler
    wrote them."""
    mem = [e for e in raw["traceEvents"] if e.get("name") == "[memory]" and e.get("ph") == "i"]
    return sorted(mem, key=lambda e: e["ts"])          # sorted() is stable


def _ns(raw, us):
    return raw["baseTimeNanoseconds"] + round(us * 1000)


def _def_lines():
    """``{"MLP.forward": 32, "train_step": 38, ...}``: where the script defines each
    function."""
    out = {}
    tree = ast.parse(SCRIPT.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node.lineno
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    out[f"{node.name}.{sub.name}"] = sub.lineno
    return out


def _frame(name):
    """A slice's name as the frame the importer should make of it (an independent parse)."""
    m = re.fullmatch(r"(.+?)\((\d+)\): (.*)", name)
    if m:
        return Frame(m.group(1), int(m.group(2)), m.group(3))
    return Frame("", 0, re.sub(r" at 0x[0-9a-f]+>$", ">", name))


@pytest.fixture(scope="module")
def real():
    return load_torch_profile(PROFILE)


# ------------------------------------------------------------------ the real trace
def test_the_real_trace_is_sniffed_and_loaded_as_the_cpus_memory(real):
    assert sniff_format(PROFILE) == "torch-profile"
    t = load_trace(PROFILE)
    assert t == real
    assert real.meta["source"] == "pytorch-profile" and real.meta["allocator"] == "torch"
    assert [d["name"] for d in real.meta["devices"]] == ["cpu"]
    assert real.meta["devices"][0]["recorded_by"] == "PyTorch's CPU allocator"
    assert real.meta["with_stack"] is True and real.meta["left_out"] == {}
    assert gpudash.models.trace_model(real).name == "torch"    # PyTorch's words


def test_counts_rows_and_peak_equal_a_replay_of_the_json_per_address(real):
    raw = _raw()
    mem = _memory_events(raw)
    live: dict[int, int] = {}
    allocs = frees = before = 0
    in_use = peak = 0
    expect = []
    for e in mem:
        a = e["args"]
        n, addr = a["Bytes"], a["Addr"]
        if n > 0:
            allocs += 1
            live[addr] = n
            in_use += n
            expect.append(("alloc", addr, n))
        else:
            frees += 1
            if addr in live:
                in_use -= live.pop(addr)
            else:
                before += 1
            expect.append(("free", addr, -n))
        peak = max(peak, in_use)
        assert in_use == a["Total Allocated"]   # the profiler's own running figure
    s = real.summary()
    assert (s["allocations"], s["frees"], before) == (allocs, frees, 0)
    assert s["peak_allocated_bytes"] == peak == real.meta["devices"][0]["peak_bytes_allocated"]
    c = real.columns
    kinds = {1: "alloc", 2: "free"}
    got = list(zip((kinds[k] for k in c["kind"].tolist()), c["ptr"].tolist(),
                   c["size"].tolist()))
    assert got == expect
    assert c["time_ns"].tolist() == [_ns(raw, e["ts"]) for e in mem]
    # frees carry their allocation's id
    ids = {}
    for k, p, aid in zip(c["kind"].tolist(), c["ptr"].tolist(), c["alloc_id"].tolist()):
        if k == 1:
            ids[p] = aid
        else:
            assert ids.pop(p) == aid


def test_every_events_stack_and_holder_equal_a_scan_of_the_slices(real):
    """The importer's numpy interval search against the plain definition, event by event:
    the innermost python_function slice of the thread holding it, then its ancestors by
    Python parent id; the innermost cpu_op as the holder."""
    raw = _raw()
    mem = _memory_events(raw)
    py = [e for e in raw["traceEvents"] if e.get("cat") == "python_function"]
    ops = [e for e in raw["traceEvents"] if e.get("cat") == "cpu_op"]
    by_id = {e["args"]["Python id"]: e for e in py}

    def inner(slices, e):
        t = _ns(raw, e["ts"])
        best = None
        for s in slices:
            if (s["pid"], s["tid"]) != (e["pid"], e["tid"]):
                continue
            lo = _ns(raw, s["ts"])
            hi = lo + round(s["dur"] * 1000)
            if lo <= t <= hi and (best is None or lo > best[0] or
                                  (lo == best[0] and hi <= best[1])):
                best = (lo, hi, s)
        return None if best is None else best[2]

    with_stack = 0
    for i, e in enumerate(mem):
        s = inner(py, e)
        frames = []
        while s is not None:
            frames.append(_frame(s["name"]))
            s = by_id.get(s["args"]["Python parent id"])
        assert real.frames_of(i) == frames, i
        with_stack += bool(frames)
        op = inner(ops, e)
        if real.columns["kind"][i] == 1:
            assert real.holder_of(i) == (op["name"] if op else ""), i
    assert with_stack > 0.9 * len(mem)


def test_the_stacks_of_named_allocations_are_the_scripts_lines(real):
    lines = _def_lines()
    c = real.columns
    rows = np.flatnonzero(c["kind"] == 1)
    # fc1's output: 128 x 512 floats, made by aten::addmm in Linear.forward in MLP.forward
    first = next(i for i in rows.tolist() if c["size"][i] == 128 * 512 * 4)
    frames = real.frames_of(first)
    assert real.holder_of(first) == "aten::addmm"
    assert frames[0] == Frame("", 0, "<built-in function linear>")
    assert (frames[1].filename, frames[1].name) == ("torch/nn/modules/linear.py", "forward")
    assert Frame("", 0, "nn.Module: Linear_0") in frames
    mine = [f for f in frames if f.filename == SCRIPT_NAME]
    assert mine[:2] == [Frame(SCRIPT_NAME, lines["MLP.forward"], "forward"),
                        Frame(SCRIPT_NAME, lines["train_step"], "train_step")]
    # the validation pass's allocations are under validate, in MLP.forward
    in_validate = [i for i in rows.tolist()
                   if Frame(SCRIPT_NAME, lines["validate"], "validate") in real.frames_of(i)]
    assert in_validate
    assert any(Frame(SCRIPT_NAME, lines["MLP.forward"], "forward") in real.frames_of(i)
               for i in in_validate)
    # Adam's state: made in torch/optim/adam.py under train_step
    adam = [i for i in rows.tolist()
            if any(f.filename == "torch/optim/adam.py" for f in real.frames_of(i))]
    assert adam and all(Frame(SCRIPT_NAME, lines["train_step"], "train_step")
                        in real.frames_of(i) for i in adam)


def test_top_holders_at_the_peak_name_the_scripts_lines(real):
    lines = _def_lines()
    table = gpudash.top_holders(real, at="peak", by="line")
    assert table.total_bytes == real.summary()["peak_allocated_bytes"]
    assert table.missing.get("no stack", (0, 0))[0] == 0
    keys = {r.key for r in table}
    assert keys <= {Frame(SCRIPT_NAME, lines[f], f.split(".")[-1])
                    for f in ("train_step", "MLP.forward", "validate")}
    assert table[0].key == Frame(SCRIPT_NAME, lines["train_step"], "train_step")
    assert sum(r.bytes for r in table) == table.total_bytes
    assert f"{SCRIPT_NAME}:{lines['train_step']} train_step" in table.to_text()


def test_annotations_are_the_record_function_ranges(real):
    raw = _raw()
    ann = [e for e in raw["traceEvents"] if e.get("cat") == "user_annotation"]
    got = real.meta["annotations"]
    names = got["names"]
    ranges = sorted((names[n], s, e) for _, n, s, e in got["ranges"])
    assert ranges == sorted((a["name"], _ns(raw, a["ts"]), _ns(raw, a["ts"])
                             + round(a["dur"] * 1000)) for a in ann)
    assert {f"step {k}" for k in range(4)} <= set(names)
    assert all(r[0] == -1 for r in got["ranges"])        # every device
    by = gpudash.top_holders(real, at="end", by="annotation")
    assert {r.holder for r in by} >= {"step 0", "step 1", "step 2"}


def test_the_leak_shows_in_every_iteration_at_the_validation_pass(real):
    """Each step keeps its validation loss with its graph: what the validation pass
    allocated and never freed (counted here from the JSON) is what leaks() finds kept from
    one step to the next, by stack; nothing else is kept in every iteration."""
    raw = _raw()
    lines = _def_lines()
    mem = _memory_events(raw)
    py = [e for e in raw["traceEvents"] if e.get("cat") == "python_function"
          and e["name"] == f"{SCRIPT_NAME}({lines['validate']}): validate"]
    steps = sorted((e for e in raw["traceEvents"] if e.get("cat") == "user_annotation"
                    and re.fullmatch(r"step \d+", e["name"])), key=lambda e: e["ts"])
    assert len(py) == len(steps) == 4
    never_freed = set()                        # indices into mem of blocks never freed
    live = {}
    for k, e in enumerate(mem):
        if e["args"]["Bytes"] > 0:
            live[e["args"]["Addr"]] = k
            never_freed.add(k)
        else:
            never_freed.discard(live.pop(e["args"]["Addr"]))
    kept_per_step = [sum(e["args"]["Bytes"] for k, e in enumerate(mem) if k in never_freed
                         and v["ts"] <= e["ts"] <= v["ts"] + v["dur"]) for v in py]
    assert all(k > 0 for k in kept_per_step)
    times = real.columns["time_ns"]
    ends = [int(np.flatnonzero(times <= _ns(raw, s["ts"] + s["dur"])).max()) for s in steps]
    table = leaks(real, by="stack", boundaries=ends)
    n = table.iterations
    assert n >= 3
    valid = Frame(SCRIPT_NAME, lines["validate"], "validate")
    mine = [r for r in table if valid in r.frames]
    per = np.sum([r.per_iteration for r in mine], axis=0)
    assert per.tolist() == kept_per_step[:n]
    every = [r for r in table if r.iterations == n]
    assert every and all(valid in r.frames for r in every)
    # by line: the forward pass (its activations) and validate (its loss) lead
    by_line = leaks(real, boundaries=ends)
    assert {by_line[0].key, by_line[1].key} == {
        Frame(SCRIPT_NAME, lines["MLP.forward"], "forward"), valid}
    # the optimizer's marks find the same iterations' leak without boundaries
    auto = leaks(real, by="stack")
    assert "Optimizer.step" in auto.source
    assert all(valid in r.frames for r in auto if r.iterations == auto.iterations)


def test_the_cli_reads_the_real_trace(capsys, tmp_path):
    lines = _def_lines()
    assert main(["holders", str(PROFILE), "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert f"{SCRIPT_NAME}:{lines['train_step']} train_step" in out and "(cpu)" in out
    assert main(["diff", str(PROFILE), "--iterations", "--by", "stack"]) == 0
    assert f"{SCRIPT_NAME}:{lines['validate']} validate" in capsys.readouterr().out
    out_path = tmp_path / "mlp.gdtrace"
    assert main(["convert", str(PROFILE), str(out_path)]) == 0
    back = read_trace(out_path)
    real = load_torch_profile(PROFILE)
    assert [back.frames_of(i) for i in range(len(back))] == \
        [real.frames_of(i) for i in range(len(real))]
    assert back.holder_names().tolist() == real.holder_names().tolist()
    assert back.meta["annotations"] == real.meta["annotations"]


def test_the_help_names_the_format(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no word wrapped at its hyphen
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    out = capsys.readouterr().out
    assert "torch-profile" in out and "profiler" in out


# ------------------------------------------------------------------ synthetic traces
BASE = 1_700_000_000_000_000_000


def _mem(ts, addr, nbytes, total=None, reserved=None, dtype=1, did=0, tid=1):
    args = {"Addr": addr, "Bytes": nbytes, "Device Type": dtype, "Device Id": did}
    if total is not None:
        args["Total Allocated"] = total
    if reserved is not None:
        args["Total Reserved"] = reserved
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1,
            "tid": tid, "ts": ts, "args": args}


def _py(ts, dur, name, pid_, parent, tid=1):
    return {"ph": "X", "cat": "python_function", "name": name, "pid": 1, "tid": tid,
            "ts": ts, "dur": dur, "args": {"Python id": pid_, "Python parent id": parent}}


def _op(ts, dur, name, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts,
            "dur": dur, "args": {}}


def _write(tmp_path, events, name="trace.json", gz=False, **header):
    obj = {"schemaVersion": 1, "baseTimeNanoseconds": BASE, **header, "traceEvents": events}
    data = json.dumps(obj).encode()
    path = tmp_path / (name + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _in_use_after_each_row(trace, device):
    c = trace.columns
    on = c["device"] == device
    delta = np.where(c["kind"] == 1, c["size"], -c["size"])
    return np.cumsum(np.where(on, delta, 0))[on]


def test_cuda_and_cpu_memory_are_separate_devices_and_the_cpus_is_left_out_by_default(
        tmp_path):
    ev = [_mem(1.0, 0x1000, 512, 512, 2 << 20, did=0),
          _mem(2.0, 0x9000, 4096, dtype=0, did=-1),
          _mem(3.0, 0x2000, 1024, 1024, 2 << 20, did=1),
          _mem(4.0, 0x1000, -512, 0, 2 << 20, did=0),
          _mem(5.0, 0x9000, -4096, dtype=0, did=-1),
          _mem(6.0, 0x7000, 64, dtype=13, did=0)]                 # MPS: not read
    props = [{"id": 0, "name": "NVIDIA H100", "totalGlobalMem": 85_000_000_000},
             {"id": 1, "name": "NVIDIA H100", "totalGlobalMem": 85_000_000_000}]
    path = _write(tmp_path, ev, deviceProperties=props)
    t = load_trace(path)
    assert [(d["index"], d["name"], d["capacity"]) for d in t.meta["devices"]] == \
        [(0, "cuda:0", 85_000_000_000), (1, "cuda:1", 85_000_000_000)]
    assert t.meta["left_out"]["cpu"]["events"] == 2
    assert t.meta["left_out"]["cpu"]["bytes_allocated"] == 4096
    assert "cpu=True" in t.meta["left_out"]["cpu"]["why"]
    assert t.meta["left_out"]["mps"]["events"] == 1
    assert t.meta["devices"][0]["recorded_by"] == "PyTorch's CUDA caching allocator"
    assert t.meta["devices"][0]["peak_bytes_reserved"] == 2 << 20
    both = load_trace(path, cpu=True)
    assert [(d["index"], d["name"]) for d in both.meta["devices"]] == \
        [(0, "cuda:0"), (1, "cuda:1"), (2, "cpu")]
    assert "cpu" not in both.meta["left_out"]
    assert both.columns["device"].tolist() == [0, 2, 1, 0, 2]
    assert "peak_bytes_reserved" not in both.meta["devices"][2]
    cpu_only = _write(tmp_path, [ev[1], ev[4]], name="cpu.json")
    assert load_trace(cpu_only).meta["devices"][0]["name"] == "cpu"
    with pytest.raises(TraceFormatError, match="no memory events left.*cpu=True"):
        load_torch_profile(cpu_only, cpu=False)


def test_times_are_the_base_time_plus_ts(tmp_path):
    ev = [_mem(1234.5678, 0x1000, 512), _mem(2000.0, 0x1000, -512)]
    t = load_trace(_write(tmp_path, ev))
    assert t.columns["time_ns"].tolist() == [BASE + 1_234_568, BASE + 2_000_000]
    no_base = tmp_path / "nobase.json"
    no_base.write_text(json.dumps({"traceEvents": ev}))
    assert load_trace(no_base).columns["time_ns"].tolist() == [1_234_568, 2_000_000]


def test_memory_from_before_the_profile_is_made_up_so_totals_match(tmp_path):
    # 10,000 B were in use when the profile began: a 4,096 B block freed during it, and
    # 5,904 B never freed; Total Allocated counts them all
    ev = [_mem(1.0, 0x5000, 1024, 11024),
          _mem(2.0, 0xA000, -4096, 6928),
          _mem(3.0, 0x5000, -1024, 5904),
          _mem(4.0, 0x6000, 2048, 7952)]
    t = load_trace(_write(tmp_path, ev))
    c = t.columns
    assert t.meta["devices"][0]["pre_existing_blocks"] == 1
    assert t.meta["devices"][0]["pre_existing_bytes"] == 10_000
    assert t.meta["inconsistent_events"] == 0
    pre = np.flatnonzero(t.holder == t.holders.index(PRE_EXISTING_HOLDER))
    made = [(int(c["kind"][i]), int(c["ptr"][i]), int(c["size"][i])) for i in pre]
    assert sorted(made) == [(1, 0, 5904), (1, 0xA000, 4096), (2, 0xA000, 4096)]
    assert int(c["time_ns"][0]) == BASE + 1000
    in_use = _in_use_after_each_row(t, 0)
    assert in_use[-4:].tolist() == [11024, 6928, 5904, 7952]
    table = gpudash.top_holders(t, at="end", by="holder")
    assert table.missing["rebuilt"] == (1, 5904)


def test_an_allocation_at_a_live_address_frees_the_earlier_one_and_double_frees_are_counted(
        tmp_path):
    ev = [_mem(1.0, 0x1000, 512, 512),
          _mem(2.0, 0x1000, 1024, 1024),          # the 512 B block was freed unseen
          _mem(3.0, 0x1000, -1024, 0),
          _mem(4.0, 0x1000, -1024, 0)]            # freed again: its allocation unseen
    with pytest.warns(GpudashWarning, match="dropped events"):
        t = load_trace(_write(tmp_path, ev))
    c = t.columns
    assert list(zip(c["kind"].tolist(), c["size"].tolist(), c["alloc_id"].tolist())) == \
        [(1, 512, 1), (2, 512, 1), (1, 1024, 2), (2, 1024, 2)]
    assert t.meta["unseen_frees"] == 1 and t.meta["unmatched_frees"] == 1
    assert c["time_ns"][1] == c["time_ns"][2]


def test_a_free_takes_the_size_and_holder_of_its_allocation(tmp_path):
    t = load_trace(_write(tmp_path, [_op(0, 10, "aten::empty"), _mem(1.0, 0x1000, 1024),
                                     _op(20, 10, "aten::other"), _mem(25.0, 0x1000, -512)]))
    assert t.columns["size"].tolist() == [1024, 1024]
    assert t.holder_names().tolist() == ["aten::empty", "aten::empty"]


def test_a_zero_byte_event_is_counted_and_left_out(tmp_path):
    t = load_trace(_write(tmp_path, [_mem(1.0, 0x1000, 512), _mem(1.5, 0x3000, 0),
                                     _mem(2.0, 0x1000, -512)]))
    assert len(t) == 2 and t.meta["zero_byte_events"] == 1


def test_stacks_and_holders_of_synthetic_slices_on_two_threads(tmp_path):
    ev = [_py(0, 100, "train.py(10): <module>", 1, None),
          _py(10, 50, "train.py(20): step", 2, 1),
          _py(12, 10, "torch/nn/modules/linear.py(120): forward", 3, 2),
          _py(13, 5, "<built-in function linear at 0x7f00aa>", 4, 3),
          _py(30, 10, "train.py(30): loss", 5, 2),
          _op(13, 4, "aten::linear"), _op(14, 2, "aten::addmm"),
          _py(0, 100, "worker.py(5): run", 6, None, tid=2),
          _mem(14.5, 0x1000, 512),            # in addmm, in the built-in
          _mem(25.0, 0x2000, 512),            # back in step after linear returned
          _mem(31.0, 0x3000, 512, tid=2),     # another thread: worker's stack
          _mem(200.0, 0x4000, 512),           # after everything: no stack
          _mem(30.0, 0x5000, 512),            # at loss's first instant
          _py(60, 20, "train.py(40): outer", 7, 1), _py(60, 10, "train.py(50): inner", 8, 7),
          _op(60, 20, "aten::outer"), _op(60, 10, "aten::inner"),
          _mem(65.0, 0x6000, 512),            # in both: the one that began last and is
          _mem(75.0, 0x7000, 512)]            # shorter is inner; then outer alone
    t = load_trace(_write(tmp_path, ev))
    by_ptr = {int(p): i for i, p in enumerate(t.columns["ptr"].tolist())}
    assert [str(f) for f in t.frames_of(by_ptr[0x1000])] == [
        " <built-in function linear>", "torch/nn/modules/linear.py:120 forward",
        "train.py:20 step", "train.py:10 <module>"]
    assert t.holder_of(by_ptr[0x1000]) == "aten::addmm"
    assert [f.name for f in t.frames_of(by_ptr[0x2000])] == ["step", "<module>"]
    assert t.holder_of(by_ptr[0x2000]) == ""
    assert t.frames_of(by_ptr[0x3000]) == [Frame("worker.py", 5, "run")]
    assert t.frames_of(by_ptr[0x4000]) == []
    assert t.frames_of(by_ptr[0x5000])[0] == Frame("train.py", 30, "loss")
    assert [f.name for f in t.frames_of(by_ptr[0x6000])] == ["inner", "outer", "<module>"]
    assert t.holder_of(by_ptr[0x6000]) == "aten::inner"
    assert [f.name for f in t.frames_of(by_ptr[0x7000])] == ["outer", "<module>"]
    assert t.holder_of(by_ptr[0x7000]) == "aten::outer"
    table = gpudash.top_holders(t, at="end", by="line")
    assert {r.holder for r in table} >= {"train.py:20 step", "worker.py:5 run"}


def test_a_trace_without_stacks_has_holders_only(tmp_path):
    t = load_trace(_write(tmp_path, [_op(0, 10, "aten::empty"), _mem(5.0, 0x1000, 512)]))
    assert t.stack is None and t.meta["with_stack"] is False
    assert t.holder_of(0) == "aten::empty"
    assert gpudash.top_holders(t)[0].holder == "aten::empty"


def test_the_reserved_figure_is_what_a_replay_through_the_caching_allocator_gives(tmp_path):
    """A CUDA profile written from gpudash's model of PyTorch's caching allocator (as
    PyTorch's profiler reports each call: the block's size and address, Total Allocated and
    Total Reserved after it): loaded and replayed, the model reserves what the profile
    says, and every address is the profile's."""
    rng = np.random.default_rng(3)
    alloc = CachingAllocator(SimulatedDevice("24GiB"))
    live: list[int] = []
    ev = []
    ts = 0.0
    for _ in range(600):
        ts += 1.5
        if live and rng.random() < 0.45:
            p = live.pop(int(rng.integers(len(live))))
            before = alloc.memory_stats()["allocated_bytes.all.current"]
            alloc.deallocate(p)
            st = alloc.memory_stats()
            ev.append(_mem(ts, p, st["allocated_bytes.all.current"] - before,
                           st["allocated_bytes.all.current"], st["reserved_bytes.all.current"]))
        else:
            n = int(rng.choice([512, 3000, 1 << 20, 5 << 20, 30 << 20]))
            before = alloc.memory_stats()["allocated_bytes.all.current"]
            p = alloc.allocate(n)
            live.append(p)
            st = alloc.memory_stats()
            ev.append(_mem(ts, p, st["allocated_bytes.all.current"] - before,
                           st["allocated_bytes.all.current"], st["reserved_bytes.all.current"]))
    peak_reserved = alloc.memory_stats()["reserved_bytes.all.peak"]
    path = _write(tmp_path, ev, gz=True, deviceProperties=[
        {"id": 0, "totalGlobalMem": 24 << 30}])
    t = load_trace(path)
    assert t.meta["devices"][0]["peak_bytes_reserved"] == peak_reserved
    assert t.meta["inconsistent_events"] == 0
    result = replay(t, allocator="torch")
    assert result.options["device_bytes"] == 24 << 30      # from deviceProperties
    assert result.peak_pool_bytes == peak_reserved
    rec = result.recording.columns
    got = rec["ptr"][np.isin(rec["kind"], (1,))].tolist()
    assert got == t.columns["ptr"][t.columns["kind"] == 1].tolist()


def test_a_list_of_events_is_read_as_a_chrome_trace(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([_mem(1.0, 0x1000, 512), _mem(2.0, 0x1000, -512)]))
    assert sniff_format(path) == "torch-profile"
    assert len(load_trace(path)) == 2


def test_innermost_equals_a_brute_force_search_on_random_nested_slices():
    rng = np.random.default_rng(7)
    thread, start, end = [], [], []

    def nest(tid, lo, hi, depth):
        t = lo
        while t < hi and depth < 6:
            a = t + int(rng.integers(0, 4))
            b = min(hi, a + int(rng.integers(0, 40)))
            if a > hi:
                break
            thread.append(tid)
            start.append(a)
            end.append(b)
            if rng.random() < 0.6:
                nest(tid, a, b, depth + 1)
            t = b + int(rng.integers(0, 3))       # siblings may touch (b == next a)

    for tid in range(4):
        nest(tid, 0, 2000, 0)
    thread, start, end = (np.array(x, dtype=np.int64) for x in (thread, start, end))
    order = np.lexsort((-end, start, thread))
    thread, start, end = thread[order], start[order], end[order]
    q_thread = rng.integers(0, 5, size=3000)
    q_time = rng.integers(-5, 2100, size=3000)
    got = innermost(thread, start, end, q_thread, q_time)
    for k in range(len(q_time)):
        hold = np.flatnonzero((thread == q_thread[k]) & (start <= q_time[k])
                              & (end >= q_time[k]))
        assert got[k] == (hold.max() if len(hold) else -1), k


def test_profile_memory_off_is_refused_saying_how_to_record(tmp_path):
    path = _write(tmp_path, [_op(0, 10, "aten::mm")], profile_memory=0)
    with pytest.raises(TraceFormatError) as err:
        load_trace(path)
    msg = str(err.value)
    assert "profile_memory=True" in msg and "with_stack=True" in msg and str(path) in msg
    assert "\n" not in msg
    assert main(["holders", str(path)]) == 1


# ------------------------------------------------------------------ hostile input
@pytest.mark.parametrize("events, message", [
    ([1], r"traceEvents\[0\] is 1; expected an event object"),
    ([{"ph": "i", "name": "[memory]", "ts": 1, "args": {"Bytes": 8, "Device Type": 0}}],
     r"traceEvents\[0\].*no 'Addr'"),
    ([{"ph": "i", "name": "[memory]", "ts": 1, "args": []}], r"args is a list"),
    ([_mem(1.0, -5, 512)], r"Addr -5 is outside 0"),
    ([_mem(1.0, 0x10, 1 << 63)], r"Bytes 9223372036854775808 is outside"),
    ([_mem(1.0, 0x10, 512.0)], r"Bytes is 512.0; expected an integer"),
    ([_mem(1.0, 0x10, True)], r"Bytes is True; expected an integer"),
    ([_mem("12", 0x10, 512)], r"ts is '12'; expected a number"),
    ([_mem(-1.0, 0x10, 512)], r"ts is -1.0; expected a finite number"),
    ([_mem(1e300, 0x10, 512)], r"ts is 1e\+300"),
    ([_mem(1.0, 0x10, 512, did=40000)], r"Device Id 40000 is outside"),
    ([_mem(1.0, 0x10, 512, did=-1)], r"a CUDA event with Device Id -1"),
    ([_mem(1.0, 0x10, 512), _py(0, -3, "a.py(1): f", 1, None)], r"dur is -3"),
    ([_mem(1.0, 0x10, 512), _py(0, 3, None, 1, None)], r"name is None"),
    ([_mem(1.0, 0x10, 512), _py(0, 3, "a.py(1): f", -4, None)], r"Python id.* -4"),
    ([{**_mem(1.0, 0x10, 512), "tid": [1]}], r"pid and tid"),
])
def test_malformed_events_are_refused_naming_the_event(tmp_path, events, message):
    path = _write(tmp_path, events)
    with pytest.raises(TraceFormatError, match=message) as err:
        load_trace(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


_ONE_EVENT = ('{"traceEvents": [{"ph": "i", "name": "[memory]", "ts": TS, "args": {"Addr": 1, '
              '"Bytes": 1, "Device Type": 0}}]}')


@pytest.mark.parametrize("text, message", [
    (_ONE_EVENT.replace("TS", "NaN"), "ts is nan"),
    (_ONE_EVENT.replace("TS", "Infinity"), "ts is inf"),
    (_ONE_EVENT.replace("TS", "1").replace('"Bytes": 1', '"Bytes": 1' + "0" * 5000),
     "not a readable JSON trace"),
    ('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply|JSON"),
    ('{"traceEvents": {"a": 1}}', "'traceEvents' is a dict"),
    ('{"traceEvents": []}', "without memory events"),
])
def test_odd_json_is_refused(tmp_path, text, message):
    path = tmp_path / "odd.json"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=message):
        load_torch_profile(path)
    with pytest.raises(TraceFormatError):
        load_trace(path, format="torch-profile")


def test_a_small_gzip_file_that_expands_past_the_ratio_is_refused_quickly(tmp_path):
    text = b'{"traceEvents": [' + b" " * (60 << 20) + b"]}"
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip.compress(text, 9))
    assert path.stat().st_size < 200_000
    t0 = time.perf_counter()
    with pytest.raises(TraceFormatError, match="expand to more than"):
        load_trace(path)
    assert time.perf_counter() - t0 < 5


def test_a_2_mb_file_of_millions_of_events_is_refused_before_it_is_parsed(tmp_path):
    rng = np.random.default_rng(0)
    parts = [b'{"traceEvents": [']
    noise = rng.integers(0, 1 << 32, size=40_000).tolist()
    for k in range(40_000):                     # 4,000,000 tiny events, some noise
        parts.append(b"{}," * 99 + b'{"n":"%08x"},' % noise[k])
    parts.append(b"{}]}")
    path = tmp_path / "many.json.gz"
    path.write_bytes(gzip.compress(b"".join(parts), 6))
    size = path.stat().st_size
    assert size < 2_500_000
    t0 = time.perf_counter()
    with pytest.raises(TraceFormatError, match="JSON objects in a file of"):
        load_trace(path)
    assert time.perf_counter() - t0 < 10


def test_a_cut_off_or_damaged_gzip_file_is_refused(tmp_path):
    data = PROFILE.read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match="cut off"):
        load_torch_profile(cut)
    tail = tmp_path / "tail.json.gz"
    tail.write_bytes(data + b"garbage!")
    with pytest.raises(TraceFormatError, match="not gzip data follow"):
        load_torch_profile(tail)
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(data[:20] + bytes(200) + data[220:])
    with pytest.raises(TraceFormatError, match="gzip"):
        load_torch_profile(bad)


def test_python_parent_cycles_and_deep_chains_are_bounded(tmp_path):
    ev = [_py(0, 100, "a.py(1): self_parent", 1, 1),
          _py(0, 100, "b.py(1): one", 2, 3, tid=2), _py(0, 100, "b.py(2): two", 3, 2, tid=2),
          _mem(5.0, 0x10, 512), _mem(5.0, 0x20, 512, tid=2)]
    depth = MAX_STACK_DEPTH + 500
    ev += [_py(i * 0.001, 100 - i * 0.002, f"c.py({i + 1}): f{i}", 10 + i,
               None if i == 0 else 9 + i, tid=3) for i in range(depth)]
    ev.append(_mem(50.0, 0x30, 512, tid=3))
    t0 = time.perf_counter()
    t = load_trace(_write(tmp_path, ev))
    assert time.perf_counter() - t0 < 10
    by_ptr = {int(p): i for i, p in enumerate(t.columns["ptr"].tolist())}
    assert t.frames_of(by_ptr[0x10]) == [Frame("a.py", 1, "self_parent")]
    assert [f.name for f in t.frames_of(by_ptr[0x20])] in (["one", "two"], ["two", "one"])
    deep = t.frames_of(by_ptr[0x30])
    assert len(deep) == MAX_STACK_DEPTH
    assert deep[0] == Frame("c.py", depth, f"f{depth - 1}")   # the innermost kept


def test_thirty_thousand_devices_load_in_linear_time(tmp_path):
    ev = [_mem(float(d), 0x1000, 512, did=d) for d in range(30_000)]
    ev += [_mem(40_000.0 + d, 0x1000, -512, did=d) for d in range(30_000)]
    t0 = time.perf_counter()
    t = load_trace(_write(tmp_path, ev))
    assert time.perf_counter() - t0 < 15
    assert len(t.meta["devices"]) == 30_000 and t.meta["devices"][-1]["name"] == "cuda:29999"
    assert t.summary()["frees"] == 30_000


def test_odd_device_types_and_zero_byte_events_only(tmp_path):
    ev = [_mem(1.0, 0x10, 64, dtype=code, did=0) for code in range(2, 400)]
    with pytest.raises(TraceFormatError, match="no memory events left.*mps"):
        load_trace(_write(tmp_path, ev))
    t = load_trace(_write(tmp_path, [_mem(1.0, 0x10, 0)], name="zero.json"))
    assert len(t) == 0 and t.meta["zero_byte_events"] == 1


def test_a_gzip_file_that_is_no_chrome_trace_is_not_taken_for_one(tmp_path):
    path = tmp_path / "snap.json.gz"
    path.write_bytes(gzip.compress(b'{"segments": [], "device_traces": []}'))
    assert sniff_format(path) is None
    with pytest.raises(TraceFormatError, match="cannot tell its format"):
        load_trace(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    out = {}

    def target():
        try:
            load_torch_profile(fifo)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(10)
    if th.is_alive():                 # unblock it, then fail
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("load_torch_profile blocked on a FIFO")
    assert isinstance(out.get("error"), TraceFormatError) and "FIFO" in str(out["error"])


def test_a_hostile_file_is_one_line_and_exit_code_1_from_the_command(tmp_path):
    path = _write(tmp_path, [_mem(1.0, -5, 512)], gz=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "gpudash", "holders", str(path)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
                          check=False)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and str(path) in proc.stderr
    assert proc.stderr.startswith("gpudash: error: ")


def test_the_real_trace_is_within_the_bounds_with_room_to_spare():
    data = PROFILE.read_bytes()
    text = zlib.decompressobj(wbits=31).decompress(data)
    assert len(text) < 50 * len(data)                 # the bound is 200 times
    assert text.count(b"{") < len(data) / 4           # the bound is one per byte
