"""What a test reads of a process from ``/proc``: one parser for the fields the tests check."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def nice_of(pid: int, tid: int | None = None) -> int:
    """The nice value of process ``pid`` (or of its thread ``tid``): field 19 of its stat, read
    after the command name, which may hold spaces and parentheses."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    return int(stat.read_text().rsplit(")", 1)[1].split()[16])


def thread_nices(pid: int) -> dict[int, int]:
    """The nice value of each thread of process ``pid`` (a thread that ended meanwhile is left out)."""
    nices = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            nices[int(tid)] = nice_of(pid, int(tid))
    return nices
