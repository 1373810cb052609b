"""The in-process deployment of the pure-logic trainer tests (not a test module): the REAL registry
(``_rg_helpers.Checked``), ``_fake_engine`` engines behind REAL ``EngineClient``s, the REAL
publisher and, where a test wants one, the REAL session manager. One builder, the variations as
parameters; each test module subclasses it with its own views (the snapshots it publishes, what
it reads back). The deployment on real engines is ``_e2e_helpers.Deployment``, a different thing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from _fake_engine import Cluster, make_cluster
from _rg_helpers import new_registry

from lora_versions_dev.fault_injection import FaultInjectingClient
from relax_glue.cohort import open_publisher
from relax_glue.publisher import Publisher
from relax_glue.sessions import SessionManager
from relax_glue.snapshot_store import SnapshotStore

# Reclaims that give up in milliseconds, not seconds: tests of a slot that stays taken wait the
# whole deadline; and registry calls retried at once.
FAST_RECLAIM: dict[str, Any] = {
    "reclaim_wait_s": 0.05,
    "reclaim_poll_s": 0.01,
    "reclaim_deadline_s": 2.0,
    "registry_retry_delay_s": 0.0,
}


class InProcessWorld:
    """``reg`` the registry, ``cluster`` / ``fakes`` the fake engines, ``engines`` the clients the
    publisher talks to (:meth:`wrap` one to inject faults), ``pub`` the publisher."""

    def __init__(
        self,
        *,
        registry: Any = None,
        cluster: Cluster | None = None,
        engines: Mapping[str, Any] | None = None,
        store: SnapshotStore | None = None,
        publisher_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.reg = registry if registry is not None else new_registry()
        self.cluster = cluster if cluster is not None else make_cluster()
        self.fakes = self.cluster.fakes
        self.engines: dict[str, Any] = dict(engines or self.cluster.clients)
        self.store = store
        self.publisher_options = dict(publisher_options or {})
        self.pub = self.publisher()

    def publisher(
        self,
        registry: Any = None,
        *,
        clients: Mapping[str, Any] | None = None,
        store: SnapshotStore | None = None,
    ) -> Publisher:
        """A publisher of this world; ``registry``, ``clients`` or ``store`` replace the world's."""
        return open_publisher(
            registry if registry is not None else self.reg,
            clients or self.engines,
            store=store or self.store,
            **self.publisher_options,
        )

    def wrap(self, engine: str) -> FaultInjectingClient:
        """The publisher talks to ``engine`` through a fault-injecting wrapper of its real client."""
        wrapper = FaultInjectingClient(self.cluster.clients[engine])
        self.engines[engine] = wrapper
        self.pub = self.publisher()
        return wrapper

    def sessions(
        self, registry: Any = None, engines: Mapping[str, Any] | None = None, **options: Any
    ) -> SessionManager:
        """A session manager over this world's registry and engine clients (or the ones given)."""
        return SessionManager(
            registry if registry is not None else self.reg, engines or self.cluster.clients, **options
        )

    def assert_no_stop_the_world(self) -> None:
        """RFC 7.3: no publication, failure, reclaim or session ever pauses, flushes or aborts all
        (aborts are per rid): none was sent, none reached an engine."""
        assert self.cluster.audit.forbidden() == []
        reached = [op for f in self.fakes.values() for op in f.ops()]
        assert not {"pause_generation", "flush_cache"} & set(reached)
