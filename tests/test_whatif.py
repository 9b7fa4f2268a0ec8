"""What-if questions: min_fraction bisection and settings sweeps (gpudash.trace.whatif)."""

from __future__ import annotations

import numpy as np
import pytest

from gpudash import ConfigError
from gpudash.trace.replay import replay
from gpudash.trace.whatif import (
    DEFAULT_FRACTIONS,
    MinFractionResult,
    SweepTable,
    min_fraction,
    sweep,
)
from gpudash.workloads import trace_from_calls, training_loop

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

MIB, GIB = 1 << 20, 1 << 30


def one_alloc(nbytes: int):
    return trace_from_calls([("alloc", 1, nbytes), ("free", 1)])


# ------------------------------------------------------------------------- min_fraction
def test_min_fraction_of_one_6gib_allocation_on_16gib_is_three_eighths():
    t = one_alloc(6 * GIB)
    r = min_fraction(t, 16 * GIB)  # allow_growth=True by default
    assert isinstance(r, MinFractionResult) and r.fits
    # the limit must hold the 6 GiB region: fraction >= 6/16 exactly
    assert 6 / 16 <= r.fraction <= 6 / 16 + 0.005
    assert r.limit_bytes == int(16 * GIB * r.fraction) >= 6 * GIB
    assert replay(t, device_bytes=16 * GIB, fraction=r.fraction, record=False).fits
    assert not replay(t, device_bytes=16 * GIB, fraction=r.fraction - 0.005,
                      record=False).fits
    # at 1.0 growth doubles its regions to one of 8 GiB for the 6 GiB: any limit from
    # 8 GiB up replays the same, so 0.5 (8 GiB) is known without a replay
    assert r.history[:2] == [(1.0, 0), (0.5, 0)]
    assert r.known == 1 and r.replays == len(r.history) - 1
    assert (r.fraction, 0) in r.history
    assert all(n > 0 for f, n in r.history if f < 6 / 16)
    assert all(n == 0 for f, n in r.history if f >= 6 / 16)
    assert not r.non_monotone
    assert "fraction=0.37" in repr(r) and "replays=8, known=1" in repr(r)


def test_min_fraction_without_growth_and_a_tighter_tolerance():
    t = one_alloc(6 * GIB)
    r = min_fraction(t, "16GiB", tolerance=0.001, allow_growth=False)
    assert 6 / 16 <= r.fraction <= 6 / 16 + 0.001
    assert r.replays > 8


def test_min_fraction_is_none_when_even_hi_fails():
    t = one_alloc(20 * GIB)
    r = min_fraction(t, "16GiB")
    assert r.fraction is None and r.limit_bytes is None and not r.fits
    assert r.replays == 1 and r.history == [(1.0, 1)]
    r = min_fraction(one_alloc(6 * GIB), "16GiB", hi=0.3)
    assert r.fraction is None


def test_min_fraction_counts_ooms_when_asked():
    t = trace_from_calls([("alloc", i, 100 * MIB) for i in range(10)])
    fast = min_fraction(t, "1GiB", allow_growth=False)
    full = min_fraction(t, "1GiB", allow_growth=False, count_ooms=True)
    assert fast.fraction == full.fraction
    assert max(n for _, n in fast.history) == 1
    assert max(n for _, n in full.history) > 1
    with pytest.raises(ValueError, match="chooses the fraction"):
        min_fraction(t, "1GiB", fraction=0.5)
    with pytest.raises(ValueError, match="tolerance"):
        min_fraction(t, "1GiB", tolerance=0)


def test_min_fraction_in_worker_processes_follows_the_same_path():
    """Two workers replay the next midpoint and the one below it side by side; the answer,
    the fractions tried and those known without a replay are those of one process."""
    t = training_loop(steps=3, layers=4, hidden=2048, seed=5)
    seen_one: list = []
    seen_two: list = []
    one = min_fraction(t, "16GiB", tolerance=0.002,
                       progress=lambda d, n: seen_one.append((d, n)))
    two = min_fraction(t, "16GiB", tolerance=0.002, jobs=2,
                       progress=lambda d, n: seen_two.append((d, n)))
    assert (two.fraction, two.history, two.replays, two.known) == (
        one.fraction, one.history, one.replays, one.known)
    assert one.known >= 1 and seen_two == seen_one
    torch_one = min_fraction(t, "16GiB", allocator="torch")
    torch_two = min_fraction(t, "16GiB", allocator="torch", jobs=3)
    assert (torch_two.fraction, torch_two.history) == (torch_one.fraction, torch_one.history)
    with pytest.raises(ConfigError, match="jobs must be an integer"):
        min_fraction(t, "16GiB", jobs=0)
    with pytest.raises(ValueError, match="not both"):
        min_fraction(t, "16GiB", jobs=2, client=object())


def test_worker_processes_fork_only_where_no_other_thread_runs():
    """A fork copies every lock as it is, held or not: with another thread alive the
    workers start by forkserver, and the answer is the same."""
    import sys
    import threading

    from gpudash.trace.whatif import _pool_context

    t = training_loop(steps=2, layers=2, hidden=1024)
    if threading.active_count() == 1 and sys.platform.startswith("linux"):
        assert _pool_context().get_start_method() == "fork"
    one = min_fraction(t, "4GiB")
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        method = _pool_context().get_start_method()
        two = min_fraction(t, "4GiB", jobs=2)
    finally:
        stop.set()
        other.join()
    assert method != "fork"
    assert (two.fraction, two.history) == (one.fraction, one.history)
    if method == "forkserver":   # its workers start with gpudash imported; nothing dropped
        from multiprocessing import forkserver

        preload = forkserver._forkserver._preload_modules
        assert "gpudash.trace.whatif" in preload and "__main__" in preload


def test_min_fraction_progress():
    seen = []
    min_fraction(one_alloc(GIB), "16GiB", progress=lambda d, n: seen.append((d, n)))
    assert seen and seen[-1][0] == seen[-1][1]


# ------------------------------------------------------------------------- sweep
@pytest.fixture(scope="module")
def small_training():
    return training_loop(steps=3, layers=4, hidden=2048, seed=1)


def test_sweep_rows_match_individual_replays(small_training):
    t = small_training
    table = sweep(t, fractions=(0.05, 0.1, 0.3), allow_growth=(True, False),
                  device_bytes="4GiB")
    assert len(table) == 6
    assert [(r["fraction"], r["allow_growth"]) for r in table.rows] == [
        (0.05, True), (0.05, False), (0.1, True), (0.1, False), (0.3, True), (0.3, False)]
    for row in table.rows:
        r = replay(t, device_bytes="4GiB", fraction=row["fraction"],
                   allow_growth=row["allow_growth"], record=False)
        assert row == {
            "fraction": row["fraction"], "allow_growth": row["allow_growth"],
            "limit_bytes": r.memory_limit, "fits": r.fits, "oom_count": r.oom_count,
            "first_oom": r.first_oom[0] if r.first_oom else None,
            "peak_pool_bytes": r.peak_pool_bytes, "peak_bytes_in_use": r.peak_bytes_in_use,
            "worst_fragmentation": r.worst_fragmentation, "extensions": r.extensions}
    assert not table.rows[0]["fits"] and table.rows[-1]["fits"]


def test_sweep_two_jobs_equals_one_job(small_training):
    kw = dict(fractions=(0.05, 0.1, 0.2, 0.4), allow_growth=(True, False),
              device_bytes="4GiB")
    one = sweep(small_training, jobs=1, **kw)
    two = sweep(small_training, jobs=2, **kw)
    assert two == one
    assert two.rows == one.rows


def test_sweep_table_views_and_best(small_training):
    table = sweep(small_training, fractions=(0.05, 0.2, 0.1), allow_growth=True,
                  device_bytes="4GiB")
    cols = table.columns()
    assert list(cols) == list(SweepTable.COLUMNS)
    assert all(len(v) == 3 for v in cols.values())
    assert cols["fraction"].tolist() == [0.05, 0.2, 0.1]
    assert cols["fits"].dtype == bool and cols["limit_bytes"].dtype == np.int64
    assert cols["first_oom"][0] >= 0 and cols["first_oom"][1] == -1
    best = table.best()
    assert best["fraction"] == 0.1 and best["fits"]
    text = table.to_text()
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["fraction", "growth", "limit", "fits"]
    assert len({len(line) for line in lines[:5]}) == 1  # aligned
    assert "409.60 MiB" in text and "(device 4.00 GiB, TensorFlow's BFC allocator)" in text
    html = table.to_html()
    assert html.startswith("<table>") and html.endswith("</table>")
    assert html.count("<tr>") == 4 and "<th>peak pool</th>" in html
    assert "best fraction=0.1" in repr(table)
    none_fit = sweep(small_training, fractions=(0.01,), allow_growth=False, device_bytes="4GiB")
    assert none_fit.best() is None


def test_sweep_default_grid_and_tensorflow_default():
    t = trace_from_calls([("alloc", 1, 3 * GIB), ("free", 1)])
    table = sweep(t, device_bytes="16GiB")
    assert len(table) == 2 * len(DEFAULT_FRACTIONS) == 20
    fits = {(r["fraction"], r["allow_growth"]): r["fits"] for r in table.rows}
    assert not fits[(0.1, True)] and fits[(0.2, True)] and fits[(0.2, False)]
    assert table.best()["fraction"] == 0.2
    t2 = sweep(t, fractions=(None,), allow_growth=True, device_bytes="16GiB")
    assert t2.rows[0]["limit_bytes"] == 15569256448 and np.isnan(t2.columns()["fraction"][0])
    assert "default" in t2.to_text()


def test_sweep_progress_and_errors(small_training):
    seen = []
    sweep(small_training, fractions=(0.1, 0.2), allow_growth=True, device_bytes="4GiB",
          progress=lambda d, n: seen.append((d, n)))
    assert seen == [(1, 2), (2, 2)]
    with pytest.raises(ValueError, match="jobs"):
        sweep(small_training, jobs=0)
    with pytest.raises(ValueError, match="fractions="):
        sweep(small_training, fraction=0.5)
