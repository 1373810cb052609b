"""One answer from every tensor-parallel rank to a managed LoRA control request (issue 38).

SGLang 0.5.23 hands every control request to every TP rank: rank 0 receives it and broadcasts it
to the others (``SchedulerRequestReceiver._broadcast_reqs_across_ranks``), and each rank's
scheduler handles it at the same point of its loop. But only rank 0 replies: the tokenizer's
fan-out waits for one reply per data-parallel rank (``FanOutCommunicator(...,
num_dp_ranks)``), so what rank 1 did is never seen. A preparation that failed on rank 1 only
would be installed on rank 0 and registered, and the first step on that adapter would run it on
one rank and not the other.

So each managed step combines every rank's answer over the TP group's CPU (gloo) group and every
rank returns the merged one: the reply rank 0 sends is what all ranks did. The usual case costs one
all-reduce of one integer (every rank succeeded, or some poll is still pending); only a failure
gathers every rank's whole answer (its message, what it holds). Every rank reaches the
collectives for the same request, because every rank gets the same requests in the same order and
tells a managed one apart from the request alone (``prepared_load.op_of``). A step that would
change state asks first (check before mutate), so a refusal on one rank changes nothing on any:

- an install goes ahead only when every rank has its preparation; an install that then fails on
  one rank is taken back out on the others before anyone replies;
- an unload goes ahead only when the step fence passed on every rank.

With one rank nothing is gathered: the local answer is the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang_ext import lora_registry_patch as upstream


@dataclass(frozen=True)
class RankAnswer:
    """One rank's answer to a LoRA update (the fields of a LoRAUpdateOutput), as gathered."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None
    pending: bool = False  # a poll's "still preparing": neither success nor failure

    @classmethod
    def of(cls, output: Any, pending_message: str | None = None) -> RankAnswer:
        message = output.error_message or None
        loaded = dict(output.loaded_adapters) if output.loaded_adapters is not None else None
        pending = not output.success and pending_message is not None and message == pending_message
        return cls(bool(output.success), message, loaded, pending)


@dataclass(frozen=True)
class Merged:
    """What every rank answers: success only when every rank succeeded; pending when none failed
    and some is still preparing; the failures' messages, each named by its rank; the adapters
    that any rank holds (so a load that some rank still holds reads as loaded, and is taken back
    out on every rank by the main process, whose unload of an id a rank lacks is a no-op)."""

    success: bool
    pending: bool
    error_message: str | None
    loaded_adapters: dict[str, str] | None = field(default=None)


def merge(answers: list[RankAnswer], pending_message: str | None = None) -> Merged:
    """The one answer of ``answers`` (index = TP rank)."""
    if len(answers) == 1:
        only = answers[0]
        return Merged(only.success, only.pending, only.error_message, only.loaded_adapters)
    failed = [(rank, a) for rank, a in enumerate(answers) if not a.success and not a.pending]
    pending = not failed and any(a.pending for a in answers)
    loaded: dict[str, str] | None = None
    for a in answers:
        if a.loaded_adapters is not None:
            loaded = {**(loaded or {}), **a.loaded_adapters}
    if failed:
        message = "; ".join(f"TP rank {rank}: {a.error_message or 'failed'}" for rank, a in failed)
    elif pending:
        message = pending_message
    else:
        message = None
    return Merged(not failed and not pending, pending, message, loaded)


def gather(scheduler: Any, answer: RankAnswer) -> list[RankAnswer]:
    """Every TP rank's answer, index = rank (this rank's alone when there is one rank). Blocks
    until every rank has called it for the same request."""
    peers = upstream.tp_peers(scheduler)
    if peers is None:
        return [answer]
    world_size, cpu_group = peers
    out: list[Any] = [None] * world_size
    upstream.all_gather_object(out, answer, cpu_group)
    return out


# An answer's kind as one integer, so that the usual case (every rank agrees) costs one all-reduce
# of one integer (the smallest wins: a failure anywhere, else a pending poll anywhere); only a
# failure then gathers every rank's whole answer, for its messages and what each rank holds.
FAILED, PENDING, SUCCEEDED = 0, 1, 2


def kind_of(answer: RankAnswer) -> int:
    return SUCCEEDED if answer.success else PENDING if answer.pending else FAILED


def worst_kind(scheduler: Any, kind: int) -> int:
    """The smallest answer kind of every TP rank. Blocks until every rank has called it."""
    peers = upstream.tp_peers(scheduler)
    return kind if peers is None else upstream.all_reduce_min(kind, peers[1])


def agree(scheduler: Any, output: Any, pending_message: str | None = None) -> Any:
    """The LoRAUpdateOutput every rank returns for ``output``, this rank's: the merge of all
    ranks' (``output`` itself with one rank). Every rank makes the same collective calls: the
    all-reduce, then the gather only when the all-reduce said some rank failed."""
    if upstream.tp_peers(scheduler) is None:
        return output
    answer = RankAnswer.of(output, pending_message)
    worst = worst_kind(scheduler, kind_of(answer))
    if worst == SUCCEEDED:
        return output
    if worst == PENDING:
        return upstream.lora_update_output(False, pending_message, answer.loaded_adapters)
    merged = merge(gather(scheduler, answer), pending_message)
    return upstream.lora_update_output(merged.success, merged.error_message, merged.loaded_adapters)


def refusal_with_what_ranks_hold(scheduler: Any, held: Any, error_message: str | None) -> Any:
    """A refusal every rank returns, naming what any rank still holds (``held``: this rank's
    LoRAUpdateOutput after its take-back; the main process takes out whatever is left)."""
    merged = merge(gather(scheduler, RankAnswer.of(held)))
    return upstream.lora_update_output(False, error_message, merged.loaded_adapters)
