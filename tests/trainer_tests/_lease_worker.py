"""A rollout worker for the lease tests: connects to the test's Ray cluster and registry actor and
opens leased sessions.

``idle`` (default): opens two sessions, binds them with one real turn each, prints
``BOUND <lora_path>`` and idles (its heartbeat renewing the leases) until the test SIGKILLs it.

``die-after-bind``: opens one session and starts a turn; the registry client is the real one,
its transport wrapped so that the moment the reply to ``bind_first`` has arrived (the ref is
taken) the worker prints ``BOUND`` and SIGKILLs itself. Only the worker lease the session was
opened on is left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any


def die_after_bind(client: Any) -> Any:
    """The real client's transport, wrapped: once the reply to the first ``bind_first`` has
    arrived (the registry took the ref), the process SIGKILLs itself."""
    real_call = client._acall

    async def call(op: str, kwargs: dict[str, Any]) -> Any:
        envelope = await real_call(op, kwargs)
        if op == "bind_first":
            print("BOUND", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return envelope

    client._acall = call
    return client


async def main(epoch: str, urls: dict[str, str], ttl_s: float, mode: str) -> None:
    from relax_glue.actor import AsyncRegistryClient, get_registry_actor
    from relax_glue.engine_client import EngineClient
    from relax_glue.sessions import SessionManager

    client = AsyncRegistryClient.for_actor(get_registry_actor(epoch))
    if mode == "die-after-bind":
        client = die_after_bind(client)
    engines = {n: EngineClient(n, u) for n, u in urls.items()}
    mgr = SessionManager(client, engines, lease_ttl_s=ttl_s)
    for i in range(1 if mode == "die-after-bind" else 2):
        s = await mgr.open(f"worker{i}")
        await s.generate(
            {"input_ids": [302, 356, 417], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        )
    print("BOUND", s.lora_path, flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    import ray

    ray.init(address=sys.argv[1], log_to_driver=False)
    mode = sys.argv[5] if len(sys.argv) > 5 else "idle"
    asyncio.run(main(sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4]), mode))
