"""The IPython extension, driven through a real IPython shell."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp

import gpudash
from gpudash import session as session_mod
from gpudash._errors import GpudashWarning

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture()
def ip():
    globalipapp.start_ipython()  # once per process; later calls return None
    shell = globalipapp.get_ipython()
    session_mod.set_default_session(None)
    shell.run_line_magic("load_ext", "gpudash")
    yield shell
    shell.run_line_magic("unload_ext", "gpudash")
    sess = session_mod.default_session(create=False)
    if sess is not None:
        sess.close()
    session_mod.set_default_session(None)


def _session():
    return session_mod.default_session(create=False)


def test_load_registers_and_unload_removes_every_magic(ip):
    names = {"gpudash", "gpudash_config", "gpudash_cells"}
    assert names <= set(ip.magics_manager.magics["line"])
    assert "gpudash_track" in ip.magics_manager.magics["cell"]
    ip.run_line_magic("unload_ext", "gpudash")
    assert not names & set(ip.magics_manager.magics["line"])
    assert "gpudash_track" not in ip.magics_manager.magics["cell"]
    ip.run_line_magic("load_ext", "gpudash")  # the fixture unloads again


def test_gpudash_creates_a_simulated_session_and_a_dashboard(ip):
    dash = ip.run_line_magic("gpudash", "--simulate 8GiB --fraction 0.5")
    try:
        from gpudash.widgets import Dashboard

        assert isinstance(dash, Dashboard)
        sess = _session()
        assert sess.simulated
        assert sess.devices[0].total == 8 * GiB
        assert sess.devices[0].memory_limit == 4 * GiB
        sess.allocate(MiB)
        dash.model.refresh_now()
        # a second %gpudash reuses the session, applies the new fraction and shows the same
        # dashboard: its history (and the page's plotly.js) carry on
        dash2 = ip.run_line_magic("gpudash", "--fraction 0.25")
        assert _session() is sess
        assert sess.devices[0].memory_limit == 2 * GiB
        assert dash2 is dash and not dash.model.closed
        assert dash.model.state(0).counters["allocs"] == 1
        with pytest.raises(UsageError, match="--device must be in 0..0"):
            ip.run_line_magic("gpudash", "--device 4")
        # another session: a new dashboard, the old one closed
        sess.close()
        dash3 = ip.run_line_magic("gpudash", "--simulate 4GiB")
        assert dash3 is not dash and dash.model.closed and _session() is not sess
    finally:
        ip.run_line_magic("unload_ext", "gpudash")
        ip.run_line_magic("load_ext", "gpudash")


def test_gpudash_config_changes_the_live_session(ip, capsys):
    ip.run_line_magic("gpudash", "--simulate 8GiB --fraction 0.5 --growth")
    sess = _session()
    ip.run_line_magic("gpudash_config", "fraction=0.25 growth=false deferred=1MiB")
    dev = sess.devices[0]
    assert dev.memory_limit == 2 * GiB
    assert dev.allocator.allow_growth is False
    assert dev.allocator.pool_bytes == 2 * GiB  # growth off: preallocated
    assert dev._deferred.threshold == MiB
    assert "limit 2.00 GiB" in capsys.readouterr().out


@pytest.mark.parametrize("line, fragment", [
    ("fraction=-1", "per_process_gpu_memory_fraction"),
    ("fraction=abc", "must be a number"),
    ("growth=maybe", "allow_growth must be true or false"),
    ("deferred=-5", "deferred"),
    ("colour=blue", "key=value"),
    ("device=0", "nothing to change"),
    ("'fraction=0.3", "No closing quotation"),
    ("fraction=0.3 device=GPU:5", "device 5 does not exist"),
    ("fraction=inf", "per_process_gpu_memory_fraction"),
])
def test_gpudash_config_refuses_bad_values_and_changes_nothing(ip, line, fragment):
    ip.run_line_magic("gpudash", "--simulate 8GiB --fraction 0.5")
    sess = _session()
    before = sess.devices[0].memory_limit
    with pytest.raises(UsageError, match=fragment):
        ip.run_line_magic("gpudash_config", line)
    assert sess.devices[0].memory_limit == before


def test_gpudash_config_reports_every_bad_value_and_changes_nothing(ip):
    ip.run_line_magic("gpudash", "--simulate 8GiB --fraction 0.5")
    dev = _session().devices[0]
    before = (dev.memory_limit, dev.allocator.allow_growth, dev._deferred.threshold)
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("gpudash_config", "fraction=0.25 growth=maybe deferred=-5 colour=x")
    text = str(info.value)
    assert text.startswith("%gpudash_config changed nothing:")
    for part in ("allow_growth must be true or false", "deferred_deletion_bytes",
                 "'colour=x' is not key=value"):
        assert part in text
    # the good value in the same line was not applied either
    assert (dev.memory_limit, dev.allocator.allow_growth, dev._deferred.threshold) == before


def test_gpudash_config_without_arguments_shows_the_settings(ip, capsys):
    ip.run_line_magic("gpudash", "--simulate 8GiB --fraction 0.5 --growth")
    capsys.readouterr()
    ip.run_line_magic("gpudash_config", "")
    out = capsys.readouterr().out
    assert out.strip() == ("gpudash: /device:GPU:0 fraction=0.5, limit 4.00 GiB, "
                           "allow_growth=True, deferred_deletion_bytes=8.00 MiB")


def test_gpudash_config_takes_a_device_by_name(ip, capsys):
    ip.run_line_magic("gpudash", "--simulate 8GiB")
    ip.run_line_magic("gpudash_config", "device=GPU:0 fraction=0.25")
    assert _session().devices[0].memory_limit == 2 * GiB
    assert "fraction=0.25, limit 2.00 GiB" in capsys.readouterr().out


def test_a_refused_gpudash_leaves_no_half_made_session(ip, monkeypatch):
    from gpudash.widgets import dashboard as dashboard_mod

    def boom(*a, **k):
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(dashboard_mod.Dashboard, "__init__", boom)
    with pytest.raises(UsageError, match="int too large"):
        ip.run_line_magic("gpudash", "--simulate 8GiB")
    assert session_mod.default_session(create=False) is None
    monkeypatch.undo()
    ip.run_line_magic("gpudash", "--simulate 4GiB")  # a later %gpudash works
    assert _session().devices[0].total == 4 * GiB


def test_gpudash_config_without_a_session_says_what_to_do(ip):
    with pytest.raises(UsageError, match="run %gpudash first"):
        ip.run_line_magic("gpudash_config", "fraction=0.5")


def test_gpudash_track_summarises_the_cell(ip, capsys):
    ip.run_line_magic("gpudash", "--simulate 8GiB --fraction 0.5")
    ip.user_ns.update(sess=_session(), MiB=MiB)
    ip.run_cell_magic("gpudash_track", "",
                      "ptrs = [sess.allocate(MiB) for _ in range(10)]\n"
                      "sess.free_now(ptrs.pop())\n")
    out = capsys.readouterr().out
    assert "gpudash_track" in out
    assert "in use +9.00 MiB" in out
    assert "peak 10.00 MiB" in out  # the cell's own peak
    assert "10 allocation(s)" in out
    assert _session().devices[0].stats().num_allocs == 10  # TensorFlow's stats untouched
    assert "0 out of memory" in out


def test_gpudash_track_names_the_cell_by_its_prompt(ip, capsys):
    """Cells run as a notebook runs them (stored in history, so each has a prompt number):
    the blocks a %%gpudash_track cell holds are "cell [N]", N its own prompt, not the next."""
    ip.run_line_magic("gpudash", "--simulate 8GiB")
    ip.user_ns.update(sess=_session(), MiB=MiB)
    prompts = []
    for size in (3, 5):
        result = ip.run_cell(f"%%gpudash_track\nkeep{size} = sess.allocate({size} * MiB)\n",
                             store_history=True)
        assert result.success, result
        n = result.execution_count  # the prompt the front end shows: In [n]
        prompts.append(n)
        out = capsys.readouterr().out
        assert f"held now by: cell [{n}] {size}.00 MiB (1 block(s))" in out, out
        assert _session().holder_of(ip.user_ns[f"keep{size}"]) == f"cell [{n}]"
    assert prompts[1] == prompts[0] + 1


def test_gpudash_track_counts_out_of_memory_and_re_raises(ip, capsys):
    ip.run_line_magic("gpudash", "--simulate 1GiB --fraction 0.5")
    ip.user_ns.update(sess=_session(), MiB=MiB)
    cell = ("try:\n    sess.allocate(900 * MiB)\nexcept gpudash.OutOfMemoryError:\n    pass\n"
            "raise RuntimeError('boom')\n")
    ip.user_ns["gpudash"] = gpudash
    with pytest.raises(RuntimeError, match="boom"):
        ip.run_cell_magic("gpudash_track", "", cell)
    out = capsys.readouterr().out
    assert "1 out of memory" in out  # the summary is shown before the error


def test_gpudash_cells_prints_a_line_after_each_cell(ip, capsys):
    ip.run_line_magic("gpudash", "--simulate 8GiB")
    ip.user_ns["sess"] = _session()
    ip.run_line_magic("gpudash_cells", "on")
    assert "after every cell is on" in capsys.readouterr().out  # it says so
    ip.run_cell("p = sess.allocate(5 * 1024 * 1024)")
    out = capsys.readouterr().out
    assert "gpudash: in use +5.00 MiB" in out
    assert "1 allocation(s)" in out
    ip.run_line_magic("gpudash_cells", "off")
    assert "are off" in capsys.readouterr().out
    ip.run_cell("q = 1")
    assert "gpudash:" not in capsys.readouterr().out
    with pytest.raises(UsageError):
        ip.run_line_magic("gpudash_cells", "sometimes")


def test_unload_stops_the_per_cell_lines(ip, capsys):
    ip.run_line_magic("gpudash", "--simulate 8GiB")
    ip.run_line_magic("gpudash_cells", "on")
    ip.run_line_magic("unload_ext", "gpudash")
    capsys.readouterr()
    ip.run_cell("z = 2")
    assert "gpudash:" not in capsys.readouterr().out
    ip.run_line_magic("load_ext", "gpudash")


def test_bad_gpudash_arguments_are_usage_errors(ip):
    with pytest.raises(UsageError):
        ip.run_line_magic("gpudash", "--fraction lots")
    with pytest.raises(UsageError):
        ip.run_line_magic("gpudash", "--bogus")


def test_unload_restores_cupys_allocator(ip, monkeypatch):
    """On a GPU, %gpudash installs the session into CuPy; %unload_ext must restore CuPy's own
    allocator. Checked here with CuPy's real set/get_allocator on a session that claims to
    be on a GPU (its allocations are never made)."""
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(session_mod.Session, "simulated", property(lambda self: False))
    before = cupy.cuda.get_allocator()
    ip.run_line_magic("gpudash", "--simulate 1GiB")
    sess = _session()
    assert sess.installed
    assert cupy.cuda.get_allocator() is not before
    ip.run_line_magic("unload_ext", "gpudash")
    assert not sess.installed
    assert cupy.cuda.get_allocator() == before
    ip.run_line_magic("load_ext", "gpudash")


def test_absurd_sizes_are_usage_errors_and_leave_nothing_behind(ip):
    with pytest.raises(UsageError, match="at most 9223372036854775807 bytes"):
        ip.run_line_magic("gpudash", "--simulate 1e999999")
    assert session_mod.default_session(create=False) is None
    ip.run_line_magic("gpudash", "--simulate 8GiB")
    before = _session().devices[0]._deferred.threshold
    with pytest.raises(UsageError, match="at most 9223372036854775807 bytes"):
        ip.run_line_magic("gpudash_config", "deferred=1e99999")
    assert _session().devices[0]._deferred.threshold == before


# ------------------------------------------------------------------------------ PyTorch
def test_gpudash_allocator_torch_makes_a_pytorch_session_and_its_dashboard(ip, capsys,
                                                                            monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    dash = ip.run_line_magic("gpudash", "--allocator torch --simulate 8GiB --fraction 0.5")
    sess = _session()
    assert sess.framework == "torch" and sess.devices[0].name == "cuda:0"
    alloc = sess.devices[0].allocator
    assert alloc.config.as_conf() == "max_split_size_mb:64"  # read from the environment
    assert alloc.fraction == 0.5 and sess.devices[0].memory_limit == 4 * GiB
    assert dash.model.session is sess and dash.model.model(0).name == "torch"
    # again, with --conf: the same session and dashboard, _set_allocator_settings live
    assert ip.run_line_magic("gpudash", "--conf expandable_segments:True") is dash
    assert alloc.config.as_conf() == "expandable_segments:True"
    with pytest.raises(UsageError, match="allow_growth is TensorFlow's setting"):
        ip.run_line_magic("gpudash", "--growth")
    # back to TensorFlow's allocator: a new default session, said in a line
    capsys.readouterr()
    ip.run_line_magic("gpudash", "--allocator bfc --simulate 1GiB")
    assert _session().model.name == "bfc" and not sess.closed
    assert "the one with PyTorch's caching allocator stays open" in capsys.readouterr().out
    sess.close()


def test_gpudash_refuses_mixed_arguments(ip):
    with pytest.raises(UsageError, match="--conf is PYTORCH_CUDA_ALLOC_CONF"):
        ip.run_line_magic("gpudash", "--simulate 1GiB --conf expandable_segments:True")
    with pytest.raises(UsageError, match="--allocator and --conf are for gpudash's session"):
        ip.run_line_magic("gpudash", "--watch torch --allocator torch")
    with pytest.raises(UsageError, match="allocator must be one of"):
        ip.run_line_magic("gpudash", "--allocator cupy --simulate 1GiB")
    with pytest.raises(UsageError, match="max_split_size_mb"):
        ip.run_line_magic("gpudash", "--allocator torch --simulate 1GiB "
                                     "--conf max_split_size_mb:5")
    assert _session() is None


def test_gpudash_config_takes_pytorch_s_names(ip, capsys):
    ip.run_line_magic("gpudash", "--allocator torch --simulate 2x8GiB")
    sess = _session()
    capsys.readouterr()
    ip.run_line_magic("gpudash_config", "")
    assert capsys.readouterr().out.splitlines() == [
        "gpudash (torch): cuda:0 fraction not set, limit 8.00 GiB, "
        "PYTORCH_CUDA_ALLOC_CONF='' (the defaults)",
        "gpudash (torch): cuda:1 fraction not set, limit 8.00 GiB, "
        "PYTORCH_CUDA_ALLOC_CONF='' (the defaults)"]
    # PyTorch takes both settings but stops on an internal assert when memory runs short
    # (pytorch/pytorch#123548): the session sets them and says so
    with pytest.warns(GpudashWarning, match="pytorch/pytorch#123548"):
        ip.run_line_magic("gpudash_config", "fraction=0.25 device=cuda:1 "
                                            "expandable_segments=true max_split_size_mb=128 gc=0.6")
    out = capsys.readouterr().out
    assert out.strip() == ("gpudash (torch): cuda:1 fraction 0.25, limit 2.00 GiB, "
                           "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True,"
                           "max_split_size_mb:128,garbage_collection_threshold:0.6'")
    a0, a1 = (d.allocator for d in sess.devices)
    assert a1.fraction == 0.25 and a0.fraction is None
    assert a0.config == a1.config  # PyTorch's settings are process-wide
    ip.run_line_magic("gpudash_config", "PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:4 "
                                        "max_split_size_mb=none")
    assert a0.config.as_conf() == "expandable_segments:True,roundup_power2_divisions:4"
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("gpudash_config", "growth=true deferred=1MiB fraction=2")
    text = str(info.value)
    for words in ("changed nothing", "allow_growth is TensorFlow's setting",
                  "deferred_deletion_bytes is TensorFlow's setting", "in [0, 1]"):
        assert words in text, words
    with pytest.raises(UsageError, match="expandable_segments must be true or false"):
        ip.run_line_magic("gpudash_config", "expandable_segments=maybe")
    with pytest.raises(UsageError, match=r"in \[0, 1\]"):
        ip.run_line_magic("gpudash_config", "fraction=2")
    assert a1.fraction == 0.25


def test_gpudash_track_and_its_report_on_a_pytorch_session(ip, capsys, tmp_path):
    from html import unescape

    ip.run_line_magic("gpudash", "--allocator torch --simulate 8GiB --conf "
                                 "expandable_segments:True")
    ip.user_ns.update(sess=_session(), MiB=MiB)
    report = tmp_path / "cell.html"
    ip.run_cell_magic("gpudash_track", f"--report {report}",
                      "ptrs = [sess.allocate(n * MiB) for n in (1, 30, 100)]\n"
                      "sess.free(ptrs.pop())\nsess.empty_cache()\n")
    out = capsys.readouterr().out
    assert "cuda:0: allocated +31.00 MiB (now 31.00 MiB), peak 131.00 MiB" in out, out
    assert "reserved 42.00 MiB" in out  # a 2 MiB small page and two 20 MiB large pages
    assert f"gpudash_track: report written to {report}" in out
    html = unescape(report.read_text())
    assert "PyTorch's caching allocator" in html and "expandable_segments:True" in html
    with pytest.raises(UsageError, match="unknown arguments"):
        ip.run_cell_magic("gpudash_track", "--bogus", "pass\n")
    ip.run_line_magic("gpudash_cells", "on")
    capsys.readouterr()
    ip.run_cell("q = sess.allocate(5 * MiB)")
    assert "gpudash: allocated +5.00 MiB" in capsys.readouterr().out
    ip.run_line_magic("gpudash_cells", "off")
