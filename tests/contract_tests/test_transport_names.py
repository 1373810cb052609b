"""The transport a bucket uses is a name registered at the contract (issue 37, item 4): the
messages carry any registered name and refuse any other (INVALID_REQUEST, as the closed set of
names did), and what they carry for HTTP and the collective is the same bytes as before the
registry (old clients keep working)."""

from __future__ import annotations

import pytest

from lora_contract import protocol as p
from lora_contract.errors import ErrorCode, LoraVersionError

NAME = p.make_lora_name(p.DEFAULT_LORA_PREFIX, "e1", "v1", "a" * 64)


def meta(**over: str) -> p.ReceiveBucketMeta:
    return p.ReceiveBucketMeta(lora_name=NAME, attempt_token="tok1", index=2, sha256="0" * 64, **over)


def test_http_and_collective_bucket_headers_are_the_bytes_they_were() -> None:
    base = {
        "X-Lora-Name": NAME,
        "X-Attempt-Token": "tok1",
        "X-Bucket-Index": "2",
        "X-Bucket-Sha256": "0" * 64,
        "Content-Type": "application/octet-stream",
    }
    assert meta().to_headers() == base  # HTTP: the body is the bucket, no transport header
    assert meta(transport="collective").to_headers() == {**base, "X-Bucket-Transport": "collective"}
    # what a client of before the registry sends parses as it did
    assert (
        p.ReceiveBucketMeta.from_headers({**base, "X-Bucket-Transport": "collective"}).transport
        == "collective"
    )
    assert p.ReceiveBucketMeta.from_headers(base).transport == p.HTTP_TRANSPORT


def test_begin_carries_the_transport_as_the_same_json_field() -> None:
    body = {
        "lora_name": NAME,
        "version_key": {"epoch": "e1", "version_id": "v1"},
        "digest": "a" * 64,
        "attempt_token": "tok1",
        "transport": "collective",
    }
    # the field is validated before the manifest's checks run: an unknown name is refused by
    # itself, a known one only by the (here absent) manifest
    with pytest.raises(LoraVersionError) as err:
        p.parse_model(p.BeginRequest, {**body, "transport": "pigeon"})
    assert err.value.code is ErrorCode.INVALID_REQUEST
    assert any(e["loc"] == ["transport"] for e in err.value.details["errors"])
    with pytest.raises(LoraVersionError) as err:
        p.parse_model(p.BeginRequest, body)
    assert not any(e["loc"] == ["transport"] for e in err.value.details["errors"])
    assert p.BeginRequest.model_fields["transport"].default == "http"


def test_a_registered_name_travels_and_an_unregistered_one_is_invalid() -> None:
    with pytest.raises(LoraVersionError) as err:
        p.ReceiveBucketMeta.from_headers({**meta().to_headers(), "X-Bucket-Transport": "carrier-pigeon"})
    assert err.value.code is ErrorCode.INVALID_REQUEST
    p.register_transport("carrier-pigeon")
    travelled = meta(transport="carrier-pigeon")
    assert travelled.to_headers()["X-Bucket-Transport"] == "carrier-pigeon"
    assert p.ReceiveBucketMeta.from_headers(travelled.to_headers()) == travelled
    # out of band means no local source beside it: a bucket comes from one place
    with pytest.raises(LoraVersionError) as err:
        p.ReceiveBucketMeta.from_headers({**travelled.to_headers(), p.BUCKET_SOURCE_HEADER: "f.safetensors"})
    assert err.value.code is ErrorCode.INVALID_REQUEST
    # naming the default is not a message any client sends
    with pytest.raises(LoraVersionError) as err:
        p.ReceiveBucketMeta.from_headers({**meta().to_headers(), "X-Bucket-Transport": "http"})
    assert err.value.code is ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize("bad", ["", "Pigeon", "pi geon", "-pigeon", "p" * 33, "pigeon\n"])
def test_a_transport_name_outside_the_rule_cannot_be_registered(bad: str) -> None:
    with pytest.raises(ValueError):
        p.register_transport(bad)
    assert bad not in p.registered_transports()
