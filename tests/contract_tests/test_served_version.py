"""The wire shape of what served a reply (issue 39): spans from per-token entries, and the check
the session layer makes against a binding."""

from __future__ import annotations

import pytest

from lora_contract.names import make_lora_name
from lora_contract.served_version import (
    BASE_MODEL,
    LAST_KEY,
    SERVED_TOKENS_KEY,
    SPANS_KEY,
    ServedSpan,
    attach_served_versions,
    read_served_spans,
    served_spans,
    served_version_problem,
    versions_of,
)

DA, DB = "a" * 64, "b" * 64
A = make_lora_name("p", "e1", "v1", DA)
B = make_lora_name("p", "e1", "v2", DB)
DIGESTS = {A: DA, B: DB}


def attached(entries: list) -> dict:
    meta = {"id": "r", SERVED_TOKENS_KEY: entries}
    attach_served_versions(meta, DIGESTS.get)
    return meta


def test_runs_of_equal_entries_become_spans_in_the_weight_versions_shape():
    meta = attached([A, A, B, BASE_MODEL, "plain", None, None])
    assert SERVED_TOKENS_KEY not in meta and meta[LAST_KEY] is None
    assert [(s["version"], s["start"], s["end"], s["adapter"]) for s in meta[SPANS_KEY]] == [
        (A, 0, 2, "managed"),
        (B, 2, 3, "managed"),
        (None, 3, 4, "base"),
        ("plain", 4, 5, "unmanaged"),
        (None, 5, 7, "unattested"),
    ]
    first = meta[SPANS_KEY][0]
    assert (first["epoch"], first["version_id"], first["digest"]) == ("e1", "v1", DA)
    assert {"version", "start", "end"} <= set(first)  # what a weight_versions parser reads


def test_no_entries_no_spans():
    meta = attached([])
    assert meta[SPANS_KEY] == [] and meta[LAST_KEY] is None
    assert served_spans([], DIGESTS.get) == []


def test_a_reply_all_of_the_binding_passes():
    meta = attached([A] * 5)
    assert served_version_problem(meta, A, DA, output_tokens=5) is None
    assert served_version_problem(meta, A, DA) is None
    assert versions_of(read_served_spans(meta) or ()) == (A,)
    assert served_version_problem(attached([]), A, DA, output_tokens=0) is None  # no token yet


@pytest.mark.parametrize(
    ("entries", "digest", "tokens", "said"),
    [
        ([A, A, B], DA, 3, "tokens [2, 3) by " + B),
        ([BASE_MODEL] * 3, DA, 3, "by base"),
        (["plain"] * 3, DA, 3, "by plain"),
        ([None] * 3, DA, 3, "by unattested"),
        ([A] * 3, DB, 3, "digest aaaaaaaaaaaa"),  # the right name, another digest
        ([A] * 2, DA, 3, "covers 2 tokens, the reply has 3"),
    ],
)
def test_anything_but_the_binding_for_every_token_is_a_problem(entries, digest, tokens, said):
    problem = served_version_problem(attached(entries), A, digest, output_tokens=tokens)
    assert problem is not None and said in problem


def test_a_reply_without_an_attestation_is_a_problem():
    assert "no 'lora_versions'" in (served_version_problem({"id": "r"}, A, DA) or "")
    assert "no meta_info" in (served_version_problem(None, A, DA) or "")
    assert served_version_problem({SPANS_KEY: [{"version": A}, "x"]}, A, DA) is not None
    unknown_digest = {SPANS_KEY: [ServedSpan(A, 0, 1, "managed", "e1", "v1", None).to_wire()]}
    assert "digest unknown" in (served_version_problem(unknown_digest, A, DA) or "")
