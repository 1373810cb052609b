"""Teardown for runs that share engines (tests, the acceptance suite, benches): remove every
managed version a run created, through the engines' own protocol, never by restarting them."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Mapping

from lora_contract import protocol
from relax_glue.engine_client import EngineAPI


async def engine_versions(client: EngineAPI, marker: str = "") -> dict[str, protocol.VersionStatus]:
    status = await client.status()
    return {v.lora_name: v for v in status.versions if marker in v.lora_name}


async def live_versions(clients: Mapping[str, EngineAPI], marker: str = "") -> dict[str, list[str]]:
    """Per engine: managed versions (named with ``marker``) that still hold something."""
    out: dict[str, list[str]] = {}
    for eid, c in clients.items():
        out[eid] = sorted(n for n, v in (await engine_versions(c, marker)).items() if v.state.holds_slot)
    return out


async def purge(
    clients: Mapping[str, EngineAPI], marker: str, timeout_s: float = 60.0
) -> dict[str, list[str]]:
    """Remove every managed version whose name contains ``marker`` from the engines (cleanup for
    a candidate, reclaim for a loaded version). Returns what is still live afterwards (a caller
    asserts it is empty)."""
    S = protocol.EngineVersionState
    deadline = time.monotonic() + timeout_s
    for c in clients.values():
        while time.monotonic() < deadline:
            todo = [v for v in (await engine_versions(c, marker)).values() if v.state.holds_slot]
            if not todo:
                break
            for v in todo:
                with contextlib.suppress(Exception):
                    if v.state in (S.PREPARED, S.LOADING):
                        await c.cleanup(
                            protocol.CleanupRequest(lora_name=v.lora_name, attempt_token=v.attempt_token)
                        )
                    else:
                        rid = v.reclaim_id or f"teardown-{uuid.uuid4().hex[:12]}"
                        await c.reclaim(
                            protocol.ReclaimRequest(lora_name=v.lora_name, reclaim_id=rid, timeout_s=5.0)
                        )
            await asyncio.sleep(0.1)
    return {eid: names for eid, names in (await live_versions(clients, marker)).items() if names}
