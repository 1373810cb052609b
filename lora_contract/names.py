"""The name rules of managed versions, in one dependency-free module (only ``re``).

Shared by the wire protocol (pydantic models), the engine and the trainer-side registry, which
must stay free of pydantic and torch. One definition each of: a name part (epoch, version_id,
prefix), a token (attempt tokens, reclaim ids, incarnations, refs), a sha256 digest, the managed
``lora_name`` shape, and how many managed versions may hold capacity at once.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from lora_contract.errors import ErrorCode, LoraVersionError

# The RFC's capacity: at most two managed versions hold a slot. It is the default of capacity K, set
# per epoch (the registry's capacity=K); the registry's slots and each engine's pins follow K.
MANAGED_CAPACITY = 2

NAME_PART = r"[A-Za-z0-9_.]{1,64}"
# Tokens and ids travel in HTTP headers and logs: a header-safe charset, bounded length.
TOKEN = r"[A-Za-z0-9_.\-]{1,128}"
SHA256 = r"[0-9a-f]{64}"
DIGEST_PREFIX_LEN = 12

# Always used with fullmatch: '$' would also accept a trailing newline.
NAME_PART_RE = re.compile(NAME_PART)
TOKEN_RE = re.compile(TOKEN)
SHA256_RE = re.compile(SHA256)
# The only definition of the managed name shape. '-' and '@' are excluded from every part, so
# '@' splits the prefix off and '-' splits epoch / version_id / digest prefix unambiguously.
LORA_NAME_RE = re.compile(
    rf"(?P<prefix>{NAME_PART})@(?P<epoch>{NAME_PART})-(?P<version_id>{NAME_PART})"
    rf"-(?P<digest_prefix>[0-9a-f]{{{DIGEST_PREFIX_LEN}}})"
)


class ParsedLoraName(NamedTuple):
    prefix: str
    epoch: str
    version_id: str
    digest_prefix: str


def _invalid(message: str) -> LoraVersionError:
    return LoraVersionError(ErrorCode.INVALID_REQUEST, message)


def name_part(field: str, value: str | int) -> str:
    """``value`` as a name part; ints are accepted (3 and "3" are the same key on the wire)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # negative ints carry '-' and are refused below
    if not isinstance(value, str) or not NAME_PART_RE.fullmatch(value):
        raise _invalid(f"{field} must match [A-Za-z0-9_.]{{1,64}}, got {value!r}")
    return value


def make_lora_name(prefix: str, epoch: str | int, version_id: str | int, digest: str) -> str:
    """``f"{prefix}@{epoch}-{version_id}-{digest[:12]}"``; parts are [A-Za-z0-9_.]{1,64}, so the
    name never holds ':' (OpenAI model="base:adapter"), '/', '-' inside a part, or whitespace."""
    parts = (name_part("prefix", prefix), name_part("epoch", epoch), name_part("version_id", version_id))
    if not isinstance(digest, str) or not SHA256_RE.fullmatch(digest):
        raise _invalid(f"digest must be 64 lowercase hex characters, got {digest!r}")
    return f"{parts[0]}@{parts[1]}-{parts[2]}-{digest[:DIGEST_PREFIX_LEN]}"


def parse_lora_name(name: str) -> ParsedLoraName | None:
    """The parts of a managed name, or None when ``name`` is not one."""
    match = LORA_NAME_RE.fullmatch(name) if isinstance(name, str) else None
    return ParsedLoraName(**match.groupdict()) if match else None


def is_managed_name(name: str, prefix: str | None = None) -> bool:
    """True for a name of our format (optionally with this exact prefix)."""
    parsed = parse_lora_name(name)
    return parsed is not None and (prefix is None or parsed.prefix == prefix)
