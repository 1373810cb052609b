"""The training processes' ranks and the few collectives the integration needs: rank 0's value
on every rank (one ``broadcast_object_list``), the publication outcome every rank agrees on, and
a bounded barrier. ``torch.distributed`` is imported only when there are several processes."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from relax_glue.trl.outcomes import PublicationOutcome


@dataclasses.dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls) -> RankInfo:
        """This process's rank. Under ``accelerate launch``/``torchrun`` the process group is
        initialized here if TRL has not done it yet (accelerate's ``PartialState``: gloo on CPU)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        # lazy: one process needs neither torch.distributed nor accelerate
        import torch.distributed as dist

        if not dist.is_initialized():
            from accelerate import PartialState

            PartialState()
        return cls(dist.get_rank(), dist.get_world_size())


def broadcast_from_main(value: Any, rank: RankInfo) -> Any:
    """Rank 0's ``value`` on every rank: one ``broadcast_object_list`` (a no-op alone)."""
    if rank.world_size == 1:
        return value
    import torch.distributed as dist  # lazy: see RankInfo.current

    box = [value if rank.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(outcome: PublicationOutcome | None, rank: RankInfo) -> PublicationOutcome:
    """Every rank gets rank 0's outcome (rank 0 passes it, the others None)."""
    wire = broadcast_from_main(outcome.to_wire() if outcome is not None else None, rank)
    if wire is None:
        raise RuntimeError("rank 0 broadcast no publication outcome")
    return PublicationOutcome.from_wire(wire)


def leave_group() -> None:
    """Leave the process group for good, after a collective met a rank that is gone: this rank's
    connections close, so the collective any other survivor still waits in (on this rank) fails
    at once instead of waiting for it. A process that exits does this by itself; one that lives
    on after the training raised (a Ray actor, a notebook) must."""
    import torch.distributed as dist  # lazy: see RankInfo.current

    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(rank: RankInfo, timeout_s: float = 60.0) -> None:
    """Every rank waits for the others; bounded on gloo (a rank that died fails it, not hangs it)."""
    import datetime

    import torch.distributed as dist  # lazy: see RankInfo.current

    if rank.world_size == 1 or not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
    else:
        dist.barrier()
