"""Differential fuzz: the compiled allocator core against the pure-Python models.

Each run drives two allocators of one model with the same seeded random operations: the
pure-Python reference (``gpudash.bfc.PyBFCAllocator``, ``gpudash.caching.PyCachingAllocator``)
and the class gpudash uses (``gpudash.BFCAllocator``, ``gpudash.CachingAllocator``: the
compiled core's subclass of the reference, where it is built). Each over its own copy of
the same sub-allocator (a simulated device that also refuses some requests at random, the
same ones for both). Every operation must give the same result on both:

- the return value, or the error (its type and its message: out-of-memory messages carry
  the whole memory log);
- the statistics (``stats()``; for PyTorch's model also ``memory_stats()``) and the
  ``limit_floor``;
- the event records (every field but the time): the journal as batch sinks receive it, and
  the events of ``subscribe`` callbacks in the stretches where one listens;

and every ``--check-every`` operations the whole state: ``check()`` on both, the snapshot,
the memory log (TensorFlow's text, with chunk handles) or PyTorch's segments and trace.

Operations: allocations of every size (0, tiny, log-uniform up to past the limit, past any
device, negative, of the wrong type), ``try_allocate``, frees (live, double, interior, never
allocated, of the wrong type), batch frees, limit and setting changes while blocks are
live, releases, preallocation, statistics resets, queries; for PyTorch's model also
streams, ``empty_cache()``, fractions and ``set_allocator_settings``, snapshots with
history recorded, and (its ``alike`` setting) a few sizes allocated and freed in bursts, so
that hundreds of cached blocks share a bin, which the compiled pools then keep sorted.
The ``overlap`` settings' device hands out a share of its ranges (and, for PyTorch's model,
expandable reservations) over earlier ones, which both cores must refuse alike; the
``conf`` model sends random ``PYTORCH_CUDA_ALLOC_CONF`` strings (PyTorch's grammar, then
mutated) through every version's parser (a ConfigError or settings, nothing else) and
both cores' ``set_allocator_settings``.

Run: ``python benchmarks/fuzz_core.py [--ops N] [--model bfc|torch|conf|all] [--seed S]``
(10**6 operations per model and setting by default; ``tests/test_core_diff.py`` runs it
smaller). Prints one line per setting; exits 1 at the first difference, naming the
operation, the seed and both sides.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import gpudash
from gpudash import SimulatedDevice
from gpudash.bfc import PyBFCAllocator

MIB = 1 << 20
GIB = 1 << 30


class Mismatch(AssertionError):
    """The two allocators disagreed."""


# ------------------------------------------------------------------------------ devices
class FlakyDevice:
    """A simulated device that refuses a seeded random share of requests (the same ones for
    both allocators, as long as they ask the same things)."""

    def __init__(self, capacity: int, seed: int, refuse: float, overlap: float = 0.0) -> None:
        self.dev = SimulatedDevice(capacity)
        self.rng = random.Random(seed)
        self.refuse = refuse
        self.overlap = overlap
        self.given: list[int] = []        # addresses handed out (overlaps start near them)
        self.fake: list[tuple[int, int]] = []
        self.calls: list[tuple] = []

    def alloc(self, nbytes: int) -> int:
        if self.refuse and self.rng.random() < self.refuse:
            self.calls.append(("refuse", nbytes))
            raise MemoryError(f"refused {nbytes}")
        if self.overlap and self.given and self.rng.random() < self.overlap:
            # a faulty device: a range over one it handed out before (both cores refuse it
            # and give it back)
            ptr = self.rng.choice(self.given) + self.rng.choice([0, 512, 4096, -512, 1 << 20])
            self.fake.append((ptr, nbytes))
            self.calls.append(("overlap", ptr, nbytes))
            return ptr
        ptr = self.dev.alloc(nbytes)
        self.given.append(ptr)
        if len(self.given) > 64:
            del self.given[:32]
        self.calls.append(("alloc", ptr, nbytes))
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        self.calls.append(("free", ptr, nbytes))
        if (ptr, nbytes) in self.fake:
            self.fake.remove((ptr, nbytes))
            return
        self.dev.free(ptr, nbytes)

    @property
    def total(self) -> int:
        return self.dev.total

    def memory_info(self) -> tuple[int, int]:
        return self.dev.memory_info()


# ------------------------------------------------------------------------------ listening
class Listener:
    """Batch sink (journal records without times) and, when subscribed, per-event callback
    (events without times) on one allocator."""

    def __init__(self, alloc: Any) -> None:
        self.alloc = alloc
        self.records: list[tuple] = []
        self.columns: list[dict] = []
        self.events: list[tuple] = []
        self._remove_raw = None
        self._remove_cols = None
        self._unsubscribe = None

    def listen(self, raw: bool, columns: bool, callback: bool) -> None:
        a = self.alloc
        if raw and self._remove_raw is None:
            self._remove_raw = a._add_sink(self._raw, raw=True)
        if columns and self._remove_cols is None:
            self._remove_cols = a._add_sink(self._cols)
        if callback and self._unsubscribe is None:
            self._unsubscribe = a.subscribe(self._event)

    def stop(self) -> None:
        for name in ("_remove_raw", "_remove_cols", "_unsubscribe"):
            f = getattr(self, name)
            if f is not None:
                f()
                setattr(self, name, None)

    def _raw(self, records: Any, extra: dict) -> None:
        r = list(records)
        for i in range(0, len(r), 8):
            self.records.append(tuple(r[i + 1:i + 8]))
        if extra:
            self.records.append(("extra", tuple(sorted(extra.items()))))

    def _cols(self, columns: dict, extra: dict) -> None:
        self.columns.append({k: v.copy() for k, v in columns.items() if k != "time_ns"})

    def _event(self, ev: Any) -> None:
        d = ev.as_dict()
        d.pop("time_ns")
        self.events.append(tuple(sorted(d.items(), key=lambda kv: kv[0])))

    def take(self) -> tuple:
        out = (self.records, self.columns, self.events)
        self.records, self.columns, self.events = [], [], []
        return out


def _same_columns(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.keys() != y.keys():
            return False
        for k in x:
            if x[k].dtype != y[k].dtype or not np.array_equal(x[k], y[k]):
                return False
    return True


# ------------------------------------------------------------------------------ the pair
def _outcome(f: Callable, *args: Any) -> tuple:
    try:
        return ("ok", f(*args))
    except Exception as exc:  # noqa: BLE001 - every error is part of the outcome
        return ("error", type(exc).__name__, str(exc))


@dataclass
class Pair:
    """The reference and the compiled allocator, driven together."""

    ref: Any
    fast: Any
    ref_dev: Any
    fast_dev: Any
    what: str
    ops: int = 0
    log: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ref_l = Listener(self.ref)
        self.fast_l = Listener(self.fast)

    def same(self, label: str, a: Any, b: Any) -> None:
        if a != b:
            tail = "\n".join(self.log[-12:])
            raise Mismatch(f"{self.what}: after {self.ops} operations, {label} differs:\n"
                           f"  reference: {a!r}\n  compiled:  {b!r}\nlast operations:\n{tail}")

    def call(self, name: str, *args: Any) -> tuple:
        """Call a method on both; the same outcome required. Returns the outcome."""
        self.ops += 1
        self.log.append(f"{name}{args!r}"[:200])
        if len(self.log) > 64:
            del self.log[:32]
        a = _outcome(getattr(self.ref, name), *args)
        b = _outcome(getattr(self.fast, name), *args)
        if name == "snapshot" and a[0] == b[0] == "ok":
            a, b = ("ok", _without_times(a[1])), ("ok", _without_times(b[1]))
        self.same(f"{name}{args!r}"[:120], a, b)
        return a

    def listen(self, raw: bool, columns: bool, callback: bool) -> None:
        self.ref_l.listen(raw, columns, callback)
        self.fast_l.listen(raw, columns, callback)

    def stop_listening(self) -> None:
        self.ref_l.stop()
        self.fast_l.stop()
        self.compare_events()

    def compare_events(self) -> None:
        self.ref.flush_events()
        self.fast.flush_events()
        ra, ca, ea = self.ref_l.take()
        rb, cb, eb = self.fast_l.take()
        self.same("journal records", ra, rb)
        self.same("subscribed events", ea, eb)
        if not _same_columns(ca, cb):
            self.same("event columns", [{k: v.tolist() for k, v in c.items()} for c in ca],
                      [{k: v.tolist() for k, v in c.items()} for c in cb])

    def compare_devices(self) -> None:
        self.same("sub-allocator calls", self.ref_dev.calls, self.fast_dev.calls)
        self.ref_dev.calls.clear()
        self.fast_dev.calls.clear()


# ------------------------------------------------------------------------------ BFC
BFC_SETTINGS = [
    # (name, limit, device capacity, allow_growth, garbage_collection, fragmentation, refuse)
    ("growth", 256 * MIB, GIB, True, False, 0.0, 0.0),
    ("growth+gc", 96 * MIB, GIB, True, True, 0.0, 0.02),
    ("no-growth", 64 * MIB, GIB, False, False, 0.0, 0.0),
    ("no-growth+gc+frag", 128 * MIB, GIB, False, True, 0.01, 0.01),
    ("device-short", 512 * MIB, 160 * MIB, True, True, 0.0, 0.0),
]
#: settings whose device hands out a share of ranges over earlier ones (refused alike)
OVERLAP = {"overlap": 0.03, "overlap+expandable": 0.03}
BFC_SETTINGS.append(("overlap", 256 * MIB, GIB, True, True, 0.0, 0.01))


def _bfc_pair(limit: int, capacity: int, growth: bool, gc: bool, frag: float, refuse: float,
              seed: int, overlap: float = 0.0) -> Pair:
    ref_dev = FlakyDevice(capacity, seed, refuse, overlap)
    fast_dev = FlakyDevice(capacity, seed, refuse, overlap)
    ref = PyBFCAllocator(ref_dev, limit, allow_growth=growth, garbage_collection=gc,
                         fragmentation_fraction=frag, name="GPU_0_bfc")
    fast = gpudash.BFCAllocator(fast_dev, limit, allow_growth=growth, garbage_collection=gc,
                                fragmentation_fraction=frag, name="GPU_0_bfc")
    return Pair(ref, fast, ref_dev, fast_dev, "")


def _size(rng: random.Random, limit: int) -> Any:
    r = rng.random()
    if r < 0.80:
        return int(2 ** rng.uniform(0, max(1.0, np.log2(limit) - 2)))
    if r < 0.86:
        return rng.choice([1, 255, 256, 257, 512, 1 << 20, (1 << 20) + 1, 128 * MIB])
    if r < 0.92:
        return int(limit * rng.uniform(0.2, 1.5))
    if r < 0.94:
        return 0
    return rng.choice([-1, 1 << 63, (1 << 63) - 257, (1 << 64) + 5, 1.0, "3", None, True,
                       np.int64(4096), np.uint32(100)])


def _bad_pointer(rng: random.Random, live: list, dead: list) -> Any:
    r = rng.random()
    if r < 0.3 and dead:
        return rng.choice(dead)
    if r < 0.5 and live:
        return rng.choice(live) + 256
    if r < 0.6 and live:
        return np.int64(rng.choice(live))
    return rng.choice([0, None, True, False, -5, 12345, 1 << 70, 0.0, "0x10", np.int64(0)])


def fuzz_bfc(ops: int, seed: int, setting: tuple, check_every: int = 2000) -> int:
    """One BFC run; the number of operations compared. Raises Mismatch."""
    name, limit, capacity, growth, gc, frag, refuse = setting
    rng = random.Random(seed)
    pair = _bfc_pair(limit, capacity, growth, gc, frag, refuse, seed, OVERLAP.get(name, 0.0))
    pair.what = f"bfc {name} seed {seed}"
    live: list[int] = []
    dead: list[int] = []
    listening = False
    ref, fast = pair.ref, pair.fast
    while pair.ops < ops:
        r = rng.random()
        if r < 0.36:
            n = _size(rng, limit)
            out = pair.call("allocate", n)
            if out[0] == "ok" and out[1]:
                live.append(out[1])
        elif r < 0.44:
            n = _size(rng, limit)
            out = pair.call("try_allocate", n, rng.random() < 0.5)
            if out[0] == "ok" and out[1]:
                live.append(out[1])
        elif r < 0.80:
            if live and rng.random() < 0.93:
                p = live.pop(rng.randrange(len(live)))
                pair.call("deallocate", p)
                dead.append(p)
                if len(dead) > 64:
                    del dead[:32]
            else:
                pair.call("deallocate", _bad_pointer(rng, live, dead))
        elif r < 0.83:
            batch = [live.pop(rng.randrange(len(live))) for _ in range(min(len(live),
                                                                          rng.randrange(1, 6)))]
            if rng.random() < 0.2:
                batch.append(_bad_pointer(rng, live, dead))
            pair.call("_deallocate_batch", batch)
            dead.extend(p for p in batch if isinstance(p, int))
        elif r < 0.88:
            p = rng.choice(live) if live and rng.random() < 0.8 else _bad_pointer(rng, live, dead)
            pair.call(rng.choice(["requested_size", "allocated_size", "allocation_id", "owns",
                                  "_live_size"]), p)
        elif r < 0.895:
            pool = ref.pool_bytes
            new = max(0, int(pool * rng.uniform(0.3, 1.6))) if rng.random() < 0.8 else \
                int(limit * rng.uniform(0.5, 1.5))
            pair.call("set_memory_limit", new if rng.random() < 0.97 else rng.choice(
                [-1, 1.5, "1GiB", 1 << 63]))
        elif r < 0.90:
            pair.call("set_allow_growth", rng.choice([True, False, True, "yes"]))
        elif r < 0.905:
            pair.call("release_free_regions")
        elif r < 0.908:
            pair.call("preallocate")
        elif r < 0.91:
            pair.call("clear_stats")
        elif r < 0.915:
            if listening:
                pair.stop_listening()
                listening = False
            else:
                pair.listen(raw=rng.random() < 0.7, columns=rng.random() < 0.7,
                            callback=rng.random() < 0.3)
                listening = True
        elif r < 0.916:
            pair.call("note_setting", "fraction", 0.5, rng.choice([0.25, 1, "x"]))
        else:
            pair.same("seq", ref.seq, fast.seq)
        pair.same("stats", ref.stats(), fast.stats())
        pair.same("limit_floor", ref.limit_floor, fast.limit_floor)
        if pair.ops % check_every == 0:
            _compare_bfc_state(pair)
    if listening:
        pair.stop_listening()
    _compare_bfc_state(pair)
    pair.call("close")
    pair.same("stats after close", ref.stats(), fast.stats())
    pair.compare_devices()
    return pair.ops


def _compare_bfc_state(pair: Pair) -> None:
    ref, fast = pair.ref, pair.fast
    ref.check()
    fast.check()
    pair.same("snapshot", ref.snapshot(), fast.snapshot())
    pair.same("memory log", ref.dump_memory_log(rng_bytes := 4096),
              fast.dump_memory_log(rng_bytes))
    pair.same("occupancy", ref.render_occupancy(), fast.render_occupancy())
    ta, tb = ref.chunk_table(), fast.chunk_table()
    pair.same("chunk table", {k: v.tolist() for k, v in ta.items()},
              {k: v.tolist() for k, v in tb.items()})
    pair.same("pending release", ref.pending_release(), fast.pending_release())
    pair.same("curr region", ref.curr_region_allocation_bytes,
              fast.curr_region_allocation_bytes)
    pair.compare_events()
    pair.compare_devices()


# ------------------------------------------------------------------------------ PyTorch
def _alike_size(rng: random.Random) -> Any:
    """Mostly a few sizes (two small, one large), else any of :func:`_torch_size`'s."""
    r = rng.random()
    if r < 0.95:
        return 512 if r < 0.6 else 1024 if r < 0.7 else 3 << 20
    return _torch_size(rng)


def _torch_size(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.45:
        return rng.randrange(1, 1 << 20)
    if r < 0.75:
        return rng.randrange(1 << 20, 10 << 20)
    if r < 0.93:
        return int(2 ** rng.uniform(23, 28.5))
    if r < 0.96:
        return rng.choice([1, 511, 512, 513, 1 << 20, (1 << 20) + 1, (10 << 20) - 511,
                           (10 << 20) - 513, 10 << 20, 20 << 20, 100 << 20])
    if r < 0.975:
        return int(2 ** rng.uniform(29, 31))
    if r < 0.98:
        return 0
    return rng.choice([-1, 1 << 60, 1 << 61, 2.0, None, True, np.int64(5000)])


TORCH_SETTINGS = [
    # (name, device capacity, conf, version, fraction, streams, refuse, live settings,
    #  alike: a few sizes, allocated and freed in bursts)
    ("default", 2 * GIB, "", None, None, (0,), 0.0, False, False),
    ("fraction+gc+mss", 8 * GIB, "garbage_collection_threshold:0.6,max_split_size_mb:100",
     None, 0.03, (0,), 0.0, False, False),
    ("roundup-2.3", 4 * GIB, "roundup_power2_divisions:[1:4,64:8,256:1,>:2]", "2.3", 0.05,
     (0,), 0.01, False, False),
    ("expandable", 4 * GIB, "expandable_segments:True", None, 0.04, (0,), 0.0, False,
     False),
    ("expandable+gc+streams", 4 * GIB, "expandable_segments:True,"
     "garbage_collection_threshold:0.7", None, 0.05, (0, 7, 0xDEADBEEF), 0.01, False,
     False),
    ("streams+mss-1.13", 2 * GIB, "max_split_size_mb:64", "1.13", None, (0, 3), 0.02, False,
     False),
    ("live-settings-2.6", 4 * GIB, "", "2.6", 0.05, (0, 5), 0.0, True, False),
    # hundreds of cached blocks of one size share a bin, which the compiled pools keep
    # sorted (from 8 entries here)
    ("alike+streams+mss", 8 * GIB, "max_split_size_mb:20", None, None, (0, 9), 0.0, False,
     True),
    # where the cores differed: settings beyond int64 (held whole), divisions whose
    # 512 * d overflows int64, streams at both ends of cudaStream_t and beyond it (refused
    # alike). PyTorch 2.8 on reads these numbers with std::stoull; before, with std::stoi,
    # which refuses them
    ("huge-settings+streams", 4 * GIB, f"max_split_size_mb:{1 << 43},"
     f"max_non_split_rounding_mb:{1 << 44},roundup_power2_divisions:[1:{1 << 62},>:4]",
     None, 0.05, (0, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -1, -(1 << 63), 1 << 64,
                   1 << 70, -(1 << 63) - 1), 0.01, True, False),
    # a device that hands out segments (and reserves ranges) over earlier ones; the live
    # settings draw random PYTORCH_CUDA_ALLOC_CONF strings too (_random_conf)
    ("overlap", 2 * GIB, "", None, None, (0, 3), 0.01, True, False),
    ("overlap+expandable", 4 * GIB, "expandable_segments:True", None, 0.05, (0,), 0.0, True,
     False),
]

_CONFS = ["expandable_segments:True", "expandable_segments:False", "max_split_size_mb:40",
          "max_split_size_mb:200", "garbage_collection_threshold:0.5",
          "roundup_power2_divisions:4", "roundup_power2_divisions:[256:2,>:4]",
          "max_split_size_mb:80,garbage_collection_threshold:0.8", "",
          "max_non_split_rounding_mb:64", "expandable_segments:True,max_split_size_mb:60",
          f"max_split_size_mb:{1 << 43}", f"max_split_size_mb:{1 << 60}",
          f"max_non_split_rounding_mb:{1 << 44}", f"roundup_power2_divisions:{1 << 62}",
          f"roundup_power2_divisions:[64:{1 << 55},>:{1 << 63}]"]


class FlakyTorchDevice(FlakyDevice):
    """FlakyDevice with the device facts PyTorch's model reads; with ``overlap`` it also
    reserves expandable ranges, a share of them over an earlier one."""

    @property
    def total(self) -> int:
        return self.dev.capacity

    def __getattr__(self, name: str) -> Any:
        if name in ("reserve", "unreserve") and self.__dict__.get("overlap"):
            return getattr(self, "_" + name)
        raise AttributeError(name)

    def _reserve(self, nbytes: int) -> int:
        bases = self.__dict__.setdefault("bases", [])
        if bases and self.rng.random() < 0.3:
            base = self.rng.choice(bases) + self.rng.choice([0, 2 << 20])
        else:
            base = (1 << 44) + len(bases) * (1 << 40)
            bases.append(base)
        self.calls.append(("reserve", base, nbytes))
        return base

    def _unreserve(self, base: int, nbytes: int) -> None:
        self.calls.append(("unreserve", base, nbytes))


_CONF_KEYS = ["max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
              "roundup_power2_divisions", "expandable_segments", "backend",
              "pinned_use_background_threads", "release_lock_on_cudamalloc",
              "pinned_num_register_threads", "bogus"]
_CONF_VALUES = ["128", "+128", "-1", "20", "19", "0", "0x80", "1e3", "128.0", "128MB",
                "\u0661\u0662\u0668", "18446744073709551616", "-18446744073709551615", "0.5",
                ".5", "1e-310", "0x1p-1", "nan", "inf", "1_0", " 64", "4", "3", "256", ">",
                "True", "False", "true", "9" * 30, "-0", "2147483648", "native",
                "cudaMallocAsync", "9" * 5000]
_CONF_NOISE = [",", ":", "[", "]", " ", "\t", "\n", "\x0b", "\x0c", "\r", "\xa0", "\x00",
               "0", "+", "-", ".", "x", "e"]


def _random_conf(rng: random.Random) -> str:
    """A PYTORCH_CUDA_ALLOC_CONF string from PyTorch's grammar (keys, ``:``, values,
    ``[k:v,...]`` lists, ``,``), then a few characters inserted, dropped or changed."""
    parts = []
    for _ in range(rng.randint(0, 4)):
        key = rng.choice(_CONF_KEYS)
        if key == "roundup_power2_divisions" and rng.random() < 0.5:
            items = [rng.choice(_CONF_VALUES + [">"])[:40] + rng.choice([":", ":", ","])
                     + rng.choice(_CONF_VALUES)[:40] for _ in range(rng.randint(0, 4))]
            value = "[" + ",".join(items) + rng.choice(["]", "]", "", "]]"])
        else:
            value = rng.choice(_CONF_VALUES)
        parts.append(key + rng.choice([":", ":", ":", ",", ""]) + value)
    text = rng.choice([",", ",", ", ", ":"]).join(parts)
    for _ in range(rng.randint(0, 3)):
        i = rng.randrange(len(text) + 1)
        op = rng.random()
        if op < 0.5:
            text = text[:i] + rng.choice(_CONF_NOISE) + text[i:]
        elif op < 0.8:
            text = text[:i] + text[i + 1:]
        else:
            text = text[:i] + rng.choice("0123456789") + text[i + 1:]
    return text


def fuzz_conf(ops: int, seed: int, setting: tuple, check_every: int = 2000) -> int:
    """Random settings strings: every version's parser answers a CachingAllocatorConfig or
    a ConfigError (never another exception), and both cores' ``set_allocator_settings``
    give the same outcome and the same settings after it."""
    from gpudash import ConfigError
    from gpudash._torch_conf import CachingAllocatorConfig
    from gpudash.caching import PyCachingAllocator

    rng = random.Random(seed)
    version = setting[1]
    ref_dev = FlakyTorchDevice(GIB, seed, 0.0)
    fast_dev = FlakyTorchDevice(GIB, seed, 0.0)
    ref = PyCachingAllocator(ref_dev, version=version)
    fast = gpudash.CachingAllocator(fast_dev, version=version)
    pair = Pair(ref, fast, ref_dev, fast_dev, f"conf {setting[0]} seed {seed}")
    live: list[int] = []
    while pair.ops < ops:
        text = _random_conf(rng)
        try:
            CachingAllocatorConfig(text, version=version)
        except ConfigError:
            pass
        except Exception as exc:  # noqa: BLE001 - the failure this fuzz looks for
            raise Mismatch(f"conf {text!r} (version {version}): {type(exc).__name__}: "
                           f"{exc}") from None
        pair.call("set_allocator_settings", text)
        pair.same("config", ref.config.as_dict(), fast.config.as_dict())
        if rng.random() < 0.3:
            out = pair.call("allocate", rng.choice([512, 3 << 20, 30 << 20, 130 << 20]), 0)
            if out[0] == "ok":
                live.append(out[1])
        if live and rng.random() < 0.3:
            pair.call("deallocate", live.pop(rng.randrange(len(live))))
        if pair.ops % check_every < 3:
            _compare_torch_state(pair)
    _compare_torch_state(pair)
    return pair.ops


CONF_SETTINGS = [("strings-2.11", "2.11"), ("strings-2.7", "2.7"), ("strings-1.13", "1.13")]


def fuzz_torch(ops: int, seed: int, setting: tuple, check_every: int = 2000) -> int:
    """One run of PyTorch's model; the number of operations compared. Raises Mismatch.
    With ``alike`` settings the compiled pools sort a bin from 8 entries (256 otherwise), so
    that bins change form often."""
    if not setting[-1]:
        return _fuzz_torch(ops, seed, setting, check_every)
    from gpudash import _core

    old = _core._set_sorted_bins_at(8)
    try:
        return _fuzz_torch(ops, seed, setting, check_every)
    finally:
        _core._set_sorted_bins_at(old)


def _fuzz_torch(ops: int, seed: int, setting: tuple, check_every: int) -> int:
    from gpudash.caching import PyCachingAllocator

    name, capacity, conf, version, fraction, streams, refuse, live, alike = setting
    size_of = _alike_size if alike else _torch_size
    rng = random.Random(seed)
    ref_dev = FlakyTorchDevice(capacity, seed, refuse, OVERLAP.get(name, 0.0))
    fast_dev = FlakyTorchDevice(capacity, seed, refuse, OVERLAP.get(name, 0.0))
    ref = PyCachingAllocator(ref_dev, conf, version=version, fraction=fraction)
    fast = gpudash.CachingAllocator(fast_dev, conf, version=version, fraction=fraction)
    pair = Pair(ref, fast, ref_dev, fast_dev, f"torch {name} seed {seed}")
    live_ptrs: list[tuple[int, int]] = []
    dead: list[int] = []
    listening = False
    while pair.ops < ops:
        r = rng.random()
        if alike and rng.random() < 0.6:
            # bursts: about 1,500 operations mostly allocating, then as many mostly freeing
            # (the steps of a model), the live blocks kept under 3,000
            freeing = (pair.ops // 1500) % 2 == 1 or len(live_ptrs) > 3000
            r = 0.45 + rng.random() * 0.37 if freeing else rng.random() * 0.45
        stream = rng.choice(streams)
        if r < 0.38:
            out = pair.call("allocate", size_of(rng), stream)
            if out[0] == "ok" and out[1]:
                live_ptrs.append(out[1])
        elif r < 0.45:
            out = pair.call("try_allocate", size_of(rng), True, stream)
            if out[0] == "ok" and out[1]:
                live_ptrs.append(out[1])
        elif r < 0.82:
            if live_ptrs and rng.random() < 0.95:
                p = live_ptrs.pop(rng.randrange(len(live_ptrs)))
                pair.call("deallocate", p)
                dead.append(p)
                if len(dead) > 64:
                    del dead[:32]
            else:
                pair.call("deallocate", _bad_pointer(rng, live_ptrs, dead))
        elif r < 0.84:
            pair.call("empty_cache")
        elif r < 0.87:
            p = rng.choice(live_ptrs) if live_ptrs and rng.random() < 0.8 else \
                _bad_pointer(rng, live_ptrs, dead)
            pair.call(rng.choice(["requested_size", "allocated_size", "allocation_id",
                                  "owns"]), p)
        elif r < 0.875:
            pair.call("cached_block_for", size_of(rng), stream)
        elif r < 0.88:
            pair.call("cached_releases")
        elif r < 0.885:
            if fraction is not None or rng.random() < 0.2:
                pair.call("set_memory_fraction", rng.choice([0.02, 0.03, 0.05, 0.1, 0.5,
                                                             1.0, 1.5, "x"]))
        elif r < 0.89:
            if live:
                if rng.random() < 0.4:
                    pair.call("set_allocator_settings", rng.choice(_CONFS))
                elif rng.random() < 0.5:
                    pair.call("set_allocator_settings", _random_conf(rng))
                else:
                    pair.call("set_allocator_settings", rng.choice(_CONFS + ["bogus:1"]))
        elif r < 0.893:
            pair.call(rng.choice(["reset_peak_stats", "reset_accumulated_stats"]))
        elif r < 0.896:
            pair.call("record_history", rng.random() < 0.7, rng.choice([50, 1000, 100000]))
        elif r < 0.899:
            if listening:
                pair.stop_listening()
                listening = False
            else:
                pair.listen(raw=rng.random() < 0.7, columns=rng.random() < 0.7,
                            callback=rng.random() < 0.3)
                listening = True
        elif r < 0.90:
            pair.call(rng.choice(["release_free_regions", "snapshot"]))
        pair.same("stats", ref.stats(), fast.stats())
        pair.same("limit_floor", ref.limit_floor, fast.limit_floor)
        if pair.ops % 16 == 0:
            pair.same("memory_stats", ref.memory_stats(), fast.memory_stats())
        if pair.ops % check_every == 0:
            _compare_torch_state(pair)
    if listening:
        pair.stop_listening()
    _compare_torch_state(pair)
    pair.call("close")
    pair.same("memory_stats after close", ref.memory_stats(), fast.memory_stats())
    pair.compare_devices()
    return pair.ops


def _without_times(snap: dict) -> dict:
    snap = dict(snap)
    snap["device_traces"] = [[{k: v for k, v in e.items() if k != "time_us"} for e in dev]
                             for dev in snap["device_traces"]]
    return snap


def _compare_torch_state(pair: Pair) -> None:
    ref, fast = pair.ref, pair.fast
    ref.check()
    fast.check()
    pair.same("memory_stats", ref.memory_stats(), fast.memory_stats())
    pair.same("snapshot", _without_times(ref.snapshot()), _without_times(fast.snapshot()))
    pair.same("memory dump", ref.memory_dump(), fast.memory_dump())
    pair.same("summary", ref.memory_summary(), fast.memory_summary())
    ta, tb = ref.chunk_table(), fast.chunk_table()
    pair.same("chunk table", {k: v.tolist() for k, v in ta.items()},
              {k: v.tolist() for k, v in tb.items()})
    pair.same("region table", ref._region_table(), fast._region_table())
    pair.same("repr", repr(ref), repr(fast))
    pair.compare_events()
    pair.compare_devices()


# ------------------------------------------------------------------------------ main
MODELS: dict[str, tuple[list, Callable]] = {"bfc": (BFC_SETTINGS, fuzz_bfc),
                                            "torch": (TORCH_SETTINGS, fuzz_torch),
                                            "conf": (CONF_SETTINGS, fuzz_conf)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000,
                    help="operations per model and setting")
    ap.add_argument("--model", default="all", choices=["all", *MODELS])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--check-every", type=int, default=2000)
    args = ap.parse_args(argv)
    if not getattr(gpudash.BFCAllocator, "compiled", False):
        print("the compiled core is not built (or GPUDASH_PURE_PYTHON is set): nothing to "
              "compare", file=sys.stderr)
        return 2
    logging.getLogger("gpudash").setLevel(logging.CRITICAL)
    total = 0
    for model, (settings, fuzz) in MODELS.items():
        if args.model not in ("all", model):
            continue
        for i, setting in enumerate(settings):
            t0 = time.perf_counter()
            try:
                n = fuzz(args.ops, args.seed + i, setting, args.check_every)
            except Mismatch as exc:
                print(f"MISMATCH {exc}", file=sys.stderr)
                return 1
            total += n
            print(f"{model:<6}{setting[0]:<22}{n:>12,} operations identical   "
                  f"{time.perf_counter() - t0:7.1f} s", flush=True)
    print(f"{total:,} operations, no difference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
