"""The overlap scheduler: the test that would prove reclaim safe with it, on CUDA only.

SGLang has no overlap scheduler on CPU, so only a GPU can show (or rule out) the hazard of
gpu_tests/README.md, "The overlap scheduler": under overlap, a finished request's release can
reach the tokenizer while the next launched batch, still holding the finished request's row
(the overshoot of an EOS/stop finish), reads the adapter's slot on the GPU; an unload served
then zeroes a slot a launched step reads. The plugin refuses the overlap scheduler until this
test has passed on a GPU.

The engine here runs with the overlap scheduler under the plugin's proof switch
(``setup_checks.OVERLAP_PROOF_ENV``, CUDA only) and with the step-fence probe in its scheduler.
Each round publishes a new version while sessions of the previous one finish on a stop token
(the overshoot path) under steady traffic on the new one, and the previous version is reclaimed
at once. It passes only if every unload met a passed fence (the probe runs inside the plugin's
fence, :mod:`sglang_ext.step_fence`, right before the real unload), every version was unloaded
exactly once, every output equals its clean baseline, and the fence had to wait at least once: a
run in which no unload ever met a launched step on its adapter never opened the hazard's window,
so it would pass with no fence at all and proves nothing. The adapters' ranks (32 and 16, in a
rank-64 pool) are below the pool's maximum, so each unload's slot clear is the partial one
(``sglang_ext.slot_zeroing``). It has never run: no GPU here.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import pytest
from _acceptance import ACCEPTANCE_ADMIN_KEY, TOOL_IDS, Cohort, greedy, prompt
from engine_wrappers.step_fence_probe import probe_lines

from lora_versions_dev.engine_log import fence_records, unload_lines
from relax_glue.publisher import PublishOutcome
from relax_glue.sessions import Session
from sglang_ext.settings import OVERLAP_PROOF_ENV

pytestmark = pytest.mark.engine

PROBE_LAUNCHER = Path(__file__).resolve().parent / "engine_wrappers" / "sglang_with_step_fence_probe.py"
ROUNDS = 20
STEADY = 16  # sessions of the new version keeping batches running while the old one drains
FINISHING = 4  # sessions of the old version that end on a stop token (the overshoot path)
STEADY_TOKENS = 96


async def test_reclaim_under_a_running_overlap_batch_never_frees_a_slot_a_launched_step_reads(
    profile, acceptance_fixtures, deployment, report_dir, report
) -> None:
    if profile.device != "cuda":
        pytest.skip(
            f"needs CUDA (this run: {profile.device}): SGLang has no overlap scheduler on CPU, so only "
            "a GPU can show or rule out the deferred-free hazard; the plugin refuses overlap meanwhile"
        )
    from lora_versions_dev.launcher import running_engines

    spec = profile.engine_spec(
        "E_overlap",
        acceptance_fixtures.model_dir,
        report_dir / "E_overlap.log",
        extra_args=["--admin-api-key", ACCEPTANCE_ADMIN_KEY],
        env={OVERLAP_PROOF_ENV: "1"},
        command_prefix=[sys.executable, str(PROBE_LAUNCHER)],
        overlap_schedule=True,
    )
    rng = random.Random(7)
    with running_engines([spec]) as (engine,):
        engines = {"E_overlap": engine, "base_A": deployment["base_A"], "base_B": deployment["base_B"]}
        async with Cohort(engines, acceptance_fixtures, profile, cohort=("E_overlap",)) as c:
            wrong: list[dict] = []
            unloaded: dict[str, str] = {}  # lora_name -> engine-local lora_id
            previous: list[Session] = []
            prev_name: str | None = None

            async def steady(s: Session, seed: int, adapter: str) -> None:
                out = await s.generate({"input_ids": prompt(seed), "sampling_params": greedy(STEADY_TOKENS)})
                ref = await c.baselines.generate(adapter, prompt(seed), STEADY_TOKENS)
                if out["output_ids"] != ref["output_ids"]:
                    wrong.append({"session": s.name, "adapter": adapter})

            async def finish_on_stop(s: Session, seed: int, adapter: str) -> None:
                """A last turn that ends on a stop token (EOS-like), then the session closes."""
                prefix = [*prompt(seed), *TOOL_IDS]
                free = await c.baselines.generate(adapter, prefix, 16, {"ignore_eos": False})
                stop = free["output_ids"][rng.randrange(2, 10)]
                params = {"temperature": 0, "max_new_tokens": 16, "stop_token_ids": [stop]}
                out = await s.generate({"input_ids": prefix, "sampling_params": params})
                ref = await c.baselines.generate(
                    adapter, prefix, 16, {"ignore_eos": False, "stop_token_ids": [stop]}
                )
                if out["output_ids"] != ref["output_ids"]:
                    wrong.append({"session": s.name, "adapter": adapter, "stop": stop})
                await s.close()

            for k in range(ROUNDS):
                adapter = "AB"[k % 2]
                result = await c.publish(adapter, f"{adapter}{k}")
                assert result.outcome is PublishOutcome.PUBLISHED, result
                name = c.name_of[adapter]
                fresh = [await c.sm.open(f"r{k}s{i}") for i in range(STEADY)]
                load = [asyncio.create_task(steady(s, 100 * k + i, adapter)) for i, s in enumerate(fresh)]
                if prev_name is not None:
                    old = c.adapter_of[prev_name]
                    status = await c.clients["E_overlap"].status()
                    unloaded[prev_name] = next(v.lora_id for v in status.versions if v.lora_name == prev_name)
                    finishing = asyncio.gather(
                        *(finish_on_stop(s, 5000 + 10 * k + i, old) for i, s in enumerate(previous))
                    )
                    # Reclaim runs while the last requests finish, not after: the unload should
                    # reach the scheduler within the step after the last release (the window in
                    # which the overshoot row is still launched), which is what the fence is for.
                    deadline = time.monotonic() + 120
                    while prev_name in (await c.live())["E_overlap"]:
                        assert time.monotonic() < deadline, f"{prev_name} was never reclaimed"
                        if finishing.done() and finishing.exception() is not None:
                            await finishing  # a finishing session failed: raise it
                        await c.publisher.reclaim_ready()
                        await asyncio.sleep(0.005)
                    await finishing
                await asyncio.gather(*load)
                previous = fresh[:FINISHING]
                for s in fresh[FINISHING:]:
                    await s.close()
                prev_name = name

            log = engine.log_path.read_text(errors="replace")
            probes = {n: probe_lines(log, lid) for n, lid in unloaded.items()}
            fences = [f for lid in unloaded.values() for f in fence_records(engine.log_path, lid)]
            unloads = {n: unload_lines(engine.log_path, lid) for n, lid in unloaded.items()}
            violations = [(n, p) for n, ps in probes.items() for p in ps if p["fence_passed"] != "True"]
            waited = sum(1 for f in fences if f["waited"] != "0")
            report.add(
                "overlap_scheduler_proof",
                {
                    "rounds": ROUNDS,
                    "versions_reclaimed": len(unloaded),
                    "fence_violations": len(violations),
                    "unloads_the_fence_waited_for": waited,
                    "fence_records": len(fences),
                    "outputs_differing_from_baseline": len(wrong),
                    "unloads_not_exactly_once": {n: u for n, u in unloads.items() if u != 1},
                },
            )
            assert all(p["overlap"] == "True" for ps in probes.values() for p in ps), "overlap was not on"
            assert not violations, f"unloads served while a launched step read the slot: {violations[:3]}"
            assert all(u == 1 for u in unloads.values()), unloads
            assert not wrong, wrong[:3]
            assert len(fences) == len(unloaded), ("an unload without its fence record", len(fences), unloaded)
            assert waited >= 1, (
                "the fence never waited: no unload met a launched step on its adapter, so this run did "
                "not exercise the overlap hazard (more rounds, steady streams or earlier reclaims needed)"
            )
