"""Shadow mode: a running PyTorch job on the dashboard, its allocator's own decisions
replayed live, and controls that act on the real process.

``gpudash.torch.attach()`` (or ``%gpudash --attach torch``), in the process that runs the
job (a training loop in a background thread, or between cells):

- turns on PyTorch's allocator history (``torch.cuda.memory._record_memory_history``, with
  Python stacks, a bounded ring);
- in a thread of its own, every ``interval`` (but after a read that took t, not before 7t
  more: an eighth of one core at most), reads the snapshot
  (``torch.cuda.memory._snapshot()``), finds the entries that are new since the previous
  read, and feeds only those through gpudash's
  exact model of PyTorch's caching allocator (the calls :func:`gpudash.trace.torch_replay.
  replay_exact` makes, resumed where the previous refresh stopped): the dashboard shows
  PyTorch's segments, blocks and allocating stacks, and the model checks every decision;
- the controls act on the process: ``torch.cuda.set_per_process_memory_fraction``, the
  whole settings string through the settings call the version has
  (``torch._C._accelerator_setAllocatorSettings`` from 2.9, else
  ``torch.cuda.memory._set_allocator_settings``), ``torch.cuda.empty_cache()``. Each answers
  in words (reserved before and after, what the new limit refuses) and with the exact
  replay of the run so far under the new setting (:meth:`Shadow.what_if`);
- an out-of-memory error in the job, caught by PyTorch's observer, is explained at the next
  refresh: where it failed (stack, step), and the setting that would have served it, found
  by replaying the recorded calls.

New entries. PyTorch's ring is returned oldest first, and every ``_snapshot()`` while
recording adds a ``snapshot`` entry. A refresh remembers the last two entries it read
(``time_us``, action, address, size) and looks for them from the newest entry backwards,
stopping at the first entry older than them: the work is in proportion to the new entries.
(PyTorch's ``_snapshot()`` itself copies its whole ring into Python; that cost is
PyTorch's and grows with ``history``.) When they are not found, the ring wrapped between
two refreshes and entries were lost: the model is rebuilt from the snapshot's segments
(each block as PyTorch lists it), the loss is counted and said (:attr:`ShadowDevice.notice`),
and feeding goes on from there. A decision the model does not reproduce is handled the same
way, so the view never drifts from PyTorch's layout.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import re
import threading
import time
from typing import Any

import numpy as np

from ._cells import display_name
from ._errors import ConfigError
from ._gc import collector_paused
from ._units import format_bytes
from .live.views import open_view
from ._torch_conf import CachingAllocatorConfig, parse_torch_version
from ._torch_hooks import listen as _listen, require_cuda as _require_cuda
from .caching import CachingAllocator
from .formats.torch_trace import (
    ACTIONS,
    A_ALLOC,
    A_FREE,
    A_OOM,
    TorchTrace,
    _MASK64,
    _SEGMENT_ACTIONS,
    from_snapshot,
    guess_version,
)
from .models import TORCH
from .session import SessionStacks
from .torch_install import installed as _installed
from .trace import torch_replay as tr
from .trace.torch_replay import ExactReplay, _Oracle, replay_exact

__all__ = ["attach", "Shadow", "ShadowDevice", "WhatIf", "OomExplanation",
           "SHADOW_HISTORY_ENTRIES"]

#: The history ring shadow mode asks PyTorch for (entries): see docs/frameworks.md,
#: "Shadow mode", for how it was chosen (benchmarks/bench_shadow.py, table c).
SHADOW_HISTORY_ENTRIES = 20_000

_TORCH_DIR = os.sep + "torch" + os.sep
_GPUDASH_DIR = os.path.dirname(os.path.abspath(__file__))
_STEP_RE = re.compile(r"ProfilerStep#(\d+)")
#: Seconds a history read serves previews for (:meth:`Shadow.preview`), at most.
PREVIEW_AGE = 1.0


def _internal(filename: str) -> bool:
    return (_TORCH_DIR in filename or filename.startswith(_GPUDASH_DIR)
            or filename.startswith("<frozen"))


def _where(frames: Any) -> str:
    """``train.py:88 forward``: the innermost frame of the job's own code."""
    for f in frames or ():
        fn = str(f.get("filename", ""))
        if fn and not _internal(fn):
            return f"{display_name(fn)}:{f.get('line', '?')} {f.get('name', '')}".strip()
    return ""


def _key(e: dict) -> tuple:
    return (e.get("time_us"), e.get("action"), e.get("addr", e.get("device_free")),
            e.get("size"))


class _Chunk:
    """What the replay's divergence report reads of a trace (``action``, ``addr``,
    ``size``, ``len``), over one refresh's entries."""

    def __init__(self, act: list, addr: list, size: list) -> None:
        self.action, self.addr, self.size = act, addr, size

    def __len__(self) -> int:
        return len(self.action)


# ------------------------------------------------------------------------------- results
@dataclasses.dataclass
class WhatIf:
    """The exact replay of the run so far under other settings (:meth:`Shadow.what_if`).

    Attributes
    ----------
    device : int
    fraction : float or None
        The ``set_per_process_memory_fraction`` replayed (None: none).
    conf : str
        The settings string replayed.
    calls : int
        The calls (allocations, frees, failed requests) replayed.
    failed : bool
        A request PyTorch served would have failed.
    call : int or None
        Which call (from 1, in the recorded run) would have failed first.
    entry : int or None
        Its index in the history ring.
    step : int or None
        Its step (``step_source`` says how steps were counted).
    step_source : str
    where : str
        The job's code that asked (``train.py:88 forward``).
    size : int
        The bytes it asked.
    served_ooms : int
        Out-of-memory errors of the run that these settings would have served.
    peak_reserved : int
        The replay's peak reserved bytes.
    text : str
        All that, in words.
    """

    device: int
    fraction: float | None
    conf: str
    calls: int = 0
    failed: bool = False
    call: int | None = None
    entry: int | None = None
    step: int | None = None
    step_source: str = ""
    where: str = ""
    size: int = 0
    served_ooms: int = 0
    real_ooms: int = 0
    peak_reserved: int = 0
    notes: list = dataclasses.field(default_factory=list)
    text: str = ""


@dataclasses.dataclass
class OomExplanation:
    """An out-of-memory error of the job, explained (:attr:`Shadow.ooms`).

    ``fix`` is the setting that would have served it (``{"fraction": 0.8}``,
    ``{"expandable_segments": True}``), ``proof`` the :class:`WhatIf` that shows it; both
    None when none of those tried would have."""

    time: float
    device: int
    size: int
    entry: int | None
    where: str
    stack: list
    step: int | None
    step_source: str
    reserved: int
    allocated: int
    limit: int
    fix: dict | None = None
    proof: WhatIf | None = None
    text: str = ""


# ------------------------------------------------------------------------------- a device
class ShadowDevice:
    """One CUDA device of a :class:`Shadow`: its model (``allocator``, a
    :class:`gpudash.CachingAllocator` that follows PyTorch's trace), the allocating stack of
    each live block, and how faithfully the model follows.

    Attributes
    ----------
    index : int
        PyTorch's device index.
    entries : int
        Trace entries fed to the model.
    lost : int
        Entries lost to a wrapped ring (never fed).
    resyncs : list of (time, reason)
        Each rebuild of the model from PyTorch's segments.
    notice : str or None
        The latest rebuild, in words (shown in the dashboard's status line).
    segment_events, segment_events_matched, allocs, allocs_matched, ooms, ooms_matched
        The exact replay's counts over every entry fed.
    """

    def __init__(self, shadow: Shadow, index: int, total: int) -> None:

        self._shadow = shadow
        self.index = index
        self.total = int(total)
        self.oracle = _Oracle(self.total)
        self.allocator = CachingAllocator(self.oracle, shadow._conf_now().copy(),
                                          name=f"cuda:{index}", device=index)
        self.allocator.device_index = index
        self.allocator.record_history(True, max_entries=1 << 40)
        self._hist: list = []
        self.allocator._history = self._hist
        self.known_fraction = False
        self._holders: dict[int, tuple[str, int]] = {}
        self._carry: list[tuple] = []
        self._last: tuple | None = None   # keys of the last two entries read
        self._seen = 0                    # entries in the ring at the last read
        self.entries = self.lost = 0
        self.resyncs: list[tuple[float, str]] = []
        self.notice: str | None = None
        self.segment_events = self.segment_events_matched = 0
        self.allocs = self.allocs_matched = self.ooms = self.ooms_matched = 0
        self.unexpected_ooms = 0
        self.divergences: list[str] = []
        self._res = None
        self._reset_result()

    def _reset_result(self) -> None:

        self._res = ExactReplay(self.index, "live")
        self._res._pos = len(self._hist)
        self._ptr_of: dict[int, int] = {}

    @property
    def name(self) -> str:
        return f"cuda:{self.index}"

    @property
    def exact(self) -> bool:
        """Every decision fed so far was PyTorch's (no rebuild after a divergence)."""
        return not self.divergences

    def settings(self) -> dict[str, Any]:
        """The settings in force, by the names of the PyTorch model's controls."""

        out = TORCH.live_settings(self.allocator)
        out["total"] = self.total
        if not self.known_fraction:
            out["fraction"] = None
        return out

    def summary(self) -> str:
        text = (f"{self.name}: {self.entries:,} entries fed, segment events "
                f"{self.segment_events_matched}/{self.segment_events}, addresses "
                f"{self.allocs_matched}/{self.allocs}, OOMs {self.ooms_matched}/{self.ooms}")
        if self.lost:
            text += f", {self.lost:,} entries lost to the ring wrapping"
        if self.resyncs:
            text += f", rebuilt from PyTorch's segments {len(self.resyncs)} time(s)"
        return text

    # ------------------------------------------------------------------ new entries
    def _new_entries(self, ring: list) -> list | None:
        """The entries of ``ring`` after those read last time (None: some were lost)."""
        n = len(ring)
        last = self._last
        if last is None:
            return []
        k1, k0 = last
        seen = self._seen
        if 0 < seen <= n and _key(ring[seen - 1]) == k1 and (
                seen < 2 or k0 is None or _key(ring[seen - 2]) == k0):
            return ring[seen:]
        t1 = k1[0]
        j = n - 1
        while j >= 0:
            e = ring[j]
            if _key(e) == k1 and (k0 is None or (j > 0 and _key(ring[j - 1]) == k0)
                                  or (j == 0 and k0 is None)):
                return ring[j + 1:]
            t = e.get("time_us")
            if t is not None and t1 is not None and t < t1:
                break
            j -= 1
        return None

    def _remember(self, ring: list) -> None:
        n = len(ring)
        self._seen = n
        if n:
            self._last = (_key(ring[-1]), _key(ring[-2]) if n > 1 else None)
        else:
            self._last = (None, None)

    # ------------------------------------------------------------------ feeding
    def _feed(self, entries: list, steps: Any) -> None:
        """Feed trace entries (PyTorch's dicts) through the model."""

        get = ACTIONS.get
        rows = self._carry
        holders = self._holders
        fresh: dict[int, Any] = {}   # blocks allocated in these entries: their frames
        for e in entries:
            a = get(e.get("action"), 0)
            if a == A_OOM:
                p = e.get("device_free", 0) or 0
            else:
                p = e.get("addr", 0) or 0
            s = e.get("stream", 0) or 0
            rows.append((a, int(p), int(e.get("size", 0) or 0), int(s) & _MASK64))
            if a == A_ALLOC:
                fresh[int(p)] = e.get("frames")
            elif a == A_FREE:
                if fresh.pop(int(p), None) is None:
                    holders.pop(int(p), None)
        # the stacks of the blocks still held (most of a step's are freed within it)
        stack_of = self._shadow._stack_id
        for p, frames in fresh.items():
            holders[p] = ("", stack_of(frames))
        self.entries += len(entries)
        self._run()

    def _run(self) -> None:

        rows = self._carry
        if not rows:
            return
        act = [r[0] for r in rows]
        addr = [r[1] for r in rows]
        size = [r[2] for r in rows]
        stream = [r[3] for r in rows]
        tt = _Chunk(act, addr, size)
        res, hist = self._res, self._hist
        had = res.first_divergence is not None
        # the entries of a call not all in the ring yet, and releases not yet attributed,
        # wait for the next read
        i, pending, _stopped = tr._replay_calls(self.allocator, self.oracle, res, tt, act, addr,
                                                size, stream, self._ptr_of,
                                                self.known_fraction, resumable=True)
        done = pending[0] if pending else i
        acts = np.asarray(act[:done], dtype=np.int8)
        self.segment_events += int(np.isin(acts, _SEGMENT_ACTIONS).sum())
        self.allocs += int((acts == A_ALLOC).sum())
        self.ooms += int((acts == A_OOM).sum())
        self.segment_events_matched += res.segment_events_matched
        self.allocs_matched += res.allocs_matched
        self.ooms_matched += res.ooms_matched
        self.unexpected_ooms += res.unexpected_ooms
        res.segment_events_matched = res.allocs_matched = res.ooms_matched = 0
        res.unexpected_ooms = 0
        del self._carry[:done]
        del hist[:res._pos]
        res._pos = 0
        if res.first_divergence is not None and not had:
            self.divergences.append(res.divergence.split("\n", 1)[0])
            self._shadow._resync_due.add(self.index)

    # ------------------------------------------------------------------ rebuild
    def _resync(self, snap: dict, reason: str) -> None:
        """Rebuild the model from the snapshot's segments of this device (PyTorch's layout
        now), in the same allocator object (the dashboard keeps watching it)."""

        alloc = self.allocator
        for seg in alloc.segments():
            for b in seg["blocks"]:
                if b["state"].startswith("active"):
                    alloc.deallocate(b["address"])
        alloc.empty_cache()
        o = self.oracle
        o.expected.clear()
        o.reserved, o.live = [], []
        o.used = o.returned = 0
        o.refuse_bytes, o.refuse_all, o.free_hint = -1, False, None
        del self._hist[:]
        self._carry = []
        segs = [s for s in snap.get("segments") or () if int(s.get("device", 0)) == self.index]
        empty = np.zeros(0, dtype=np.int64)
        tt = TorchTrace(self.index, np.zeros(0, dtype=np.int8), empty, empty, empty, segs,
                        snap.get("allocator_settings"), guess_version(snap))
        made = tr._construct(alloc, o, tt) if segs else {}
        del self._hist[:]
        self._reset_result()
        self._holders = {k: v for k, v in self._holders.items()
                         if any(s["address"] <= k < s["address"] + s["total_size"]
                                for s in segs)}
        when = time.strftime("%H:%M:%S")
        self.resyncs.append((time.time(), reason))
        if made is None:
            self.notice = (f"{self.name}: {reason}; PyTorch's segments could not be rebuilt "
                           f"by calls (expandable segments) at {when}: the view shows the "
                           "segments made from now on")
        else:
            self.notice = (f"{self.name}: {reason}; the model was rebuilt from PyTorch's "
                           f"segments at {when} ({len(segs)} segment(s))")


# ------------------------------------------------------------------------------- shadow
class Shadow:
    """A PyTorch job's allocator, mirrored live (see the module docstring).

    Made by :func:`attach`. Quacks like a gpudash session where the dashboard needs it
    (``devices``, ``configure``, ``empty_cache``, ``stacks``): ``gpudash.dashboard(shadow)``
    or :meth:`dashboard` show it, with controls that act on PyTorch.

    Attributes
    ----------
    devices : list of ShadowDevice
    ooms : list of OomExplanation
        Out-of-memory errors of the job, explained.
    answers : list of str
        What each control did, in words.
    refreshes : int
    refresh_seconds : list of float
        The time each refresh took (the latest 1,000).
    read_seconds, read_at : float
        The latest refresh's time, and when it ended (``time.monotonic()``; None before).
    pace : float
        After a read of t seconds the thread waits at least ``pace`` x t (:meth:`next_wait`).
    errors : list of str
        Refreshes that failed (the thread goes on).
    """

    def __init__(self, torch: Any, devices: list[int], history: int, interval: float,
                 steps: str, pace: float = 7.0) -> None:

        self._torch = torch
        self.history = history
        self.interval = float(interval)
        self.step_source = steps
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._closed = False
        self._steps: list[tuple[int, int]] = []   # (time_us, step) of shadow.step()
        self._step = 0
        self._resync_due: set[int] = set()
        self._pending_ooms: list[tuple] = []
        self.stacks = SessionStacks()
        self.ooms: list[OomExplanation] = []
        self.answers: list[str] = []
        self.errors: list[str] = []
        self.refreshes = 0
        self.refresh_seconds: list[float] = []
        self.pace = float(pace)
        self.read_seconds = 0.0      # the latest refresh: reading the ring and feeding it
        self.read_at: float | None = None   # when it read (time.monotonic())
        self._fraction_set: dict[int, float] = {}
        self._snap: dict | None = None
        self._snap_at = 0.0               # time.monotonic() of that read
        self._parsed: tuple = (None, None)   # (snapshot, its traces): the last parsed
        self._annotations: list = []
        self.devices = [ShadowDevice(self, i, int(torch.cuda.get_device_properties(i)
                                                  .total_memory)) for i in devices]
        for dev in self.devices:
            frac = self._get_fraction(dev.index)
            if frac is not None and frac < 1.0:
                dev.allocator.set_memory_fraction(frac)
                dev.known_fraction = True
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Shadow:
        if self._thread is None and self.interval > 0:
            self._thread = threading.Thread(target=self._loop, name="gpudash-torch-shadow",
                                            daemon=True)
            self._thread.start()
        return self

    def next_wait(self) -> float:
        """Seconds the reading thread waits before its next read: ``interval``, or
        ``pace`` times the latest read's time when that is longer, so reading PyTorch's
        history takes at most ``1 / (1 + pace)`` of one core (an eighth by default)
        however large the ring and however fast the job allocates."""
        return max(self.interval, self.pace * self.read_seconds)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.next_wait())
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - said, and the thread goes on
                self.errors.append(f"{time.strftime('%H:%M:%S')} refresh failed: {exc!r}")
                del self.errors[:-20]

    def stop(self) -> None:
        """Stop refreshing and turn PyTorch's history recording off (which clears it)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        try:
            self._torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:  # noqa: BLE001
            pass
        for dev in self.devices:
            dev._holders.clear()
        if self in _keep:
            _keep.remove(self)

    close = stop

    def __enter__(self) -> Shadow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __repr__(self) -> str:
        return (f"Shadow(torch {self._torch.__version__}, devices "
                f"{[d.index for d in self.devices]}, {self.refreshes} refreshes)")

    # ------------------------------------------------------------------ the session face
    def device(self, device: Any = None) -> ShadowDevice:
        if device is None:
            return self.devices[0]
        for dev in self.devices:
            if device in (dev.index, dev.name):
                return dev
        raise ConfigError(f"this shadow follows CUDA device(s) "
                          f"{[d.index for d in self.devices]}; got {device!r}")

    def _holder_text(self, holder: tuple[str, int]) -> str:
        label, sid = holder
        where = self.stacks.where(sid) if sid >= 0 else ""
        return f"{label} @ {where}" if label and where else (label or where)

    def _stack_id(self, frames: Any) -> int:
        if not frames:
            return -1
        st = self.stacks
        ids = []
        for f in frames:
            fn = str(f.get("filename", ""))
            if _internal(fn):
                continue
            key = (fn, int(f.get("line", 0) or 0), str(f.get("name", "")))
            i = st._frame_ids.get(key)
            if i is None:
                i = st._new(st._frame_ids, st.frames, key)
            ids.append(i)
            if len(ids) >= st.depth:
                break
        if not ids:
            return -1
        key = tuple(ids)
        i = st._stack_ids.get(key)
        return i if i is not None else st._new(st._stack_ids, st.stacks, key)

    def dashboard(self, **options: Any) -> Any:
        """The live dashboard over this shadow (its controls act on PyTorch): the view the
        package registers (:mod:`gpudash.live.views`); this layer does not import it."""
        return open_view("dashboard", self, **options)

    # ------------------------------------------------------------------ steps
    def step(self, n: int | None = None) -> int:
        """Mark the start of a training step (the next one, or step ``n``): what-ifs and
        OOM explanations then name steps by this counter, unless the job's
        ``ProfilerStep#N`` annotations are there."""
        with self._lock:
            self._step = self._step + 1 if n is None else int(n)
            self._steps.append((time.time_ns() // 1000, self._step))
            return self._step

    def _step_at(self, time_us: Any) -> tuple[int | None, str]:
        marks = []
        for a in self._annotations:
            m = _STEP_RE.search(str(a.get("name", "")))
            if m and str(a.get("stage", "START")).upper() == "START" and "time_us" in a:
                marks.append((int(a["time_us"]), int(m.group(1))))
        source = "the job's ProfilerStep#N annotations"
        if not marks:
            marks, source = list(self._steps), "shadow.step() calls"
        if not marks or time_us is None:
            return None, ""
        marks.sort()
        k = bisect.bisect_right(marks, (int(time_us), 1 << 62)) - 1
        return (marks[k][1], source) if k >= 0 else (None, source)

    # ------------------------------------------------------------------ refresh
    def _read(self) -> dict:
        snap = self._torch.cuda.memory._snapshot()
        self._snap = snap
        self._snap_at = time.monotonic()
        self._annotations = list(snap.get("external_annotations") or ())
        return snap

    def refresh(self) -> dict[int, int]:
        """Read PyTorch's snapshot and feed each device's new entries to its model; the new
        entries by device. Explains OOMs the observer reported since."""
        t0 = time.perf_counter()
        with self._lock, collector_paused():
            if self._closed:
                raise ConfigError("this shadow is stopped; attach again")
            snap = self._read()
            traces = snap.get("device_traces") or []
            out = {}
            for dev in self.devices:
                ring = traces[dev.index] if dev.index < len(traces) else []
                new = dev._new_entries(ring)
                if new is None:
                    lost = max(0, len(ring) - 1)
                    dev.lost += lost
                    dev._resync(snap, f"the history ring ({len(ring):,} entries) wrapped "
                                      "between two refreshes: entries were lost")
                    dev._remember(ring)
                    out[dev.index] = 0
                    continue
                if dev._last is None:       # the first read: start from PyTorch's layout
                    dev._resync(snap, "attached mid-run")
                    if not dev.allocator.segments():
                        dev.notice = None   # nothing held yet: nothing rebuilt, to say
                        dev.resyncs.pop()
                    dev._remember(ring)
                    out[dev.index] = 0
                    continue
                self._sync_settings(dev, snap)
                dev._feed(new, self._steps)
                dev._remember(ring)
                out[dev.index] = len(new)
            for d in sorted(self._resync_due):
                dev = self.device(d)
                dev._resync(snap, f"the model left PyTorch's decisions "
                                  f"({dev.divergences[-1]})")
            self._resync_due.clear()
            ooms, self._pending_ooms = self._pending_ooms, []
            # explained before another refresh returns (a caller's refresh() after an OOM
            # finds its explanation in ooms)
            for event in ooms:
                self.ooms.append(self._explain(event, snap))
        took = time.perf_counter() - t0
        self.read_seconds = took
        self.read_at = time.monotonic()
        self.refreshes += 1
        self.refresh_seconds.append(took)
        del self.refresh_seconds[:-1000]
        return out

    def live_note(self, device: Any = None) -> str | None:
        """What a view of ``device`` says beside its figures: how old the model's state is
        ("history read 0.8 s ago; a read takes 35 ms, one every 0.28 s"), the latest
        rebuild of the model (a ring that wrapped) and the latest failed refresh."""
        dev = self.device(device)
        parts = []
        if self._closed:
            parts.append("shadow mode stopped: the view shows the last state read")
        elif self.read_at is None:
            parts.append("PyTorch's history not read yet")
        else:
            ago = time.monotonic() - self.read_at
            text = f"history read {ago:.1f} s ago (a read takes {self.read_seconds * 1e3:.0f} ms"
            if self.running:
                text += f", one every {self.next_wait() + self.read_seconds:.2f} s"
            parts.append(text + ")")
        if dev.notice:
            parts.append(dev.notice)
        if self.errors:
            parts.append(self.errors[-1])
        return "; ".join(parts)

    def _sync_settings(self, dev: ShadowDevice, snap: dict) -> None:
        """Settings changed in the job's own code follow into the model."""
        settings = snap.get("allocator_settings") or {}
        text = settings.get("PYTORCH_CUDA_ALLOC_CONF")
        if text is not None and text != dev.allocator.config.as_conf():

            want = CachingAllocatorConfig.from_snapshot_settings(
                settings, version=dev.allocator.config.version)
            if want.as_conf() != dev.allocator.config.as_conf():
                dev.allocator.set_allocator_settings(want.as_conf())
        frac = self._get_fraction(dev.index)
        if frac is not None and (dev.known_fraction or frac < 1.0) and \
                frac != dev.allocator.fraction:
            dev.allocator.set_memory_fraction(frac)
            dev.known_fraction = True

    def _get_fraction(self, i: int) -> float | None:
        get = getattr(self._torch.cuda, "get_per_process_memory_fraction", None)
        if i in self._fraction_set:
            return self._fraction_set[i]
        try:
            return float(get(i)) if get is not None else None
        except Exception:  # noqa: BLE001 - older PyTorch
            return None

    def _conf_now(self) -> Any:

        v = parse_torch_version(str(self._torch.__version__).split("+")[0])
        try:
            snap = self._torch.cuda.memory._snapshot()
        except Exception:  # noqa: BLE001
            snap = {}
        return CachingAllocatorConfig.from_snapshot_settings(
            snap.get("allocator_settings") or {}, version=v)

    # ------------------------------------------------------------------ controls
    def _reserved(self, i: int) -> int:
        return int(self._torch.cuda.memory_stats(i).get("reserved_bytes.all.current", 0))

    def configure(self, per_process_gpu_memory_fraction: float | None = None,
                  allow_growth: bool | None = None, deferred_deletion_bytes: int | None = None,
                  device: Any = None, *, fraction: float | None = None,
                  conf: str | None = None, **parts: Any) -> str:
        """Change the job's allocator live; the answer in words (also in :attr:`answers`).

        ``fraction`` calls ``torch.cuda.set_per_process_memory_fraction`` on ``device`` (or
        every device followed). ``conf`` (a settings string) and ``parts``
        (``expandable_segments``, ``max_split_size_mb``, ``garbage_collection_threshold``...)
        make the whole settings string -- the settings in force with these changed, since
        PyTorch resets what the string leaves out -- and pass it to the settings call of
        this PyTorch. The answer says reserved before and after, what the new limit
        refuses, and what the run so far would have met under the new setting
        (:meth:`what_if`).

        Raises
        ------
        ConfigError
            A bad value (checked before anything changes), a TensorFlow setting, or a change
            PyTorch refused (its words; nothing changed).
        """

        for key, value in (("allow_growth", allow_growth),
                           ("deferred_deletion_bytes", deferred_deletion_bytes)):
            if value is not None:
                TORCH.check_setting(key, value)
        if per_process_gpu_memory_fraction is not None and fraction is not None and \
                per_process_gpu_memory_fraction != fraction:
            raise ConfigError("fraction and per_process_gpu_memory_fraction disagree: give one")
        frac = fraction if fraction is not None else per_process_gpu_memory_fraction
        if frac is not None:
            TORCH.check_setting("fraction", frac)
        for key, value in parts.items():
            TORCH.check_setting(key, value)
        targets = self.devices if device is None else [self.device(device)]
        with self._lock:
            self.refresh()
            before = {d.index: self._reserved(d.index) for d in self.devices}
            lines = []
            if conf is not None or parts:
                lines.append(self._set_settings(conf, parts))
            if frac is not None:
                for dev in targets:
                    lines.append(self._set_fraction(dev, float(frac), before[dev.index]))
            self.refresh()
        for dev in targets:
            after = self._reserved(dev.index)
            lines.append(f"{dev.name}: reserved {format_bytes(before[dev.index])} before, "
                         f"{format_bytes(after)} after")
            wi = self.what_if(dev.index)
            lines.append(wi.text)
        text = "\n".join(lines)
        self.answers.append(text)
        return text

    def _set_fraction(self, dev: ShadowDevice, frac: float, reserved: int) -> str:
        try:
            self._torch.cuda.set_per_process_memory_fraction(frac, dev.index)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConfigError(f"PyTorch refused set_per_process_memory_fraction({frac:g}, "
                              f"{dev.index}): {exc}; nothing changed") from None
        self._fraction_set[dev.index] = frac
        dev.allocator.set_memory_fraction(frac)
        dev.known_fraction = True
        limit = int(frac * dev.total)
        table = dev.allocator.chunk_table()
        free = table["size"][~table["in_use"]]
        largest = int(free.max()) if len(free) else 0
        room = max(0, limit - reserved)
        text = (f"{dev.name}: torch.cuda.set_per_process_memory_fraction({frac:g}, "
                f"{dev.index}): limit {format_bytes(limit)} of {format_bytes(dev.total)}. "
                f"From now on a request no cached block serves (the largest cached free block "
                f"is {format_bytes(largest)}) may take {format_bytes(room)} of new memory")
        if reserved > limit:
            text += (f"; reserved {format_bytes(reserved)} is {format_bytes(reserved - limit)} "
                     "above it: PyTorch keeps what it holds, and a request that needs new "
                     "memory first frees the cached segments, then fails")
        else:
            text += "; a larger one frees the cached segments first, then fails"
        return text

    def _set_settings(self, conf: str | None, parts: dict) -> str:
        dev0 = self.devices[0]
        new = dev0.allocator.config.copy()
        # the backend is PyTorch's to judge (it is fixed when CUDA starts): passed on as given
        backend = [p.strip() for p in (conf or "").split(",")
                   if p.split(":")[0].strip() == "backend"]
        if conf is not None:
            new.apply(",".join(p for p in conf.split(",")
                               if p.split(":")[0].strip() != "backend"))
        if parts:
            new.update(**parts)
        whole = ",".join(p for p in (new.as_conf(), *backend) if p)
        for dev in self.devices:      # what PyTorch would take live and later pay for
            TORCH.check_live_split(dev.allocator.chunk_table(),
                                   dev0.allocator.config.max_split_size, new.max_split_size,
                                   dev.name)
        setter = getattr(self._torch._C, "_accelerator_setAllocatorSettings", None)
        name = "torch._C._accelerator_setAllocatorSettings"
        if setter is None:
            setter = self._torch.cuda.memory._set_allocator_settings
            name = "torch.cuda.memory._set_allocator_settings"
        old = dev0.allocator.config.as_conf()
        try:
            setter(whole)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"PyTorch refused {name}({whole!r}) live: {exc}; nothing "
                              "changed (set it in PYTORCH_CUDA_ALLOC_CONF before the first "
                              "CUDA call, and restart)") from None
        clean = new.as_conf()
        for dev in self.devices:
            dev.allocator.set_allocator_settings(clean)
        segs = sum(len(d.allocator.chunk_table()["regions"]) for d in self.devices)
        text = (f"{name}({whole!r}): the whole string, since PyTorch resets what it leaves "
                f"out (was {old!r}); process-wide, every device")
        if new.expandable_segments != dev0.allocator.config.expandable_segments or (
                "expandable_segments" in parts):
            text += (f". expandable_segments applies to the segments made from now on: the "
                     f"{segs} segment(s) held stay as they were made (PyTorch 2.11 takes the "
                     "change live and converts nothing)")
        return text

    def empty_cache(self, device: Any = None) -> int:
        """``torch.cuda.empty_cache()`` (PyTorch's call empties every device's cache); the
        bytes returned on ``device`` (or all followed), said in :attr:`answers`."""
        with self._lock:
            self.refresh()
            targets = self.devices if device is None else [self.device(device)]
            before = {d.index: self._reserved(d.index) for d in targets}
            self._torch.cuda.empty_cache()
            self.refresh()
            freed = 0
            lines = []
            for dev in targets:
                after = self._reserved(dev.index)
                freed += max(0, before[dev.index] - after)
                held = len(dev.allocator.chunk_table()["regions"])
                lines.append(f"{dev.name}: torch.cuda.empty_cache(): reserved "
                             f"{format_bytes(before[dev.index])} before, "
                             f"{format_bytes(after)} after ({format_bytes(before[dev.index] - after)}"
                             f" returned); {held} segment(s) stay, each holding an allocated "
                             "block")
            self.answers.append("\n".join(lines))
            return freed

    release_free_regions = empty_cache

    def flush(self, device: Any = None) -> int:
        """PyTorch has no deferred frees: 0."""
        return 0

    # ------------------------------------------------------------------ what-if
    def what_if(self, device: Any = None, *, fraction: float | None = None,
                conf: str | None = None, snapshot: dict | None = None,
                **parts: Any) -> WhatIf:
        """The exact replay of the run so far (the calls in PyTorch's history ring) under
        other settings: the fraction in force unless ``fraction`` is given, the settings in
        force with ``conf`` / ``parts`` applied. Says the first call that would have failed
        (its step and the job's line), or that the run fits, and how many of the run's own
        OOMs would have been served."""

        dev = self.device(device)
        snap = snapshot if snapshot is not None else self._read_locked()
        cfg = dev.allocator.config.copy()
        if conf is not None:
            cfg.apply(conf)
        if parts:
            cfg.update(**parts)
        frac = fraction if fraction is not None else (
            dev.allocator.fraction if dev.known_fraction else None)
        seen, traces = self._parsed
        if seen is not snap:
            traces = from_snapshot(snap)
            self._parsed = (snap, traces)
        out = WhatIf(dev.index, frac, cfg.as_conf())
        tt = traces.get(dev.index)
        if tt is None or not len(tt):
            out.text = f"{dev.name}: no recorded calls to replay yet"
            return out
        res = replay_exact(tt, conf=cfg, fraction=frac, device_total=dev.total,
                           keep_snapshot=False)
        out.notes = list(res.notes)
        calls = np.flatnonzero(np.isin(tt.action, (A_ALLOC, A_FREE, A_OOM)))
        out.calls = int(res.calls)
        out.real_ooms = int(res.ooms)
        out.served_ooms = int(res.ooms - res.ooms_matched)
        out.peak_reserved = int(res.allocator.memory_stats().get("reserved_bytes.all.peak", 0))
        still = None   # the first of the run's own OOMs these settings would not serve
        for call, nbytes in res.oom_calls:
            if call >= len(calls):
                continue
            entry = int(calls[call])
            if tt.action[entry] != A_ALLOC:
                still = still or (call, entry, nbytes)
                continue
            raw = snap["device_traces"][dev.index][entry]
            out.failed, out.call, out.entry, out.size = True, call + 1, entry, int(nbytes)
            out.where = _where(raw.get("frames"))
            out.step, out.step_source = self._step_at(raw.get("time_us"))
            break
        setting = (f"fraction {frac:g}" if frac is not None else "no fraction") + (
            f", {cfg.as_conf()}" if cfg.as_conf() else "")
        if out.failed:
            step = f" (step {out.step}, counted by {out.step_source})" if out.step is not None \
                else ""
            out.text = (f"{dev.name}: at {setting} this run would have failed at call "
                        f"{out.call:,}{step}" + (f", {out.where}" if out.where else "")
                        + f": {format_bytes(out.size)} asked")
        elif still is not None:
            call, entry, nbytes = still
            raw = snap["device_traces"][dev.index][entry]
            where = _where(raw.get("frames"))
            step, source = self._step_at(raw.get("time_us"))
            stepw = f" (step {step}, counted by {source})" if step is not None else ""
            out.text = (f"{dev.name}: at {setting} every request PyTorch served would have "
                        f"been served, and the run's out-of-memory error at call {call + 1:,}"
                        f"{stepw}" + (f", {where}" if where else "") + " would still happen: "
                        f"{format_bytes(int(nbytes))} asked (peak reserved "
                        f"{format_bytes(out.peak_reserved)})")
        else:
            out.text = (f"{dev.name}: at {setting} the {out.calls:,} calls recorded would all "
                        f"have been served (peak reserved {format_bytes(out.peak_reserved)})")
        if out.real_ooms:
            out.text += (f"; {out.served_ooms} of the run's {out.real_ooms} out-of-memory "
                         "error(s) would have been served")
        if res.start != "empty":
            out.text += " (the ring starts mid-run: the replay starts from the layout then)"
        return out

    def preview(self, setting: str, value: Any, device: Any = None) -> str:
        """What a setting would have done to the run so far, before it is applied (the
        dashboard's controls show it while a slider is dragged or a value typed):
        :meth:`what_if` with ``setting`` (``per_process_gpu_memory_fraction`` or a part of
        PyTorch's settings string) at ``value``. Nothing changes in the job."""
        TORCH.check_setting(setting, value)
        # a slider dragged asks many times a second: the history read within the last
        # PREVIEW_AGE seconds serves them all (read and parsed once)
        snap = self._snap if self._snap is not None and \
            time.monotonic() - self._snap_at <= PREVIEW_AGE else None
        if setting in ("per_process_gpu_memory_fraction", "fraction"):
            wi = self.what_if(device, fraction=float(value), snapshot=snap)
        else:
            wi = self.what_if(device, snapshot=snap, **{setting: value})
        text = "what-if, not applied: " + wi.text
        if setting == "max_split_size_mb" and value is not None:
            dev = self.device(device)
            hazard = TORCH.split_hazard(dev.allocator.chunk_table(),
                                        dev.allocator.config.max_split_size, int(value) << 20)
            if hazard:
                text += ". Applying it live would be refused: " + \
                    TORCH.split_hazard_text(hazard, int(value) << 20)
        return text

    def _read_locked(self) -> dict:
        with self._lock:
            return self._read()

    # ------------------------------------------------------------------ OOMs
    def _on_oom(self, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        if self._closed:
            return
        self._pending_ooms.append((time.time(), int(device), int(alloc), int(device_allocated),
                                   int(device_free)))
        self._wake.set()

    def _explain(self, event: tuple, snap: dict) -> OomExplanation:

        t, d, nbytes, allocated, free = event
        dev = self.device(d) if any(x.index == d for x in self.devices) else self.devices[0]
        ring = (snap.get("device_traces") or [])[dev.index] if dev.index < len(
            snap.get("device_traces") or []) else []
        entry = next((k for k in range(len(ring) - 1, -1, -1)
                      if ACTIONS.get(ring[k].get("action")) == A_OOM), None)
        raw = ring[entry] if entry is not None else {}
        step, source = self._step_at(raw.get("time_us"))
        frames = [f for f in raw.get("frames") or () if not _internal(str(f.get("filename")))]
        stats = self._torch.cuda.memory_stats(dev.index)
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        frac = dev.allocator.fraction if dev.known_fraction else None
        limit = int(frac * dev.total) if frac is not None else dev.total
        ex = OomExplanation(t, dev.index, nbytes, entry, _where(frames), frames, step, source,
                            reserved, allocated, limit)
        where = f" at {ex.where}" if ex.where else ""
        stepw = f" (step {step}, counted by {source})" if step is not None else ""
        ex.text = (f"{dev.name}: PyTorch ran out of memory{where}{stepw}: "
                   f"{format_bytes(nbytes)} asked with {format_bytes(allocated)} allocated, "
                   f"{format_bytes(reserved)} reserved, limit {format_bytes(limit)}")
        # settings that would have served it, proven by replaying the run so far
        tries: list[dict] = []
        if frac is not None and frac < 1.0:
            steps = np.linspace(frac, 1.0, 6)[1:]
            tries += [{"fraction": round(float(f), 3)} for f in steps]
        if not dev.allocator.config.expandable_segments:
            tries.insert(0, {"expandable_segments": True})
        for fix in tries:
            wi = self.what_if(dev.index, snapshot=snap, **fix)
            if wi.served_ooms and not wi.failed:
                ex.fix, ex.proof = fix, wi
                name, value = next(iter(fix.items()))
                ex.text += (f". {name}={value} would have served it: {wi.text}")
                break
        else:
            ex.text += (". None of " + ", ".join(f"{k}={v}" for f in tries for k, v in f.items())
                        + " would have served it (replayed): the job needs less memory "
                        "(smaller batch, activation checkpointing)" if tries else
                        ". The device is full (no fraction to raise)")
        return ex


def attach(module: Any = None, *, devices: Any = None, history: int | None = None,
           interval: float = 0.25, start: bool = True, pace: float = 7.0) -> Shadow:
    """Follow a PyTorch job in this process live: its allocator's history through gpudash's
    exact model, controls that act on it, OOMs explained (see :mod:`gpudash.torch_shadow`).

    Parameters
    ----------
    module : optional
        The ``torch`` module (default ``import torch``; a stand-in with its API in tests).
    devices : int or list of int, optional
        CUDA devices to follow (default all): one model each.
    history : int, optional
        Entries of PyTorch's history ring (default :data:`SHADOW_HISTORY_ENTRIES`, 20,000).
        The ring must hold the entries made between two reads; when it wraps between two
        reads the model is rebuilt from PyTorch's segments, and that is said. A larger ring
        makes each read (``_snapshot()`` copies it all, holding the GIL) longer, and the
        what-if look further back.
    interval : float
        Seconds between reads, at least (0: no thread; call :meth:`Shadow.refresh`). After
        a read that took t the thread waits at least ``pace`` x t (7: an eighth of one core).
    pace : float
        See ``interval``.
    start : bool
        Start the refresh thread.

    Raises
    ------
    ConfigError
        PyTorch missing, no CUDA device, a device that does not exist.
    """

    torch = _require_cuda("attach to torch", module)
    if _installed() is not None:
        raise ConfigError(
            "install mode is on in this process: PyTorch's pluggable allocator records no "
            "history (CUDAPluggableAllocator does not support recordHistory), so there is "
            "nothing for shadow mode to read. gpudash.torch.installed().dashboard(), or "
            "%gpudash --attach torch, shows the installed allocator live, with its controls")
    if not hasattr(getattr(torch.cuda, "memory", None), "_snapshot"):
        raise ConfigError(f"torch {torch.__version__} has no torch.cuda.memory._snapshot(); "
                          "shadow mode needs PyTorch >= 2.1")
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval < 0:
        raise ConfigError(f"interval must be seconds >= 0; got {interval!r}")
    history = SHADOW_HISTORY_ENTRIES if history is None else history
    if isinstance(history, bool) or not isinstance(history, int) or history < 1:
        raise ConfigError(f"history must be an integer >= 1 (ring entries); got {history!r}")
    count = torch.cuda.device_count()
    ids = list(range(count)) if devices is None else (
        [devices] if isinstance(devices, int) else list(devices))
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count:
            raise ConfigError(f"PyTorch has no CUDA device {i!r}; accepted: 0..{count - 1}")
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=history)
    if isinstance(pace, bool) or not isinstance(pace, (int, float)) or pace < 0:
        raise ConfigError(f"pace must be a number >= 0 (reads' waits over their time); "
                          f"got {pace!r}")
    shadow = Shadow(torch, ids, history, interval, "", pace)
    _listen(shadow, "attach to torch", torch)
    _keep.append(shadow)
    shadow.refresh()
    return shadow.start() if start else shadow


_keep: list[Shadow] = []   # PyTorch's observer list holds weak references
