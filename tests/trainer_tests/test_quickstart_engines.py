"""The README's "Use it with your trainer" block, executed exactly as written against real CPU
engines. First: a PEFT model is published after each "training step" (the third publication
meets CAPACITY_ERROR and the block's reclaim-then-retry path), agent episodes bind and close.
Then the faults its defaults are there for: the process running the block is SIGKILLed in the
middle of an episode, an engine of the cohort is SIGKILLed and restarted, and the block runs
again in a new process (this one) on the same epoch and state directory."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from _e2e_helpers import PROMPTS, TOOL_IDS, aclose_all, begins_for, failed_generations, purge
from _quickstart import a_training_step, peft_model, run_quickstart

from lora_contract import protocol
from lora_versions_dev.farm import ADMIN_KEY
from relax_glue.registry_types import SessionState, VersionKey, VersionState

pytestmark = pytest.mark.engine

WORKER = Path(__file__).with_name("_quickstart_worker.py")
LEASE_TTL_S = 3.0


def quickstart_env(monkeypatch, engines: dict[str, Any], state_dir: Path, epoch: str) -> dict[str, str]:
    env = {
        "LORA_VERSIONS_ENGINES": ",".join(f"{eid}={e.url}" for eid, e in engines.items()),
        "LORA_VERSIONS_ADMIN_KEY": ADMIN_KEY,
        "LORA_VERSIONS_EPOCH": epoch,
        "LORA_VERSIONS_STATE_DIR": str(state_dir),
        "LORA_VERSIONS_LEASE_TTL_S": str(LEASE_TTL_S),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


async def close_quickstart(ns: dict[str, Any], marker: str) -> dict:
    left = await purge(ns["clients"], marker)
    await aclose_all(ns["clients"].values())
    await ns["sessions"].aclose()
    ns["registry"].close()
    ns["durable"].close()
    return left


@pytest.fixture(scope="module", autouse=True)
def _spare_boots_early(request):
    """The session's spare engine (conftest.py), the one the restart test SIGKILLs: spawned when
    this module starts (if it is not up already), so it boots while the first test runs."""
    if any(item.name == RESTART_TEST for item in request.session.items):
        request.getfixturevalue("spare_engine")


async def test_the_readme_quickstart_runs_as_written(engines, fixtures, monkeypatch, tmp_path) -> None:
    epoch = f"qs{uuid.uuid4().hex[:6]}"
    quickstart_env(monkeypatch, {"E0": engines[0], "E1": engines[1]}, tmp_path, epoch)
    ns = run_quickstart()  # exactly the README's code
    registry = ns["registry"]
    model = peft_model(fixtures.model_dir, fixtures.adapter_dir("A"))
    try:
        first = await ns["after_training_step"](model, 1)
        assert first.published, first
        episodes = await asyncio.gather(*(ns["rollout"](list(p), list(TOOL_IDS)) for p in PROMPTS))
        assert all(0 < len(e) <= 32 for e in episodes), episodes  # two sampled turns each

        a_training_step(model)
        second = await ns["after_training_step"](model, 2)
        assert second.published and second.lora_name != first.lora_name
        # step1 is retired and unreferenced but still holds its slot (both K = 2 slots held): the
        # step publisher reclaims it before it publishes step3
        a_training_step(model)
        third = await ns["after_training_step"](model, 3)
        assert third.published, third
        states = {v.version_key.version_id: v.state for v in (await registry.status()).versions}
        assert states == {
            "step1": VersionState.RECLAIMED,
            "step2": VersionState.RETIRED,
            "step3": VersionState.PUBLISHED,
        }
        assert (await registry.version(version_key=VersionKey(epoch, "step1"))).session_refs == 0
        await ns["rollout"](list(PROMPTS[0]), list(TOOL_IDS))
        assert (await registry.status()).sessions["CLOSED"] == len(PROMPTS) + 1  # every episode released once
        # the store kept exactly the live versions' snapshots, on disk
        live = [await registry.version(version_key=VersionKey(epoch, v)) for v in ("step2", "step3")]
        assert ns["publisher"].store.digests() == {v.digest for v in live}
    finally:
        left = await close_quickstart(ns, f"@{epoch}-")
        assert not any(left.values()), left


RESTART_TEST = "test_the_quickstart_survives_a_worker_killed_mid_episode_and_an_engine_restart"


async def test_the_quickstart_survives_a_worker_killed_mid_episode_and_an_engine_restart(
    engines, fixtures, monkeypatch, tmp_path, spare_engine
) -> None:
    from lora_versions_dev.launcher import spawn_engine

    eq = await asyncio.to_thread(spare_engine.take)
    epoch = f"qs{uuid.uuid4().hex[:6]}"
    env = quickstart_env(monkeypatch, {"E0": engines[0], "EQ": eq}, tmp_path, epoch)

    # 1. The process running the quickstart publishes step1, binds an episode and dies in its tool call.
    worker = subprocess.Popen(
        [
            sys.executable,
            str(WORKER),
            str(fixtures.model_dir),
            str(fixtures.adapter_dir("A")),
            ",".join(map(str, PROMPTS[0])),
        ],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(worker.stdout.readline), 300)
        assert line.startswith("BOUND "), line
        step1_name = line.split()[1]
    finally:
        os.killpg(worker.pid, signal.SIGKILL)  # no close, no goodbye: only its lease is left
        await asyncio.to_thread(worker.wait, 30)

    # 2. An engine of the cohort is SIGKILLed and started again on its port: it holds nothing.
    os.killpg(eq.proc.pid, signal.SIGKILL)
    await asyncio.to_thread(eq.proc.wait, 60)
    eq = await asyncio.to_thread(spawn_engine, spare_engine.spec(eq.port, "-restarted"))
    spare_engine.engine = eq  # the fixture stops whichever process runs now
    await asyncio.to_thread(eq.wait_healthy, 300.0)

    # 3. The quickstart starts again (the same epoch and state directory): registry, store and
    #    the dead process's session are as they were.
    ns = run_quickstart()
    registry = ns["registry"]
    try:
        st = await registry.status()
        assert st.default_lora_name == step1_name
        # reopened as it was: the dead process's episode still OPEN, holding step1 by its lease
        dead = [s for s in await registry.sessions() if s.binding is not None]
        assert len(dead) == 1 and dead[0].state is SessionState.OPEN and dead[0].lease_id is not None
        eq_client = ns["clients"]["EQ"]
        assert not [v for v in (await eq_client.status()).versions if f"@{epoch}-" in v.lora_name]

        # Episodes of the new process bind step1; those routed to EQ meet the loss and restore it.
        episodes = await asyncio.gather(*(ns["rollout"](list(p), list(TOOL_IDS)) for p in PROMPTS))
        assert all(0 < len(e) <= 32 for e in episodes), episodes
        assert registry.reaping  # the client reaps leases from the first one granted through it
        on_eq = {v.lora_name: v for v in (await eq_client.status()).versions}
        restored = on_eq[step1_name]
        assert restored.state is protocol.EngineVersionState.READY_LOCAL
        assert restored.attempt_token.startswith("rst-")  # staged by the reconciler, from the store
        refused = [e for e in failed_generations([eq_client.audit]) if "UNKNOWN_VERSION" in e.outcome]
        assert refused, "no episode met the lost version on the restarted engine"
        assert begins_for([eq_client], step1_name), "step1 was staged onto the restarted engine"

        model = peft_model(fixtures.model_dir, fixtures.adapter_dir("A"))
        a_training_step(model)
        step2 = await ns["after_training_step"](model, 2)
        assert step2.published, step2

        # The dead process's session is closed by its lease: step1 can go, step3 can come.
        t0 = time.monotonic()
        while (await registry.session(session_key=dead[0].session_key)).state is not SessionState.CLOSED:
            assert time.monotonic() - t0 < LEASE_TTL_S + 20, "the dead worker's session was never reaped"
            await asyncio.sleep(0.2)
        expired = await registry.session(session_key=dead[0].session_key)
        assert expired.expired and expired.released
        a_training_step(model)
        step3 = await ns["after_training_step"](model, 3)  # reclaims step1, then publishes
        assert step3.published, step3
        states = {v.version_key.version_id: v.state for v in (await registry.status()).versions}
        assert states == {
            "step1": VersionState.RECLAIMED,
            "step2": VersionState.RETIRED,
            "step3": VersionState.PUBLISHED,
        }
    finally:
        left = await close_quickstart(ns, f"@{epoch}-")
        assert not any(left.values()), left
