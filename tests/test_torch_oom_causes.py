"""The defects of issue 34 in reading and explaining PyTorch's out-of-memory message, each
with the case that showed it: causes that follow PyTorch's allocator and agree with their own
figures, advice that applies to that PyTorch and that pool, and robust reading (NVML's
not-available figures, a container's own process, unread clauses, other texts, stdin, huge
figures, long hyphen-ended logs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpudash import TraceFormatError
from gpudash.postmortem import explain
from gpudash.torch_oom import read_torch_ooms

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "torch_oom"
GiB = 1 << 30
MiB = 1 << 20


def one(text: str):
    (o,) = read_torch_ooms(text)
    return o


def cli(*args: str, stdin: str | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "gpudash", *args], capture_output=True,
                          text=True, input=stdin, timeout=timeout, cwd=ROOT)


def new_message(request="2.00 GiB", cap="23.65 GiB", free="1.25 GiB", this="22.38 GiB",
                alloc="19.91 GiB", unalloc="1.90 GiB", extra=""):
    this_clause = (f"Including non-PyTorch memory, this process has {this} memory in use. "
                   if this else "")
    return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {request}. GPU 0 "
            f"has a total capacity of {cap} of which {free} is free. {this_clause}{extra}"
            f"Of the allocated memory {alloc} is allocated by PyTorch, and {unalloc} is "
            "reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
            "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.")


# ----------------------------------------------------------------------------- causes
def test_free_plus_unallocated_covering_the_segment_is_fragmentation():
    o = one(new_message())
    c = o.cause()
    assert c.name == "fragmentation", c.why
    assert c.settings == ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    assert "3.15 GiB in all" in c.why and "short" not in o.explain()


def test_a_device_with_room_is_unknown_and_never_0_b_short():
    text = (DATA / "structureflow_room.txt").read_text()
    o = one(text)
    c = o.cause()
    assert c.name == "unknown" and c.settings == []
    assert "8.20 GiB free, more than the 8.13 GiB segment" in c.why
    assert "short" not in o.explain()
    assert any("MPS" in a for a in c.advice) and any("driver" in a for a in c.advice)


def test_memory_held_outside_pytorch_is_another_process_with_how_to_find_it():
    k80 = ("RuntimeError: CUDA out of memory. Tried to allocate 64.00 MiB (GPU 0; 11.17 GiB "
           "total capacity; 520.00 MiB already allocated; 12.50 MiB free; 530.00 MiB reserved "
           "in total by PyTorch)")
    c = one(k80).cause()
    assert c.name == "another process", c.why
    assert "10.64 GiB" in c.figures[-1] or "9.64 GiB" in c.figures[-1]
    assert any("nvidia-smi" in a for a in c.advice)
    assert "larger GPU" not in " ".join(c.advice) and "smaller batches" not in c.why
    # with the PIDs the message names
    msg = new_message(free="100.00 MiB", this="3.00 GiB", alloc="2.40 GiB",
                      unalloc="100.00 MiB", extra="Process 4242 has 20.00 GiB memory in use. ")
    c = one(msg).cause()
    assert c.name == "another process" and "process 4242 (20.00 GiB)" in c.why
    assert any("4242" in a and "nvidia-smi" in a for a in c.advice)


def test_a_1_0_message_with_a_small_pool_request_gets_no_max_split_size_mb():
    o = one((DATA / "generativegraph_small_pool.txt").read_text())
    assert o.wording == "1.0-1.3" and o.small_pool and o.request.value == MiB
    c = o.cause()
    assert c.settings == []
    assert not any("max_split_size_mb:" in s for s in c.settings + c.advice)
    assert not any("expandable_segments:True" in s for s in c.settings)
    # a large request of that era: no setting either (max_split_size_mb came in 1.10)
    c = one((DATA / "colab_k80_cached.txt").read_text()).cause()
    assert c.settings == [] and any("1.10" in a and "upgrade" in a for a in c.advice)
    # a small-pool request under 2.x: expandable segments do not serve it either
    c = one(new_message(request="2.00 MiB", free="1.00 MiB", unalloc="300.00 MiB")).cause()
    assert c.name == "fragmentation" and c.settings == []


def test_max_split_size_mb_only_where_the_message_shows_pytorch_1_10():
    hinted = ("RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; 15.90 "
              "GiB total capacity; 13.13 GiB already allocated; 415.88 MiB free; 14.80 GiB "
              "reserved in total by PyTorch) If reserved memory is >> allocated memory try "
              "setting max_split_size_mb to avoid fragmentation.")
    c = one(hinted).cause()
    assert c.name == "fragmentation"
    assert c.settings == ["PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512"]
    c = one(hinted.split(" If reserved")[0]).cause()       # 1.4-1.9: no such knob
    assert c.settings == [] and any("upgrade" in a for a in c.advice)


def test_an_allowed_limit_is_raised_to_a_value():
    msg = new_message(request="2.00 GiB", cap="139.72 GiB", free="134.00 GiB",
                      this="5.50 GiB", alloc="4.90 GiB", unalloc="100.00 MiB",
                      extra="5.59 GiB allowed; ")
    o = one(msg)
    c = o.cause()
    assert c.name == "limit" and "5.59 GiB" in c.why
    (line,) = c.settings
    assert line.startswith("torch.cuda.set_per_process_memory_fraction(0.")
    frac = float(line.split("(")[1].split(")")[0])
    assert frac * o.capacity.lo >= o.reserved.hi + o.request.hi
    assert (frac - 0.001) * o.capacity.value < o.reserved.value + o.request.value
    assert any("garbage_collection_threshold" in a for a in c.advice)
    # the driver had no room either: a larger fraction alone would not do, and it says so
    tight = msg.replace("134.00 GiB is free", "1.00 GiB is free")
    c = one(tight).cause()
    assert c.name == "limit" and c.settings == [] and "alone would not do" in c.why


def test_a_device_with_room_under_2_1_is_not_fragmentation_but_the_unprinted_fraction():
    c = one((DATA / "pytorch_111363_unprinted_fraction.txt").read_text()).cause()
    assert c.name == "unknown" and c.settings == []
    assert "2.1 does not print a set_per_process_memory_fraction" in c.advice[0]


# ----------------------------------------------------------------------------- reading
def test_nvml_not_available_figures_are_said_so():
    o = one((DATA / "wsl_nvml.txt").read_text())
    assert o.this_process is None
    text = o.explain()
    assert "EiB" not in text and "17179869184" in text and "not available" in text
    o = one((DATA / "fraction_nvml_container.txt").read_text())
    assert o.processes == [] and o.unknown_processes == [1459]
    assert "EiB" not in o.explain() and "1459: not available (NVML)" in o.explain()


def test_a_listed_process_matching_pytorchs_memory_is_this_process():
    o = one((DATA / "generateu_container.txt").read_text())
    assert o.this_pid == 20398 and o.this_process.value == round(14.52 * GiB)
    assert o.processes == [] and o.cause().name == "fragmentation"
    assert any("is this process" in a for a in o.assumed)
    e = explain(DATA / "generateu_container.txt")
    assert "assumed" in str(e) and "process 20398 (14.52 GiB) is this process" in str(e)
    # a process far larger than PyTorch's memory stays another one
    big = (DATA / "generateu_container.txt").read_text().replace("14.52 GiB", "24.52 GiB")
    assert one(big).this_pid is None


def test_an_unread_sentence_gives_a_warning():
    o = one(new_message().replace("unallocated.", "unalocated."))
    assert o.unallocated is None
    (w,) = [w for w in o.warnings if "not read" in w]
    assert "unalocated" in w
    r = cli("explain", "-", stdin=new_message().replace("unallocated.", "unalocated."))
    assert r.returncode == 0 and "not read" in r.stdout
    # a clean message warns of nothing
    assert not one(new_message()).warnings


@pytest.mark.parametrize("text, what", [
    ("Traceback (most recent call last):\n  File \"t.py\", line 3\nRuntimeError: CUDA error: "
     "an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
     "reported at some other API call\n", "illegal-memory-access"),
    ("RuntimeError: CUDA error: device-side assert triggered\n", "device-side assert"),
])
def test_a_text_that_is_no_out_of_memory_says_what_it_is(tmp_path, text, what):
    path = tmp_path / "err.log"
    path.write_text(text)
    with pytest.raises(TraceFormatError) as exc:
        explain(path)
    msg = str(exc.value)
    assert what in msg and "not an out-of-memory error" in msg
    for words in ("PyTorch's 'CUDA out of memory", "TensorFlow's 'Allocator (GPU_0_bfc) ran "
                  "out of memory", "JAX's 'RESOURCE_EXHAUSTED"):
        assert words in msg
    r = cli("explain", str(path))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1


def test_explain_reads_standard_input():
    text = (DATA / "cads_device_full.txt").read_text()
    r = cli("explain", "-", stdin=text)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("<stdin>: PyTorch ran out of memory") and "device full" in r.stdout
    r = cli("explain", "-", stdin="")
    assert r.returncode == 1 and "nothing on standard input" in r.stderr
    r = cli("explain", "-", stdin="RuntimeError: CUDA error: an illegal memory access\n")
    assert r.returncode == 1 and "<stdin>: not an out-of-memory error" in r.stderr
    assert "gpudash-stdin" not in r.stderr


def test_a_400_digit_figure_is_an_error_or_a_warning_never_an_internal_error(tmp_path):
    digits = "9" * 400
    bad = tmp_path / "huge_request.txt"
    bad.write_text(new_message(request=f"{digits}.00 GiB"))
    r = cli("explain", str(bad))
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "2**63" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    free = tmp_path / "huge_free.txt"
    free.write_text(new_message(free=f"{digits}.00 GiB"))
    r = cli("explain", str(free))
    assert r.returncode == 0, r.stderr
    assert "beyond any GPU" in r.stdout


def test_hyphen_ended_lines_are_read_in_linear_time(tmp_path):
    """4 MB of lines ending in a hyphen, then a message: joining them was quadratic (11 s a
    MB, minutes for this); now it is one pass. The timeout is the test's guard, not a
    measurement."""
    log = tmp_path / "hyphens.log"
    log.write_text("ab-\n" * 1_000_000 + new_message() + "\n")
    r = cli("explain", str(log), timeout=90)
    assert r.returncode == 0, r.stderr
    assert "fragmentation" in r.stdout


def test_long_digit_runs_are_read_in_linear_time_and_unicode_digits_are_no_figures():
    """100 messages, each with a 3,000-digit run: every figure pattern used to rescan the run
    from each of its digits (0.8 s a message, over a minute for these); a figure past
    Python's 4,300-digit int limit used to end in a ValueError."""
    code = ("from gpudash.torch_oom import read_torch_ooms\n"
            f"msg = {new_message()!r}\n"
            "msg = msg.replace('Of the allocated', '9' * 3000 + ' Of the allocated')\n"
            "ooms = read_torch_ooms((msg + '\\n') * 100)\n"
            "assert len(ooms) == 100 and all(o.free.value for o in ooms)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    o = one(new_message(free="\u0661\u0662.\u0665 MiB"))      # Arabic-Indic digits
    assert o.free is None and o.capacity is None
    with pytest.raises(TraceFormatError, match="2\\*\\*63"):   # past Python's 4,300 digits
        read_torch_ooms(new_message(request="9" * 5000 + ".00 GiB"))
