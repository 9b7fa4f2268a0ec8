"""Install mode: the C functions gpudash._core exports for PyTorch's CUDAPluggableAllocator,
called through ctypes as PyTorch's loader calls them, over host memory; held to the Python
model of PyTorch's caching allocator (gpudash.caching) call for call; install() against the
torch stand-in. The GPU run is marked ``gpu``."""

from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
import threading
from types import SimpleNamespace

import pytest

from gpudash import ConfigError
from gpudash._units import format_bytes
from gpudash.bfc import BFCAllocator
from gpudash.caching import CachingAllocator

core = pytest.importorskip("gpudash._core")
if not hasattr(core, "pluggable_setup"):  # pragma: no cover - an old build
    pytest.skip("gpudash._core was built without install mode", allow_module_level=True)

from gpudash import torch_install  # noqa: E402
from gpudash.testing import InstalledSegments, installed_segments  # noqa: E402
from torch_standin import StandInTorch  # noqa: E402

pytestmark = pytest.mark.core

MiB = 1 << 20
TOTAL = 512 * MiB


def _lib() -> ctypes.CDLL:
    return torch_install.load_hooks()


def _free_everything() -> None:
    lib = _lib()
    for dev in range(2):
        for ptr, size, _req, stream, _pool, allocated, _head, _aid in \
                core.pluggable_state(dev)["blocks"]:
            if allocated:
                lib.gpudash_torch_free(ptr, size, dev, stream)
    core.pluggable_empty_cache(-1)


@pytest.fixture
def lib():
    _free_everything()
    core.pluggable_setup("host", total=TOTAL, on_oom="null")
    lib = _lib()
    lib.gpudash_torch_init(2)
    yield lib
    torch_install._reset_for_tests()
    _free_everything()


def _stats(dev: int = 0) -> dict:
    return torch_install.InstalledAllocator(None, core, 2, None).memory_stats(dev)


_Replaying = InstalledSegments       # the Python model's device: the core's segments
_heads = installed_segments


# ------------------------------------------------------------------------------ the symbols
def test_the_hooks_are_exported_and_ctypes_finds_them():
    lib = ctypes.CDLL(core.__file__)
    for hook, name in core.PLUGGABLE_SYMBOLS.items():
        assert ctypes.cast(getattr(lib, name), ctypes.c_void_p).value, hook
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm here")
    out = subprocess.run([nm, "-D", "--defined-only", core.__file__], capture_output=True,
                         text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if " T " in line}
    assert set(core.PLUGGABLE_SYMBOLS.values()) <= exported


# ------------------------------------------------------------------------------ differential
@pytest.mark.parametrize("conf, fraction", [(None, None), ("max_split_size_mb:40", None),
                                            (None, 0.25)])
def test_same_addresses_and_statistics_as_the_python_model(lib, conf, fraction):
    if conf:
        core.pluggable_settings(0, max_split_size=40 * MiB)
    if fraction:
        lib.gpudash_torch_memory_fraction(fraction, 0)
    sub = _Replaying(TOTAL)
    model = CachingAllocator(sub, conf, fraction=fraction)
    rng = random.Random(36)
    live: list[tuple[int, int, int]] = []
    sizes = [1, 500, 512, 4000, 100_000, 1 * MiB, 1 * MiB + 1, 3 * MiB, 9 * MiB, 12 * MiB,
             25 * MiB, 45 * MiB, 70 * MiB]
    streams = [0, 0, 0, 0x7000]
    ooms = 0
    for step in range(1500):
        if live and (rng.random() < 0.45 or len(live) > 60):
            ptr, n, stream = live.pop(rng.randrange(len(live)))
            lib.gpudash_torch_free(ptr, n, 0, stream)
            model.deallocate(ptr)
        elif step % 311 == 310:
            lib.gpudash_torch_reset()
            model.empty_cache()
        else:
            n = rng.choice(sizes) + rng.randrange(0, 3000)
            stream = rng.choice(streams)
            got = lib.gpudash_torch_malloc(n, 0, stream or None) or 0
            want = model.try_allocate(n, stream=stream)
            assert got == want, f"step {step}: {n} bytes on stream {stream:#x}"
            if got:
                live.append((got, n, stream))
            else:
                ooms += 1
        assert sub.live == _heads()
    assert _stats() == model.memory_stats()
    if fraction:
        assert ooms and _stats()["num_ooms"] == ooms
    for ptr, n, stream in live:
        lib.gpudash_torch_free(ptr, n, 0, stream)
        model.deallocate(ptr)
    lib.gpudash_torch_reset()
    model.empty_cache()
    assert _stats() == model.memory_stats()
    assert core.pluggable_state(0)["reserved"] == 0


def test_tens_of_thousands_of_blocks_as_the_python_model_has_them(lib):
    """The block records grow by doubling and move when they do: a split made as they move
    reads the block again from the moved records (it read the freed ones and crashed past
    8,192 blocks). 40,000 live blocks, the same addresses as the Python model, and the
    dashboard's columns equal to the rows."""
    import numpy as np

    model = CachingAllocator(_Replaying(TOTAL))
    live = []
    for i in range(40_000):
        n = 512 * (1 + i % 31)
        got = lib.gpudash_torch_malloc(n, 0, None)
        assert got and got == model.try_allocate(n), i
        live.append((got, n))
    rows = core.pluggable_state(0)["blocks"]
    cols = core.pluggable_state(0, "columns")["blocks"]
    assert len(rows) > 40_000
    for k, name in enumerate(("ptr", "size", "requested", "stream", "pool", "allocated",
                              "head", "aid")):
        assert np.array_equal(cols[name], np.array([r[k] for r in rows])), name
    assert core.pluggable_state(0, None)["blocks"] is None
    assert _stats() == model.memory_stats()
    for ptr, n in live[::2]:
        lib.gpudash_torch_free(ptr, n, 0, None)
        model.deallocate(ptr)
    assert _stats() == model.memory_stats()
    for ptr, n in live[1::2]:
        lib.gpudash_torch_free(ptr, n, 0, None)
        model.deallocate(ptr)
    lib.gpudash_torch_reset()
    assert core.pluggable_state(0)["reserved"] == 0
    with pytest.raises(ValueError, match="blocks must be"):
        core.pluggable_state(0, "tuples")


def test_a_live_max_split_that_would_free_a_segment_in_use_is_refused(lib):
    """Install mode is PyTorch's allocator for real memory: a max_split_size_mb lowered live
    below a split segment's free run would let it release that segment while a block in
    it is in use. Refused, saying why, nothing changed; a safe value goes."""
    torch = _standin()
    handle = torch_install.install(torch=torch, backend="host", total=TOTAL, on_oom="null",
                                   quiet=True)
    lib = _lib()
    a = lib.gpudash_torch_malloc(int(30.5 * MiB), 0, None)
    b = lib.gpudash_torch_malloc(int(1.2 * MiB), 0, None)
    lib.gpudash_torch_free(a, int(30.5 * MiB), 0, None)
    with pytest.raises(ConfigError, match=r"cuda:0: max_split_size_mb:21 live is not safe "
                                          r"now: 1 split segment\(s\)"):
        handle.set_allocator_settings("max_split_size_mb:21")
    assert torch.cuda.memory_stats()["max_split_size"] == -1
    feed = handle.feed(0)
    with pytest.raises(ConfigError, match="not safe now"):
        feed.configure(max_split_size_mb=30)
    handle.set_allocator_settings("max_split_size_mb:40")
    assert torch.cuda.memory_stats()["max_split_size"] == 40 * MiB
    lib.gpudash_torch_free(b, int(1.2 * MiB), 0, None)
    lib.gpudash_torch_reset()
    handle.set_allocator_settings("max_split_size_mb:21")    # no segment left: safe
    assert torch.cuda.memory_stats()["max_split_size"] == 21 * MiB
    handle.uninstall()


def test_free_of_an_unknown_pointer_changes_nothing(lib, capfd):
    p = lib.gpudash_torch_malloc(1000, 0, None)
    before = _stats()
    lib.gpudash_torch_free(p + 512, 1000, 0, None)
    assert _stats() == before
    assert "not a live block" in capfd.readouterr().err
    lib.gpudash_torch_free(p, 1000, 0, None)
    lib.gpudash_torch_free(p, 1000, 0, None)   # a double free: refused, said
    assert "not a live block" in capfd.readouterr().err
    assert _stats()["allocation.all.current"] == 0


def test_oom_returns_null_and_is_recorded(lib, capfd):
    lib.gpudash_torch_memory_fraction(0.1, 0)    # 51.2 MiB
    assert lib.gpudash_torch_malloc(40 * MiB, 0, None)
    assert lib.gpudash_torch_malloc(40 * MiB, 0, None) is None
    s = core.pluggable_state(0)
    assert s["num_ooms"] == 1 and s["ooms"][0][1:] == (40 * MiB, 40 * MiB)
    assert "out of memory on cuda:0" in capfd.readouterr().err
    assert lib.gpudash_torch_malloc(0, 0, None) is None   # size 0: no memory, no OOM
    assert core.pluggable_state(0)["num_ooms"] == 1


def test_base_alloc_record_stream_and_devices(lib):
    a = lib.gpudash_torch_malloc(1000, 0, None)
    b = lib.gpudash_torch_malloc(3000, 0, None)
    size = ctypes.c_size_t(0)
    assert lib.gpudash_torch_base_alloc(b, ctypes.byref(size)) == a
    assert size.value == 2 * MiB
    other = 0x1234
    lib.gpudash_torch_record_stream(b, other)
    lib.gpudash_torch_free(b, 3000, 0, None)
    assert core.pluggable_state(0)["stream_waits"] == 1
    c = lib.gpudash_torch_malloc(5000, 1, None)     # another device: its own state
    assert core.pluggable_state(1)["stats"]["allocation"][0] == 1
    assert core.pluggable_state(0)["stats"]["allocation"][0] == 1
    lib.gpudash_torch_free(c, 5000, 1, None)
    lib.gpudash_torch_free(a, 1000, 0, None)


def test_threads_allocate_without_the_gil(lib):
    """ctypes releases the GIL around each call: eight threads run the C entry points at
    once, each writing its own byte into its blocks and checking it is still there."""
    errors: list[str] = []

    def work(k: int) -> None:
        rng = random.Random(k)
        mine: list[tuple[int, int]] = []
        for _ in range(1500):
            if mine and rng.random() < 0.5:
                p, n = mine.pop(rng.randrange(len(mine)))
                if ctypes.string_at(p, min(n, 64)) != bytes([k]) * min(n, 64):
                    errors.append(f"thread {k}: block {p:#x} was overwritten")
                lib.gpudash_torch_free(p, n, 0, None)
            else:
                n = rng.choice([64, 700, 5000, 200_000, 3 * MiB])
                p = lib.gpudash_torch_malloc(n, 0, None)
                if not p:
                    errors.append(f"thread {k}: out of memory")
                    continue
                ctypes.memset(p, k, min(n, 64))
                mine.append((p, n))
        for p, n in mine:
            lib.gpudash_torch_free(p, n, 0, None)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = core.pluggable_state(0)
    assert s["stats"]["allocation"][0] == 0 and s["stats"]["allocated_bytes"][0] == 0
    assert s["allocs"] == s["frees"]
    # every segment is whole again: one free block each
    assert all(head and not used for *_x, used, head, _aid in s["blocks"])
    assert sum(size for _p, size, *_r in s["blocks"]) == s["reserved"]


# ------------------------------------------------------------------------------ install()
def _standin(initialized: bool = False, devices: int = 1) -> StandInTorch:
    torch = StandInTorch(devices=devices)
    made = []
    torch.cuda.is_initialized = lambda: initialized
    torch.cuda.memory = SimpleNamespace(
        CUDAPluggableAllocator=lambda path, a, f: made.append((path, a, f)) or (path, a, f),
        change_current_allocator=lambda alloc: made.append(("changed", alloc)),
        memory_stats=lambda device=None: {"theirs": 1},
        _snapshot=lambda mempool_id=None: {"theirs": 1})
    torch.made = made
    return torch


def test_install_too_late_says_so():
    for allocator in ("torch", "bfc"):
        torch = _standin(initialized=True)
        with pytest.raises(ConfigError, match="too late: CUDA is already initialised"):
            torch_install.install(allocator, torch=torch, backend="host", quiet=True)
        assert torch.made == []
    with pytest.raises(ConfigError, match="max_split_size_mb is PyTorch's"):
        torch_install.install("bfc", max_split_size_mb=64, torch=_standin(), backend="host",
                              quiet=True)
    with pytest.raises(ConfigError, match="the BFC's options"):
        torch_install.install("torch", allow_growth=False, torch=_standin(), backend="host",
                              quiet=True)
    with pytest.raises(ConfigError, match="'torch' or 'bfc'"):
        torch_install.install("cuda_malloc_async", torch=_standin(), backend="host",
                              quiet=True)


def test_install_routes_stats_snapshot_and_controls(lib):
    torch = _standin()
    theirs = torch.cuda.memory.memory_stats
    with pytest.warns(UserWarning, match="CUDA graphs.*CUDA IPC.*cuDNN benchmark"):
        handle = torch_install.install(torch=torch, backend="host", total=TOTAL,
                                       on_oom="null")
    assert torch.made[0] == (core.__file__, "gpudash_torch_malloc", "gpudash_torch_free")
    lib = _lib()
    sub = _Replaying(TOTAL)
    model = CachingAllocator(sub)
    ptrs = []
    for n in (1000, 5 * MiB, 30 * MiB):
        p = lib.gpudash_torch_malloc(n, 0, None)
        assert model.allocate(n) == p
        ptrs.append((p, n))
    lib.gpudash_torch_free(ptrs[1][0], ptrs[1][1], 0, None)
    model.deallocate(ptrs[1][0])
    for space in (torch.cuda, torch.cuda.memory):
        assert space.memory_stats() == model.memory_stats()
    snap = torch.cuda.memory._snapshot()
    assert snap["segments"] == model.snapshot()["segments"]
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    # the controls act on the real allocator
    torch.cuda.set_per_process_memory_fraction(0.5)
    assert core.pluggable_state(0)["allowed"] == TOTAL // 2
    assert torch.cuda.get_per_process_memory_fraction(0) == 0.5
    torch.cuda.empty_cache()
    model.empty_cache()
    assert torch.cuda.memory_stats() == model.memory_stats()
    feed = handle.feed(0)
    sample = feed.sample()
    assert sample.stats.bytes_in_use == 1024 + 30 * MiB
    assert sample.table["ptr"].tolist() == model.chunk_table()["ptr"].tolist()
    assert sample.table["regions"].tolist() == model.chunk_table()["regions"].tolist()
    feed.configure(per_process_gpu_memory_fraction=0.2)
    assert core.pluggable_state(0)["allowed"] == int(0.2 * TOTAL)
    assert feed.sample().settings[0][1:] == ("fraction", 0.5, 0.2)
    with pytest.raises(ConfigError, match="always grows"):
        feed.configure(allow_growth=False)
    handle.set_allocator_settings("max_split_size_mb:64")
    assert torch.cuda.memory_stats()["max_split_size"] == 64 * MiB
    handle.set_allocator_settings("")          # what the string leaves out: default
    assert torch.cuda.memory_stats()["max_split_size"] == -1
    with pytest.raises(ConfigError, match="expandable_segments"):
        handle.set_allocator_settings("expandable_segments:True")
    with pytest.raises(ConfigError, match="already installed"):
        torch_install.install(torch=torch, backend="host", quiet=True)
    handle.uninstall()
    assert torch.cuda.memory.memory_stats is theirs
    assert torch.cuda.memory.memory_stats() == {"theirs": 1}
    assert "_snapshot" not in vars(torch.cuda)      # the stand-in's own method again
    for p, n in (ptrs[0], ptrs[2]):
        lib.gpudash_torch_free(p, n, 0, None)


def test_the_dashboard_acts_on_the_installed_allocator_in_pytorch_s_words(lib):
    """install mode's dashboard: PyTorch's model, layout and controls; each control acts on
    the C allocator live and answers in PyTorch's words; what install mode cannot apply
    (expandable_segments, garbage_collection_threshold) is refused with nothing changed."""
    pytest.importorskip("anywidget")
    from gpudash.models import TORCH

    torch = _standin()
    handle = torch_install.install(torch=torch, backend="host", total=TOTAL, on_oom="null",
                                   quiet=True)
    lib = _lib()
    model = CachingAllocator(_Replaying(TOTAL))
    ptrs = []
    for n in (1000, 5 * MiB, 30 * MiB, 7 * MiB):
        p = lib.gpudash_torch_malloc(n, 0, None)
        assert model.allocate(n) == p
        ptrs.append((p, n))
    lib.gpudash_torch_free(ptrs[1][0], ptrs[1][1], 0, None)
    model.deallocate(ptrs[1][0])
    dash = handle.dashboard(rate_hz=4.0)
    try:
        live = dash.model
        assert live.model(0) is TORCH and live.controls_disabled(0) is None
        info = dash._controls_info(0)
        assert info["model"]["name"] == "torch"
        assert [c["name"] for c in info["model"]["controls"]] == \
            [c.name for c in TORCH.controls]
        assert info["settings"]["conf"] == "" and info["settings"]["max_split_size_mb"] is None
        # what install mode cannot apply is drawn disabled, with the reason act() gives
        assert sorted(info["unavailable"]) == ["expandable", "gc"]
        assert "does not model expandable_segments" in info["unavailable"]["expandable"]
        state = live.refresh_now(force=True)[0]
        assert state.table["ptr"].tolist() == model.chunk_table()["ptr"].tolist()
        # the fraction: the C allocator's limit, PyTorch's words
        answer = live.act(0, "fraction", 0.25)
        assert core.pluggable_state(0)["allowed"] == TOTAL // 4
        assert answer["text"].startswith("fraction 0.250: limit 128.00 MiB "
                                         "(torch.cuda.set_per_process_memory_fraction(0.25)")
        # max_split_size_mb: the whole settings string, as PyTorch writes it
        answer = live.act(0, "max_split", 64)
        assert torch.cuda.memory_stats()["max_split_size"] == 64 * MiB
        assert "blocks of 64 MiB or more are not split" in answer["text"]
        assert "_set_allocator_settings('max_split_size_mb:64')" in answer["text"]
        model.set_memory_fraction(0.25)
        model.set_allocator_settings("max_split_size_mb:64")
        # refused, saying why; nothing changes
        before = core.pluggable_state(0)
        with pytest.raises(ConfigError, match="does not model expandable_segments"):
            live.act(0, "expandable", True)
        with pytest.raises(ConfigError, match="does not model garbage_collection_threshold"):
            live.act(0, "gc", 0.6)
        with pytest.raises(ConfigError, match="max_split_size_mb"):
            live.act(0, "max_split", 10)        # PyTorch's rule: > 20
        after = core.pluggable_state(0)
        assert (after["allowed"], after["max_split_size"]) == \
            (before["allowed"], before["max_split_size"])
        # the same control from the browser: refused in words, not a traceback
        replies = []
        dash._post = lambda kind, content, *a: replies.append((kind, content))
        dash._on_msg(None, {"type": "action", "id": 7, "name": "expandable", "value": True},
                     [])
        kind, reply = replies[-1]
        assert kind == "reply" and reply["ok"] is False and \
            "does not model expandable_segments" in reply["text"]
        # empty cache: wholly free segments back, the bytes said
        lib.gpudash_torch_free(ptrs[3][0], ptrs[3][1], 0, None)
        model.deallocate(ptrs[3][0])
        answer = live.act(0, "empty_cache")
        held = model.memory_stats()["reserved_bytes.all.current"]
        model.empty_cache()
        freed = held - model.memory_stats()["reserved_bytes.all.current"]
        assert freed > 0 and answer["text"].startswith(
            f"empty_cache(): returned {format_bytes(freed)}")
        assert torch.cuda.memory_stats() == model.memory_stats()
        # the timeline's marks: what changed, old and new, in the order it changed
        marks = [(m.setting, m.old, m.new) for m in live.refresh_now(force=True)[0].settings]
        assert marks == [("fraction", None, 0.25), ("max_split_size_mb", None, 64)], marks
    finally:
        dash.close()
    for p, n in (ptrs[0], ptrs[2]):
        lib.gpudash_torch_free(p, n, 0, None)
    # uninstalled: no dashboard to follow, said so
    handle.uninstall()
    with pytest.raises(ConfigError, match="given back to PyTorch"):
        handle.dashboard()


def test_the_installed_dashboard_has_a_device_picker_and_acts_on_the_device_shown(lib):
    """One feed per GPU, one device picker: each device's blocks, and a control acts on the
    device it is given, not the others."""
    pytest.importorskip("anywidget")
    torch = _standin(devices=2)
    handle = torch_install.install(torch=torch, backend="host", total=TOTAL, on_oom="null",
                                   quiet=True)
    lib = _lib()
    p0 = lib.gpudash_torch_malloc(3 * MiB, 0, None)
    p1 = lib.gpudash_torch_malloc(5 * MiB, 1, None)
    dash = handle.dashboard(device=1)
    try:
        live = dash.model
        assert live.num_devices == 2 and dash.device == 1
        assert [n.split(" ")[0] for n in live.device_names] == ["cuda:0", "cuda:1"]
        states = live.refresh_now(force=True)
        assert p1 in states[1].table["ptr"].tolist() and p1 not in states[0].table["ptr"]
        assert p0 in states[0].table["ptr"].tolist()
        live.act(1, "fraction", 0.5)
        assert core.pluggable_state(1)["allowed"] == TOTAL // 2
        assert core.pluggable_state(0)["allowed"] is None
        dash.device = 0
        assert dash._controls_info(0)["settings"]["fraction"] is None
    finally:
        dash.close()
        lib.gpudash_torch_free(p0, 3 * MiB, 0, None)
        lib.gpudash_torch_free(p1, 5 * MiB, 1, None)
        handle.uninstall()


def test_shadow_mode_and_the_magic_know_install_mode_is_on(lib):
    pytest.importorskip("anywidget")
    from IPython.core.error import UsageError
    from IPython.testing import globalipapp

    from gpudash.torch_shadow import attach

    torch = _standin()
    handle = torch_install.install(torch=torch, backend="host", total=TOTAL, on_oom="null",
                                   quiet=True)
    with pytest.raises(ConfigError, match="does not support recordHistory"):
        attach(torch)
    import gpudash.torch

    assert gpudash.torch.installed() is handle     # the error's way to the dashboard
    globalipapp.start_ipython()
    ip = globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "gpudash")
    try:
        dash = ip.run_line_magic("gpudash", "--attach torch --fraction 0.5")
        try:
            assert core.pluggable_state(0)["allowed"] == TOTAL // 2
            assert dash.model.model(0).name == "torch"
            assert "gpudash installed" in dash.model.device_names[0]
        finally:
            dash.close()
        with pytest.raises(UsageError, match=r"device must be an index in 0\.\.0"):
            ip.run_line_magic("gpudash", "--attach torch --device 5")
    finally:
        ip.run_line_magic("unload_ext", "gpudash")
        handle.uninstall()


# ------------------------------------------------------------------------------ the BFC
def _bfc_setup(growth: bool = True, gc: bool = False, host_total: int = TOTAL) -> ctypes.CDLL:
    _free_everything()
    core.pluggable_setup("host", total=host_total, on_oom="null", allocator="bfc",
                         allow_growth=growth, garbage_collection=gc)
    lib = _lib()
    lib.gpudash_torch_init(2)
    return lib


@pytest.fixture
def bfc_after():
    yield
    torch_install._reset_for_tests()
    _free_everything()
    core.pluggable_setup("host", total=TOTAL, on_oom="null")   # the caching allocator again


def _torch_figures(table: dict) -> dict[str, int]:
    """The current values PyTorch's keys must show for a BFC state (its chunk table):
    regions are segments, chunks are blocks, a free chunk of a region that holds more than
    one is an inactive split; all in the large pool."""
    size, used, region = table["size"], table["in_use"], table["region"]
    chunks_in = {r: int((region == r).sum()) for r in set(region.tolist())}
    split_free = [not u and chunks_in[r] > 1 for u, r in zip(used.tolist(), region.tolist())]
    return {
        "allocation": int(used.sum()), "segment": len(table["regions"]),
        "inactive_split": sum(split_free),
        "allocated_bytes": int(size[used].sum()),
        "reserved_bytes": int(table["regions"][:, 1].sum()) if len(table["regions"]) else 0,
        "inactive_split_bytes": int(sum(z for z, f in zip(size.tolist(), split_free) if f)),
        "requested_bytes": int(table["requested"][used].sum()),
    }


def _check_bfc_against(model: BFCAllocator, peaks: dict | None) -> None:
    """The C core's state is the model's: every chunk (address, size, requested, id, in
    use, region), the BFC's statistics, and memory_stats() in PyTorch's keys."""
    s = core.pluggable_state(0)
    t = model.chunk_table()
    rows = s["blocks"]
    heads, region = [], 0
    for r in rows:
        if r[6]:
            region = r[0]
        heads.append(region)
    assert [r[0] for r in rows] == t["ptr"].tolist()
    assert [r[1] for r in rows] == t["size"].tolist()
    assert [r[2] if r[5] else 0 for r in rows] == t["requested"].tolist()
    assert [r[7] for r in rows] == t["alloc_id"].tolist()
    assert heads == t["region"].tolist()
    st = model.stats()
    b = s["bfc"]
    assert (b["num_allocs"], b["largest_alloc_size"], b["memory_limit"]) == (
        st.num_allocs, st.largest_alloc_size, st.bytes_limit)
    assert (s["stats"]["allocated_bytes"][0], s["stats"]["allocated_bytes"][1]) == (
        st.bytes_in_use, st.peak_bytes_in_use)
    assert (s["reserved"], s["peak_reserved"]) == (st.pool_bytes, st.peak_pool_bytes)
    assert b["curr_region_allocation_bytes"] == model.curr_region_allocation_bytes
    assert b["pool_over_limit"] == model.pool_over_limit
    stats = _stats()
    for name, value in _torch_figures(t).items():
        if peaks is not None:
            peaks[name] = max(peaks.get(name, value), value)
        for pool, want in (("all", value), ("large_pool", value), ("small_pool", 0)):
            assert stats[f"{name}.{pool}.current"] == want, (name, pool)
        if peaks is not None:
            assert stats[f"{name}.all.peak"] == peaks[name], name
    assert stats["active_bytes.all.current"] == st.bytes_in_use
    assert stats["allocation.all.allocated"] == st.num_allocs


@pytest.mark.parametrize("growth, gc, host_total, limit", [
    (True, False, TOTAL, TOTAL),                 # growth: 2 MiB regions doubling
    (False, False, TOTAL, 300 * MiB),            # one region of the whole limit
    (True, True, TOTAL, 200 * MiB),              # garbage collection before an OOM
    (False, False, 200 * MiB, 256 * MiB),        # the device refuses: the backpedal
])
def test_bfc_same_addresses_statistics_and_ooms_as_the_python_model(bfc_after, capfd, growth,
                                                                   gc, host_total, limit):
    """PyTorch's calls on the BFC through the C hooks (ctypes, as PyTorch's loader calls
    them), and the same calls on gpudash.bfc.BFCAllocator over the same regions: the same
    addresses (so the same offsets in the same regions), chunks, ids, statistics and OOMs,
    through live changes of the limit (the fraction hook too) and of growth, and
    empty_cache."""
    lib = _bfc_setup(growth, gc, host_total)
    core.pluggable_settings(0, memory_limit=limit)
    sub = _Replaying(host_total)
    model = BFCAllocator(sub, limit, allow_growth=growth, garbage_collection=gc)
    rng = random.Random(36 + growth + 2 * gc)
    live: list[tuple[int, int]] = []
    sizes = [1, 200, 256, 1000, 4000, 100_000, 1 * MiB, 3 * MiB, 9 * MiB, 25 * MiB,
             70 * MiB, 140 * MiB]
    weights = [6, 6, 3, 6, 6, 5, 4, 4, 3, 2, 1, 1]
    ooms, peaks, seen = [], {}, set()
    first_growth = growth
    for step in range(1200):
        if live and (rng.random() < 0.45 or len(live) > 40):
            ptr, n = live.pop(rng.randrange(len(live)))
            lib.gpudash_torch_free(ptr, n, 0, None)
            model.deallocate(ptr)
        elif step % 251 == 250:
            lib.gpudash_torch_reset()                    # torch.cuda.empty_cache()
            model.release_free_regions()
        elif step % 199 == 198:                          # the limit, live, down or up
            new = rng.choice([limit // 4, limit // 2, limit])
            core.pluggable_settings(0, memory_limit=new)
            model.set_memory_limit(new)
        elif step % 307 == 306:
            lib.gpudash_torch_memory_fraction(0.3, 0)    # the fraction hook: a limit
            model.set_memory_limit(int(0.3 * host_total))
        elif step % 401 == 400:
            growth = not growth
            core.pluggable_settings(0, allow_growth=growth)
            model.set_allow_growth(growth)
        else:
            n = rng.choices(sizes, weights)[0] + rng.randrange(0, 3000)
            got = lib.gpudash_torch_malloc(n, 0, None) or 0
            want = model.try_allocate(n)
            assert got == want, f"step {step}: {n} bytes"
            if got:
                live.append((got, n))
            else:
                ooms.append(((n + 255) & ~255, n))
        assert sub.live == _heads(), f"step {step}"
        seen |= set(sub.live.values())
        if step % 10 == 0 or not live:
            _check_bfc_against(model, peaks)
        else:    # the peaks PyTorch's keys must show: every step's state counts
            for name, value in _torch_figures(model.chunk_table()).items():
                peaks[name] = max(peaks.get(name, value), value)
    _check_bfc_against(model, peaks)
    s = core.pluggable_state(0)
    assert ooms and s["num_ooms"] == len(ooms)
    assert [o[1:] for o in s["ooms"]] == ooms[-64:]
    if gc:      # the run went through DeallocateFreeRegions
        assert "garbage collection" in capfd.readouterr().err
    if limit > host_total and not first_growth:
        # the first region (the whole limit) was refused: regions were cut by 0.9
        assert seen and max(seen) < host_total
    for ptr, n in live:
        lib.gpudash_torch_free(ptr, n, 0, None)
        model.deallocate(ptr)
    lib.gpudash_torch_reset()
    model.release_free_regions()
    _check_bfc_against(model, peaks)
    assert core.pluggable_state(0)["reserved"] == 0


def test_bfc_tens_of_thousands_of_chunks_as_the_python_model_has_them(bfc_after):
    """The BFC's chunk records past several doublings (the records move): 40,000 live
    chunks at the Python model's addresses, its statistics, the columns equal to the rows."""
    import numpy as np

    lib = _bfc_setup(True, False, TOTAL)
    core.pluggable_settings(0, memory_limit=TOTAL)
    model = BFCAllocator(_Replaying(TOTAL), TOTAL, allow_growth=True)
    live = []
    for i in range(40_000):
        n = 256 * (1 + i % 31)
        got = lib.gpudash_torch_malloc(n, 0, None)
        assert got and got == model.allocate(n), i
        live.append((got, n))
    rows = core.pluggable_state(0)["blocks"]
    cols = core.pluggable_state(0, "columns")["blocks"]
    assert len(rows) > 40_000 and np.array_equal(cols["aid"], [r[7] for r in rows])
    assert np.array_equal(cols["ptr"], [r[0] for r in rows])
    t = model.chunk_table()
    assert cols["ptr"].tolist() == t["ptr"].tolist()
    assert cols["aid"].tolist() == t["alloc_id"].tolist()
    for ptr, n in live:
        lib.gpudash_torch_free(ptr, n, 0, None)
        model.deallocate(ptr)
    assert core.pluggable_state(0)["stats"]["allocated_bytes"][0] == 0
    lib.gpudash_torch_reset()                      # empty_cache: every region back
    assert core.pluggable_state(0)["reserved"] == 0


def test_bfc_growth_regions_double_and_growth_off_takes_the_limit(bfc_after):
    lib = _bfc_setup(growth=True)
    core.pluggable_settings(0, memory_limit=TOTAL)
    ptrs = [lib.gpudash_torch_malloc(4 * MiB, 0, None) for _ in range(16)]
    assert all(ptrs)
    # TensorFlow's doubling with a 512 MiB limit and 4 MiB requests: 4, 4, 8, 16, 32 MiB
    # regions hold 1 + 1 + 2 + 4 + 8 of them
    assert sorted(_heads().values()) == [4 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB]
    assert core.pluggable_state(0)["bfc"]["curr_region_allocation_bytes"] == 64 * MiB
    for p in ptrs:
        lib.gpudash_torch_free(p, 4 * MiB, 0, None)
    lib = _bfc_setup(growth=False)
    core.pluggable_settings(0, fraction=0.5)
    p = lib.gpudash_torch_malloc(1000, 0, None)
    assert list(_heads().values()) == [TOTAL // 2]
    assert _stats()["reserved_bytes.all.current"] == TOTAL // 2
    lib.gpudash_torch_free(p, 1000, 0, None)


def test_bfc_threads_allocate_without_the_gil(bfc_after):
    lib = _bfc_setup(growth=True)
    errors: list[str] = []

    def work(k: int) -> None:
        rng = random.Random(k)
        mine: list[tuple[int, int]] = []
        for _ in range(1200):
            if mine and rng.random() < 0.5:
                p, n = mine.pop(rng.randrange(len(mine)))
                if ctypes.string_at(p, min(n, 64)) != bytes([k]) * min(n, 64):
                    errors.append(f"thread {k}: block {p:#x} was overwritten")
                lib.gpudash_torch_free(p, n, 0, None)
            else:
                n = rng.choice([64, 700, 5000, 200_000, 3 * MiB])
                p = lib.gpudash_torch_malloc(n, 0, None)
                if not p:
                    errors.append(f"thread {k}: out of memory")
                    continue
                ctypes.memset(p, k, min(n, 64))
                mine.append((p, n))
        for p, n in mine:
            lib.gpudash_torch_free(p, n, 0, None)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = core.pluggable_state(0)
    assert s["stats"]["allocation"][0] == 0 and s["allocs"] == s["frees"]
    assert all(head and not used for *_x, used, head, _aid in s["blocks"])
    assert s["stats"]["inactive_split"][0] == 0


def test_install_bfc_routes_stats_snapshot_feed_and_controls(bfc_after):
    from gpudash.models import BFC
    from gpudash.live.model import LiveModel

    torch = _standin()
    with pytest.warns(UserWarning, match="BFC.*does not tell streams apart"):
        handle = torch_install.install("bfc", torch=torch, backend="host", total=TOTAL,
                                       on_oom="null", fraction=0.5, allow_growth=True)
    assert handle.allocator == "bfc"
    lib = _lib()
    sub = _Replaying(TOTAL)
    model = BFCAllocator(sub, TOTAL // 2)
    ptrs = []
    for n in (1000, 5 * MiB, 30 * MiB, 3 * MiB):
        p = lib.gpudash_torch_malloc(n, 0, None)
        assert model.allocate(n) == p
        ptrs.append((p, n))
    lib.gpudash_torch_free(ptrs[1][0], ptrs[1][1], 0, None)
    model.deallocate(ptrs[1][0])
    _check_bfc_against(model, None)
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] == model.stats().bytes_in_use
    assert stats["reserved_bytes.all.current"] == model.pool_bytes
    assert stats["max_split_size"] == -1
    snap = torch.cuda.memory._snapshot()
    t = model.chunk_table()
    assert [(seg["address"], seg["total_size"]) for seg in snap["segments"]] == \
        [tuple(r) for r in t["regions"].tolist()]
    assert [b["address"] for seg in snap["segments"] for b in seg["blocks"]] == \
        t["ptr"].tolist()
    assert snap["allocator_settings"]["memory_limit"] == TOTAL // 2
    assert torch.cuda.get_per_process_memory_fraction(0) == 0.5
    with pytest.raises(ConfigError, match="PyTorch's allocator settings do not apply"):
        handle.set_allocator_settings("max_split_size_mb:64")
    # the feed: the BFC's figures, its chunk table, live controls answered in words
    feed = handle.feed(0)
    sample = feed.sample()
    assert sample.stats.num_allocs == 4 and sample.stats.bytes_limit == TOTAL // 2
    for col in ("ptr", "size", "requested", "alloc_id", "bin", "region", "in_use"):
        assert sample.table[col].tolist() == t[col].tolist(), col
    assert sample.table["regions"].tolist() == t["regions"].tolist()
    live = LiveModel(feeds=[feed], start=False)
    try:
        assert live.controls_disabled(0) is None and live.model(0) is BFC
        assert list(live.unavailable_controls(0)) == ["deferred"]
        live.configure(0, per_process_gpu_memory_fraction=0.05)   # 25.6 MiB: below the pool
        model.set_memory_limit(int(0.05 * TOTAL))
        _check_bfc_against(model, None)
        assert core.pluggable_state(0)["bfc"]["pool_over_limit"]
        pending, held = model.pending_release()
        assert handle.pending_release(0) == (pending, held) and held >= 1
        answer = BFC.answer("fraction", 0.05, None, live.answer_facts(0))
        assert answer["text"] == "fraction 0.050: limit 25.60 MiB", answer
        assert f"{held} region(s) go back as they empty" in answer["warning"]
        # a capped pool refuses what would take bytes in use past the limit
        assert lib.gpudash_torch_malloc(20 * MiB, 0, None) is None
        assert model.try_allocate(20 * MiB) == 0
        live.configure(0, allow_growth=False)
        model.set_allow_growth(False)
        assert core.pluggable_state(0)["bfc"]["allow_growth"] is False
        assert BFC.answer("growth", False, None, live.answer_facts(0))["text"] == \
            "growth: off"
        assert [s[1:] for s in feed.sample().settings] == [("fraction", 0.5, 0.05),
                                                          ("allow_growth", True, False)]
        with pytest.raises(ConfigError, match="deferred_deletion_bytes does not apply"):
            live.configure(0, deferred_deletion_bytes=1 << 20)
        torch.cuda.set_per_process_memory_fraction(1.0)
        model.set_memory_limit(TOTAL)
        assert handle.pending_release(0) == (0, 0)
        for p, n in (ptrs[0], ptrs[2], ptrs[3]):
            lib.gpudash_torch_free(p, n, 0, None)
            model.deallocate(p)
        released = live.release_free_regions(0)
        assert released == model.release_free_regions() and released > 0
        _check_bfc_against(model, None)
    finally:
        live.close()
    handle.uninstall()


# ------------------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
def test_install_on_a_gpu_in_a_fresh_process(tmp_path):
    """A fresh interpreter installs before CUDA starts, trains a few steps, and reads the
    figures through torch.cuda.memory_stats()."""
    import sys

    script = tmp_path / "job.py"
    script.write_text(
        "import torch, gpudash.torch as gt\n"
        "h = gt.install(quiet=True)\n"
        "m = torch.nn.Linear(256, 256).cuda()\n"
        "x = torch.randn(64, 256, device='cuda')\n"
        "m(x).sum().backward()\n"
        "s = torch.cuda.memory_stats()\n"
        "assert s['allocated_bytes.all.current'] > 0, s\n"
        "assert torch.cuda.memory_allocated() == s['allocated_bytes.all.current']\n"
        "print('ok', s['reserved_bytes.all.current'])\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


# ------------------------------------------------------------------------------ the fuzz
@pytest.mark.parametrize("allocator", ["torch", "bfc"])
def test_the_fuzz_finds_no_difference_through_thousands_of_live_blocks(bfc_after, allocator):
    """benchmarks/fuzz_install.py, short: the hooks against the Python model through
    bursts of small blocks, frees, empty_cache, limits and settings changed live."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import fuzz_install

    assert fuzz_install.fuzz(allocator, 20_000, 5, check_every=500) == 20_000
