"""The plugin's log lines stay whole when several processes share one log (a TP engine's ranks).

Each rank of a TP engine is its own process writing to the engine's one stderr. ``print`` writes
the text and its newline in two calls, so another rank's line could land between them: seen in CI
as two ranks' step-fence lines glued on one line, which hid rank 0's line from every reader that
reads the log line by line (tests/plugin_tests/test_tp_engines.py). One write of the whole line,
newline included, is one write to the shared file.
"""

from __future__ import annotations

import sys

from sglang_ext import plugin_log


class Recording:
    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        return None


def test_a_log_line_is_one_write_with_its_newline(monkeypatch) -> None:
    stderr = Recording()
    monkeypatch.setattr(sys, "stderr", stderr)
    plugin_log.log_line("step fence lora_id=L tp_rank=1")
    assert stderr.writes == ["[lora-versions] step fence lora_id=L tp_rank=1\n"]
