"""Damaged or odd inputs to ``load_trace`` (and so to every command): a TraceFormatError
naming the file, never another exception; and nothing taken that is not a path."""

from __future__ import annotations

import json
import os
import sys

import pytest

from gpudash import TraceFormatError
from gpudash.trace import load_trace

_SEG = {"device": 0, "address": 1 << 40, "total_size": 2 << 20, "allocated_size": 0,
        "active_size": 0, "stream": 0, "segment_type": "large",
        "blocks": [{"size": 2 << 20, "state": "inactive"}]}


def _alloc(**fields):
    entry = {"action": "alloc", "addr": 1, "size": 512, "stream": 0, "time_us": 1}
    entry.update(fields)
    return {"segments": [], "device_traces": [[entry]]}


CASES = {
    "nan_time.json": '{"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, '
                     '"size": 512, "stream": 0, "time_us": NaN}]]}',
    "inf_time.json": '{"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, '
                     '"size": 512, "stream": 0, "time_us": Infinity}]]}',
    "deep.json": '{"segments": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "blocks_int.json": json.dumps({"segments": [dict(_SEG, blocks=5)], "device_traces": []}),
    "state_list.json": json.dumps({"segments": [dict(_SEG, blocks=[
        {"size": 2 << 20, "state": ["x"]}])], "device_traces": []}),
    "ptr_2_64.json": json.dumps(_alloc(addr=2 ** 64)),
    "size_2_70.json": json.dumps(_alloc(size=2 ** 70)),
    "negative.json": json.dumps(_alloc(size=-5)),
    "device_40000.json": json.dumps({"segments": [dict(_SEG, device=40000)],
                                     "device_traces": []}),
    "tf_400_digits.log": "Allocator (GPU_0_bfc) ran out of memory trying to allocate "
                         + "9" * 400 + "B (rounded to 256)\n",
    "rmm_huge_field.csv": "Thread,Time,Action,Pointer,Size,Stream\n1,00:00:01,allocate,0x1,"
                          + "9" * 200_000 + ",0\n",
    "rmm_huge_pointer.csv": "Thread,Time,Action,Pointer,Size,Stream\n1,00:00:01,allocate,0x"
                            + "f" * 40 + ",256,0\n",
    "empty.gdtrace": "",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_damaged_inputs_are_trace_format_errors_naming_the_file(tmp_path, name):
    path = tmp_path / name
    path.write_text(CASES[name])
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_negative_sizes_are_refused_at_import(tmp_path):
    path = tmp_path / "negative.json"
    path.write_text(CASES["negative.json"])
    with pytest.raises(TraceFormatError, match="negative size"):
        load_trace(path)


@pytest.mark.parametrize("bad", [True, 1, 0, None, 3.5, ["x"]])
def test_only_paths_are_read_never_a_file_descriptor(bad, capsys):
    with pytest.raises(TraceFormatError, match="a trace is read from a path"):
        load_trace(bad)
    print("stdout still open")  # load_trace(1) used to close file descriptor 1
    assert "stdout still open" in capsys.readouterr().out
    os.fstat(1)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(TraceFormatError, match="is a FIFO"):
        load_trace(fifo)


def test_a_missing_file_and_a_directory_that_is_no_log_dir(tmp_path):
    with pytest.raises(TraceFormatError, match="no such file"):
        load_trace(tmp_path / "nope.gdtrace")
    with pytest.raises(TraceFormatError) as info:
        load_trace(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_the_recursion_limit_is_left_as_it_was(tmp_path):
    limit = sys.getrecursionlimit()
    path = tmp_path / "deep.json"
    path.write_text(CASES["deep.json"])
    with pytest.raises(TraceFormatError):
        load_trace(path)
    assert sys.getrecursionlimit() == limit


def test_a_pickle_whose_shared_references_expand_to_10_8_blocks_is_refused_fast(tmp_path):
    """A few kilobytes of pickle, 10^8 blocks once expanded (one dict repeated by reference):
    refused by its size, in well under a second, without walking it."""
    import pickle
    import time

    block = {"size": 512, "state": "active_allocated", "requested_size": 512}
    seg = dict(_SEG, blocks=[block] * 10_000)
    path = tmp_path / "bomb.pickle"
    path.write_bytes(pickle.dumps({"segments": [seg] * 10_000, "device_traces": []},
                                  protocol=4))
    assert path.stat().st_size < 200_000
    t0 = time.perf_counter()
    with pytest.raises(TraceFormatError, match="gpudash's bound on what one import may expand"):
        load_trace(path)
    assert time.perf_counter() - t0 < 30


# ------------------------------------------------------------------ crafted .gdtrace records
def _crafted(tmp_path, mutate):
    """A real trace file whose records are rebuilt with valid CRCs after ``mutate``."""
    from gpudash.formats import format as fmt
    from gpudash.workloads import training_loop

    good = tmp_path / "good.gdtrace"
    fmt.write_trace(training_loop(steps=1, layers=2, hidden=256), good, overwrite=True)
    data = good.read_bytes()
    off = len(fmt.MAGIC)
    records = []
    while off < len(data):
        (rtype, js, payload, off), _ = fmt._parse_record(data, off)
        records.append([rtype, json.loads(js), payload])
    mutate(records)
    out = tmp_path / "crafted.gdtrace"
    out.write_bytes(fmt.MAGIC + b"".join(fmt._record(t, h, p) for t, h, p in records))
    return out


def test_crafted_records_with_valid_crcs_are_trace_format_errors(tmp_path):
    from gpudash.formats import format as fmt
    from gpudash.trace import read_trace

    def bad_settings(records):
        for r in records:
            if r[0] == fmt._REC_EVENTS:
                r[1]["settings"] = 5

    def list_update(records):
        records.insert(1, [fmt._REC_META_UPDATE, ["not", "a", "dict"], b""])

    def bad_payload(records):
        for r in records:
            if r[0] == fmt._REC_EVENTS:
                r[2] = b"\x93NUMPY garbage"

    for mutate, fragment in ((bad_settings, "'settings' must be a list"),
                             (list_update, "metadata update"),
                             (bad_payload, "event batch")):
        path = _crafted(tmp_path, mutate)
        for reader in (read_trace, load_trace):
            with pytest.raises(TraceFormatError, match=fragment):
                reader(path)
