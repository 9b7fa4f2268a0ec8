"""Write the sample traces in ``gpudash/samples/`` (package data: ``gpudash.samples``) (deterministic: same files every run).

- ``training.gdtrace``: :func:`~gpudash.workloads.training_loop` (10 steps, 12 layers);
- ``inference.gdtrace``: :func:`~gpudash.workloads.inference_server` (120 requests);
- ``fragmentation.gdtrace``: :func:`~gpudash.workloads.fragmentation_stress`
  (700 rounds, marks at 900 and 250 MiB).

Each stays under 300 KB. Run: ``python benchmarks/make_samples.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpudash.formats.format import write_trace
from gpudash.workloads import fragmentation_stress, inference_server, training_loop

#: file name -> (workload function, keyword arguments)
SAMPLES = {
    "training.gdtrace": (training_loop, {"steps": 10, "layers": 12, "seed": 0}),
    "inference.gdtrace": (inference_server, {"requests": 120, "seed": 0}),
    "fragmentation.gdtrace": (fragmentation_stress,
                              {"rounds": 700, "seed": 0, "high": "900MiB", "low": "250MiB"}),
}

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "gpudash" / "samples"


def make_samples(out: Path = DEFAULT_OUT) -> dict[str, int]:
    """Write every sample into ``out``; returns file name -> bytes written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name, (fn, kwargs) in SAMPLES.items():
        path = out / name
        write_trace(fn(**kwargs), path, overwrite=True)
        sizes[name] = path.stat().st_size
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for name, size in make_samples(args.out).items():
        print(f"{name:<24} {size:>9,} bytes")


if __name__ == "__main__":
    main()
