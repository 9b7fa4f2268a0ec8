"""Which allocator core runs: the compiled one only when it was built from these sources."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import gpudash
from gpudash import _accel, _sourcehash

PKG = Path(gpudash.__file__).resolve().parent


def test_the_fingerprint_follows_every_source_file(tmp_path):
    shutil.copy(PKG / "_core.pyx", tmp_path)
    shutil.copytree(PKG / "_csrc", tmp_path / "_csrc")
    first = _sourcehash.source_hash(tmp_path)
    assert first == _sourcehash.source_hash(PKG)
    pxi = sorted((tmp_path / "_csrc").glob("*.pxi"))[-1]
    pxi.write_text(pxi.read_text() + "\n# changed\n")
    assert _sourcehash.source_hash(tmp_path) != first
    assert _sourcehash.source_hash(tmp_path / "nowhere") is None


def test_an_extension_from_other_sources_is_not_used(monkeypatch):
    monkeypatch.delenv(_accel.ENV, raising=False)
    try:
        from gpudash import _core
    except ImportError:
        pytest.skip("the compiled core is not built here")
    assert _core.SOURCE_HASH == _sourcehash.source_hash(PKG)
    assert _accel._load() == (_core, "")
    monkeypatch.setattr(_accel, "source_hash", lambda _dir: "0" * 64)
    core, reason = _accel._load()
    assert core is None and "built from other sources" in reason and "rebuild" in reason


def test_the_environment_variable_chooses_the_pure_models(monkeypatch):
    monkeypatch.setenv(_accel.ENV, "1")
    assert _accel._load() == (None, f"{_accel.ENV} is set")
    monkeypatch.setenv(_accel.ENV, "0")
    assert _accel._load()[1] != f"{_accel.ENV} is set"


def test_describe_says_which_core_runs_and_why(monkeypatch):
    monkeypatch.setattr(_accel, "COMPILED", False)
    monkeypatch.setattr(_accel, "REASON", f"{_accel.ENV} is set")
    assert _accel.describe() == f"pure Python ({_accel.ENV} is set)"
    if _accel._core is not None:
        monkeypatch.setattr(_accel, "COMPILED", True)
        assert _accel.describe().startswith("compiled (gpudash._core, _core")


# ---------------------------------------------------------------------- the contract
# class attributes that are no method of the model: Python's and Cython's own (Cython gives a
# class with __setitem__ a __delitem__ that refuses, and one with __eq__ the other five)
_CYTHON_MADE = {"__new__", "__doc__", "__pyx_vtable__", "__reduce__", "__setstate__", "__hash__",
                "__delitem__",
                "__lt__", "__le__", "__ne__", "__gt__", "__ge__", "__init__", "__module__",
                "__qualname__", "__dict__", "__weakref__", "__slots__"}


def _built_core():
    try:
        from gpudash import _core
    except ImportError:
        pytest.skip("the compiled core is not built here")
    return _core


def _stubs() -> tuple[set[str], dict[str, set[str]]]:
    """The names ``_core.pyi`` declares: top-level, and each class's members."""
    import ast

    tree = ast.parse((PKG / "_core.pyi").read_text())
    top: set[str] = set()
    members: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            top.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            members[node.name] = {
                n.name if isinstance(n, ast.FunctionDef) else n.target.id
                for n in node.body if isinstance(n, (ast.FunctionDef, ast.AnnAssign))}
    return top, members


def test_the_stubs_list_exactly_what_the_core_exports():
    """_core.pyi names every public function, class and constant of the built core, and
    every method and attribute of each class; nothing more."""
    core = _built_core()
    import types

    from gpudash import _errors

    exported = {n for n, v in vars(core).items()
                if not n.startswith("_") and not isinstance(v, types.ModuleType)
                and getattr(_errors, n, None) is not v}  # the errors it raises are _errors'
    top, members = _stubs()
    assert top == exported, (sorted(top - exported), sorted(exported - top))
    for name, stubbed in members.items():
        made = {n for n in vars(getattr(core, name)) if n not in _CYTHON_MADE}
        assert stubbed - {"__init__"} == made, (name, sorted(stubbed - made),
                                                sorted(made - stubbed))


def _twin_source(where: str) -> bool:
    """Whether ``"_csrc/file.pxi: Class.method"`` (or ``: function``) is defined there."""
    import re

    path, name = (s.strip() for s in where.split(":"))
    text = (PKG / path).read_text()
    if "." not in name:
        return re.search(rf"^(def|cdef class) {name}\b", text, re.M) is not None
    cls, method = name.split(".")
    m = re.search(rf"^cdef class {cls}\b[^\n]*\n", text, re.M)
    body = text[m.end():] if m else ""
    end = re.search(r"^(cdef class|def|class) ", body, re.M)  # the class's last line
    body = body[:end.start()] if end else body
    return re.search(rf"^    (?:def|cpdef(?: \w+)*?) {method}\(", body, re.M) is not None


def test_every_twin_in_the_table_is_where_it_says():
    import importlib

    for pure, where in _accel.TWINS.items():
        mod, *attrs = pure.split(".")
        if mod == "trace":
            mod = f"trace.{attrs.pop(0)}"
        obj = importlib.import_module(f"gpudash.{mod}")
        for attr in attrs:
            obj = getattr(obj, attr)  # the pure-Python side exists
        assert _twin_source(where), (pure, where)


@pytest.mark.skipif(not _accel.COMPILED, reason="the compiled core does not run here")
def test_the_table_names_every_method_a_compiled_class_replaces():
    import types

    from gpudash import bfc, caching, session

    for compiled, pure in ((bfc.BFCAllocator, bfc.PyBFCAllocator),
                           (caching.CachingAllocator, caching.PyCachingAllocator),
                           (session.Session, session.PySession)):
        assert compiled is not pure and issubclass(compiled, pure)
        replaced = set()
        for klass in compiled.__mro__[:compiled.__mro__.index(pure)]:
            for name, value in vars(klass).items():
                if (name in _CYTHON_MADE or name.startswith("__pyx") or name == "compiled"
                        or isinstance(value, (types.GetSetDescriptorType,
                                              types.MemberDescriptorType))):
                    continue
                if hasattr(pure, name):
                    replaced.add(name)
        prefix = f"{pure.__module__.removeprefix('gpudash.')}.{pure.__name__}."
        table = {k.removeprefix(prefix) for k in _accel.TWINS if k.startswith(prefix)}
        assert table == replaced, (pure, sorted(table ^ replaced))


def test_the_public_classes_are_bound_in_one_place():
    """bfc.BFCAllocator, caching.CachingAllocator and session.Session are the compiled
    twins of the pure-Python models where the core runs, else the models themselves; only
    gpudash._accel reads the compiled core."""
    import re

    import gpudash
    from gpudash import bfc, caching, session

    for public, pure, name in ((bfc.BFCAllocator, bfc.PyBFCAllocator, "BFCAllocator"),
                               (caching.CachingAllocator, caching.PyCachingAllocator,
                                "CachingAllocator"),
                               (session.Session, session.PySession, "Session")):
        assert getattr(gpudash, name) is public
        if _accel.COMPILED:
            assert public.__mro__[-2 if name == "Session" else -3] is pure or issubclass(
                public, pure)
            assert (public.__qualname__, public.__module__) == (name, pure.__module__)
        else:
            assert public is pure
    readers = []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if path.name != "_accel.py" and re.search(
                r"import _core\b|_accel\._core\b|gpudash\._core import", text):
            readers.append(path.name)
    assert readers == []


def test_event_codes_are_defined_in_events_only():
    import re

    from gpudash import events

    kinds = "|".join(k.name for k in events.EventKind)
    defining = re.compile(rf"^\s*_?({kinds})(\s*,\s*_?({kinds}))*\s*=\s*\(?\s*(int\(EventKind|\d)",
                          re.M)
    found = [p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")
             if p.name != "events.py" and defining.search(p.read_text())]
    assert found == []
    assert [events.ALLOC, events.FREE, events.SPLIT, events.MERGE, events.EXTEND,
            events.RELEASE, events.OOM, events.LIMIT] == [int(k) for k in events.EventKind]
    try:
        from gpudash import _core
    except ImportError:
        return
    assert _core.EVENT_KINDS == {k.name: int(k) for k in events.EventKind}
