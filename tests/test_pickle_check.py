"""The compiled pickle check of a PyTorch snapshot (``_csrc/pickcheck.pxi``) against the
Python one it is the twin of (``gpudash.trace.torch_snapshot._check_pickle``): the same
verdict and the same message, byte offsets included, on real snapshots, on the pickle bombs
of issue 34, on every opcode and on thousands of damaged pickles; it never crashes, and it
reads the caller's buffer (bytes, an mmap of the file) without copying it."""

from __future__ import annotations

import mmap
import pickle
import random
import tracemalloc
from pathlib import Path

import pytest

from gpudash import TraceFormatError, _accel
from gpudash.trace import torch_snapshot
from gpudash.trace.torch_snapshot import _ARG, _check_pickle, _check_source

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

from shared_files import EXTERNAL  # noqa: E402
from test_hardening_34 import _hash_bomb, _memo_bomb, _repr_bomb  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def compiled():
    """The compiled check (built from these sources), also where GPUDASH_PURE_PYTHON=1
    makes the loader run the Python one."""
    try:
        return _accel.extension("the compiled pickle check").check_pickle
    except ImportError as exc:
        pytest.skip(str(exc))


def _verdict(check, data) -> str | None:
    try:
        check(data, "x.pickle")
    except TraceFormatError as exc:
        return str(exc)
    return None


def _same(compiled, data) -> str | None:
    want = _verdict(_check_pickle, data)
    assert _verdict(compiled, data) == want, bytes(data[:120])
    return want


def _real_pickles() -> list[Path]:
    found = sorted(DATA.rglob("*.pickle")) + sorted(DATA.rglob("*.pkl"))
    if EXTERNAL.is_dir():
        found += sorted(EXTERNAL.glob("*.pickle")) + sorted(EXTERNAL.glob("*.pkl"))
    return found


def _snapshot(steps: int = 4) -> dict:
    """A small snapshot as PyTorch writes it: shared frames, tuples, floats, big ints,
    nested lists, settings, annotations, an empty trace."""
    frames = [{"filename": "train.py", "line": 88, "name": "forward"},
              {"filename": "??", "line": 0, "name": "c10::alloc"}]
    return {"segments": [{"device": 0, "address": 1 << 40, "total_size": 2 << 20,
                          "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                          "is_expandable": False, "frames": frames, "blocks": [
                              {"address": 1 << 40, "size": 1 << 20, "requested_size": 1000,
                               "state": "active_allocated", "frames": frames},
                              {"address": (1 << 40) + (1 << 20), "size": 1 << 20,
                               "requested_size": 0, "state": "inactive", "frames": []}]}],
            "device_traces": [[{"action": a, "addr": (1 << 40) + 512 * k, "size": 512,
                                "stream": 0, "time_us": 1.5 * k, "frames": frames,
                                "compile_context": "N/A", "user_metadata": ""}
                               for k, a in enumerate(["alloc", "free_requested",
                                                      "free_completed"] * steps)], []],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                   "max_split_size": -1, "roundup_power2_divisions": [1] * 4},
            "external_annotations": [{"name": "fwd", "stage": "START", "device": 0,
                                      "time_us": 3}]}


def _snapshot_pickles() -> list[bytes]:
    """:func:`_snapshot` at every protocol (0 to 5)."""
    return [pickle.dumps(_snapshot(), protocol=p) for p in range(6)]


def test_the_loader_runs_the_compiled_check_where_the_core_runs():
    bound = torch_snapshot._pickle_check
    if _accel.COMPILED:
        assert bound is not _check_pickle and bound.__name__ == "check_pickle"
    else:
        assert bound is _check_pickle


def test_real_snapshots_pass_both_checks(compiled):
    paths = _real_pickles()
    assert paths    # tests/data has one at least
    for path in paths:
        data = path.read_bytes()
        assert _same(compiled, data) is None, path.name
        # and mapped, as the loader reads a file
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            assert compiled(m, path.name) is None


def test_written_snapshots_at_every_protocol_pass_both_checks(compiled):
    for data in _snapshot_pickles():
        assert _same(compiled, data) is None
        assert _same(compiled, data[:-1]) is None     # no STOP: the end of the data


# the bombs of issue 34 and the cases each rule was written for, with the words of the verdict
CASES = [
    (_memo_bomb(), "the memo index 134,217,728 with 0 entries stored at byte 3"),
    (_hash_bomb(), "a dict key that is not a string at byte 429"),
    (_repr_bomb(), None),       # a snapshot the loader refuses later, bounded
    (b"\x80\x02Np999999999\n.", "memo index 999,999,999"),
    (b"\x80\x04\x8f(K\x01\x90.", "a set element that is not a string at byte 6"),
    (b"\x80\x04(K\x01\x91.", "a set element that is not a string"),   # frozenset({1})
    (b"\x80\x02}(K\x01Nu.", "a dict key that is not a string at byte 7"),
    (b"\x80\x02(K\x01Nd.", "a dict key that is not a string"),      # DICT, protocol 0 style
    (b"\x80\x02}K\x01Ns.", "a dict key that is not a string"),      # SETITEM
    (b"\x80\x02X\xff\xff\xff\x7fabc.", "runs past the end of the file at byte 2"),
    (b"\x80\x02N]R.", "the opcode b'R', which no snapshot holds"),
    (b"\x80\x02\x8b\xff\xff\xff\xff.", "runs past the end"),        # LONG4 of length -1
    (b"\x80\x04\x8d" + b"\xff" * 8 + b".", "runs past the end"),     # a length of 2**64 - 1
    (b"\x80\x04\x96" + (1 << 63).to_bytes(8, "little") + b".", "runs past the end"),
    (b"\x80\x02X\x01\x00", "runs past the end"),                    # the length cut short
    (b"(S'abc'", "a text argument with no end of line"),
    (b"cos\nsystem", "a text argument with no end of line"),        # a global's second line
    (b"cos\nsystem\n(S'echo'\ntR.", None),      # a global: left to the unpickler's refusal
    (b"\x80\x02N" + b"r" + (257).to_bytes(4, "little") + b".", "memo index 257 with 0"),
    (b"\x80\x02N" + b"r" + (256).to_bytes(4, "little") + b".", None),
    (b"\x80\x02\xff", "the opcode b'\\xff'"),
    (b"\x80\x02'", "the opcode b\"'\""),
    # protocol 0's PUT and GET, read as Python's int() reads them
    (b"Np-5\n.", "the memo index -5 with 0 entries stored at byte 1"),
    (b"Np 12 \n.", None), (b"Np1_2\n.", None), (b"Np+3\n.", None), (b"Np\n.", "not a number"),
    (b"Np" + b"0" * 5000 + b"\n.", "not a number"),     # past Python's 4,300-digit limit
    (b"Np99999999999999999999\n.", "the memo index 99,999,999,999,999,999,999 with 0"),
    (b"Np0000000000000000000000000000012\n.", None),
    (b"Np\xd9\xa1\n.", "not a number"), (b"Np1\x002\n.", "not a number"),
    (b"Vab\np0\n}g0\nNs.", None), (b"Vab\np0\n}g 0\nNs.", None),
    (b"Vab\np0\n}g-1\nNs.", "a dict key that is not a string"),
    (b"Np0\n}g9999999999999999999999999\nNs.", "a dict key that is not a string"),
    # a memo entry keeps whether it held a str: MEMOIZE, BINPUT, LONG_BINPUT, overwritten
    (b"\x80\x04}X\x01\x00\x00\x00a\x94h\x00Ns.", None),
    (b"\x80\x04}N\x94h\x00Ns.", "a dict key that is not a string at byte 8"),
    (b"\x80\x02}X\x01\x00\x00\x00aq\x05Nq\x05h\x05Ns.", "a dict key that is not a string"),
    (b"\x80\x02}X\x01\x00\x00\x00ar\x00\x01\x00\x00j\x00\x01\x00\x00Ns.", None),
    (b"\x80\x02}(j\x00\x01\x00\x00Nu.", "a dict key that is not a string"),  # never stored
    # TUPLE1..3 on a short stack drop what Python's slice drops
    (b"X\x01\x00\x00\x00aX\x01\x00\x00\x00a\x870\x94}(h\x00Nu.", None),   # keeps 1
    (b"X\x01\x00\x00\x00a\x870\x94}(h\x00Nu.", "a dict key that is not a string"),
    # cut anywhere inside a hot opcode
    (b"\x80\x02j\x01", None), (b"\x80\x02h", None), (b"\x80\x02(", None), (b"", None),
]


@pytest.mark.parametrize("data, words", CASES)
def test_bombs_and_each_rule_give_the_same_verdict(compiled, data, words):
    got = _same(compiled, data)
    if words is None:
        assert got is None
    else:
        assert got is not None and words in got, got


def test_every_opcode_after_every_prefix_gives_the_same_verdict(compiled):
    """Each of the 256 bytes as an opcode, with arguments cut short, empty, huge, negative,
    text or none, after a prefix that leaves the stack empty, a mark, a str or a memo."""
    tails = [b"", b".", b"\x00", b"\xff\xff\xff\xff", b"\x01\x00\x00\x00a.", b"12\n.",
             b"12\n13\n.", b"a\n", b"\x05\x00\x00\x00\x00\x00\x00\x00abcde.", b"-1\n.",
             b" 1_0\n.", b"\x00\x00\x00\x00\x00\x00\x00\x00Ns."]
    prefixes = [b"", b"\x80\x02", b"\x80\x02(", b"\x80\x02NN", b"\x80\x02(NN",
                b"\x80\x04X\x01\x00\x00\x00a\x94", b"\x80\x04}X\x01\x00\x00\x00a\x94"]
    seen = set()
    for pre in prefixes:
        for op in range(256):
            for tail in tails:
                got = _same(compiled, pre + bytes([op]) + tail)
                seen.add(got.split(" at byte")[0].split(": ", 1)[1][:30] if got else None)
    assert len(seen) >= 8, seen     # every kind of verdict came up


def _mutate(rng: random.Random, data: bytes) -> bytes:
    d = bytearray(data)
    if len(d) > 3000:                       # a window of a big one, after its PROTO
        start = rng.randrange(len(d) - 3000)
        d = d[:2] + d[start:start + 3000]
    for _ in range(rng.randint(1, 4)):
        r = rng.random()
        pos = rng.randrange(len(d)) if d else 0
        if r < 0.4 and d:                   # a byte changed
            d[pos] = rng.randrange(256)
        elif r < 0.55:                      # cut
            d = d[:pos]
        elif r < 0.8:                       # an opcode the check knows, with a few bytes
            d[pos:pos] = bytes([rng.choice(list(_ARG))]) + rng.randbytes(rng.randint(0, 5))
        elif d:                             # bytes dropped
            del d[pos:pos + rng.randint(1, 8)]
    return bytes(d)


def test_thousands_of_damaged_pickles_give_the_same_verdict(compiled):
    small = _snapshot_pickles()
    small += [p.read_bytes() for p in _real_pickles() if p.stat().st_size < 300_000]
    rng = random.Random(34)
    kinds: dict[str | None, int] = {}
    for _ in range(4000):
        got = _same(compiled, _mutate(rng, rng.choice(small)))
        kind = got.split(" at byte")[0].split(": ", 1)[1][:30] if got else None
        kinds[kind] = kinds.get(kind, 0) + 1
    assert None in kinds and len(kinds) >= 6, kinds


def test_every_truncation_of_a_snapshot_gives_the_same_verdict(compiled):
    for data in _snapshot_pickles()[2:]:
        for end in range(len(data)):
            _same(compiled, data[:end])


@pytest.mark.parametrize("data", [
    b"\x80\x02" + b"(" * 2_000_000 + b".",              # two million marks
    b"(" * 1_000_000 + b"]" * 1_000_000 + b"e" * 1_000_000 + b"l" * 1_000_000,
    b"\x80\x04" + b"]\x94" * 500_000 + b"h\x00" * 500_000 + b"0" * 2_000_000,
    b"N" + b"".join(b"r" + (257 * k + 256).to_bytes(4, "little") for k in range(100_000)),
    b"\x80\x04" + b"}" + b"X\x01\x00\x00\x00a]" * 300_000 + b"s" * 600_000 + b".",
    # runs of LONG_BINGET across the stack's growth, one that is no str at an even place
    b"\x80\x04X\x01\x00\x00\x00a\x94}(" + b"j\x00\x00\x00\x00" * 9001 + b"u.",
    b"\x80\x04X\x01\x00\x00\x00a\x94}(" + b"j\x00\x00\x00\x00" * 8190
    + b"j\x01\x00\x00\x00" + b"j\x00\x00\x00\x00" * 811 + b"u.",
], ids=["marks", "nested", "memo", "memo-growth", "setitem", "gets", "gets-refused"])
def test_deep_and_wide_pickles_neither_crash_nor_differ(compiled, data):
    got = _same(compiled, data)
    assert (got is None) == (b"j\x01\x00\x00\x00" not in data), got


def test_a_mapped_file_is_read_in_place_and_let_go(compiled, tmp_path):
    """The check takes the mmap's buffer and gives it back, refused or not: the loader
    closes the map after it."""
    for i, data in enumerate([_snapshot_pickles()[4], _memo_bomb(), b"\x80\x02X\xff"]):
        path = tmp_path / f"{i}.pickle"
        path.write_bytes(data)
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            assert _verdict(compiled, m) == _verdict(_check_pickle, data)
            m.close()       # BufferError if the check still held the map
        assert _verdict(compiled, memoryview(data)) == _verdict(_check_pickle, data)


def test_the_load_path_copies_no_file(tmp_path):
    """A file is checked through its mmap, and bytes in place: Python allocates no copy
    of them (a copy of a 4 MB file would show as 4 MB in tracemalloc's peak)."""
    blob = pickle.dumps(_snapshot(steps=8000), protocol=4)
    assert len(blob) > 1_000_000
    path = tmp_path / "big.pickle"
    path.write_bytes(blob)
    for source in ("file", "bytes"):
        with open(path, "rb") as f:
            tracemalloc.start()
            try:
                _check_source(f if source == "file" else blob, "big.pickle")
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert f.tell() == 0
        assert peak < len(blob) // 4, (source, peak, len(blob))
