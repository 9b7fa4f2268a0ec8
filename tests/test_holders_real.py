"""Who held the memory in other people's real PyTorch snapshots (../shared/reference/external,
skipped when absent; GPUDASH_EXTERNAL names another folder): ``top_holders(by="line")`` at the
peak against a count made here straight from the pickle, and what explain and the report
show of it."""

from __future__ import annotations

import pickle
import re
from collections import Counter
from pathlib import Path

import pytest

from gpudash.trace import load_trace
from gpudash.trace.holders import top_holders
from gpudash.formats.stacks import Frame

ROOT = Path(__file__).resolve().parent.parent
from shared_files import EXTERNAL  # noqa: E402
needs_external = pytest.mark.skipif(not EXTERNAL.is_dir(), reason="../shared is absent")

# the real snapshots whose trace starts at an empty allocator, and their devices
EMPTY_START = [("DeComFL.memory.pickle", 0), ("code_location.memory_snapshot.pickle", 0),
               ("code_location.memory_snapshot.pickle", 1),
               ("code_location.memory_snapshot.pickle", 2),
               ("cs336_silmont2000.mem_snapshot.pickle", 0)]


def _is_users(filename: str) -> bool:
    """The user's own code, written out plainly: a .py file outside torch, installed
    packages and the standard library."""
    path = filename.replace("\\", "/")
    return (path.endswith(".py") and "site-packages/" not in path
            and "dist-packages/" not in path and "/torch/" not in path
            and "torchinductor_" not in path
            and re.search(r"/lib/python3\.\d+/", path) is None)


def _count_from_the_pickle(path: Path, device: int) -> tuple[int, Counter]:
    """Replay the device's alloc / free_completed entries, take the first moment the bytes
    allocated peak, and add up each live block by its innermost user frame (None: none)."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    live: dict[int, dict] = {}
    now = best = 0
    at_best: dict[int, dict] = {}
    for e in snap["device_traces"][device]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            now += e["size"]
            if now > best:
                best, at_best = now, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            now -= live.pop(e["addr"])["size"]
    groups: Counter = Counter()
    for e in at_best.values():
        frame = next((f for f in e.get("frames") or [] if _is_users(f["filename"])), None)
        key = (frame["filename"], frame["line"], frame["name"]) if frame else None
        groups[key] += e["size"]
    return best, groups


@needs_external
@pytest.mark.parametrize("name,device", EMPTY_START)
def test_holders_by_line_at_the_peak_equal_a_count_from_the_pickle(name, device):
    peak, expected = _count_from_the_pickle(EXTERNAL / name, device)
    table = top_holders(load_trace(EXTERNAL / name), at="peak", by="line", device=device)
    assert abs(table.total_bytes - peak) <= 0.01 * peak
    got: Counter = Counter()
    for row in table:
        got[tuple(row.key) if isinstance(row.key, Frame) else None] += row.bytes
    assert set(got) == set(expected)
    for key, n in expected.items():
        assert abs(got[key] - n) <= 0.01 * n, (key, got[key], n)
    # the same order, largest first (ties by name)
    top = [k for k, _ in sorted(expected.items(), key=lambda kv: -kv[1]) if k][:3]
    shown = [tuple(r.key) for r in table if isinstance(r.key, Frame)][:3]
    assert [expected[k] for k in shown] == [expected[k] for k in top]
    assert not table.missing.get("rebuilt")


@pytest.mark.core
@needs_external
def test_explain_shows_who_held_the_memory_and_the_refused_stack():
    from gpudash.torch_explain import explain_torch

    e = explain_torch(EXTERNAL / "code_location.memory_snapshot.pickle", prove=False)
    text = str(e)
    assert e.device == 1 and e.holders is not None
    assert e.holders[0].holder == "models.py:174 update_nodes"
    assert "held at the OOM" in text and "29.68 GiB in 12 block(s) at models.py:174" in text
    # the refused request's stack, the user's frames first
    rows = e.lines()
    i = next(i for i, (k, _) in enumerate(rows) if k == "request's stack")
    stack = [v for _, v in rows[i:i + 4]]
    assert stack[0].endswith("models.py:181 update_nodes")
    assert stack[1].endswith("models.py:231 forward")
    assert stack[2].startswith("called into (in libraries)")
    assert stack[2].endswith("torch/nn/functional.py:1701 relu")
    assert stack[3].endswith("more frame(s) in libraries and C++)")
    assert "held at the OOM" in e._summary_html()


@needs_external
def test_the_report_shows_holders_with_stacks_and_an_icicle(tmp_path):
    from gpudash.report import _holders_section, stack_icicle_figure

    trace = load_trace(EXTERNAL / "code_location.memory_snapshot.pickle")
    section = _holders_section(trace, 1)
    assert "Who holds memory at the peak" in section
    assert "Who held memory at the out-of-memory error" in section
    assert 0 < section.count("<details>") <= 40             # two tables of at most 20 rows
    assert 'data-plot="icicle"' in section and "models.py:174 update_nodes" in section
    # a row's stack on demand: the user's frames, then the libraries' and C++'s
    assert "-- in libraries:" in section and "-- C++:" in section
    fig = stack_icicle_figure(trace, device=1, max_nodes=10)
    icicle = fig.data[0]
    assert len(icicle.ids) <= 11 and icicle.labels[1] == "models.py:231 forward"
    assert icicle.values[0] == top_holders(trace, device=1).total_bytes
