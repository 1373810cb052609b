"""The typed error crosses every boundary through one factory (LoraVersionError.parts and
from_parts): a JSON body (HTTP), a registry actor envelope (Ray) and a pickle (multiprocessing)
each give back the same code, message and details."""

from __future__ import annotations

import pickle

import pytest

from lora_contract.errors import HTTP_STATUS, ErrorCode, LoraVersionError
from relax_glue.actor import _refused, _unwrap


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_round_trips_through_every_encoding(code: ErrorCode) -> None:
    err = LoraVersionError(code, f"{code.value} happened", lora_name="p@e-v", held=["a", "b"])
    rebuilt = [
        LoraVersionError.from_body(err.to_body()),
        pickle.loads(pickle.dumps(err)),
    ]
    with pytest.raises(LoraVersionError) as raised:
        _unwrap(_refused(err))
    rebuilt.append(raised.value)
    for other in rebuilt:
        assert other is not None and other.parts() == err.parts()
        assert other.http_status == HTTP_STATUS[code] and str(other) == str(err)


def test_a_body_that_is_not_ours_is_not_an_error() -> None:
    for body in (None, [], {"error": "x"}, {"error": {"message": "no code"}}, {"error": {"code": "NOPE"}}):
        assert LoraVersionError.from_body(body) is None


def test_an_envelope_of_an_unknown_operation_is_a_typed_refusal() -> None:
    from relax_glue.actor import _call_envelope

    with pytest.raises(LoraVersionError) as raised:
        _unwrap(_call_envelope(object(), "drop_everything", {}))
    assert raised.value.code is ErrorCode.INVALID_REQUEST
