"""Every relative link in README.md and docs/*.md reaches an existing file,
and every ``#anchor`` a heading of that file (GitHub's heading slugs). Also:
the README stays a five-minute read, and shows ``make demo`` / ``make test``
before any other command. No process, no torch."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # the one-minute tier (make test-fast)

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str):
    """The lines outside fenced code blocks, with inline code removed."""
    fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped
    (letters, digits, ``_``, ``-`` and spaces kept), spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path):
    for line in _prose(path.read_text()):
        line = re.sub(r"`[^`]*`", "", line)
        yield from LINK.findall(line)


def test_relative_links_resolve():
    broken = []
    cache: dict[Path, set[str]] = {}
    for page in PAGES:
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_slug_matches_github():
    assert slug("Knobs (FSDP2's names wherever FSDP2 has the knob)") == \
        "knobs-fsdp2s-names-wherever-fsdp2-has-the-knob"
    assert slug("The tensor layout (`shard_granularity=\"tensor\"`)") == \
        "the-tensor-layout-shard_granularitytensor"
    assert slug("torch.compile") == "torchcompile"
    assert slug("Measured: one H200, torch 2.11.0+cu130, NCCL 2.28.9 (2026-11-27)") == \
        "measured-one-h200-torch-2110cu130-nccl-2289-2026-11-27"


def test_readme_is_short_and_shows_make_first():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    commands = [ln.split("#")[0].strip() for ln in first_block.strip().splitlines()]
    assert commands[:2] == ["make demo", "make test"], commands


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= listed, sorted(pages - listed)
