"""The docs' links hold: in README.md and every docs/*.md, every relative markdown link names a file that exists, and
every `#anchor` (in the page, or into another .md file) is the GitHub slug of a heading of the page it points at.
Pure text: nothing is imported but the standard library."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fenced = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if m := FENCE.match(line):
            fenced = None if fenced == m.group(1) else (fenced or m.group(1))
            continue
        if fenced is None:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's markdown: the rendered text (code spans, links and emphasis unwrapped),
    lower-cased, without punctuation but hyphens and underscores, each space a hyphen."""
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), heading)
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text).replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a page: its headings' slugs (a repeated one numbered -1, -2, ... as GitHub does) and HTML
    anchors."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose(page.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        if m := HEADING.match(line):
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in a page's prose, code spans left out."""
    out = []
    for number, line in prose(page.read_text(encoding="utf-8")):
        text = CODE_SPAN.sub("", line)
        out += [(number, target) for target in INLINE_LINK.findall(text)]
        if m := REFERENCE.match(text):
            out.append((number, m.group(1)))
    return out


def broken(page: Path) -> list[str]:
    """What is wrong with a page's relative links, one line each."""
    problems = []
    for number, target in links(page):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        file = (page.parent / unquote(path)).resolve() if path else page
        if not file.exists():
            problems.append(f"{where}: no such file")
        elif anchor and file.suffix == ".md" and unquote(anchor) not in anchors(file):
            problems.append(f"{where}: no heading of {file.relative_to(ROOT)} has the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    assert broken(page) == []


@pytest.mark.parametrize(("heading", "anchor"), [
    ("Integer products (`gguf`)", "integer-products-gguf"),
    ("float32-exact products (`gguf-exact`)", "float32-exact-products-gguf-exact"),
    ("Where a single stream's time goes", "where-a-single-streams-time-goes"),
    ("Scoring prompts: `echo` and `prompt_logprobs`", "scoring-prompts-echo-and-prompt_logprobs"),
    ("Several machines: a group of processes", "several-machines-a-group-of-processes"),
    ("[Mesh](mesh.md) and **more**", "mesh-and-more"),
])
def test_slugs_are_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_the_pages_have_links_to_check() -> None:
    assert len(PAGES) > 10 and all(links(p) for p in PAGES[:2])
