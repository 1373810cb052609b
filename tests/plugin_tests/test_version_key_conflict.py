"""A version key names one adapter on an engine for its lifetime (design.md: same key, other
digest = VERSION_CONFLICT). Another digest gives another lora_name, so the name check alone
never saw it; the registry enforces it per epoch, the engine now does too."""

from __future__ import annotations

from test_version_table import LIMITS, begin_req, refused_without_trace, snap

from lora_contract.errors import ErrorCode
from sglang_ext.version_table import VersionTable


def test_the_same_version_key_with_another_digest_is_a_conflict_for_the_engines_life() -> None:
    table = VersionTable("inc", LIMITS)
    first = begin_req(snap(1), "7")
    table.begin(first)
    other = begin_req(snap(2), "7")  # same (epoch, version_id), other weights: another name
    assert other.lora_name != first.lora_name and other.version_key == first.version_key
    refused_without_trace(table, lambda: table.begin(other), ErrorCode.VERSION_CONFLICT)
    table.finish_cleanup(first.lora_name, first.attempt_token)  # even after a cleanup
    refused_without_trace(table, lambda: table.begin(other), ErrorCode.VERSION_CONFLICT)
    again = begin_req(snap(1), "7")  # the same key and digest, a new attempt: allowed
    assert table.begin(again).state == "PREPARED"
    assert table.begin(begin_req(snap(2), "8")).state == "PREPARED"  # another key: no conflict
