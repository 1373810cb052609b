"""Engine choice per request: session-sticky round robin.

The router sees a session key and answers an engine id. It never sees the request body, so it
cannot change ``lora_path`` even by mistake (RFC 2: the router only passes ``lora_path`` through).
Stickiness keeps a session's turns on one engine, where its prefix is already in the KV cache.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Router", "StickyRoundRobinRouter"]


@runtime_checkable
class Router(Protocol):
    def pick(self, session_key: Hashable) -> str: ...
    def forget(self, session_key: Hashable) -> None: ...


class StickyRoundRobinRouter:
    """A new session gets the next engine in turn; every later request of it, the same one."""

    def __init__(self, engine_ids: Sequence[str]) -> None:
        if not engine_ids or len(set(engine_ids)) != len(engine_ids):
            raise ValueError(f"need distinct engine ids, got {list(engine_ids)}")
        self.engine_ids: tuple[str, ...] = tuple(engine_ids)
        self._next = 0
        self._assigned: dict[Hashable, str] = {}

    def pick(self, session_key: Hashable) -> str:
        engine = self._assigned.get(session_key)
        if engine is None:
            engine = self.engine_ids[self._next % len(self.engine_ids)]
            self._next += 1
            self._assigned[session_key] = engine
        return engine

    def forget(self, session_key: Hashable) -> None:
        self._assigned.pop(session_key, None)
