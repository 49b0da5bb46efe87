"""Links between the repository's docs land on a heading that exists (as GitHub renders it):
a rewritten doc, such as docs/benchmarks.md, keeps the anchors others link to."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(doc: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub makes them (repeats get -1, -2)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-")
            repeat = seen.get(slug, 0)
            seen[slug] = repeat + 1
            found.add(slug if repeat == 0 else f"{slug}-{repeat}")
    return found


def links_to_headings() -> list[tuple[Path, str, Path, str]]:
    """(doc, link, target file, anchor) for every link to a heading of a doc in the repo."""
    found = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if anchor and file.suffix == ".md" and file.is_relative_to(ROOT):
                found.append((doc, target, file, anchor))
    return found


def test_anchors_follow_github() -> None:
    doc = ROOT / "docs" / "benchmarks.md"
    assert {
        "the-shield-in-front-of-a-separate-server-issue-22",
        "one-shared-fleet-issue-30",
        "type-through-issue-28",
    } <= anchors(doc)


def test_there_are_links_to_check() -> None:
    assert any(file.name == "benchmarks.md" for _, _, file, _ in links_to_headings())


@pytest.mark.parametrize(
    ("doc", "link", "file", "anchor"),
    [pytest.param(*found, id=f"{found[0].name}:{found[1]}") for found in links_to_headings()],
)
def test_link_lands_on_a_heading(doc: Path, link: str, file: Path, anchor: str) -> None:
    assert file.exists(), f"{doc.name}: {link} names a file that does not exist"
    assert anchor in anchors(file), f"{doc.name}: {link} names no heading of {file.name}"


def test_every_relative_link_names_a_file_of_the_repo() -> None:
    """A link out of the repository (../shared/...) is dead in a clone and on GitHub."""
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            path = target.partition("#")[0]
            if not path or "://" in path or path.startswith("mailto:"):
                continue
            # GitHub reads a leading / from the repository's root.
            file = (ROOT / path[1:] if path.startswith("/") else doc.parent / path).resolve()
            if not file.is_relative_to(ROOT) or not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken
