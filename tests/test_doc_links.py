"""Every relative link and image in the README and ``docs/*.md`` points at a file of this
checkout, and a ``#fragment`` into a Markdown file names one of its headings (as GitHub makes
heading anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: ``[text](target)`` and ``![alt](target)``; a title after the target is allowed.
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE = re.compile(r"`[^`\n]*`")


def links(text: str) -> list[tuple[int, str]]:
    """The link targets of a Markdown text with their line numbers, outside code."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    prose = CODE.sub(blank, FENCE.sub(blank, text))
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(prose)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.MULTILINE):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """``LINE: TARGET (why)`` for each relative link of ``page`` that does not resolve to a
    file under ``root`` (or to a heading of it)."""
    bad = []
    for line, target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto: ...
            continue
        path_part, _, fragment = target.partition("#")
        dest = page if not path_part else (page.parent / path_part).resolve()
        if not dest.exists():
            bad.append(f"{line}: {target} (no such file)")
        elif root.resolve() not in dest.parents and dest != root.resolve():
            bad.append(f"{line}: {target} (outside the repository)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{line}: {target} (no heading #{fragment} in {dest.name})")
    return bad


def test_the_pages_are_found():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "docs/frameworks.md", "docs/performance.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_points_at_a_file_that_exists(page):
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path):
    """The check can fail: a missing file, a missing heading, a link out of the folder; links
    to the web, inside code and to headings that exist pass."""
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## A `code` heading, with words\n\nSee [x](missing.md), "
                    "[y](page.md#nowhere), [z](page.md#a-code-heading-with-words), "
                    "[w](#top), ![i](img.png), [h](https://example.com/a.md), "
                    "[o](../outside.md), `[not a link](nope.md)`.\n\n```\n[nor](this.md)\n"
                    "```\n", encoding="utf-8")
    (tmp_path / "img.png").write_bytes(b"")
    (tmp_path.parent / "outside.md").write_text("# Out\n", encoding="utf-8")
    assert broken_links(page, root=tmp_path) == [
        "5: missing.md (no such file)",
        "5: page.md#nowhere (no heading #nowhere in page.md)",
        "5: ../outside.md (outside the repository)",
    ]


def test_slugs_follow_githubs_rule():
    assert slug("Differential fuzz runs (`benchmarks/fuzz_core.py`)") == \
        "differential-fuzz-runs-benchmarksfuzz_corepy"
    assert slug("PyTorch's caching allocator, live") == "pytorchs-caching-allocator-live"
    assert slug("Who holds the memory at 10^6 events") == "who-holds-the-memory-at-106-events"
