"""Parsing the project's own source in a test, safe beside threads that parse too.

CPython 3.11.7 (the interpreter the bootstrap finds here) keeps the AST constructor's recursion
depth in interpreter-wide state (python/cpython gh-106905, fixed in later releases). A cyclic
garbage collection that starts inside one ``ast.parse`` runs finalizers; one that releases the GIL
(a socket or file closed, a sleep) lets another thread run, and if that thread parses meanwhile,
the first parse fails with a spurious ``SystemError: AST constructor recursion depth mismatch``.
CI met it twice in full runs, with threads left by earlier tests alive
(``tests/test_source_trees.py`` reproduces it in every try). A parse here runs with the collector
off: no finalizer runs inside it, so the GIL is never let go and no other parse interleaves."""

from __future__ import annotations

import ast
import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def _no_garbage_collection() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_text(source: str, filename: str = "<unknown>") -> ast.Module:
    with _no_garbage_collection():
        return ast.parse(source, filename)


def parse_file(path: Path) -> ast.Module:
    return parse_text(path.read_text(), str(path))
