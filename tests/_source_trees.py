"""Parsing the project's own source in a test, safe beside threads that parse too.

CPython 3.11.7 (the interpreter the bootstrap finds here) keeps the AST constructor's recursion
depth in interpreter-wide state (python/cpython gh-106905, fixed in later releases): when the GIL
passes to another thread in the middle of one ``ast.parse`` (a finalizer that runs Python code
lets the eval loop hand it over) and that thread parses meanwhile, the first parse fails with a
spurious ``SystemError: AST constructor recursion depth mismatch``. CI saw it once, in a full run
where threads left by earlier tests were alive. A parse here holds the GIL: the switch interval
is raised for its few milliseconds, so no other thread's parse can interleave."""

from __future__ import annotations

import ast
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

# Long enough for the largest module's parse; short enough that a thread waiting for the GIL is
# never held up noticeably (it asks again after this long at the latest).
_HOLD_GIL_S = 1.0


@contextlib.contextmanager
def _holding_the_gil() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(_HOLD_GIL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def parse_text(source: str, filename: str = "<unknown>") -> ast.Module:
    with _holding_the_gil():
        return ast.parse(source, filename)


def parse_file(path: Path) -> ast.Module:
    return parse_text(path.read_text(), str(path))
