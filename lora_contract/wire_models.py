"""The base of the wire models shared by the plugin and the trainer side: one frozen pydantic
base, the constrained string types (from the name rules in :mod:`lora_contract.names`), and parsing
that turns every validation failure into a typed :class:`LoraVersionError`."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from pydantic_core import PydanticCustomError

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.names import NAME_PART, SHA256, TOKEN, parse_lora_name

Sha256Hex = Annotated[str, StringConstraints(pattern=rf"^{SHA256}$")]
NamePart = Annotated[str, StringConstraints(pattern=rf"^{NAME_PART}$")]
Token = Annotated[str, StringConstraints(pattern=rf"^{TOKEN}$")]
NonNegInt = Annotated[int, Field(ge=0)]


def _check_managed_name(name: str) -> str:
    if parse_lora_name(name) is None:
        raise ValueError(f"not a managed lora_name: {name!r} (expected prefix@epoch-version_id-digest12)")
    return name


LoraName = Annotated[str, AfterValidator(_check_managed_name)]

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class WireModel(BaseModel):
    model_config = _FROZEN


def mismatch(message: str) -> PydanticCustomError:
    # A validator error tagged with our code, so parse_model() reports MANIFEST_MISMATCH rather
    # than a generic INVALID_REQUEST for an internally inconsistent manifest or plan.
    return PydanticCustomError(ErrorCode.MANIFEST_MISMATCH.value, message)


def invalid(message: str, **details: Any) -> LoraVersionError:
    return LoraVersionError(ErrorCode.INVALID_REQUEST, message, **details)


M = TypeVar("M", bound=BaseModel)


def to_version_error(exc: ValidationError, what: str) -> LoraVersionError:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    # A validator tagged with one of our codes (e.g. MANIFEST_MISMATCH) decides the code.
    codes = [ErrorCode(e["type"]) for e in errors if e["type"] in ErrorCode.__members__]
    code = codes[0] if codes else ErrorCode.INVALID_REQUEST
    details = [{"loc": [str(p) for p in e["loc"]], "msg": e["msg"]} for e in errors[:20]]
    return LoraVersionError(code, f"invalid {what}: {details[0]['msg'] if details else exc}", errors=details)


def validate_data(validate_json: Any, validate_python: Any, data: Any, what: str) -> Any:
    try:
        if isinstance(data, bytes | bytearray | str):
            return validate_json(data)
        return validate_python(data)
    except ValidationError as exc:
        raise to_version_error(exc, what) from None


def parse_model(model: type[M], data: Any) -> M:
    """Validate JSON text/bytes or a dict into ``model``; failures are LoraVersionError
    (INVALID_REQUEST, or MANIFEST_MISMATCH for an inconsistent manifest or plan)."""
    return validate_data(model.model_validate_json, model.model_validate, data, model.__name__)
