"""Exact replay of PyTorch memory snapshots through :class:`~gpudash.CachingAllocator`.

PyTorch's snapshot (``torch.cuda.memory._dump_snapshot``) records every decision its caching
allocator made: ``segment_alloc``/``segment_map`` (memory asked of the driver),
``segment_free``/``segment_unmap`` (memory given back), ``alloc``, ``free_completed`` and
``oom``. :func:`replay_exact` makes the same calls (allocs, frees, failed requests) through
gpudash's model and checks that it makes the same decisions:

- **Addresses.** A new segment's address is the CUDA driver's choice, so the model takes
  it from the trace (the ``segment_alloc`` of the same call; for an expandable segment,
  the first ``segment_map`` outside the ranges already reserved). PyTorch breaks ties
  between equal-size free blocks by address, so this matters.
- **Releases.** The trace does not log ``empty_cache()`` calls, nor the driver refusing
  memory. A run of ``segment_free``/``segment_unmap`` right before a call that gets new
  memory (or fails) is the allocator's reaction to a refusal: the replay refuses device
  memory in that call until the model has given back as many bytes (it then decides
  itself what to release: oversize blocks first under ``max_split_size_mb``, then
  everything). Any other run is an explicit ``torch.cuda.empty_cache()``. An ``oom`` entry
  is a request the driver refused every time. With a known
  ``set_per_process_memory_fraction`` (and the device's total memory) the model's own limit
  decides instead.
- **Mid-run traces.** PyTorch keeps the last ``max_entries`` events, so a trace can start
  after segments and allocations that still exist. The starting state is rebuilt from the
  final segments by walking the trace backwards (as MemoryViz does): segments that existed
  before, blocks allocated before (their size from the final layout, or the request rounded,
  extended over a leftover the allocator would not have split), the free gaps between them.
  Garbage-collection ages before the trace are unknowable (0).

The result (:class:`ExactReplay`) says per device how many segment events, allocation
addresses and out-of-memory points matched, whether the final layout equals the snapshot's
``segments`` (sizes, blocks and their states, in order), where the first divergence is, and
what could not be exact.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left, insort
from collections import deque
from typing import Any

import numpy as np

from .._torch_conf import CachingAllocatorConfig, parse_torch_version
from ..caching import (
    K_SMALL_SIZE,
    CachingAllocator,
    PyCachingAllocator,
    _Block,
    _ExpandableSegment,
    _inc,
    _inc1,
    _key,
)
from ..formats.torch_trace import (  # noqa: F401 - re-exported: replay's inputs, by their old home
    _GETS,
    _MASK64,
    _RELEASES,
    _SEGMENT_ACTIONS,
    A_ALLOC,
    A_FREE,
    A_FREE_REQ,
    A_MAP,
    A_OOM,
    A_SEG_ALLOC,
    A_SEG_FREE,
    A_UNMAP,
    ACTION_NAMES,
    ACTIONS,
    StartSegment,
    TorchTrace,
    _blocks_of,
    _Ranges,
    _starts_empty,
    _state,
    _u64,
    from_snapshot,
    from_trace,
    guess_version,
    start_state,
)

__all__ = ["TorchTrace", "ExactReplay", "StartSegment", "from_snapshot", "from_trace",
           "replay_exact", "start_state", "ACTIONS", "ACTION_NAMES", "guess_version"]

# ---------------------------------------------------------------------------------- result
@dataclasses.dataclass(eq=False)
class ExactReplay:
    """How closely :class:`~gpudash.CachingAllocator` reproduced one device's trace.

    Attributes
    ----------
    device : int
    start : str
        ``"empty"`` (the trace starts from an empty allocator: exact replay is checkable) or
        ``"mid-run"`` (the starting state was rebuilt from the final segments).
    segment_events, segment_events_matched : int
        ``segment_alloc``/``segment_free``/``segment_map``/``segment_unmap`` entries of the
        trace, and how many the model made identically (action, address, size) at the same
        place within the same call.
    allocs, allocs_matched : int
        ``alloc`` entries, and how many got the same address.
    ooms, ooms_matched : int
        ``oom`` entries, and how many the model also failed.
    unexpected_ooms : int
        Requests the model refused that the trace served.
    final_layout_equal : bool or None
        Whether the model's segments equal the snapshot's (address, size, blocks with their
        sizes and states, in order); None without final segments.
    final_mismatch : str
        The first difference of the final layouts ("" when equal).
    first_divergence : int or None
        Index of the first trace entry whose call the model did not reproduce.
    divergence : str
        What differed there, with the trace entries around it.
    notes : list of str
        What the replay assumed (rebuilt starting state, release runs read as
        ``empty_cache()``, unknown fraction...).
    empty_cache_calls : int
        Release runs replayed as explicit ``empty_cache()`` calls.
    pressure_calls : int
        Calls in which the replay refused device memory (as the trace shows the driver did).
    snapshot : dict
        The model's own snapshot at the end, in PyTorch's layout with ``device_traces``.
    allocator : CachingAllocator
        The model after the replay.
    """

    device: int
    start: str
    segment_events: int = 0
    segment_events_matched: int = 0
    allocs: int = 0
    allocs_matched: int = 0
    ooms: int = 0
    ooms_matched: int = 0
    unexpected_ooms: int = 0
    final_layout_equal: bool | None = None
    final_mismatch: str = ""
    first_divergence: int | None = None
    divergence: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    empty_cache_calls: int = 0
    pressure_calls: int = 0
    calls: int = 0
    oom_calls: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    rebuilt: dict = dataclasses.field(default_factory=dict)
    snapshot: dict = dataclasses.field(default_factory=dict, repr=False)
    allocator: Any = dataclasses.field(default=None, repr=False)
    _pos: int = dataclasses.field(default=0, repr=False)

    @property
    def exact(self) -> bool:
        """Every segment event, address and OOM matched and the final layout is equal."""
        return (self.segment_events_matched == self.segment_events
                and self.allocs_matched == self.allocs and self.ooms_matched == self.ooms
                and not self.unexpected_ooms and self.final_layout_equal is not False)

    def summary(self) -> str:
        """One line: ``device 0 (empty start): segment events 61/61, addresses
        7946/7946, OOMs 0/0, final layout equal``."""
        fl = {True: "final layout equal", False: "final layout differs",
              None: "no final layout"}[self.final_layout_equal]
        text = (f"device {self.device} ({self.start} start): segment events "
                f"{self.segment_events_matched}/{self.segment_events}, addresses "
                f"{self.allocs_matched}/{self.allocs}, OOMs {self.ooms_matched}/{self.ooms}"
                f"{f', {self.unexpected_ooms} unexpected OOMs' if self.unexpected_ooms else ''}"
                f", {fl}")
        return text


# ---------------------------------------------------------------------------------- oracle
class _Oracle:
    """The device under a replay: addresses from the trace, refusals where the trace shows
    the driver refused."""

    kind = "replay"
    #: Its addresses are a recording's, not a device's own choice: the model's expandable
    #: reservations span the device's total memory as gpudash assumes it, which may exceed
    #: the recorded device's, so a recorded segment may lie where the model's reservation
    #: would reach but the real one did not (see PyCachingAllocator._clash).
    recorded_addresses = True

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.expected: deque = deque()     # (action, addr, size) segment gets of this call
        self.reserved: list[tuple[int, int]] = []
        self.extents: list[tuple[int, int]] = []    # reservations: (base, size)
        self.refuse_bytes = -1             # refuse until this many bytes came back (-1: no)
        self.refuse_all = False
        self.returned = 0
        self.synthetic = 0x100000000000
        self.live: list[tuple[int, int]] = []   # segments handed out, by address
        self.address_misses = 0
        self.free_hint: int | None = None

    # cudaMalloc / cudaFree
    def alloc(self, nbytes: int) -> int:
        if self._refusing():
            raise MemoryError("refused (as in the trace)")
        for i, (act, addr, size) in enumerate(self.expected):
            if act == A_SEG_ALLOC:
                del self.expected[i]
                if size == nbytes and not self._overlaps(addr, nbytes):
                    return self._take(addr, nbytes)
                break
        # the model asked for other memory than the trace shows (it diverged): an address
        # no trace segment uses
        self.address_misses += 1
        ptr = self._synthetic(nbytes)
        self.synthetic += (nbytes + (2 << 20) - 1) // (2 << 20) * (2 << 20) + (2 << 20)
        return self._take(ptr, nbytes)

    def _synthetic(self, nbytes: int) -> int:
        """The next address no trace segment uses, past what was handed out there, and
        outside every reservation."""
        while self._overlaps(self.synthetic, nbytes) or any(
                b < self.synthetic + nbytes and self.synthetic < b + n for b, n in self.extents):
            self.synthetic += 1 << 30
        return self.synthetic

    def _take(self, ptr: int, nbytes: int) -> int:
        insort(self.live, (ptr, nbytes))
        self.used += nbytes
        return ptr

    def _overlaps(self, ptr: int, nbytes: int) -> bool:
        """Whether [ptr, ptr + nbytes) meets a segment handed out: the model refuses a
        device that hands out one range twice, so such a trace address (the trace and the
        model diverged, or the trace is damaged) is not handed out."""
        i = bisect_left(self.live, (ptr, 0))
        if i < len(self.live) and self.live[i][0] < ptr + nbytes:
            return True
        return i > 0 and self.live[i - 1][0] + self.live[i - 1][1] > ptr

    def free(self, ptr: int, nbytes: int) -> None:
        i = bisect_left(self.live, (ptr, nbytes))
        if i < len(self.live) and self.live[i] == (ptr, nbytes):
            del self.live[i]
        self.used -= nbytes
        self.returned += nbytes

    # expandable segments
    def reserve(self, nbytes: int) -> int:
        # A reservation is mapped from its base upward: a map at or below a reservation's
        # high-water mark extends it; the first map beyond every one starts a new one.
        for act, addr, size in self.expected:
            if act == A_MAP and not any(b <= addr <= top for b, top in self.reserved):
                if self._overlaps(addr, nbytes):
                    break
                self.reserved.append((addr, addr))
                self.extents.append((addr, nbytes))
                return addr
        self.address_misses += 1
        ptr = self._synthetic(nbytes)
        self.synthetic += nbytes + (1 << 30)
        self.reserved.append((ptr, nbytes))
        self.extents.append((ptr, nbytes))
        return ptr

    def unreserve(self, base: int, nbytes: int) -> None:
        self.reserved = [(b, top) for b, top in self.reserved if b != base]
        self.extents = [(b, n) for b, n in self.extents if b != base]

    def mapped(self, addr: int, size: int) -> None:
        """Raise the high-water mark of the reservation holding ``addr``."""
        for k, (b, top) in enumerate(self.reserved):
            if b <= addr <= top:
                self.reserved[k] = (b, max(top, addr + size))
                return

    def create_page(self, nbytes: int) -> int:
        if self._refusing():
            raise MemoryError("refused (as in the trace)")
        self.used += nbytes
        return 1

    def release_page(self, handle: int, nbytes: int) -> None:
        self.used -= nbytes
        self.returned += nbytes

    def _refusing(self) -> bool:
        if self.refuse_all:
            return True
        return self.refuse_bytes >= 0 and self.returned < self.refuse_bytes

    def memory_info(self) -> tuple[int, int]:
        if self.free_hint is not None:
            return self.free_hint, self.total
        return max(0, self.total - self.used), self.total


# ---------------------------------------------------------------------------------- replay
def replay_exact(tt: TorchTrace, *, conf: Any = None, fraction: float | None = None,
                 device_total: int | None = None, version: Any = None,
                 max_entries: int = 10_000_000, sample: list | None = None,
                 attach: Any = None, progress: Any = None,
                 stop_at_oom: int | None = None, keep_snapshot: bool = True) -> ExactReplay:
    """Replay one device's PyTorch trace through the model with the trace's own addresses,
    and compare every decision (see the module docstring).

    Parameters
    ----------
    tt : TorchTrace
    conf : str, dict or CachingAllocatorConfig, optional
        The settings the job ran with. Default: the snapshot's ``allocator_settings``, else
        PyTorch's defaults (said in ``notes``).
    fraction : float, optional
        ``set_per_process_memory_fraction`` the job used (a snapshot does not record it).
    device_total : int, optional
        The device's total memory (``cudaMemGetInfo``'s total); needed with ``fraction``.
        Default: enough for the trace (it is only a ceiling the replay never reaches).
    version : str or tuple, optional
        The PyTorch version (default: guessed from the snapshot's layout).
    sample : list of three lists, optional
        Filled with the allocated bytes, reserved bytes and largest free block after every
        call of the trace (alloc, free, oom), as :func:`gpudash.trace.replay.replay` samples.
    attach : callable, optional
        ``attach(allocator)`` once the starting state is in place, before the first call
        (a recorder of the replay's events).
    progress : callable, optional
        ``progress(done, total)`` in trace entries, every 65,536 entries and at the end.
    stop_at_oom : int, optional
        Stop right after the trace's ``stop_at_oom``-th out-of-memory entry (from 1): the
        allocator is left as it was when PyTorch raised (its cache already released), and
        the counts cover the entries up to there; no final layout is compared.
    keep_snapshot : bool
        Keep the replayed allocator's snapshot (``snapshot``, its history included); False
        leaves it empty (a what-if that reads only the counts and the allocator).
    """
    notes: list[str] = []
    if stop_at_oom is not None and stop_at_oom < 1:
        raise ValueError(f"stop_at_oom counts from 1; got {stop_at_oom}")
    v = parse_torch_version(version) if version is not None else tt.version
    if isinstance(conf, CachingAllocatorConfig):
        cfg = conf.copy()
    elif isinstance(conf, str):
        cfg = CachingAllocatorConfig(conf, version=v)
    elif isinstance(conf, dict) or (conf is None and tt.settings):
        cfg = CachingAllocatorConfig.from_snapshot_settings(conf or tt.settings, version=v)
    else:
        cfg = CachingAllocatorConfig(version=v)
        notes.append("the snapshot has no allocator_settings: PyTorch's defaults assumed "
                     "(pass conf= with the job's PYTORCH_CUDA_ALLOC_CONF)")
    if fraction is not None and device_total is None:
        raise ValueError("fraction needs device_total (the device's total memory)")
    total = device_total or (1 << 50)
    start = _starts_empty(tt)

    def make(model: type) -> tuple[Any, _Oracle]:
        oracle = _Oracle(total)
        alloc = model(oracle, cfg, name=f"cuda:{tt.device}", device=tt.device)
        alloc.record_history(True, max_entries=max_entries + 1)
        if fraction is not None:
            alloc.set_memory_fraction(fraction)
        return alloc, oracle

    # The compiled core where it is built (the pure-Python model otherwise). A trace that
    # starts mid-run gets its starting state made by calls where that gives exactly the
    # rebuilt layout (it does for every real snapshot at hand), else built in the
    # pure-Python model's records.
    alloc, oracle = make(CachingAllocator)
    res = ExactReplay(tt.device, "empty", notes=notes)
    act, addr, size, stream = (tt.action.tolist(), tt.addr.tolist(), tt.size.tolist(),
                               tt.stream.astype(np.uint64).tolist())
    if not start:
        res.start = "mid-run"
        made = _construct(alloc, oracle, tt) if fraction is None else None
        if made is None:
            alloc, oracle = make(PyCachingAllocator)
            made = _rebuild(alloc, oracle, tt)
        res.rebuilt = made
        notes.append(
            f"the trace starts mid-run: its starting state was rebuilt from the final "
            f"segments ({res.rebuilt['segments']} segment(s), {res.rebuilt['blocks']} "
            f"block(s) allocated before the trace, {res.rebuilt['guessed']} of them sized "
            "from their request)")
    alloc._history.clear()
    # a list while replaying: each call's new entries are read from where the last ended
    alloc._history = hist = []
    res._pos = 0
    if attach is not None:
        attach(alloc)
    ptr_of: dict[int, int] = {}   # trace address -> model address of live allocations
    known_fraction = fraction is not None
    i, pending, stop = _replay_calls(alloc, oracle, res, tt, act, addr, size, stream, ptr_of,
                                     known_fraction, sample=sample, progress=progress,
                                     stop_at_oom=stop_at_oom)
    done = tt.action[:i] if stop else tt.action
    res.segment_events = int(np.isin(done, _SEGMENT_ACTIONS).sum())
    res.allocs = int((done == A_ALLOC).sum())
    res.ooms = int((done == A_OOM).sum())
    if res.empty_cache_calls:
        notes.append(f"{res.empty_cache_calls} run(s) of segment releases replayed as "
                     "torch.cuda.empty_cache() calls (PyTorch does not log those calls)")
    if res.pressure_calls and not known_fraction:
        notes.append(f"{res.pressure_calls} call(s) met a device refusal where the trace "
                     "shows one (releases before new memory, or an oom entry)")
    if stop:
        notes.append(f"stopped at the out-of-memory entry {i - 1} (entries after it not "
                     "replayed)")
    elif tt.final is not None:
        mismatch = _compare_final(alloc, tt.final)
        res.final_layout_equal = not mismatch
        res.final_mismatch = mismatch
    alloc.check()
    alloc._history = deque(hist, maxlen=max_entries + 1)
    res.snapshot = alloc.snapshot() if keep_snapshot else {}
    res.allocator = alloc
    return res


def _replay_calls(alloc: CachingAllocator, oracle: _Oracle, res: ExactReplay, tt: Any,
                  act: list, addr: list, size: list, stream: list, ptr_of: dict[int, int],
                  known_fraction: bool, *, resumable: bool = False, sample: list | None = None,
                  progress: Any = None, stop_at_oom: int | None = None
                  ) -> tuple[int, list[int], bool]:
    """Replay the calls of a run of trace entries (``act``, ``addr``, ``size``, ``stream``)
    on ``alloc``, comparing each decision with the trace's (``res`` keeps the counts and
    the first divergence); ``ptr_of`` maps the trace's addresses of live blocks to the
    model's and carries over from one run to the next.

    ``resumable`` (shadow mode, which reads PyTorch's ring as it grows): a call whose
    segment entries are in the run but whose alloc is not yet stops the run there, and a
    run of releases at its end is left unattributed; the caller keeps both for the next
    entries. Otherwise such a call is noted and a trailing run of releases replayed as
    ``empty_cache()``.

    Returns ``(i, pending, stopped)``: the entry the run stopped at (``len(act)`` when it
    went through), the indices of the releases not yet attributed, and whether the
    ``stop_at_oom``-th out-of-memory entry ended it.
    """
    n = len(act)
    i = 0
    pending: list[int] = []        # indices of a release run not yet attributed
    calls = res.calls
    hist = alloc._history
    try_allocate, deallocate = alloc.try_allocate, alloc.deallocate
    sampling = sample is not None
    if sampling:
        s_in, s_pool, s_lf = (lst.append for lst in sample)
        in_use = type(alloc).bytes_in_use.__get__
        largest = alloc._largest_free_block

    stop = False
    ooms_left = stop_at_oom

    def after_call(oom_bytes: int = 0) -> None:
        nonlocal calls
        if oom_bytes:
            res.oom_calls.append((calls, oom_bytes))
        calls += 1
        if sampling:
            s_in(in_use(alloc))
            s_pool(alloc._reserved)
            s_lf(largest())

    next_report = 1 << 16
    while i < n:
        if progress is not None and i >= next_report:
            progress(i, n)
            next_report += 1 << 16
        a = act[i]
        if a == A_FREE_REQ and not pending:     # its free_completed makes the call
            i += 1
            continue
        if a == A_ALLOC and not pending and res._pos == len(hist):
            # the common call: served from the cache at the trace's address, nothing else
            if oracle.expected:
                oracle.expected = deque()
            oracle.returned = 0
            before = len(hist)
            p = try_allocate(size[i], True, stream[i])
            if p and p == addr[i] and len(hist) == before + 1:
                res._pos = before + 1
                ptr_of[p] = p
                res.allocs_matched += 1
                calls += 1
                if sampling:
                    s_in(in_use(alloc))
                    s_pool(alloc._reserved)
                    s_lf(largest())
            else:
                served = _after_malloc(alloc, oracle, res, tt, addr, size, i, i, [], [], p,
                                       ptr_of)
                after_call(0 if served else size[i])
            i += 1
            continue
        if a == A_FREE and not pending:
            p = ptr_of.pop(addr[i], None)
            if p is not None:
                before = len(hist)
                try:
                    deallocate(p)
                except Exception as exc:  # noqa: BLE001 - recorded as a divergence
                    _diverge(res, i, tt, f"free_completed of {addr[i]:#x}: {exc}")
                if res._pos == before and len(hist) == before + 2:
                    res._pos = before + 2      # its free_requested and free_completed
                calls += 1
                if sampling:
                    s_in(in_use(alloc))
                    s_pool(alloc._reserved)
                    s_lf(largest())
                i += 1
                continue
        if a in _RELEASES:
            pending.append(i)
            i += 1
            continue
        if a in _GETS:
            # the gets (and releases between them) up to the call they belong to
            j = i
            while j < n and act[j] in _SEGMENT_ACTIONS:
                j += 1
            if j < n and act[j] in (A_ALLOC, A_OOM):
                served = _call(alloc, oracle, res, tt, act, addr, size, stream, pending, i,
                               j + 1, ptr_of, known_fraction)
                after_call(0 if served else size[j])
                pending = []
                i = j + 1
                if act[j] == A_OOM and ooms_left is not None:
                    ooms_left -= 1
                    if ooms_left == 0:
                        stop = True
                        break
                continue
            if resumable and j >= n:        # the call's alloc is not in the ring yet
                break
            res.notes.append(f"entry {i}: a {ACTION_NAMES[a]} that no alloc follows")
            i = j
            continue
        if a in (A_ALLOC, A_OOM):
            served = _call(alloc, oracle, res, tt, act, addr, size, stream, pending, i, i + 1,
                           ptr_of, known_fraction)
            after_call(0 if served else size[i])
            pending = []
            i += 1
            if a == A_OOM and ooms_left is not None:
                ooms_left -= 1
                if ooms_left == 0:
                    stop = True
                    break
            continue
        if pending:
            _empty_cache(alloc, res, tt, act, addr, size, pending)
            pending = []
        if a == A_FREE:
            p = ptr_of.pop(addr[i], None)
            if p is None:
                if addr[i] in alloc._blocks and alloc._blocks[addr[i]].allocated:
                    p = addr[i]
                else:
                    _diverge(res, i, tt, f"free_completed of {addr[i]:#x}: the model has no "
                             "allocation there")
                    i += 1
                    continue
            try:
                alloc.deallocate(p)
            except Exception as exc:  # noqa: BLE001 - recorded as a divergence
                _diverge(res, i, tt, f"free_completed of {addr[i]:#x}: {exc}")
            after_call()
        i += 1
    if pending and not stop and not resumable:
        _empty_cache(alloc, res, tt, act, addr, size, pending)
        pending = []
    if progress is not None:
        progress(n, n)
    res.calls = calls
    return i, pending, stop


def _diverge(res: ExactReplay, i: int, tt: TorchTrace, what: str) -> None:
    if res.first_divergence is not None:
        return
    res.first_divergence = i
    lo, hi = max(0, i - 20), min(len(tt), i + 21)
    lines = []
    for k in range(lo, hi):
        a = int(tt.action[k])
        mark = ">>" if k == i else "  "
        lines.append(f"{mark} {k:7d} {ACTION_NAMES[a] or '?':15s} {int(tt.addr[k]):#x} "
                     f"{int(tt.size[k])}")
    res.divergence = what + "\n" + "\n".join(lines)


def _model_events(alloc: CachingAllocator, res: ExactReplay) -> list[tuple[int, int, int]]:
    """The model's trace entries since the last read (``res._pos`` in its history)."""
    hist = alloc._history
    new = hist[res._pos:]
    res._pos = len(hist)
    return [(ACTIONS[e[0]], e[1], e[2]) for e in new]


def _call(alloc: CachingAllocator, oracle: _Oracle, res: ExactReplay, tt: TorchTrace,
          act: list, addr: list, size: list, stream: list, pending: list[int], lo: int,
          hi: int, ptr_of: dict, known_fraction: bool) -> bool:
    """One malloc: the release run before it (``pending``), its gets ``lo..hi-2`` and the
    alloc or oom at ``hi-1``; whether the model served it."""
    last = hi - 1
    is_oom = act[last] == A_OOM
    gets = [(act[k], addr[k], size[k]) for k in range(lo, last) if act[k] in _GETS]
    mid_releases = [k for k in range(lo, last) if act[k] in _RELEASES]
    releases = pending + mid_releases
    expected = [(act[k], addr[k], size[k]) for k in releases] + gets
    oracle.expected = deque(gets)
    oracle.returned = 0
    oracle.refuse_all = False
    oracle.refuse_bytes = -1
    oracle.free_hint = None
    nbytes = size[last]
    st = stream[last]
    # Releases before a call that asks no new memory, or that a cached block would serve
    # now (PyTorch would not have asked the device), were an explicit empty_cache() first,
    # whatever the fraction.
    explicit = bool(pending) and (not (gets or is_oom) or alloc.cached_block_for(nbytes, st))
    if explicit:
        _empty_cache(alloc, res, tt, act, addr, size, pending)
        releases = mid_releases
        expected = [(act[k], addr[k], size[k]) for k in releases] + gets
    if not known_fraction:
        # Releases before new memory: the allocator's answer to a refusal -- unless they are
        # exactly what empty_cache() releases now (a refusal under max_split_size_mb frees
        # oversize blocks first): then they were an explicit empty_cache() first.
        if pending and not explicit and _as_empty_cache(alloc, act, addr, size, pending):
            _empty_cache(alloc, res, tt, act, addr, size, pending)
            releases = mid_releases
            expected = [(act[k], addr[k], size[k]) for k in releases] + gets
        if is_oom:
            oracle.refuse_all = True
            oracle.free_hint = addr[last]
            res.pressure_calls += 1
        elif releases and gets:
            oracle.refuse_bytes = sum(size[k] for k in releases)
            res.pressure_calls += 1
    p = alloc.try_allocate(nbytes, True, st)
    return _after_malloc(alloc, oracle, res, tt, addr, size, lo, last, pending, expected, p,
                         ptr_of, is_oom)


def _after_malloc(alloc: CachingAllocator, oracle: _Oracle, res: ExactReplay, tt: TorchTrace,
                  addr: list, size: list, lo: int, last: int, pending: list[int],
                  expected: list, p: int, ptr_of: dict, is_oom: bool = False) -> bool:
    """:func:`_call` after the model's malloc (``p``): its segment events compared with the
    trace's (``expected``), its address with the entry's; whether it was served."""
    nbytes = size[last]
    oracle.refuse_all = False
    oracle.refuse_bytes = -1
    oracle.free_hint = None
    made = _model_events(alloc, res)
    made_seg = [e for e in made if e[0] in _SEGMENT_ACTIONS]
    for a, p_, s_ in made_seg:
        if a == A_MAP:
            oracle.mapped(p_, s_)
    matched = sum(1 for x, y in zip(made_seg, expected) if x == y)
    res.segment_events_matched += matched
    ok = matched == len(expected) == len(made_seg)
    if is_oom:
        if p:
            _diverge(res, last, tt, f"oom of {nbytes} bytes: the model served it at {p:#x}")
            alloc.deallocate(p)
            ok = False
        else:
            res.ooms_matched += 1
    else:
        if not p:
            res.unexpected_ooms += 1
            _diverge(res, last, tt, f"alloc of {nbytes} bytes: the model ran out of memory")
            return False
        ptr_of[addr[last]] = p
        if p == addr[last]:
            res.allocs_matched += 1
        else:
            ok = False
            _diverge(res, last, tt, f"alloc of {nbytes} bytes: the model chose {p:#x}, the "
                     f"trace {addr[last]:#x}")
    if not ok and res.first_divergence is None:
        _diverge(res, lo if not pending else pending[0], tt,
                 f"segment events of this call: trace {_fmt(expected)}, model {_fmt(made_seg)}")
    return bool(p)


def _as_empty_cache(alloc: CachingAllocator, act: list, addr: list, size: list,
                    run: list[int]) -> bool:
    """The release run equals what ``empty_cache()`` would release now, in order."""
    if alloc.config.max_split_size is None:
        return False   # without it a refusal releases exactly this too: same state either way
    mine = [(ACTIONS[a], p, s) for a, p, s in alloc.cached_releases()]
    return mine == [(act[k], addr[k], size[k]) for k in run]


def _fmt(events: list[tuple[int, int, int]]) -> str:
    return "[" + ", ".join(f"{ACTION_NAMES[a]} {p:#x} {s}" for a, p, s in events) + "]"


def _empty_cache(alloc: CachingAllocator, res: ExactReplay, tt: TorchTrace, act: list,
                 addr: list, size: list, pending: list[int]) -> None:
    if not pending:
        return
    _model_events(alloc, res)
    alloc.empty_cache()
    res.empty_cache_calls += 1
    made = [e for e in _model_events(alloc, res) if e[0] in _SEGMENT_ACTIONS]
    expected = [(act[k], addr[k], size[k]) for k in pending]
    matched = sum(1 for x, y in zip(made, expected) if x == y)
    res.segment_events_matched += matched
    if not (matched == len(expected) == len(made)):
        _diverge(res, pending[0], tt, f"release run read as empty_cache(): trace "
                 f"{_fmt(expected)}, model {_fmt(made)}")


# ---------------------------------------------------------------------------------- compare
def _compare_final(alloc: CachingAllocator, final: list[dict]) -> str:
    mine = alloc.segments()
    theirs = sorted(final, key=lambda s: s["address"])
    if len(mine) != len(theirs):
        a = {s["address"] for s in mine}
        b = {s["address"] for s in theirs}
        extra = sorted(a - b)[:3]
        missing = sorted(b - a)[:3]
        return (f"{len(mine)} segments in the model, {len(theirs)} in the snapshot (model "
                f"only: {[hex(x) for x in extra]}, snapshot only: {[hex(x) for x in missing]})")
    for m, t in zip(mine, theirs):
        if m["address"] != t["address"] or m["total_size"] != t["total_size"]:
            return (f"segment {t['address']:#x} ({t['total_size']} bytes) is "
                    f"{m['address']:#x} ({m['total_size']} bytes) in the model")
        mb = [(b["size"], b["state"]) for b in m["blocks"]]
        tb = [(b["size"], _state(b) if _state(b) != "active_pending_free"
               else "active_allocated") for b in t.get("blocks") or []]
        if mb != tb:
            for k, (x, y) in enumerate(zip(mb, tb)):
                if x != y:
                    return (f"segment {t['address']:#x}, block {k}: snapshot {y[0]} bytes "
                            f"{y[1]}, model {x[0]} bytes {x[1]}")
            return (f"segment {t['address']:#x}: {len(tb)} blocks in the snapshot, {len(mb)} "
                    "in the model")
    return ""


# ---------------------------------------------------------------------------------- rebuild
def _construct(alloc: CachingAllocator, oracle: _Oracle, tt: TorchTrace) -> dict | None:
    """Make the state the trace started from (:func:`start_state`) in ``alloc`` by calls,
    as the allocator would have made it; the counts, or None where the calls do not give
    exactly that layout (expandable segments, a block the allocator would have split, a
    size its rounding never gives...): the caller then builds it with :func:`_rebuild`.

    Each segment is asked for whole at its address and given back to the cache, then cut
    front to back by allocating each of its blocks and gaps at its exact size (no other
    free block exists meanwhile, so best fit takes its front); a block whose request is
    less than its size (a remainder too small to split) is then freed and asked for again
    by its request, which takes it whole; last, the gaps are freed. The layout made is
    compared with the one rebuilt, block by block (size, state, request). The peaks and
    the accumulated statistics are reset (they count the replay's calls); the model's
    snapshot shows a gap's size as the last request of that free block, and allocation
    ids count the calls made here."""
    state, counts = start_state(tt, alloc._conf)
    if any(seg.expandable for seg in state):
        return None
    gaps: list[int] = []
    asked: list[tuple[int, int, int]] = []
    for seg in state:
        oracle.expected = deque([(A_SEG_ALLOC, seg.address, seg.size)])
        probe = alloc.try_allocate(512 if seg.small else seg.size, True, seg.stream)
        if probe != seg.address or oracle.expected:
            return None
        alloc.deallocate(probe)
        for p0, sz, req in _tiling(seg):
            # a small segment's gap can be larger than a small request: asked in parts
            step = K_SMALL_SIZE if seg.small else sz
            at = p0
            while at < p0 + sz:
                part = min(step, p0 + sz - at)
                if alloc.try_allocate(part, True, seg.stream) != at:
                    return None
                if req < 0:
                    gaps.append(at)
                at += part
            if req >= 0 and req != sz:
                asked.append((p0, req, seg.stream))
    for p0, req, strm in asked:
        alloc.deallocate(p0)
        if alloc.try_allocate(req, True, strm) != p0:
            return None
    for p in gaps:
        alloc.deallocate(p)
    want = [[seg.address, seg.size, [(sz, req) for _, sz, req in _tiling(seg)]]
            for seg in state]
    got = [[m["address"], m["total_size"],
            [(b["size"], b["requested_size"] if b["state"] != "inactive" else -1)
             for b in m["blocks"]]] for m in alloc.segments()]
    if got != want:
        return None
    alloc.reset_peak_stats()
    alloc.reset_accumulated_stats()
    alloc._largest = max((sz for seg in state for _, sz, _ in seg.blocks), default=0)
    return counts


def _tiling(seg: StartSegment) -> list[tuple[int, int, int]]:
    """A starting segment's blocks and gaps in address order: (address, size, requested or
    -1 for a gap)."""
    out = []
    cursor, end = seg.address, seg.address + seg.size
    for b0, sz, req in seg.blocks:
        if b0 > cursor:
            out.append((cursor, b0 - cursor, -1))
        out.append((b0, sz, req))
        cursor = b0 + sz
    if cursor < end:
        out.append((cursor, end - cursor, -1))
    return out


def _rebuild(alloc: CachingAllocator, oracle: _Oracle, tt: TorchTrace) -> dict:
    """Put the state the trace started from (:func:`start_state`) into ``alloc``."""
    state, counts = start_state(tt, alloc._conf)
    conf = alloc._conf

    def chain(lo: int, hi: int, seg: StartSegment, pool: Any, es: Any) -> list[_Block]:
        out: list[_Block] = []
        cursor = lo
        for b0, sz, req in seg.blocks:
            if b0 > cursor:
                out.append(_Block(cursor, b0 - cursor, seg.stream, pool, es))
            blk = _Block(b0, sz, seg.stream, pool, es)
            blk.allocated = True
            blk.requested = req
            out.append(blk)
            cursor = b0 + sz
        if cursor < hi:
            out.append(_Block(cursor, hi - cursor, seg.stream, pool, es))
        return out

    def link(blocks: list[_Block]) -> None:
        prev = None
        for b in blocks:
            b.prev = prev
            if prev is not None:
                prev.next = b
            prev = b
        for b in blocks:
            _install(alloc, b)

    total = alloc.device_total
    reservations: dict[int, tuple[Any, list[_Block]]] = {}
    for seg in state:
        pool = alloc._small if seg.small else alloc._large
        if not seg.expandable:
            alloc._segments[seg.address] = seg.size
            oracle._take(seg.address, seg.size)
            _inc(alloc._stats.pool["segment"], pool.index, 1)
            mss = conf.max_split_size
            if mss is not None and seg.size >= mss:
                _inc1(alloc._stats.oversize_segments, 1)
            link(chain(seg.address, seg.address + seg.size, seg, pool, None))
            continue
        held = reservations.get(seg.base)
        if held is None:
            page = (2 << 20) if seg.small else (20 << 20)
            es = _ExpandableSegment(seg.base, page, (total + total // 8 + page - 1) // page,
                                    seg.stream, pool)
            alloc._expandable.append(es)
            oracle.reserved.append((es.base, es.base))
            oracle.extents.append((es.base, es.size))
            held = reservations[seg.base] = (es, [])
        es, pieces = held
        cursor = pieces[-1].ptr + pieces[-1].size if pieces else es.base
        if seg.address > cursor:
            pieces.append(_Block(cursor, seg.address - cursor, seg.stream, pool, es,
                                 mapped=False))
        hi = seg.address + seg.size
        last = (hi - es.base) // es.page
        es.handles.extend([None] * (last - len(es.handles)))
        for p in range((seg.address - es.base) // es.page, last):
            es.handles[p] = 1
        oracle.used += seg.size
        oracle.mapped(seg.address, seg.size)
        pieces.extend(chain(seg.address, hi, seg, pool, es))
    for es, pieces in reservations.values():
        end = pieces[-1].ptr + pieces[-1].size
        if end < es.base + es.size:
            pieces.append(_Block(end, es.base + es.size - end, es.stream, es.pool, es,
                                 mapped=False))
        link(pieces)
    # what existed before the trace is the baseline of the peaks
    alloc.reset_peak_stats()
    return counts


def _install(alloc: CachingAllocator, b: _Block) -> None:
    """Register a rebuilt block: address table, pool or unmapped list, statistics."""
    alloc._blocks[b.ptr] = b
    pool = b.pool
    st = alloc._stats.pool
    t = pool.index
    if b.mapped:
        alloc._reserved += b.size
        _inc(st["reserved_bytes"], t, b.size)
    if b.allocated:
        b.aid = alloc._next_aid
        alloc._next_aid += 1
        alloc._largest = max(alloc._largest, b.size)
        _inc(st["allocation"], t, 1)
        _inc(st["allocated_bytes"], t, b.size)
        _inc(st["requested_bytes"], t, b.requested)
        mss = alloc._conf.max_split_size
        if mss is not None and b.size >= mss:
            _inc1(alloc._stats.oversize_allocations, 1)
    elif b.mapped:
        insort(pool.keys, _key(b))
        if b.es is None and (b.prev is not None or b.next is not None):
            _inc(st["inactive_split"], t, 1)
            _inc(st["inactive_split_bytes"], t, b.size)
    else:
        insort(pool.unmapped, (b.stream << 64) | b.ptr)
