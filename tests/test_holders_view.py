"""Stacks in gpudash's own sessions, the holders' tree, and the dashboard's holders view
(over a recording comm): who holds the memory live and at a moment picked on the timeline.

The browser's side (drawing, the click on the timeline, the hover) is in ``test_browser.py``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import test_widgets_model as shared
from test_widgets_dashboard import act, say, sent

import gpudash
from gpudash import top_holders
from gpudash.holder_tree import (
    KIND_BELOW,
    KIND_LABEL,
    KIND_OTHER,
    KIND_USER,
    NO_LABEL,
    holder_tree,
    stack_paths,
    trace_holder_tree,
)
from gpudash.session import STACK_DEPTH
from gpudash.formats.stacks import StackTable
from gpudash.widgets import Dashboard, LiveModel
from gpudash.widgets.dashboard import VIEWS
from gpudash.live.model import _HolderLog

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

comms = shared.comms
MIB = 1 << 20
HERE = __file__


# ------------------------------------------------------------------ a small "training loop"
# Each function allocates on its own line: the tests know which line holds what.
def init_weights(sess, n):
    return [sess.allocate(8 * MIB) for _ in range(n)]          # LINE_WEIGHTS


def forward(sess, layers):
    return [layer_output(sess, i) for i in range(layers)]


def layer_output(sess, i):
    return sess.allocate((i + 1) * MIB)                          # LINE_ACT


def optimizer_state(sess, weights):
    return [sess.allocate(16 * MIB) for _ in weights]           # LINE_OPT


def _line_of(marker: str) -> int:
    with open(HERE, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# {marker}"):
                return i
    raise AssertionError(marker)


def train(sess, steps=2, layers=3):
    """Weights and optimizer state that stay; activations of the last step kept."""
    with sess.label("init"):
        w = init_weights(sess, 2)
        opt = optimizer_state(sess, w)
    acts = []
    for step in range(steps):
        with sess.label(f"step {step}"):
            for p in acts:
                sess.free_now(p)
            acts = forward(sess, layers)
    return w, opt, acts


# ------------------------------------------------------------------ 1. stacks in sessions
def test_record_stacks_keeps_the_whole_allocating_stack_interned():
    with gpudash.Session(simulate="4GiB", poll=False, record_stacks=True) as sess:
        a, b = [layer_output(sess, i) for i in range(2)]   # one stack: one id
        c = init_weights(sess, 1)[0]
        frames = sess.stack_of(a)
        # innermost first, the caller's frames above gpudash's own
        assert frames[0] == (HERE, _line_of("LINE_ACT"), "layer_output")
        assert frames[1][0] == HERE and frames[1][2] == "<listcomp>"
        assert frames[2][2] == "test_record_stacks_keeps_the_whole_allocating_stack_interned"
        assert not any("/gpudash/" in f[0] and "/tests/" not in f[0] for f in frames)
        assert sess.stack_of(b) == frames
        st = sess.stacks
        assert sess.devices[0]._holders[a][1] == sess.devices[0]._holders[b][1]
        assert sess.devices[0]._holders[c][1] != sess.devices[0]._holders[a][1]
        assert len(st) == 2 and len(st.frames) == len(set(st.frames))
        # the words the chunk map shows did not change
        assert sess.holder_of(a) == f"test_holders_view.py:{_line_of('LINE_ACT')} layer_output"


def test_gpudash_frames_are_left_out_wherever_they_are():
    from gpudash.workloads import run_workload

    with gpudash.Session(simulate="4GiB", poll=False, record_stacks=True) as sess:
        run = run_workload([("alloc", "a", MIB)], sess.allocate, sess.free)   # this line
        frames = sess.stack_of(run.live["a"])
        assert frames[0][0] == HERE and frames[0][2] == \
            "test_gpudash_frames_are_left_out_wherever_they_are"
        assert not any("/gpudash/" in f[0] and "/tests/" not in f[0] for f in frames)


def test_stacks_are_bounded_in_depth():
    def deep(sess, k):
        return deep(sess, k - 1) if k else sess.allocate(MIB)

    with gpudash.Session(simulate="4GiB", poll=False, record_stacks=True) as sess:
        p = deep(sess, 2 * STACK_DEPTH)
        frames = sess.stack_of(p)
        assert len(frames) == STACK_DEPTH and all(f[2] == "deep" for f in frames)


def test_without_record_stacks_a_session_keeps_no_stacks():
    with gpudash.Session(simulate="4GiB", poll=False) as sess:
        p = sess.allocate(MIB)
        with sess.label("x"):
            q = sess.allocate(MIB)
        assert sess.stacks is None and sess.stack_of(q) == [] and sess.holder_of(p) is None
        assert sess.holder_of(q) == "x"
        assert sess.devices[0]._holders == {q: ("x", -1)}


def test_a_failing_holder_sink_never_breaks_an_allocation():
    with gpudash.Session(simulate="4GiB", poll=False, record_stacks=True) as sess:
        def bad(*args):
            raise RuntimeError("boom")

        remove = sess._add_holder_sink(bad)
        with pytest.warns(gpudash.GpudashWarning, match="holder sink"):
            p = sess.allocate(MIB)
        assert sess.holder_of(p)
        remove()


# ------------------------------------------------------------------ 2. the Recorder
@pytest.mark.parametrize("allocator", [None, "torch"])
def test_a_recorded_session_names_the_users_lines_and_labels(allocator):
    with gpudash.Session(simulate="16GiB", poll=False, record_stacks=True,
                         allocator=allocator) as sess:
        rec = gpudash.Recorder(sess)
        w, opt, acts = train(sess)
        trace = rec.to_trace()
        rec.detach()
        in_use = sum(sess.devices[0].allocator.allocated_size(p) for p in w + opt + acts)
    by_line = {r.holder: (r.bytes, r.allocations) for r in top_holders(trace, at="end")}
    weights = f"test_holders_view.py:{_line_of('LINE_WEIGHTS')} <listcomp>"
    opt_line = f"test_holders_view.py:{_line_of('LINE_OPT')} <listcomp>"
    act_line = f"test_holders_view.py:{_line_of('LINE_ACT')} layer_output"
    assert set(by_line) == {weights, opt_line, act_line}, by_line
    assert by_line[weights][1] == 2 and by_line[opt_line][1] == 2 and by_line[act_line][1] == 3
    # labels are the holders of the alloc and free rows
    by_label = {r.holder: r.allocations for r in top_holders(trace, at="end", by="holder")}
    assert by_label == {"init": 4, "step 1": 3}
    kind = trace.columns["kind"]
    frees = np.flatnonzero(kind == 2)
    assert len(frees) == 3 and all(trace.holders[h] == "step 0" for h in trace.holder[frees])
    assert (trace.stack[frees] == -1).all()     # the free call's stack was not recorded
    # bytes by line add up to what the allocator had in use at the end
    assert sum(b for b, _ in by_line.values()) == in_use


def test_a_recorder_of_a_plain_session_or_allocator_records_no_stacks():
    with gpudash.Session(simulate="4GiB", poll=False) as sess:
        rec = gpudash.Recorder(sess)
        sess.allocate(MIB)
        t = rec.to_trace()
        rec.detach()
        assert t.stack is None and (t.holder == -1).all() and t.holders == []
    alloc = gpudash.BFCAllocator(gpudash.SimulatedDevice("1GiB"), 1 << 30)
    with gpudash.Recorder(alloc) as rec:
        alloc.allocate(1000)
    assert rec.to_trace().stack is None


def test_the_recorders_holder_log_is_bounded_by_its_capacity():
    with gpudash.Session(simulate="4GiB", poll=False, record_stacks=True) as sess:
        rec = gpudash.Recorder(sess, capacity=100)
        for _ in range(20_000):
            sess.free_now(sess.allocate(256))
        held = rec._held_by[0]
        assert len(held[0]) <= 100 + 4096
        rec.detach()


# ------------------------------------------------------------------ 3. the tree
def _recorded(steps=2, layers=3, allocator=None):
    sess = gpudash.Session(simulate="16GiB", poll=False, record_stacks=True,
                           allocator=allocator)
    rec = gpudash.Recorder(sess)
    train(sess, steps, layers)
    return sess, rec


def test_the_trees_bytes_are_top_holders_by_stack_for_the_same_blocks():
    sess, rec = _recorded()
    try:
        trace = rec.to_trace()
        table = top_holders(trace, at="end", by="stack")
        tree = trace_holder_tree(trace, at="end", labels=False)
        paths, _ = stack_paths(trace.stacks, [r.stack_ids[0] for r in table])
        expected: dict = {}
        for row, path in zip(table, paths):
            key = tuple(step[0] for step in path)
            expected[key] = expected.get(key, 0) + row.bytes
        assert tree.leaves() == expected
        assert int(tree.value[0]) == table.total_bytes == tree.total_bytes
        # user frames outermost first, then what the innermost called into (nothing: the
        # session was called from the test's own line)
        acts = next(k for k in expected if k[-1].endswith("layer_output"))
        assert [k.split(" ")[-1] for k in acts] == [
            "test_the_trees_bytes_are_top_holders_by_stack_for_the_same_blocks", "_recorded",
            "train", "forward", "<listcomp>", "layer_output"]
        # with labels: the label on top, the same bytes under each
        labelled = trace_holder_tree(trace, at="end")
        roots = {labelled.name[i]: int(labelled.value[i]) for i in range(len(labelled))
                 if labelled.depth[i] == 1}
        assert set(roots) == {"init", "step 1"}
        assert all(labelled.kind[i] == KIND_LABEL for i in range(len(labelled))
                   if labelled.depth[i] == 1)
        by_holder = {r.holder: r.bytes for r in top_holders(trace, at="end", by="holder")}
        assert roots == by_holder
    finally:
        rec.detach()
        sess.close()


def test_the_tree_is_the_reports_icicle():
    from attrib_helpers import CPP_MM, TORCH_CALL, TORCH_LINEAR, make_trace, user

    from gpudash.report import stack_icicle_figure

    calls = [("alloc", "a", 100, [TORCH_LINEAR, TORCH_CALL, user(10, "fwd"), user(50, "main")]),
             ("alloc", "b", 300, [CPP_MM, user(12, "fwd"), user(50, "main")]),
             ("alloc", "c", 50, [user(20, "init"), user(40, "main")]),
             ("alloc", "d", 30, None), ("alloc", "e", 7, [TORCH_LINEAR]),
             ("free", "c")]
    trace = make_trace(calls)
    for max_nodes in (300, 3):
        tree = trace_holder_tree(trace, at="end", max_nodes=max_nodes)
        fig = stack_icicle_figure(trace, at="end", max_nodes=max_nodes)
        ic = fig.data[0]
        icicle = {tuple(i[1:].split("\x1f")) if i != "/" else (): v
                  for i, v in zip(ic.ids, ic.values)}
        mine = {tree.path(i): int(tree.value[i]) for i in range(len(tree))}
        assert mine == icicle
    full = trace_holder_tree(trace, at="end")
    kinds = {full.name[i]: int(full.kind[i]) for i in range(len(full))}
    assert kinds["train.py:50 main"] == KIND_USER
    assert kinds["(in libraries) linear.py:125 forward"] == KIND_BELOW
    assert kinds["(C++) aten::mm"] == KIND_BELOW
    assert kinds["(outside user code) linear.py:125 forward"] == KIND_OTHER
    assert kinds["(no stack recorded)"] == KIND_OTHER


def test_the_tree_keeps_its_largest_nodes_and_their_bytes_in_the_parents():
    rng = np.random.default_rng(1)
    st = StackTable()
    sids = [st.intern_frames([(f"/p/m{k % 40}.py", 10 + k, f"f{k}"), ("/p/main.py", 5, "main")])
            for k in range(400)]
    size = rng.integers(1, 1000, 2000)
    stack = np.array(sids)[rng.integers(0, 400, 2000)]
    everything = sorted(holder_tree(size, stack, st, max_nodes=10**6).value[1:].tolist(),
                        reverse=True)
    for cap in (1, 10, 100, 1000):
        tree = holder_tree(size, stack, st, max_nodes=cap)
        used = len(np.unique(stack))     # one leaf each, under one "main.py:5 main"
        assert len(tree) <= cap + 1 and tree.nodes == used + 2
        assert tree.left_out == used + 1 - (len(tree) - 1)
        assert int(tree.value[0]) == int(size.sum())
        # every parent first, at least as wide as what hangs under it, children inside it
        for i in range(1, len(tree)):
            p = int(tree.parent[i])
            assert p < i and tree.depth[i] == tree.depth[p] + 1
            assert tree.x0[p] <= tree.x0[i] and \
                tree.x0[i] + tree.value[i] <= tree.x0[p] + tree.value[p]
        kids = np.bincount(tree.parent[1:], weights=tree.value[1:], minlength=len(tree))
        assert (kids <= tree.value + 0.5).all()
        # the kept nodes are the largest
        kept = sorted(tree.value[1:].tolist(), reverse=True)
        assert kept == everything[:len(kept)]
    with pytest.raises(ValueError, match="sizes but"):
        holder_tree([1, 2], [0], st)


def test_labels_are_the_top_level_and_unlabelled_blocks_say_so():
    st = StackTable()
    s = st.intern_frames([("/p/train.py", 3, "step")])
    tree = holder_tree([10, 20, 5], [s, s, -1], st, label=[0, -1, -1], labels=["cell [4]"])
    top = {tree.name[i]: int(tree.value[i]) for i in range(len(tree)) if tree.depth[i] == 1}
    assert top == {"cell [4]": 10, NO_LABEL: 25}
    assert tree.leaves() == {("cell [4]", "train.py:3 step"): 10,
                             (NO_LABEL, "train.py:3 step"): 20,
                             (NO_LABEL, "(no stack recorded)"): 5}


# ------------------------------------------------------------------ 4. the history
def test_the_holder_log_gives_every_moment_against_a_brute_force_count():
    rng = random.Random(5)
    for bound in (10**6, 200, 40):
        log = _HolderLog(bound)
        live: dict[int, tuple] = {}
        states = []
        nxt = 1
        for step in range(300):
            for _ in range(rng.randint(0, 6)):
                live[nxt] = (rng.randint(1, 999), rng.randint(-1, 3), rng.randint(-1, 2))
                nxt += 1
            for k in rng.sample(sorted(live), k=min(len(live), rng.randint(0, 5))):
                del live[k]
            # a block whose holder the model saw late: its history takes it
            if live and rng.random() < 0.1:
                k = rng.choice(sorted(live))
                live[k] = (live[k][0], live[k][1], 7)
                for s in states:
                    if k in s[1]:
                        s[1][k] = live[k]
            aid = np.array(sorted(live), dtype=np.int64)
            cols = [np.array([live[a][j] for a in aid.tolist()], dtype=np.int64)
                    for j in range(3)]
            log.update(float(step * 10), aid, *cols)
            states.append((float(step * 10), dict(live)))
        oldest = log.base_ms
        for t, want in states:
            got_t, (aid, size, stack, label), note = log.at(t + 3)
            if oldest is not None and t < oldest:
                assert got_t == oldest and note
                continue
            # the refresh that made this state (a refresh that changed nothing made none)
            assert note == "" and got_t <= t
            got = {a: (s, st, lb) for a, s, st, lb in zip(aid.tolist(), size.tolist(),
                                                          stack.tolist(), label.tolist())}
            assert got == want, (bound, t)
        events = len(log.adds) + len(log.gone)
        assert events <= bound or bound == 10**6
        if bound == 40:
            assert log.folded > 0 and log.nbytes < 64 * 1024


def test_a_moment_in_the_past_is_the_state_of_that_moment():
    """Blocks allocated and freed between refreshes, counted here independently: the holders
    at each refresh's moment are those the allocator had then, by label, and their total is
    the timeline's figure for that moment."""
    with gpudash.Session(simulate="16GiB", poll=False, record_stacks=True) as sess, \
            LiveModel(sess, start=False) as model:
        rng = random.Random(2)
        live: dict[int, tuple[int, str]] = {}
        moments = []
        for step in range(25):
            with sess.label(f"phase {step % 4}"):
                for _ in range(rng.randint(0, 5)):
                    p = sess.allocate(rng.randint(1, 4 * MIB))
                    live[p] = (sess.devices[0].allocator.allocated_size(p), f"phase {step % 4}")
            for p in rng.sample(sorted(live), k=min(len(live), rng.randint(0, 3))):
                sess.free_now(p)
                del live[p]
            model.refresh_now()
            want: dict[str, int] = {}
            for size, label in live.values():
                want[label] = want.get(label, 0) + size
            moments.append((model.state(0).time_ms, want, model.state(0).stats.bytes_in_use))
        tl = model.state(0).timeline
        for t_ms, want, in_use in moments:
            held = model.held_blocks(0, at_ms=t_ms)
            # (taken at this refresh, or the last one that changed the blocks in use)
            assert held.time_ms <= t_ms and not held.live and held.note == ""
            got: dict[str, int] = {}
            for size, code in zip(held.size.tolist(), held.label.tolist()):
                got[held.labels[code]] = got.get(held.labels[code], 0) + size
            assert got == {k: v for k, v in want.items() if v}
            assert held.total == in_use == tl["in_use"][np.flatnonzero(tl["time_ms"] == t_ms)[0]]
            # a moment between two refreshes is the earlier one's state
            assert model.held_blocks(0, at_ms=t_ms + 0.01).total == in_use


def test_held_blocks_refuses_a_moment_where_no_history_is_kept():
    with gpudash.Session(simulate="4GiB", poll=False) as sess, \
            LiveModel(sess, start=False, holder_history=0) as model:
        with pytest.raises(gpudash.ConfigError, match="no history of who held what"):
            model.held_blocks(0, at_ms=model.start_ms)
        assert model.held_blocks(0).live
    with pytest.raises(gpudash.ConfigError, match="holder_history must be an integer"):
        LiveModel(gpudash.Session(simulate="1GiB", poll=False), holder_history=-1)


# ------------------------------------------------------------------ 5. the dashboard
def _holders_messages(log, dash):
    out = []
    for content, buffers in sent(log, dash):
        meta = content.get("holders")
        if meta is not None:
            out.append((content, meta, buffers))
    return out


def decode_tree(meta, buffers, strings):
    n = meta["n"]
    at = meta["buf"]
    f = np.frombuffer(buffers[at], dtype=np.float64).reshape(2, n)
    i32 = np.frombuffer(buffers[at + 1], dtype=np.int32).reshape(4, n)
    i8 = np.frombuffer(buffers[at + 2], dtype=np.int8).reshape(2, n)
    return {"x0": f[0], "value": f[1], "parent": i32[0], "blocks": i32[1],
            "name": [strings[i] for i in i32[2]], "text": [strings[i] for i in i32[3]],
            "depth": i8[0], "kind": i8[1]}


class Page:
    """The page's string table, kept as dashboard.js keeps it."""

    def __init__(self):
        self.strings: list[str] = []

    def take(self, st):
        if st["base"] == 0:
            self.strings = []
        del self.strings[st["base"]:]
        self.strings.extend(st["new"])

    def read(self, content, buffers):
        if content.get("chunks"):
            self.take(content["chunks"]["strings"])
        meta = content.get("holders")
        if meta is None:
            return None
        self.take(meta["strings"])
        return decode_tree(meta, buffers, self.strings)


def test_holders_is_a_view_of_its_own_shown_where_the_session_records_stacks(comms):
    with gpudash.Session(simulate="4GiB", poll=False, record_stacks=True) as rs, \
            gpudash.Session(simulate="4GiB", poll=False) as plain:
        with Dashboard(rs) as d1, Dashboard(plain) as d2, \
                Dashboard(plain, views=VIEWS + ("holders",)) as d3:
            assert d1.views == VIEWS + ("holders",) and d2.views == VIEWS
            assert "holders" in d3.views
            say(d2, {"type": "hello"})
            assert not _holders_messages(comms, d2)
            reply = act(comms, d2, "holders_at", 1.0)
            assert not reply["ok"] and "no holders view" in reply["text"]
        with pytest.raises(gpudash.ConfigError, match="unknown view"):
            Dashboard(plain, views=("nope",))
        with pytest.raises(gpudash.ConfigError, match="holder_nodes"):
            Dashboard(plain, holder_nodes=0)


def test_the_holders_tree_goes_to_the_page_when_it_changed_and_at_a_moment(comms):
    with gpudash.Session(simulate="16GiB", poll=False, record_stacks=True) as sess:
        model = LiveModel(sess, start=False)
        dash = Dashboard(model=model)
        page = Page()
        try:
            train(sess, steps=1)
            model.refresh_now()
            t_first = model.seconds(model.state(0).time_ms)
            in_use_first = model.state(0).stats.bytes_in_use
            say(dash, {"type": "hello"})
            (content, buffers), = sent(comms, dash, "snapshot")
            tree = page.read(content, buffers)
            meta = content["holders"]
            assert meta["live"] and meta["at"] is None
            assert tree["value"][0] == meta["total"] == in_use_first
            assert meta["root"].endswith(f"in use in {meta['blocks']} chunk(s)")
            assert {tree["name"][i] for i in range(meta["n"]) if tree["depth"][i] == 1} == \
                {"init", "step 0"}
            # the same tree as the trace of the same blocks would give
            mine = dash.holders_tree()
            assert tree["name"] == mine.name and list(tree["value"]) == list(mine.value)
            # hover text: the frame in full
            i = tree["name"].index(f"test_holders_view.py:{_line_of('LINE_ACT')} layer_output")
            assert tree["text"][i] == f"{HERE}:{_line_of('LINE_ACT')} layer_output"
            # nothing changed: no tree in the update
            model.refresh_now(force=True)    # an update goes: the tick's
            last, buffers = sent(comms, dash, "update")[-1]
            assert last.get("holders") is None
            # a change: the tree again, its new strings only
            with sess.label("step 1"):
                more = forward(sess, 2)
            model.refresh_now()
            last, buffers = sent(comms, dash, "update")[-1]
            tree = page.read(last, buffers)
            assert tree is not None and last["holders"]["strings"]["base"] > 0
            assert "step 1" in tree["name"] and "step 1" in last["holders"]["strings"]["new"]
            assert tree["value"][0] == model.state(0).stats.bytes_in_use > in_use_first
            # a moment picked on the timeline: the state then, in a message of its own
            n = len(sent(comms, dash, "holders"))
            reply = act(comms, dash, "holders_at", t_first)
            assert reply["ok"] and reply["text"].startswith(f"holders at {t_first:.2f} s: ")
            (content, buffers), = sent(comms, dash, "holders")[n:]
            tree = page.read(content, buffers)
            assert not content["holders"]["live"]
            assert abs(content["holders"]["at"] - t_first) < 1e-6
            assert tree["value"][0] == in_use_first
            assert "step 1" not in tree["name"]
            # refreshes leave the moment alone; a snapshot (a reload) shows it again
            for p in more:
                sess.free_now(p)
            model.refresh_now()
            assert sent(comms, dash, "update")[-1][0].get("holders") is None
            say(dash, {"type": "hello"})
            content, buffers = sent(comms, dash, "snapshot")[-1]
            assert content["holders"]["at"] == pytest.approx(t_first, abs=1e-6)
            # live again
            reply = act(comms, dash, "holders_at", None)
            assert reply["ok"] and reply["text"] == "holders: live"
            content, buffers = sent(comms, dash, "holders")[-1]
            assert content["holders"]["live"]
            tree = page.read(content, buffers)
            assert tree["value"][0] == model.state(0).stats.bytes_in_use
            for bad in ("soon", True, float("nan")):
                reply = act(comms, dash, "holders_at", bad)
                assert not reply["ok"] and "holders_at must be a time" in reply["text"]
        finally:
            dash.close()
            model.close()


def test_the_wire_is_bounded_whatever_the_stacks(comms):
    """500 distinct stacks from 500 files: the tree sent keeps the largest holder_nodes
    nodes, and its bytes stay bounded."""
    with gpudash.Session(simulate="80GiB", poll=False, record_stacks=True) as sess:
        ns: dict = {}
        for k in range(500):
            code = compile(f"def f{k}(s):\n    return s.allocate({(k % 37 + 1) * MIB})\n",
                           f"/work/gen/module_{k}.py", "exec")
            exec(code, ns)  # noqa: S102 - the test's own generated functions
        for k in range(500):
            ns[f"f{k}"](sess)
        model = LiveModel(sess, start=False)
        dash = Dashboard(model=model, holder_nodes=50)
        try:
            say(dash, {"type": "hello"})
            content, buffers = sent(comms, dash, "snapshot")[-1]
            meta = content["holders"]
            assert meta["n"] <= 51 and meta["nodes"] > 500 and meta["left_out"] > 450
            at = meta["buf"]
            tree_bytes = sum(len(b) for b in buffers[at:at + 3])
            assert tree_bytes == meta["n"] * 34
            text_bytes = sum(len(x.encode()) for x in meta["strings"]["new"])
            assert text_bytes <= 2 * meta["n"] * 300
            assert int(np.frombuffer(buffers[at], np.float64)[meta["n"]]) == \
                model.state(0).stats.bytes_in_use
        finally:
            dash.close()
            model.close()


def test_the_string_table_starts_afresh_with_chunks_and_tree_together(comms, monkeypatch):
    import gpudash.widgets.dashboard as gd

    with gpudash.Session(simulate="16GiB", poll=False, record_stacks=True) as sess:
        model = LiveModel(sess, start=False)
        dash = Dashboard(model=model)
        page = Page()
        try:
            train(sess, steps=1)
            model.refresh_now()
            say(dash, {"type": "hello"})
            page.read(*sent(comms, dash, "snapshot")[-1])
            monkeypatch.setattr(gd, "MAX_STRINGS", len(dash._strings) + 2)
            for k in range(3):
                with sess.label(f"more {k}"):
                    forward(sess, 2)
            model.refresh_now()
            content, buffers = sent(comms, dash, "update")[-1]
            assert content["chunks"]["strings"]["base"] == 0
            tree = page.read(content, buffers)
            assert tree is not None and {"more 0", "more 1", "more 2"} <= set(tree["name"])
            # every holder id of the chunk map names a string of the fresh table
            n = content["chunks"]["n"]
            ids = np.frombuffer(buffers[5], dtype=np.int32)
            assert len(ids) == n and ids.max() < len(page.strings)
        finally:
            dash.close()
            model.close()


def test_a_pytorch_sessions_holders_speak_pytorchs_words(comms):
    with gpudash.Session(simulate="16GiB", poll=False, record_stacks=True,
                         allocator="torch") as sess:
        train(sess, steps=1)
        with Dashboard(sess, rate_hz=20) as dash:
            dash.model.refresh_now()
            say(dash, {"type": "hello"})
            content, _ = sent(comms, dash, "snapshot")[-1]
            assert content["holders"]["root"].endswith(
                f"allocated in {content['holders']['blocks']} block(s)")
            reply = act(comms, dash, "holders_at", 0.0)
            assert " allocated in " in reply["text"] and reply["text"].endswith("block(s)")


def test_the_record_stacks_path_is_not_taken_without_stacks_or_labels():
    """The compiled fast path stays in force for a plain session (holders are tracked only
    once a label or record_stacks asks for them)."""
    with gpudash.Session(simulate="1GiB", poll=False) as sess:
        assert sess._track_holders is False and sess._stacks is None
        p = sess.allocate(1000)
        assert sess.devices[0]._holders == {}
        sess.free_now(p)
