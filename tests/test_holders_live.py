"""Who holds memory in a live session: ``Session.label``, ``record_stacks``, the chunk
map's hover data and the ``%%gpudash_track`` summary."""

from __future__ import annotations

import threading

import pytest

import gpudash
from gpudash.widgets import LiveModel

pytestmark = pytest.mark.core  # runs again on the pure-Python models (.ci/run)

MIB = 1 << 20


def test_labels_mark_the_allocations_made_inside_and_nest():
    with gpudash.Session(simulate="16GiB", poll=False) as sess:
        with sess.label("forward"):
            a = sess.allocate(MIB)
            with sess.label("attention"):
                b = sess.allocate(2 * MIB)
        c = sess.allocate(4 * MIB)
        assert sess.holder_of(a) == "forward" and sess.holder_of(b) == "attention"
        assert sess.holder_of(c) is None
        assert sess.holders() == {"attention": (2 * MIB, 1), "forward": (MIB, 1)}
        sess.free(b)
        sess.flush()  # the block went back: no holder left for it
        assert sess.holders() == {"forward": (MIB, 1)}
        sess.free_now(a)
        assert sess.holders() == {}


def test_a_label_is_per_thread():
    with gpudash.Session(simulate="16GiB", poll=False) as sess:
        seen = {}

        def other():
            seen["ptr"] = sess.allocate(MIB)

        with sess.label("main"):
            t = threading.Thread(target=other)
            t.start()
            t.join()
        assert sess.holder_of(seen["ptr"]) is None


def test_record_stacks_names_the_allocating_line_outside_gpudash():
    with gpudash.Session(simulate="16GiB", poll=False, record_stacks=True) as sess:
        p = sess.allocate(MIB)  # this line
        holder = sess.holder_of(p)
        assert holder.startswith("test_holders_live.py:")
        assert holder.endswith("test_record_stacks_names_the_allocating_line_outside_gpudash")
        with sess.label("step"):
            q = sess.allocate(MIB)
        assert sess.holder_of(q).startswith("step @ test_holders_live.py:")


def test_bad_labels_and_flags_are_refused():
    with gpudash.Session(simulate="16GiB", poll=False) as sess:
        for bad in ("", "  ", None, 3):
            with pytest.raises(gpudash.ConfigError, match="a label is a non-empty string"):
                with sess.label(bad):
                    pass
    with pytest.raises(gpudash.ConfigError, match="record_stacks must be True or False"):
        gpudash.Session(simulate="16GiB", poll=False, record_stacks="yes")


def test_the_chunk_table_carries_the_holders_for_the_chunk_map():
    with gpudash.Session(simulate="16GiB", poll=False) as sess:
        with sess.label("weights"):
            p = sess.allocate(3 * MIB)
        q = sess.allocate(MIB)
        with LiveModel(sess, start=False) as model:
            table = model.state(0).table
            by_ptr = dict(zip(table["ptr"].tolist(), table["holder"].tolist()))
            assert by_ptr[p] == "weights" and by_ptr[q] == ""


def test_track_labels_the_cell_and_says_who_holds_memory_at_the_end(capsys):
    from IPython.testing import globalipapp

    ip = globalipapp.start_ipython() or globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "gpudash")
    try:
        ip.run_line_magic("gpudash", "--simulate 8GiB")
        sess = gpudash.session.default_session(create=False)
        ip.user_ns.update(sess=sess, MIB=MIB)
        capsys.readouterr()
        ip.run_cell_magic("gpudash_track", "", "keep = [sess.allocate(8 * MIB) for _ in range(3)]")
        out = capsys.readouterr().out
        n = ip.execution_count
        assert f"held now by: cell [{n}] 24.00 MiB (3 block(s))" in out, out
    finally:
        ip.run_line_magic("unload_ext", "gpudash")


def test_a_notebook_cell_s_line_is_named_as_ipython_names_the_cell():
    """Code run from a cell has a file name IPython makes up (ipykernel: a hash of the
    cell's text in a temporary folder); a holder reads ``Cell In[N]:LINE`` instead, as
    IPython's own tracebacks do, everywhere a frame is shown."""
    pytest.importorskip("IPython")
    from IPython.testing import globalipapp

    from gpudash._cells import cell_name, display_name
    from gpudash.trace.callers import short_paths

    globalipapp.start_ipython()
    ip = globalipapp.get_ipython()
    number = ip.execution_count
    ip.run_cell("import sys\n"
                "def grab(sess):\n"
                "    return sess.allocate(1 << 20), sys._getframe().f_code.co_filename\n",
                store_history=True)
    with gpudash.Session(simulate="16GiB", poll=False, record_stacks=True) as sess:
        ptr, filename = ip.user_ns["grab"](sess)
        assert filename != f"Cell In[{number}]"      # Python's own name is a file's
        assert cell_name(filename) == display_name(filename) == f"Cell In[{number}]"
        assert sess.holder_of(ptr) == f"Cell In[{number}]:3 grab"
    assert short_paths([filename, "/a/train.py"]) == {filename: f"Cell In[{number}]",
                                                       "/a/train.py": "train.py"}
    # a file IPython did not compile keeps its name
    assert cell_name(__file__) is None and display_name(__file__) == "test_holders_live.py"
