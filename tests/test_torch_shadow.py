"""Shadow mode (gpudash.torch.attach) against the torch stand-in that records history as
PyTorch 2.11 does (tests/torch_standin.ModelTorch): every control, a refused live change, a
wrapped ring, the what-if against the run itself, OOMs, several devices, the magic."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import gpudash
from gpudash import ConfigError, OutOfMemoryError
from gpudash.torch_shadow import attach

from torch_standin import GiB, MiB, ModelTorch

pytestmark = pytest.mark.core

HERE = os.path.basename(__file__)


def _layout(segments):
    """Segments as PyTorch lists them, less what a rebuilt free gap cannot know (the last
    request it served)."""
    return [(s["address"], s["total_size"],
             [(b["address"], b["size"], b["state"],
               b["requested_size"] if b["state"] != "inactive" else 0) for b in s["blocks"]])
            for s in sorted(segments, key=lambda s: s["address"])]


def _same(shadow, torch, device=0):
    mine = shadow.device(device).allocator.segments()
    theirs = [s for s in torch.cuda.allocators[device].segments()]
    return _layout(mine) == _layout(theirs)


def _workload(torch, steps=12, device=0, shadow=None, calls=None):
    """A deterministic training-like loop: per step, activations freed at its end, one kept;
    every allocate and free counted in ``calls`` (from 1, as the what-if counts)."""
    kept = []
    for s in range(steps):
        if calls is not None:
            calls.step = s + 1      # shadow.step() counts from 1
        if shadow is not None:
            shadow.step()
        acts = []
        for k in range(6):
            acts.append(torch.allocate((s % 5 + 1) * 9 * MiB + k * MiB, device))
            if calls is not None:
                calls.append(("alloc", s))
        kept.append(acts.pop(2))
        for a in acts:
            torch.free(a, device)
            if calls is not None:
                calls.append(("free", s))
    return kept


class _Calls(list):
    step = 0


# ------------------------------------------------------------------------- the stand-in
def test_the_standin_records_history_as_pytorch_2_11():
    torch = ModelTorch(total=GiB)
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=50)
    p = torch.allocate(3 * MiB)
    ring = torch.cuda.memory._snapshot()["device_traces"][0]
    assert [e["action"] for e in ring] == ["segment_alloc", "alloc", "snapshot"]
    assert ring[1]["addr"] == p and ring[1]["size"] == 3 * MiB and ring[1]["time_us"] > 0
    assert ring[1]["frames"][0]["filename"].endswith(HERE)
    for _ in range(40):
        torch.free(torch.allocate(MiB))
    ring = torch.cuda.memory._snapshot()["device_traces"][0]
    assert len(ring) == 50 and ring[0]["action"] != "segment_alloc"   # it wrapped
    # the settings call resets what the string leaves out, but not expandable_segments
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True,max_split_size_mb:64")
    torch._C._accelerator_setAllocatorSettings("garbage_collection_threshold:0.5")
    conf = torch.cuda.allocators[0].config
    assert conf.max_split_size is None and conf.garbage_collection_threshold == 0.5
    assert conf.expandable_segments
    with pytest.raises(RuntimeError, match="backend parsed at runtime"):
        torch._C._accelerator_setAllocatorSettings("backend:cudaMallocAsync")
    with pytest.raises(ValueError, match="Allowed range"):
        torch.cuda.set_per_process_memory_fraction(1.5)
    assert not hasattr(ModelTorch(version="2.8.0")._C, "_accelerator_setAllocatorSettings")
    torch.cuda.memory._record_memory_history(enabled=None)
    assert torch.cuda.memory._snapshot()["device_traces"] == [[]]


# ------------------------------------------------------------------------- following
def test_attach_follows_the_job_exactly_with_its_stacks():
    torch = ModelTorch(total=4 * GiB)
    before = [torch.allocate(3 * MiB) for _ in range(4)]      # made before attaching
    shadow = attach(torch, interval=0)
    try:
        dev = shadow.devices[0]
        assert "attached" in dev.notice and _same(shadow, torch)
        _workload(torch)
        for p in before[:2]:
            torch.free(p)
        fed = shadow.refresh()[0]
        assert fed == dev.entries and fed > 100
        assert dev.exact and dev.allocs_matched == dev.allocs > 0
        assert dev.segment_events_matched == dev.segment_events > 0
        assert _same(shadow, torch)
        st = dev.allocator.memory_stats()
        real = torch.cuda.memory_stats(0)
        assert st["reserved_bytes.all.current"] == real["reserved_bytes.all.current"]
        assert st["allocated_bytes.all.current"] == real["allocated_bytes.all.current"]
        # each live block made since attaching carries the job's allocating line
        texts = {shadow._holder_text(h) for h in dev._holders.values()}
        assert any(t.startswith(f"{HERE}:") and "_workload" in t for t in texts)
        # nothing new: only the snapshot entry the read itself adds
        assert shadow.refresh()[0] == 1
    finally:
        shadow.stop()
    assert torch.history[-1]["enabled"] is None


class _CountingRing(list):
    reads = 0

    def __getitem__(self, k):
        type(self).reads += 1
        return super().__getitem__(k)


def test_a_refresh_reads_the_new_entries_not_the_ring():
    torch = ModelTorch(total=4 * GiB)
    shadow = attach(torch, interval=0, history=100_000)
    try:
        _workload(torch, steps=30)
        shadow.refresh()
        real = torch.cuda.memory._snapshot
        full = len(real()["device_traces"][0])

        def counted():
            snap = real()
            snap["device_traces"] = [_CountingRing(r) for r in snap["device_traces"]]
            return snap

        torch.cuda.memory._snapshot = counted
        dev = shadow.devices[0]
        dev._seen = 0          # make it search backwards, from the newest entry
        torch.free(torch.allocate(MiB))
        _CountingRing.reads = 0
        # the read above's snapshot entry, segment_alloc, alloc, free_requested,
        # free_completed and this read's snapshot entry
        assert shadow.refresh()[0] == 6
        assert full > 500 and _CountingRing.reads < 20
        assert _same(shadow, torch)
    finally:
        shadow.stop()


def test_a_ring_that_wrapped_between_refreshes_is_resynced_and_said():
    torch = ModelTorch(total=4 * GiB)
    shadow = attach(torch, interval=0, history=64)
    try:
        _workload(torch, steps=20)        # far more than 64 entries between two refreshes
        assert shadow.refresh()[0] == 0
        dev = shadow.devices[0]
        assert dev.lost > 0 and "wrapped between two refreshes" in dev.notice
        assert "lost" in dev.summary() and _same(shadow, torch)
        _workload(torch, steps=1)          # fits in the ring: followed exactly from there
        assert shadow.refresh()[0] > 0 and dev.exact and _same(shadow, torch)
    finally:
        shadow.stop()


# ------------------------------------------------------------------------- controls
def test_the_fraction_acts_on_pytorch_and_its_what_if_predicts_where_pytorch_fails():
    torch = ModelTorch(total=2 * GiB)
    shadow = attach(torch, interval=0)
    try:
        _workload(torch, shadow=shadow)
        shadow.refresh()
        wi = shadow.what_if(fraction=0.2)
        assert wi.failed and wi.step is not None and wi.step_source == "shadow.step() calls"
        assert wi.where.startswith(f"{HERE}:") and f"call {wi.call:,}" in wi.text
        answer = shadow.configure(fraction=0.2)
        assert torch.cuda.get_per_process_memory_fraction(0) == 0.2
        assert shadow.devices[0].allocator.fraction == 0.2
        assert "set_per_process_memory_fraction(0.2, 0)" in answer
        assert "reserved" in answer and "before" in answer and "after" in answer
        assert "would have failed at call" in answer
    finally:
        shadow.stop()
    # the same job run at 0.2 from the start fails where the what-if said
    again = ModelTorch(total=2 * GiB, fraction=0.2)
    calls = _Calls()
    with pytest.raises(OutOfMemoryError):
        _workload(again, calls=calls)
    assert len(calls) + 1 == wi.call and calls.step == wi.step


def test_settings_go_as_the_whole_string_through_the_call_the_version_has():
    for version, call in (("2.11.0", "torch._C._accelerator_setAllocatorSettings"),
                          ("2.8.0", "torch.cuda.memory._set_allocator_settings")):
        torch = ModelTorch(total=4 * GiB, version=version)
        shadow = attach(torch, interval=0)
        try:
            _workload(torch, steps=4)
            answer = shadow.configure(max_split_size_mb=64)
            assert call in answer
            answer = shadow.configure(garbage_collection_threshold=0.6)
            # PyTorch resets what the string leaves out: the string carries both
            last = torch.settings_calls[-1][1]
            assert "max_split_size_mb:64" in last and "garbage_collection_threshold:0.6" in last
            conf = torch.cuda.allocators[0].config
            assert conf.max_split_size == 64 * MiB and conf.garbage_collection_threshold == 0.6
            answer = shadow.configure(expandable_segments=True)
            assert "held stay as they were made" in answer
            assert torch.cuda.allocators[0].config.expandable_segments
            assert "max_split_size_mb:64" in torch.settings_calls[-1][1]
            _workload(torch, steps=4)
            shadow.refresh()
            assert shadow.devices[0].exact and _same(shadow, torch)
        finally:
            shadow.stop()


def test_a_change_pytorch_refuses_live_is_said_and_nothing_changes():
    torch = ModelTorch(total=4 * GiB)
    shadow = attach(torch, interval=0)
    try:
        shadow.configure(max_split_size_mb=64)
        with pytest.raises(ConfigError, match="PyTorch refused .*backend parsed at runtime != "
                                              "allocator async backend parsed at load time"):
            shadow.configure(conf="backend:cudaMallocAsync")
        assert torch.cuda.allocators[0].config.max_split_size == 64 * MiB
        assert shadow.devices[0].allocator.config.max_split_size == 64 * MiB
        n = len(torch.settings_calls)
        with pytest.raises(ConfigError, match=r"\[0, 1\]"):
            shadow.configure(fraction=1.5)
        with pytest.raises(ConfigError, match="allow_growth"):
            shadow.configure(allow_growth=True)
        assert len(torch.settings_calls) == n and torch.cuda.allocators[0].fraction is None
    finally:
        shadow.stop()


def test_empty_cache_returns_what_pytorch_returns_and_says_it():
    torch = ModelTorch(total=4 * GiB)
    shadow = attach(torch, interval=0)
    try:
        _workload(torch)
        before = torch.cuda.memory_stats(0)["reserved_bytes.all.current"]
        freed = shadow.empty_cache()
        after = torch.cuda.memory_stats(0)["reserved_bytes.all.current"]
        assert freed == before - after > 0
        assert "torch.cuda.empty_cache(): reserved" in shadow.answers[-1]
        assert _same(shadow, torch) and shadow.devices[0].exact
    finally:
        shadow.stop()


def test_an_oom_is_explained_with_its_stack_and_the_setting_that_serves_it():
    torch = ModelTorch(total=2 * GiB)
    shadow = attach(torch, interval=0)
    try:
        shadow.configure(fraction=0.15)
        with pytest.raises(OutOfMemoryError):
            _workload(torch, shadow=shadow)
        shadow.refresh()
        ex = shadow.ooms[-1]
        assert ex.where.startswith(f"{HERE}:") and ex.step is not None
        assert ex.fix is not None and ex.proof.served_ooms >= 1 and not ex.proof.failed
        assert "would have served it" in ex.text
        assert shadow.devices[0].ooms_matched == shadow.devices[0].ooms == 1
    finally:
        shadow.stop()


def test_a_what_if_that_serves_every_served_request_but_not_the_run_s_oom_says_so():
    """Between the fraction the job ran out at and one that serves it, the what-if neither
    fails a request PyTorch served nor serves the run's own OOM: it says that OOM would
    still happen (not that every call would have been served)."""
    torch = ModelTorch(total=2 * GiB)
    shadow = attach(torch, interval=0)
    try:
        held = _workload(torch, shadow=shadow)
        shadow.configure(fraction=0.2)
        with pytest.raises(OutOfMemoryError):
            held += _workload(torch, shadow=shadow)
        shadow.refresh()
        seen = {}
        for f in np.arange(0.20, 1.0, 0.01):
            wi = shadow.what_if(fraction=round(float(f), 2))
            kind = "fails" if wi.failed else ("serves" if wi.served_ooms else "still")
            seen.setdefault(kind, wi)
        still, serves = seen["still"], seen["serves"]
        assert still.real_ooms == 1 and still.served_ooms == 0 and not still.failed
        assert "would still happen" in still.text and "would all have been served" \
            not in still.text
        assert f"{HERE}:" in still.text and "(step " in still.text
        assert serves.fraction > still.fraction and "would all have been served" in serves.text
    finally:
        shadow.stop()


def test_previews_of_a_dragged_slider_share_one_history_read(monkeypatch):
    """A slider dragged asks for a preview many times a second: the history read within
    PREVIEW_AGE serves them (read and parsed once), and nothing changes in the job."""
    import gpudash.torch_shadow as ts

    torch = ModelTorch(total=2 * GiB)
    shadow = attach(torch, interval=0)
    try:
        _workload(torch, shadow=shadow)
        shadow.refresh()
        reads = []
        real = torch.cuda.memory._snapshot
        monkeypatch.setattr(torch.cuda.memory, "_snapshot",
                            lambda *a, **k: reads.append(1) or real(*a, **k))
        texts = [shadow.preview("per_process_gpu_memory_fraction", f)
                 for f in (0.3, 0.25, 0.2, 0.15, 0.1)]
        assert reads == [] and all(t.startswith("what-if, not applied: ") for t in texts)
        assert texts[2].endswith(shadow.what_if(fraction=0.2).text.split(": ", 1)[1])
        assert torch.cuda.get_per_process_memory_fraction(0) == 1.0
        monkeypatch.setattr(ts, "PREVIEW_AGE", 0.0)     # an old read: read again
        shadow.preview("per_process_gpu_memory_fraction", 0.2)
        assert len(reads) >= 1
    finally:
        shadow.stop()


def test_a_live_max_split_that_would_free_a_segment_in_use_is_refused_before_pytorch_hears():
    """Lowering max_split_size_mb live below a split segment's free run would let PyTorch
    cudaFree that segment while a block in it is in use (see TORCH.split_hazard): shadow
    mode refuses before calling PyTorch, the preview says so, and a safe value goes."""
    torch = ModelTorch(total=GiB)
    shadow = attach(torch, interval=0)
    try:
        a = torch.allocate(int(30.5 * MiB))
        torch.allocate(int(1.2 * MiB))
        torch.free(a)
        shadow.refresh()
        calls = len(torch.settings_calls)
        with pytest.raises(ConfigError, match="max_split_size_mb:21 live is not safe now"):
            shadow.configure(max_split_size_mb=21)
        assert shadow.devices[0].allocator.config.max_split_size is None
        assert len(torch.settings_calls) == calls                   # PyTorch not called
        text = shadow.preview("max_split_size_mb", 21)
        assert text.startswith("what-if, not applied: ") and \
            "Applying it live would be refused: max_split_size_mb:21" in text
        assert "refused" not in shadow.preview("max_split_size_mb", 64)
        assert "max_split_size_mb:64" in shadow.configure(max_split_size_mb=64)
    finally:
        shadow.stop()


def test_steps_come_from_the_jobs_annotations_when_it_has_them():
    torch = ModelTorch(total=2 * GiB)
    shadow = attach(torch, interval=0)
    try:
        for s in range(12):
            torch.step_annotation(100 + s)
            _workload(torch, steps=1)
        wi = shadow.what_if(fraction=0.05)
        assert wi.failed and wi.step >= 100 and "ProfilerStep" in wi.step_source
    finally:
        shadow.stop()


# ------------------------------------------------------------------------- devices, views
def test_one_model_per_device_and_the_dashboard_acts_on_pytorch():
    pytest.importorskip("ipywidgets")
    from gpudash.live.model import LiveModel

    torch = ModelTorch(devices=2, total=GiB)
    shadow = attach(torch, interval=0)
    model = LiveModel(shadow, start=False)
    try:
        _workload(torch, steps=3, device=1)
        shadow.refresh()
        assert _same(shadow, torch, 1) and not shadow.devices[0].allocator.segments()
        state = model.refresh_now()[1]
        assert state.stats.bytes_in_use == torch.cuda.memory_stats(1)[
            "allocated_bytes.all.current"]
        model.configure(device=1, fraction=0.5)
        assert torch.cuda.get_per_process_memory_fraction(1) == 0.5
        assert torch.cuda.get_per_process_memory_fraction(0) == 1.0
    finally:
        model.close()
        shadow.stop()


def test_the_dashboard_answers_in_shadows_words_and_says_how_current_it_is(monkeypatch):
    """Through the dashboard's own message path (a control from the page, the reply, the
    next update's headline): shadow's answer, not the generic one; the ring's notice."""
    pytest.importorskip("anywidget")
    import test_widgets_dashboard as wd
    import test_widgets_model as wm

    from gpudash.widgets import Dashboard

    log = wm.MessageLog()
    cls = wm._make_recording_comm_class()
    import comm

    monkeypatch.setattr(comm, "create_comm", lambda *a, **k: cls(log, **k))
    torch = ModelTorch(total=2 * GiB)
    shadow = attach(torch, interval=0, history=2000)
    dash = Dashboard(shadow, start=False)
    try:
        _workload(torch, shadow=shadow)
        shadow.refresh()
        wd.say(dash, {"type": "hello"})
        head = wd.sent(log, dash, "snapshot")[-1][0]["headline"]
        assert head["note"].startswith("history read ") and "s ago" in head["note"]
        # before a change is applied, the page asks what it would do (a slider dragged, a
        # value typed): the replay of the run so far under it, and nothing changes
        assert dash._controls_info(0)["preview"] is True
        before = torch.cuda.get_per_process_memory_fraction(0)
        reply = wd.act(log, dash, "preview", {"name": "fraction", "value": 0.2})
        assert reply["ok"] and reply["preview"] and \
            torch.cuda.get_per_process_memory_fraction(0) == before
        assert reply["text"].startswith("what-if, not applied: cuda:0: at fraction 0.2 this "
                                        "run would have failed at call")
        assert reply["text"].endswith(shadow.what_if(fraction=0.2).text.split(": ", 1)[1])
        reply = wd.act(log, dash, "preview", {"name": "max_split", "value": 64})
        assert reply["ok"] and "max_split_size_mb:64" in reply["text"]
        assert shadow.devices[0].allocator.config.as_dict()["max_split_size_mb"] is None
        for bad in ({"name": "fraction", "value": 1.5}, {"name": "empty_cache", "value": None},
                    {"name": "fraction"}, 0.2):
            assert not wd.act(log, dash, "preview", bad)["ok"], bad
        # the fraction from the page: PyTorch's call, reserved before and after, what the
        # limit refuses, and the replay of the run so far
        reply = wd.act(log, dash, "fraction", 0.2)
        assert reply["ok"] and torch.cuda.get_per_process_memory_fraction(0) == 0.2
        text = reply["text"]
        assert "torch.cuda.set_per_process_memory_fraction(0.2, 0)" in text
        assert "before" in text and "after" in text and "may take" in text
        assert "at fraction 0.2 this run would have failed at call" in text
        assert f"(step {shadow.what_if().step}, counted by shadow.step() calls)" in text
        assert f"{HERE}:" in text and text == shadow.answers[-1]
        reply = wd.act(log, dash, "empty_cache")
        assert reply["ok"] and reply["text"].startswith("cuda:0: torch.cuda.empty_cache()")
        reply = wd.act(log, dash, "max_split", 64)
        assert "_accelerator_setAllocatorSettings('max_split_size_mb:64')" in reply["text"]
        # a change PyTorch refuses: said, nothing changed
        reply = wd.act(log, dash, "fraction", 1.5)
        assert not reply["ok"] and torch.cuda.get_per_process_memory_fraction(0) == 0.2
        # the ring wraps between two reads: the rebuild is said beside the figures
        for _ in range(1000):
            torch.free(torch.allocate(MiB))
        shadow.refresh()
        dash.refresh()
        note = wd.sent(log, dash, "update")[-1][0]["headline"]["note"]
        assert "the history ring (2,000 entries) wrapped between two refreshes" in note
        assert "rebuilt from PyTorch's segments" in note
        # with nothing new in the job, the views still go on (the note says the age)
        n = len(wd.sent(log, dash, "update"))
        import time

        time.sleep(0.15)
        dash.refresh()
        assert len(wd.sent(log, dash, "update")) == n + 1
    finally:
        dash.close()
        shadow.stop()


def test_reading_the_history_keeps_to_its_share_of_a_core():
    torch = ModelTorch(total=GiB)
    shadow = attach(torch, interval=0.01, start=False)
    try:
        shadow.read_seconds = 0.2          # a slow read (a large ring on real PyTorch)
        assert shadow.next_wait() == pytest.approx(1.4)   # 7 x the read: 1/8 of a core
        shadow.read_seconds = 0.0001
        assert shadow.next_wait() == 0.01                 # the interval asked
        assert "history read" in shadow.live_note(0)
    finally:
        shadow.stop()
    assert shadow.live_note(0).startswith("shadow mode stopped")


def test_the_refresh_thread_follows_a_job_in_another_thread():
    torch = ModelTorch(total=4 * GiB)
    shadow = attach(torch, interval=0.01)
    try:
        job = threading.Thread(target=_workload, args=(torch, 40))
        job.start()
        job.join()
        shadow._wake.set()
        import time

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (shadow.refreshes > 1 and
                                                     _same(shadow, torch)):
            time.sleep(0.02)
        assert _same(shadow, torch) and shadow.refreshes > 1 and not shadow.errors
    finally:
        shadow.stop()
    assert not shadow.running


def test_attach_refuses_what_it_cannot_follow():
    from torch_standin import StandInTorch

    with pytest.raises(ConfigError, match="no CUDA device"):
        attach(StandInTorch(available=False))
    with pytest.raises(ConfigError, match="no CUDA device 3"):
        attach(ModelTorch(), devices=3)
    with pytest.raises(ConfigError, match="history must be"):
        attach(ModelTorch(), history=0)
    assert gpudash.torch.attach is attach


def test_the_magic_attaches_and_shows_the_dashboard(monkeypatch):
    pytest.importorskip("anywidget")
    from IPython.testing import globalipapp

    import gpudash.torch_shadow as ts

    torch = ModelTorch(total=GiB)
    monkeypatch.setattr(ts, "attach", lambda module=None, **kw: attach(torch, interval=0))
    globalipapp.start_ipython()
    ip = globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "gpudash")
    try:
        dash = ip.run_line_magic("gpudash", "--attach torch --fraction 0.5")
        assert torch.cuda.get_per_process_memory_fraction(0) == 0.5
        assert dash.model.session.devices[0].index == 0
        from IPython.core.error import UsageError

        with pytest.raises(UsageError, match="--attach follows a PyTorch job"):
            ip.run_line_magic("gpudash", "--attach jax")
        with pytest.raises(UsageError, match="do not go with it"):
            ip.run_line_magic("gpudash", "--attach torch --allocator torch")
    finally:
        ip.run_line_magic("unload_ext", "gpudash")
    assert torch.history[-1]["enabled"] is None


@pytest.mark.gpu
def test_shadow_follows_real_pytorch_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for PyTorch")
    shadow = attach(interval=0)
    try:
        xs = [torch.empty(n * (1 << 20), dtype=torch.uint8, device="cuda") for n in (1, 3, 30)]
        del xs[1]
        shadow.refresh()
        assert shadow.devices[0].exact
    finally:
        shadow.stop()
