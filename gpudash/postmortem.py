"""Out-of-memory post-mortems: why did an allocation fail, and what limit would have served it?

:func:`explain` reads an allocator dump (a log with TensorFlow's, JAX's or XLA's dump, or the
``MemoryDump`` protobuf of ``TF_BFC_MEMORY_DUMP``; :mod:`gpudash.trace.tf_dump`) and answers
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
  ``pool + rounded``, and with a device size, the matching
  ``per_process_gpu_memory_fraction`` (TensorFlow's limit is ``total x fraction``);
- who holds the memory, largest first, when the dump names holders (MEM_DEBUG builds' "by
  op", the protobuf's ``op_name``), and the op that made the failing request.

``gpudash explain PATH [--device SIZE] [--html OUT]`` prints the same; in a notebook the
returned :class:`Explanation` displays the summary, the chunk map and the bins.
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._errors import GpudashError, TraceFormatError
from ._units import format_bytes, parse_bytes

__all__ = ["explain", "Explanation", "smallest_limit"]


def _b(n: int) -> str:
    """``45.89 MiB (48,120,832 B)``."""
    return f"{format_bytes(n)} ({n:,} B)" if n >= 1024 else f"{n:,} B"


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
class Explanation:
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
        The smallest ``per_process_gpu_memory_fraction`` giving :attr:`smallest_limit` on
        that device (rounded up to 4 decimals).
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
        rows.append(("free in pool", f"{_b(self.free)} in {len(free_chunks)} chunk(s); "
                     f"largest {_b(self.largest_free)}"))
        if self.limit:
            rows.append(("room below limit", _b(self.headroom)))
        rows.append(("cause", self.cause_text()))
        if self.smallest_limit is not None:
            text = _b(self.smallest_limit)
            if self.fraction is not None:
                text += (f" = per_process_gpu_memory_fraction {self.fraction:.4f} of a "
                         f"{format_bytes(self.device_bytes)} device")
            rows.append(("smallest limit that serves it", text))
        if self.holders:
            top = ", ".join(f"{h} {format_bytes(b)}" + (f" ({n})" if n > 1 else "")
                            for h, b, n in self.holders[:8])
            rows.append(("held by", top))
        return rows

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
        checks = d.extra.get("checks") or []
        if checks:
            ok = sum(1 for c in checks if c["agrees"])
            tail.append(f"  checks: {ok} of {len(checks)} figures the dump prints agree with "
                        "its chunk lines")
        return "\n".join([head, *body, *tail])

    # ------------------------------------------------------------------ views
    def figures(self) -> list:
        """The chunk map and the bins (plotly figures)."""
        from .report import bins_figure, chunkmap_figure

        title = (f"Chunk map of {self.dump.allocator_name or 'the allocator'} at the failure "
                 f"({format_bytes(self.in_use)} in use)")
        return [chunkmap_figure(self.dump, title=title), bins_figure(self.dump)]

    def _summary_html(self) -> str:
        rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                       for k, v in self.lines())
        warn = "".join(f"<li>{html.escape(w)}</li>" for w in self.warnings)
        head = html.escape(str(self).splitlines()[0])
        return (f'<div class="gpudash-explain"><p><b>{head}</b></p>'
                f'<table id="explain-summary">{rows}</table>'
                + (f"<ul class=\"warnings\">{warn}</ul>" if warn else "") + "</div>")

    def to_html(self, *, full: bool = True) -> str:
        """The explanation as HTML with its figures (plotly inline: opens offline)."""
        parts = [self._summary_html()]
        for i, fig in enumerate(self.figures()):
            parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0),
                                     config={"displaylogo": False}))
        body = "\n".join(parts)
        if not full:
            return body
        title = html.escape(f"gpudash explain: {Path(self.path).name}")
        return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{title}</title><style>body {{ font-family: system-ui, sans-serif; "
                f"margin: 24px; }} table {{ border-collapse: collapse; }} th, td {{ border: "
                f"1px solid #ccc; padding: 4px 10px; text-align: left; }}</style></head>"
                f"<body><h1>{title}</h1>{body}</body></html>\n")

    def write_html(self, path: str | os.PathLike, overwrite: bool = False) -> Path:
        """Write :meth:`to_html` to ``path`` (refuses to replace a file unless asked)."""
        out = Path(path)
        if out.exists() and not overwrite:
            raise GpudashError(f"{out} exists; pass overwrite=True to replace it")
        out.write_text(self.to_html(), encoding="utf-8")
        return out

    def _ipython_display_(self) -> None:  # pragma: no cover - exercised through IPython
        from IPython.display import HTML, display

        display(HTML(self._summary_html()))
        for fig in self.figures():
            display(fig)

    def _repr_html_(self) -> str:
        return self._summary_html()


def explain(path: str | os.PathLike, *, device: int | str | None = None,
            index: int | None = None, allocator: str | None = None,
            request: int | str | None = None, limit: int | str | None = None) -> Explanation:
    """Explain an out-of-memory error from its allocator dump.

    Parameters
    ----------
    path : str or os.PathLike
        A log with an allocator dump, or a ``TF_BFC_MEMORY_DUMP`` protobuf.
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

    Returns
    -------
    Explanation
        Printable (``str``), displayable in a notebook, :meth:`Explanation.write_html`.

    Raises
    ------
    TraceFormatError
        No dump in the file (one line naming the file and what was expected), or no dump of
        that allocator or index.
    """
    from .trace.format import round_up_256
    from .trace.tf_dump import read_dumps

    dumps = read_dumps(path)
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
    fraction = None
    if smallest is not None and dev_bytes:
        fraction = math.ceil(smallest / dev_bytes * 10_000) / 10_000
        while int(dev_bytes * fraction) < smallest:   # float rounding: one more step
            fraction += 0.0001
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
                       holders=ranked, warnings=warnings, index=pick, count=len(dumps))
