"""Out-of-memory post-mortems: why did an allocation fail, and what limit would have served it?

:func:`explain` reads an allocator dump (a log with TensorFlow's, JAX's or XLA's dump, or the
``MemoryDump`` protobuf of ``TF_BFC_MEMORY_DUMP``; :mod:`gpudash.formats.tf_dump`) and answers
on one screen:

- the request that failed (bytes, rounded to 256, the op that asked);
- bytes in use, the pool (regions held) and the limit;
- free bytes in the pool and the largest free chunk;
- the cause, in plain words:

  * **limit reached**: the free bytes of the pool plus the room left below the limit are
    less than the request: even if every free byte were one chunk, it would not fit;
  * **fragmentation**: there are enough free bytes, but no free chunk is large enough and
    the limit leaves no room for a region large enough;

- the smallest memory limit that would have served the request from this state: the BFC
  serves a request that no free chunk fits by adding a region of at least the rounded
  request, which it may do while ``limit - pool >= rounded``; so the answer is
  ``pool + rounded``. It keeps the pool as the dump shows it: a job restarted with that
  limit lays its chunks out anew, and a replay of the dump from an empty allocator
  (``gpudash whatif``) may need more;
- that limit in the setting of the framework that printed the dump, given the device's
  size: TensorFlow's ``per_process_gpu_memory_fraction`` (the limit is ``total x
  fraction``), JAX's ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (the same in single precision) for
  a dump printed by jaxlib's XLA; a host-memory allocator (TensorFlow's
  ``bfc_cpu_allocator_for_gpu``, ``gpu_host_bfc``) takes no fraction: its limit is an
  environment variable in MiB (``TF_CPU_BFC_MEM_LIMIT_IN_MB``, ``TF_GPU_HOST_MEM_LIMIT_IN_MB``);
- who holds the memory, largest first, when the dump names holders (MEM_DEBUG builds' "by
  op", the protobuf's ``op_name``), and the op that made the failing request.

``gpudash explain PATH [--device SIZE] [--framework NAME] [--html OUT]`` prints the same; in
a notebook the returned :class:`Explanation` displays the summary, the chunk map and the
bins.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any

from ._errors import ConfigError, TraceFormatError
from ._explanation import _ExplanationViews
from ._units import format_bytes, parse_bytes
from .formats.format import round_up_256
from .formats.tf_dump import _body, _OOM, _request, read_dumps
from .models import model_of_dump
from .options import jax_memory_limit
from .report import bins_figure, chunkmap_figure
from .torch_explain import explain_torch, is_torch_file

__all__ = ["explain", "Explanation", "smallest_limit", "smallest_fraction"]

#: Byte figures are ``int64_t`` in the allocator: a dump's figure of 2**63 or more is damaged.
_MAX_BYTES = 1 << 63
_MIB = 1 << 20

#: Source paths that say which build printed a log line. jaxlib builds XLA as
#: ``external/xla`` (``external/org_tensorflow`` before 2023); TensorFlow prints
#: ``tensorflow/...``, or ``external/local_xla``/``external/local_tsl`` since 2.16.
_JAX_PATHS = ("external/xla/", "external/org_tensorflow/")
_TF_PATHS = ("tensorflow/", "external/local_xla/", "external/local_tsl/")
#: Words elsewhere in a log that name the framework (a dump line may carry no path).
_JAX_WORDS = ("jaxlib", "XlaRuntimeError", "pjrt_stream_executor_client", "xla_extension")
_TF_WORDS = ("Created TensorFlow device", "Created device /job:", "ResourceExhaustedError",
             "tensorflow.python")

#: The setting that gives a GPU allocator its limit, by framework.
FRACTION_SETTINGS = {"tensorflow": "per_process_gpu_memory_fraction",
                     "jax": "XLA_PYTHON_CLIENT_MEM_FRACTION"}
#: TensorFlow's host-memory BFC allocators and the variable (MiB, default 64 GiB) that limits
#: each: ``TF_CPU_ALLOCATOR_USE_BFC=true`` makes the CPU allocator one; pinned host memory
#: for GPU copies is always one.
HOST_LIMIT_VARIABLES = {"bfc_cpu_allocator_for_gpu": "TF_CPU_BFC_MEM_LIMIT_IN_MB",
                        "gpu_host_bfc": "TF_GPU_HOST_MEM_LIMIT_IN_MB",
                        "cuda_host_bfc": "TF_CUDA_HOST_MEM_LIMIT_IN_MB"}   # before TF 1.14
_HOST_LIMIT_DEFAULT_MB = 1 << 16
_NOT_A_FAILURE = "The caller indicates that this is not a failure"


def _b(n: int) -> str:
    """``45.89 MiB (48,120,832 B)``."""
    return f"{format_bytes(n)} ({n:,} B)" if n >= 1024 else f"{n:,} B"


def smallest_fraction(needed: int, total: int, framework: str = "tensorflow") -> float | None:
    """The smallest fraction with 4 decimals whose limit on a ``total``-byte device reaches
    ``needed`` bytes, computed the framework's way; None when ``needed > total``.

    TensorFlow's limit is ``int(total * fraction)``; JAX's takes the fraction in single
    precision first (:func:`gpudash.options.jax_memory_limit`). The first candidate is
    ``ceil(needed * 10000 / total) / 10000``, exact in integers; the float product may fall
    a byte short of it, and the next step (``total / 10000`` bytes more) never does.

    Examples
    --------
    >>> smallest_fraction(53_477_376, 16 << 30)
    0.0032
    >>> smallest_fraction(17 << 30, 16 << 30) is None
    True
    """
    if total <= 0 or needed > total:
        return None
    limit = jax_memory_limit if framework == "jax" else (lambda t, f: int(t * f))
    first = max(1, -(-needed * 10_000 // total))
    for k in range(first, min(first + 2, 10_000) + 1):
        if limit(total, k / 10_000) >= needed:
            return k / 10_000
    return None  # pragma: no cover - k = 10000 is the whole device, which is >= needed


def smallest_limit(pool_bytes: int, rounded_request: int, largest_free: int = 0) -> int:
    """The smallest allocator limit at which BFC would have served a request from a state.

    A free chunk of at least ``rounded_request`` bytes serves it at any limit (the current
    one suffices: ``pool_bytes`` is returned); otherwise a new region of at least the
    rounded request is needed, which ``Extend`` adds only while ``limit - pool >= rounded``.
    """
    if largest_free >= rounded_request:
        return pool_bytes
    return pool_bytes + rounded_request


@dataclass
class Explanation(_ExplanationViews):
    """One out-of-memory error explained (see the module docstring).

    Attributes
    ----------
    dump : MemoryDump
        The allocator's state at the failure, as read.
    request : int or None
        Bytes asked for (None when the dump does not say).
    rounded : int or None
        The request rounded up to 256 bytes.
    op : str
        The op that asked ("" when unknown).
    in_use, pool, limit, free, largest_free : int
        Bytes: in use, held in regions, the allocator's limit (0 when unknown), free in the
        pool, and the largest free chunk.
    headroom : int
        ``limit - pool`` rounded down to 256: the room for a new region.
    cause : str
        ``"limit reached"``, ``"fragmentation"``, ``"no failure"`` (a free chunk or the
        headroom would have served it: the allocator was waiting on deferred frees, or the
        dump is from another moment), or ``"unknown"`` (no request or no limit).
    smallest_limit : int or None
        See :func:`smallest_limit`.
    device_bytes : int or None
        The device size given, for :attr:`fraction`.
    fraction : float or None
        The smallest value of :attr:`setting` giving :attr:`smallest_limit` on that device
        (rounded up to 4 decimals, :func:`smallest_fraction`); None without a device, for a
        host-memory allocator, or when the limit exceeds the device (no fraction of it
        serves the request).
    framework : str
        Who printed the dump: ``"tensorflow"`` or ``"jax"`` (JAX or another XLA client).
    setting : str or None
        What sets this allocator's limit: ``per_process_gpu_memory_fraction`` (TensorFlow),
        ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (JAX), or for TensorFlow's host-memory
        allocators ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` / ``TF_GPU_HOST_MEM_LIMIT_IN_MB``; None for
        another host-memory allocator.
    host : bool
        A host-memory (CPU) allocator: no GPU memory fraction applies to it.
    limit_mib : int or None
        For a host allocator limited by a MiB variable: the smallest value serving the
        request (``ceil(smallest_limit / MiB)``).
    holders : list of (str, int, int)
        ``(holder, bytes, chunks)`` of the chunks in use, largest first, when named.
    warnings : list of str
        What the dump lacked or contradicted.
    """

    dump: Any
    path: str
    request: int | None
    rounded: int | None
    op: str
    in_use: int
    pool: int
    limit: int
    free: int
    largest_free: int
    headroom: int
    cause: str
    smallest_limit: int | None
    device_bytes: int | None = None
    fraction: float | None = None
    framework: str = "tensorflow"
    setting: str | None = "per_process_gpu_memory_fraction"
    host: bool = False
    limit_mib: int | None = None
    holders: list[tuple[str, int, int]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    index: int = 0
    count: int = 1

    # ------------------------------------------------------------------ text
    def lines(self) -> list[tuple[str, str]]:
        """The summary as (label, text) rows."""
        d = self.dump
        n_use = d.extra.get("in_use_chunks", sum(c.in_use for c in d.chunks))
        free_chunks = [c for c in d.chunks if not c.in_use]
        rows = []
        if self.request is not None:
            req = _b(self.rounded or self.request)
            if self.request != self.rounded and self.request is not None:
                req = f"{_b(self.request)}, rounded to {self.rounded:,} B"
            rows.append(("request", req + (f", by op {self.op}" if self.op else "")))
        else:
            rows.append(("request", "not in the dump (pass --request SIZE)"))
        rows.append(("in use", f"{_b(self.in_use)} in {n_use:,} chunk(s)"))
        limit = _b(self.limit) if self.limit else "unknown (pass --limit SIZE)"
        rows.append(("pool / limit", f"{_b(self.pool)} in {len(d.regions)} region(s) / "
                     f"{limit}"))
        rows.append(("free in pool", f"{_b(self.free)} in {len(free_chunks):,} chunk(s); "
                     f"largest {_b(self.largest_free)}"))
        if self.limit:
            rows.append(("room below limit", _b(self.headroom)))
        rows.append(("cause", self.cause_text()))
        if self.smallest_limit is not None:
            rows.append(("smallest limit that serves it",
                         _b(self.smallest_limit) + self.setting_text()))
        if self.holders:
            top = ", ".join(f"{h} {format_bytes(b)}" + (f" ({n})" if n > 1 else "")
                            for h, b, n in self.holders[:8])
            rows.append(("held by", top))
        return rows

    def setting_text(self) -> str:
        """The smallest limit in the allocator's own setting (empty when none applies)."""
        if self.host:
            if self.setting is None:
                return (" (a host-memory allocator: no GPU memory fraction applies; whatever "
                        "created it set its limit)")
            return (f" = {self.setting}={self.limit_mib} (a host-memory allocator: this "
                    f"variable, default {_HOST_LIMIT_DEFAULT_MB} MiB, limits it, not a GPU "
                    "memory fraction; set it before TensorFlow starts)")
        if self.device_bytes is None or self.smallest_limit is None:
            return ""
        device = format_bytes(self.device_bytes)
        if self.fraction is None:
            return f": more than the {device} device, no fraction of this device serves it"
        value = f"{self.fraction:.4f}"
        if self.framework == "jax":
            return f" = {self.setting}={value} of a {device} device"
        return f" = {self.setting} {value} of a {device} device"

    def cause_text(self) -> str:
        """The cause in plain words, with the numbers behind it."""
        if self.cause == "limit reached":
            return (f"limit reached: {format_bytes(self.free)} free in the pool and "
                    f"{format_bytes(self.headroom)} below the limit, "
                    f"{format_bytes(self.free + self.headroom)} in all, is less than the "
                    f"{format_bytes(self.rounded or 0)} asked for")
        if self.cause == "fragmentation":
            return (f"fragmentation: {format_bytes(self.free + self.headroom)} free (in the "
                    f"pool and below the limit) is enough for "
                    f"{format_bytes(self.rounded or 0)}, but the largest free chunk is "
                    f"{format_bytes(self.largest_free)} and the limit leaves "
                    f"{format_bytes(self.headroom)} for a new region")
        if self.cause == "no failure":
            return ("no failure from this state: a free chunk or the room below the limit "
                    "fits the request (frees not yet applied when it failed?)")
        return ("unknown: " + ("the dump names no request" if self.request is None else
                               "the limit is not known"))

    def __str__(self) -> str:
        d = self.dump
        where = f", line {d.extra['line']}" if d.extra.get("line") else ""
        which = f" (dump {self.index + 1} of {self.count})" if self.count > 1 else ""
        head = (f"{self.path}{where}: out of memory in "
                f"{d.allocator_name or 'an unnamed allocator'}{which}")
        width = max(len(k) for k, _ in self.lines())
        body = [f"  {k:<{width}}  {v}" for k, v in self.lines()]
        tail = [f"  warning: {w}" for w in self.warnings]
        if self.smallest_limit is not None and self.smallest_limit > self.pool \
                and self.dump.chunks:
            tail.append("  note: that limit keeps the pool as the dump shows it and adds one "
                        "region of the rounded request; a job restarted with it lays its "
                        "chunks out anew, and a replay of the dump from an empty allocator "
                        "(gpudash whatif) may need more")
        checks = d.extra.get("checks") or []
        if checks:
            ok = sum(1 for c in checks if c["agrees"])
            tail.append(f"  checks: {ok} of {len(checks)} figures the dump prints agree with "
                        "its chunk lines")
        return "\n".join([head, *body, *tail])

    # ------------------------------------------------------------------ views
    def figures(self) -> list:
        """The chunk map and the bins (plotly figures)."""
        frag = model_of_dump(self.dump).fragmentation(self.in_use, self.pool, self.largest_free)
        title = (f"Chunk map of {self.dump.allocator_name or 'the allocator'} at the failure "
                 f"({format_bytes(self.in_use)} in use; {frag.label} {frag.text})")
        return [chunkmap_figure(self.dump, title=title), bins_figure(self.dump)]

def explain(path: str | os.PathLike, *, device: int | str | None = None,
            index: int | None = None, allocator: str | None = None,
            request: int | str | None = None, limit: int | str | None = None,
            framework: str | None = None, conf: str | None = None,
            torch_version: str | None = None) -> Any:
    """Explain an out-of-memory error from its allocator dump, or PyTorch's.

    PyTorch's files (its out-of-memory message, pasted or in a log, or a memory snapshot
    with an ``oom`` entry), or ``framework="torch"``, are explained by
    :func:`gpudash.torch_explain.explain_torch` in PyTorch's terms, and return a
    :class:`~gpudash.torch_explain.TorchExplanation` (``allocator`` then names the GPU,
    ``cuda:1``; ``conf`` and ``torch_version`` are the job's ``PYTORCH_CUDA_ALLOC_CONF`` and
    PyTorch; ``request`` and ``limit`` do not apply).

    Parameters
    ----------
    path : str or os.PathLike
        A log with an allocator dump, or a ``TF_BFC_MEMORY_DUMP`` protobuf; or PyTorch's
        message or snapshot.
    device : int or str, optional
        The device's size (``"16GiB"``), for the fraction matching the smallest limit.
    index : int, optional
        Which dump of the log (0-based; negative from the end). Default: the last dump that
        names a failed request (else the last dump).
    allocator : str, optional
        Only dumps of this allocator (``GPU_1_bfc``).
    request, limit : int or str, optional
        What the dump does not record (a MemoryDump protobuf has neither): the bytes asked
        for and the allocator's limit.
    framework : {"tensorflow", "jax"}, optional
        Who printed the dump, for the setting the answer is given in. Default: read from the
        log (jaxlib's ``external/xla/`` source paths, ``XlaRuntimeError``... mean JAX;
        anything else, and a protobuf, TensorFlow).

    Returns
    -------
    Explanation
        Printable (``str``), displayable in a notebook, :meth:`Explanation.write_html`.

    Raises
    ------
    TraceFormatError
        No dump in the file (one line naming the file and what was expected; a log whose
        only "ran out of memory" lines are TensorFlow's non-fatal warnings says so), no dump
        of that allocator or index, or a figure of 2**63 bytes or more.
    """
    if framework is not None and framework not in (*FRACTION_SETTINGS, "torch"):
        raise ConfigError(f"framework must be one of {', '.join(FRACTION_SETTINGS)}, torch; "
                          f"got {framework!r}")

    if framework == "torch" or (framework is None and is_torch_file(path)):
        for name, value in (("request", request), ("limit", limit)):
            if value is not None:
                raise ConfigError(f"{name} is for a TensorFlow or JAX dump that does not say "
                                  f"it; PyTorch's message and snapshot do")
        gpu = None
        if allocator is not None:
            name = str(allocator)
            digits = name.rsplit(":", 1)[-1]
            if not digits.isdigit():
                raise ConfigError(f"a PyTorch GPU is named cuda:N; got {allocator!r}")
            gpu = int(digits)
        return explain_torch(path, index=index, device=device, gpu=gpu, conf=conf,
                             torch_version=torch_version)
    for name, value in (("conf", conf), ("torch_version", torch_version)):
        if value is not None:
            raise ConfigError(f"{name} is PyTorch's; {path} is not a PyTorch file (pass "
                              "framework='torch' to read it as one)")
    try:
        dumps = read_dumps(path)
    except TraceFormatError:
        declined = _declined_warnings(path)
        if not declined:
            raise
        sizes = sorted(size for _, size in declined)
        names = ", ".join(sorted({name for name, _ in declined}))
        raise TraceFormatError(
            f"{path}: the log holds no out-of-memory error: its {len(declined)} 'ran out of "
            f"memory' line(s) ({names}, {format_bytes(sizes[0])} to "
            f"{format_bytes(sizes[-1])}) are non-fatal warnings ('... {_NOT_A_FAILURE}'): "
            "the caller went on without that memory, and the allocator prints its dump only "
            "at a real failure") from None
    chosen = list(range(len(dumps)))
    if allocator is not None:
        chosen = [i for i in chosen if dumps[i].allocator_name == allocator]
        if not chosen:
            names = sorted({d.allocator_name for d in dumps if d.allocator_name})
            raise TraceFormatError(f"{path}: no dump of allocator {allocator!r}; its dumps "
                                   f"are of {', '.join(names) or 'unnamed allocators'}")
    if index is not None:
        try:
            pick = chosen[index]
        except IndexError:
            raise TraceFormatError(f"{path}: no dump {index}: it has {len(chosen)} "
                                   f"dump(s){' of ' + allocator if allocator else ''}") from None
    else:
        failed = [i for i in chosen if dumps[i].extra.get("request")]
        with_state = [i for i in failed if dumps[i].chunks or dumps[i].stats.bytes_in_use]
        pick = (with_state or failed or chosen)[-1]
    dump = dumps[pick]
    warnings = list(dump.extra.get("warnings", []))
    req = dump.extra.get("request") or {}
    nbytes: int | None = req.get("bytes")
    rounded: int | None = req.get("rounded")
    if request is not None:
        nbytes = parse_bytes(request, name="request")
        rounded = round_up_256(nbytes)
        warnings = [w for w in warnings if "request" not in w]
    lim = dump.memory_limit
    if limit is not None:
        lim = parse_bytes(limit, name="limit")
        warnings = [w for w in warnings if "limit" not in w]
    st = dump.stats
    in_use, pool = st.bytes_in_use, st.pool_bytes
    where = f"{path}, line {dump.extra['line']}" if dump.extra.get("line") else f"{path}"
    for what, value in (("the request", nbytes), ("the request rounded to 256 bytes", rounded),
                        ("bytes in use", in_use), ("the pool", pool), ("the limit", lim)):
        if value is not None and value >= _MAX_BYTES:
            raise TraceFormatError(f"{where}: {what} is {value:,} bytes, 2**63 or more: no "
                                   "allocator holds or is asked for that much (a damaged or "
                                   "edited dump?)")
    free = max(pool - in_use, 0)
    largest = st.largest_free_block_bytes
    headroom = max(lim - pool, 0) // 256 * 256 if lim else 0
    if rounded is None or not lim:
        cause = "unknown"
    elif largest >= rounded or headroom >= rounded:
        cause = "no failure"
    elif free + headroom < rounded:
        cause = "limit reached"
    else:
        cause = "fragmentation"
    smallest = smallest_limit(pool, rounded, largest) if rounded is not None else None
    dev_bytes = parse_bytes(device, name="device") if device is not None else None
    if framework is None:
        framework = _framework_of(path, dump)
    name = dump.allocator_name or ""
    host = name in HOST_LIMIT_VARIABLES or "cpu" in name.lower() or "host" in name.lower()
    setting = HOST_LIMIT_VARIABLES.get(name) if host else FRACTION_SETTINGS[framework]
    fraction = limit_mib = None
    if smallest is not None:
        if host and setting is not None:
            limit_mib = max(1, -(-smallest // _MIB))
        elif not host and dev_bytes:
            fraction = smallest_fraction(smallest, dev_bytes, framework)
    holders: dict[str, list[int]] = {}
    for c in dump.chunks:
        if c.in_use and getattr(c, "holder", ""):
            h = holders.setdefault(c.holder, [0, 0])
            h[0] += c.size
            h[1] += 1
    ranked = sorted(((k, v[0], v[1]) for k, v in holders.items()), key=lambda t: -t[1])
    return Explanation(dump=dump, path=os.fspath(path), request=nbytes, rounded=rounded,
                       op=req.get("op", ""), in_use=in_use, pool=pool, limit=lim, free=free,
                       largest_free=largest, headroom=headroom, cause=cause,
                       smallest_limit=smallest, device_bytes=dev_bytes, fraction=fraction,
                       framework=framework, setting=setting, host=host, limit_mib=limit_mib,
                       holders=ranked, warnings=warnings, index=pick, count=len(dumps))


def _text_lines(path: str | os.PathLike):
    """The lines of a text file, or none for a binary or unreadable one, or anything but a
    regular file (a FIFO would block)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return
        with open(path, "rb") as f:
            if b"\x00" in f.read(4096):
                return
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from f
    except OSError:
        return


def _declined_warnings(path: str | os.PathLike) -> list[tuple[str, int]]:
    """``(allocator, bytes)`` of each "ran out of memory ... The caller indicates that this
    is not a failure" warning in a log (TensorFlow's, for an allocation that may fail)."""
    out = []
    for line in _text_lines(path):
        if _NOT_A_FAILURE in line:
            m = _OOM.search(_body(line))
            if m is not None:
                try:
                    size = _request(m, str(path))["bytes"]
                except TraceFormatError:
                    size = 0
                out.append((m.group("name"), size))
    return out


def _framework_of(path: str | os.PathLike, dump: Any) -> str:
    """``"jax"`` when jaxlib's XLA printed the dump, else ``"tensorflow"``: the source path on
    the dump's own line decides; without one, words elsewhere in the log (a JAX program may
    also log TensorFlow's lines, so only a log without TensorFlow's is JAX's)."""
    if dump.extra.get("source") != "tensorflow-log":
        return "tensorflow"               # a MemoryDump protobuf: TF_BFC_MEMORY_DUMP
    at = dump.extra.get("line") or 0
    jax = tf = False
    for n, line in enumerate(_text_lines(path), 1):
        head = line[:512]
        is_jax = any(p in head for p in _JAX_PATHS)
        is_tf = not is_jax and any(p in head for p in _TF_PATHS)
        if n == at and (is_jax or is_tf):
            return "jax" if is_jax else "tensorflow"
        jax = jax or is_jax or any(w in line for w in _JAX_WORDS)
        tf = tf or is_tf or any(w in line for w in _TF_WORDS)
    return "jax" if jax and not tf else "tensorflow"
