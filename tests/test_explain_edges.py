"""``gpudash explain`` at its edges: requests beyond any device, dumps of a million chunks,
logs whose only "ran out of memory" lines are warnings, and the setting each framework
answers in (TensorFlow's fraction, JAX's, none for a host allocator)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpudash
from gpudash import TraceFormatError, style
from gpudash.options import jax_memory_limit
from gpudash.proto import bfc_memory_map_pb2

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "tests" / "data" / "real"
from shared_files import EXTERNAL  # noqa: E402
needs_external = pytest.mark.skipif(not EXTERNAL.is_dir(), reason="../shared is absent")
OOM_LINE = "ran out of memory trying to allocate 3.00MiB (rounded to 3145728)"


def gpudash_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpudash", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def gpu_log(tmp_path: Path, request: str = "3.00MiB (rounded to 3145728)", *,
            path_tag: str = "", name: str = "GPU_0_bfc") -> Path:
    """tests/data/real/tf_oom_mixed.log as a GPU allocator's (renamed), with another request
    and, optionally, a source path on its out-of-memory line."""
    text = (REAL / "tf_oom_mixed.log").read_text()
    text = text.replace("bfc_cpu_allocator_for_gpu", name)
    text = text.replace(OOM_LINE, f"ran out of memory trying to allocate {request}")
    if path_tag:
        text = re.sub(r" bfc_allocator\.cc:502\] Allocator", f" {path_tag}:502] Allocator",
                      text, count=1)
    out = tmp_path / f"gpu_{abs(hash((request, path_tag, name)))}.log"
    out.write_text(text)
    return out


# ---------------------------------------------------------------------------- the fraction
def test_the_fraction_is_computed_in_closed_form_and_exactly():
    from gpudash.postmortem import smallest_fraction

    rng = np.random.default_rng(7)
    for framework in ("tensorflow", "jax"):
        limit = jax_memory_limit if framework == "jax" else (lambda t, f: int(t * f))
        for _ in range(2000):
            total = int(rng.integers(1 << 20, 1 << 50))
            needed = int(rng.integers(1, total + 1))
            f = smallest_fraction(needed, total, framework)
            k = round(f * 10_000)
            assert f == k / 10_000 and 1 <= k <= 10_000
            assert limit(total, f) >= needed                     # it serves the request
            assert k == 1 or limit(total, (k - 1) / 10_000) < needed   # and is the smallest
    assert smallest_fraction((16 << 30) + 1, 16 << 30) is None
    assert smallest_fraction(16 << 30, 16 << 30) == 1.0


def test_a_request_beyond_the_device_ends_and_says_no_fraction_serves_it(tmp_path):
    # a request rounded to 2**62 + 256 on a 1 MiB device used to step the fraction by
    # 0.0001 until it reached 4.4e12: it never ended
    huge = gpu_log(tmp_path, "4.00EiB (rounded to 4611686018427388160)")
    r = gpudash_cli("explain", str(huge), "--device", "1MiB", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "no fraction of this device serves it" in r.stdout
    e = gpudash.explain(huge, device="1MiB")
    assert e.fraction is None and e.smallest_limit == e.pool + 4611686018427388160
    # within the device: the fraction, exactly the smallest
    e = gpudash.explain(gpu_log(tmp_path), device="16GiB")
    assert e.fraction == 0.0032 and not e.host and e.setting == "per_process_gpu_memory_fraction"
    assert "per_process_gpu_memory_fraction 0.0032 of a 16.00 GiB device" in str(e)


@pytest.mark.parametrize("request_text", ["99999.99EiB", "8.00EiB"])
def test_figures_beyond_int64_are_a_one_line_error_naming_the_file(tmp_path, request_text):
    bad = gpu_log(tmp_path, request_text)
    r = gpudash_cli("explain", str(bad), "--device", "16GiB", timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "2**63" in lines[0]
    with pytest.raises(TraceFormatError, match="line 4: the request"):
        gpudash.explain(bad)


# ---------------------------------------------------------------------------- a large dump
def write_memory_dump(path: Path, n: int, regions: int = 4) -> int:
    """An n-chunk MemoryDump protobuf, chunks alternating in use and free; returns the pool."""
    rng = np.random.default_rng(3)
    sizes = rng.choice([256, 4096, 65536], size=n).tolist()
    md = bfc_memory_map_pb2.MemoryDump(allocator_name="GPU_0_bfc")
    base, per = 0x7F0000000000, -(-n // regions)
    for i, size in enumerate(sizes):
        if i and i % per == 0:
            base += 1 << 32                                   # a gap: the next region
        md.chunk.add(address=base, size=size, requested_size=size - 1 if i % 2 else 0,
                     in_use=bool(i % 2), op_name="MatMul" if i % 2 else "")
        base += size
    path.write_bytes(md.SerializeToString())
    return sum(sizes)


def test_the_chunk_map_of_a_large_dump_is_downsampled(tmp_path):
    from gpudash.report import CHUNKMAP_COLUMNS

    dump = tmp_path / "large.memdump"
    pool = write_memory_dump(dump, 40_000)
    e = gpudash.explain(dump, request="64MiB", limit=pool)
    fig = e.figures()[0]
    bars = sum(len(t.x) for t in fig.data)
    assert bars <= 3 * CHUNKMAP_COLUMNS * len(e.dump.regions) < len(e.dump.chunks)
    # every chunk begins in exactly one bar, and each region's bars cover it end to end
    counts = [int(m) for t in fig.data for h in t.hovertext
              for m in re.findall(r"([\d,]+) chunk\(s\) begin here", h.replace(",", ""))]
    assert sum(counts) == len(e.dump.chunks) == 40_000
    for r, region in enumerate(e.dump.regions):
        name = f"region {r} @ {region.ptr:#x}"
        widths = [x for t in fig.data for y, x in zip(t.y, t.x) if y == name]
        _, scale = style.unit_for(max(g.size for g in e.dump.regions))
        assert abs(sum(widths) * scale - region.size) <= len(widths)
    out = tmp_path / "large.html"
    r = gpudash_cli("explain", str(dump), "--request", "64MiB", "--limit", str(pool),
                    "--html", str(out))
    assert r.returncode == 0, r.stderr
    html = out.read_text()
    assert len(html) < 3_000_000                 # a bar per chunk made this 14 MB
    assert "chunks drawn as" in html and re.search(r"<script[^>]*\bsrc=", html) is None
    # a small dump still gets a bar, and a hover text, per chunk
    small = gpudash.explain(REAL / "tf_oom_mixed.log").figures()[0]
    assert sum(len(t.x) for t in small.data) >= len(gpudash.explain(REAL / "tf_oom_mixed.log")
                                                    .dump.chunks)


# ---------------------------------------------------------------------------- warnings only
DECLINED = ("2021-08-30 02:24:22.499646: W tensorflow/core/common_runtime/bfc_allocator.cc:246] "
            "Allocator (GPU_0_bfc) ran out of memory trying to allocate {size} with "
            "freed_by_count=0. The caller indicates that this is not a failure, but may mean "
            "that there could be performance gains if more memory were available.\n")


def test_a_log_of_non_fatal_warnings_is_not_taken_for_an_out_of_memory_error(tmp_path):
    log = tmp_path / "warnings.log"
    log.write_text("2021-08-30 02:19:34.293206: I tensorflow/core/common_runtime/gpu/"
                   "gpu_device.cc:1402] Created TensorFlow device (/job:localhost/replica:0/"
                   "task:0/device:GPU:0 with 688 MB memory)\n"
                   + "".join(DECLINED.format(size=s) for s in ("546.16MiB", "150.16MiB")))
    r = gpudash_cli("explain", str(log))
    assert r.returncode == 1
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and str(log) in line
    assert "no out-of-memory error" in line and "non-fatal warnings" in line
    assert "The caller indicates that this is not a failure" in line
    assert "its 2 'ran out of memory' line(s)" in line
    # it does not ask for the very message the file holds
    assert "expected an out-of-memory message" not in line
    with pytest.raises(TraceFormatError, match="non-fatal"):
        gpudash.explain(log)


@needs_external
def test_the_yolo_warnings_log_says_it_holds_no_error():
    r = gpudash_cli("explain", str(EXTERNAL / "tf2x_gsate_yolo_oom_warnings_2021.log"))
    assert r.returncode == 1 and "its 10 'ran out of memory' line(s)" in r.stderr
    assert "non-fatal warnings" in r.stderr and "no out-of-memory error" in r.stderr


# ---------------------------------------------------------------------------- the setting
@pytest.mark.parametrize("tag, framework", [
    ("external/xla/xla/tsl/framework/bfc_allocator.cc", "jax"),
    ("external/org_tensorflow/tensorflow/tsl/framework/bfc_allocator.cc", "jax"),
    ("tensorflow/core/common_runtime/bfc_allocator.cc", "tensorflow"),
    ("external/local_xla/xla/tsl/framework/bfc_allocator.cc", "tensorflow"),
    ("", "tensorflow"),
])
def test_the_answer_is_in_the_frameworks_own_setting(tmp_path, tag, framework):
    log = gpu_log(tmp_path, path_tag=tag)
    e = gpudash.explain(log, device="16GiB")
    assert e.framework == framework and not e.host
    text = str(e)
    if framework == "jax":
        assert e.setting == "XLA_PYTHON_CLIENT_MEM_FRACTION" and e.fraction == 0.0032
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.0032 of a 16.00 GiB device" in text
        assert "per_process_gpu_memory_fraction" not in text
        assert jax_memory_limit(16 << 30, e.fraction) >= e.smallest_limit
    else:
        assert "per_process_gpu_memory_fraction 0.0032" in text
        assert "XLA_PYTHON_CLIENT" not in text
    # the command says the same, and --framework overrides what the log suggests
    r = gpudash_cli("explain", str(log), "--device", "16GiB", "--framework", "jax")
    assert r.returncode == 0 and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.0032" in r.stdout


def test_a_host_allocator_gets_no_fraction_but_what_limits_it(tmp_path):
    for path in (REAL / "tf_oom_mixed.log", REAL / "tf_oom_mixed.memdump.pb"):
        e = gpudash.explain(path, device="16GiB", request="3MiB", limit="48MiB")
        assert e.host and e.fraction is None and e.setting == "TF_CPU_BFC_MEM_LIMIT_IN_MB"
        assert e.limit_mib == -(-e.smallest_limit // (1 << 20))
        assert "fraction 0." not in str(e) and "not a GPU memory fraction" in str(e)
    host = gpu_log(tmp_path, name="gpu_host_bfc")
    e = gpudash.explain(host, device="16GiB")
    assert e.host and "TF_GPU_HOST_MEM_LIMIT_IN_MB=51" in str(e)
    other = gpu_log(tmp_path, name="xla_cpu_host_bfc")
    e = gpudash.explain(other, device="16GiB")
    assert e.host and e.setting is None and "no GPU memory fraction applies" in str(e)


@needs_external
def test_jax_and_xla_dumps_answer_in_jaxs_setting():
    xla = gpudash.explain(EXTERNAL / "xla_reactant_bfc_dump_2025.log", device="32GiB")
    assert xla.framework == "jax" and xla.fraction == 0.6693
    assert jax_memory_limit(32 << 30, 0.6693) >= xla.smallest_limit \
        > jax_memory_limit(32 << 30, 0.6692)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.6693" in str(xla)
    over = gpudash.explain(EXTERNAL / "xla_reactant_bfc_dump_2025.log", device="16GiB")
    assert over.fraction is None and "no fraction of this device serves it" in str(over)
    pi0 = gpudash.explain(EXTERNAL / "jax_pi0_two_gpu_oom_2025.log", device="16GiB")
    assert pi0.framework == "jax" and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.2813" in str(pi0)
    tf = gpudash.explain(EXTERNAL / "tf14_alexnet_oom_2017.log", device="16GiB")
    assert tf.framework == "tensorflow" and "per_process_gpu_memory_fraction 0.0212" in str(tf)
