"""Every measured figure the docs show lives in one results file and reaches the page through a generated table.

- Each `<!-- bench:NAME -->` ... `<!-- /bench -->` block of README.md, docs/*.md and bench/README.md is exactly what
  `python -m bench.report` renders from the committed results; and every table it knows is shown on some page.
- Outside those blocks and outside code (fenced blocks and inline code spans: commands, flags, log lines), no line
  states a measured figure: a number followed by a unit of speed (anything per second: tokens/s, GB/s), time (ns, us,
  ms, s, seconds, minutes, hours), memory (B, KB, KiB, MB, MiB, GB, GiB, TB, bytes), or a ratio (2.5x, 40%). A
  hand-typed table whose header names such a unit fails the same way. A setting, a limit, a default or a fixed size
  is not a measurement: it stays in prose where SETTINGS lists its phrase (the figure with the words that make it a
  setting), and each phrase there must still occur on a page; a hand-typed table of sizes the code computes from a
  shape (the arena's bytes) says "computed" in its header, and its rows are not read.
- bench/README.md names every script under bench/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import report

ROOT = Path(__file__).resolve().parent.parent
PAGES = report.pages(ROOT)
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+).+?\1")
NUMBER = r"(?<![\w.,/])\d[\d,]*(?:\.\d+)?"
UNIT = (r"(?:\s?[A-Za-z]+/s\b"  # speed
        r"|\s?(?:ns|us|µs|ms)\b|\s(?:s|seconds?|minutes?|min|hours?|h)\b"  # time
        r"|\s?(?:[KMGT]i?B|bytes?)\b|\sB\b"  # memory
        r"|[x×](?!\w)|\s?%)")  # ratio
FIGURE = re.compile(NUMBER + UNIT)
HEADER_UNIT = re.compile(r"(?<![\w'-])(?:[A-Za-z]+/s|ns|us|ms|s|seconds|MiB|GiB|MB|GB|KiB|KB|bytes|%)(?![\w-])")
RULE = re.compile(r"^\|\s*:?-{3,}")  # a markdown table's second line
# Settings, limits, defaults and fixed sizes in prose: each phrase is the figure with the words that make it one.
SETTINGS = (
    # limits, timeouts and defaults
    "a limit of 600 s", "a budget of 12 minutes on 2 cores", "every 5 s of silence", "more than 5 s to", "3600 s",
    "over 256 KiB", "last 5 seconds with a chart", "at most 8 GiB", "1 MiB", "at most 64 writes and 1 GiB", "(60 s)",
    "silent for 10 s", "(30 s here)", "waited 2 s without work", "at most 8.5 s", "under ~10 GB",
    "under 10 minutes on one H100/H200",
    # Cloud Run's own
    "Cloud Run's 10 s", "kills at 10 s", "kills 10 s later", "= 240 s, Cloud Run's cap", "drains for 6 s",
    # fixed sizes: pages, buffers, a device's memory, the bandwidth probe
    "2 MiB pages", "4 KB pages", "each 2 MiB range", "15/16", "64 KiB or more", "a 128 KiB buffer", "8 MiB buffers",
    "an L4's 24 GB", "a 24 GB L4", "24 GB L4s", "a compiled reduction over 512 MiB",
    # targets a check holds a figure to
    "within 1% of", "at most 10% of its prompt tokens", ">= 75% of HBM", "<= 1.2x 1 lane", "<= 3x 1 lane",
    "<= 1.3x live 512", ">= 7x K=1",
)


def prose(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of every passage outside fenced code and outside `bench.report`'s blocks: each
    table line alone, and each paragraph's lines joined, so that a figure or a code span broken over two lines reads
    whole; code spans removed."""
    out: list[tuple[int, str]] = []
    fenced, block, paragraph = None, False, []

    def flush() -> None:
        if paragraph:
            out.append((paragraph[0][0], CODE_SPAN.sub("", " ".join(line.strip() for _, line in paragraph))))
            paragraph.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if m := FENCE.match(line):
            flush()
            fenced = None if fenced == m.group(1) else (fenced or m.group(1))
        elif line.startswith("<!-- bench:") or block or fenced is not None:
            flush()
            block = not line.startswith("<!-- /bench -->") and fenced is None
        elif line.startswith("|"):
            flush()
            out.append((number, CODE_SPAN.sub("", line)))
        elif not line.strip() or line.lstrip().startswith(("#", "- ", "* ")) or re.match(r"^\s*\d+\. ", line):
            flush()
            if line.strip():
                paragraph.append((number, line))
        else:
            paragraph.append((number, line))
    flush()
    return out


def figures(text: str) -> list[str]:
    """Each measured figure a page's prose states, as `line: figure`, settings' phrases left out."""
    found, computed = [], False
    passages = prose(text)
    for i, (number, line) in enumerate(passages):
        header = line.startswith("|") and i + 1 < len(passages) and RULE.match(passages[i + 1][1])
        if header:
            computed = "computed" in line
        if not line.startswith("|"):
            computed = False
        if computed:
            continue
        bare = line
        for phrase in SETTINGS:
            bare = bare.replace(phrase, " ")
        found += [f"{number}: {m.group(0)}" for m in FIGURE.finditer(bare)]
        if header and HEADER_UNIT.search(line):
            found.append(f"{number}: a hand-typed table of measured figures: {line.strip()}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_block_is_its_table_rendered_from_the_results(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert report.fill(text) == text, f"run `python -m bench.report`: {page.relative_to(ROOT)}'s tables differ"


def test_every_table_is_shown_on_a_page() -> None:
    shown = {m.group(2) for page in PAGES for m in report.BLOCK.finditer(page.read_text(encoding="utf-8"))}
    assert set(report.TABLES) <= shown, sorted(set(report.TABLES) - shown)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_states_no_measured_figure(page: Path) -> None:
    assert figures(page.read_text(encoding="utf-8")) == []


def test_each_setting_phrase_is_used() -> None:
    text = "\n".join(line for page in PAGES for _, line in prose(page.read_text(encoding="utf-8")))
    assert [p for p in SETTINGS if p not in text] == []


def test_the_map_lists_every_bench_script() -> None:
    listed = set(re.findall(r"`(?:python -m )?bench\.(\w+)", (ROOT / "bench" / "README.md").read_text()))
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"__init__"}
    assert scripts - listed == set() and listed - scripts == set()


@pytest.mark.parametrize(("line", "found"), [
    ("One stream makes 139.3 tokens/s.", ["1: 139.3 tokens/s"]),
    ("the station is 1.57x faster", ["1: 1.57x"]),
    ("a step takes 6.7 ms, 57% of its roofline", ["1: 6.7 ms", "1: 57%"]),
    ("1,240 MiB at ready, ready in 30-90 s", ["1: 1,240 MiB", "1: 90 s"]),
    ("| lanes | ms a step |\n| ---: | ---: |\n| 1 | 6.7 |", ["1: a hand-typed table of measured figures: "
                                                         "| lanes | ms a step |"]),
    ("8 lanes x 32,768 positions, 503s, Q4_K, 0x10, `--max-seq 2048`, `took 9 ms`", []),
    ("weights on 2 MiB pages", []),
    ("a step takes 6.7\nms, `--lanes\n8`", ["1: 6.7 ms"]),
    ("- a list item of 8\n  GiB\n- another item", ["1: 8 GiB"]),
    ("| dtype | bytes a lane, computed |\n| --- | ---: |\n| int8 | 38.3 MB |\n\nthen 38.3 MB", ["5: 38.3 MB"]),
    ("| model | the station's promises |\n| --- | --- |", []),
    ("<!-- bench:peers -->\n| a | b |\n| --- | --- |\n| 1.57x | 9 ms |\n<!-- /bench -->", []),
])
def test_the_rule(line: str, found: list[str]) -> None:
    assert figures(line) == found
