"""PyTorch's out-of-memory errors explained: from the message, and from a snapshot replayed
to the failure, with each suggested setting proven by a replay."""

from __future__ import annotations

import pickle

import pytest

from gpudash import CachingAllocator, ConfigError, OutOfMemoryError, SimulatedDevice
from gpudash.cli import main
from gpudash.postmortem import explain
from gpudash.torch_explain import TorchExplanation, explain_torch
from gpudash.workloads import caching_snapshot, finetune_calls

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

GiB = 1 << 30

MESSAGE = (
    "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
    "total capacity of 23.65 GiB of which 1.12 GiB is free. Including non-PyTorch memory, "
    "this process has 22.52 GiB memory in use. Of the allocated memory 15.21 GiB is "
    "allocated by PyTorch, and 6.86 GiB is reserved by PyTorch but unallocated. If reserved "
    "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF="
    "expandable_segments:True to avoid fragmentation.\n")


@pytest.fixture(scope="module")
def oom_snapshot(tmp_path_factory):
    path = tmp_path_factory.mktemp("snap") / "ft24.pickle"
    path.write_bytes(pickle.dumps(caching_snapshot(finetune_calls(), device_bytes="24GiB")))
    return path


def the_models_own_message() -> str:
    """What the model raised when the job itself failed (the message PyTorch prints)."""
    a = CachingAllocator(SimulatedDevice(24 * GiB, "cuda:0"), version="2.4")
    ptrs = {}
    for call in finetune_calls():
        if call[0] == "free":
            a.deallocate(ptrs.pop(call[1]))
            continue
        try:
            ptrs[call[1]] = a.allocate(call[2])
        except OutOfMemoryError as exc:
            return str(exc)
    raise AssertionError("the job did not run out of memory")


def test_a_snapshot_is_replayed_to_the_failure_and_the_fix_proven(oom_snapshot, tmp_path):
    e = explain(oom_snapshot)
    assert isinstance(e, TorchExplanation) and e.source == "snapshot"
    assert (e.device, e.device_total, e.cause) == (0, 24 * GiB, "fragmentation")
    assert e.largest_free < e.request <= e.unallocated + e.device_free
    # the state at the failure is the job's: the message rebuilt from it is the one raised
    assert e.message.split(". If reserved")[0] in the_models_own_message()
    proven = {setting: fits for setting, fits, _ in e.proofs}
    assert proven["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"] is True
    text = str(e)
    assert "fits with         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text
    assert "per_process_gpu_memory_fraction" not in text and "allow_growth" not in text
    assert e.dump.extra["layout"] == "pools" and len(e.figures()) == 2
    page = e.write_html(tmp_path / "e.html").read_text()
    assert "Segments of cuda:0" in page and "Pool occupancy" in page


def test_the_message_alone_is_read_and_answered_in_pytorchs_setting(tmp_path, capsys):
    path = tmp_path / "oom.log"
    path.write_text(MESSAGE)
    e = explain(path)
    assert e.source == "message" and e.cause == "fragmentation"
    assert e.settings == ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    assert e.figures() == [] and e.dump is None
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "from PyTorch's message" in out and "would serve it" in out


def test_device_full_has_no_setting_to_offer(tmp_path):
    calls = [("alloc", 1, 6 * GiB), ("alloc", 2, 1 * GiB), ("free", 2), ("alloc", 3, 3 * GiB)]
    path = tmp_path / "full.pickle"
    path.write_bytes(pickle.dumps(caching_snapshot(calls, device_bytes="8GiB")))
    e = explain_torch(path)
    assert e.cause == "device full" and e.settings == [] and e.proofs == []
    assert "no allocator setting makes room" in e.why


def test_what_is_not_pytorchs_or_has_no_failure_is_said(oom_snapshot, tmp_path):
    fits = tmp_path / "fits.pickle"
    fits.write_bytes(pickle.dumps(caching_snapshot(finetune_calls(steps=2, layers=2),
                                                   device_bytes="8GiB")))
    with pytest.raises(Exception, match="no out-of-memory entry"):
        explain(fits)
    with pytest.raises(ConfigError, match="request is for a TensorFlow or JAX dump"):
        explain(oom_snapshot, request="1GiB")
    with pytest.raises(ConfigError, match="cuda:N"):
        explain(oom_snapshot, allocator="GPU_0_bfc")
    text = tmp_path / "plain.log"
    text.write_text("nothing here\n")
    with pytest.raises(Exception, match="no out-of-memory message in the file; expected .*PyTorch.*TensorFlow.*JAX"):
        explain(text, framework="torch")


from shared_files import EXTERNAL as _EXTERNAL_DIR  # noqa: E402

EXTERNAL = _EXTERNAL_DIR / "code_location.memory_snapshot.pickle"


@pytest.mark.skipif(not EXTERNAL.exists(), reason="../shared/reference/external is not here")
def test_a_real_snapshots_oom_on_its_second_gpu():
    """A real job's snapshot (three GPUs, expandable segments): the failure on cuda:1 was a
    full GPU, not fragmentation: nothing to suggest."""
    e = explain(EXTERNAL)
    assert (e.device, e.cause, e.settings, e.total_known) == (1, "device full", [], False)
    assert "Tried to allocate 4.94 GiB. GPU 1 has a total capacity of 78.51 GiB" in e.message
    assert "held outside PyTorch's allocator" not in str(e)
    assert "what else held the GPU is not in the snapshot" in str(e)
