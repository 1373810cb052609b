"""docs/layout.md names every module of the shipped packages, one line each, and nothing else: a
module added, moved or removed without its line in the page fails here, so the page a reader
finds their way by cannot drift from the tree (issue 37: it had missed every module the second
redesign created)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "layout.md"
PACKAGES = ("lora_contract", "sglang_ext", "relax_glue", "lora_versions_dev", "lora_versions_demo")

FENCE = "```"
# Inside a code block: a package's own line ("relax_glue/   ..."), then its modules, two spaces in,
# each by its path inside the package and a description ("  trl/callback.py   the TRL callback").
PACKAGE_LINE = re.compile(r"^([a-z_]+)/(?:\s|$)")
MODULE_LINE = re.compile(r"^  (\S+\.py)(?:\s{2,}(\S.*))?$")


def modules_in_tree() -> set[str]:
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def page_lines() -> list[tuple[str, str]]:
    """(module path from the root, its description) for every module line of the page's code blocks,
    in order; a module line under a package the page does not ship is not one."""
    entries: list[tuple[str, str]] = []
    in_block, package = False, None
    for line in PAGE.read_text().splitlines():
        if line.startswith(FENCE):
            in_block, package = not in_block, None
            continue
        if not in_block:
            continue
        if m := PACKAGE_LINE.match(line):
            package = m.group(1) if m.group(1) in PACKAGES else None
        elif package and (m := MODULE_LINE.match(line)):
            entries.append((f"{package}/{m.group(1)}", (m.group(2) or "").strip()))
    return entries


def test_every_module_of_the_shipped_packages_has_its_line() -> None:
    listed = {path for path, _ in page_lines()}
    missing = sorted(modules_in_tree() - listed)
    assert not missing, f"modules without their line in docs/layout.md: {missing}"


def test_every_line_names_a_module_that_exists() -> None:
    listed = {path for path, _ in page_lines()}
    stale = sorted(listed - modules_in_tree())
    assert not stale, f"docs/layout.md names modules that do not exist: {stale}"


def test_each_module_has_exactly_one_line_that_says_what_it_is() -> None:
    entries = page_lines()
    paths = [path for path, _ in entries]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    assert not twice, f"modules listed more than once in docs/layout.md: {twice}"
    bare = [path for path, description in entries if not description]
    assert not bare, f"module lines without a description in docs/layout.md: {bare}"
