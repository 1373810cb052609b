"""The README and every page of docs/ stay true to the tree and self-contained: every relative
link resolves (a file or folder that exists in the repository, and a heading that exists when it
names one), nothing points outside the repository (a user who clones it has nothing beside it),
and the README stays short enough to be read (at most 200 lines; details live in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...
# A path that leaves the repository the way the old docs did: ../shared/..., or the shared folder
# of the machine the project was written on.
OUTSIDE = re.compile(r"\.\./shared/|(?<![\w/.])shared/(?:seeds|docs)/")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a markdown file's headings: lower case, punctuation dropped, spaces to
    hyphens (code fences skipped: a '#' comment there is no heading)."""
    found, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^#{1,6} (.+)$", line)):
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


def links(path: Path) -> list[str]:
    """Every link target of a page outside its code blocks."""
    targets, in_code = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code:
            targets.extend(LINK.findall(line))
    return targets


def link_problem(page: Path, target: str) -> str | None:
    if EXTERNAL.match(target):
        return None
    rel, _, anchor = target.partition("#")
    path = (page.parent / rel).resolve() if rel else page
    if not path.is_relative_to(ROOT):
        return f"{target}: outside the repository"
    if not path.exists():
        return f"{target}: no such file or folder"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"{target}: no heading with that anchor in {path.name}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    problems = [p for target in links(page) if (p := link_problem(page, target))]
    assert not problems, problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_points_outside_the_repository(page: Path) -> None:
    outside = [
        f"{page.name}:{n}: {line.strip()[:100]}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not outside, outside


def test_the_readme_is_at_most_200_lines() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"
