"""What the profile benches share (bench/scheduler_profile.py, bench/decode_gap_profile.py): an
engine's processes by role, and py-spy's raw output read as stacks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import psutil

# SGLang titles its child processes sglang::<role>; the plugin's collective receiver runs as
# ``python -m sglang_ext.collective_receiver`` (only once a group is connected)
ROLES = ("scheduler", "detokenizer", "collective_receiver")


def engine_processes(name: str, pid: int) -> dict[str, psutil.Process]:
    """``"<name> main"`` (the engine's own process) and ``"<name> <role>"`` for each child."""
    out = {f"{name} main": psutil.Process(pid)}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:  # gone meanwhile
            continue
        for role in ROLES:
            if role in cmd:
                # a TP engine's schedulers are titled per rank (sglang::scheduler_TP0, _TP1, ...)
                rank = re.search(r"sglang::(scheduler_TP\d+)", cmd)
                out[f"{name} {rank[1] if rank else role}"] = child
    return out


def raw_stacks(raw: Path) -> Iterator[tuple[list[str], int]]:
    """Each line of py-spy's ``--format raw`` output: its frames (outermost first; with
    ``--threads`` the first names the thread) and its sample count."""
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)
