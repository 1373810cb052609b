"""The TRL side of one run, built by :meth:`GRPOVersions.connect`: the registry (in-process, or
the Ray actor with several processes), the async stack on its thread-hosted loop (engine clients,
the smg gateway, sessions; the publisher on rank 0), TRL's ``rollout_func`` and callback, the
run's report, and the close that undoes it all."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from relax_glue.trl.callback import PublishingHooks, publishing_callback_class
from relax_glue.trl.cluster import RayRole, join_registry, leave_ray
from relax_glue.trl.completions import CompletionRecord
from relax_glue.trl.config import VersionsConfig
from relax_glue.trl.event_loop import LoopThread
from relax_glue.trl.outcomes import PublicationOutcome
from relax_glue.trl.publication import StepPublication
from relax_glue.trl.ranks import RankInfo, broadcast_from_main
from relax_glue.trl.rollouts import EnvTurn, RolloutFunc, Rollouts

if TYPE_CHECKING:
    from relax_glue.engine_client import AuditEntry, EngineClient
    from relax_glue.gateway import GatewayClient
    from relax_glue.sessions import SessionManager
    from relax_glue.trl.cluster import Registry

# What the publisher's engine clients go through (fault injection in the example's engine tests).
ClientWrapper = Callable[["EngineClient"], "EngineClient"]


class GRPOVersions:
    """The TRL side of one run: sessions (every rank), the publication (rank 0 publishes), the
    loop they run on. Build with :meth:`connect`; hand TRL :meth:`rollout_func` and
    :meth:`callback`; :meth:`report` and :meth:`close` at the end."""

    def __init__(
        self,
        loop: LoopThread,
        rank: RankInfo,
        epoch: str,
        config: VersionsConfig,
        *,
        sessions: SessionManager,
        publication: StepPublication,
        clients: Mapping[str, EngineClient],
        gateway: GatewayClient,
        ray: RayRole | None = None,
    ) -> None:
        self.loop, self.rank, self.epoch, self.config = loop, rank, epoch, config
        self.sessions, self.publication, self.clients, self.gateway = sessions, publication, clients, gateway
        self.rollouts = Rollouts(loop, rank, sessions, config, on_episode_closed=publication.episode_closed)
        self.ray = ray or RayRole()  # what this process did with Ray (several processes only)
        self._closed = False

    @classmethod
    def connect(
        cls,
        engines: Mapping[str, str],
        *,
        gateway_url: str,
        admin_key: str | None = None,
        epoch: str | None = None,
        config: VersionsConfig | None = None,
        wrap_publisher_client: ClientWrapper | None = None,
    ) -> GRPOVersions:
        """Clients for ``engines`` (id -> URL, control calls go there), sessions through the smg
        gateway at ``gateway_url``, a registry of ``epoch`` (one per run: names never repeat;
        default a fresh one, agreed by every rank) and, on rank 0, the publisher.

        ``wrap_publisher_client`` is a test seam, not configuration: it wraps each engine client
        the publisher uses (the example's engine test corrupts one bucket in the real client's
        fault wrapper). Production code passes nothing."""
        config = config or VersionsConfig()
        rank = RankInfo.current()
        epoch = broadcast_from_main(epoch or f"trl{uuid.uuid4().hex[:8]}", rank)
        registry, ray = join_registry(rank, epoch, tuple(engines), config)
        loop = LoopThread()
        try:
            sessions, publication, clients, gateway = loop.call(
                _build(engines, gateway_url, admin_key, registry, rank, config, loop, wrap_publisher_client),
                config.setup_timeout_s,
            )
        except BaseException:
            loop.close()
            raise
        return cls(
            loop,
            rank,
            epoch,
            config,
            sessions=sessions,
            publication=publication,
            clients=clients,
            gateway=gateway,
            ray=ray,
        )

    def callback(self) -> PublishingHooks:
        """The publication callback for ``GRPOTrainer(callbacks=[...])``."""
        return publishing_callback_class()(self.publication)

    def rollout_func(
        self, *, env_turn: EnvTurn, max_new_tokens: int, assistant_turns: int = 2, ignore_eos: bool = False
    ) -> RolloutFunc:
        """TRL's ``rollout_func``: see :meth:`relax_glue.trl.rollouts.Rollouts.rollout_func`."""
        return self.rollouts.rollout_func(
            env_turn=env_turn,
            max_new_tokens=max_new_tokens,
            assistant_turns=assistant_turns,
            ignore_eos=ignore_eos,
        )

    @property
    def outcomes(self) -> list[PublicationOutcome]:
        """Every rank: the agreed publication outcomes, in order."""
        return self.publication.outcomes

    @property
    def completions(self) -> list[CompletionRecord]:
        """This rank's episodes (when ``config.keep_completions``)."""
        return self.rollouts.completions

    # ---------------------------------------------------------------------------- the end

    def registry_states(self) -> dict[str, str]:
        """Rank 0: every version of the epoch and its registry state (empty on other ranks)."""
        steps = self.publication.steps
        if steps is None:
            return {}
        publisher = steps.publisher

        async def read() -> dict[str, str]:
            status = await publisher.registry.status()
            return {v.lora_name: v.state.value for v in status.versions}

        return self.loop.call(read(), self.config.setup_timeout_s)

    def report(self) -> dict[str, Any]:
        """This rank's record of the run (JSON-able): the agreed outcomes, rank 0's publications,
        reclaims and registry states, this rank's episodes and the calls that did not succeed."""
        p = self.publication
        failed = [dataclasses.asdict(e) for e in self.audit_entries() if e.outcome != "ok"]
        return {
            "rank": self.rank.rank,
            "world_size": self.rank.world_size,
            "epoch": self.epoch,
            "config": {k: str(v) for k, v in dataclasses.asdict(self.config).items()},
            "outcomes": [o.to_wire() for o in p.outcomes],
            "publications": [
                {**dataclasses.asdict(r), "lora_ids": p.lora_ids.get(r.lora_name or "", {})}
                for r in p.publications
            ],
            "reclaims": [dataclasses.asdict(r) for r in p.reclaims],
            "completions": [c.summary() for c in self.completions],
            "failures": p.failures,
            "registry_states": self.registry_states(),
            "failed_requests": failed,
            "forbidden_calls": [dataclasses.asdict(e) for e in self.forbidden_calls()],
        }

    def audit_entries(self) -> list[AuditEntry]:
        """Every call of this rank's clients (engines directly, and the gateway)."""
        return [e for log in self._audit_logs() for e in log.entries()]

    def forbidden_calls(self) -> list[AuditEntry]:
        """Pause, flush or abort-all calls in this rank's audit logs (there must be none)."""
        from relax_glue.engine_client import forbidden_calls  # lazy, as every stack import here

        return forbidden_calls(self._audit_logs())

    def _audit_logs(self) -> list[Any]:
        logs = {id(c.audit): c.audit for c in self.clients.values()}
        logs[id(self.gateway.client.audit)] = self.gateway.client.audit
        return list(logs.values())

    def close(self) -> None:
        """Close the sessions and clients of this rank, stop its loop; then leave Ray (the
        process that started it stops it last, once every rank left)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.loop.call(self._aclose(), self.config.setup_timeout_s)
        finally:
            self.loop.close()
            leave_ray(self.rank, self.ray)

    async def _aclose(self) -> None:
        await self.sessions.aclose()
        for c in self.clients.values():
            await c.aclose()
        await self.gateway.aclose()


async def _build(
    engines: Mapping[str, str],
    gateway_url: str,
    admin_key: str | None,
    registry: Registry,
    rank: RankInfo,
    config: VersionsConfig,
    loop: LoopThread,
    wrap: ClientWrapper | None,
) -> tuple[SessionManager, StepPublication, dict[str, EngineClient], GatewayClient]:
    """The async stack, created on the loop it will run on (its HTTP pools belong to that loop).
    The stack's modules are imported here: importing this package stays light."""
    from relax_glue.cohort import open_publisher
    from relax_glue.engine_client import EngineClient
    from relax_glue.gateway import GatewayClient
    from relax_glue.sessions import SessionManager

    clients = {eid: EngineClient(eid, url, admin_key=admin_key) for eid, url in engines.items()}
    gateway = GatewayClient(gateway_url, clients)
    sessions = SessionManager(
        registry, clients, gateway=gateway, drain_timeout_s=10.0, lease_ttl_s=config.lease_ttl_s
    )
    publisher = None
    if rank.is_main:
        pub_clients = {eid: (wrap(c) if wrap is not None else c) for eid, c in clients.items()}
        publisher = open_publisher(registry, pub_clients, reclaim_wait_s=1.0, reclaim_poll_s=0.05)
    return sessions, StepPublication(loop, rank, config, publisher, clients), clients, gateway
