"""RFC 7.3's path to the engines over a collective group: a version published with
``transport="collective"`` (the trainer's :class:`~relax_glue.collective_sender.CollectiveSender`
broadcasting each bucket's bytes to the engine's receiver, ``sglang_ext.collective_receiver``)
is served by sessions exactly as its clean baseline computes it.

The backend follows the device (``DeviceProfile.collective_backend``): NCCL on a GPU, gloo on CPU,
the same code otherwise (``lora_contract.collective_group``). NCCL refuses two ranks of one group
on the same GPU, and this test process is the trainer's rank: on a GPU host it publishes to E1
only, which runs on GPU 1 while this process's rank uses GPU 0, so it needs two GPUs (skipped
with that reason on one). Not run on a GPU here: no machine of ours has one.
"""

from __future__ import annotations

import pytest
from _acceptance import ACCEPTANCE_ADMIN_KEY, COHORT, TURN_TOKENS, Cohort, prompt

from relax_glue.bucket_transport import CollectiveTransport
from relax_glue.collective_sender import CollectiveSender
from relax_glue.engine_client import EngineClient
from relax_glue.publisher import PublishOutcome

pytestmark = pytest.mark.engine


def collective_cohort(profile) -> tuple[str, ...]:
    """The engines the collective publication goes to: both on CPU (gloo has no device); on a
    GPU host E1 alone, which ``DeviceProfile.engine_spec`` puts on GPU 1 (index 1 of the
    deployment), away from this process's NCCL rank on GPU 0."""
    if profile.device != "cuda":
        return COHORT
    if profile.gpus < 2:
        pytest.skip(
            "NCCL needs the trainer's rank (this process, GPU 0) and the engine's on different GPUs: "
            f"this host has {profile.gpus}"
        )
    return ("E1",)


async def test_a_version_published_over_the_collective_transport_serves_its_clean_baseline(
    deployment, acceptance_fixtures, profile, epsilon, report
) -> None:
    backend = report.fix("collective.backend", profile.collective_backend, "NCCL on a GPU, gloo on CPU")
    cohort = collective_cohort(profile)
    senders = {e: CollectiveSender(backend=backend) for e in cohort}
    clients = {
        e: EngineClient(
            e, deployment[e].url, admin_key=ACCEPTANCE_ADMIN_KEY, transport=CollectiveTransport(senders[e])
        )
        for e in cohort
    }
    try:
        async with Cohort(
            deployment, acceptance_fixtures, profile, cohort, epsilon=epsilon, clients=clients
        ) as c:
            published = await c.publish("A")
            assert published.outcome is PublishOutcome.PUBLISHED, published
            sessions = [await c.sm.open(f"coll{i}") for i in range(2 * len(cohort))]
            for i, s in enumerate(sessions):
                await c.episode(s, prompt(1200 + i), TURN_TOKENS)
            checks = [(t, await c.check(t)) for t in c.turns]
            report.add(
                "collective_transport",
                {
                    "backend": backend,
                    "engines": list(cohort),
                    "groups_connected": {e: s.connects for e, s in senders.items()},
                    "publication_s": round(published.duration_s, 3),
                    "phase_s": {k: round(v, 3) for k, v in published.phase_s.items()},
                    "turns_compared": len(checks),
                    "max_abs_logprob_delta": max(cmp.max_abs_delta for _, cmp in checks),
                    "turns_differing": [t.short() for t, cmp in checks if not cmp.ok],
                },
            )
            # The bytes went over each engine's group (a group per engine, connected at begin).
            assert all(s.connects >= 1 for s in senders.values()), {e: s.connects for e, s in senders.items()}
            assert {t.engine for t in c.turns} == set(cohort)
            assert all(cmp.ok for _, cmp in checks), [(t.short(), cmp) for t, cmp in checks if not cmp.ok]
            assert not c.forbidden()
    finally:
        for s in senders.values():
            s.close()
