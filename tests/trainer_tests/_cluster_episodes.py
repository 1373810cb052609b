"""What the multi-node tests' rollout workers run (not a test module): each function is awaited
in a :class:`relax_glue.placement.RolloutWorker` actor on a rollout node, given its session
manager. Typed errors come back as ``{"error": code}`` (a Ray task error would wrap them), every
other answer as plain data. Imported by the workers from the test tree (the cluster's
``PYTHONPATH``)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from typing import Any

from lora_contract.errors import LoraVersionError
from relax_glue.actor import AsyncRegistryClient, RegistryUnavailable
from relax_glue.sessions import SessionManager


def _greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def _session(mgr: SessionManager, nonce: str) -> Any:
    (session,) = [s for key, s in mgr.sessions.items() if key.nonce == nonce]
    return session


async def first_turns(mgr: SessionManager, names: Sequence[str], prompt: Sequence[int], n: int) -> list[dict]:
    """Open one session per name and run its first turn (it binds there): mid-episode from here."""
    out = []
    for name in names:
        session = await mgr.open(name)
        reply = await session.generate({"input_ids": list(prompt), "sampling_params": _greedy(n)})
        nonce, lora_path = session.key.nonce, session.lora_path
        out.append({"nonce": nonce, "lora_path": lora_path, "output_ids": reply["output_ids"]})
    return out


async def next_turn(mgr: SessionManager, nonce: str, input_ids: Sequence[int], n: int) -> dict:
    """One more turn of an open session, or the typed error that refused it."""
    session = _session(mgr, nonce)
    try:
        reply = await session.generate({"input_ids": list(input_ids), "sampling_params": _greedy(n)})
    except (LoraVersionError, RegistryUnavailable) as err:
        return {"error": err.code.value, "phase": session.phase.value, "in_flight": len(session.in_flight)}
    return {"lora_path": session.lora_path, "output_ids": reply["output_ids"], "phase": session.phase.value}


async def close(mgr: SessionManager, nonce: str) -> dict:
    session = _session(mgr, nonce)
    try:
        view = await session.close()
    except (LoraVersionError, RegistryUnavailable) as err:
        return {"error": err.code.value}
    return {"state": view.state.value, "released": view.released}


async def open_and_bind(mgr: SessionManager, name: str, prompt: Sequence[int], n: int) -> dict:
    """A new session's first turn, or the typed error that refused it."""
    try:
        (bound,) = await first_turns(mgr, [name], prompt, n)
    except (LoraVersionError, RegistryUnavailable) as err:
        return {"error": err.code.value}
    return bound


async def environment(mgr: SessionManager) -> dict[str, str | None]:
    """What the worker's process was given to reach Ray."""
    return {k: os.environ.get(k) for k in ("HOME", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}


def cut_off_while(flag: str) -> Callable[[AsyncRegistryClient], AsyncRegistryClient]:
    """A fault on the worker's REAL registry client: while the file ``flag`` exists every call
    it makes hangs before it leaves (a cut link: no answer, no error); the rest pass through."""

    def wrap(client: AsyncRegistryClient) -> AsyncRegistryClient:
        real_call = client._acall

        async def call(op: str, kwargs: dict[str, Any]) -> Any:
            while os.path.exists(flag):
                await asyncio.sleep(0.05)
            return await real_call(op, kwargs)

        client._acall = call  # type: ignore[method-assign]
        return client

    return wrap
