"""The layers point down: a module imports nothing of a layer above its own, inside a
function included (docs' layout: formats below the questions asked of a trace; the live
layer and the monitors below the views)."""

from __future__ import annotations

import ast
from pathlib import Path

import gpudash

ROOT = Path(gpudash.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every gpudash module ``path`` imports, at the top or inside a function."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    package = parts[:-1]  # a module's package; an __init__.py's own
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("gpudash")}


def _modules(*places: str) -> list[Path]:
    paths = []
    for place in places:
        p = ROOT / place
        paths += sorted(p.rglob("*.py")) if p.is_dir() else [p.with_suffix(".py")]
    return paths


def _offending(places: tuple[str, ...], above: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for path in _modules(*places):
        hits = sorted(m for m in _imports(path)
                      if any(m == a or m.startswith(a + ".") for a in above))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    return bad


def test_the_formats_know_nothing_of_the_questions_or_the_views():
    assert _offending(("formats",), ("gpudash.trace", "gpudash.workloads", "gpudash.live",
                                     "gpudash.widgets", "gpudash.monitors", "gpudash.dask",
                                     "gpudash.report", "gpudash.cli", "gpudash.session")) == {}


def test_the_live_layer_and_the_monitors_import_no_view():
    assert _offending(("live", "monitors"), ("gpudash.widgets", "gpudash.dask.dashboard",
                                             "gpudash.report", "gpudash.magics",
                                             "gpudash.cli")) == {}


def test_pytorch_s_observer_sits_below_its_users():
    """torch.py re-exports shadow and install mode; they and the monitor share PyTorch's
    out-of-memory observer from a module below all three, so none imports torch.py."""
    assert _offending(("_torch_hooks", "torch_shadow", "torch_install", "monitors"),
                      ("gpudash.torch",)) == {}


def test_workloads_sit_above_the_allocators_and_below_the_questions():
    assert _offending(("workloads",), ("gpudash.trace", "gpudash.live", "gpudash.widgets",
                                       "gpudash.session")) == {}
