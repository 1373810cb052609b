"""Several Ray nodes on this one host, for the multi-node tests and demo (issue 42).

Each node is a raylet of its own (``ray.cluster_utils.Cluster``: Ray's own facility for this),
with its own node id and the custom resource of its role (:mod:`relax_glue.placement`'s
``lora_registry`` / ``lora_rollout``); the head node is the trainer's. A node is removed by
killing its processes (what a lost host looks like to the rest), and a node of the same role is
added with a new id (what a host that comes back looks like).

Token auth is on, with a token drawn here and handed to every node's processes and to this
process in their environment; the nodes' ``HOME`` is a directory of the cluster's own, so Ray's
``~/.ray/auth_token`` is neither read nor written by any of them (the multi-host steps in
``docs/placement.md`` pass the same two things by hand). Ray's failure detection is shortened
(a lost node is declared dead in about 1.5 s instead of about 30 s) so that tests wait for the
lease TTLs they set, not for Ray.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from relax_glue.placement import join_cluster, reload_ray_auth, use_ray_auth

HEAD_ROLE = "head"
_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# GCS health checks of each raylet: every 0.5 s, dead after 3 misses
FAST_FAILURE_DETECTION = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
}


def _set_environment(values: Mapping[str, str | None]) -> None:
    """Set ``values`` in ``os.environ`` (None: unset)."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def _environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the block: what the processes that Ray spawns
    meanwhile inherit."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        _set_environment(values)
        yield
    finally:
        _set_environment(saved)


class LocalRayCluster:
    """A head node (the trainer's) and one node per entry of ``roles`` (a custom resource name
    each, e.g. ``("lora_registry", "lora_rollout", "lora_rollout")``), started by :meth:`start`,
    joined by this process with :meth:`connect`, stopped by :meth:`stop` (``with`` does all three).

    ``python_path``: directories every Ray worker imports from (the repository, and the test
    helpers whose functions rollout workers run)."""

    def __init__(
        self,
        roles: Sequence[str],
        *,
        python_path: Sequence[str | os.PathLike[str]] = (),
        node_cpus: int = 1,
    ) -> None:
        self.roles = tuple(roles)
        self.token = secrets.token_hex(32)
        self.python_path = os.pathsep.join(os.fspath(p) for p in python_path)
        self.node_cpus = node_cpus
        self.home = Path(tempfile.mkdtemp(prefix="lora-ray-home-"))
        self._cluster: Any = None
        self._nodes: dict[str, Any] = {}  # node id -> ray's Node
        self._role_of: dict[str, str] = {}  # node id -> role
        self._connected = False
        self._saved_env: dict[str, str | None] = {}

    # ------------------------------------------------------------------ life cycle

    def _node_env(self) -> dict[str, str | None]:
        # on top of this process's auth settings (use_ray_auth), for the node's processes only
        return {"HOME": str(self.home), "PYTHONPATH": self.python_path or None}

    def start(self) -> LocalRayCluster:
        """Start the nodes. This process speaks to them with the cluster's token from now until
        :meth:`stop` (it starts the head's services itself)."""
        from ray.cluster_utils import Cluster

        self._saved_env = {k: os.environ.get(k) for k in _AUTH_ENV}
        use_ray_auth(self.token)
        with _environment(self._node_env()):
            self._cluster = Cluster(shutdown_at_exit=True)
            head = self._cluster.add_node(
                num_cpus=self.node_cpus,
                include_dashboard=False,
                _system_config=FAST_FAILURE_DETECTION,
            )
        self._remember(head, HEAD_ROLE)
        for role in self.roles:
            self.add(role)
        return self

    def _remember(self, node: Any, role: str) -> str:
        self._nodes[node.node_id] = node
        self._role_of[node.node_id] = role
        return node.node_id

    def add(self, role: str) -> str:
        """A new node offering ``role`` (a new node id, as a host that came back has); its id."""
        # no CPU slot: the actors placed on a role's node (the registry, rollout workers, training
        # ranks) ask for none
        with _environment(self._node_env()):
            node = self._cluster.add_node(num_cpus=0, resources={role: 1})
        return self._remember(node, role)

    def remove(self, node_id: str) -> None:
        """Kill every process of the node (raylet, object store, its workers and actors), without
        letting them shut down cleanly: a lost host."""
        node = self._nodes.pop(node_id)
        self._role_of.pop(node_id)
        self._cluster.remove_node(node, allow_graceful=False)

    def nodes(self, role: str) -> list[str]:
        """The ids of the live nodes of ``role``, in the order they were added."""
        return [n for n, r in self._role_of.items() if r == role]

    @property
    def address(self) -> str:
        return self._cluster.address

    def connect(self) -> None:
        """Join the cluster from this process (as any process of the run joins it: address and
        token given, :func:`relax_glue.placement.join_cluster`)."""
        join_cluster(self.address, self.token)
        self._connected = True

    def disconnect(self) -> None:
        if self._connected:
            import ray

            ray.shutdown()
            self._connected = False

    def stop(self) -> None:
        """Stop every node, and give this process back the Ray auth settings it had (a later
        ``ray.init()`` of another test then starts its own local Ray as before)."""
        self.disconnect()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
        if self._saved_env:
            _set_environment(self._saved_env)
            self._saved_env = {}
            reload_ray_auth()
        shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        """Started, and joined by this process; stopped at the end of the block."""
        try:
            self.start()
            self.connect()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
