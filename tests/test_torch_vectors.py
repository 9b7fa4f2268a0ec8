"""PyTorch's own allocator, recorded on a GPU under each setting of the validation plan
(``benchmarks/gpu_record_torch_vectors.py`` writes ``tests/data/torch_vectors/``: a snapshot
and, beside it, the fraction, the device's total memory, the conf string and PyTorch's
version, which a snapshot does not record): the model replays each exactly. Skipped where no
vectors have been recorded yet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpudash.trace.torch_replay import from_snapshot, replay_exact
from gpudash.formats.torch_snapshot import load_torch_snapshot_dict

VECTORS = Path(__file__).resolve().parent / "data" / "torch_vectors"
FILES = sorted(p.stem for p in VECTORS.glob("*.json")) if VECTORS.is_dir() else []


@pytest.mark.skipif(not FILES, reason="no PyTorch vectors recorded yet (needs a GPU: "
                                      "benchmarks/gpu_record_torch_vectors.py)")
@pytest.mark.parametrize("name", FILES)
def test_pytorch_vectors_replay_exactly(name):
    side = json.loads((VECTORS / f"{name}.json").read_text())
    snap = load_torch_snapshot_dict(VECTORS / f"{name}.pickle")
    for dev, tt in from_snapshot(snap, name).items():
        res = replay_exact(tt, conf=side["conf"] or None, fraction=side["fraction"],
                           device_total=side["device_total"], version=side["torch_version"])
        assert res.start == "empty", res.summary()
        assert res.exact, f"{name}: {res.summary()}\n{res.final_mismatch}\n{res.divergence}"
