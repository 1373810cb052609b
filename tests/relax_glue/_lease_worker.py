"""A rollout worker for the lease test: connects to the test's Ray cluster and registry actor,
opens two leased sessions, binds them with one real turn each, prints ``BOUND <lora_path>`` and
idles (its heartbeat renewing the leases) until the test SIGKILLs it."""

from __future__ import annotations

import asyncio
import json
import sys


async def main(epoch: str, urls: dict[str, str], ttl_s: float) -> None:
    from relax_glue.actor import AsyncRegistryClient, get_registry_actor
    from relax_glue.engine_client import EngineClient
    from relax_glue.sessions import SessionManager

    client = AsyncRegistryClient.for_actor(get_registry_actor(epoch))
    engines = {n: EngineClient(n, u) for n, u in urls.items()}
    mgr = SessionManager(client, engines, lease_ttl_s=ttl_s)
    for i in range(2):
        s = await mgr.open(f"worker{i}")
        await s.generate(
            {"input_ids": [302, 356, 417], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        )
    print("BOUND", s.lora_path, flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    import ray

    ray.init(address=sys.argv[1], log_to_driver=False)
    asyncio.run(main(sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])))
