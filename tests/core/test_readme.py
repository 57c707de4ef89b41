"""The README stays a five-minute read that sends readers into docs/: at most about 300
lines, and each of its relative links reaches a page of docs/ and, with an anchor, a heading
of that page. Anchors are slugged as mkdocs.yml slugs them (pymdownx's GitHub-style slugs),
so a link that works here works on GitHub and on the site; the site's own links are checked
by ``mkdocs build --strict``."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import repo_root
from pymdownx.slugs import slugify

SLUG = slugify(case="lower")
MAX_LINES = 300


def _headings(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks), as the site makes them."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    titles = re.findall(r"^#{1,6} (.+)$", text, re.M)
    return {SLUG(re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", t).replace("`", ""), "-")
            for t in titles}


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_the_readme_is_short():
    lines = (repo_root() / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_the_readme_links_reach_docs_pages_and_their_headings():
    root = repo_root()
    local = [link for link in _links((root / "README.md").read_text())
             if not link.startswith(("http://", "https://"))]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        path, _, anchor = link.partition("#")
        assert path.startswith("docs/") and ".." not in path, f"{link}: not a docs/ page"
        page = root / path
        assert page.is_file() and page.suffix == ".md", f"{link}: no such page"
        if anchor:
            assert anchor in _headings(page), f"{link}: no such heading in {path}"


def test_a_broken_anchor_is_caught():
    """The check can fail: a heading that is not there is not found."""
    page = repo_root() / "docs" / "accounting.md"
    assert "theorem-58" in _headings(page)
    assert "theorem-59" not in _headings(page)
