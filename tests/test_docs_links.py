"""Every relative link in the README, docs/, examples/ and the changelog resolves to a file or
folder inside the repository, and every `#anchor` to a heading of its target, with GitHub's
heading ids. Markdown is parsed by markdown-it (CommonMark + tables), so a link inside a code
span or a fenced block is not a link."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
MD = MarkdownIt("commonmark").enable("table")


def documents() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted(p for p in (ROOT / "examples").glob("*") if p.is_file())
    return files


def github_slug(text: str) -> str:
    """GitHub's heading id (github-slugger): lower case, punctuation and symbols dropped except
    '-' and '_', each space a '-'. `Adaptive k, the build's plan` -> `adaptive-k-the-builds-plan`."""
    return "".join(c for c in text.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """The ids GitHub gives the headings of a Markdown file (a repeated heading gets -1, -2, ...)."""
    tokens = MD.parse(doc.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type != "heading_open":
            continue
        text = "".join(t.content for t in inline.children if t.type in ("text", "code_inline"))
        slug = github_slug(text)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(doc: Path) -> list[str]:
    """The targets of the Markdown links and images in `doc` (for a file that is not Markdown,
    e.g. an example script, the Markdown-style links in its text)."""
    text = doc.read_text(encoding="utf-8")
    if doc.suffix != ".md":
        return re.findall(r"\[[^\]\n]*\]\(([^)\s]+)\)", text)
    out = []
    for block in MD.parse(text):
        for t in block.children or ():             # links live in inline tokens, in order
            if t.type == "link_open":
                out.append(t.attrGet("href"))
            elif t.type == "image":
                out.append(t.attrGet("src"))
    return out


def problems(doc: Path, root: Path = ROOT) -> list[str]:
    found = []
    for href in links(doc):
        url = urlsplit(href)
        if url.scheme or url.netloc:            # http(s), mailto: not checked here
            continue
        target = doc if not url.path else (doc.parent / unquote(url.path)).resolve()
        if not target.is_relative_to(root):
            found.append(f"{href}: outside the repository")
        elif not target.exists():
            found.append(f"{href}: no such file")
        elif url.fragment:
            if target.is_dir() or target.suffix != ".md":
                found.append(f"{href}: an anchor into a file that is not Markdown")
            elif unquote(url.fragment) not in anchors(target):
                found.append(f"{href}: no heading with that id in {target.relative_to(root)}")
    return found


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    assert problems(doc) == []


def test_the_readme_links_every_page_of_docs():
    linked = {(ROOT / urlsplit(h).path).resolve() for h in links(ROOT / "README.md") if not urlsplit(h).scheme}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set()


def test_the_checker_finds_what_is_wrong(tmp_path):
    """A broken link, a link out of the repository, a wrong anchor and a link in a code span
    (which is not a link): the checker reports exactly the first three."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Adaptive k, the build's plan\n\n## Same\n\n## Same\n")
    doc = tmp_path / "docs" / "a.md"
    doc.write_text("[ok](b.md#adaptive-k-the-builds-plan) [ok2](b.md#same-1) [x](missing.md) "
                   "[y](../../etc/passwd) [z](b.md#nope) `[code](missing2.md)` [web](https://example.com/x)\n\n"
                   "| a | [cell](c.md) |\n|---|---|\n")
    assert problems(doc, root=tmp_path) == ["missing.md: no such file", "../../etc/passwd: outside the repository",
                             "b.md#nope: no heading with that id in docs/b.md", "c.md: no such file"]
