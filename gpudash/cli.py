"""The ``gpudash`` command (also ``python -m gpudash``).

Subcommands: ``demo``, ``replay``, ``whatif``, ``explain``, ``holders``, ``diff``, ``info``,
``convert``, ``lab``. Every one has ``--help``. Exit code 0 on success; 1 with a one-line
reason for a user error (bad file, bad value) -- never a traceback for those.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from ._errors import ConfigError, GpudashError
from ._units import format_bytes, parse_bytes
from ._version import __version__
from .models import TORCH, fraction_text, model_for, trace_model

__all__ = ["main"]

WORKLOADS = ("training", "inference", "fragmentation")
#: What ``gpudash convert --to`` writes.
_SAVE_FORMATS = ("gdtrace", "torch-json", "torch-pickle", "perfetto")


class _UserError(Exception):
    """A problem with what the user asked for: reported in one line, exit code 1."""


#: Exit codes, for scripts and CI (also in ``gpudash --help``).
EXIT_OK = 0
EXIT_ERROR = 1     # bad input or arguments: one line on stderr
EXIT_OOM = 3       # replay: the trace ran out of memory under the settings given
EXIT_BUG = 70      # an unexpected error inside gpudash (GPUDASH_DEBUG=1 shows the traceback)
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141    # the reader of the output went away (`gpudash ... | head`): 128 + SIGPIPE

EXIT_CODES_TEXT = ("exit codes: 0 success; 1 bad input or arguments (one line on stderr); "
                   "3 replay ran out of memory; 70 an internal error (GPUDASH_DEBUG=1 for the "
                   "traceback); 130 interrupted; 141 the output's reader went away, quietly")

#: Simulated device sizes the commands accept.
MIN_DEVICE = 1 << 20
MAX_DEVICE = 1 << 50
#: Bounds of the other numeric arguments: what makes sense, so a typo is refused at once
#: instead of running until killed (a demo of 10**20 steps).
MAX_STEPS = 1000          # demo: the fragmentation workload takes about 0.05 s a step
MAX_SEED = (1 << 63) - 1
MAX_JOBS = 256
MAX_DEVICE_INDEX = (1 << 15) - 1   # a trace's device column is int16
MAX_DUMP = 1 << 20
MAX_FRACTIONS = 100       # --fractions: each one is two replays
#: The report ``gpudash demo`` writes when no --html is given, and the title it gives it: an
#: existing file with that title is the demo's own, and is replaced without --overwrite.
DEMO_REPORT = Path("gpudash-demo.html")
DEMO_TITLE = "gpudash demo: "


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 with usage; we say one line
        raise _UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except GpudashError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _device_arg(text: str) -> int:
    """A simulated device size: 1 MiB to 1 PiB (``1.5`` alone would be a 1-byte device)."""
    n = _bytes_arg(text)
    if n < MIN_DEVICE:
        raise argparse.ArgumentTypeError(
            f"a device size must be at least 1 MiB; got {text!r} = {n} B (give a unit: "
            f"{text}GiB?)")
    if n > MAX_DEVICE:
        raise argparse.ArgumentTypeError(f"a device size must be at most 1 PiB; got {text!r}")
    return n


def _int_arg(lo: int, hi: int):
    """An argparse type: an integer in lo..hi (refused in one line naming the bounds)."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer; got {text[:40]!r}"
                                             ) from None
        if not lo <= value <= hi:
            shown = text if len(text) <= 24 else text[:20] + "..."
            raise argparse.ArgumentTypeError(f"must be {lo:,}..{hi:,}; got {shown}")
        return value
    return parse


def _fraction_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a fraction must be a number; got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(
            f"a fraction must be in 0..1 (PyTorch's set_per_process_memory_fraction, "
            f"TensorFlow's per_process_gpu_memory_fraction with 0 for its default, JAX's "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION; a simulated device has no unified memory to "
            f"oversubscribe); got {text}")
    return value


def _fractions_arg(text: str) -> list[float]:
    parts = [part for part in text.split(",") if part.strip()]
    if len(parts) > MAX_FRACTIONS:
        raise argparse.ArgumentTypeError(f"at most {MAX_FRACTIONS} fractions (each is two "
                                         f"replays); got {len(parts)}")
    return [_fraction_arg(part) for part in parts]


def _add_settings(p: argparse.ArgumentParser, *, fraction: bool = True,
                  torch: bool = False) -> None:
    if fraction:
        p.add_argument("--fraction", type=_fraction_arg, default=None, metavar="F",
                       help="PyTorch: torch.cuda.set_per_process_memory_fraction (default: "
                            "none); TensorFlow: per_process_gpu_memory_fraction, JAX: "
                            "XLA_PYTHON_CLIENT_MEM_FRACTION (default: TensorFlow's rule, free "
                            "memory minus the system reserve)")
    p.add_argument("--growth", action=argparse.BooleanOptionalAction, default=None,
                   help="TensorFlow/JAX: allow_growth (JAX: XLA_PYTHON_CLIENT_PREALLOCATE="
                        "false); default: what the trace was recorded with, else off. "
                        "PyTorch always grows on demand")
    if torch:
        p.add_argument("--device", type=_device_arg, default=None, metavar="SIZE",
                       help="simulated device size, 1MiB..1PiB, e.g. 16GiB (default: what "
                            "the trace shows, else 16GiB for TensorFlow and JAX and, for "
                            "PyTorch, the smallest common GPU that held the trace; the "
                            "output says which)")
    else:
        p.add_argument("--device", type=_device_arg, default=16 << 30, metavar="SIZE",
                       help="simulated device size, 1MiB..1PiB, e.g. 16GiB (default 16GiB)")
    p.add_argument("--gc", action=argparse.BooleanOptionalAction, default=None,
                   help="TensorFlow's BFC: garbage collection of free regions before an OOM "
                        "(default: off; PyTorch: --conf garbage_collection_threshold:F)")
    if torch:
        p.add_argument("--conf", default=None, metavar="TEXT",
                       help="PyTorch's PYTORCH_CUDA_ALLOC_CONF, e.g. "
                            "expandable_segments:True,max_split_size_mb:128 (default: what "
                            "the snapshot was recorded with)")
        p.add_argument("--torch-version", default=None, metavar="X.Y",
                       help="the PyTorch whose allocator rules to follow (default: the oldest "
                            "that writes the snapshot's fields)")


def _formats() -> list[str]:
    from .trace.io import FORMATS

    return list(FORMATS)


def _add_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default=None, choices=_formats(), metavar="FORMAT",
                   help="read the input as this format instead of guessing from its first "
                        "bytes: " + ", ".join(_formats()))


def _add_device_choice(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--device-index", type=_int_arg(0, MAX_DEVICE_INDEX), default=None,
                   metavar="N",
                   help="only this device of a trace with several (default: every device)")
    g.add_argument("--allocator", default=None, metavar="NAME",
                   help="only the device of this allocator, e.g. GPU_1_bfc")


_AT_HELP = ("peak (the first peak of bytes allocated), oom (just before the first refused "
            "allocation), end, an event index N, or a time from the trace's first event with "
            "a unit: 12.5s, 300ms (default peak)")


def _add_attribution(p: argparse.ArgumentParser) -> None:
    from .trace.holders import BY

    p.add_argument("--by", choices=BY, default=None,
                   help="group by: line (default where the trace has call stacks), function, "
                        "file, stack, annotation, category, holder (default otherwise)")
    p.add_argument("--device", type=_int_arg(0, MAX_DEVICE_INDEX), default=None, metavar="N",
                   help="only device N (default: the trace's only device, or all; --at oom: "
                        "the failing device)")
    p.add_argument("--user-code", default=None, metavar="REGEX",
                   help="frames whose filename matches REGEX are your code (default: .py files "
                        "outside torch, site-packages and the standard library)")
    p.add_argument("--limit", type=_int_arg(1, 1_000_000), default=20, metavar="N",
                   help="print the first N rows (default 20)")


def _vary_arg(text: str) -> tuple[str, list]:
    """``KNOB=V,V,...``: a PyTorch knob and the values a sweep crosses."""
    knob, sep, values = text.partition("=")
    if not sep or not knob.strip() or not values.strip():
        raise argparse.ArgumentTypeError(f"expected KNOB=V,V,... (e.g. "
                                         f"max_split_size_mb=none,128); got {text[:60]!r}")
    out: list = []
    for v in values.split(","):
        v = v.strip()
        if v.lower() in ("none", "trace"):
            out.append(None)
            continue
        try:
            out.append(int(v))
        except ValueError:
            try:
                out.append(float(v))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{knob}: {v!r} is not a number (or none)"
                                                 ) from None
    if len(out) > MAX_FRACTIONS:
        raise argparse.ArgumentTypeError(f"{knob}: at most {MAX_FRACTIONS} values")
    return knob.strip(), out


def _add_framework(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--framework", choices=("tensorflow", "jax", "torch"), default=None,
                   help=text)


def _model_of(args: argparse.Namespace, trace: Any) -> Any:
    """The allocator model a replay or what-if command runs: ``--framework``'s, else the
    trace's; another model's flags refused by name (:meth:`AllocatorModel.refuse_flags`)."""
    model = model_for(args.framework) if args.framework else trace_model(trace)
    refusal = model.refuse_flags(args)
    if refusal is not None:
        raise _UserError(refusal)
    return model


def _model_kwargs(args: argparse.Namespace, model: Any, index: Any, dev: int) -> dict:
    """The replay settings the command's flags give, for ``model``
    (:meth:`AllocatorModel.cli_kwargs`)."""
    kwargs: dict[str, Any] = {"allocator": model.name}
    if args.device is not None:
        kwargs["device_bytes"] = args.device
    kwargs.update(model.cli_kwargs(args, index.settings(dev)))
    return kwargs


def _chosen_devices(trace: Any, args: argparse.Namespace) -> list[int]:
    """The devices a replay/whatif command works on (all, unless one is chosen)."""
    import numpy as np

    present = np.unique(trace.columns["device"]).tolist() or [0]
    names = {int(d["index"]): d.get("name", "") for d in trace.meta.get("devices") or []}
    listing = ", ".join(f"{d} ({names.get(d) or 'unnamed'})" for d in present)
    if args.device_index is not None:
        if args.device_index not in present:
            raise _UserError(f"{args.trace}: no device {args.device_index}; its devices are "
                             f"{listing}")
        return [args.device_index]
    if args.allocator is not None:
        hits = [d for d in present if names.get(d) == args.allocator]
        if not hits:
            raise _UserError(f"{args.trace}: no allocator named {args.allocator!r}; its "
                             f"devices are {listing}")
        return hits
    return present


def _parser() -> _Parser:
    parser = _Parser(prog="gpudash", description="See, explain and tune GPU memory for "
                     "PyTorch, TensorFlow and JAX: their allocators (PyTorch's caching "
                     "allocator, the BFC allocator of TensorFlow and XLA), live and replayed "
                     "from PyTorch snapshots and profiler traces, TensorFlow logs and "
                     "profiles, JAX/XLA dumps, RMM and CuPy logs.", epilog=EXIT_CODES_TEXT)
    parser.add_argument("--version", action="version", version=f"gpudash {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("demo", help="run a synthetic workload live on a simulated device "
                       "through PyTorch's, TensorFlow's or JAX's allocator and write the HTML "
                       "report",
                       description="Run a synthetic workload through a gpudash session on a "
                       "simulated device and write the HTML report. --framework tensorflow "
                       "(the default) or jax: the BFC allocator, with its memory log at the "
                       "peak, in TensorFlow's or XLA's settings; --framework torch: PyTorch's "
                       "caching allocator, with torch.cuda.memory_summary()'s figures at the "
                       "peak and the smallest set_per_process_memory_fraction that fits, as a "
                       "line to paste with PYTORCH_CUDA_ALLOC_CONF.")
    p.add_argument("--workload", choices=WORKLOADS, default="training")
    p.add_argument("--steps", type=_int_arg(1, MAX_STEPS), default=8,
                   help=f"size of the workload, 1..{MAX_STEPS} (default 8)")
    p.add_argument("--seed", type=_int_arg(0, MAX_SEED), default=0)
    _add_settings(p)
    _add_framework(p, "whose allocator runs the workload, in its words: torch (PyTorch's "
                      "caching allocator), tensorflow (default) or jax (the BFC allocator)")
    p.add_argument("--conf", default=None, metavar="TEXT",
                   help="PyTorch: PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True "
                        "(default: PyTorch's defaults)")
    p.add_argument("--html", type=Path, default=None, metavar="OUT",
                   help=f"report file (default {DEMO_REPORT}, which a later demo replaces)")
    p.add_argument("--no-html", action="store_true", help="do not write the report")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing report named with --html")

    p = sub.add_parser("replay", help="replay a trace through its framework's allocator model",
                       description="Replay an allocation trace (gpudash, TensorFlow log or "
                       "profile, PyTorch snapshot or profiler trace, RMM CSV, CuPy hook) on a "
                       "simulated device, through "
                       "TensorFlow's BFC allocator or PyTorch's caching allocator (a PyTorch "
                       "snapshot with its own settings: exactly, every segment and address "
                       "checked).")
    p.add_argument("trace", type=Path, metavar="TRACE")
    _add_format(p)
    _add_settings(p, torch=True)
    _add_device_choice(p)
    _add_framework(p, "replay through this framework's allocator (default: the trace's own: "
                      "PyTorch's caching allocator for a PyTorch snapshot, else BFC)")
    p.add_argument("--deferred", type=_bytes_arg, default=None, metavar="BYTES",
                   help="deferred_deletion_bytes, as TensorFlow reads it (0 = 8 MiB). "
                        "Default: none, frees apply at once, as the trace records them")
    p.add_argument("--html", type=Path, default=None, metavar="OUT", help="write a report")
    p.add_argument("--overwrite", action="store_true", help="replace an existing report")

    p = sub.add_parser("whatif", help="the smallest fraction a trace needs, and a sweep",
                       description="Find the smallest memory fraction at which the trace "
                       "replays without running out of memory (TensorFlow's "
                       "per_process_gpu_memory_fraction, JAX's XLA_PYTHON_CLIENT_MEM_FRACTION, "
                       "PyTorch's set_per_process_memory_fraction), and sweep settings "
                       "(allow_growth; for PyTorch expandable_segments).")
    p.add_argument("trace", type=Path, metavar="TRACE")
    _add_format(p)
    _add_settings(p, fraction=False, torch=True)
    _add_device_choice(p)
    p.add_argument("--fractions", type=_fractions_arg, default=None, metavar="F,F,...",
                   help="fractions to sweep (default 0.1..1.0)")
    p.add_argument("--vary", type=_vary_arg, action="append", default=None,
                   metavar="KNOB=V,V,...",
                   help="PyTorch: also sweep one of its knobs, e.g. "
                        "max_split_size_mb=none,128,512 or garbage_collection_threshold=none,0.8 "
                        "(none: the trace's own setting); repeat for more")
    _add_framework(p, "answer in this framework's allocator and settings, and print the "
                      "lines to paste (default: the trace's own; lines for a PyTorch trace; "
                      "jax: replay with garbage collection off, as XLA runs its BFC)")
    p.add_argument("--jobs", type=_int_arg(1, MAX_JOBS), default=min(2, os.cpu_count() or 1),
                   help=f"processes for the replays (the bisection's and the sweep's), "
                        f"1..{MAX_JOBS} (default: up to 2)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="run the replays as tasks on this Dask scheduler "
                        "(tcp://host:8786; needs gpudash[dask]; --jobs is then ignored; "
                        "connecting waits Dask's distributed.comm.timeouts.connect)")
    p.add_argument("--html", type=Path, default=None, metavar="OUT", help="write a report")
    p.add_argument("--overwrite", action="store_true", help="replace an existing report")

    p = sub.add_parser(
        "explain", help="why an allocation ran out of memory, from the allocator's dump",
        description="Explain an out-of-memory error: PyTorch's message ('CUDA out of "
        "memory. Tried to allocate ...', pasted or in a log) or its memory snapshot "
        "(replayed to the failure; without an 'oom' entry, the state it holds), the "
        "allocator dump in a TensorFlow, JAX or XLA log (pasted or whole), or the MemoryDump "
        "protobuf TF_BFC_MEMORY_DUMP writes; several errors: the last unless --dump or "
        "--allocator. It gives the request, what was allocated, reserved or in use, the "
        "free memory and the largest free block, the cause (fragmentation, the limit, "
        "another process, the device full), the setting that would have served the "
        "request, in the words of the framework that failed, and the holders where the "
        "input names them.")
    p.add_argument("path", type=Path, metavar="PATH", help="a log or a MemoryDump protobuf")
    p.add_argument("--device", type=_device_arg, default=None, metavar="SIZE",
                   help="device size, e.g. 16GiB: also give the smallest limit as a memory "
                        "fraction (PyTorch's set_per_process_memory_fraction, TensorFlow's "
                        "per_process_gpu_memory_fraction, JAX's "
                        "XLA_PYTHON_CLIENT_MEM_FRACTION); for a PyTorch snapshot, the GPU's "
                        "size where it does not say")
    p.add_argument("--framework", choices=("tensorflow", "jax", "torch"), default=None,
                   help="who printed the dump, for the setting to answer in (default: read "
                        "from the file; a protobuf is TensorFlow's; PyTorch's message or "
                        "snapshot is PyTorch's)")
    p.add_argument("--allocator", default=None, metavar="NAME",
                   help="the error of this device: PyTorch's cuda:1, TensorFlow's or XLA's "
                        "allocator name (GPU_1_bfc)")
    p.add_argument("--conf", default=None, metavar="TEXT",
                   help="PyTorch: the job's PYTORCH_CUDA_ALLOC_CONF (default: the snapshot's "
                        "allocator_settings)")
    p.add_argument("--torch-version", default=None, metavar="X.Y",
                   help="PyTorch: whose allocator rules to follow")
    p.add_argument("--dump", type=_int_arg(-MAX_DUMP, MAX_DUMP), default=None, metavar="N",
                   help="the N-th error of the input: PyTorch's message or snapshot 'oom' "
                        "entry, TensorFlow's or XLA's dump (1 = the first; -1 = the last)")
    p.add_argument("--request", type=_bytes_arg, default=None, metavar="SIZE",
                   help="TensorFlow: the bytes asked for, when the dump does not say (a "
                        "protobuf)")
    p.add_argument("--limit", type=_bytes_arg, default=None, metavar="SIZE",
                   help="TensorFlow: the allocator's limit, when the dump does not say (a "
                        "protobuf)")
    p.add_argument("--html", type=Path, default=None, metavar="OUT",
                   help="write a report with the segment or chunk map and the pools or bins")
    p.add_argument("--overwrite", action="store_true", help="replace an existing report")

    p = sub.add_parser(
        "holders", help="who holds the memory at a moment: bytes by line, stack, category...",
        description="The allocations live at a moment of a trace, grouped by who made them: "
        "the line of your own code that allocated (from the call stacks a PyTorch snapshot "
        "or a profiler trace recorded with with_stack=True records), its function, file or "
        "whole stack, the record_function annotation open, "
        "a category (parameters, gradients, optimizer state, activations, temporaries), or "
        "the holder names of a TensorFlow profile or log (the op of a PyTorch profiler "
        "trace). Largest first; the output says "
        "which moment, device and user-code rule it used, and what was missing.")
    p.add_argument("trace", type=Path, metavar="TRACE")
    _add_format(p)
    _add_attribution(p)
    p.add_argument("--at", default="peak", metavar="MOMENT", help=_AT_HELP)
    p.add_argument("--stacks", action="store_true",
                   help="under each row, the stack of its largest allocation (your code first)")

    p = sub.add_parser(
        "diff", help="bytes gained and lost by line between two traces or two moments",
        description="Compare who holds the memory: two traces of one program (gpudash diff A "
        "B: at the same moment of each, or --at for A and --to for B), one trace at two "
        "moments (gpudash diff A --at peak --to end), or what stays live from one iteration "
        "to the next (gpudash diff A --iterations: iterations from the snapshot's or "
        "profiler trace's ProfilerStep/Optimizer.step annotations, or --boundaries). Largest "
        "change first.")
    p.add_argument("a", type=Path, metavar="A")
    p.add_argument("b", type=Path, metavar="B", nargs="?", default=None,
                   help="a second trace (optional)")
    _add_format(p)
    _add_attribution(p)
    p.add_argument("--at", default="peak", metavar="MOMENT",
                   help="the first moment (of A); " + _AT_HELP)
    p.add_argument("--to", default=None, metavar="MOMENT",
                   help="the second moment: of B (default: --at), or of A when there is no B")
    p.add_argument("--iterations", action="store_true",
                   help="one trace: what each iteration allocated that is still live at the "
                        "end of the next")
    p.add_argument("--boundaries", default=None, metavar="M,M,...",
                   help="with --iterations: where iterations end (event indices or times "
                        "such as 2.5s), instead of the annotations")

    sub.add_parser("info", help="the devices gpudash sees (NVML or simulated)",
                   description="List the GPUs NVML reports, or the simulated device gpudash "
                   "would use.")

    p = sub.add_parser("convert", help="convert a trace between formats, or to Perfetto",
                       description="Read any trace gpudash knows (gpudash's .gdtrace; "
                       "TensorFlow's allocator log and profiles; PyTorch's memory snapshots and "
                       "profiler traces, the .json or .json.gz of export_chrome_trace recorded "
                       "with profile_memory=True; RMM CSV; CuPy hook output) and write it as a "
                       "gpudash trace (.gdtrace), a PyTorch snapshot (.json / .pickle) or, with "
                       "--to perfetto, Chrome Trace Event JSON for ui.perfetto.dev and "
                       "chrome://tracing: per device, counters of the bytes allocated and "
                       "reserved (TensorFlow/JAX: in use and pool), each out-of-memory error "
                       "as an instant, record_function ranges as slices (gzipped when OUT ends "
                       "in .gz). --merge appends those events to a PyTorch profiler trace "
                       "(export_chrome_trace), aligned on its baseTimeNanoseconds, so memory "
                       "lines up with its kernels.")
    p.add_argument("input", type=Path, metavar="IN")
    p.add_argument("output", type=Path, metavar="OUT",
                   help="without --to, its extension chooses the format: .gdtrace, .json or "
                        ".pickle/.pkl")
    p.add_argument("--to", default=None, choices=_SAVE_FORMATS, metavar="FORMAT",
                   help="the format to write: " + ", ".join(_SAVE_FORMATS)
                        + " (perfetto: Chrome Trace Event JSON)")
    p.add_argument("--merge", type=Path, default=None, metavar="PROFILER.json",
                   help="with --to perfetto (implied): a PyTorch profiler trace (.json or "
                        ".json.gz) to write the memory events into; OUT is that trace with "
                        "them added (OUT may be the same file, with --overwrite)")
    p.add_argument("--offset-ns", type=_int_arg(-(1 << 62), 1 << 62), default=None,
                   metavar="NS",
                   help="with --to perfetto: nanoseconds to add to the trace's times to reach "
                        "Unix-epoch time (needed to merge a trace whose times are not "
                        "wall-clock: a synthetic workload, a replay, a snapshot without "
                        "time_us)")
    p.add_argument("--max-points", type=_int_arg(3, 1 << 40), default=None, metavar="N",
                   help="with --to perfetto: the most points per counter and device (default "
                        "50,000; above it each span of time keeps its highest, lowest and "
                        "last value)")
    _add_format(p)
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")

    p = sub.add_parser(
        "lab", help="open the quick-start notebook in JupyterLab", allow_abbrev=False,
        description="Start JupyterLab on the quick-start notebook (a copy is written to the "
        "current directory when gpudash is installed from a wheel). Runs as root too, passing "
        "JupyterLab's --allow-root. Any further arguments (after --, or ones gpudash lab does "
        "not know, like --ServerApp.port_retries=0) go to JupyterLab unchanged.")
    p.add_argument("--port", type=_int_arg(0, 65535), default=8888,
                   help="port to listen on (default 8888)")
    p.add_argument("--ip", default=None, help="address to listen on (JupyterLab's default: "
                   "localhost; 0.0.0.0 for every interface)")
    p.add_argument("--token", default=None,
                   help="the access token (default: JupyterLab makes one and prints it)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    return parser


# ---------------------------------------------------------------------------- commands
#: The library's keyword hints (``pass format=...``) as this command's flags: messages and
#: notes come from the library, which names its own keywords.
_FLAGS = {"format": "--format FORMAT", "overwrite": "--overwrite",
          "device_bytes": "--device SIZE", "conf": "--conf TEXT",
          "torch_version": "--torch-version X.Y", "boundaries": "--boundaries M,M,...",
          "fractions": "--fractions F,F,...", "allocator": "--framework",
          "jobs": "--jobs N", "fraction": "--fraction F"}
_PASS = re.compile(r"\bpass (\w+)=(?:\.\.\.|True|'(\w+)')?(?: \(--[^)]*\)| or --[\w-]+(?: [A-Z.,]+)?)?")


def _flags(text: str) -> str:
    """``text`` with the library's ``pass name=...`` hints given as the command's flags
    (``pass format=...`` -> ``pass --format FORMAT``); hints without a flag stay."""
    def flag(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        named = m.group(0).partition(" (--")[2]
        if named:   # the hint names its flag already: that alone
            return f"pass --{named.rstrip(')')}"
        if name not in _FLAGS:
            return m.group(0)
        if name == "allocator" and value:
            return f"pass --framework {value}"
        return f"pass {_FLAGS[name]}"
    return _PASS.sub(flag, text) if "pass " in text else text


def _say(*parts: Any) -> None:
    print(*(_flags(p) if isinstance(p, str) else p for p in parts), flush=True)


def _load(path: Path, format: str | None = None):
    from .trace import load_trace

    return load_trace(path, format=format)


def _check_out(path: Path | None, overwrite: bool) -> None:
    """Refuse an output before any work: it exists, or its folder does not."""
    if path is None:
        return
    if path.exists() and not overwrite:
        raise _UserError(f"{path} exists; pass --overwrite to replace it")
    if path.exists() and path.is_dir():
        raise _UserError(f"{path} is a directory; name a file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise _UserError(f"cannot write {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise _UserError(f"cannot write {path}: the folder {parent} is not writable")


def _workload_calls(name: str, steps: int, seed: int):
    from .trace import workloads as w

    if steps < 1:
        raise _UserError(f"--steps must be >= 1; got {steps}")
    if name == "training":
        return w.training_loop_calls(steps=steps, seed=seed)
    if name == "inference":
        return w.inference_server_calls(requests=50 * steps, seed=seed)
    return w.fragmentation_stress_calls(rounds=250 * steps, seed=seed)


def cmd_demo(args: argparse.Namespace) -> int:
    from .options import ConfigProto
    from .recorder import Recorder
    from .session import Session
    from .trace.workloads import run_workload

    html_out, overwrite = args.html, args.overwrite
    if html_out is None:   # the demo's own report: a later demo replaces it
        html_out = DEMO_REPORT
        overwrite = overwrite or _is_demo_report(html_out)
    model = model_for(args.framework or "tensorflow")
    refusal = model.refuse_flags(args)
    if refusal is not None:
        raise _UserError(refusal.replace("this replays", "this demo runs"))
    if args.framework == "jax" and args.gc:
        raise _UserError("--framework jax runs XLA's BFC, which never garbage-collects; "
                         "drop --gc")
    if not args.no_html:
        _check_out(html_out, overwrite)
    if model.streams:   # PyTorch's demo: its calls on streams, memory_summary() at the peak
        return _demo_torch(args, html_out, overwrite)
    config = ConfigProto(allow_soft_placement=True)
    config.gpu_options.allow_growth = bool(args.growth)  # None: TensorFlow's default, off
    if args.fraction is not None:
        config.gpu_options.per_process_gpu_memory_fraction = args.fraction
    _say(f"gpudash demo: {args.workload} workload on a simulated "
         f"{format_bytes(args.device)} device")
    with Session(config, simulate=args.device, environ={}) as sess:
        dev = sess.devices[0]
        alloc = dev.allocator
        _say(f"  allocator {alloc.name}: limit {format_bytes(alloc.memory_limit)}, "
             f"allow_growth={alloc.allow_growth}")
        rec = Recorder(sess)
        peak = {"bytes": -1, "log": ""}

        def allocate(nbytes: int) -> int:
            ptr = sess.allocate(nbytes)
            if alloc.bytes_in_use > peak["bytes"]:
                peak["bytes"] = alloc.bytes_in_use
                peak["pending"] = True
            return ptr

        def deallocate(ptr: int) -> None:
            if peak.pop("pending", False):  # about to fall from a peak: keep its log
                peak["log"] = alloc.dump_memory_log(0)
            sess.free_now(ptr)

        run = run_workload(_workload_calls(args.workload, args.steps, args.seed),
                           allocate, deallocate)
        if peak.pop("pending", False):
            peak["log"] = alloc.dump_memory_log(0)
        stats = alloc.stats()
        trace = rec.to_trace({"workload": args.workload})
        rec.detach()
    _say("")
    who = ("the BFC allocator's memory log at the peak, as XLA prints it for JAX"
           if args.framework == "jax" else "TensorFlow's memory log at the peak")
    _say(f"{who} ({format_bytes(peak['bytes'])} in use):")
    _say(peak["log"])
    _say("")
    _say(f"{run.allocs} allocations, {run.frees} frees, {run.ooms} out of memory; "
         f"peak in use {format_bytes(stats.peak_bytes_in_use)}, "
         f"peak pool {format_bytes(stats.peak_pool_bytes)}; {len(trace)} events recorded")
    if not args.no_html:
        from .report import write_report

        write_report(trace, html_out, title=f"{DEMO_TITLE}{args.workload}",
                     device_bytes=args.device, overwrite=overwrite,
                     replay_options={"allow_growth": bool(args.growth),
                                     "fraction": args.fraction, "garbage_collection": args.gc})
        _say(f"report: {html_out}")
    return 0


def _demo_torch(args: argparse.Namespace, html_out: Path, overwrite: bool) -> int:
    """``gpudash demo --framework torch``: the workload through PyTorch's caching allocator,
    its ``memory_summary()`` at the peak, and the smallest fraction that fits as the lines
    to paste."""
    from .recorder import Recorder
    from .session import Session
    from .trace.whatif import min_fraction
    from .trace.workloads import run_workload

    try:
        sess = Session(allocator="torch", config=args.conf or "", simulate=args.device,
                       environ={}, fraction=args.fraction)
    except ConfigError as exc:
        raise _UserError(str(exc)) from None
    _say(f"gpudash demo: {args.workload} workload on a simulated "
         f"{format_bytes(args.device)} device, through PyTorch's caching allocator")
    with sess:
        alloc = sess.devices[0].allocator
        _say(f"  {alloc.name}: limit {format_bytes(alloc.memory_limit)}, "
             f"{TORCH.settings_text({'conf': alloc.config.as_conf(), 'fraction': args.fraction})}")
        rec = Recorder(sess)
        peak = {"bytes": -1, "summary": ""}

        def allocated() -> int:
            return int(alloc.memory_stats()["allocated_bytes.all.current"])

        def allocate(nbytes: int) -> int:
            ptr = sess.allocate(nbytes)
            if allocated() > peak["bytes"]:
                peak["bytes"] = allocated()
                peak["pending"] = True
            return ptr

        def deallocate(ptr: int) -> None:
            if peak.pop("pending", False):  # about to fall from a peak: keep its summary
                peak["summary"] = alloc.memory_summary()
            sess.free(ptr)

        run = run_workload(_workload_calls(args.workload, args.steps, args.seed),
                           allocate, deallocate)
        if peak.pop("pending", False):
            peak["summary"] = alloc.memory_summary()
        st = alloc.memory_stats()
        trace = rec.to_trace({"workload": args.workload})
        rec.detach()
    _say("")
    _say(f"torch.cuda.memory_summary() at the peak ({format_bytes(max(peak['bytes'], 0))} "
         "allocated):")
    _say(peak["summary"])
    _say("")
    _say(f"{run.allocs} allocations, {run.frees} frees, {run.ooms} out of memory; "
         f"peak allocated {format_bytes(int(st['allocated_bytes.all.peak']))}, "
         f"peak reserved {format_bytes(int(st['reserved_bytes.all.peak']))}, "
         f"{int(st['num_device_alloc'])} segment(s) from cudaMalloc; {len(trace)} events "
         "recorded")
    try:
        best = min_fraction(trace, args.device, allocator="torch", conf=args.conf or "")
    except ConfigError as exc:   # settings PyTorch does not support together
        _say(f"no fraction to paste: {exc}")
        best = None
    if best is not None and best.fraction is not None:
        _say(f"smallest set_per_process_memory_fraction that fits: "
             f"{fraction_text(best.fraction)} (bisected to within {best.tolerance:g}); "
             "PyTorch: paste these (the environment variable before PyTorch starts; the "
             "fraction any time):")
        for line in best.paste_lines("torch"):
            _say(f"  {line}")
    elif best is not None:
        _say(f"does not fit on a {format_bytes(args.device)} device even at fraction 1.0")
    if not args.no_html:
        from .report import write_report

        write_report(trace, html_out, title=f"{DEMO_TITLE}{args.workload}",
                     device_bytes=args.device, overwrite=overwrite,
                     replay_options={"allocator": "torch", "fraction": args.fraction,
                                     "conf": args.conf or None})
        _say(f"report: {html_out}")
    return 0


def _is_demo_report(path: Path) -> bool:
    """Whether ``path`` is a report an earlier ``gpudash demo`` wrote (its title says so)."""
    try:
        with open(path, "rb") as f:
            head = f.read(2048)
    except OSError:
        return False
    return head.startswith(b"<!DOCTYPE html>") and \
        f"<title>{DEMO_TITLE}".encode() in head


def cmd_replay(args: argparse.Namespace) -> int:
    from .trace.replay import DeviceIndex

    _check_out(args.html, args.overwrite)
    trace = _load(args.trace, args.format)
    devices = _chosen_devices(trace, args)
    _refuse_empty(trace, args, devices, "replay")
    index = DeviceIndex(trace)   # looked up once: linear in devices + events
    out_of_memory = False
    if len(devices) > 1:
        _say(f"{args.trace}: {len(devices)} devices, each replayed with its own allocator "
             "(--device-index N or --allocator NAME for one)")
    model = _model_of(args, trace)
    for dev in devices:
        kwargs = _model_kwargs(args, model, index, dev)
        if args.fraction is not None:
            kwargs["fraction"] = args.fraction
        try:
            result = index.replay(dev, progress=True, record=False, **kwargs)
        except ConfigError as exc:
            raise _UserError(str(exc)) from None
        label = f" {index.label(dev)}:" if len(devices) > 1 or dev else ""
        device_text = format_bytes(result.options["device_bytes"])
        from_log = (args.fraction is None and "memory_limit" in model.inputs()
                    and index.source_limit(dev) is not None)
        settings_text = model.settings_text(result.options)
        _say(f"{args.trace}:{label} {result.calls} calls replayed{model.cli_words['through']} "
             f"on a {device_text} device, limit {format_bytes(result.memory_limit)}"
             f"{' (from the log)' if from_log else ''}"
             + (f": {settings_text}" if model.cli_words["through"] else f", {settings_text}"))
        if result.fidelity is not None:
            _say(f"exact: {result.fidelity.summary()}")
        for note in result.assumed:
            _say(f"assumed: {note}")
        for warning in result.warnings:
            _say(f"warning: {warning}")
        if (result.calls == 0 and trace.meta.get("source") == "pytorch-snapshot"
                and trace_model(trace) is model):
            _say_snapshot_state(trace, dev, args)
            continue
        if result.fits and result.warnings:
            _say("fits: no allocation ran out of memory, of the calls the trace holds (no "
                 "answer for the job: see the warning)")
        elif result.fits:
            _say("fits: no allocation ran out of memory")
        else:
            out_of_memory = True
            idx, nbytes = result.first_oom
            _say(f"OUT OF MEMORY: {result.oom_count} allocation(s) refused; the first at call "
                 f"{idx} ({format_bytes(nbytes)})")
        _say(f"peak {model.in_use} {format_bytes(result.peak_bytes_in_use)}, peak "
             f"{model.pool} {format_bytes(result.peak_pool_bytes)}, {result.extensions} "
             f"{model.cli_words['regions']}, worst fragmentation "
             f"{result.worst_fragmentation:.1%}, {result.events_per_second:,.0f} events/s")
    if args.html is not None:
        from .report import write_report

        opts = _model_kwargs(args, model, index, devices[0])
        opts.update(fraction=args.fraction, device=devices[0])
        device_bytes = opts.pop("device_bytes", None)
        if (args.fraction is None and "memory_limit" in model.inputs()
                and index.source_limit(devices[0]) is not None):
            opts["memory_limit"] = index.source_limit(devices[0])
            device_bytes = max(device_bytes or 0, opts["memory_limit"])
        write_report(trace, args.html, title=f"gpudash replay: {args.trace.name}",
                     device_bytes=device_bytes, overwrite=args.overwrite,
                     replay_options=opts)
        _say(f"report: {args.html}" + (f" ({index.label(devices[0])})"
                                       if len(devices) > 1 else ""))
    return EXIT_OOM if out_of_memory else EXIT_OK


def _say_snapshot_state(trace: Any, dev: int, args: argparse.Namespace) -> None:
    """``replay`` of a PyTorch snapshot without trace entries (one saved in an out-of-memory
    handler without ``_record_memory_history``): no call to replay, so no "fits"; the state
    the snapshot holds instead (:func:`gpudash.torch_explain.snapshot_state`)."""
    from .torch_explain import snapshot_state

    state = snapshot_state(trace, dev, path=args.trace, conf=args.conf,
                           torch_version=args.torch_version)
    _say("no answer: the snapshot's trace records no allocation on this device, so there is "
         "nothing to replay (neither fits nor out of memory); the state it holds, at the "
         "failure where it was saved in an out-of-memory handler:")
    rows = [r for r in state.lines() if r[0] != "assumed"]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        _say(f"  {k:<{width}}  {v}")


def _refuse_empty(trace: Any, args: argparse.Namespace, devices: list[int], what: str) -> None:
    """A device without events has nothing to replay: one line naming the file and why."""
    import numpy as np

    from .trace.caveats import no_events_text

    column = trace.columns["device"]
    for dev in devices:
        if not np.any(column == dev):
            raise _UserError(f"{args.trace}: {no_events_text(trace, dev)}; nothing to {what}")


def _dask_client(address: str) -> Any:
    try:
        import dask
        from distributed import Client
    except ImportError:
        raise _UserError("--scheduler needs Dask's distributed: pip install 'gpudash[dask]'"
                         ) from None
    try:
        return Client(address, set_as_default=False,
                      timeout=dask.config.get("distributed.comm.timeouts.connect"))
    except (OSError, ValueError) as exc:
        raise _UserError(f"cannot reach the Dask scheduler at {address}: {exc}") from None


def cmd_whatif(args: argparse.Namespace) -> int:
    _check_out(args.html, args.overwrite)
    if args.jobs < 1:
        raise _UserError(f"--jobs must be >= 1; got {args.jobs}")
    trace = _load(args.trace, args.format)
    if args.framework == "jax" and args.gc:
        raise _UserError("--framework jax replays JAX's BFC, which never garbage-collects; "
                         "drop --gc")
    if args.scheduler is None:
        return _whatif(args, trace, None)
    with _dask_client(args.scheduler) as client:
        _say(f"replaying on the Dask cluster at {args.scheduler} "
             f"({len(client.nthreads())} worker(s))")
        return _whatif(args, trace, client)


def _whatif(args: argparse.Namespace, trace: Any, client: Any) -> int:
    from .trace.caveats import from_dump_note
    from .trace.replay import DeviceIndex
    from .trace.whatif import min_fraction, sweep

    devices = _chosen_devices(trace, args)
    _refuse_empty(trace, args, devices, "replay")
    index = DeviceIndex(trace)
    model = _model_of(args, trace)
    # the framework whose lines to paste: the model's own where it has one (PyTorch's)
    framework = args.framework or (model.frameworks[0] if len(model.frameworks) == 1
                                   else None)
    if len(devices) > 1:
        each = f"{format_bytes(args.device)} device" if args.device else "device"
        _say(f"{args.trace}: {len(devices)} devices, each on its own {each} (--device-index N "
             "or --allocator NAME for one)")
    first = None
    for dev in devices:
        label = f" {index.label(dev)}:" if len(devices) > 1 or dev else ""
        kwargs = _model_kwargs(args, model, index, dev)
        device_bytes = kwargs.pop("device_bytes", None)
        try:
            best = min_fraction(trace, device_bytes, device=dev, progress=True, client=client,
                                jobs=1 if client is not None else args.jobs, **kwargs)
        except ConfigError as exc:
            raise _UserError(str(exc).removeprefix("min_fraction: ")) from None
        total = best.device_bytes
        for note in best.assumed:
            _say(f"assumed: {note}")
        for warning in best.warnings:
            _say(f"warning: {warning}")
        if best.fraction is None:
            _say(f"{args.trace}:{label} does not fit on a {format_bytes(total)} device "
                 "even at fraction 1.0")
        else:
            step = format_bytes(int(total * best.tolerance))
            held = " the calls the trace holds" if best.warnings else ""
            what = model.settings_text(best.settings, fraction=False)
            _say(f"{args.trace}:{label} smallest {model.cli_words['smallest']} that "
                 f"fits{held}: {_fraction_shown(best, framework)} "
                 f"({format_bytes(best.limit_bytes)} of "
                 f"{format_bytes(total)}; bisected to within {best.tolerance:g}, "
                 f"{step}), {what}, {best.replays} replays"
                 + (f" ({best.known} more fractions known from them)" if best.known else "")
                 + (": a lower bound for the job (see the warning)" if best.warnings else ""))
        # the same question with the model's what-if toggle flipped (PyTorch's expandable
        # segments)
        flipped = _say_flipped(trace, args, model, best, dev, kwargs, client, label)
        note = from_dump_note(trace, dev)
        if note is not None and not best.warnings and best.fraction is not None:
            _say(f"note: {note}")
        answers = [r for r in (best, flipped) if r is not None and r.fraction is not None]
        if framework is not None and best.warnings and answers:
            _say("no lines to paste: the trace is less than the job (see the warning), "
                 "and a setting from it would be too small")
        elif framework is not None and answers:
            _PASTE[framework](framework, best, flipped, answers, kwargs)
        kwargs = {"device_bytes": total, "progress": True, "device": dev,
                  **{k: v for k, v in _model_kwargs(args, model, index, dev).items()
                     if k not in model.grid and k != "device_bytes"}}  # sweep varies the grid
        if client is None:
            kwargs["jobs"] = args.jobs
        else:
            kwargs["client"] = client
        if args.fractions:
            kwargs["fractions"] = args.fractions
        if args.vary:
            kwargs["vary"] = dict(args.vary)
        try:
            table = sweep(trace, **kwargs)
        except ConfigError as exc:
            raise _UserError(str(exc)) from None
        _say("")
        _say(table.to_text(warnings=False))
        if first is None:
            first = (dev, best, table)
    if args.html is not None and first is not None:
        from .report import write_report

        dev, best, table = first
        opts = _model_kwargs(args, model, index, dev)
        opts.pop("device_bytes", None)
        opts.update(fraction=best.fraction, device=dev)
        write_report(trace, args.html, title=f"gpudash what-if: {args.trace.name}",
                     device_bytes=best.device_bytes, overwrite=args.overwrite,
                     sweep_table=table, replay_options=opts)
        _say(f"report: {args.html}" + (f" ({index.label(dev)})"
                                       if len(devices) > 1 else ""))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .postmortem import explain

    _check_out(args.html, args.overwrite)
    stdin = str(args.path) == "-"
    if not stdin and not args.path.exists():
        raise _UserError(f"no such file: {args.path}")
    index = None
    if args.dump is not None:
        if args.dump == 0:
            raise _UserError("--dump counts from 1 (or -1 for the last)")
        index = args.dump - 1 if args.dump > 0 else args.dump
    opts = dict(device=args.device, index=index, allocator=args.allocator,
                request=args.request, limit=args.limit, framework=args.framework,
                conf=args.conf, torch_version=args.torch_version)
    if stdin:
        result = _explain_stdin(explain, opts)
    else:
        result = explain(args.path, **opts)
    _say(str(result))
    if args.html is not None:
        result.write_html(args.html, overwrite=args.overwrite)
        _say(f"report: {args.html}")
    return 0


_STDIN_LIMIT = 64 << 20     # what `explain -` reads at most


def _explain_stdin(explain: Any, opts: dict) -> Any:
    """``explain -``: the text (or file) on standard input, explained as "<stdin>"."""
    import tempfile

    data = sys.stdin.buffer.read(_STDIN_LIMIT + 1)
    if not data:
        raise _UserError("<stdin>: nothing on standard input (paste the message, or pipe "
                         "a log: cat train.log | gpudash explain -)")
    if len(data) > _STDIN_LIMIT:
        raise _UserError(f"<stdin>: more than {format_bytes(_STDIN_LIMIT)}; save it to a "
                         "file and pass its path")
    with tempfile.TemporaryDirectory(prefix="gpudash-stdin-") as tmp:
        path = Path(tmp) / "stdin"
        path.write_bytes(data)
        try:
            result = explain(path, **opts)
        except GpudashError as exc:
            raise type(exc)(str(exc).replace(str(path), "<stdin>")) from None
    if hasattr(result, "path"):
        result.path = "<stdin>"
    return result


def _attribution_trace(path: Path, fmt: str | None, device: int | None) -> Any:
    """Load a trace for ``holders``/``diff``: a missing file, an unknown device or a trace
    without allocations is a one-line error."""
    import numpy as np

    if not path.exists():
        raise _UserError(f"no such file: {path}")
    trace = _load(path, fmt)
    kind, dev = trace.columns["kind"], trace.columns["device"]
    if device is not None and not np.any(dev == device):
        present = ", ".join(str(d) for d in np.unique(dev).tolist()) or "none"
        raise _UserError(f"{path}: no device {device}; its devices are {present}")
    mine = kind == 1 if device is None else (kind == 1) & (dev == device)
    if not np.any(mine):
        where = f" on device {device}" if device is not None else ""
        raise _UserError(f"{path}: the trace has no allocations{where}: nothing holds memory")
    return trace


def cmd_holders(args: argparse.Namespace) -> int:
    from .trace.holders import top_holders

    trace = _attribution_trace(args.trace, args.format, args.device)
    try:
        table = top_holders(trace, args.at, by=args.by, device=args.device,
                            user_code=args.user_code)
    except (GpudashError, IndexError) as exc:
        raise _UserError(f"{args.trace}: {exc}") from None
    _say(f"{args.trace}: " + table.to_text(limit=args.limit, stacks=args.stacks))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from .trace.diff import diff_holders, leaks

    a = _attribution_trace(args.a, args.format, args.device)
    try:
        if args.iterations:
            if args.b is not None:
                raise _UserError("--iterations compares the iterations of one trace; drop B")
            bounds = None
            if args.boundaries:
                bounds = [x.strip() for x in args.boundaries.split(",") if x.strip()]
            table = leaks(a, by=args.by, device=args.device, boundaries=bounds,
                          user_code=args.user_code)
            _say(f"{args.a}: " + table.to_text(limit=args.limit))
            return 0
        if args.boundaries:
            raise _UserError("--boundaries goes with --iterations")
        b = _attribution_trace(args.b, args.format, args.device) if args.b is not None \
            else None
        if b is None and args.to is None:
            raise _UserError(f"{args.a}: one trace needs --to MOMENT (compare --at with --to), "
                             "or a second trace B, or --iterations")
        result = diff_holders(a, b, at=args.at, to=args.to, by=args.by, device=args.device,
                              user_code=args.user_code)
    except (GpudashError, IndexError) as exc:
        raise _UserError(f"{args.a}: {exc}") from None
    name = f"{args.a}" + (f" -> {args.b}" if args.b is not None else "")
    _say(f"{name}: " + result.to_text(limit=args.limit))
    if not len(result):
        _say("no change")
    return 0


def _say_flipped(trace: Any, args: argparse.Namespace, model: Any, best: Any, dev: int,
                 kwargs: dict, client: Any, label: str) -> Any:
    """The what-if with the model's toggle (:attr:`AllocatorModel.whatif_toggles`: PyTorch's
    expandable segments) flipped; None for a model without one."""
    from .trace.whatif import min_fraction

    if not model.whatif_toggles:
        return None
    toggle = model.whatif_toggles[0]
    on = model.toggle_on(best.settings, toggle)
    name = f"{toggle}:{not on}"
    try:
        flipped = min_fraction(trace, best.device_bytes, device=dev, client=client,
                               jobs=1 if client is not None else args.jobs,
                               **dict(kwargs, **{toggle: not on}))
    except ConfigError as exc:   # PyTorch's rule: settings it does not support together
        _say(f"{args.trace}:{label} with {name}: not offered: "
             f"{str(exc).removeprefix('min_fraction: ')}")
        return None
    if flipped.fraction is None:
        _say(f"{args.trace}:{label} with {name}: does not fit even at fraction 1.0")
        return flipped
    saved = (best.limit_bytes or 0) - (flipped.limit_bytes or 0)
    how = ("where the other setting does not fit at all" if best.fraction is None else
           f"{format_bytes(saved)} less" if saved > 0 else
           f"{format_bytes(-saved)} more" if saved < 0 else "the same")
    _say(f"{args.trace}:{label} with {name}: {fraction_text(flipped.fraction)} "
         f"({format_bytes(flipped.limit_bytes)}, {how})")
    return flipped


def _fraction_shown(best: Any, framework: str | None) -> str:
    """The fraction that fits, as ``whatif`` prints it and pastes it (one value for both):
    :func:`~gpudash.models.fraction_text`; for TensorFlow's and JAX's lines, no less than
    what gives the limit the framework's own way (:func:`~gpudash.options.paste_fraction`:
    JAX computes it in single precision)."""
    from .options import paste_fraction

    shown = float(fraction_text(best.fraction))
    if framework in ("tensorflow", "jax"):
        shown = max(shown, paste_fraction(best.limit_bytes, best.device_bytes, framework))
    return fraction_text(shown)


def _paste_torch(framework: str, best: Any, flipped: Any, answers: list,
                 kwargs: dict) -> None:
    """``whatif`` of PyTorch's: the lines to paste, and those with the toggle flipped where
    they take less."""
    _say("")
    _say("PyTorch: paste these (the environment variable before PyTorch starts; "
         "the fraction any time):")
    for line in answers[0].paste_lines("torch"):
        _say(f"  {line}")
    if len(answers) == 2 and (flipped.limit_bytes or 0) < (best.limit_bytes or 0):
        saved = format_bytes(best.limit_bytes - flipped.limit_bytes)
        _say(f"  or, {saved} less, with expandable segments:")
        for line in flipped.paste_lines("torch"):
            _say(f"    {line}")


def _paste_tf(framework: str, best: Any, flipped: Any, answers: list, kwargs: dict) -> None:
    """``whatif`` of TensorFlow's or JAX's: :func:`_say_paste_lines`."""
    _say_paste_lines(framework, _fraction_shown(best, framework), best.limit_bytes,
                     best.device_bytes, kwargs["allow_growth"])


#: The lines ``whatif`` pastes, by framework.
_PASTE = {"torch": _paste_torch, "tensorflow": _paste_tf, "jax": _paste_tf}


def _say_paste_lines(framework: str, shown: str, limit: int, device: int,
                     growth: bool) -> None:
    """``whatif --framework``: the answer as lines to paste (at the fraction printed,
    ``shown``), and the restart note."""
    from .options import restart_lines

    fraction = float(shown)
    name = {"jax": "JAX", "tensorflow": "TensorFlow"}[framework]
    _say("")
    _say(f"{name}: paste these (the limit they give covers the "
         f"{format_bytes(limit)} needed; {name} must restart to take them):")
    if framework == "jax":
        for line in restart_lines("jax", fraction, growth, form="env")[:-1]:
            _say(f"  {line}")
        _say("  or, in a notebook before JAX starts:")
        for line in restart_lines("jax", fraction, growth, form="notebook")[:-1]:
            _say(f"  {line}")
    else:
        for line in restart_lines("tensorflow", fraction, growth, total=device)[:-1]:
            _say(f"  {line}")


def cmd_info(args: argparse.Namespace) -> int:
    from .devices import CudaMemory
    from .nvml import device_facts, nvml_available
    from .options import simulated_devices_from_env

    ok, reason = nvml_available()
    if ok:
        facts = device_facts()
        _say(f"NVML: {len(facts)} GPU(s)")
        def nbytes(value: Any) -> str:  # a fact NVML could not read is NA
            return format_bytes(value) if isinstance(value, int) else "N/A"

        from .nvml import format_processes, gpu_processes

        processes = gpu_processes()
        for f in facts:
            _say(f"  GPU {f.index}: {f.name}  total {nbytes(f.total)}  free {nbytes(f.free)}  "
                 f"used {nbytes(f.used)}  this process {nbytes(f.process_used)}  "
                 f"compute capability {f.compute_capability}")
            for line in format_processes({f.index: processes.get(f.index, [])}):
                _say(line)
    else:
        _say(f"NVML: not available ({reason})")
    cuda_ok, cuda_reason = CudaMemory.available()
    _say(f"CUDA through CuPy: {'available' if cuda_ok else 'not available (' + cuda_reason + ')'}")
    sizes = simulated_devices_from_env()
    if sizes:
        _say("GPUDASH_SIMULATE: " + ", ".join(format_bytes(s) for s in sizes))
    elif not cuda_ok:
        _say("gpudash sessions here run on a simulated 16.00 GiB device "
             "(set GPUDASH_SIMULATE=2x16GiB to change it)")
    from . import _accel

    _say(f"allocator core: {_accel.describe()}")
    if _accel.COMPILED:
        _say(f"  (set {_accel.ENV}=1 to run the pure-Python models instead)")
        clock = ("the time-stamp counter, read as time.time_ns() values"
                 if _accel.twin("JOURNAL_CLOCK", "") == "tsc" else "time.time_ns()")
        _say(f"  event times: {clock} ({_accel.twin('JOURNAL_CLOCK_REASON', '')}; "
             f"GPUDASH_JOURNAL_CLOCK=realtime stamps time.time_ns() directly)")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .trace import save_trace

    fmt = args.to
    if fmt is None and args.merge is not None:
        fmt = "perfetto"
    if fmt is None:
        suffix = args.output.suffix.lower()
        fmt = {".json": "torch-json", ".pickle": "torch-pickle", ".pkl": "torch-pickle",
               ".gdtrace": "gdtrace"}.get(suffix)
        if fmt is None:
            raise _UserError(f"{args.output}: cannot tell what to write from {suffix or 'no'} "
                             "extension; use .gdtrace (gpudash's own), .json or .pickle "
                             "(PyTorch's snapshot), or --to perfetto")
    perfetto_only = [flag for flag, value in (("--merge", args.merge),
                                              ("--offset-ns", args.offset_ns),
                                              ("--max-points", args.max_points))
                     if value is not None]
    if fmt != "perfetto" and perfetto_only:
        raise _UserError(f"{', '.join(perfetto_only)} only apply to --to perfetto; got --to "
                         f"{fmt}")
    _check_out(args.output, args.overwrite)
    if args.merge is not None and not args.merge.is_file():
        raise _UserError(f"{args.merge}: no such file (--merge names a PyTorch profiler trace)"
                         if not args.merge.exists() else
                         f"{args.merge}: not a regular file (--merge names a PyTorch profiler "
                         "trace)")
    trace = _load(args.input, args.format)
    if fmt != "perfetto":
        save_trace(trace, args.output, format=fmt, overwrite=args.overwrite)
        _say(f"{args.input} -> {args.output} ({fmt}, {len(trace)} events)")
        return 0
    options: dict[str, Any] = {"merge": args.merge, "offset_ns": args.offset_ns}
    if args.max_points is not None:
        options["max_points"] = args.max_points
    done = save_trace(trace, args.output, format=fmt, overwrite=args.overwrite,
                      **options)
    counters = sum(sum(d["points"].values()) for d in done["devices"])
    ooms = sum(d["ooms"] for d in done["devices"])
    into = f", added to {args.merge}'s {done['profiler_events']:,} events" \
        if args.merge is not None else ""
    _say(f"{args.input} -> {args.output} (perfetto: {len(trace):,} trace events as "
         f"{counters:,} counter points, {ooms:,} out-of-memory instants, "
         f"{done['annotations']:,} annotation slices on {len(done['devices'])} device(s)"
         f"{into})")
    for note in done["notes"]:
        _say(f"  note: {note}")
    return 0


#: The notebook ``gpudash lab`` opens, and where a wheel keeps a copy of it.
QUICKSTART = "01_quickstart.ipynb"


def _quickstart_notebook(write: bool = True) -> tuple[Path, str | None]:
    """The quick-start notebook to open, and a note when a copy was written for it.

    In a clone (or an editable install) this is ``notebooks/01_quickstart.ipynb``. Installed
    from a wheel, the package's copy (``gpudash/notebooks/``) is copied to the current
    directory, once (an existing copy, perhaps edited, is kept).
    """
    root = Path(__file__).resolve().parent.parent
    clone = root / "notebooks" / QUICKSTART
    if clone.exists() and (root / "pyproject.toml").exists():
        return clone, None
    packaged = Path(__file__).resolve().parent / "notebooks" / QUICKSTART
    if not packaged.exists():
        raise _UserError(f"the quick-start notebook is in neither {clone} nor {packaged}; "
                         "reinstall gpudash")
    target = Path.cwd() / f"gpudash_{QUICKSTART}"
    if target.exists():
        return target, f"opening your copy {target}"
    if not write:
        return target, f"would copy the quick-start notebook to {target}"
    target.write_bytes(packaged.read_bytes())
    return target, f"copied the quick-start notebook to {target}"


def lab_command(args: argparse.Namespace, extra: Sequence[str] = (),
                is_root: bool | None = None, write: bool = True,
                ) -> tuple[list[str], Path, list[str]]:
    """The JupyterLab command ``gpudash lab`` runs: ``(argv, working directory, notes)``.

    The notebook's folder is the server's root and the browser opens the notebook itself
    (``/lab/tree/<name>``), not the Launcher. As root, ``--allow-root`` is added (JupyterLab
    refuses to start as root without it). *extra* is passed through unchanged (the first
    ``--`` is dropped).
    """
    notebook, note = _quickstart_notebook(write)
    notes = [note] if note else []
    cmd = [sys.executable, "-m", "jupyterlab",
           f"--ServerApp.root_dir={notebook.parent}",
           f"--LabApp.default_url=/lab/tree/{notebook.name}",
           f"--ServerApp.port={args.port}"]
    if args.ip is not None:
        cmd.append(f"--ServerApp.ip={args.ip}")
    if args.token is not None:
        cmd.append(f"--IdentityProvider.token={args.token}")
    if args.no_browser:
        cmd.append("--no-browser")
    if is_root is None:
        is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    extra = list(extra)
    if "--" in extra:  # the separator itself is gpudash's, not JupyterLab's
        extra.remove("--")
    if is_root and "--allow-root" not in extra:
        cmd.append("--allow-root")
        notes.append("running as root: passing --allow-root to JupyterLab")
    cmd.extend(extra)
    return cmd, notebook.parent, notes


def cmd_lab(args: argparse.Namespace) -> int:
    import importlib.util
    import subprocess

    if importlib.util.find_spec("jupyterlab") is None:
        raise _UserError("JupyterLab is not installed: pip install 'gpudash[lab]'")
    cmd, cwd, notes = lab_command(args, getattr(args, "jupyter_args", ()),
                                  write=not args.dry_run)
    for note in notes:
        _say(f"gpudash lab: {note}")
    _say(" ".join(cmd))
    if args.dry_run:
        return 0
    if hasattr(os, "execv"):
        # become JupyterLab: signals (Ctrl-C, a terminate) reach the server itself, and no
        # server is left behind when this process ends
        sys.stdout.flush()
        sys.stderr.flush()
        os.chdir(cwd)
        os.execv(cmd[0], cmd)
    return subprocess.call(cmd, cwd=cwd)  # pragma: no cover - platforms without exec


COMMANDS = {"demo": cmd_demo, "replay": cmd_replay, "whatif": cmd_whatif,
            "explain": cmd_explain, "holders": cmd_holders, "diff": cmd_diff,
            "info": cmd_info, "convert": cmd_convert, "lab": cmd_lab}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = _parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command == "lab":  # JupyterLab's own arguments pass through
            args.jupyter_args = extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command is None:
            parser.print_help()
            return 0
        return COMMANDS[args.command](args)
    except _UserError as exc:
        print(f"gpudash: error: {_flags(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        # the reader went away (`gpudash whatif X | head -1`): stop quietly, as Unix tools
        # do; what is still buffered goes nowhere instead of failing again at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(devnull, stream.fileno())
            except (OSError, ValueError, AttributeError):  # closed, or not a real file
                pass
        os.close(devnull)
        return EXIT_PIPE
    except (GpudashError, OSError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"gpudash: error: {_flags(message)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("gpudash: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - a bug: one line, a distinct code
        if os.environ.get("GPUDASH_DEBUG"):
            raise
        print(f"gpudash: internal error: {type(exc).__name__}: {exc} (set GPUDASH_DEBUG=1 "
              "for the traceback, and please report it)", file=sys.stderr)
        return EXIT_BUG


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
