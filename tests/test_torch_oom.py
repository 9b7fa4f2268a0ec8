"""PyTorch's out-of-memory message, in every wording since 1.0, read and explained."""

from __future__ import annotations

import textwrap

import pytest

from gpudash import CachingAllocator, SimulatedDevice
from gpudash.torch_oom import looks_like_torch_oom, read_torch_ooms

GiB = 1 << 30
MiB = 1 << 20

NEW = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
       "total capacity of 23.65 GiB of which 1.12 GiB is free. Including non-PyTorch memory, "
       "this process has 22.52 GiB memory in use. Of the allocated memory 17.86 GiB is "
       "allocated by PyTorch, and 4.26 GiB is reserved by PyTorch but unallocated. If reserved "
       "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
       "True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch"
       ".org/docs/stable/notes/cuda.html#environment-variables)")
OLD = ("RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total "
       "capacity; 130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by "
       "PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to "
       "avoid fragmentation.  See documentation for Memory Management and "
       "PYTORCH_CUDA_ALLOC_CONF")
CACHED = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 11.17 GiB "
          "total capacity; 10.57 GiB already allocated; 22.81 MiB free; 275.01 MiB cached)")
V21 = ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 224.00 MiB. "
       "GPU 0 has a total capacty of 79.15 GiB of which 130.81 MiB is free. Process 3562 has "
       "33.00 GiB memory in use. Including non-PyTorch memory, this process has 46.01 GiB "
       "memory in use. Of the allocated memory 44.93 GiB is allocated by PyTorch, and 582.81 "
       "MiB is reserved by PyTorch but unallocated.")


def test_the_current_wording():
    (o,) = read_torch_ooms("Traceback (most recent call last):\n  File \"x.py\", line 3\n" + NEW)
    assert o.request.value == 2 * GiB and o.device == 0
    assert o.capacity.value == round(23.65 * GiB) and o.free.value == round(1.12 * GiB)
    assert o.unallocated.value == round(4.26 * GiB)
    assert o.reserved.value == round(17.86 * GiB) + round(4.26 * GiB)
    assert o.this_process.value == round(22.52 * GiB)
    assert o.wording == "2.2-2.8" and not o.warnings
    cause, why, settings = o.diagnosis()
    assert cause == "fragmentation" and "4.26 GiB" in why
    assert settings == ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    assert abs(o.request.tol - 0.005 * GiB) <= 1   # two decimals: known to half a unit


def test_the_1_x_wordings_and_what_cached_means():
    (o,) = read_torch_ooms(OLD.replace("47.06 MiB free", "7.06 MiB free"))
    assert o.wording == "1.4-2.0"
    assert o.reserved.value == 188 * MiB
    assert o.unallocated.value == 188 * MiB - round(130.35 * MiB)
    cause, _, settings = o.diagnosis()
    assert cause == "fragmentation" and settings[0].startswith(
        "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:")
    (c,) = read_torch_ooms(CACHED)
    assert c.wording == "1.0-1.3"
    # "cached" was reserved minus allocated
    assert c.unallocated.value == round(275.01 * MiB)
    assert c.reserved.value == round(10.57 * GiB) + round(275.01 * MiB)


def test_other_processes_and_the_2_1_misspelling():
    (o,) = read_torch_ooms(V21)
    assert o.wording == "2.1" and o.processes == [(3562, o.processes[0][1])]
    assert o.processes[0][1].value == 33 * GiB
    assert o.diagnosis()[0] == "fragmentation"     # 582.81 MiB unallocated >= 224 MiB
    # 50 MiB unallocated + 130.81 MiB free < 224 MiB: the 33 GiB of process 3562 is the cause
    tight = V21.replace("582.81 MiB is reserved", "50.00 MiB is reserved")
    (t,) = read_torch_ooms(tight)
    cause, why, settings = t.diagnosis()
    assert cause == "another process" and "3562" in why and settings == []


@pytest.mark.parametrize("dress", [
    lambda m: "\n".join("> " + line for line in textwrap.wrap(m, 70)),        # quoted, wrapped
    lambda m: "E1204 10:11:12.123456 4242 train.py:88] " + m,                  # glog
    lambda m: m.replace("PyTorch", "Pytorch"),                                  # lower case
    lambda m: "[rank3]: " + m.replace(". ", ".\n[rank3]: "),                    # rank per line
])
def test_dressed_messages(dress):
    text = dress(NEW)
    assert looks_like_torch_oom(text)
    (o,) = read_torch_ooms(text)
    assert o.request.value == 2 * GiB and o.unallocated.value == round(4.26 * GiB)


def test_a_fraction_limit_names_the_fraction_that_serves_it():
    # the GPU had 5.12 GiB free, more than the 2 GiB segment: the limit alone refused it
    msg = NEW.replace("Of the allocated", "12.00 GiB allowed; Of the allocated").replace(
        "of which 1.12 GiB is free", "of which 5.12 GiB is free").replace(
        "4.26 GiB is reserved", "0.50 GiB is reserved").replace("PYTORCH_CUDA_ALLOC_CONF",
                                                               "PYTORCH_ALLOC_CONF")
    (o,) = read_torch_ooms(msg)
    assert o.wording == "2.9+" and o.allowed.value == 12 * GiB
    cause, why, settings = o.diagnosis()
    assert cause == "limit"
    need = round(17.86 * GiB) + round(0.5 * GiB) + 2 * GiB
    assert settings[0].startswith("torch.cuda.set_per_process_memory_fraction(0.")
    frac = float(settings[0].split("(")[1].split(")")[0])
    assert frac * round(23.65 * GiB) >= need


def test_contradicting_figures_are_explained_with_a_warning():
    bad = NEW.replace("of which 1.12 GiB is free", "of which 31.12 GiB is free")
    (o,) = read_torch_ooms(bad)
    assert any("contradict" in w for w in o.warnings)
    assert "warning" in o.explain()


@pytest.mark.core
def test_the_models_own_messages_read_back():
    """The model's OutOfMemoryError text, in each version's wording, is read back with its
    figures."""
    for version in ("1.3", "1.13", "2.1", "2.4", "2.11"):
        a = CachingAllocator(SimulatedDevice(GiB), version=version)
        a.deallocate(a.allocate(900 * MiB))      # one 900 MiB segment, cached
        hole = a.allocate(300 * MiB)             # both split from it
        a.allocate(300 * MiB)
        a.deallocate(hole)                       # 600 MiB free in two pieces of 300
        with pytest.raises(Exception) as exc:
            a.allocate(500 * MiB)
        (o,) = read_torch_ooms(str(exc.value))
        assert o.request.value == 500 * MiB, version
        assert abs(o.unallocated.value - 600 * MiB) <= o.unallocated.tol, version
        assert o.diagnosis()[0] == "fragmentation", version


def test_no_message():
    assert read_torch_ooms("all good") == []
    assert not looks_like_torch_oom("Allocator (GPU_0_bfc) ran out of memory trying to allocate")
