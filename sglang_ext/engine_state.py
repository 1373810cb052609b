"""This engine's managed-version state, held in the engine's main process.

One instance per process (:func:`engine_state`). The incarnation is a fresh id at each plugin
start: every receipt carries it, so a READY from before a restart can be told apart.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from sglang_ext.protocol import EngineStatus, VersionStatus
from sglang_ext.setup_checks import MANAGED_CAPACITY


@dataclass
class EngineState:
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)
    versions: dict[str, VersionStatus] = field(default_factory=dict)

    def status(self) -> EngineStatus:
        return EngineStatus(
            incarnation=self.incarnation,
            versions=tuple(self.versions[name] for name in sorted(self.versions)),
            managed_capacity=MANAGED_CAPACITY,
            server_time=time.time(),
        )


_STATE: EngineState | None = None


def engine_state() -> EngineState:
    global _STATE
    if _STATE is None:
        _STATE = EngineState()
    return _STATE
