"""The line protocol between the engine's collective link and its receiver process: every
message one side writes is the message the other side reads, and nothing else is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_contract.collective_group import token_tag
from lora_contract.errors import ErrorCode
from sglang_ext.collective_messages import (
    Arrived,
    Connect,
    Connected,
    Expect,
    ExpectedBucket,
    Failed,
    Message,
    MessageError,
    Progress,
    decode,
    encode,
)

MESSAGES: list[Message] = [
    Connect(init_method="tcp://127.0.0.1:29500", group_id="g1", timeout_s=30.0, backend="gloo"),
    Expect(
        job="job-1",
        tag=token_tag("attempt-1"),
        buckets=(ExpectedBucket(0, 100, Path("/s/p0"), 16), ExpectedBucket(1, 0, Path("/s/p 1"), 8)),
    ),
    Expect(job="job-2", tag=b"", buckets=()),
    Connected(),
    Progress(job="job-1", index=3, landed=4 << 20),
    Arrived(job="job-1", index=3),
    Failed(reason="rendezvous failed: RuntimeError: x\ny"),
    Failed(reason="expected bucket 0 ...", code=ErrorCode.MANIFEST_MISMATCH, job="job-1", index=0),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_is_one_line_read_back_as_itself(msg: Message) -> None:
    line = encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line) == msg
    assert decode(line.decode()) == msg  # what the receiver reads from its text stdin


def test_the_refusal_code_travels_typed() -> None:
    back = decode(encode(Failed(reason="r", code=ErrorCode.STALE_ATTEMPT, job="j", index=1)))
    assert isinstance(back, Failed) and back.code is ErrorCode.STALE_ATTEMPT


@pytest.mark.parametrize(
    "line",
    [
        b"not json\n",
        b"[1, 2]\n",
        b'{"job": "j", "index": 0}\n',  # no kind
        b'{"kind": "bucket", "job": "j", "index": 0}\n',  # the old event name: nobody reads it
        b'{"kind": "arrived", "job": "j"}\n',  # a field missing
        b'{"kind": "arrived", "job": "j", "index": "0"}\n',  # a field of the wrong type
        b'{"kind": "arrived", "job": "j", "index": true}\n',
        b'{"kind": "progress", "job": "j", "index": 0, "landed": 1.5}\n',
        b'{"kind": "failed", "reason": "r", "code": "NO_SUCH_CODE", "job": null, "index": null}\n',
        b'{"kind": "expect", "job": "j", "tag": "zz", "buckets": []}\n',  # not hex
        b'{"kind": "expect", "job": "j", "tag": "", "buckets": [{"index": 0}]}\n',
        b'{"kind": "expect", "job": "j", "tag": "", "buckets": ["b"]}\n',
        b'{"kind": "connect", "init_method": "tcp://h:1", "group_id": "g", "timeout_s": "30",'
        b' "backend": "gloo"}\n',
    ],
)
def test_anything_else_is_refused(line: bytes) -> None:
    with pytest.raises(MessageError):
        decode(line)


def test_the_receivers_refusal_code_field_is_read() -> None:
    """The receiver used to send ``code=`` in a free-form event the engine never read: now the
    field is part of the message, and a Failed without it is TRANSFER_FAILED, not unknown."""
    plain = json.loads(encode(Failed(reason="r")))
    assert plain["code"] == "TRANSFER_FAILED"
    del plain["code"]
    with pytest.raises(MessageError):
        decode(json.dumps(plain))
