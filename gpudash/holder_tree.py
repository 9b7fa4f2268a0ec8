"""Who holds the memory, as a tree: the live blocks' stacks merged into a flame graph.

:func:`holder_tree` groups blocks (sizes, stack ids into a
:class:`~gpudash.formats.stacks.StackTable`, optional labels) into the tree the dashboard's
holders view and the report's icicle draw: under the root, the block's label when blocks have
labels (``Session.label``, a ``%%gpudash_track`` cell: ``"(no label)"`` for the others), then
the frames of the user's own code, outermost first, then what the innermost one called into
(``"(in libraries) functional.py:1701 relu"``, :func:`gpudash.trace.callers.below_user_code`).
A stack without a user frame is one node named by what it has
(``"(outside user code) module.py:12 f"``, ``"(autograd) MmBackward0"``, ``"(no Python
frame)"``); a block without a stack is ``"(no stack recorded)"``. Which frames are the user's
is :func:`gpudash.trace.callers.user_code_rule`'s (the rule ``top_holders`` uses), and the
blocks of one stack id always land in one leaf, so a leaf's bytes are the bytes of the
``top_holders(by="stack")`` rows whose stacks lead to it.

Widths are bytes. At most ``max_nodes`` nodes are kept, the largest: a smaller node's bytes
stay in its parent (drawn as the part of the parent its children do not cover), so what a
view sends and draws is bounded whatever the stacks. Nodes come laid out: each one's offset
from the root's left edge (:attr:`HolderTree.x0`), children left to right by bytes.

:func:`trace_holder_tree` does the same for the allocations live at a moment of a trace
(:func:`gpudash.trace.holders.resolve_moment`), labels from the trace's holder strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._units import format_bytes
from .trace.callers import (
    NO_STACK,
    below_user_code,
    call_sites,
    frame_text,
    short_paths,
    user_code_rule,
)
from .formats.stacks import StackTable
from .models import trace_model
from .trace.holders import allocations, resolve_moment

__all__ = [
    "KIND_BELOW",
    "KIND_LABEL",
    "KIND_OTHER",
    "KIND_ROOT",
    "KIND_USER",
    "MAX_NODES",
    "NO_LABEL",
    "HolderTree",
    "holder_tree",
    "stack_paths",
    "trace_holder_tree",
]

#: The label level's name for blocks without a label, when other blocks have one.
NO_LABEL = "(no label)"
#: Nodes a tree keeps by default (the largest; the rest stay in their parents).
MAX_NODES = 200
#: What a node is (:attr:`HolderTree.kind`): the root, a label, a frame of the user's code,
#: the library or C++ code below the user's innermost frame, a stack with no user frame (or
#: no stack).
KIND_ROOT, KIND_LABEL, KIND_USER, KIND_BELOW, KIND_OTHER = range(5)
#: The longest name or text a node keeps (a C++ frame's name can run to thousands).
MAX_TEXT = 300


@dataclass
class HolderTree:
    """A tree of who holds the memory: node 0 is the root, every other node's parent comes
    before it.

    Attributes
    ----------
    name : list of str
        What each node is called (``train.py:42 forward``; a label; the root's ``root``).
    text : list of str
        Each node in full, for a hover: the frame with its whole path, the label.
    kind : numpy.ndarray of int8
        :data:`KIND_ROOT`, :data:`KIND_LABEL`, :data:`KIND_USER`, :data:`KIND_BELOW` or
        :data:`KIND_OTHER`.
    depth, parent : numpy.ndarray of int32
        The level (0 for the root) and the parent's index (-1 for the root).
    value, blocks : numpy.ndarray of int64
        Bytes and blocks under each node (its own and its descendants', those not kept
        included).
    x0 : numpy.ndarray of int64
        Each node's offset in bytes from the root's left edge.
    total_bytes, total_blocks : int
        Of every block.
    nodes : int
        Nodes before the bound (:attr:`left_out` of them not kept).
    left_out : int
    rule : str
        Which frames counted as the user's (in words).
    notes : list of str
        What was missing or assumed.
    """

    name: list
    text: list
    kind: np.ndarray
    depth: np.ndarray
    parent: np.ndarray
    value: np.ndarray
    blocks: np.ndarray
    x0: np.ndarray
    total_bytes: int = 0
    total_blocks: int = 0
    nodes: int = 1
    left_out: int = 0
    rule: str = ""
    notes: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.name)

    def path(self, i: int) -> tuple[str, ...]:
        """The names from the root's child down to node ``i`` (() for the root)."""
        out = []
        while i > 0:
            out.append(self.name[i])
            i = int(self.parent[i])
        return tuple(reversed(out))

    def leaves(self) -> dict[tuple[str, ...], int]:
        """``{path: bytes}`` of the nodes without kept children."""
        has_child = np.zeros(len(self), dtype=bool)
        has_child[self.parent[1:]] = True
        return {self.path(i): int(self.value[i]) for i in range(1, len(self))
                if not has_child[i]}

    def __repr__(self) -> str:
        return (f"HolderTree({len(self)} nodes of {self.nodes}, "
                f"{format_bytes(self.total_bytes)} in {self.total_blocks} blocks)")


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def stack_paths(stacks: StackTable, stack_ids: Any, user_code: Any = None
                ) -> tuple[list[tuple[tuple[str, str, int], ...]], str]:
    """The path of each stack id (-1: none recorded) in the tree, and the user-code rule in
    words: a tuple of steps ``(name, text, kind)``, outermost first (see the module
    docstring). File names are shortened as :func:`gpudash.trace.callers.short_paths` does,
    over the files of these stacks."""
    rule = user_code_rule(user_code)
    sids = [int(s) for s in np.asarray(stack_ids).tolist()]
    sites = call_sites(stacks, rule)
    frames = stacks.frames
    files = sorted({frames[f].filename for s in sids if s >= 0 for f in stacks.stacks[s].frames})
    short = short_paths(files)
    out = []
    for s in sids:
        if s < 0:
            out.append(((NO_STACK, NO_STACK, KIND_OTHER),))
            continue
        fr = stacks.frames_of(s)
        ids = stacks.stacks[s].frames
        user = [i for i in range(len(fr)) if sites.is_user[ids[i]]]
        if not user:
            fb = int(sites.fallback_frame[s])
            name = sites.fallback[s] + (f" {frame_text(frames[fb], short)}" if fb >= 0 else "")
            text = sites.fallback[s] + (f" {frames[fb]}" if fb >= 0 else "")
            out.append(((_clip(name), _clip(text), KIND_OTHER),))
            continue
        path = [(_clip(frame_text(fr[i], short)), _clip(str(fr[i])), KIND_USER)
                for i in reversed(user)]
        below = below_user_code(fr, rule, short)
        if below:
            path.append((_clip(below), _clip(below_user_code(fr, rule)), KIND_BELOW))
        out.append(tuple(path))
    return out, f"user code: {rule.description}"


def holder_tree(size: Any, stack: Any, stacks: StackTable | None, *, label: Any = None,
                labels: Any = (), user_code: Any = None, max_nodes: int = MAX_NODES,
                root: str | None = None, chunk: str = "block",
                path_cache: dict | None = None) -> HolderTree:
    """The blocks as a tree of who holds them (see the module docstring).

    Parameters
    ----------
    size : array-like of int
        Each block's bytes.
    stack : array-like of int
        Each block's stack id in ``stacks`` (-1: none recorded).
    stacks : StackTable or None
        None: no block has a stack.
    label, labels : array-like of int, sequence of str
        Each block's label as an index into ``labels`` (-1: none). When any block has one,
        labels are the first level under the root.
    user_code : optional
        Which frames are the user's (:func:`gpudash.trace.callers.user_code_rule`).
    max_nodes : int
        Nodes kept besides the root, the largest (ties: the shallower first).
    root : str, optional
        The root's name (default: the bytes and blocks in all).
    chunk : str
        What one block is called in the framework's words (``"block"``, ``"chunk"``).
    path_cache : dict, optional
        Keeps the paths of the stacks between calls over one growing stack table (a live
        view's): they are found again only when the table or the set of stacks changed.
    """
    size = np.asarray(size, dtype=np.int64).reshape(-1)
    stack = np.asarray(stack, dtype=np.int64).reshape(-1)
    if len(stack) != len(size):
        raise ValueError(f"holder_tree: {len(size)} sizes but {len(stack)} stack ids")
    if label is None:
        label = np.full(len(size), -1, dtype=np.int64)
    label = np.asarray(label, dtype=np.int64).reshape(-1)
    if len(label) != len(size):
        raise ValueError(f"holder_tree: {len(size)} sizes but {len(label)} labels")
    labels = list(labels)
    if stacks is None:
        stacks = StackTable()
        stack = np.full(len(size), -1, dtype=np.int64)
    with_labels = bool((label >= 0).any())
    # one group per distinct (label, stack): its bytes and blocks
    width = len(stacks) + 1
    key = (label + 1) * width + (stack + 1)
    uniq, inv = np.unique(key, return_inverse=True)
    g_bytes = np.bincount(inv, weights=size.astype(np.float64), minlength=len(uniq)) \
        if len(size) else np.zeros(0)
    g_blocks = np.bincount(inv, minlength=len(uniq)) if len(size) else np.zeros(0, np.int64)
    g_label = uniq // width - 1
    g_stack = uniq % width - 1
    sids = np.unique(g_stack)
    ckey = (len(stacks), sids.tobytes(), user_code)
    # one entry, read and replaced whole (two threads may share a cache)
    entry = path_cache.get("paths") if path_cache is not None else None
    if entry is not None and entry[0] == ckey:
        _, path_of, rule = entry
    else:
        paths, rule = stack_paths(stacks, sids, user_code)
        path_of = dict(zip(sids.tolist(), paths))
        if path_cache is not None:
            path_cache["paths"] = (ckey, path_of, rule)
    total = int(size.sum())
    value: dict[tuple, list] = {}
    step_of: dict[tuple, tuple[str, str, int]] = {}
    for lab, sid, b, n in zip(g_label.tolist(), g_stack.tolist(), g_bytes.tolist(),
                              g_blocks.tolist()):
        steps = path_of[sid]
        if with_labels:
            name = labels[lab] if lab >= 0 else NO_LABEL
            steps = ((_clip(name), _clip(name), KIND_LABEL),) + steps
        names = tuple(s[0] for s in steps)
        for k in range(1, len(names) + 1):
            p = names[:k]
            rec = value.get(p)
            if rec is None:
                value[p] = [b, n]
                step_of[p] = steps[k - 1]
            else:
                rec[0] += b
                rec[1] += n
    n_all = len(value)
    nodes = sorted(value, key=lambda k: (-value[k][0], len(k)))[:max(0, int(max_nodes))]
    kept = set(nodes)
    nodes = [k for k in nodes if all(k[:j] in kept for j in range(1, len(k)))]
    kept = set(nodes)
    # children left to right by bytes (then name), depth first: each parent before its
    # children, each node's offset its parent's plus its elder siblings' bytes
    children: dict[tuple, list] = {}
    for k in nodes:
        children.setdefault(k[:-1], []).append(k)
    for v in children.values():
        v.sort(key=lambda k: (-value[k][0], k[-1]))
    order: list[tuple] = [()]
    idx = {(): 0}
    x0 = [0.0]
    stack_: list[tuple[tuple, float]] = [((), 0.0)]
    parent = [-1]
    while stack_:
        p, at = stack_.pop()
        kids = children.get(p, [])
        offs = []
        for k in kids:
            offs.append(at)
            at += value[k][0]
        for k, off in zip(kids, offs):
            idx[k] = len(order)
            order.append(k)
            x0.append(off)
            parent.append(idx[p])
        for k, off in reversed(list(zip(kids, offs))):
            stack_.append((k, off))
    n_blocks = len(size)
    names = [root if root is not None else
             f"{format_bytes(total)} in {n_blocks:,} {chunk}(s)"]
    texts = [names[0]]
    kinds = [KIND_ROOT]
    for k in order[1:]:
        name, text, kind = step_of[k]
        names.append(name)
        texts.append(text)
        kinds.append(kind)
    vals = [float(total)] + [value[k][0] for k in order[1:]]
    blks = [n_blocks] + [value[k][1] for k in order[1:]]
    notes = []
    if len(size) and (stack < 0).any():
        none = stack < 0
        notes.append(f"{int(none.sum()):,} {chunk}(s) ({format_bytes(int(size[none].sum()))}) "
                     "have no recorded stack")
    if n_all > len(order) - 1:
        notes.append(f"{n_all - (len(order) - 1):,} smaller node(s) not drawn: their bytes "
                     "are in their parents")
    return HolderTree(
        name=names, text=texts, kind=np.array(kinds, dtype=np.int8),
        depth=np.array([len(k) for k in order], dtype=np.int32),
        parent=np.array(parent, dtype=np.int32),
        value=np.rint(np.array(vals, dtype=np.float64)).astype(np.int64),
        blocks=np.array(blks, dtype=np.int64),
        x0=np.rint(np.array(x0, dtype=np.float64)).astype(np.int64),
        total_bytes=total, total_blocks=n_blocks, nodes=n_all + 1,
        left_out=n_all - (len(order) - 1), rule=rule, notes=notes)


def trace_holder_tree(trace: Any, at: Any = "peak", *, device: Any = None, user_code: Any = None,
                      max_nodes: int = MAX_NODES, labels: bool = True) -> HolderTree:
    """:func:`holder_tree` of the allocations live at a moment of a trace (``at`` as
    :func:`gpudash.trace.top_holders` takes it), their holder strings as labels (a gpudash
    session's labels; with ``labels=False``, none)."""
    allocs = allocations(trace, device)
    moment = resolve_moment(trace, at, device, allocs)
    live = allocs.live_after(moment.event)
    label = trace.holder[allocs.row[live]].astype(np.int64) if labels else None
    total = int(allocs.size[live].sum())
    return holder_tree(allocs.size[live], allocs.stack[live], trace.stacks, label=label,
                       labels=trace.holders, user_code=user_code, max_nodes=max_nodes,
                       root=f"{format_bytes(total)} at {moment.text}",
                       chunk=trace_model(trace).chunk)
