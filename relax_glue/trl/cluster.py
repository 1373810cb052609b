"""Where the registry of a TRL run lives. One process: in-process. Several (``accelerate
launch``): the epoch's Ray actor, started by rank 0 on a local Ray cluster of its own (its address
reaches the others in one broadcast) and joined by the other ranks; at the end the ranks that
joined leave first and the one that started the cluster stops it last. Only rank 0's client
carries the publisher token. ``ray`` is imported only with several processes."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from relax_glue.trl.config import VersionsConfig
from relax_glue.trl.ranks import RankInfo, barrier, broadcast_from_main

if TYPE_CHECKING:
    from relax_glue.actor import AsyncRegistryClient
    from relax_glue.registry import LoRAVersionRegistry

    Registry = LoRAVersionRegistry | AsyncRegistryClient

RAY_AUTH = "RAY_AUTH_MODE"  # how a process joins the Ray cluster rank 0 started


@dataclasses.dataclass(frozen=True)
class RayRole:
    started: bool = False  # this process started the local Ray cluster: it stops it, last
    joined: bool = False  # this process connected to it: it disconnects, first
    used: bool = False  # several processes share the Ray registry (every rank leaves together)


def join_registry(
    rank: RankInfo, epoch: str, cohort: tuple[str, ...], config: VersionsConfig
) -> tuple[Registry, RayRole]:
    """The run's registry (or its client) and what this process did with Ray."""
    if rank.world_size == 1:
        from relax_glue.registry import LoRAVersionRegistry  # lazy: the Ray path never needs it

        return LoRAVersionRegistry(epoch, cohort, capacity=config.capacity), RayRole()
    handle, started, joined, answer, token = None, False, False, {}, None
    if rank.is_main:
        try:
            handle, started, answer, token = _start_ray_registry(epoch, cohort, config)
        except Exception as exc:  # every rank learns it and raises: nobody waits for a registry
            answer = {"error": f"{type(exc).__name__}: {exc}"}
    answer = broadcast_from_main(answer, rank)
    if "error" in answer:
        raise RuntimeError(f"rank 0 could not start the registry actor: {answer['error']}")
    if not rank.is_main:
        handle, joined = _join_ray_registry(epoch, answer)
    from relax_glue.actor import AsyncRegistryClient  # lazy: it imports ray

    # only rank 0 publishes: its client alone carries the publisher token (never broadcast)
    return AsyncRegistryClient.for_actor(handle, publisher_token=token), RayRole(started, joined, used=True)


def _start_ray_registry(
    epoch: str, cohort: tuple[str, ...], config: VersionsConfig
) -> tuple[Any, bool, dict[str, str], str]:
    import ray

    from relax_glue.actor import new_publisher_token, start_registry_actor

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=config.ray_num_cpus, include_dashboard=False, log_to_driver=False)
    # the handle is kept (by the client): a non-detached actor dies with its last handle
    token = new_publisher_token()
    handle = start_registry_actor(epoch, cohort, config.capacity, publisher_token=token)
    # Ray turns token auth on for a new local cluster (RAY_AUTH_MODE in this process only): the
    # other ranks must join in the same mode (the token itself: ~/.ray/auth_token, one host)
    answer = {"address": ray.get_runtime_context().gcs_address, "auth": os.environ.get(RAY_AUTH, "")}
    return handle, started, answer, token


def _join_ray_registry(epoch: str, answer: Mapping[str, str]) -> tuple[Any, bool]:
    # Ray reads its auth mode when it is imported: set it first
    if answer["auth"]:
        os.environ.setdefault(RAY_AUTH, answer["auth"])
    import ray

    from relax_glue.actor import get_registry_actor

    joined = not ray.is_initialized()
    if joined:
        ray.init(address=answer["address"], log_to_driver=False)
    return get_registry_actor(epoch), joined


def leave_ray(rank: RankInfo, ray_role: RayRole) -> None:
    """The ranks that joined leave Ray first; the one that started the cluster stops it after a
    barrier. A Ray the user had started before is left as it was."""
    if not ray_role.used:
        return
    import ray

    if ray_role.joined:
        ray.shutdown()
    barrier(rank)
    if ray_role.started:
        ray.shutdown()
