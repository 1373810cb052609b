"""The body of one rank in test_trl_outcomes.py's two-process test (not a test module): kept apart
so that a spawned rank imports only what it runs (torch.distributed and relax_glue.trl)."""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

from relax_glue.trl import PublicationFailed, VersionsConfig
from relax_glue.trl.publication import StepPublication
from relax_glue.trl.ranks import RankInfo, agree


def hung_publication_rank(rank: int, port: int, results: Any) -> None:
    """Rank 0's publication never ends (a future nobody completes); both ranks must agree on
    the typed timeout and raise the same PublicationFailed, at the same point."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        info = RankInfo(rank, 2)
        config = VersionsConfig(max_failures=0, publish_timeout_s=0.5)
        v = StepPublication(None, info, config)
        mine = v.settle(7, concurrent.futures.Future()) if info.is_main else None
        try:
            v.record(agree(mine, info))
            results.put((rank, "no raise", None))
        except PublicationFailed as exc:
            results.put((rank, exc.outcome.code, exc.outcome.step))
    finally:
        dist.destroy_process_group()
