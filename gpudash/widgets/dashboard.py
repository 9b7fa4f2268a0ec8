"""The dashboard: every live view of a session, with its controls, in one widget.

One `anywidget <https://anywidget.dev>`_ (one comm, one small ES module,
``static/dashboard.js``) draws, in the browser:

    headline (in use / pool / limit / peak / the model's fragmentation figure, a banner while
    the pool is over a limit lowered live) and controls (device, the model's controls, pause,
    refresh rate)
    timeline      | heatmap          (one time base: seconds since the model started)
    chunk map     | bins
    holders (the width of both)

The holders view is a flame graph of who holds the blocks in use
(:func:`gpudash.holder_tree.holder_tree`, the grouping of ``top_holders(by="stack")``):
labels at the top when blocks have them (``Session.label``, a ``%%gpudash_track`` cell),
then the frames of the user's code, outermost first, then the library code they called
into; widths in bytes, the hover a node's bytes, blocks and its frame in full. It shows the
latest state; a click on the timeline shows the state at that moment instead (the
:class:`~gpudash.live.LiveModel` keeps a bounded history of the blocks in use and who
held them: :meth:`~gpudash.live.LiveModel.held_blocks`), and its "live" button goes
back. It is shown by default on a session that records stacks (``record_stacks=True``);
``views=`` adds it to any other (:data:`EXTRA_VIEWS`).

What differs between allocators comes from the device's allocator model
(:mod:`gpudash.models`), sent with the controls: its controls (TensorFlow's BFC: fraction,
growth, deferred deletion, release, flush; PyTorch's caching allocator: fraction,
``expandable_segments``, ``max_split_size_mb``, ``garbage_collection_threshold``, empty
cache), its words (in use / allocated, pool / reserved, chunk map / segment map), its bins or
pools, each region's kind (PyTorch: small or large pool, expandable), its fragmentation
figure (TensorFlow's ``1 - largest free / free``; PyTorch's reserved but unallocated, in bytes
and % of reserved) and its own figures in the headline. The page draws whatever the model
lists; no view tests which allocator it has.

The segment / chunk map draws its regions as rows of one width (a region much larger than
the rest continues on the next rows), named by their region, in a plot of at most 520 pixels
that opens on the first rows (16 pixels each) and pans to the others; plotly thins the row
labels by the space per row, and hovering a block says its row, address, sizes and who holds
it (the session's label or the allocating line).

What crosses the wire
---------------------
- **plotly.js once per page.** The module asks the kernel for plotly.js (the cartesian
  partial bundle, gzip-compressed, ~0.5 MB) only when the page does not have it yet, and keeps
  it on ``window``; a second dashboard, a re-run of ``%gpudash`` or a re-render send nothing
  again. A reloaded page fetches it once. An answer that never comes (a page reloaded while
  its widgets were restored can lose one) is asked for again after 8 s, 16 s, 32 s...
- **Binary buffers.** Timeline points, heatmap columns (``uint8``) and chunk arrays go as
  numpy buffers; JSON carries only small figures. Every region goes (its address, size and
  kind; the row width of the segment / chunk map comes from
  :func:`gpudash.maplayout.row_layout`), and who holds each chunk goes as an ``int32`` id
  into a table of strings the page keeps: a label or a stack is sent once, not once per
  chunk.
- **Increments.** After the first snapshot, a refresh sends the timeline points and heatmap
  columns that are new, and the chunk table only when it changed (at most once a second
  when it is large). The model's refresher coalesces events, so a busy allocator still
  sends at most ``rate_hz`` updates a second.
- **The holders' tree** as arrays (each node's offset and bytes, parent, blocks, level,
  kind, and the ids of its name and full text in the same string table), at most
  ``holder_nodes`` nodes (the largest; the rest in their parents), sent when it changed
  (at most ``rate_hz`` times a second) and, for a moment picked on the timeline, once.
- **Snapshots on (re)connect.** Each rendered view says hello; the kernel answers with the
  whole history, so a reloaded page or a re-displayed dashboard shows what happened before.

The browser redraws on animation frames, at most once per frame, whatever arrives.

Controls act through the live layer's one path, :meth:`gpudash.live.LiveModel.act`, at once
(the source's ``configure``, ``release_free_regions``, ``flush_deferred``, ``empty_cache``),
and answer in the model's words ("released 0 B: no region is wholly free"; "expandable_segments: on: segments
made from now on are expandable..."). A value is checked before anything is set, by the
model's checks (a device the source does not have, growth ``"false"``, a fraction of ``true``,
``max_split_size_mb`` below 20):
the answer, shown in the status line, names the setting and the value, nothing changes, and
the dashboard goes on. Sources that cannot be controlled (a framework watched read-only)
get disabled controls whose tooltip says why, and a button that prints the settings to
restart with.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import numbers
import threading
import time
import weakref
from importlib import resources
from typing import Any

import anywidget
import numpy as np
import traitlets

from .. import style
from .._comm_routing import follow_the_page
from .._errors import ConfigError, GpudashError
from .._units import format_bytes
from ..holder_tree import MAX_NODES, holder_tree
from ..maplayout import row_layout
from ..live.model import LiveModel, bin_labels
from ..monitors._base import Monitor

__all__ = ["Dashboard", "VIEWS", "EXTRA_VIEWS", "plotly_bundle"]

#: The views ``Dashboard(views=...)`` shows by default, in layout order.
VIEWS = ("stats", "timeline", "heatmap", "chunkmap", "bins")
#: Views ``views=`` also accepts: ``holders`` (who holds the memory, a flame graph), shown
#: by default on a session that records stacks.
EXTRA_VIEWS = ("holders",)

#: A chunk table larger than this is sent at most once a second.
LARGE_TABLE = 2000
#: Holder strings a page keeps; past this the table starts afresh with those in use.
MAX_STRINGS = 4096

_STATIC = resources.files("gpudash.widgets") / "static"
_BUNDLE_CACHE: dict[str, Any] = {}


def plotly_bundle() -> tuple[str, bytes]:
    """``(version, gzip bytes)`` of the plotly.js bundle the dashboard sends once per page."""
    if "gz" not in _BUNDLE_CACHE:
        data = (_STATIC / "plotly-cartesian.min.js.gz").read_bytes()
        _BUNDLE_CACHE["gz"] = data
        _BUNDLE_CACHE["version"] = hashlib.sha256(data).hexdigest()[:16]
    return _BUNDLE_CACHE["version"], _BUNDLE_CACHE["gz"]


def lib_message(raw: bool = False) -> tuple[dict, list]:
    """``(content, buffers)`` of the message that hands plotly.js to a page that asked for
    it: the gzip bundle, or (``raw``, for a browser without ``DecompressionStream``) the
    script itself."""
    version, data = plotly_bundle()
    if raw:
        return ({"type": "lib", "version": version, "encoding": "none"},
                [memoryview(gzip.decompress(data))])
    return {"type": "lib", "version": version, "encoding": "gzip"}, [memoryview(data)]


def esm(name: str) -> str:
    """The front-end module ``static/<name>``, after the page-wide plotly.js loader that
    every gpudash module shares (``static/loader.js``)."""
    return "\n".join((_STATIC / f).read_text(encoding="utf-8") for f in ("loader.js", name))


def _esm() -> str:
    return esm("dashboard.js")


def _f64(a: Any) -> memoryview:
    return memoryview(np.ascontiguousarray(a, dtype=np.float64).tobytes())


def _layout_key(table: dict) -> bytes:
    """A digest of a chunk table's layout: the table is sent again only when it changes
    (a refresh without events, or with events that cancel out, sends none)."""
    h = hashlib.blake2b(digest_size=16)
    for k in ("ptr", "size", "requested", "in_use"):
        h.update(np.ascontiguousarray(table[k]).data)
    holders = table.get("holder")
    if holders is not None:
        h.update("\0".join(map(str, holders)).encode())
    return h.digest()


class Dashboard(anywidget.AnyWidget):
    """Live views and controls of a session, an allocator or feeds, in one widget.

    Parameters
    ----------
    source : Session, BFCAllocator, CachingAllocator or Monitor, optional
        What to show and control (a PyTorch session: ``Session(..., allocator="torch")``); a
        framework monitor (``gpudash.watch(...)``) is shown through its :attr:`feeds`, as
        its ``dashboard()`` does.
    feeds : list of DeviceFeed, optional
        Instead of a source: one feed per device (a framework monitor's, a Dask worker's).
    rate_hz : float
        Model refreshes a second (adjustable in the controls).
    views : sequence of str, optional
        Which of :data:`VIEWS` and :data:`EXTRA_VIEWS` to show (controls are always shown).
        Default: :data:`VIEWS`, and ``holders`` too on a session with ``record_stacks``.
    device : int
        The device shown first.
    holder_nodes : int
        Nodes the holders view draws at most (the largest; a smaller one's bytes stay in
        its parent).
    model : LiveModel, optional
        Show an existing model (its history included) instead of making one; the dashboard
        then leaves the model open when it closes.
    **model_options
        ``history``, ``heatmap_rows``, ``heatmap_columns`` for a new :class:`LiveModel`.

    Attributes
    ----------
    model : LiveModel
    device : int
        The device shown (set it, or pick it in the controls).
    views : tuple of str
        The views shown.
    sent : dict
        Messages and bytes sent so far, by kind (``lib``, ``snapshot``, ``update``, ``reply``).

    Examples
    --------
    >>> import gpudash
    >>> from gpudash.widgets import Dashboard
    >>> sess = gpudash.Session(simulate="2x16GiB")
    >>> dash = Dashboard(sess)   # in a notebook, end the cell with ``dash`` to show it
    >>> dash.model.num_devices
    2
    >>> dash.close(); sess.close()
    """

    _esm = traitlets.Unicode(_esm()).tag(sync=True)
    device = traitlets.Int(0).tag(sync=True)
    views = traitlets.Tuple().tag(sync=True)
    setup = traitlets.Dict().tag(sync=True)
    lib_version = traitlets.Unicode("").tag(sync=True)

    def __init__(self, source: Any = None, *, feeds: Any = None, rate_hz: float = 4.0,
                 views: Any = None, device: int = 0, model: LiveModel | None = None,
                 holder_nodes: int = MAX_NODES, **model_options: Any) -> None:
        names = tuple(views) if views is not None else None
        unknown = [n for n in names or () if n not in VIEWS + EXTRA_VIEWS]
        if unknown:
            raise ConfigError(f"unknown view(s) {unknown}; choose from "
                              f"{list(VIEWS + EXTRA_VIEWS)}")
        if isinstance(holder_nodes, bool) or not isinstance(holder_nodes, int) or \
                not 1 <= holder_nodes <= 10_000:
            raise ConfigError(f"holder_nodes must be an integer from 1 to 10,000; got "
                              f"{holder_nodes!r}")
        if isinstance(source, Monitor):
            if feeds is not None:
                raise TypeError("Dashboard takes a source or feeds=[...], not both")
            source, feeds = None, list(source.feeds)
        if model is not None:
            self._owns_model = False
            self.model = model
        else:
            self._owns_model = True
            self.model = LiveModel(source, feeds=feeds, rate_hz=rate_hz, **model_options)
        try:
            self._check_device(device)
        except ConfigError:
            if self._owns_model:
                self.model.close()
            raise
        self._send_lock = threading.RLock()
        self._cursor: dict = {}
        self._chunks_sent_ms = 0.0
        self._chunks_version: bytes | None = None
        self._controls_sent: dict | None = None
        self._strings: dict[str, int] = {}  # holder strings the page has, by id
        self._driver_cache: dict[int, tuple[float, dict]] = {}
        self.sent: dict[str, list[int]] = {}
        self._hellos = 0
        if names is None:
            stacks = getattr(self.model.session, "stacks", None)
            names = VIEWS + (("holders",) if stacks is not None else ())
        # the holders view: the tree shown (live, or at a moment picked on the timeline),
        # the one the page has, and the paths of the session's stacks (kept between trees)
        self.holder_nodes = holder_nodes
        self._tree: tuple | None = None        # (key, tree, meta) of the latest live tree
        self._moment: tuple | None = None      # (device, tree, meta) of a moment picked
        self._tree_sent: Any = None            # the tree the page has
        self._path_cache: dict = {}
        version, _ = plotly_bundle()
        super().__init__(device=device, views=names, lib_version=version,
                         setup=self._setup())
        ref = weakref.ref(self)

        def tick(now_ms: float, changed: set) -> None:
            dash = ref()
            if dash is not None:
                dash._on_tick(changed)

        self._remove_tick = self.model.add_tick_listener(tick)
        self.on_msg(self._on_msg)
        # it sends from the refresher thread: see _comm_routing (a reloaded page's messages were
        # routed to a subshell the page had deleted)
        follow_the_page(self)
        self.observe(self._on_device, "device")

    def _check_device(self, device: Any) -> int:
        """``device`` if it is an index of the model's devices, else a ConfigError."""
        n = self.model.num_devices
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < n:
            raise ConfigError(f"device must be an index in 0..{n - 1} (the source has {n} "
                              f"device(s)); got {device!r}")
        return device

    @traitlets.validate("device")
    def _validate_device(self, proposal: Any) -> int:
        # checked before it is set: a device the model does not have would break every
        # later snapshot, reply and update
        try:
            return self._check_device(proposal["value"])
        except ConfigError as exc:
            raise traitlets.TraitError(str(exc)) from None

    # ------------------------------------------------------------------ what is drawn
    def _setup(self) -> dict:
        m = self.model
        return {
            "devices": m.device_names,
            "colors": dict(style.COLORS),
            "fills": dict(style.FILLS),
            "heatmap_scale": style.HEATMAP_SCALE,
            "bin_labels": bin_labels(),
            "time_title": style.TIME_TITLE + " since " + m.start_label,
            "rate_hz": m.rate_hz,
        }

    def _controls_info(self, device: int) -> dict:
        m = self.model
        settings = m.device_settings(device)
        disabled = m.controls_disabled(device)
        feed = m.feed(device)
        return {
            "driver": self._driver_info(device),
            "settings": {k: (v if not isinstance(v, float) or np.isfinite(v) else None)
                         for k, v in settings.items()},
            "disabled": disabled,
            # the source says what a setting would do before it is applied (shadow mode):
            # a slider previews while dragged and applies when released
            "preview": m.can_preview(device),
            # controls of the model this source cannot apply, each with its reason
            "unavailable": m.unavailable_controls(device),
            # deferred deletion to flush and tune: a session here, or a controllable feed
            # (a Dask worker's session)
            "session": m.session is not None or (feed is not None and not disabled),
            "has_layout": m.has_layout(device),
            "model": self._model_info(device),
            "restart": feed is not None and hasattr(feed, "restart_lines"),
            "paused": bool(m.paused),
            "rate_hz": m.rate_hz,
        }

    def _model_info(self, device: int) -> dict:
        """What the page draws differently for the device's allocator model: its controls,
        its words, its bins or pools (:mod:`gpudash.models`)."""
        model = self.model.model(device)
        return {"name": model.name, "words": model.words(), "bin_labels": model.bin_labels(),
                "controls": [c.as_dict() for c in model.controls]}

    def _driver_info(self, device: int) -> dict | None:
        """Who else is on the GPU, for a watched framework: NVML's processes on the device
        (this one marked) and the framework's pool against what the driver counts for this
        process; or why NVML cannot say. Read at most every 2 s (None for other sources)."""
        feed = self.model.feed(device)
        monitor = getattr(feed, "_monitor", None)
        if monitor is None or not hasattr(monitor, "driver_view"):
            return None
        now = time.monotonic()
        cached = self._driver_cache.get(device)
        if cached is not None and now - cached[0] < 2.0:
            return cached[1]
        try:
            view = monitor.driver_view()
        except Exception as exc:  # noqa: BLE001 - shown in words, never fatal
            info: dict = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
        else:
            info = {"available": bool(view.get("available")), "reason": view.get("reason", "")}
            row = next((d for d in view.get("devices", []) if d.get("feed") == feed.name), None)
            if row is not None:
                def num(v: Any) -> int | None:
                    return int(v) if isinstance(v, (int, np.integer)) else None

                info.update(pool=num(row.get("pool")), driver=num(row.get("driver")),
                            outside=num(row.get("outside_pool")), processes=[
                                {"pid": int(p.pid), "name": str(p.name), "used": num(p.used),
                                 "self": bool(p.is_self),
                                 "framework": str(getattr(p, "framework", "") or "")}
                                for p in row.get("processes", [])[:12]])
        self._driver_cache[device] = (now, info)
        return info

    def _headline(self, state: Any) -> dict:
        s = state.stats
        pending, held = self.model.pending_release(state.device)
        model = state.model
        return {
            "name": state.name, "in_use": int(s.bytes_in_use), "pool": int(s.pool_bytes),
            "limit": int(s.bytes_limit), "peak": int(s.peak_bytes_in_use),
            "largest_free": int(s.largest_free_block_bytes),
            "fragmentation": float(s.fragmentation), "capacity": int(state.capacity),
            # the model's own fragmentation figure (TensorFlow's external fragmentation;
            # PyTorch's reserved but unallocated)
            "frag": model.fragmentation(int(s.bytes_in_use), int(s.pool_bytes),
                                        int(s.largest_free_block_bytes)).as_dict(),
            "chunks": int(state.num_chunks), "internal": int(state.internal_fragmentation),
            "counters": dict(state.counters),
            "pending_release": int(pending), "regions_holding": int(held),
            "banner": model.limit_banner(int(s.pool_bytes), int(s.bytes_limit), int(pending),
                                         int(held)),
            # the model's own figures (PyTorch's segments, retries, OOMs by its names)
            "extra": model.headline(state),
            "ooms": [[(o.time_ms - self.model.start_ms) / 1e3, o.rounded, o.in_use]
                     for o in state.ooms[-50:]],
            # stats the source does not report (a framework's totals): shown as unknown
            "missing": sorted(getattr(self.model.feed(state.device), "missing", ()) or ()),
            # why a watched framework's figures are not current (a call that has not
            # returned, a failed poll): shown in the status line
            "error": getattr(self.model.feed(state.device), "error", None),
            # how current the source's figures are (shadow mode: when PyTorch's history
            # was read, a model rebuilt after its ring wrapped): shown beside them
            "note": self.model.note(state.device),
        }

    def _chunk_buffers(self, state: Any) -> tuple[dict, list]:
        """The chunk table as the page draws it: ``[cols, bins, holder ids, regions,
        kinds]``.

        ``cols`` (float64, 6 x n): region index, offset in the region, size, requested, in
        use, address of each chunk. ``bins`` (float64, 5 x bins). ``holder ids`` (int32, n;
        empty when no chunk has a holder): who holds each chunk, an index into the page's
        string table (-1: nobody named); the strings the page has not had come in
        ``meta["strings"]`` (``base``: the index of the first; 0 starts the table afresh).
        ``regions`` (float64, 2 x regions): address and size of each region; the page lays
        them out in rows of ``meta["row_bytes"]`` (chosen by
        :func:`gpudash.maplayout.row_layout`: a region takes ``ceil(size / row_bytes)``
        rows, those of one row first, then the others, each in address order;
        ``meta["n_rows"]`` in all). ``kinds`` (int8, regions): each
        region's kind, an index into ``meta["kind_names"]`` (-1: none;
        ``meta["region_kinds"]`` keeps the first 64 as words, as before)."""
        t = state.table
        regions = t["regions"]
        n = len(t["size"])
        if n:
            ri = np.searchsorted(regions[:, 0], t["region"])
            offset = t["ptr"] - t["region"]
        else:
            ri = np.zeros(0, dtype=np.int64)
            offset = ri
        kinds = state.model.region_kinds(t)
        layout = row_layout(regions[:, 1])
        ids, strings = self._holder_ids(t.get("holder"), n)
        # each region's kind as a code into kind_names (a few words, not one per region)
        names = sorted(set(kinds)) if kinds is not None else []
        code = {k: i for i, k in enumerate(names)}
        meta = {"n": n, "n_regions": int(len(regions)),
                "region_kinds": None if kinds is None else kinds[:64],
                "kind_names": names,
                "row_bytes": int(layout.row_bytes), "n_rows": int(layout.total_rows),
                "strings": strings}
        cols = np.empty((6, n), dtype=np.float64)
        cols[0] = ri
        cols[1] = offset
        cols[2] = t["size"]
        cols[3] = t["requested"]
        cols[4] = t["in_use"]
        cols[5] = t["ptr"]
        bins = state.bins
        binarr = np.vstack([np.asarray(getattr(bins, k), dtype=np.float64) for k in
                            ("free_bytes", "in_use_bytes", "free_chunks", "in_use_chunks",
                             "requested_bytes")])
        meta["n_bins"] = int(binarr.shape[1])
        regarr = np.empty((2, len(regions)), dtype=np.float64)
        regarr[0] = regions[:, 0]
        regarr[1] = regions[:, 1]
        kind_codes = np.array([code[k] for k in kinds] if kinds is not None else
                              [-1] * len(regions), dtype=np.int8)
        return meta, [_f64(cols), _f64(binarr), memoryview(ids.tobytes()), _f64(regarr),
                      memoryview(kind_codes.tobytes())]

    def _holder_ids(self, holders: Any, n: int) -> tuple[np.ndarray, dict]:
        """Holders as ids into the page's string table, and the strings it lacks.

        Each string goes to a page once: a snapshot starts the table afresh (``base`` 0),
        an update sends only strings it has not sent since. Past :data:`MAX_STRINGS`
        strings the table starts afresh with those in use."""
        none = np.zeros(0, dtype=np.int32)   # nobody named: no ids at all
        if holders is None or not n:
            return none, {"base": len(self._strings), "new": []}
        uniq, inv = np.unique(np.asarray(holders, dtype=object).astype(str),
                              return_inverse=True)
        named = [u for u in uniq.tolist() if u]
        if not named:
            return none, {"base": len(self._strings), "new": []}
        ids = np.full(n, -1, dtype=np.int32)
        if len(self._strings) + len(named) > MAX_STRINGS:
            self._strings = {}
        base = len(self._strings)
        new = []
        for u in named:
            if u not in self._strings:
                self._strings[u] = len(self._strings)
                new.append(u)
        idmap = np.array([self._strings.get(u, -1) if u else -1 for u in uniq.tolist()],
                         dtype=np.int32)
        ids[:] = idmap[inv.reshape(-1)]
        return ids, {"base": base, "new": new}

    # ------------------------------------------------------------------ the holders view
    def _make_tree(self, held: Any) -> tuple[Any, dict]:
        """The holders' tree of some blocks (:meth:`LiveModel.held_blocks`), in the
        device's framework's words, and what the page says about it."""
        words = self.model.model(held.device).words()
        in_use, chunk = words.get("in_use", "in use"), words.get("chunk", "chunk")
        total = held.total
        root = f"{format_bytes(total)} {in_use} in {len(held):,} {chunk}(s)"
        tree = holder_tree(held.size, held.stack, held.stacks, label=held.label,
                           labels=held.labels, max_nodes=self.holder_nodes, root=root,
                           chunk=chunk, path_cache=self._path_cache)
        notes = list(tree.notes)
        if held.note:
            notes.insert(0, held.note)
        meta = {"n": len(tree), "live": bool(held.live),
                "at": None if held.live else round(self.model.seconds(held.time_ms), 6),
                "total": int(total), "blocks": len(held), "nodes": int(tree.nodes),
                "left_out": int(tree.left_out), "depth": int(tree.depth.max()),
                "rule": tree.rule, "notes": notes, "root": root,
                "stacks": held.stacks is not None}
        return tree, meta

    def _live_tree(self, state: Any) -> tuple[Any, dict]:
        """The tree of a state's blocks in use, made again only when they changed."""
        held = self.model.held_blocks(state.device, state=state)
        h = hashlib.blake2b(digest_size=16)
        for a in (held.size, held.stack, held.label):
            h.update(np.ascontiguousarray(a).data)
        n_stacks = len(held.stacks) if held.stacks is not None else -1
        h.update(f"{state.device} {len(held.labels)} {n_stacks}".encode())
        key = h.digest()
        if self._tree is None or self._tree[0] != key:
            tree, meta = self._make_tree(held)
            self._tree = (key, tree, meta)
        return self._tree[1], self._tree[2]

    def _shown_tree(self, state: Any) -> tuple[Any, dict]:
        """The tree the holders view shows for a state: the moment picked, else live."""
        if self._moment is not None and self._moment[0] == state.device:
            return self._moment[1], self._moment[2]
        return self._live_tree(state)

    def _new_strings(self, names: Any) -> int:
        have = self._strings
        return sum(1 for u in set(names) if u and u not in have)

    def _tree_buffers(self, tree: Any, meta: dict, at: int) -> tuple[dict, list]:
        """The tree as the page draws it: ``meta`` (``buf``: the index of its first
        buffer) and ``[f64 2 x n: offset and bytes of each node, int32 4 x n: parent,
        blocks, name id and text id, int8 2 x n: level and kind]``; strings the page lacks
        in ``meta["strings"]`` (as the chunk map's)."""
        base = len(self._strings)
        new = []
        ids = np.empty((2, len(tree)), dtype=np.int32)
        for row, texts in enumerate((tree.name, tree.text)):
            for i, u in enumerate(texts):
                sid = self._strings.get(u)
                if sid is None:
                    sid = self._strings[u] = len(self._strings)
                    new.append(u)
                ids[row, i] = sid
        f = np.vstack([tree.x0, tree.value]).astype(np.float64)
        i32 = np.vstack([tree.parent, np.minimum(tree.blocks, 2**31 - 1), ids[0], ids[1]]
                        ).astype(np.int32)
        i8 = np.vstack([np.minimum(tree.depth, 127), tree.kind]).astype(np.int8)
        meta = dict(meta, strings={"base": base, "new": new}, buf=at)
        return meta, [_f64(f), memoryview(i32.tobytes()), memoryview(i8.tobytes())]

    def _send_holders(self) -> None:
        """The tree shown now, on its own (after a moment was picked, or "live")."""
        with self._send_lock:
            state = self.model.state(self.device)
            if state is None or self.model.closed:
                return
            tree, meta = self._shown_tree(state)
            meta, buffers = self._tree_buffers(tree, meta, 0)
            self._tree_sent = tree
            self._post("holders", {"type": "holders", "device": state.device,
                                   "holders": meta}, buffers)

    def _message(self, state: Any, full: bool) -> tuple[dict, list]:
        """A snapshot (``full``) or an update of one device's state."""
        cur = self._cursor if not full else {}
        tl = state.timeline
        t_ms = tl["time_ms"]
        start = self.model.start_ms
        last_t = cur.get("t", -np.inf)
        k = 0 if full else int(np.searchsorted(t_ms, last_t, side="right"))
        timeline = np.vstack([(t_ms[k:] - start) / 1e3, tl["in_use"][k:], tl["pool"][k:],
                              tl["limit"][k:]])
        hm_t = state.heatmap_time_ms
        row_bytes = state.heatmap_row_bytes
        hfull = full or cur.get("row_bytes") != row_bytes
        j = 0 if hfull else int(np.searchsorted(hm_t, cur.get("ht", -np.inf), side="right"))
        cols = state.heatmap[:, j:]
        heat = np.clip(np.rint(cols.T * 255.0), 0, 255).astype(np.uint8)  # columns x rows
        now = time.monotonic()
        layout = _layout_key(state.table)
        send_chunks = full or layout != self._chunks_version and (
            state.num_chunks <= LARGE_TABLE or now - self._chunks_sent_ms >= 1.0)
        content = {
            "type": "snapshot" if full else "update", "device": state.device,
            "version": state.version, "now": (state.time_ms - start) / 1e3,
            "headline": self._headline(state),
            "timeline_n": int(timeline.shape[1]),
            "heat": {"full": bool(hfull), "rows": int(state.heatmap.shape[0]),
                     "n": int(heat.shape[0]), "row_bytes": int(row_bytes),
                     "max_columns": int(self.model._devices[state.device].heatmap.columns)},
            "chunks": None,
        }
        buffers = [_f64(timeline), memoryview(heat.tobytes()), _f64((hm_t[j:] - start) / 1e3)]
        tree = None
        if "holders" in self.views:
            tree, tree_meta = self._shown_tree(state)
            send_tree = full or tree is not self._tree_sent
            if not full and (send_tree or send_chunks):
                # past MAX_STRINGS the table starts afresh: both users of it come again
                names = list(tree.name) + list(tree.text) if send_tree else []
                if send_chunks and "holder" in state.table:
                    names += np.unique(np.asarray(state.table["holder"], dtype=object)
                                       .astype(str)).tolist()
                if len(self._strings) + self._new_strings(names) > MAX_STRINGS:
                    full_strings = True
                    send_chunks = send_tree = True
                else:
                    full_strings = False
            else:
                full_strings = full
        else:
            send_tree = False
            full_strings = full
        if send_chunks:
            if full_strings:   # the page starts its string table afresh
                self._strings = {}
            meta, bufs = self._chunk_buffers(state)
            content["chunks"] = meta
            buffers += bufs
            self._chunks_version = layout
            self._chunks_sent_ms = now
        if send_tree and tree is not None:
            meta, bufs = self._tree_buffers(tree, tree_meta, len(buffers))
            content["holders"] = meta
            buffers += bufs
            self._tree_sent = tree
        controls = self._controls_info(state.device)
        if full or controls != self._controls_sent:  # settings changed from code, too
            content["controls"] = controls
            self._controls_sent = controls
        if len(t_ms):
            self._cursor["t"] = float(t_ms[-1])
        if len(hm_t):
            self._cursor["ht"] = float(hm_t[-1])
        self._cursor["row_bytes"] = row_bytes
        return content, buffers

    def _post(self, kind: str, content: dict, buffers: list | None = None) -> None:
        if self.comm is None:
            return
        self.send(content, buffers=buffers)
        n = len(json.dumps(content)) + sum(len(b) for b in (buffers or ()))
        rec = self.sent.setdefault(kind, [0, 0])
        rec[0] += 1
        rec[1] += n

    def _send_state(self, full: bool) -> None:
        with self._send_lock:
            if self.model.closed:
                return
            state = self.model.state(self.device)
            if state is None:
                return
            content, buffers = self._message(state, full)
            self._post("snapshot" if full else "update", content, buffers)

    def _on_tick(self, changed: set) -> None:
        if not self._hellos or self.device not in changed:
            return
        try:
            self._send_state(full=False)
        except Exception as exc:  # noqa: BLE001 - a closed comm while the kernel stops
            self.model.errors.append(f"dashboard update: {exc!r}")

    def _on_device(self, change: dict) -> None:
        self._chunks_version = None
        self._moment = None   # a moment picked on another device's timeline
        if self._hellos:
            self._send_state(full=True)

    # ------------------------------------------------------------------ from the browser
    def _on_msg(self, _widget: Any, content: dict, buffers: list) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        try:
            if kind == "hello":
                self._hellos += 1
                self._send_state(full=True)
            elif kind in ("lib", "lib-raw"):
                self._post("lib", *lib_message(raw=kind == "lib-raw"))
            elif kind == "action":
                self._reply(content, self._act(content))
        except GpudashError as exc:
            self._reply(content, {"ok": False, "text": str(exc)})
        except Exception as exc:  # noqa: BLE001 - answer, never a silent failure
            self._reply(content, {"ok": False, "text": f"{type(exc).__name__}: {exc}"})

    def _reply(self, content: dict, answer: dict) -> None:
        answer = dict(answer, type="reply", id=content.get("id"), name=content.get("name"),
                      device=self.device)
        if "controls" not in answer:
            answer["controls"] = self._controls_info(self.device)
            self._controls_sent = answer["controls"]
        self._post("reply", answer)

    def _act(self, content: dict) -> dict:
        """Run one control from the browser; the answer says what happened, in words.

        The dashboard's own controls (device, pause, rate, the holders' moment, restart)
        act here, and ``preview`` (``{name, value}``: what a control would do, from a
        source that says it before applying, :meth:`gpudash.live.LiveModel.preview`);
        every control of the allocator model goes to
        :meth:`gpudash.live.LiveModel.act`, which checks the value first (no coercion:
        growth ``"false"`` is refused, not read as true): a bad one is a
        :class:`~gpudash.ConfigError` naming the setting and the value, and nothing
        changes."""
        name = content.get("name")
        m = self.model
        dev = self.device
        value = content.get("value")
        if name == "device":
            self.device = self._check_device(value)
            return {"ok": True, "text": f"showing {m.device_names[self.device]}"}
        if name == "pause":
            if not isinstance(value, bool):
                raise ConfigError(f"pause must be true or false; got {value!r}")
            m.paused = bool(value)
            return {"ok": True, "text": "paused" if m.paused else "live"}
        if name == "rate":
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ConfigError(f"rate must be a number of refreshes a second; got {value!r}")
            try:
                m.rate_hz = float(value)
            except traitlets.TraitError as exc:
                raise ConfigError(str(exc)) from None
            return {"ok": True, "text": f"{m.rate_hz:g} refreshes/s"}
        if name == "holders_at":
            return self._holders_at(value)
        if name == "preview":
            if not isinstance(value, dict) or set(value) != {"name", "value"}:
                raise ConfigError(f"preview takes {{name, value}}: a control and the value "
                                  f"to preview; got {value!r}")
            return m.preview(dev, value["name"], value["value"])
        if name == "restart":
            feed = m.feed(dev)
            lines = feed.restart_lines() if feed is not None else []
            text = "\n".join(lines) if lines else "no settings to restart with"
            print(text)
            return {"ok": True, "text": text}
        # a control of the device's allocator model: the live layer's one path
        return m.act(dev, name, value)

    def _holders_at(self, value: Any) -> dict:
        """The holders view at a moment (``value``: seconds since the model started, as the
        timeline's x axis reads), or live again (``None``)."""
        if "holders" not in self.views:
            raise ConfigError("this dashboard has no holders view; show one with "
                              "Dashboard(..., views=[..., 'holders'])")
        m = self.model
        dev = self.device
        if value is None:
            self._moment = None
            self._send_holders()
            return {"ok": True, "text": "holders: live"}
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
                not np.isfinite(float(value)):
            raise ConfigError(f"holders_at must be a time in seconds on the timeline, or "
                              f"null for live; got {value!r}")
        held = m.held_blocks(dev, at_ms=m.start_ms + float(value) * 1e3)
        tree, meta = self._make_tree(held)
        self._moment = (dev, tree, meta)
        self._send_holders()
        words = m.model(dev).words()
        text = (f"holders at {meta['at']:.2f} s: {format_bytes(held.total)} "
                f"{words.get('in_use', 'in use')} in {len(held):,} "
                f"{words.get('chunk', 'chunk')}(s)")
        return {"ok": True, "text": text + (f" ({held.note})" if held.note else "")}

    def holders_tree(self, at: float | None = None) -> Any:
        """The holders view's tree (:class:`gpudash.holder_tree.HolderTree`) of the device
        shown: live, or at ``at`` seconds on the timeline."""
        m = self.model
        held = m.held_blocks(self.device, at_ms=None if at is None else
                             m.start_ms + float(at) * 1e3)
        return self._make_tree(held)[0]

    # ------------------------------------------------------------------ Python side
    def refresh(self) -> None:
        """Update every view now (for example after a cell finished a workload)."""
        self.model.refresh_now()

    def close(self) -> None:
        """Stop listening, close the model it made (a model passed in stays open), and
        close the widget with its layout. The session stays open."""
        remove = getattr(self, "_remove_tick", None)
        if remove is not None:
            remove()
            self._remove_tick = None
        model = getattr(self, "model", None)
        if model is not None and getattr(self, "_owns_model", False):
            model.close()
        layout = getattr(self, "layout", None)
        super().close()
        if layout is not None:
            layout.close()

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        model = getattr(self, "model", None)
        return f"Dashboard(views={list(self.views)}, device={self.device}, model={model!r})"
