"""Record a PyTorch profiler trace (Chrome trace JSON, gzip-compressed) of a small training run
on the CPU, with memory events and Python stacks, for gpudash's tests.

Usage: python record_torch_profile.py OUT.json.gz   (PyTorch 2.13, CPU; deterministic)

An MLP (256 -> 512 -> 512 -> 10) trains for 4 steps with Adam, each step inside
record_function("step N"). The run has one deliberate leak: every step also computes a
"validation" loss without torch.no_grad() and keeps it in a list, so each kept loss holds its
autograd graph and with it the activations of that forward pass (about 0.5 MiB a step).
"""
import gzip
import os
import shutil
import sys
import tempfile

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

STEPS = 4
BATCH = 128


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 512)
        self.fc2 = nn.Linear(512, 512)
        self.head = nn.Linear(512, 10)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        return self.head(h)


def train_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def validate(model, xv, yv, kept):
    loss = nn.functional.cross_entropy(model(xv), yv)   # the leak: no torch.no_grad()
    kept.append(loss)                                    # keeps the graph, and its activations


def main(out):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = [(torch.randn(BATCH, 256), torch.randint(0, 10, (BATCH,))) for _ in range(STEPS)]
    xv, yv = torch.randn(BATCH, 256), torch.randint(0, 10, (BATCH,))
    kept = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True,
                 record_shapes=True) as prof:
        for step, (x, y) in enumerate(data):
            with record_function(f"step {step}"):
                train_step(model, opt, x, y)
                validate(model, xv, yv, kept)
    tmp = tempfile.mkdtemp()
    try:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.GzipFile(out, "wb", compresslevel=9, mtime=0) as g:
            shutil.copyfileobj(f, g)
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main(sys.argv[1])
