"""JAX's settings: parsed as jaxlib parses them, run as XLA builds its BFC, named as JAX names
them; the docs' knob table is checked row by row."""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import gpudash
from gpudash import ConfigError, GpudashWarning
from gpudash.cli import main
from gpudash.options import (
    JAX_ALLOCATOR_KINDS,
    float32,
    framework_changes,
    framework_settings_text,
    jax_memory_limit,
    jax_settings_from_env,
    paste_fraction,
    restart_lines,
)

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

GiB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent
JAX_VARS = ("XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
            "XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB")
HAVE_JAXLIB = importlib.util.find_spec("jaxlib") is not None

# -- against jaxlib's own parser --------------------------------------------------------------

CASES = [
    {},
    {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"},
    {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.41"},
    {"XLA_CLIENT_MEM_FRACTION": "0.3"},
    {"XLA_CLIENT_MEM_FRACTION": "0.3", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4"},
    {"XLA_CLIENT_MEM_FRACTION": "", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4"},
    {"XLA_PYTHON_CLIENT_MEM_FRACTION": "abc"},
    {"XLA_PYTHON_CLIENT_MEM_FRACTION": " 1e-1 "},
    {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    {"XLA_PYTHON_CLIENT_PREALLOCATE": "False"},
    {"XLA_PYTHON_CLIENT_PREALLOCATE": "0"},
    {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
    {"XLA_PYTHON_CLIENT_PREALLOCATE": "FALSE"},
    {"XLA_PYTHON_CLIENT_PREALLOCATE": "no"},
    {"XLA_PYTHON_CLIENT_PREALLOCATE": ""},
    {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
    {"XLA_PYTHON_CLIENT_ALLOCATOR": "BFC"},
    {"XLA_PYTHON_CLIENT_ALLOCATOR": "Cuda_Async"},
    {"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"},
    {"XLA_PYTHON_CLIENT_ALLOCATOR": "address"},
    {"XLA_PYTHON_CLIENT_ALLOCATOR": "foo"},
    {"XLA_PYTHON_CLIENT_ALLOCATOR": ""},
    {"XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB": "512"},
    {"XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB": "x"},
]


@pytest.mark.skipif(not HAVE_JAXLIB, reason="jaxlib is not installed (pip install jax)")
@pytest.mark.parametrize("env", CASES, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items())
                         or "unset")
def test_same_reading_as_jaxlib(monkeypatch, env):
    """gpudash's parser against jaxlib's ``generate_pjrt_gpu_plugin_options`` (no GPU
    needed: it only reads the environment), under the installed jaxlib's rules."""
    from jaxlib import xla_client

    version = gpudash.options.installed_jaxlib_version()
    for var in JAX_VARS:
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        theirs = xla_client.generate_pjrt_gpu_plugin_options()
        error = None
    except ValueError as exc:
        theirs, error = None, exc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GpudashWarning)
        if error is not None:
            with pytest.raises(ConfigError) as info:
                jax_settings_from_env(env, jaxlib_version=version)
            var = next(k for k in JAX_VARS if k in str(error) or k in env)
            assert var in str(info.value)  # names the variable
            return
        ours = jax_settings_from_env(env, jaxlib_version=version)
    assert ours.allocator == theirs["allocator"]
    assert ours.memory_fraction == theirs.get("memory_fraction", 0.75)
    assert ours.preallocate == theirs.get("preallocate", True)
    assert ours.collective_memory_size == theirs.get("collective_memory_size", 0)


@pytest.mark.parametrize("value", ["0", "-0.5", "nan", "inf", "1.5"])
def test_stricter_than_jaxlib_where_xla_cannot_honour_it(value):
    """jaxlib passes any float on; these fail later in XLA (or allocate nonsense)."""
    with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        jax_settings_from_env({"XLA_PYTHON_CLIENT_MEM_FRACTION": value})


def test_above_one_with_unified_memory():
    s = jax_settings_from_env({"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.5",
                               "TF_FORCE_UNIFIED_MEMORY": "TRUE"})
    assert s.unified_memory and s.memory_limit(16 * GiB) == 24 * GiB
    # XLA: total * max(1, fraction) with unified memory
    assert jax_settings_from_env({"TF_FORCE_UNIFIED_MEMORY": "1"}).memory_limit(16 * GiB) == \
        16 * GiB


def test_both_fractions_is_an_error_naming_both():
    with pytest.raises(ConfigError) as info:
        jax_settings_from_env({"XLA_CLIENT_MEM_FRACTION": "0.3",
                               "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4"})
    assert "XLA_CLIENT_MEM_FRACTION" in str(info.value)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in str(info.value)


def test_allocator_kinds_by_version():
    assert jax_settings_from_env({"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"}).allocator == "vmm"
    with pytest.raises(ConfigError, match=r"needs jaxlib >= 0\.10\.0") as info:
        jax_settings_from_env({"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"}, jaxlib_version="0.4.35")
    assert "'default', 'bfc', 'platform', 'cuda_async'" in str(info.value)
    with pytest.raises(ConfigError, match=r"needs jaxlib >= 0\.11\.0"):
        jax_settings_from_env({"XLA_PYTHON_CLIENT_ALLOCATOR": "address"}, jaxlib_version="0.10.2")
    with pytest.raises(ConfigError, match="older than gpudash models"):
        jax_settings_from_env({}, jaxlib_version="0.4.20")
    assert set(JAX_ALLOCATOR_KINDS) == {"default", "bfc", "platform", "cuda_async", "vmm",
                                        "address"}


def test_new_fraction_name_ignored_by_old_jaxlib():
    with pytest.warns(GpudashWarning, match="ignored by jaxlib 0.4.31"):
        s = jax_settings_from_env({"XLA_CLIENT_MEM_FRACTION": "0.3"}, jaxlib_version="0.4.31")
    assert s.memory_fraction == 0.75 and s.fraction_variable is None
    s = jax_settings_from_env({"XLA_CLIENT_MEM_FRACTION": "0.3"}, jaxlib_version="0.4.32")
    assert s.memory_fraction == 0.3


def test_preallocate_values_jaxlib_reads_as_true_warn():
    with pytest.warns(GpudashWarning, match="only 'false', 'False' and '0'"):
        assert jax_settings_from_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "FALSE"}).preallocate


def test_limit_in_single_precision():
    """Up to jaxlib 0.10.1 the limit is size_t(total * float32(fraction)), nothing more."""
    total = 16 * GiB
    for f in (0.75, 0.41, 0.1, 0.9, 1 / 3):
        assert jax_memory_limit(total, f, jaxlib_version="0.10.1") == int(
            total * float(np.float32(f)))
        assert float32(f) == float(np.float32(f))
    assert jax_memory_limit(total, 0.41, jaxlib_version="0.4.35") < int(total * 0.41)


# bytes_limit of device.memory_stats() on an H200 (total 150,109,880,320 B, as cudaMemGetInfo
# gives it), with XLA_PYTHON_CLIENT_MEM_FRACTION set to each fraction
H200_TOTAL = 150_109_880_320
H200_LIMITS = {0.75: 112_583_507_968, 0.5: 75_054_972_928, 0.3: 45_034_242_048,
               0.333: 49_987_715_072}


@pytest.mark.parametrize("fraction", sorted(H200_LIMITS))
def test_limit_rounded_up_to_2_mib_as_xla_does_on_an_h200(fraction):
    """XLA (RoundUpGpuMemoryLimit, jaxlib >= 0.10.2) rounds size_t(total * float32(f)) up
    to a multiple of 2 MiB: the limits measured on an H200, to the byte."""
    xla = H200_LIMITS[fraction]
    assert jax_memory_limit(H200_TOTAL, fraction) == xla
    assert jax_memory_limit(H200_TOTAL, fraction, jaxlib_version="0.10.2") == xla
    assert xla % (2 << 20) == 0 and 0 <= xla - int(H200_TOTAL * float32(fraction)) < 2 << 20
    # older jaxlibs stop at the single-precision product
    assert jax_memory_limit(H200_TOTAL, fraction, jaxlib_version="0.10.1") == int(
        H200_TOTAL * float32(fraction))
    # both variables, preallocating or growing: the same rounded limit
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
        for pre in ("true", "false"):
            settings = jax_settings_from_env({name: str(fraction),
                                              "XLA_PYTHON_CLIENT_PREALLOCATE": pre})
            assert settings.memory_limit(H200_TOTAL) == xla
            old = jax_settings_from_env({name: str(fraction)}, jaxlib_version="0.10.1")
            assert old.memory_limit(H200_TOTAL) == int(H200_TOTAL * float32(fraction))


def test_limit_rounding_with_unified_memory_and_the_default():
    assert jax_memory_limit(H200_TOTAL) == H200_LIMITS[0.75]  # 0.75 is the default
    s = jax_settings_from_env({"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.3",
                               "TF_FORCE_UNIFIED_MEMORY": "1"})
    product = int(H200_TOTAL * float32(1.3))
    assert s.memory_limit(H200_TOTAL) == -(-product // (2 << 20)) * (2 << 20) > product


@pytest.mark.parametrize("preallocate", ["true", "false"])
def test_jax_session_runs_xlas_rounded_limit(preallocate):
    """A JAX session's BFC gets XLA's limit, rounded, preallocated or grown to it; with an
    older jaxlib's rules, the plain product."""
    env = {"XLA_CLIENT_MEM_FRACTION": "0.3", "XLA_PYTHON_CLIENT_PREALLOCATE": preallocate}
    with gpudash.Session.from_env("jax", environ=env, simulate=H200_TOTAL) as sess:
        alloc = sess.devices[0].allocator
        assert alloc.memory_limit == H200_LIMITS[0.3]
        sess.allocate(256)
        if preallocate == "true":
            assert alloc.pool_bytes == H200_LIMITS[0.3]
        sess.configure(per_process_gpu_memory_fraction=float32(0.5))
        assert alloc.memory_limit == H200_LIMITS[0.5]
    with gpudash.Session.from_env("jax", environ=env, simulate=H200_TOTAL,
                                  jaxlib_version="0.10.1") as sess:
        assert sess.devices[0].allocator.memory_limit == int(H200_TOTAL * float32(0.3))


def test_session_from_env_jax():
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "TF_FORCE_GPU_ALLOW_GROWTH": "false", "TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "100"}
    with gpudash.Session.from_env("jax", environ=env, simulate="16GiB") as sess:
        assert sess.framework == "jax" and sess.jax_settings.fraction_variable == \
            "XLA_PYTHON_CLIENT_MEM_FRACTION"
        alloc = sess.devices[0].allocator
        assert (alloc.memory_limit, alloc.allow_growth, alloc.garbage_collection) == (
            8 * GiB, True, False)  # TensorFlow's variables are not JAX's
        p = sess.allocate(1 << 20)
        sess.free(p)
        sess.flush()
        assert alloc.bytes_in_use == 0
    with gpudash.Session.from_env("jax", environ={}, simulate="16GiB") as sess:
        alloc = sess.devices[0].allocator
        assert alloc.memory_limit == 12 * GiB and not alloc.allow_growth
        sess.allocate(256)
        assert alloc.pool_bytes == 12 * GiB  # preallocated at the first allocation


@pytest.mark.filterwarnings("ignore:Overriding allow_growth")
def test_session_from_env_tensorflow_is_the_plain_session():
    env = {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    with gpudash.Session.from_env("tensorflow", environ=env, simulate="16GiB") as a, \
            gpudash.Session(environ=env, simulate="16GiB") as b:
        assert a.framework == b.framework == "tensorflow"
        assert a.config == b.config
        assert a.devices[0].memory_limit == b.devices[0].memory_limit
        assert a.devices[0].allocator.allow_growth is True


@pytest.mark.parametrize(("framework", "env", "match"), [
    ("jax", {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}, "XLA_PYTHON_CLIENT_ALLOCATOR"),
    ("jax", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "half"}, "XLA_PYTHON_CLIENT_MEM_FRACTION"),
    ("mxnet", {}, "framework must be one of tensorflow, jax"),
])
def test_session_from_env_refuses(framework, env, match):
    with pytest.raises(ConfigError, match=match):
        gpudash.Session.from_env(framework, environ=env, simulate="16GiB")


# -- names and paste lines -------------------------------------------------------------------


def test_framework_changes_under_jax_names():
    assert framework_changes("jax", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.41",
                                     "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) == {
        "per_process_gpu_memory_fraction": float32(0.41), "allow_growth": True}
    for bad, match in [({"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc"}, "fixed when the session starts"),
                       ({"XLA_FOO": "1"}, "a JAX setting must be"),
                       ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "x"}, "XLA_PYTHON_CLIENT_MEM_FRACTION")]:
        with pytest.raises(ConfigError, match=match):
            framework_changes("jax", bad)
    text = framework_settings_text("jax", 0.5, True, 8 * GiB)
    assert text == ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 XLA_PYTHON_CLIENT_PREALLOCATE=false "
                    "(limit 8.00GiB)")


def test_restart_lines():
    assert restart_lines("jax", 0.41, True) == [
        "XLA_PYTHON_CLIENT_MEM_FRACTION=0.41", "XLA_PYTHON_CLIENT_PREALLOCATE=false",
        "# JAX reads these once, when its GPU backend starts: set them before the first JAX "
        "call and restart the process (kernel) to take them"]
    assert restart_lines("jax", 0.41, None, form="notebook")[0] == \
        "%env XLA_PYTHON_CLIENT_MEM_FRACTION=0.41"
    tf = restart_lines("tensorflow", 0.41, False, total=16 * GiB)
    assert tf[0] == "config.gpu_options.per_process_gpu_memory_fraction = 0.41"
    assert tf[1] == "config.gpu_options.allow_growth = False"
    assert "LogicalDeviceConfiguration(memory_limit=6718)" in tf[2]  # ceil(0.41 x 16 GiB / MiB)
    assert "restart" in tf[-1]
    with pytest.raises(ConfigError, match="form must be"):
        restart_lines("jax", 0.5, form="yaml")


def test_paste_fraction_reaches_the_limit_the_framework_way():
    total = 16 * GiB
    for needed in (int(total * 0.195), 3 * GiB, 12345678901, 1):
        # JAX: the limit every jaxlib gives (without the rounding of 0.10.2 and later)
        for fw, limit in (("jax", lambda t, f: jax_memory_limit(t, f, jaxlib_version="0.4.30")),
                          ("tensorflow", lambda t, f: int(t * f))):
            f = paste_fraction(needed, total, fw)
            assert limit(total, f) >= needed
            assert f == round(f, 3)
            assert f <= 0.001 or limit(total, round(f - 0.001, 3)) < needed  # the smallest


def test_whatif_framework_prints_paste_lines(capsys):
    trace = ROOT / "gpudash" / "samples" / "training.gdtrace"
    assert main(["whatif", str(trace), "--framework", "jax", "--growth", "--fractions", "0.5",
                 "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"smallest fraction that fits: ([0-9.]+) \(", out)
    assert m
    lines = re.findall(r"^  (XLA_PYTHON_CLIENT_MEM_FRACTION=([0-9.]+))$", out, re.M)
    assert lines and float(lines[0][1]) >= float(m.group(1))
    assert "%env XLA_PYTHON_CLIENT_MEM_FRACTION=" in out
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in out  # --growth
    assert "JAX must restart to take them" in out
    # the pasted value, read back the way JAX reads it, still fits the trace
    from gpudash.trace import load_trace
    from gpudash.trace.replay import replay

    s = jax_settings_from_env({"XLA_PYTHON_CLIENT_MEM_FRACTION": lines[0][1],
                               "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    result = replay(load_trace(trace), device_bytes=16 * GiB, fraction=s.effective_fraction,
                    allow_growth=s.allow_growth, garbage_collection=False)
    assert result.fits

    assert main(["whatif", str(trace), "--framework", "tensorflow", "--no-growth",
                 "--fractions", "0.5", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  config\.gpu_options\.per_process_gpu_memory_fraction = [0-9.]+$", out,
                     re.M)
    assert "config.gpu_options.allow_growth = False" in out
    assert "memory_limit=" in out and "TensorFlow must restart" in out


def test_whatif_framework_jax_refuses_gc(capsys):
    trace = ROOT / "gpudash" / "samples" / "training.gdtrace"
    assert main(["whatif", str(trace), "--framework", "jax", "--gc"]) == 1
    assert "never garbage-collects" in capsys.readouterr().err


def test_gpudash_config_takes_and_shows_jax_names():
    """A real IPython shell: %gpudash_config on a JAX session speaks JAX's variables."""
    from IPython.core.error import UsageError
    from IPython.testing import globalipapp
    from IPython.utils.capture import capture_output

    from gpudash.session import default_session, set_default_session

    globalipapp.start_ipython()  # once per process; later calls return None
    ip = globalipapp.get_ipython()
    old = default_session(create=False)
    sess = gpudash.Session.from_env("jax", environ={}, simulate="16GiB")
    set_default_session(sess)
    try:
        ip.run_line_magic("load_ext", "gpudash")
        ip.run_line_magic("gpudash", "")
        with capture_output() as cap:
            ip.run_line_magic("gpudash_config", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.41 "
                              "XLA_PYTHON_CLIENT_PREALLOCATE=false")
        assert cap.stdout.strip() == (
            "gpudash (jax): /device:GPU:0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.4099999964237213 "
            "XLA_PYTHON_CLIENT_PREALLOCATE=false (limit 6.56GiB)")
        alloc = sess.devices[0].allocator
        assert alloc.memory_limit == jax_memory_limit(16 * GiB, 0.41) and alloc.allow_growth
        with pytest.raises(UsageError, match="XLA_PYTHON_CLIENT_MEM_FRACTION=.*and "
                                             "XLA_PYTHON_CLIENT_MEM_FRACTION|both set"):
            ip.run_line_magic("gpudash_config", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 "
                              "XLA_CLIENT_MEM_FRACTION=0.2")
        with pytest.raises(UsageError, match="XLA_PYTHON_CLIENT_ALLOCATOR is fixed"):
            ip.run_line_magic("gpudash_config", "XLA_PYTHON_CLIENT_ALLOCATOR=platform")
        assert alloc.memory_limit == jax_memory_limit(16 * GiB, 0.41)  # nothing changed
        ip.run_line_magic("gpudash_config", "fraction=0.5")  # gpudash's own names still work
        assert alloc.memory_limit == 8 * GiB
    finally:
        ip.run_line_magic("unload_ext", "gpudash")
        sess.close()
        set_default_session(old)


# -- the docs' table ---------------------------------------------------------------------------


def _table_rows():
    text = (ROOT / "docs" / "frameworks.md").read_text()
    section = text.split("## Every knob and the BFC option it sets", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| ---") or line.startswith(
                "| framework"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, line
        rows.append(cells)
    return rows


def _pairs(cell):
    out = {}
    for part in cell.strip("`").split(";"):
        part = part.strip().strip("`")
        if part:
            key, _, value = part.partition("=")
            out[key.strip()] = value.strip()
    return out


def _value(text):
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def test_docs_table_has_every_knob():
    rows = _table_rows()
    knobs = {r[1] for r in rows}
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
                 "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR",
                 "TF_FORCE_UNIFIED_MEMORY", "TF_FORCE_GPU_ALLOW_GROWTH",
                 "TF_ENABLE_GPU_GARBAGE_COLLECTION", "TF_DEVICE_MIN_SYS_MEMORY_IN_MB",
                 "config.gpu_options.per_process_gpu_memory_fraction",
                 "config.gpu_options.allow_growth", "config.gpu_options.allocator_type"):
        assert any(name in k for k in knobs), name
    kinds = {r[2].strip("`") for r in rows if "XLA_PYTHON_CLIENT_ALLOCATOR" in r[1]}
    assert kinds == set(JAX_ALLOCATOR_KINDS)


@pytest.mark.parametrize("row", _table_rows(), ids=lambda r: f"{r[0]}:{r[1]}={r[2]}")
def test_docs_table_row(row):
    """env -> options -> allocator, for each row of docs/frameworks.md."""
    framework, knob, value, option_cell, alloc_cell = row
    names = re.findall(r"`([^`]+)`", knob)
    value = value.strip("`")
    environ: dict = {}
    config = gpudash.ConfigProto(allow_soft_placement=True)
    expected_options = _pairs(option_cell) if option_cell != "refused" else {}
    if not names:  # (nothing set)
        pass
    elif names[0].startswith("config.gpu_options."):
        setattr(config.gpu_options, names[0].rsplit(".", 1)[1], _value(value))
    elif names[0].startswith("tf.config"):  # checked from the gpudash option on
        config.gpu_options.update(**{k: _value(v) for k, v in expected_options.items()})
    else:
        for name in names:
            environ[name] = value
    kwargs = {"environ": environ, "simulate": "16GiB"}
    if framework == "tensorflow":
        kwargs["config"] = config
    if option_cell == "refused":
        with pytest.raises(ConfigError, match=names[0]):
            gpudash.Session.from_env(framework, **kwargs)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GpudashWarning)  # TensorFlow's override notices
        sess = gpudash.Session.from_env(framework, **kwargs)
    with sess:
        dev = sess.devices[0]
        for key, text in expected_options.items():
            assert getattr(dev.options, key) == _value(text), key
        alloc = dev.allocator
        for key, text in _pairs(alloc_cell).items():
            if key == "type":  # the public class (the pure model's is PyBFCAllocator)
                public = getattr(gpudash, text, None) or getattr(gpudash.session, text)
                assert type(alloc) is public, (type(alloc), text)
            elif key == "pool_bytes":  # after one small allocation
                sess.allocate(256)
                assert alloc.pool_bytes < 8 << 20
            else:
                assert getattr(alloc, key) == _value(text), key
