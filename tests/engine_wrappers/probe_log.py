"""One probe line to the engine's log, whole.

``print(text, file=sys.stderr)`` writes the text and its newline in two calls, so a line another
thread prints in between lands on the same line (the prepared-load probe's worker-thread record
was lost that way in CI, glued behind a scheduler-thread record). One write of the whole line,
newline included, is not split: the text layer writes it under the GIL in one call."""

from __future__ import annotations

import sys


def log_line(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
