"""What the engine's collective link (:mod:`sglang_ext.collective_link`) and its receiver process
(:mod:`sglang_ext.collective_receiver`) say to each other: one JSON object per line, a ``kind``
and that kind's fields. Both sides build and read the lines with :func:`encode` and
:func:`decode` only, so a field one side writes is a field the other side reads (or a
:class:`MessageError`), never a key nobody looks at.

Commands (engine -> receiver): :class:`Connect` once, first; then :class:`Expect` jobs, run in
order. Events (receiver -> engine): :class:`Connected`; per bucket :class:`Progress` (its frame
was accepted, then bytes landed) and :class:`Arrived` (whole); :class:`Failed` (then the process
exits: after a failed receive the pair is out of step, and the group is not reused).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_contract.errors import ErrorCode


class MessageError(ValueError):
    """A line that is not one of these messages (a bug on one side: the pair is not trusted)."""


@dataclass(frozen=True)
class ExpectedBucket:
    """One bucket the receiver is to write: ``nbytes`` tensor bytes into ``path`` at ``offset``
    (right after the bucket's header, already written by the engine)."""

    index: int
    nbytes: int
    path: Path
    offset: int


@dataclass(frozen=True)
class Connect:
    init_method: str
    group_id: str
    timeout_s: float
    backend: str


@dataclass(frozen=True)
class Expect:
    """Receive one attempt's buckets, in order; ``tag``: :func:`~lora_contract.collective_group.token_tag`
    of its attempt token."""

    job: str
    tag: bytes
    buckets: tuple[ExpectedBucket, ...]


@dataclass(frozen=True)
class Connected:
    pass


@dataclass(frozen=True)
class Progress:
    """``landed`` tensor bytes of bucket ``index`` are in its file (0: its frame was accepted and
    its data receive posted)."""

    job: str
    index: int
    landed: int


@dataclass(frozen=True)
class Arrived:
    job: str
    index: int


@dataclass(frozen=True)
class Failed:
    """The receiver gave up (and exits). ``code``: what the caller of the bucket ``index`` of
    ``job`` is told (the group's other waits end with TRANSFER_FAILED)."""

    reason: str
    code: ErrorCode = ErrorCode.TRANSFER_FAILED
    job: str | None = None
    index: int | None = None


Message = Connect | Expect | Connected | Progress | Arrived | Failed
_KINDS: dict[str, type[Message]] = {
    "connect": Connect,
    "expect": Expect,
    "connected": Connected,
    "progress": Progress,
    "arrived": Arrived,
    "failed": Failed,
}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}


def encode(msg: Message) -> bytes:
    """``msg`` as one line."""
    fields: dict[str, Any]
    match msg:
        case Expect():
            fields = {
                "job": msg.job,
                "tag": msg.tag.hex(),
                "buckets": [
                    {"index": b.index, "nbytes": b.nbytes, "path": str(b.path), "offset": b.offset}
                    for b in msg.buckets
                ],
            }
        case Failed():
            fields = {"reason": msg.reason, "code": msg.code.value, "job": msg.job, "index": msg.index}
        case _:
            fields = dict(vars(msg))
    return (json.dumps({"kind": _KIND_OF[type(msg)], **fields}) + "\n").encode()


def decode(line: bytes | str) -> Message:
    """One line back into its message; MessageError for anything else."""
    try:
        obj = json.loads(line)
        kind = obj.pop("kind")
        cls = _KINDS[kind]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise MessageError(f"not a collective message: {str(line)[:200]!r}") from exc
    try:
        msg = _build(cls, obj)
    except (ValueError, TypeError, KeyError) as exc:
        raise MessageError(f"a {kind} message with bad fields: {exc}") from exc
    return msg


def _build(cls: type[Message], obj: dict[str, Any]) -> Message:
    if cls is Connect:
        return Connect(
            init_method=_typed(obj, "init_method", str),
            group_id=_typed(obj, "group_id", str),
            timeout_s=float(_typed(obj, "timeout_s", (int, float))),
            backend=_typed(obj, "backend", str),
        )
    if cls is Expect:
        return Expect(
            job=_typed(obj, "job", str),
            tag=bytes.fromhex(_typed(obj, "tag", str)),
            buckets=tuple(
                ExpectedBucket(
                    index=_typed(b, "index", int),
                    nbytes=_typed(b, "nbytes", int),
                    path=Path(_typed(b, "path", str)),
                    offset=_typed(b, "offset", int),
                )
                for b in _typed(obj, "buckets", list)
            ),
        )
    if cls is Connected:
        return Connected()
    if cls is Progress:
        return Progress(
            job=_typed(obj, "job", str), index=_typed(obj, "index", int), landed=_typed(obj, "landed", int)
        )
    if cls is Arrived:
        return Arrived(job=_typed(obj, "job", str), index=_typed(obj, "index", int))
    return Failed(
        reason=_typed(obj, "reason", str),
        code=ErrorCode(_typed(obj, "code", str)),
        job=_typed(obj, "job", (str, type(None))),
        index=_typed(obj, "index", (int, type(None))),
    )


def _typed(obj: dict[str, Any], key: str, types: type | tuple[type, ...]) -> Any:
    value = obj[key]
    # bool is an int to isinstance, never to this protocol
    if not isinstance(value, types) or isinstance(value, bool):
        raise TypeError(f"{key}: {type(value).__name__} {value!r:.80}")
    return value
