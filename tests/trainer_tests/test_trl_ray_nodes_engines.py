"""Issue 42: TRL's ``GRPOTrainer`` with its training ranks on several Ray nodes of one cluster
(lora_versions_dev.ray_cluster: four raylets on this host), the farm's engines through the smg
gateway. Each rank is an actor pinned to its node (examples/trl_grpo/ray_ranks.py; on one host
Ray attaches every driver to the head node); every rank joins the cluster with the address and
token the spec gives it (``VersionsConfig.ray_address`` / ``ray_auth_token``), rank 0 starts the
registry actor there and the others find it.

* Two ranks on two nodes: every check of the accelerate run holds (one outcome per step agreed
  by both ranks, every turn on its one bound version, rewards given that version, every retired
  version unloaded once per engine after its last session closed).
* Three ranks, the middle one's node lost: the other two end at once with the same error."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
import uuid
from pathlib import Path

import pytest
from _optional import optional_module

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # examples/ is run from the repository root, not installed
    sys.path.insert(0, str(REPO))

from _e2e_helpers import version_states, versions_on  # noqa: E402

from examples.trl_grpo import checks as ck  # noqa: E402
from examples.trl_grpo.ray_ranks import launch_on_nodes  # noqa: E402
from examples.trl_grpo.train import TrainSpec  # noqa: E402
from lora_versions_dev.farm import ADMIN_KEY  # noqa: E402
from lora_versions_dev.gateway_process import running_gateway  # noqa: E402
from lora_versions_dev.ray_cluster import LocalRayCluster  # noqa: E402
from relax_glue.actor import RegistryUnavailable  # noqa: E402

# Ray nodes and two training processes
pytestmark = [pytest.mark.engine, pytest.mark.room(gib=4.0)]

STEPS = 2
TIMEOUT_S = 420.0
TRAIN_ROLE = "lora_train"
HALF_PUBLISHED = ("PREPARED", "LOADING", "FAILED")  # engine states of a publication not settled


@pytest.fixture(scope="module")
def gateway(engines, run_dir):
    with running_gateway([e.url for e in engines], run_dir / "gateway-trl-ray.log") as gw:
        yield gw


@pytest.fixture(scope="module")
def cluster():
    optional_module("ray", "ray", "ray")
    with LocalRayCluster((TRAIN_ROLE,) * 3, python_path=(REPO,)) as c:
        yield c


def ray_run(engines, gateway, fixtures, cluster, out: Path, steps: int) -> TrainSpec:
    """The example's run on the farm's engines through smg, in background publication, every
    rank joining ``cluster`` with its address and token."""
    return TrainSpec(
        engines={e.name: e.url for e in engines},
        gateway_url=gateway.url,
        admin_key=ADMIN_KEY,
        model_dir=str(fixtures.model_dir),
        out_dir=str(out),
        epoch=f"trl{uuid.uuid4().hex[:6]}",
        steps=steps,
        background=True,
        ray_address=cluster.address,
        ray_auth_token=cluster.token,
    )


def test_two_training_ranks_on_two_ray_nodes_agree_on_every_outcome(
    engines, gateway, fixtures, cluster, tmp_path
):
    import ray

    spec = ray_run(engines, gateway, fixtures, cluster, tmp_path, STEPS)
    epoch = spec.epoch
    nodes = cluster.nodes(TRAIN_ROLE)[:2]
    try:
        run = launch_on_nodes(spec, nodes)
        reports = ray.get(run.reports, timeout=TIMEOUT_S)
        unloads = ck.count_unloads(reports, {e.name: e.log_path for e in engines})
        live = asyncio.run(versions_on(engines, f"@{epoch}-"))
    finally:
        left = asyncio.run(versions_on(engines, f"@{epoch}-", remove=True))
    assert not any(left.values()), left
    assert [r["node_id"] for r in reports] == nodes and len(set(nodes)) == 2
    assert [(r["rank"], r["world_size"]) for r in reports] == [(0, 2), (1, 2)]
    assert all(r["error"] is None for r in reports), [r["error"] for r in reports]
    outcomes = ck.main_report(reports)["outcomes"]
    cohort = [e.name for e in engines]
    failed = [
        c
        for c in [
            ck.ranks_agree(reports),
            ck.one_outcome_per_step(outcomes, STEPS, failures={}),
            ck.turns_on_one_version(reports),
            ck.rewards_received_versions(reports),
            ck.retired_unloaded_once(reports, unloads, cohort),
            ck.reclaimed_after_last_close(reports),
            ck.no_pause_flush_abort_all(reports),
        ]
        if not c.ok
    ]
    assert not failed, failed
    assert live == {e: [outcomes[STEPS]["lora_name"]] for e in cohort}, live
    by_rank = {r["rank"]: {c["session"] for c in r["completions"]} for r in reports}
    assert all(len(s) == STEPS * 4 for s in by_rank.values()) and not by_rank[0] & by_rank[1]



def test_a_training_rank_node_lost_ends_the_other_ranks_at_once_and_leaves_nothing_half_published(
    engines, gateway, fixtures, cluster, tmp_path
):
    """Three ranks on three nodes; rank 1's node is removed once step1 is published (six steps
    asked). Ranks 0 and 2 do not wait in a collective for a rank that is gone: each ends at once
    (far inside ``ddp_timeout``) with the same error, torch.distributed's of the first collective
    that met the loss, which the integration's leaving barrier does not mask. Nothing is left
    half published on any engine."""
    import ray

    from relax_glue.actor import AsyncRegistryClient

    spec = ray_run(engines, gateway, fixtures, cluster, tmp_path, steps=6)
    epoch = spec.epoch
    nodes = cluster.nodes(TRAIN_ROLE)
    try:
        run = launch_on_nodes(spec, nodes)
        registry = AsyncRegistryClient.for_named_actor(epoch)

        async def published(vid: str) -> bool:
            with contextlib.suppress(RegistryUnavailable):  # rank 0 has not started it yet
                status = await registry.status()
                return status.default is not None and status.default.version_id == vid
            return False

        deadline = time.monotonic() + TIMEOUT_S
        while not asyncio.run(published("step1")):
            assert time.monotonic() < deadline, "step1 was never published"
            time.sleep(0.2)
        cluster.remove(nodes[1])
        t_lost = time.monotonic()
        for rank in (0, 2):
            # ended, not timed out: a wait for the lost rank would last ddp_timeout (300 s)
            with pytest.raises(ray.exceptions.RayTaskError) as ended:
                ray.get(run.reports[rank], timeout=120)
            cause, trace = getattr(ended.value, "cause", ended.value), str(ended.value)
            ended_s = time.monotonic() - t_lost
            print(f"\n[rank lost] rank {rank} ended {ended_s:.1f}s after the node: {cause!r}")
            # torch.distributed's own error of the first collective that met the loss (TRL's, or
            # the integration's): not masked by the one the leaving rank's last barrier meets
            assert isinstance(cause, RuntimeError), trace
            assert re.search("Connection (closed|reset) by peer", str(cause)), trace
            assert "monitored_barrier" not in trace, trace
        states = asyncio.run(version_states(engines, f"@{epoch}-"))
        half = {e: [n for n, s in v.items() if s in HALF_PUBLISHED] for e, v in states.items()}
        assert not any(half.values()), states
    finally:
        left = asyncio.run(versions_on(engines, f"@{epoch}-", remove=True))
        cluster.add(TRAIN_ROLE)
    assert not any(left.values()), left
