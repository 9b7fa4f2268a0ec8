"""Small synthetic traces with call stacks, for the attribution tests (holders, categories,
diffs): each call gets the stack given, one event per microsecond."""

from __future__ import annotations

import numpy as np

from gpudash.events import COLUMNS, COLUMN_DTYPES
from gpudash.trace import Trace
from gpudash.formats.stacks import StackTable

# frames as PyTorch records them: (filename, line, name), innermost first in a stack
SITE = "/home/u/.venv/lib/python3.11/site-packages"
TORCH_LINEAR = (f"{SITE}/torch/nn/modules/linear.py", 125, "forward")
TORCH_CALL = (f"{SITE}/torch/nn/modules/module.py", 1784, "_call_impl")
TORCH_CONVERT = (f"{SITE}/torch/nn/modules/module.py", 1357, "convert")
TORCH_APPLY = (f"{SITE}/torch/nn/modules/module.py", 930, "_apply")
TORCH_TO = (f"{SITE}/torch/nn/modules/module.py", 1371, "to")
TORCH_ADAM = (f"{SITE}/torch/optim/adam.py", 420, "_single_tensor_adam")
TORCH_STEP = (f"{SITE}/torch/optim/optimizer.py", 493, "wrapper")
TORCH_BACKWARD = (f"{SITE}/torch/autograd/graph.py", 825, "_engine_run_backward")
STDLIB = ("/usr/lib/python3.11/threading.py", 982, "run")
CPP_MM = ("??", 0, "at::_ops::mm::call(at::Tensor const&, at::Tensor const&)")
CPP_ALLOC = ("CUDACachingAllocator.cpp", 0, "c10::cuda::CUDACachingAllocator::malloc")
ENGINE = ("??", 0, "torch::autograd::Engine::thread_main(std::shared_ptr<GraphTask> const&)")
MM_BACKWARD = ("??", 0, "torch::autograd::generated::MmBackward0::apply(variable_list&&)")
ACC_GRAD = ("??", 0, "torch::autograd::AccumulateGrad::apply(variable_list&&)")


def user(line: int, name: str = "step", path: str = "/home/u/proj/train.py") -> tuple:
    return (path, line, name)


def make_trace(calls: list[tuple], meta: dict | None = None) -> Trace:
    """A trace of ``calls``: ``("alloc", key, size, frames[, device])``, ``("free", key)``,
    ``("oom", size, frames[, device])``; frames innermost first (None: no stack). Event i
    happens at ``i`` microseconds."""
    st = StackTable()
    rows: dict[str, list] = {c: [] for c in COLUMNS}
    stack: list[int] = []
    live: dict = {}
    ptr = 1 << 20
    for i, call in enumerate(calls):
        op = call[0]
        if op == "alloc":
            _, key, size, frames, *dev = call
            d = dev[0] if dev else 0
            live[key] = (ptr, size, d, i + 1)
            vals = dict(kind=1, ptr=ptr, size=size, requested=size, alloc_id=i + 1, device=d)
            ptr += size
            sid = -1 if frames is None else st.intern_frames(frames)
        elif op == "free":
            p, size, d, aid = live.pop(call[1])
            vals = dict(kind=2, ptr=p, size=size, requested=size, alloc_id=aid, device=d)
            sid = -1
        elif op == "oom":
            _, size, frames, *dev = call
            vals = dict(kind=7, ptr=0, size=size, requested=size, alloc_id=-1,
                        device=dev[0] if dev else 0)
            sid = -1 if frames is None else st.intern_frames(frames)
        else:
            raise ValueError(op)
        vals.update(seq=i, time_ns=i * 1000, bin=0, region=0)
        for c in COLUMNS:
            rows[c].append(vals[c])
        stack.append(sid)
    cols = {c: np.array(rows[c], dtype=COLUMN_DTYPES[c]) for c in COLUMNS}
    meta = {"source": "pytorch-snapshot", **(meta or {})}
    return Trace(cols, meta, stack=np.array(stack, dtype=np.int32), stacks=st)
