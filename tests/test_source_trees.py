"""The test-side parser (tests/_source_trees.py) survives what failed CI: a collection inside a
parse whose finalizer lets the GIL go to a thread that parses too (CPython 3.11.7, gh-106905).
With plain ``ast.parse`` in place of ``parse_text`` every try of this scenario fails here."""

from __future__ import annotations

import ast
import contextlib
import gc
import threading
import time
from pathlib import Path

from _source_trees import parse_text

SOURCE = (Path(__file__).resolve().parents[1] / "relax_glue" / "actor.py").read_text()
OTHER = "x = (1, (2, (3, (4, (5,)))))\n" * 50


class _LetsTheGilGo:
    """Cyclic garbage whose finalizer releases the GIL, as a closed socket's does."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        time.sleep(0)


def test_a_parse_survives_a_collection_that_hands_the_gil_to_another_parser() -> None:
    stop = threading.Event()

    def parse_elsewhere() -> None:
        while not stop.is_set():
            with contextlib.suppress(SystemError):  # that thread's parse is not under test
                ast.parse(OTHER)

    threshold = gc.get_threshold()
    gc.set_threshold(50)
    other = threading.Thread(target=parse_elsewhere, daemon=True)
    other.start()
    try:
        for _ in range(20):
            for _ in range(20):
                _LetsTheGilGo()
            assert parse_text(SOURCE).body
    finally:
        stop.set()
        other.join()
        gc.set_threshold(*threshold)
        gc.collect()
