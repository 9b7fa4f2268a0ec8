"""What a trace cannot tell: the warnings that replay and what-if answers carry.

A trace imported from an out-of-memory log is often less than the job: the allocator's dump
may be elided or cut off, JAX prints no dump at all, and a log of TensorFlow's non-fatal
"ran out of memory" warnings holds no allocation. ``gpudash explain`` warns about each; a
replay of such a trace starts with less memory in use than the job had, so its "fits" and
what-if's smallest fraction are lower bounds. :func:`trace_warnings` says so, in the words
``explain`` uses (the importers keep them in ``trace.meta``: ``incomplete_states``,
``declined_allocations``; see :func:`gpudash.trace.load_tf_log`), and
:class:`~gpudash.trace.replay.ReplayResult`, :class:`~gpudash.trace.whatif.MinFractionResult`
and :class:`~gpudash.trace.whatif.SweepTable` carry them as ``warnings``.
"""

from __future__ import annotations

import numpy as np

from .._units import format_bytes
from ..events import EventKind
from ..formats.format import Trace, device_entries

__all__ = ["trace_warnings", "no_events_text", "from_dump_note"]

_NOT_A_FAILURE = "The caller indicates that this is not a failure"
_CONSEQUENCE = ("a fit here does not mean the job fits, and what-if's smallest fraction is a "
                "lower bound")


def _name(trace: Trace, device: int) -> str:
    d = device_entries(trace.meta).get(device)
    return str(d["name"]) if d is not None and d.get("name") else ""


def _records(meta: dict, key: str) -> list[dict]:
    """``meta[key]``'s dict entries (a hand-edited or damaged list is read as far as it
    holds dicts)."""
    value = meta.get(key)
    return [r for r in value if isinstance(r, dict)] if isinstance(value, list) else []


def no_events_text(trace: Trace, device: int) -> str:
    """``"the trace has no events for this device (...)"``, and why when the log says:
    its "ran out of memory" lines were non-fatal warnings."""
    name = _name(trace, device)
    text = f"the trace has no events for this device (device {device}" \
        + (f", {name})" if name else ")")
    declined = [d for d in _records(trace.meta, "declined_allocations")
                if not name or d.get("allocator") == name]
    if declined:
        text += (f": its {len(declined)} 'ran out of memory' line(s) are non-fatal warnings "
                 f"('... {_NOT_A_FAILURE}'), and it holds no out-of-memory error")
    return text


def trace_warnings(trace: Trace, device: int) -> list[str]:
    """What a replay of ``device`` cannot know about the job that made the trace.

    Parameters
    ----------
    trace : Trace
    device : int

    Returns
    -------
    list of str
        Empty for a complete trace. Otherwise one line each: the trace has no events for
        the device; or its out-of-memory error came with an incomplete dump, or none (the
        dump's own warnings, the bytes in use it states and the bytes the trace rebuilds).
    """
    cols = trace.columns
    on = np.asarray(cols["device"]) == device
    if not on.any():
        return [no_events_text(trace, device)]
    name = _name(trace, device)
    out = []
    recorded = _records(trace.meta, "incomplete_states")
    for rec in recorded:
        if rec.get("allocator") != name:
            continue
        what = "; ".join(rec.get("warnings") or []) or "its dump is incomplete"
        if rec.get("in_use") is None and not rec.get("rebuilt"):
            held = "the memory in use when it failed is unknown, so a replay starts from an " \
                   "empty allocator"
        elif rec.get("in_use") is None:
            held = (f"the memory in use when it failed is unknown beyond the "
                    f"{format_bytes(rec['rebuilt'])} the dump lists, so a replay may start "
                    "with less than the job held")
        else:
            held = (f"the trace rebuilds {format_bytes(rec.get('rebuilt') or 0)} of the "
                    f"{format_bytes(rec['in_use'])} in use when it failed, so a replay starts "
                    "with less than the job held")
        out.append(f"{name}'s out-of-memory error (line {rec.get('line')}): {what}; {held}: "
                   f"{_CONSEQUENCE}")
    if "incomplete_states" not in trace.meta and trace.meta.get("source") == "tensorflow-log":
        # a log read before incomplete_states was kept: no allocation before the first OOM
        kind = np.asarray(cols["kind"])[on]
        ooms = np.flatnonzero(kind == int(EventKind.OOM))
        made = np.flatnonzero(np.isin(kind, (int(EventKind.ALLOC), int(EventKind.EXTEND))))
        if len(ooms) and (not len(made) or made[0] > ooms[0]):
            out.append(f"{name or f'device {device}'} has no allocation in the trace before its "
                       "out-of-memory error: the memory in use when it failed is unknown, so "
                       f"a replay starts from an empty allocator: {_CONSEQUENCE}")
    if trace.meta.get("source") == "pytorch-snapshot":
        # a snapshot dumped in the job's out-of-memory handler: the job ended there
        kind = np.asarray(cols["kind"])[on]
        ooms = np.flatnonzero(kind == int(EventKind.OOM))
        if len(ooms) and not np.any(kind[ooms[-1] + 1:] == int(EventKind.ALLOC)):
            out.append(f"{name or f'cuda:{device}'}'s trace ends at its out-of-memory error "
                       "(no allocation after it): the job's calls after the failure are not "
                       f"in it, so {_CONSEQUENCE}")
    return out


def from_dump_note(trace: Trace, device: int) -> str | None:
    """For a device whose state comes from its dump (complete): why what-if's smallest
    limit is not ``gpudash explain``'s. None for other devices."""
    name = _name(trace, device)
    if not name or name not in (trace.meta.get("dump_states") or []):
        return None
    return (f"{name}'s state is its dump's, rebuilt as allocations in address order; what-if "
            "replays it from an empty allocator at each limit, where the BFC lays the chunks "
            "out anew (a free chunk is split only for a request of at most half its size, or "
            "leaving 128 MiB), so it may need more than 'gpudash explain', whose smallest "
            "limit keeps the dump's layout and adds one region of the request")
