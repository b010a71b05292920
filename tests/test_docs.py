"""The docs stay true to the code: generated blocks are fresh, the README is short and starts with
the two commands, and every relative link (and anchor) in README.md and docs/*.md resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


@pytest.mark.core
def test_generated_blocks_are_fresh() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_docs.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr + done.stdout


@pytest.mark.core
def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) < 16_000, f"README.md is {len(readme):,} bytes; move detail to docs/"
    lines = readme.decode().splitlines()
    assert lines[0].startswith("# ")
    block = lines[lines.index("```sh") : lines.index("```sh") + 4]
    assert lines.index("```sh") <= 2, "the README must open with the make commands"
    assert block[1].startswith("make train ") and block[2].startswith("make test "), block
    assert block[3] == "```", block


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    return LINK.findall(text)


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.core) if p.parent == ROOT else p for p in PAGES],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
