"""The PyTorch monitor as users run it: ``gpudash.watch("torch")`` starts its polling thread,
time passes, the program allocates, and the feed, its history and the dashboard follow; a
call into PyTorch that does not return is reported and never stops the monitor's stop().

Without a CUDA build of PyTorch the monitor watches a stand-in with torch's API shape
(``torch_standin.StandInTorch``), passed where the monitor takes its torch module: the
threads, feeds, timing and dashboard are the real ones. test_monitors_gpu.py asserts the
same of a real GPU.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import test_widgets_model as shared
from browser_helpers import missing_browser_reason
from test_widgets_dashboard import say, sent
from test_widgets_model import wait_for
from torch_standin import GiB, MiB, ModelTorch, StandInTorch

import gpudash
from gpudash import BackendUnavailableError, ConfigError
from gpudash.bfc import AllocatorStats
from gpudash.monitors._base import Poll
from gpudash.monitors._parse import torch_chunk_table
from gpudash.monitors._torch import TorchMonitor
from gpudash.widgets import Dashboard, LiveModel

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

comms = shared.comms

MONITOR_THREAD = "gpudash-torch-monitor"


def watch(fake, **options):
    options = {"interval": 0.02, "snapshot_interval": 0.1, "history": 1000,
               "poll_timeout": 0.5, **options}
    return gpudash.watch("torch", module=fake, **options)


def stop_returns(monitor, within: float = 3.0) -> bool:
    """stop() in a thread of its own: True when it returned within ``within`` seconds
    (a stop that waits out a stuck call would not)."""
    t = threading.Thread(target=monitor.stop)
    t.start()
    t.join(within)
    return not t.is_alive()


def monitor_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("gpudash-torch")]


@pytest.fixture
def fake():
    torch = StandInTorch()
    yield torch
    torch.release("snapshot")
    torch.release("stats")
    assert wait_for(lambda: not monitor_threads(), timeout=5)


def test_latest_follows_the_thread_s_polls(fake):
    """feed.latest is the newest poll, the point history ends with, as the thread polls."""
    mon = watch(fake, snapshot_interval=30)  # one layout, at the start
    feed = mon.feeds[0]
    try:
        assert wait_for(lambda: mon.polls >= 3)
        handles = [fake.allocate(512 * MiB) for _ in range(4)]
        assert wait_for(lambda: feed.history and feed.history[-1][1] == 2 * GiB)
        polls = mon.polls
        assert wait_for(lambda: mon.polls >= polls + 10)  # still polling
        assert wait_for(lambda: feed.latest.stats.bytes_in_use == 2 * GiB)
        assert feed.latest.stats.pool_bytes == 2 * GiB and feed.error is None
        fake.free(handles.pop())
        assert wait_for(lambda: feed.latest.stats.bytes_in_use == 1536 * MiB)
    finally:
        mon.stop()
    s = feed.latest.stats
    assert (feed.latest.time_ms, s.bytes_in_use, s.pool_bytes, s.bytes_limit) == \
        feed.history[-1]
    assert {thread for _, thread in fake.calls_of("stats")} == {MONITOR_THREAD}
    assert fake.history[0]["max_entries"] == 1000 and fake.history[-1]["enabled"] is None


def test_a_layout_reaches_the_model_with_its_own_stats_then_the_newer_figures(fake):
    """Samples not taken yet: a layout keeps the stats read with it; the figures polled
    after it come at the next sample, merged, with their counts; latest is the newest."""
    mon = TorchMonitor(module=fake, interval=60, snapshot_interval=3600, history=0)
    feed = mon.feeds[0]
    model = LiveModel(feeds=[feed], start=False)  # starts the monitor: one poll, then a minute
    try:
        assert wait_for(lambda: mon.polls == 1)
        model.refresh_now()
        assert feed.sample() is None
        p = fake.allocate(3 * MiB)
        table = torch_chunk_table(fake.cuda.memory_snapshot(), device=0)
        a = AllocatorStats(bytes_in_use=3 * MiB, pool_bytes=4 * MiB)
        b = AllocatorStats(bytes_in_use=5 * MiB, pool_bytes=8 * MiB)
        c = AllocatorStats(bytes_in_use=7 * MiB, pool_bytes=8 * MiB)
        feed._publish(Poll(a, table=table, allocs=1), 1000.0)
        feed._publish(Poll(b, allocs=2, ooms=((1, 2, 3),)), 1250.0)
        feed._publish(Poll(c, allocs=3, frees=1), 1500.0)
        assert feed.latest.stats == c and feed.latest.time_ms == 1500.0
        assert feed.history[-1] == (1500.0, 7 * MiB, 8 * MiB, 0)
        first = feed.sample()
        assert first.table is table and first.stats == a and first.allocs == 1
        second = feed.sample()
        assert second.table is None and second.stats == c and second.time_ms == 1500.0
        assert (second.allocs, second.frees, second.events, second.ooms) == (
            5, 1, 6, ((1, 2, 3),))
        assert feed.sample() is None
        # a new layout stands for everything before it, and carries its counts
        feed._publish(Poll(b, allocs=2), 1750.0)
        feed._publish(Poll(c, table=table, allocs=4), 2000.0)
        last = feed.sample()
        assert last.table is table and last.stats == c and last.allocs == 6
        assert feed.sample() is None
        # the live model draws the layout with its stats, then the newer figures on it
        feed._publish(Poll(a, table=table), 2250.0)
        feed._publish(Poll(c), 2500.0)
        model.refresh_now()
        assert model.state(0).stats == a
        model.refresh_now()
        state = model.state(0)
        assert state.stats == c and int(state.table["size"][state.table["in_use"]].sum()) == \
            3 * MiB
        fake.free(p)
    finally:
        model.close()
        mon.stop()


def test_a_monitor_s_dashboard_is_the_views_dashboard_of_its_feeds(comms, fake):
    """``monitor.dashboard()`` and ``gpudash.Dashboard(monitor)`` show the monitor's feeds (and
    closing one stops the monitor); the monitor reaches the view through the one the package
    registered, without importing it."""
    mon = watch(fake)
    with pytest.raises(TypeError, match="a source or feeds"):
        Dashboard(mon, feeds=mon.feeds)
    dash = mon.dashboard(rate_hz=20)
    try:
        assert isinstance(dash, Dashboard) and dash.model.num_devices == len(mon.feeds) == 1
        fake.allocate(1 * GiB)
        assert wait_for(lambda: dash.model.state(0).stats.bytes_in_use == 1 * GiB, timeout=30)
    finally:
        dash.close()
        mon.stop()
    with pytest.raises(ConfigError, match="monitor is stopped"):
        mon.dashboard()
    mon = watch(fake)
    other = Dashboard(mon, rate_hz=20)
    try:
        assert other.model.num_devices == 1
        assert wait_for(lambda: other.model.state(0).stats.bytes_in_use == 1 * GiB, timeout=30)
    finally:
        other.close()
    assert wait_for(lambda: not mon.running)


def test_a_stuck_layout_read_is_reported_and_the_figures_keep_coming(comms, fake):
    mon = watch(fake)
    feed = mon.feeds[0]
    dash = Dashboard(feeds=mon.feeds, rate_hz=20)
    try:
        assert wait_for(lambda: feed.latest is not None and fake.calls_of("snapshot"))
        fake.hold("snapshot")
        assert wait_for(lambda: fake.waiting["snapshot"].is_set())  # a read is stuck
        reader = [t for t in threading.enumerate() if t.name == "gpudash-torch-layout"]
        assert len(reader) == 1
        fake.allocate(1 * GiB)
        assert wait_for(lambda: feed.latest.stats.bytes_in_use == 1 * GiB)
        assert wait_for(lambda: feed.error is not None)
        assert "torch.cuda.memory_snapshot() has not returned after" in feed.error
        assert "the figures are current" in feed.error
        polls = mon.polls
        assert wait_for(lambda: mon.polls >= polls + 5)  # still polling, one read at a time
        assert len([t for t in threading.enumerate() if t.name == "gpudash-torch-layout"]) == 1
        # the dashboard's status line says so
        say(dash, {"type": "hello"})
        assert wait_for(lambda: any(
            "memory_snapshot() has not returned" in (c["headline"].get("error") or "")
            for c, _ in sent(comms, dash) if c["type"] in ("snapshot", "update")))
        # stop() does not wait for the read; PyTorch's history is given back when it returns
        assert stop_returns(mon)
        assert not mon.running and [h["enabled"] for h in fake.history] == ["all"]
        released = time.monotonic()
        fake.release("snapshot")
        assert wait_for(lambda: len(fake.history) == 2)
        assert fake.history[1]["enabled"] is None and fake.history[1]["time"] >= released
        assert fake.history[1]["thread"] == "gpudash-torch-layout"
        assert any("memory_snapshot() took" in text for _, _, text in mon.errors)
    finally:
        dash.close()
        mon.stop()


def test_a_stuck_poll_is_reported_and_stop_does_not_wait_for_it(comms, fake):
    mon = watch(fake, snapshot_interval=0)
    feed = mon.feeds[0]
    dash = Dashboard(feeds=mon.feeds, rate_hz=20)
    try:
        say(dash, {"type": "hello"})
        assert wait_for(lambda: mon.polls >= 2)
        fake.hold("stats")
        assert wait_for(lambda: fake.waiting["stats"].is_set())  # the thread is stuck
        assert wait_for(lambda: feed.error is not None)
        assert feed.error.startswith("torch cuda:0: the poll has not returned after")
        assert "torch is not answering" in feed.error
        # nothing new is polled, yet the dashboard gets the news
        assert wait_for(lambda: any(
            "the poll has not returned" in (c["headline"].get("error") or "")
            for c, _ in sent(comms, dash) if c["type"] in ("snapshot", "update")))
        # a poll of one's own does not hang behind it either
        with pytest.raises(BackendUnavailableError, match="the poll has not returned"):
            mon.poll()
        assert stop_returns(mon)
        assert any("stopped without waiting for it" in text for _, _, text in mon.errors)
        assert [h["enabled"] for h in fake.history] == ["all"]  # not yet given back
        fake.release("stats")
        assert wait_for(lambda: len(fake.history) == 2 and not monitor_threads())
        assert fake.history[1]["enabled"] is None
        assert fake.history[1]["thread"] == MONITOR_THREAD
        assert any("a poll took" in text for _, _, text in mon.errors)
    finally:
        dash.close()
        mon.stop()


def test_a_failed_poll_is_said_on_the_feed_until_one_succeeds(fake):
    mon = watch(fake, snapshot_interval=0)
    feed = mon.feeds[0]
    real = fake.cuda.memory_stats
    try:
        assert wait_for(lambda: mon.polls >= 1)

        def broken(device=0):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        fake.cuda.memory_stats = broken
        assert wait_for(lambda: feed.error is not None)
        assert "the last poll failed" in feed.error and "illegal memory access" in feed.error
        fake.cuda.memory_stats = real
        assert wait_for(lambda: feed.error is None)
    finally:
        mon.stop()


def test_an_oom_reaches_the_feed_through_pytorch_s_observer():
    fake = StandInTorch(total=1 * GiB)
    mon = watch(fake)
    feed = mon.feeds[0]
    try:
        with pytest.raises(MemoryError):
            fake.allocate(2 * GiB)
        seen: list = []

        def oom_sampled() -> bool:
            sample = feed.sample()
            if sample is not None:
                seen.extend(sample.ooms)
            return bool(seen)

        assert wait_for(oom_sampled)
        (t_ns, rounded, requested), = seen
        assert rounded == requested == 2 * GiB and abs(t_ns / 1e9 - time.time()) < 60
    finally:
        mon.stop()


def test_the_layout_is_read_and_drawn_from_a_stand_in_without_include_traces():
    """Older PyTorch (no include_traces): the monitor calls memory_snapshot() plainly."""
    fake = StandInTorch(include_traces=False)
    p = fake.allocate(3 * MiB)
    mon = TorchMonitor(module=fake, snapshot_interval=0.1, history=0)
    try:
        mon.poll()
        t = mon.feeds[0].latest.table
        assert t is not None and int(t["size"][t["in_use"]].sum()) == 3 * MiB
        assert np.array_equal(t["regions"], np.array([[p, 4 * MiB]]))
    finally:
        mon.stop()


def test_watch_torch_refuses_what_it_cannot_watch():
    with pytest.raises(ConfigError, match="cannot watch torch: PyTorch has no CUDA device"):
        gpudash.watch("torch", module=StandInTorch(available=False))
    with pytest.raises(ConfigError, match="poll_timeout must be a number of seconds"):
        gpudash.watch("torch", module=StandInTorch(), poll_timeout=0)
    with pytest.raises(ConfigError, match="PyTorch has no CUDA device 3; accepted: 0..0"):
        gpudash.watch("torch", module=StandInTorch(), devices=3)
    assert not monitor_threads()


# ----------------------------------------------------------------------------- in a browser
_NO_BROWSER = missing_browser_reason()


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.skipif(_NO_BROWSER is not None, reason=f"browser tests: {_NO_BROWSER}")
def test_the_dashboard_s_status_line_says_when_torch_stops_answering(tmp_path_factory):
    """In JupyterLab, driven by Chromium: a watched PyTorch (the stand-in) whose poll is
    stuck is said in red in the dashboard's status line, and the line clears when it
    answers again."""
    import nbformat
    from browser_helpers import (LabServer, launch_chromium, run_code_in_new_cell,
                                 wait_for_notebook)
    from playwright.sync_api import sync_playwright

    tests = str(Path(__file__).resolve().parent)
    server = LabServer(tmp_path_factory.mktemp("lab"))
    pw = sync_playwright().start()
    try:
        server.start()
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nbformat.write(nb, server.root / "stuck.ipynb")
        browser = launch_chromium(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(30_000)
        page.goto(server.url("lab/tree/stuck.ipynb?reset"))
        wait_for_notebook(page)
        run_code_in_new_cell(page, f"import sys\nsys.path.insert(0, {tests!r})\n"
                                   "from torch_standin import StandInTorch\nimport gpudash\n"
                                   "fake = StandInTorch()\n"
                                   "mon = gpudash.watch('torch', module=fake, interval=0.05, "
                                   "poll_timeout=0.5)\nmon.dashboard()")
        dash = page.locator(".gd-root").first
        dash.wait_for(state="attached", timeout=60_000)
        dash.locator(".gd-head", has_text="torch cuda:0").wait_for(timeout=30_000)
        status = dash.locator(".gd-status")
        run_code_in_new_cell(page, "fake.hold('stats')\nprint('held')")
        dash.scroll_into_view_if_needed()
        page.wait_for_function(
            "(e) => e.classList.contains('err') && e.textContent.startsWith("
            "'torch cuda:0: the poll has not returned after')",
            arg=status.element_handle(), timeout=30_000, polling=100)
        run_code_in_new_cell(page, "fake.release('stats')\nprint('released')")
        page.wait_for_function("(e) => !e.classList.contains('err') && e.textContent === ''",
                               arg=status.element_handle(), timeout=30_000, polling=100)
        out = run_code_in_new_cell(page, "mon.stop()\nprint(mon.running, mon.feeds[0].error)")
        assert out.strip().splitlines()[-1] == "False None"
        browser.close()
    finally:
        pw.stop()
        server.stop()


# ------------------------------------------------------------------------------ replay
def _run(torch, steps: int = 500, seed: int = 3, device: int = 0) -> None:
    """A program's allocations, frees, out-of-memory errors and empty_cache() calls."""
    rng = random.Random(seed)
    live: list[int] = []
    for i in range(steps):
        if live and rng.random() < 0.45:
            torch.free(live.pop(rng.randrange(len(live))), device)
        else:
            try:
                live.append(torch.allocate(rng.choice([700, 3000, 2 * MiB, 5 * MiB, 30 * MiB,
                                                       90 * MiB, 300 * MiB]), device))
            except gpudash.OutOfMemoryError:
                pass
        if i % 150 == 149:
            torch.cuda.empty_cache()


@pytest.mark.parametrize("conf, fraction", [
    ("", None), ("max_split_size_mb:64", 0.5), ("expandable_segments:True", 0.3),
    ("garbage_collection_threshold:0.6", 0.3)])
def test_what_the_monitor_watched_replays_exactly_through_the_model(conf, fraction):
    """The stand-in's allocator is gpudash's model of PyTorch's, so the snapshot the monitor
    reads is PyTorch's layout of a real run: its replay must match every segment event,
    address and OOM, and end in the same layout, with the fraction PyTorch reports."""
    torch = ModelTorch(total=4 * GiB, conf=conf or None, fraction=fraction)
    mon = watch(torch, snapshot_interval=30, history=100_000)
    try:
        _run(torch)
        alloc = torch.cuda.allocators[0]
        result = mon.replay()
        fid = result.fidelity
        assert fid.start == "empty" and fid.final_layout_equal, fid.summary()
        assert fid.segment_events_matched == fid.segment_events > 0
        assert fid.allocs_matched == fid.allocs and fid.ooms_matched == fid.ooms
        assert fid.ooms == alloc.memory_stats()["num_ooms"]
        assert result.allocator == "torch" and result.options["fraction"] == fraction
        assert result.options["conf"] == conf
        assert result.memory_limit == alloc.memory_limit
        assert result.peak_pool_bytes == alloc.memory_stats()["reserved_bytes.all.peak"]
        # the snapshot read once, replayed on a smaller device: a what-if, no longer exact
        snap = mon.snapshot()
        other = mon.replay(snapshot=snap, exact=False, device_bytes=2 * GiB)
        assert other.fidelity is None and other.options["device_bytes"] == 2 * GiB
    finally:
        mon.stop()
    assert wait_for(lambda: not monitor_threads(), timeout=5)


def test_a_history_ring_that_wrapped_replays_from_the_middle_and_says_so():
    torch = ModelTorch(total=4 * GiB)
    mon = watch(torch, snapshot_interval=30, history=300)  # far fewer entries than the run
    try:
        _run(torch, steps=600)
        result = mon.replay()
        fid = result.fidelity
        assert fid.start == "mid-run" and "(mid-run start)" in fid.summary()
        # the start is rebuilt from the final segments: the window replays exactly too
        assert fid.final_layout_equal and fid.segment_events_matched == fid.segment_events
    finally:
        mon.stop()


def test_replay_refuses_what_it_cannot_replay():
    torch = ModelTorch(devices=2, total=GiB)
    mon = watch(torch, snapshot_interval=30, history=0)  # no history turned on
    try:
        torch.allocate(MiB)
        with pytest.raises(ConfigError, match="has no allocator history to replay .the "
                                              "monitor was started with history=0"):
            mon.replay()
        with pytest.raises(ConfigError, match=r"watches CUDA device\(s\) \[0, 1\]; got 5"):
            mon.replay(device=5)
    finally:
        mon.stop()
    with pytest.raises(ConfigError, match="this torch monitor is stopped"):
        mon.replay()
    plain = StandInTorch()  # a torch without memory._snapshot()
    mon = watch(plain, snapshot_interval=30)
    try:
        with pytest.raises(ConfigError, match=r"no torch.cuda.memory._snapshot\(\)"):
            mon.replay()
    finally:
        mon.stop()
