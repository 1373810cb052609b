"""Only the publisher that opened the registry changes what is published (issue 36).

Every op of ``PUBLISHER_OPS`` is tried, in a state where it would be accepted, with no token, a
wrong token and a token of the wrong type: each is NOT_PUBLISHER and leaves the complete state
unchanged (canonical dump and the raw attributes); then the right token is accepted. Session ops
need no token. A refused caller gets no replayed answer either, and no query gives the token away.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from _rg_helpers import ENGINES, EPOCH, Publisher, digest, lora_name, refused, sk, snapshot, vk

from lora_contract.errors import ErrorCode
from relax_glue.actor import AsyncRegistryClient, RegistryClient
from relax_glue.registry import MUTATING_OPS, PUBLISHER_OPS, LoRAVersionRegistry, new_publisher_token
from relax_glue.registry_types import (
    CleanupEvidence,
    PreparedEvidence,
    ReadyEvidence,
    UnloadEvidence,
)

Case = Callable[[LoRAVersionRegistry, Publisher], dict[str, Any]]


def _pending_b(reg: LoRAVersionRegistry, pub: Publisher) -> str:
    pub.publish("A")
    return pub.reserve("B").attempt_token


def _ready_b(reg: LoRAVersionRegistry, pub: Publisher) -> str:
    token = _pending_b(reg, pub)
    for engine in ENGINES:
        pub.ready("B", engine)
    return token


def _retired_a(reg: LoRAVersionRegistry, pub: Publisher) -> None:
    pub.publish("A")
    pub.publish("B")


def _claimed_a(reg: LoRAVersionRegistry, pub: Publisher) -> str:
    _retired_a(reg, pub)
    return reg.claim_reclaim(vk("A"), publisher_token=reg.publisher_token).reclaim_id


def _aborted_b(reg: LoRAVersionRegistry, pub: Publisher) -> str:
    token = _pending_b(reg, pub)
    reg.abort(token, "failed", publisher_token=reg.publisher_token)
    return token


# op -> the arguments of a call that the publisher's token gets accepted, after its set-up
CASES: dict[str, Case] = {
    "record_base": lambda reg, pub: {"fingerprint": "a" * 64},
    "reserve": lambda reg, pub: (
        pub.publish("A"),
        {
            "version_key": vk("B"),
            "digest": digest("B"),
            "lora_name": lora_name("B", digest("B")),
            "request_id": "r",
        },
    )[1],
    "record_prepared": lambda reg, pub: {
        "engine_id": "E0",
        "receipt": PreparedEvidence(vk("B"), _pending_b(reg, pub), pub.incarnation["E0"]),
    },
    "record_ready": lambda reg, pub: {
        "engine_id": "E0",
        "receipt": ReadyEvidence(vk("B"), digest("B"), _pending_b(reg, pub), pub.incarnation["E0"]),
    },
    "commit": lambda reg, pub: {
        "version_key": vk("B"),
        "attempt_token": _ready_b(reg, pub),
        "expected_default_revision": 1,
    },
    "abort": lambda reg, pub: {"attempt_token": _pending_b(reg, pub), "reason": "stray"},
    "record_cleanup": lambda reg, pub: (
        lambda token: {
            "engine_id": "E0",
            "attempt_token": token,
            "receipt": CleanupEvidence(token, pub.incarnation["E0"]),
        }
    )(_aborted_b(reg, pub)),
    "register_engine_incarnation": lambda reg, pub: (
        _ready_b(reg, pub),  # a new incarnation would drop E0's READY of the pending attempt
        {"engine_id": "E0", "incarnation": "E0-i9"},
    )[1],
    "mark_engine_unknown": lambda reg, pub: {
        "engine_id": "E0",
        "ref": _pending_b(reg, pub),
        "op": "begin",
        "reason": "stray",
    },
    "declare_engine_lost": lambda reg, pub: {"engine_id": "E1", "reason": "stray"},
    "claim_reclaim": lambda reg, pub: (_retired_a(reg, pub), {"version_key": vk("A")})[1],
    "confirm_reclaim": lambda reg, pub: {
        "version_key": vk("A"),
        "engine_id": "E0",
        "receipt": UnloadEvidence(_claimed_a(reg, pub), pub.incarnation["E0"]),
    },
}


def test_the_table_covers_every_publication_op_and_no_session_op() -> None:
    assert set(CASES) == set(PUBLISHER_OPS)
    assert set(PUBLISHER_OPS) <= set(MUTATING_OPS)
    for op in ("open_session", "bind_first", "begin_close", "close_and_release", "grant_lease", "end_leases"):
        assert op not in PUBLISHER_OPS, op  # what a rollout worker calls needs no token


@pytest.mark.parametrize("op", PUBLISHER_OPS)
@pytest.mark.parametrize(
    "given",
    [None, "wrong", "prefix", 12345, b"bytes"],
    ids=["no-token", "wrong-token", "right-prefix", "int", "bytes"],
)
def test_a_publication_op_without_the_publishers_token_is_refused_and_changes_nothing(
    op: str, given: Any
) -> None:
    reg = LoRAVersionRegistry(EPOCH, ENGINES)
    pub = Publisher(reg)
    kwargs = CASES[op](reg, pub)
    token = reg.publisher_token
    if given == "wrong":
        given = new_publisher_token()
    elif given == "prefix":  # all but the last character: compared whole, never by prefix
        given = token[:-1]
    before, raw, seq = reg.dump(), snapshot(reg), reg.seq

    err = refused(ErrorCode.NOT_PUBLISHER, getattr(reg, op), **kwargs, publisher_token=given)
    assert reg.dump() == before and snapshot(reg) == raw and reg.seq == seq
    assert err.http_status == 403 and err.details == {"op": op}
    assert token not in str(err) and token not in repr(err.parts())

    getattr(reg, op)(**kwargs, publisher_token=token)  # the publisher's call is accepted
    assert reg.seq == seq + 1, op
    reg.check_invariants(full=True)


def test_a_retry_without_the_token_gets_no_replayed_answer() -> None:
    """The token is checked before the idempotency lookup: a replay would hand a worker the
    attempt token (with it, the engines' begin and end) or a reclaim id."""
    reg = LoRAVersionRegistry(EPOCH, ENGINES)
    pub = Publisher(reg)
    receipt = pub.publish("A")
    res = pub.results["A"]
    args = (vk("A"), res.digest, res.lora_name, "req-A-A")
    refused(ErrorCode.NOT_PUBLISHER, reg.reserve, *args)
    refused(ErrorCode.NOT_PUBLISHER, reg.commit, vk("A"), res.attempt_token, 0)
    # the publisher's retries get the first answers
    assert reg.reserve(*args, publisher_token=reg.publisher_token) == res
    assert reg.commit(vk("A"), res.attempt_token, 0, publisher_token=reg.publisher_token) == receipt


def test_session_ops_need_no_token_and_no_query_returns_it() -> None:
    reg = LoRAVersionRegistry(EPOCH, ENGINES)
    Publisher(reg).publish("A")
    reg.grant_lease("w", 30.0, now=0.0)
    reg.open_session(sk("s"), lease_id="w")
    assert reg.bind_first(sk("s")).version_key == vk("A")
    reg.close_and_release(sk("s"))
    token = reg.publisher_token
    seen = [reg.dump(), reg.status(), reg.version(vk("A")), reg.sessions(include_closed=True), reg.lease("w")]
    assert all(token not in repr(answer) for answer in seen)
    assert token not in reg.dump()
    # a dump holds no token: a registry loaded from it has its own (the loader's)
    back = LoRAVersionRegistry.load(reg.dump())
    assert back.publisher_token != token
    refused(ErrorCode.NOT_PUBLISHER, back.claim_reclaim, vk("A"), publisher_token=token)
    assert LoRAVersionRegistry.load(reg.dump(), publisher_token=token).publisher_token == token


def test_a_registry_refuses_a_token_that_cannot_be_one() -> None:
    for bad in ("short", "x" * 300, "ü" * 20, 7):
        with pytest.raises(ValueError, match="publisher token") as info:
            LoRAVersionRegistry(EPOCH, ENGINES, publisher_token=bad)  # type: ignore[arg-type]
        assert str(bad) not in str(info.value)
    assert (
        LoRAVersionRegistry(EPOCH, ENGINES).publisher_token
        != LoRAVersionRegistry(EPOCH, ENGINES).publisher_token
    )


async def test_a_client_carries_the_token_of_the_registry_it_was_built_from_unless_told_not_to() -> None:
    reg = LoRAVersionRegistry(EPOCH, ENGINES)
    publisher, worker = RegistryClient.in_process(reg), RegistryClient.in_process(reg, as_publisher=False)
    assert publisher.is_publisher and not worker.is_publisher
    refused(ErrorCode.NOT_PUBLISHER, worker.register_engine_incarnation, "E0", "E0-i1")
    Publisher(publisher).publish("A")  # the client fills its token in
    assert worker.bind_first(sk("s")).version_key == vk("A")
    # a token the caller passes itself is kept (a wrong one is refused, never replaced)
    refused(ErrorCode.NOT_PUBLISHER, publisher.claim_reclaim, vk("A"), publisher_token=new_publisher_token())

    async_worker = await AsyncRegistryClient.in_process(reg, as_publisher=False).connect()
    async_publisher = await AsyncRegistryClient.in_process(reg).connect()
    with pytest.raises(Exception) as info:
        await async_worker.abort(attempt_token=reg.version(vk("A")).attempt_token, reason="stray")
    assert getattr(info.value, "code", None) is ErrorCode.NOT_PUBLISHER
    assert (await async_publisher.status()).default == vk("A")
    assert (await async_worker.close_and_release(session_key=sk("s"))).released
