"""The one configuration object of a TRL run on versions (every field has a working default)."""

from __future__ import annotations

import dataclasses

from lora_contract.names import MANAGED_CAPACITY
from relax_glue.backpressure import StalenessPolicy


@dataclasses.dataclass(frozen=True)
class VersionsConfig:
    capacity: int = MANAGED_CAPACITY  # the epoch's K (engines need K + 1 LoRA slots)
    background: bool = False  # publish while the next step's rollouts run (a lag of <= 1 step)
    max_failures: int = 0  # failed publications tolerated (counted) before every rank raises
    # capacity backpressure: reclaim and a bounded wait, a bounded skip, a bounded forced wait
    policy: StalenessPolicy = dataclasses.field(default_factory=StalenessPolicy)
    publish_timeout_s: float = 120.0  # rank 0 reaches the outcome broadcast within this
    episode_timeout_s: float = 300.0  # one episode; then it is a recorded, masked failure
    rollout_timeout_s: float = 900.0  # one process's batch (a last resort past the episodes')
    keep_completions: bool = True  # keep every episode's record for report() (memory grows)
    setup_timeout_s: float = 120.0
    lease_ttl_s: float = 60.0  # a dead process's sessions close when their lease runs out
    version_prefix: str = "step"
    ray_num_cpus: int = 1  # the local Ray cluster rank 0 starts for the registry actor (world > 1)
    # Ranks on several hosts: the Ray cluster every rank joins, its GCS address and auth token
    # given to each process (docs/placement.md). None: rank 0 starts a local Ray of its own.
    ray_address: str | None = None
    ray_auth_token: str | None = dataclasses.field(default=None, repr=False)
