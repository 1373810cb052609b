"""Where a bucket's bytes come from, as the publication shell sees it: a filler per bucket.

The shell (:class:`~sglang_ext.publication.PublicationService`) receives every bucket the same
way: a :data:`BucketFiller` fills a verifying receiver, and only a bucket that passed every check
changes the attempt. An HTTP body and a file in the engine's local source directory are fillers
the route builds from the acknowledging request itself. A transport whose bytes come *out of
band* (the collective group) is an :class:`OutOfBandReceive`: it prepares an attempt at begin,
hands the shell a filler per acknowledgement, and settles and forgets the attempt at cleanup.
The shell holds them by the ``BeginRequest.transport`` value they serve, so a new transport is a
new class here and in its route, not a branch in the shell.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from lora_contract.protocol import BucketSpec, Manifest, ReceiveBucketMeta, max_payload_bytes

if TYPE_CHECKING:
    from sglang_ext.bucket_receiver import BucketReceiver
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


class OutOfBandReceive(Protocol):
    """A transport whose bytes do not travel in the acknowledging calls (see the module doc)."""

    # the BeginRequest.transport value this receive serves
    transport: str

    def receiving(self, key: AttemptKey) -> bool:
        """Whether this attempt's buckets are being received here already (a retried begin)."""
        ...

    def check_ready(self) -> None:
        """Raise TRANSPORT_UNAVAILABLE if a new attempt cannot be received now; called before
        the version table changes, so a refusal leaves nothing behind."""
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
