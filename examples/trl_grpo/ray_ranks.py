"""The example's training ranks as Ray actors, one per Ray node (issue 42): a run whose ranks sit
on several nodes of one cluster, every rank joining it for the registry actor with the address
and token of the spec (``VersionsConfig.ray_address`` / ``ray_auth_token``).

On several hosts the usual launch is ``accelerate launch --num_machines N`` on each host, each
rank joining the cluster from its own host. On one host Ray attaches every driver process to the
head node, so here each rank runs in an actor pinned to its node: it sets the environment that
``torchrun`` would (rank, world size, rendezvous address), then runs :func:`train_process`, and
the ranks form their gloo group between the nodes as accelerate's ranks do.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from typing import Any

from examples.trl_grpo.train import TrainSpec, train_process


class TrainRank:
    """One training rank (a Ray actor; :func:`launch_on_nodes` places it)."""

    def __init__(self, rank: int, world_size: int, master_port: int) -> None:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK="0",  # the only rank on its node
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port),
            OMP_NUM_THREADS="1",
            TRL_EXPERIMENTAL_SILENCE="1",
            TOKENIZERS_PARALLELISM="false",
        )

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def train(self, spec: dict[str, Any]) -> dict[str, Any]:
        report = train_process(TrainSpec(**spec))
        return {**report, "node_id": self.node_id()}


@dataclasses.dataclass(frozen=True)
class RanksOnNodes:
    actors: list[Any]  # keep them: an actor lives while a handle of it does
    reports: list[Any]  # the ObjectRef of each rank's report, in rank order


def launch_on_nodes(spec: TrainSpec, nodes: Sequence[str]) -> RanksOnNodes:
    """One :class:`TrainRank` per node (rank i on ``nodes[i]``, pinned there), each training on
    ``spec``. The caller is connected to the cluster."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    remote = ray.remote(TrainRank)
    ranks = [
        remote.options(
            num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote(rank, len(nodes), port)
        for rank, node in enumerate(nodes)
    ]
    fields = dataclasses.asdict(spec)
    return RanksOnNodes(ranks, [r.train.remote(fields) for r in ranks])
