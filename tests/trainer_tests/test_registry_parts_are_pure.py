"""The registry's parts are pure: no module of the state machine imports a clock, randomness or
IO (the durable store replays the journal through the same code and must get the same state and
answers). Only the host's functions beside it may: ``stamp_now`` reads the host's clock (a
function-level import in relax_glue.registry), and the publisher token is drawn by ``secrets``
when a registry is opened, never inside a transition."""

from __future__ import annotations

import ast
from pathlib import Path

from _source_trees import parse_file

import relax_glue

PACKAGE = Path(relax_glue.__file__).parent
# The modules the state machine is made of (registry_ops, the client surfaces, is not one of them).
PARTS = (
    "registry",
    "registry_spec",
    "registry_rules",
    "registry_state",
    "registry_attempts",
    "registry_sessions",
    "registry_reclaim",
    "registry_types",
)
IMPURE = {
    "asyncio", "datetime", "os", "random", "ray", "socket", "sqlite3", "subprocess", "threading", "time",
    "uuid", "relax_glue.store", "relax_glue.actor",
}  # fmt: skip
# (module, import): the allowed exceptions, each said why in the module docstring above.
ALLOWED = {("registry", "time"), ("registry_rules", "secrets")}


def _imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """(top module name, imported at module level) of every import in ``tree``."""
    top_level = {id(node) for node in getattr(tree, "body", [])}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in top_level))
    return found


def test_no_part_of_the_registry_imports_a_clock_randomness_or_io() -> None:
    impure = []
    for part in PARTS:
        for name, _ in _imports(parse_file(PACKAGE / f"{part}.py")):
            root = name if name.startswith("relax_glue.") else name.split(".")[0]
            if (root in IMPURE or root == "secrets") and (part, root) not in ALLOWED:
                impure.append(f"{part}.py imports {name}")
    assert not impure, impure


def test_the_host_clock_is_read_only_inside_stamp_now() -> None:
    tree = parse_file(PACKAGE / "registry.py")
    assert ("time", True) not in _imports(tree)
    (stamp,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "stamp_now"]
    assert ("time", False) in _imports(stamp)
