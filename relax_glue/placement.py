"""A run laid out over a Ray cluster of several nodes (issue 42): the registry actor on the node
that holds its database, rollout workers as Ray actors on the rollout nodes (each with its own
session manager and worker lease), the trainer wherever it runs; engines are reached over HTTP.

Nodes are found by the **custom resource** they were started with (``ray start --resources
'{"lora_registry": 1}'`` on the registry's host, ``'{"lora_rollout": 1}'`` on each rollout host),
never by address or by where a process happened to start, so the same code lays out one host
with several raylets and a real multi-host cluster.

Every process joins with an address and an auth token **passed to it** (:func:`join_cluster`):
nothing is read from the home directory. Ray's default token file (``~/.ray/auth_token``) is one
host's; on several hosts it would be whatever each host happened to hold.

When the registry's node is lost, Ray does not start the actor elsewhere (it is pinned to its
database: :func:`~relax_glue.actor.start_registry_actor`), and every call fails with
REGISTRY_UNAVAILABLE. When the node and its database are back, the trainer calls
:func:`start_registry` again with a fresh layout: the actor starts there from the journal, and
every client made by :func:`start_registry` or a :class:`RolloutWorker` finds it by name.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lora_contract.names import MANAGED_CAPACITY
from relax_glue.actor import (
    DEFAULT_LEASE_REAPER_S,
    DEFAULT_NAMESPACE,
    AsyncRegistryClient,
    start_registry_actor,
)
from relax_glue.engine_client import EngineClient
from relax_glue.sessions import DEFAULT_LEASE_TTL_S, SessionManager, SessionPhase

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = [
    "REGISTRY_RESOURCE",
    "ROLLOUT_RESOURCE",
    "RolloutWorker",
    "RunLayout",
    "join_cluster",
    "layout_of",
    "reload_ray_auth",
    "start_registry",
    "start_rollout_workers",
    "use_ray_auth",
]

REGISTRY_RESOURCE = "lora_registry"  # the node whose disk holds the registry's database
ROLLOUT_RESOURCE = "lora_rollout"  # a node that hosts rollout workers

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """Which Ray node does what (node ids)."""

    registry_node: str
    rollout_nodes: tuple[str, ...]


def layout_of(
    nodes: Sequence[Mapping[str, Any]], registry: str = REGISTRY_RESOURCE, rollout: str = ROLLOUT_RESOURCE
) -> RunLayout:
    """The layout of the alive nodes in ``nodes`` (``ray.nodes()`` records) by their resources.
    Exactly one node may offer ``registry`` (two would be two databases); at least one must
    offer ``rollout``."""
    alive = [n for n in nodes if n.get("Alive")]
    holders = sorted(n["NodeID"] for n in alive if n.get("Resources", {}).get(registry))
    if len(holders) != 1:
        raise ValueError(
            f"exactly one alive node must offer the resource {registry!r} (the registry's database "
            f"is on one disk): found {len(holders)}"
        )
    rollout_nodes = tuple(sorted(n["NodeID"] for n in alive if n.get("Resources", {}).get(rollout)))
    if not rollout_nodes:
        raise ValueError(f"no alive node offers the resource {rollout!r} (rollout workers)")
    return RunLayout(holders[0], rollout_nodes)


def current_layout(registry: str = REGISTRY_RESOURCE, rollout: str = ROLLOUT_RESOURCE) -> RunLayout:
    """The layout of the cluster this process is connected to, now."""
    import ray

    return layout_of(ray.nodes(), registry, rollout)


def join_cluster(
    address: str,
    auth_token: str | None,
    *,
    namespace: str | None = None,
    runtime_env: Mapping[str, Any] | None = None,
) -> None:
    """Connect this process to the cluster at ``address`` (``host:port`` of its GCS) with the
    cluster's token. ``auth_token`` None: the cluster runs without token auth (said explicitly,
    so Ray does not go looking for a token file). Call it before anything else starts Ray here."""
    use_ray_auth(auth_token)
    import ray

    if ray.is_initialized():
        joined = ray.get_runtime_context().gcs_address
        if joined != address:
            raise RuntimeError(f"this process is already connected to the Ray cluster at {joined}")
        return
    ray.init(
        address=address,
        namespace=namespace,
        log_to_driver=False,
        runtime_env=dict(runtime_env) if runtime_env is not None else None,
    )


def use_ray_auth(auth_token: str | None) -> None:
    """This process (and what it spawns) speaks to Ray with ``auth_token`` (None: no token auth).
    Ray reads its auth settings once and caches them: when it is already imported here, the
    cache is dropped so the next connection reads these (as Ray's own ``get-auth-token`` does)."""
    if auth_token is not None:
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = auth_token
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)  # the token given, not a file's
    else:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        os.environ.pop("RAY_AUTH_TOKEN", None)
    reload_ray_auth()


def reload_ray_auth() -> None:
    """Make Ray, when it is already imported here, read its auth settings from the environment
    again (it caches them at first use)."""
    if "ray" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def start_registry(
    layout: RunLayout,
    epoch: str | int,
    engines: Sequence[str],
    capacity: int = MANAGED_CAPACITY,
    *,
    db_path: str | os.PathLike[str],
    publisher_token: str,
    lease_reaper_s: float | None = DEFAULT_LEASE_REAPER_S,
    namespace: str = DEFAULT_NAMESPACE,
) -> AsyncRegistryClient:
    """The epoch's durable registry actor on the layout's registry node (started, or found
    running there), and the trainer's client of it, which follows the actor by name (a restart
    on the node that came back is found). ``db_path`` is a path on that node's disk. The actor
    lives while the client does (or a handle of it): keep the client for the run."""
    handle = start_registry_actor(
        epoch,
        engines,
        capacity,
        db_path=db_path,
        namespace=namespace,
        lease_reaper_s=lease_reaper_s,
        node_id=layout.registry_node,
        publisher_token=publisher_token,
    )
    return AsyncRegistryClient.for_named_actor(
        epoch, namespace=namespace, handle=handle, publisher_token=publisher_token
    )


class RolloutWorker:
    """One rollout worker: a session manager with its own worker lease over the epoch's registry
    actor (found by name, never a publisher) and the engines (HTTP). Run it as a Ray actor
    (:func:`start_rollout_workers`): its methods run on the actor's event loop, where the lease's
    heartbeat runs between turns. Episodes are the caller's: :meth:`run` awaits
    ``fn(sessions, *args)`` there.

    ``wrap_registry``: a function given the worker's registry client that returns the client the
    session manager uses (a fault-injection seam: a test wraps the real client to cut it off)."""

    def __init__(
        self,
        epoch: str | int,
        engine_urls: Mapping[str, str],
        *,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        heartbeat_s: float | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        wrap_registry: Callable[[AsyncRegistryClient], Any] | None = None,
    ) -> None:
        registry: Any = AsyncRegistryClient.for_named_actor(epoch, namespace=namespace)
        if wrap_registry is not None:
            registry = wrap_registry(registry)
        self._engines = {name: EngineClient(name, url) for name, url in engine_urls.items()}
        self.sessions = SessionManager(
            registry, self._engines, lease_ttl_s=lease_ttl_s, heartbeat_s=heartbeat_s
        )

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        return await fn(self.sessions, *args, **kwargs)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def counters(self) -> dict[str, int]:
        """What the worker did that a test or a dashboard asks about."""
        s = self.sessions
        open_sessions = sum(1 for v in s.sessions.values() if v.phase is SessionPhase.OPEN)
        return {
            "fenced_turns": s.fenced_turns,
            "renewals": s.renewals,
            "served_mismatches": s.served_mismatches,
            "open_sessions": open_sessions,
        }

    async def shutdown(self) -> None:
        """Close every session, stop the heartbeat, close the engine clients."""
        try:
            await self.sessions.close_all()
        finally:
            await self.sessions.aclose()
            for engine in self._engines.values():
                await engine.aclose()


def start_rollout_workers(
    layout: RunLayout,
    epoch: str | int,
    engine_urls: Mapping[str, str],
    *,
    per_node: int = 1,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    heartbeat_s: float | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    wrap_registry: Callable[[AsyncRegistryClient], Any] | None = None,
) -> list[ActorHandle]:
    """``per_node`` :class:`RolloutWorker` actors on each rollout node, pinned there (a worker
    lost with its node is not started elsewhere: its lease runs out and the registry closes its
    sessions). Ordered by node, then by worker."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(RolloutWorker)
    return [
        remote.options(
            num_cpus=0,  # waits on engines and the registry; takes no CPU slot from trainers
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote(
            epoch,
            dict(engine_urls),
            lease_ttl_s=lease_ttl_s,
            heartbeat_s=heartbeat_s,
            namespace=namespace,
            wrap_registry=wrap_registry,
        )
        for node in layout.rollout_nodes
        for _ in range(per_node)
    ]
