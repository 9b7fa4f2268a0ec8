"""Synthetic allocation workloads: seeded, deterministic, as traces or as live call streams.

Each workload comes in two forms:

- ``*_calls(...)`` is a generator of calls, ``("alloc", key, nbytes)`` and ``("free", key)``,
  that can drive any allocator (:func:`run_workload` maps keys to pointers);
- the function of the plain name returns a :class:`~gpudash.trace.Trace` of the same calls:
  ALLOC and FREE rows only, with 256-aligned addresses, ``alloc_id`` pairing, increasing
  ``time_ns`` and ``meta`` naming the workload and its parameters (``source`` is
  ``"synthetic"``).

The addresses of a workload trace are those a BFC allocator with growth on a roomy
simulated device (1 TiB) hands out, so they look like a real TensorFlow process's; ``size``
is the request rounded up to 256 bytes (as importers of foreign traces record it), not the
chunk the allocator chose. Randomness comes from :class:`random.Random` seeded with
``seed``, using only ``random()`` (whose sequence Python keeps stable across versions).

Workloads
---------
:func:`training_loop`
    Weights and optimizer slots that stay; per step, activations allocated layer by layer in
    the forward pass and freed in reverse order in the backward pass, gradients, optimizer
    temporaries.
:func:`inference_server`
    Weights that stay; per request, a batch of varying size and sequence length whose
    buffers are allocated and freed, with a few requests' caches and outputs alive at once.
:func:`fragmentation_stress`
    Small and large allocations interleaved and freed out of order: small blocks pin the
    holes that large ones leave, so the free space ends up in many pieces.
:func:`finetune`
    A transformer fine-tuned on batches of varying sequence length (float16): the
    activations change size every step, with short-lived temporaries between the saved
    ones, so a caching allocator's segments stop fitting the next step's requests.

:func:`caching_snapshot` runs a call stream through PyTorch's caching-allocator model and
returns what ``torch.cuda.memory._snapshot()`` would (a job with no GPU at hand can still
be looked at as PyTorch would show it).

Examples
--------
>>> from gpudash.workloads import training_loop
>>> t = training_loop(steps=2, layers=2, hidden=256)
>>> t.meta["workload"], len(t) > 0
('training_loop', True)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._units import parse_bytes
from .bfc import BFCAllocator
from .caching import CachingAllocator
from .devices import SimulatedDevice
from .events import COLUMN_DTYPES, ALLOC as _ALLOC, FREE as _FREE
from .formats.format import Trace, bins_for_sizes

__all__ = [
    "Call",
    "WorkloadRun",
    "training_loop",
    "training_loop_calls",
    "inference_server",
    "inference_server_calls",
    "fragmentation_stress",
    "fragmentation_stress_calls",
    "finetune",
    "finetune_calls",
    "caching_snapshot",
    "trace_from_calls",
    "iter_calls",
    "run_workload",
    "WORKLOADS",
]

#: A workload call: ``("alloc", key, nbytes)`` or ``("free", key)``.
Call = tuple

_KIB = 1 << 10
_MIB = 1 << 20
_T0 = 1_000_000_000  # first event at t = 1 s (traces start at a fixed, plausible time)


def _randint(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in ``[lo, hi]`` from ``rng.random()`` only (stable across Pythons)."""
    return lo + int(rng.random() * (hi - lo + 1))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in ``[lo, hi]``, log-uniformly distributed."""
    return int(lo * (hi / lo) ** rng.random())


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


# ------------------------------------------------------------------------------ workloads
def training_loop_calls(steps: int = 10, layers: int = 12, batch: int = 64,
                        hidden: int = 4096, seed: int = 0) -> Iterator[Call]:
    """The calls of a dense network's training loop (float32, Adam).

    Parameters
    ----------
    steps : int
        Training steps.
    layers : int
        Dense layers of ``hidden`` x ``hidden``.
    batch : int
        Batch size (the activations of one layer are ``batch * hidden * 4`` bytes).
    hidden : int
        Width of every layer.
    seed : int
        Seeds the sizes of the per-layer workspaces (cuDNN-like scratch buffers).

    Yields
    ------
    tuple
        ``("alloc", key, nbytes)`` or ``("free", key)``; keys are ints from 1.

    Notes
    -----
    Weights (``hidden**2 * 4`` bytes) and biases are allocated first and never freed. Each
    step allocates the input batch and labels, then per layer the pre-activation, the
    activation, a dropout mask and a short-lived workspace; the backward pass walks the
    layers in reverse, allocating the activation gradient and the weight and bias
    gradients, and frees that layer's activations and the gradient of the layer above. Adam's
    two slot variables per parameter are created after the first backward pass (as Keras
    creates them lazily) and stay; the optimizer then uses one temporary per weight and
    frees the gradients.
    """
    steps = _check_positive("steps", steps)
    layers = _check_positive("layers", layers)
    batch = _check_positive("batch", batch)
    hidden = _check_positive("hidden", hidden)
    rng = random.Random(seed)
    keys = iter(range(1, 1 << 62))
    w_bytes = hidden * hidden * 4
    b_bytes = hidden * 4
    act = batch * hidden * 4

    weights = []
    for _ in range(layers):
        kw, kb = next(keys), next(keys)
        yield ("alloc", kw, w_bytes)
        yield ("alloc", kb, b_bytes)
        weights.append((kw, kb))
    slots_made = False
    for _ in range(steps):
        x, y = next(keys), next(keys)
        yield ("alloc", x, act)
        yield ("alloc", y, batch * 4)
        saved = []
        for _ in range(layers):
            z, a, m, ws = next(keys), next(keys), next(keys), next(keys)
            yield ("alloc", z, act)
            yield ("alloc", ws, _randint(rng, 1, 32) * _MIB)
            yield ("free", ws)
            yield ("alloc", a, act)
            yield ("alloc", m, batch * hidden)
            saved.append((z, a, m))
        loss = next(keys)
        yield ("alloc", loss, 256)
        upstream = next(keys)
        yield ("alloc", upstream, act)
        yield ("free", loss)
        grads = []
        for z, a, m in reversed(saved):
            ga, dw, db = next(keys), next(keys), next(keys)
            yield ("alloc", dw, w_bytes)
            yield ("alloc", db, b_bytes)
            yield ("alloc", ga, act)
            yield ("free", m)
            yield ("free", a)
            yield ("free", z)
            yield ("free", upstream)
            upstream = ga
            grads.append((dw, db))
        yield ("free", upstream)
        yield ("free", y)
        yield ("free", x)
        if not slots_made:
            for _ in range(layers):
                for nbytes in (w_bytes, b_bytes, w_bytes, b_bytes):
                    yield ("alloc", next(keys), nbytes)
            slots_made = True
        for dw, db in reversed(grads):
            tmp = next(keys)
            yield ("alloc", tmp, w_bytes)
            yield ("free", tmp)
            yield ("free", db)
            yield ("free", dw)


def inference_server_calls(requests: int = 500, max_batch: int = 64,
                           seed: int = 0) -> Iterator[Call]:
    """The calls of a transformer inference server answering batched requests (float16).

    Parameters
    ----------
    requests : int
        Requests served.
    max_batch : int
        Largest batch; each request's batch is uniform in ``[1, max_batch]``.
    seed : int
        Seeds batch sizes, sequence lengths (128, 256 or 512) and how long outputs and
        caches wait.

    Yields
    ------
    tuple
        ``("alloc", key, nbytes)`` or ``("free", key)``.

    Notes
    -----
    A 6-block model (hidden 1024, 16 heads, vocabulary 32000) is loaded first. Each request
    allocates its token ids, then per block the block's output and the attention scores
    (freed at once) and frees the previous block's output; its KV cache and logits stay
    alive until one to three later requests have started (a response waiting to be sent),
    so lifetimes of different sizes overlap.
    """
    requests = _check_positive("requests", requests)
    max_batch = _check_positive("max_batch", max_batch)
    rng = random.Random(seed)
    keys = iter(range(1, 1 << 62))
    hidden, heads, vocab, blocks = 1024, 16, 32000, 6
    for nbytes in [vocab * hidden * 2] + [12 * hidden * hidden * 2 + 13 * hidden * 2] * blocks:
        yield ("alloc", next(keys), nbytes)
    pending: list[tuple[int, list[int]]] = []  # (request after which to free, keys)
    for r in range(requests):
        b = _randint(rng, 1, max_batch)
        seq = (128, 256, 512)[_randint(rng, 0, 2)]
        ids = next(keys)
        yield ("alloc", ids, b * seq * 4)
        kv = next(keys)
        yield ("alloc", kv, 2 * blocks * b * seq * hidden * 2)
        prev = None
        for _ in range(blocks):
            out, scores = next(keys), next(keys)
            yield ("alloc", out, b * seq * hidden * 2)
            yield ("alloc", scores, b * heads * seq * seq * 2)
            yield ("free", scores)
            if prev is not None:
                yield ("free", prev)
            prev = out
        logits = next(keys)
        yield ("alloc", logits, b * vocab * 2)
        yield ("free", prev)
        yield ("free", ids)
        pending.append((r + _randint(rng, 1, 3), [logits, kv]))
        still = []
        for due, ks in pending:
            if due <= r:
                for k in ks:
                    yield ("free", k)
            else:
                still.append((due, ks))
        pending = still
    for _, ks in pending:
        for k in ks:
            yield ("free", k)


def fragmentation_stress_calls(rounds: int = 2000, seed: int = 0, *,
                               high: int | str = "1800MiB",
                               low: int | str = "500MiB") -> Iterator[Call]:
    """Interleaved small and large allocations, freed out of order, leaving holes.

    Parameters
    ----------
    rounds : int
        Each round makes four large-block steps and allocates one small block (256 B -
        64 KiB, log-uniform). While filling, a step allocates a large block (512 KiB -
        2 MiB, log-uniform) until the live large blocks reach ``high`` bytes; while
        draining, a step frees a large block chosen at random anywhere in the live set,
        until they fall to ``low``; then filling starts again. At most 300 small blocks
        live; beyond that a random one is freed.
    seed : int
        Seeds sizes and choices.
    high, low : int or str
        The fill and drain marks (bytes or ``"1800MiB"``).

    Yields
    ------
    tuple
        ``("alloc", key, nbytes)`` or ``("free", key)``.

    Notes
    -----
    The first fill packs the allocator's regions; every drain then punches holes all over
    them, and small blocks allocated meanwhile pin the holes apart, so the free space is
    cut into many pieces and no single free chunk is large. With the default marks and the
    default replay (16 GiB, growth) the pool stays at 2 GiB and external fragmentation
    settles around 0.8 after the first cycle, against about 0.3 for
    :func:`training_loop_calls`.
    """

    rounds = _check_positive("rounds", rounds)
    high = parse_bytes(high, name="high")
    low = parse_bytes(low, name="low")
    if not 0 <= low < high:
        raise ValueError(f"need 0 <= low < high; got low={low}, high={high}")
    rng = random.Random(seed)
    keys = iter(range(1, 1 << 62))
    sizes: dict[int, int] = {}
    order: list[int] = []  # live large blocks in allocation order
    small: list[int] = []
    live = 0
    filling = True
    for _ in range(rounds):
        for _ in range(4):
            if filling:
                k = next(keys)
                n = _log_uniform(rng, 512 * _KIB, 2 * _MIB)
                yield ("alloc", k, n)
                sizes[k] = n
                order.append(k)
                live += n
                filling = live < high
            else:
                k = order.pop(_randint(rng, 0, len(order) - 1))
                live -= sizes.pop(k)
                yield ("free", k)
                filling = live <= low
        k = next(keys)
        yield ("alloc", k, _log_uniform(rng, 256, 64 * _KIB))
        small.append(k)
        while len(small) > 300:
            yield ("free", small.pop(_randint(rng, 0, len(small) - 1)))
    for k in order + small:
        yield ("free", k)


def finetune_calls(steps: int = 40, layers: int = 24, hidden: int = 2048, heads: int = 16,
                   batch: int = 2, min_len: int = 128, max_len: int = 2304,
                   seed: int = 0) -> Iterator[Call]:
    """The calls of a transformer fine-tuned on batches of varying sequence length
    (float16 weights and activations, Adam's two float32 moments per weight).

    Parameters
    ----------
    steps : int
        Training steps; each draws a sequence length in ``[min_len, max_len]`` (a multiple
        of 64).
    layers, hidden, heads : int
        The transformer: per layer ``4 * hidden**2`` attention and ``8 * hidden**2`` MLP
        weights.
    batch : int
        Sequences per step.
    min_len, max_len : int
        Bounds of the sequence length.
    seed : int
        Seeds the sequence lengths.

    Yields
    ------
    tuple
        ``("alloc", key, nbytes)`` or ``("free", key)``; keys are ints from 1.

    Notes
    -----
    Per layer, the forward pass saves five activations (QKV, the ``batch * heads * len**2``
    attention probabilities, the attention output, the MLP's hidden state and output), each
    made from a temporary of the same size that is freed at once; the backward pass
    recomputes the attention scores in a temporary, frees the layer's activations and passes
    a gradient down; the weight gradients are allocated after the backward pass and freed
    by the optimizer step. Adam's moments are allocated after the first step and stay.
    Because the length changes every step, so do the sizes of the large requests: the
    workload where PyTorch's ``expandable_segments:True`` pays (with the defaults, PyTorch's
    default allocator needs about 24.4 GiB, expandable segments about 23.1 GiB).
    """
    steps = _check_positive("steps", steps)
    layers = _check_positive("layers", layers)
    hidden = _check_positive("hidden", hidden)
    heads = _check_positive("heads", heads)
    batch = _check_positive("batch", batch)
    min_len = _check_positive("min_len", min_len)
    max_len = _check_positive("max_len", max_len)
    if max_len < min_len:
        raise ValueError(f"max_len ({max_len}) must be at least min_len ({min_len})")
    rng = random.Random(seed)
    keys = iter(range(1, 1 << 62))
    weights = []
    for _ in range(layers):
        for nbytes in (4 * hidden * hidden * 2, 8 * hidden * hidden * 2):
            yield ("alloc", next(keys), nbytes)
            weights.append(nbytes)
    lo, hi = max(1, min_len // 64), max(1, max_len // 64)
    moments = False
    for _ in range(steps):
        seq = _randint(rng, lo, hi) * 64
        tokens = batch * seq
        x = next(keys)
        yield ("alloc", x, tokens * hidden * 2)
        saved = []
        for _ in range(layers):
            acts = []
            for nbytes in (tokens * 3 * hidden * 2, batch * heads * seq * seq * 2,
                           tokens * hidden * 2, tokens * 4 * hidden * 2, tokens * hidden * 2):
                tmp, key = next(keys), next(keys)
                yield ("alloc", tmp, nbytes)
                yield ("alloc", key, nbytes)
                yield ("free", tmp)
                acts.append(key)
            saved.append(acts)
        grad = next(keys)
        yield ("alloc", grad, tokens * hidden * 2)
        for acts in reversed(saved):
            scores = next(keys)
            yield ("alloc", scores, batch * heads * seq * seq * 2)
            yield ("free", scores)
            for key in reversed(acts):
                yield ("free", key)
            down = next(keys)
            yield ("alloc", down, tokens * hidden * 2)
            yield ("free", grad)
            grad = down
        grads = []
        for nbytes in weights:
            key = next(keys)
            yield ("alloc", key, nbytes)
            grads.append(key)
        yield ("free", grad)
        yield ("free", x)
        if not moments:
            for nbytes in weights:
                for _ in range(2):
                    yield ("alloc", next(keys), nbytes * 2)
            moments = True
        for key in grads:
            yield ("free", key)


# ------------------------------------------------------------------------------ traces
def trace_from_calls(calls: Iterable[Call], *, meta: dict | None = None,
                     seed: int = 0) -> Trace:
    """A trace of ALLOC/FREE rows from a call stream, with plausible addresses and times.

    Parameters
    ----------
    calls : iterable of tuple
        ``("alloc", key, nbytes)`` / ``("free", key)``; a free of an unknown key raises.
    meta : dict, optional
        Merged into the trace's ``meta`` (``source`` defaults to ``"synthetic"``).
    seed : int
        Seeds the gaps between event times (0.5-5 µs, plus 20-200 µs every 64 calls).

    Returns
    -------
    Trace
        Addresses come from a BFC allocator with growth on a 1 TiB simulated device;
        ``size`` is the request rounded up to 256; ``alloc_id`` counts allocations from 1.

    Raises
    ------
    ValueError
        A free of a key that is not live, an alloc of a live key, or an unknown call.
    """

    space = 1 << 40
    bfc = BFCAllocator(SimulatedDevice(space), space, allow_growth=True, name="synthetic")
    allocate, deallocate = bfc.allocate, bfc.deallocate
    rng = random.Random(seed ^ 0x5EED)
    rand = rng.random
    kind: list[int] = []
    ptr: list[int] = []
    req: list[int] = []
    aid: list[int] = []
    live: dict[Any, tuple[int, int, int]] = {}  # key -> (ptr, requested, alloc id)
    next_id = 1
    for call in calls:
        op = call[0]
        if op == "alloc":
            key, nbytes = call[1], int(call[2])
            if key in live:
                raise ValueError(f"alloc of key {key!r}, which is still live")
            if nbytes <= 0:
                raise ValueError(f"alloc of key {key!r} asks for {nbytes} bytes; need > 0")
            p = allocate(nbytes)
            live[key] = (p, nbytes, next_id)
            kind.append(_ALLOC)
            ptr.append(p)
            req.append(nbytes)
            aid.append(next_id)
            next_id += 1
        elif op == "free":
            hit = live.pop(call[1], None)
            if hit is None:
                raise ValueError(f"free of key {call[1]!r}, which is not live")
            p, nbytes, a = hit
            deallocate(p)
            kind.append(_FREE)
            ptr.append(p)
            req.append(nbytes)
            aid.append(a)
        else:
            raise ValueError(f"unknown call {call!r}; expected ('alloc', key, nbytes) or "
                             "('free', key)")
    n = len(kind)
    gaps = np.array([500 + int(rand() * 4500) for _ in range(n)], dtype=np.int64)
    gaps[::64] += np.array([20_000 + int(rand() * 180_000) for _ in range(len(gaps[::64]))],
                           dtype=np.int64)
    requested = np.array(req, dtype=np.int64)
    size = (requested + 255) & ~np.int64(255)
    size = np.maximum(size, 256)
    cols = {
        "seq": np.arange(n, dtype=np.int64),
        "time_ns": _T0 + np.cumsum(gaps),
        "kind": np.array(kind, dtype=COLUMN_DTYPES["kind"]),
        "ptr": np.array(ptr, dtype=np.int64),
        "size": size,
        "requested": requested,
        "bin": bins_for_sizes(size),
        "region": np.zeros(n, dtype=np.int64),
        "alloc_id": np.array(aid, dtype=np.int64),
        "device": np.zeros(n, dtype=COLUMN_DTYPES["device"]),
    }
    m = {"source": "synthetic"}
    if meta:
        m.update(meta)
    m.setdefault("live_at_end", len(live))
    return Trace(cols, m)


def _workload_trace(name: str, calls: Iterator[Call], params: dict, seed: int) -> Trace:
    return trace_from_calls(calls, seed=seed, meta={"workload": name, "parameters": params})


def training_loop(steps: int = 10, layers: int = 12, batch: int = 64, hidden: int = 4096,
                  seed: int = 0) -> Trace:
    """:func:`training_loop_calls` as a :class:`~gpudash.trace.Trace` (see there)."""
    params = {"steps": steps, "layers": layers, "batch": batch, "hidden": hidden, "seed": seed}
    return _workload_trace("training_loop", training_loop_calls(**params), params, seed)


def inference_server(requests: int = 500, max_batch: int = 64, seed: int = 0) -> Trace:
    """:func:`inference_server_calls` as a :class:`~gpudash.trace.Trace` (see there)."""
    params = {"requests": requests, "max_batch": max_batch, "seed": seed}
    return _workload_trace("inference_server", inference_server_calls(**params), params, seed)


def fragmentation_stress(rounds: int = 2000, seed: int = 0, *, high: int | str = "1800MiB",
                         low: int | str = "500MiB") -> Trace:
    """:func:`fragmentation_stress_calls` as a :class:`~gpudash.trace.Trace` (see there)."""
    params = {"rounds": rounds, "seed": seed, "high": high, "low": low}
    return _workload_trace("fragmentation_stress", fragmentation_stress_calls(**params),
                           params, seed)


def finetune(steps: int = 40, layers: int = 24, hidden: int = 2048, heads: int = 16,
             batch: int = 2, min_len: int = 128, max_len: int = 2304, seed: int = 0) -> Trace:
    """:func:`finetune_calls` as a :class:`~gpudash.trace.Trace` (see there)."""
    params = {"steps": steps, "layers": layers, "hidden": hidden, "heads": heads,
              "batch": batch, "min_len": min_len, "max_len": max_len, "seed": seed}
    return _workload_trace("finetune", finetune_calls(**params), params, seed)


def caching_snapshot(calls: Iterable[Call], *, device_bytes: int | str = "80GiB",
                     conf: str | None = None, fraction: float | None = None,
                     torch_version: str | tuple | None = None,
                     max_entries: int = 1_000_000) -> dict:
    """Run ``calls`` through PyTorch's caching-allocator model (a
    :class:`~gpudash.CachingAllocator` on a :class:`~gpudash.SimulatedDevice`) with history
    recorded, and return its ``torch.cuda.memory._snapshot()``: segments, ``device_traces``
    and the allocator settings, as :func:`gpudash.formats.torch_snapshot.load_torch_snapshot`
    and PyTorch's MemoryViz read them.

    Like PyTorch, the run stops at the first allocation the allocator refuses: the trace
    ends with that ``oom`` entry (and the ``snapshot`` entry PyTorch adds when one is
    taken), as a job's ``_dump_snapshot`` in its OOM handler leaves it.

    Parameters
    ----------
    calls : iterable of tuple
        A workload call stream (``("alloc", key, nbytes)`` / ``("free", key)``).
    device_bytes : int or str
        The simulated GPU's total memory.
    conf : str, optional
        ``PYTORCH_CUDA_ALLOC_CONF``.
    fraction : float, optional
        ``torch.cuda.set_per_process_memory_fraction``.
    torch_version : str or tuple, optional
        The PyTorch whose rules the model follows (default: the newest it knows).
    max_entries : int
        ``record_memory_history``'s ``max_entries``.

    Examples
    --------
    >>> from gpudash.workloads import caching_snapshot, finetune_calls
    >>> snap = caching_snapshot(finetune_calls(steps=2, layers=2), device_bytes="8GiB")
    >>> snap["device_traces"][0][0]["action"], len(snap["segments"]) > 0
    ('segment_alloc', True)
    """

    dev = SimulatedDevice(parse_bytes(device_bytes, name="device_bytes"), "cuda:0")
    alloc = CachingAllocator(dev, conf, fraction=fraction, version=torch_version)
    alloc.record_history(True, max_entries=max_entries)
    ptrs: dict[Any, int] = {}
    for call in calls:
        if call[0] == "alloc":
            ptr = alloc.try_allocate(int(call[2]))
            if not ptr:
                break
            ptrs[call[1]] = ptr
        else:
            ptr = ptrs.pop(call[1], None)
            if ptr is not None:
                alloc.deallocate(ptr)
    return alloc.snapshot()


#: Workload name -> (trace function, calls function).
WORKLOADS: dict[str, tuple[Callable[..., Trace], Callable[..., Iterator[Call]]]] = {
    "training_loop": (training_loop, training_loop_calls),
    "inference_server": (inference_server, inference_server_calls),
    "fragmentation_stress": (fragmentation_stress, fragmentation_stress_calls),
    "finetune": (finetune, finetune_calls),
}


# ------------------------------------------------------------------------------ live use
def iter_calls(trace: Trace, device: int | None = None) -> Iterator[Call]:
    """A trace's replayable calls as a workload call stream (for :func:`run_workload`).

    Allocations the trace shows as refused (OOM rows) are yielded as an alloc followed by
    its free, so a live allocator attempts them once.
    """
    calls = trace.calls(device)
    op, key, nbytes = calls.op.tolist(), calls.key.tolist(), calls.nbytes.tolist()
    oom_key = -1
    for o, k, n in zip(op, key, nbytes):
        if o == 1:
            yield ("alloc", k, n)
        elif o == 2:
            yield ("free", k)
        elif n > 0:
            yield ("alloc", ("oom", oom_key), n)
            yield ("free", ("oom", oom_key))
            oom_key -= 1


@dataclass
class WorkloadRun:
    """What :func:`run_workload` did.

    Attributes
    ----------
    allocs, frees : int
        Calls made to ``allocate`` and ``deallocate``.
    ooms : int
        Allocations refused with a ``MemoryError`` (``OutOfMemoryError`` included); their
        frees are skipped.
    skipped_frees : int
        Frees of refused allocations (not passed on).
    live : dict
        Keys still allocated at the end -> pointer.
    seconds : float
        Wall time.
    """

    allocs: int = 0
    frees: int = 0
    ooms: int = 0
    skipped_frees: int = 0
    live: dict | None = None
    seconds: float = 0.0

    def __repr__(self) -> str:
        return (f"WorkloadRun(allocs={self.allocs}, frees={self.frees}, ooms={self.ooms}, "
                f"live={len(self.live or {})}, seconds={self.seconds:.3f})")


def run_workload(calls: Iterable[Call], allocate: Callable[[int], Any],
                 deallocate: Callable[[Any], Any], *, sleep: float = 0.0,
                 stop: Callable[[], bool] | None = None) -> WorkloadRun:
    """Drive a live allocator with a call stream.

    Parameters
    ----------
    calls : iterable of tuple
        A ``*_calls(...)`` generator, :func:`iter_calls`, or any ``("alloc", key, nbytes)``
        / ``("free", key)`` stream.
    allocate, deallocate : callable
        ``allocate(nbytes) -> pointer`` and ``deallocate(pointer)``
        (``BFCAllocator.allocate``/``deallocate``, a session's, CuPy's...).
    sleep : float, default 0.0
        Seconds to sleep after each call (to watch a live view move).
    stop : callable, optional
        Checked before each call; returning True ends the run early.

    Returns
    -------
    WorkloadRun
        Counts; an allocation refused with ``MemoryError`` is counted in ``ooms`` and its
        later free skipped, so the run goes on.

    Raises
    ------
    ValueError
        A free of a key that was never allocated (or already freed), or an unknown call.
    """
    if sleep < 0:
        raise ValueError(f"sleep must be >= 0 seconds; got {sleep}")
    out = WorkloadRun(live={})
    live = out.live
    refused: set = set()
    t0 = time.perf_counter()
    for call in calls:
        if stop is not None and stop():
            break
        op = call[0]
        if op == "alloc":
            try:
                p = allocate(call[2])
            except MemoryError:
                out.ooms += 1
                refused.add(call[1])
            else:
                live[call[1]] = p
            out.allocs += 1
        elif op == "free":
            key = call[1]
            if key in live:
                deallocate(live.pop(key))
                out.frees += 1
            elif key in refused:
                refused.discard(key)
                out.skipped_frees += 1
            else:
                raise ValueError(f"free of key {key!r}, which was never allocated or is "
                                 "already freed")
        else:
            raise ValueError(f"unknown call {call!r}; expected ('alloc', key, nbytes) or "
                             "('free', key)")
        if sleep:
            time.sleep(sleep)
    out.seconds = time.perf_counter() - t0
    return out
