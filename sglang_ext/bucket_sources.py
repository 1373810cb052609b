"""Where a bucket's bytes come from, as the publication shell sees it: a filler per bucket.

The shell (:class:`~sglang_ext.publication.PublicationService`) receives every bucket the same
way: a :data:`BucketFiller` fills a verifying receiver, and only a bucket that passed every check
changes the attempt. An HTTP body and a file in the engine's local source directory are fillers
the route builds from the acknowledging request itself. A transport whose bytes come *out of
band* (the collective group) is an :class:`OutOfBandReceive`: it prepares an attempt at begin,
hands the shell a filler per acknowledgement, and settles and forgets the attempt at cleanup.

Each is registered here (:func:`register_receive`) under the transport name the contract knows
(:func:`lora_contract.transport.register_transport`; the collective's registration is in
:mod:`sglang_ext.engine_state`, which assembles the engine); the engine builds every registered receive
at start, the shell holds them by the ``BeginRequest.transport`` they serve and the route mounts
their own setup calls (:class:`SetupRoute`, the collective's group connect), so a new transport
is a registration, not a branch in the contract, the route or the shell.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel

from lora_contract.protocol import (
    HTTP_TRANSPORT,
    BucketSpec,
    Manifest,
    ReceiveBucketMeta,
    max_payload_bytes,
    registered_transports,
)

if TYPE_CHECKING:
    from sglang_ext.bucket_receiver import BucketReceiver
    from sglang_ext.staging import StagingArea
    from sglang_ext.version_table import ManagedVersion

# safetensors header slack on top of the tensor bytes a bucket may carry
HEADER_SLACK = 64 * 1024

# A version's attempt: the stash and the running load belong to exactly this (name, token) pair.
# The table binds a token to one name for good (ATTEMPT_MISMATCH), and keying by both keeps even
# a table bug from letting one attempt's tensors reach another version.
AttemptKey = tuple[str, str]

# Fills a bucket receiver with at most the given number of bytes: from the request body, chunk by
# chunk as it arrives (with the HTTP shell's deadlines and its handling of a client that goes
# away), from a file in the engine's local source directory, or from an out-of-band receive.
# The receiver raises to stop.
BucketFiller = Callable[[int, "BucketReceiver"], Awaitable[None]]


def bucket_cap(manifest: Manifest, spec: BucketSpec, max_bucket_bytes: int) -> int:
    """The most bytes a bucket's file may have: its tensors' bytes, the engine's limit, a header."""
    return min(max_payload_bytes(manifest, spec), max_bucket_bytes) + HEADER_SLACK


@dataclass(frozen=True)
class SetupRoute:
    """A JSON control call a transport adds for its own setup (the collective's group connect):
    mounted by the route like every control call (same auth, body limits and typed errors);
    ``handle`` gets the parsed request and answers the reply model."""

    path: str
    request: type[BaseModel]
    handle: Callable[[Any], Awaitable[BaseModel]]


class OutOfBandReceive(Protocol):
    """A transport whose bytes do not travel in the acknowledging calls (see the module doc)."""

    # the BeginRequest.transport value this receive serves
    transport: str

    def setup_routes(self) -> Sequence[SetupRoute]:
        """The control calls this transport needs besides the protocol's own (often none)."""
        ...

    def receiving(self, key: AttemptKey) -> bool:
        """Whether this attempt's buckets are being received here already (a retried begin).
        False for an attempt whose receive can no longer end (e.g. its channel broke): the
        retried begin then gets it ready again, like a new one."""
        ...

    def check_ready(self, channel: str | None) -> None:
        """Raise TRANSPORT_UNAVAILABLE if a new attempt cannot be received now over the trainer's
        ``channel`` (``BeginRequest.channel``); called before the version table changes, so a
        refusal leaves nothing behind."""
        ...

    def prepare(self, key: AttemptKey, version: ManagedVersion) -> None:
        """Get ready for the attempt's remaining buckets (the version is PREPARED)."""
        ...

    def filler(self, meta: ReceiveBucketMeta) -> BucketFiller:
        """The filler of this bucket's acknowledgement."""
        ...

    async def settle(self, key: AttemptKey) -> None:
        """Before a cleanup removes the attempt: let bytes still landing land."""
        ...

    def forget(self, key: AttemptKey) -> None:
        """The attempt is over: release everything held for it."""
        ...


@dataclass(frozen=True)
class ReceiveSetup:
    """What the engine hands each registered receive when it builds it, once, at start."""

    staging: StagingArea
    max_bucket_bytes: int
    incarnation: str
    log: Callable[[str], None]


ReceiveFactory = Callable[[ReceiveSetup], OutOfBandReceive]
# transport name -> how this engine builds its receive (see the module doc)
_RECEIVES: dict[str, ReceiveFactory] = {}


def register_receive(transport: str, factory: ReceiveFactory) -> None:
    """Have every engine built from now on receive ``transport``'s buckets with ``factory``'s
    receive. The contract must know the name first (a message could not carry it otherwise)."""
    if transport not in registered_transports() or transport == HTTP_TRANSPORT:
        raise ValueError(f"{transport!r} is not an out-of-band transport registered at the contract")
    _RECEIVES[transport] = factory


def build_receives(setup: ReceiveSetup) -> list[OutOfBandReceive]:
    """One receive per registered transport, for an engine starting now."""
    receives = [factory(setup) for factory in _RECEIVES.values()]
    assert [r.transport for r in receives] == list(_RECEIVES), "each receive serves its own name"
    return receives
