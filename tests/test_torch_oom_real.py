"""Real PyTorch out-of-memory messages from public issues (tests/data/torch_oom/, sources and
hand computations in its README): each gives the request, the cause and advice that applies,
and no answer contradicts its own figures."""

from __future__ import annotations

import itertools
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest

from gpudash.postmortem import explain
from gpudash.torch_oom import TorchOOM, read_torch_ooms

DATA = Path(__file__).resolve().parent / "data" / "torch_oom"
EXPECTED = json.loads((DATA / "expected.json").read_text())
UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
MiB = 1 << 20


def size(text: str) -> int:
    num, unit = text.split()
    return round(Fraction(num) * UNITS[unit])


def contradictions(o: TorchOOM) -> list[str]:
    """What an answer must never say, given its own figures."""
    c = o.cause()
    text = o.explain()
    bad = []
    seg = o.request.value
    tol = o.request.tol + (o.free.tol if o.free else 0) + (
        o.unallocated.tol if o.unallocated else 0)
    for short in re.findall(r"([\d.]+ (?:bytes|B|KiB|MiB|GiB)) short", text):
        if short.split()[0] in ("0", "0.00"):
            bad.append(f"says {short} short")
    if o.free is not None:
        f = o.free.value
        u = o.unallocated.value if o.unallocated else 0
        room = o.allowed is None or o.reserved is None or \
            o.allowed.value - o.reserved.value >= seg
        if c.name == "device full" and f + u >= seg:
            bad.append("device full, yet free + unallocated covers the segment")
        if c.name == "fragmentation" and f - seg > tol and room:
            bad.append("fragmentation, yet the device and the limit had room for a segment")
        if c.name == "unknown" and (f < seg or not room):
            bad.append("unknown, yet the figures show the segment was refused")
        if c.name == "limit" and (o.allowed is None or
                                  o.reserved.value + seg <= o.allowed.value - tol):
            bad.append("limit, yet reserved + segment is within the limit")
        if c.name == "another process" and f - tol > seg:
            bad.append("another process, yet the device had the segment free")
    for s in c.settings:
        if "max_split_size_mb" in s and (o.small_pool or o.wording in ("1.0-1.3",)):
            bad.append(f"{s} for a request it cannot serve")
        if "expandable_segments" in s and o.wording in ("1.0-1.3", "1.4-2.0"):
            bad.append(f"{s} before PyTorch 2.1")
        m = re.match(r"torch\.cuda\.set_per_process_memory_fraction\(([\d.]+)\)", s)
        if m:
            frac = float(m.group(1))
            if not 0 < frac <= 1 or frac * o.capacity.lo < o.reserved.value + seg:
                bad.append(f"{s} does not allow reserved + the segment")
    return bad


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_real_message(name):
    want = EXPECTED[name]
    (o,) = read_torch_ooms((DATA / name).read_text())
    assert o.request.value == size(want["request"])
    assert ("small" if o.small_pool else "large") == want["pool"]
    assert o.wording == want["wording"]
    for figure in ("free", "unallocated", "reserved", "allowed"):
        if figure in want:
            got = getattr(o, figure)
            assert abs(got.value - size(want[figure])) <= got.tol, figure
    c = o.cause()
    assert c.name == want["cause"], (c.name, c.why)
    if want["settings"]:
        assert len(c.settings) == len(want["settings"])
        for got, expect in zip(c.settings, want["settings"]):
            assert got.startswith(expect), got
    else:
        assert c.settings == []
    for part in want.get("advice", []):
        assert any(part in a for a in c.advice), (part, c.advice)
    for part in want.get("why", []):
        assert part in c.why, (part, c.why)
    for part in want.get("assumed", []):
        assert any(part in a for a in o.assumed), (part, o.assumed)
    for part in want.get("warnings", []):
        assert any(part in w for w in o.warnings), (part, o.warnings)
    if "this_pid" in want:
        assert o.this_pid == want["this_pid"] and not o.processes
    assert not [w for w in o.warnings if "not read" in w]
    assert c.figures and "known to within" in c.figures[-1] or "outside" in c.figures[-1]
    assert contradictions(o) == []
    # the command says the same
    e = explain(DATA / name)
    assert e.cause == want["cause"] and e.request == o.request.value


def test_every_file_has_an_expectation_and_a_source():
    readme = (DATA / "README.md").read_text()
    texts = {p.name for p in DATA.glob("*.txt")} - {"memory_summary_2_13.txt"}
    assert texts == set(EXPECTED)
    for name in texts | {"memory_summary_2_13.txt"}:
        assert f"`{name}`" in readme


def test_the_memory_summary_is_read_and_summarised():
    e = explain(DATA / "memory_summary_2_13.txt")
    assert e.source == "memory_summary" and e.cause == "none"
    assert (e.allocated, e.reserved, e.unallocated) == (6100 * MiB, 9300 * MiB, 1500 * MiB)
    text = str(e)
    assert "memory_summary() of GPU 0" in text and "not an out-of-memory message" in text
    assert "CUDA OOMs           1" in text and "16 % of reserved" in text


def test_no_answer_contradicts_its_figures_over_a_grid():
    """Every combination of free, unallocated, the limit and other processes around a 2 GiB
    segment: the checker finds nothing to object to."""
    GiB = "{:.2f} GiB"
    seen = set()
    for free, unalloc, allowed, other in itertools.product(
            (0.0, 0.5, 1.25, 1.99, 2.0, 2.01, 8.2), (0.0, 0.5, 1.9, 2.5),
            (None, 4.0, 30.0), (0.0, 6.0)):
        alloc = 10.0
        this = alloc + unalloc + 0.5
        cap = this + other + free
        procs = f"Process 77 has {GiB.format(other)} memory in use. " if other else ""
        lim = f"{GiB.format(allowed)} allowed; " if allowed else ""
        msg = (f"CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
               f"of {GiB.format(cap)} of which {GiB.format(free)} is free. {procs}Including "
               f"non-PyTorch memory, this process has {GiB.format(this)} memory in use. {lim}"
               f"Of the allocated memory {GiB.format(alloc)} is allocated by PyTorch, and "
               f"{GiB.format(unalloc)} is reserved by PyTorch but unallocated.")
        (o,) = read_torch_ooms(msg)
        assert contradictions(o) == [], msg
        assert not [w for w in o.warnings if "not read" in w], msg
        seen.add(o.cause().name)
    assert seen == {"fragmentation", "limit", "another process", "device full", "unknown"}
