"""Fast unit tests of the request rules in ``tokenizer_hooks`` (the engine tests prove them over
HTTP on real engines; these pin the rule itself so a mutation fails in milliseconds)."""

from __future__ import annotations

import types

import pytest

from sglang_ext.tokenizer_hooks import INTERNAL_FIELDS, forbidden_fields, raw_forbidden_fields

LORA_ID = "0123456789abcdef0123456789abcdef"  # the shape of SGLang's lora_id (uuid4().hex)


def req(**fields: object) -> types.SimpleNamespace:
    base = dict.fromkeys(INTERNAL_FIELDS)
    base["extra_key"] = None
    return types.SimpleNamespace(**{**base, **fields})


def test_a_plain_request_is_allowed() -> None:
    assert forbidden_fields(req(extra_key="tenant-7")) == []
    assert forbidden_fields(req(extra_key=["a", "b"])) == []


@pytest.mark.parametrize("field", INTERNAL_FIELDS)
def test_every_engine_set_field_is_forbidden(field: str) -> None:
    assert forbidden_fields(req(**{field: "x"})) == [field]


def test_lora_id_is_forbidden_even_when_empty() -> None:
    assert forbidden_fields(req(lora_id="")) == ["lora_id"]


@pytest.mark.parametrize(
    "extra_key",
    [LORA_ID, f"tenant{LORA_ID}", ["ok", f"x{LORA_ID}"]],
)
def test_an_extra_key_ending_like_a_lora_id_is_forbidden(extra_key: object) -> None:
    # Req.extra_key = extra_key + lora_id: such a base request would share an adapter's cache.
    assert forbidden_fields(req(extra_key=extra_key)) == ["extra_key"]


@pytest.mark.parametrize("extra_key", [LORA_ID[:-1], f"{LORA_ID}-x", LORA_ID.upper(), ["a", None]])
def test_an_extra_key_that_does_not_end_like_a_lora_id_is_allowed(extra_key: object) -> None:
    assert forbidden_fields(req(extra_key=extra_key)) == []


@pytest.mark.parametrize("field", [*INTERNAL_FIELDS, "received_time", "positional_embed_overrides"])
@pytest.mark.parametrize("value", ["x", 0, 0.0, False, "", [], {}])
def test_a_raw_body_may_not_set_an_internal_field(field: str, value: object) -> None:
    # 0 and false are not null: only the field's exact upstream default is "not set".
    assert raw_forbidden_fields({"text": "hi", field: value}) == [field]


@pytest.mark.parametrize("value", [True, 1, 0, None, "false"])
def test_return_bytes_is_refused_unless_false(value: object) -> None:
    assert raw_forbidden_fields({"text": "hi", "return_bytes": value}) == ["return_bytes"]


def test_fields_at_their_upstream_default_are_accepted() -> None:
    # What a re-serializing gateway writes (smg 1.13.0 with retries on adds "return_bytes": false).
    body = {"text": "hi", "return_bytes": False, "lora_id": None, "received_time": None}
    assert raw_forbidden_fields(body) == []
    assert raw_forbidden_fields({"text": "hi"}) == []
