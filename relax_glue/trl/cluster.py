"""Where the registry of a TRL run lives. One process: in-process. Several (``accelerate
launch``): the epoch's Ray actor, started by rank 0 and joined by the other ranks, on the Ray
cluster the configuration names (``ray_address`` and ``ray_auth_token``, given to every rank:
ranks on several hosts) or else on a local Ray cluster rank 0 starts (its address and a token
drawn for it reach the others in one broadcast over the ranks' own process group). No rank reads
a token from its home directory. At the end the ranks that joined leave first and the one that
started the cluster stops it last. Only rank 0's client carries the publisher token. ``ray`` is
imported only with several processes."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from relax_glue.trl.config import VersionsConfig
from relax_glue.trl.ranks import RankInfo, barrier, broadcast_from_main, leave_group

if TYPE_CHECKING:
    from relax_glue.actor import AsyncRegistryClient
    from relax_glue.registry import LoRAVersionRegistry

    Registry = LoRAVersionRegistry | AsyncRegistryClient

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RayRole:
    started: bool = False  # this process started Ray here (a local cluster, or its connection): leaves last
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
        handle, joined = _join_ray_registry(epoch, answer, config)
    from relax_glue.actor import AsyncRegistryClient  # lazy: it imports ray

    # only rank 0 publishes: its client alone carries the publisher token (never broadcast)
    return AsyncRegistryClient.for_actor(handle, publisher_token=token), RayRole(started, joined, used=True)


def _start_ray_registry(
    epoch: str, cohort: tuple[str, ...], config: VersionsConfig
) -> tuple[Any, bool, dict[str, str], str]:
    import ray

    from relax_glue.actor import new_publisher_token, start_registry_actor
    from relax_glue.placement import join_cluster, use_ray_auth

    # started: Ray was started here (a local cluster, or this process's connection to the
    # user's cluster), so this process leaves it last
    started, cluster_token = not ray.is_initialized(), ""
    if config.ray_address is not None:  # the user's cluster: every rank has its address and token
        join_cluster(config.ray_address, config.ray_auth_token)
    elif started:
        # a local Ray of the run's own, with token auth on a token drawn here (never a file's);
        # the other ranks get it in the broadcast, over the process group they already trust
        cluster_token = secrets.token_hex(32)
        use_ray_auth(cluster_token)
        ray.init(num_cpus=config.ray_num_cpus, include_dashboard=False, log_to_driver=False)
    # the handle is kept (by the client): a non-detached actor dies with its last handle
    token = new_publisher_token()
    handle = start_registry_actor(epoch, cohort, config.capacity, publisher_token=token)
    answer = {"address": ray.get_runtime_context().gcs_address, "token": cluster_token}
    return handle, started, answer, token


def _join_ray_registry(epoch: str, answer: Mapping[str, str], config: VersionsConfig) -> tuple[Any, bool]:
    import ray

    from relax_glue.actor import get_registry_actor
    from relax_glue.placement import join_cluster

    joined = not ray.is_initialized()
    if config.ray_address is not None:
        join_cluster(config.ray_address, config.ray_auth_token)
    elif answer["token"]:
        join_cluster(answer["address"], answer["token"])
    elif joined:  # rank 0 used a Ray its user started: join it as this process's settings say
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
    try:
        barrier(rank)
    except RuntimeError as exc:
        # a rank is gone (gloo: its connection closed): the error of the collective that met the
        # loss first is the one to surface, not this one; and no other survivor may be left
        # waiting on this rank, so it leaves the process group (its connections close)
        logger.warning("a rank is gone: leaving Ray and the process group without it: %s", exc)
        leave_group()
    if ray_role.started:
        ray.shutdown()
