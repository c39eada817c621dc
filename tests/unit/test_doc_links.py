"""Every relative link in README.md and docs/*.md resolves: to a file of this repository and, with an
anchor, to a heading of that file, named as GitHub names it (lower case, punctuation dropped, spaces as
``-``, a repeated heading ``-1``, ``-2``…). Pages move and headings get reworded; a link that fell behind
fails here rather than on the reader.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# the repository root, wherever under tests/ this file lives
REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target), the target up to a space (a title may follow) or the closing paren
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # https:, mailto:, …


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _heading_text(raw: str) -> str:
    """A heading as rendered: code spans keep their text, links their label, emphasis marks go."""
    text = INLINE_CODE.sub(lambda m: m.group(2), raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"(\*\*|__|\*|~~)", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text, before duplicates are numbered."""
    return re.sub(r"[^\w\- ]", "", _heading_text(heading).strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    names: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(path.read_text()):
        names.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        names.add(base if n == 0 else f"{base}-{n}")
    return names


def links(path: Path) -> list[str]:
    found = []
    for line in _prose(path.read_text()):
        m = REFERENCE.match(line)
        if m:
            found.append(m.group(1))
        found.extend(LINK.findall(INLINE_CODE.sub("", line)))
    return found


def broken(path: Path) -> list[str]:
    """The page's relative links that name no file, or no heading of their file."""
    bad = []
    for target in links(path):
        if not target or EXTERNAL.match(target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or REPO not in dest.parents:
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no such heading in {dest.relative_to(REPO)}")
    return bad


def test_slugs_follow_github() -> None:
    assert slug("Configuration (`canaryd.toml`)") == "configuration-canarydtoml"
    assert slug("Two runs, diffed: `canaryd diff`") == "two-runs-diffed-canaryd-diff"
    assert slug("What is recorded, and how it is judged") == "what-is-recorded-and-how-it-is-judged"
    assert slug("**Bold** and [a link](x.md) with_underscore") == "bold-and-a-link-with_underscore"
    assert slug("CanarydFingerprintChurn") == "canarydfingerprintchurn"


def test_duplicate_headings_are_numbered(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Notes\n\n## Notes\n\n```\n# not a heading\n```\n\n## Notes\n")
    assert anchors(page) == {"notes", "notes-1", "notes-2"}


def test_a_link_that_fell_behind_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Kept\n")
    page = tmp_path / "README.md"
    page.write_text(
        "See [a](docs/a.md#kept), [gone](docs/a.md#moved), [b](docs/b.md), [web](https://example.org/x#y),\n"
        "`[code](nowhere.md)` and [here](#see).\n\n## See\n\n```\n[fenced](nowhere.md)\n```\n"
    )
    assert broken(page) == ["docs/a.md#moved: no such heading in docs/a.md", "docs/b.md: no such file"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    assert links(page) or page.name != "README.md", "README.md links to its pages"
    assert not broken(page), f"{page.relative_to(REPO)}: broken links"
