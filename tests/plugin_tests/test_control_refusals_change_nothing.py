"""Every 4xx of the control routes leaves the engine as it was (issue 36; the contract: a refusal
means nothing changed, lora_contract/errors.py), with the one exception docs/serving.md states.

The real routes (sglang_ext.http_routes) and services over the real version table, on the
in-memory native edge (tests/_fake_native.py). One engine holds a version in every state a
refusal can meet; each row sends one bad call and compares the engine before and after: the
version table (records, tombstones, owners, keys), SGLang's side (names, counts, loaded ids,
unloads) and the staged files."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from _publication_shell import Shell

from lora_contract.errors import HTTP_STATUS, ErrorCode, LoraVersionError
from lora_contract.protocol import ReceiveBucketMeta, Routes

CAPACITY = 6  # exactly the slots the world below holds: one more begin is CAPACITY_ERROR


@dataclass
class EngineInEveryState:
    """One engine (the real routes over the shell) holding a version in every state a refusal can
    meet, by role; :meth:`snapshot` is everything a refusal must leave as it was."""

    shell: Shell
    client: httpx.AsyncClient
    names: dict[str, str]  # role -> lora_name
    tokens: dict[str, str]  # role -> attempt token

    def snapshot(self) -> Any:
        t, n = self.shell.table, self.shell.native
        staged = sorted(str(p) for p in self.shell.publication.staging.root.rglob("*"))
        return copy.deepcopy(
            (
                t.versions,
                t.cleaned,
                t.attempt_owner,
                t.key_digest,
                n.registry,
                n.counters,
                sorted(n.loaded),
                dict(n.unloads),
                staged,
            )
        )


async def engine_in_every_state(monkeypatch) -> EngineInEveryState:
    from fastapi import FastAPI

    import sglang_ext.http_routes as http_routes

    shell = Shell(managed_capacity=CAPACITY)
    monkeypatch.setattr(http_routes, "engine_state", lambda: shell.state)
    app = FastAPI()
    http_routes.install(app, shell.state)
    names, tokens = {}, {}

    async def staged(role: str, seed: int) -> None:
        names[role], tokens[role] = await shell.stage(seed)

    await staged("ready", 1)
    await shell.end(names["ready"], tokens["ready"])
    await staged("staged", 2)  # every bucket in, not ended
    begun = shell.snapshots[2].begin_request("p", "e", "v3", uuid.uuid4().hex)
    await shell.publication.begin(begun)  # begun, no bucket yet
    names["begun"], tokens["begun"] = begun.lora_name, begun.attempt_token
    await staged("cleaned", 4)
    await shell.cleanup(names["cleaned"], tokens["cleaned"])
    await staged("reclaiming", 5)
    await shell.end(names["reclaiming"], tokens["reclaiming"])
    shell.native.acquire(names["reclaiming"])  # a request still holds it: the reclaim drains
    await shell.reclaim(names["reclaiming"], "r1")
    await staged("failed", 6)
    shell.native.fail_next("probe")
    shell.native.fail_next("physical_unload")
    with pytest.raises(LoraVersionError):
        await shell.end(names["failed"], tokens["failed"])
    await staged("negative", 7)
    await shell.end(names["negative"], tokens["negative"])
    shell.native.release(shell.native.lora_id_of(names["negative"]))  # a release nobody acquired
    states = {role: shell.table.get(name).state.value for role, name in names.items()}
    assert states == {
        "ready": "READY_LOCAL",
        "staged": "PREPARED",
        "begun": "PREPARED",
        "cleaned": "CLEANED",
        "reclaiming": "RECLAIMING",
        "failed": "FAILED",
        "negative": "READY_LOCAL",
    }
    assert shell.table.slots_in_use() == CAPACITY
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")
    return EngineInEveryState(shell, client, names, tokens)


# ------------------------------------------------------------------------------ the calls


def begin_of(
    w: EngineInEveryState, seed: int, version_id: str, token: str | None = None, **update: Any
) -> dict:
    snap = w.shell.snapshots.get(seed) or w.shell.snapshot(seed)
    req = snap.begin_request("p", "e", version_id, token or uuid.uuid4().hex)
    return req.model_copy(update=update).model_dump(mode="json")


def post_json(route: str, body: Callable[[EngineInEveryState], Any]) -> Callable[[EngineInEveryState], Any]:
    async def call(w: EngineInEveryState) -> httpx.Response:
        b = body(w)
        content = b if isinstance(b, bytes) else json.dumps(b).encode()
        return await w.client.post(route, content=content, headers={"content-type": "application/json"})

    return call


def bucket(
    role: str, *, index: int = 0, sha: str | None = None, **extra: str
) -> Callable[[EngineInEveryState], Any]:
    async def call(w: EngineInEveryState) -> httpx.Response:
        seed = {"begun": 2, "ready": 1, "cleaned": 4, "staged": 2}[role]
        [b] = list(w.shell.snapshots[seed].iter_buckets())
        meta = ReceiveBucketMeta(
            lora_name=w.names[role], attempt_token=w.tokens[role], index=index, sha256=sha or b.sha256
        )
        headers = httpx.Headers(meta.to_headers())
        for k, value in extra.items():
            headers[k] = value  # replaces a header of that name, whatever its case
        return await w.client.post(Routes.RECEIVE_BUCKET, content=b.payload, headers=headers)

    return call


def named(role: str, token_of: str | None = None, **extra: Any) -> Callable[[EngineInEveryState], dict]:
    def body(w: EngineInEveryState) -> dict:
        token = w.tokens[token_of or role] if token_of != "new" else uuid.uuid4().hex
        return {"lora_name": w.names[role], "attempt_token": token, **extra}

    return body


def reclaim_of(
    role: str, reclaim_id: str = "r2", timeout_s: float = 0.05
) -> Callable[[EngineInEveryState], dict]:
    return lambda w: {"lora_name": w.names[role], "reclaim_id": reclaim_id, "timeout_s": timeout_s}


ROWS: dict[str, tuple[Callable[[EngineInEveryState], Any], ErrorCode]] = {
    # begin
    "begin: not JSON": (post_json(Routes.BEGIN, lambda w: b"{not json"), ErrorCode.INVALID_REQUEST),
    "begin: a READY version under another attempt": (
        post_json(Routes.BEGIN, lambda w: begin_of(w, 1, "v1")),
        ErrorCode.NOT_ATTEMPT_OWNER,
    ),
    "begin: a cleaned attempt again": (
        post_json(Routes.BEGIN, lambda w: begin_of(w, 4, "v4", w.tokens["cleaned"])),
        ErrorCode.STALE_ATTEMPT,
    ),
    "begin: a version key with another digest": (
        post_json(Routes.BEGIN, lambda w: begin_of(w, 2, "v1")),
        ErrorCode.VERSION_CONFLICT,
    ),
    "begin: a version another attempt is staging": (
        post_json(Routes.BEGIN, lambda w: begin_of(w, 2, "v2")),
        ErrorCode.PUBLICATION_IN_PROGRESS,
    ),
    "begin: another base model": (
        post_json(Routes.BEGIN, lambda w: begin_of(w, 8, "v8", base_fingerprint="a" * 64)),
        ErrorCode.BASE_MISMATCH,
    ),
    "begin: every slot in use": (
        post_json(Routes.BEGIN, lambda w: begin_of(w, 8, "v8")),
        ErrorCode.CAPACITY_ERROR,
    ),
    "begin: a transport this engine has not": (
        post_json(Routes.BEGIN, lambda w: begin_of(w, 8, "v8", transport="collective")),
        ErrorCode.TRANSPORT_UNAVAILABLE,
    ),
    "begin: an attempt token of another version": (
        post_json(Routes.BEGIN, lambda w: begin_of(w, 8, "v8", w.tokens["ready"])),
        ErrorCode.ATTEMPT_MISMATCH,
    ),
    "begin: a FAILED version again": (
        post_json(Routes.BEGIN, lambda w: begin_of(w, 6, "v6", w.tokens["failed"])),
        ErrorCode.LOAD_FAILED,
    ),
    # receive_bucket
    "bucket: not safetensors": (
        bucket("begun", **{"content-type": "application/json"}),
        ErrorCode.INVALID_REQUEST,
    ),
    "bucket: another sha256": (bucket("begun", sha="0" * 64), ErrorCode.CHECKSUM_MISMATCH),
    "bucket: outside the plan": (bucket("begun", index=1), ErrorCode.BUCKET_OUT_OF_ORDER),
    "bucket: of a cleaned attempt": (bucket("cleaned"), ErrorCode.STALE_ATTEMPT),
    "bucket: declared larger than its cap": (
        bucket("begun", **{"content-length": str(10**12)}),
        ErrorCode.PAYLOAD_TOO_LARGE,
    ),
    # end
    "end: not JSON": (post_json(Routes.END, lambda w: b"[]"), ErrorCode.INVALID_REQUEST),
    "end: before every bucket": (post_json(Routes.END, named("begun")), ErrorCode.MANIFEST_MISMATCH),
    "end: an attempt never begun": (post_json(Routes.END, named("staged", "new")), ErrorCode.STALE_ATTEMPT),
    "end: an attempt token of another version": (
        post_json(Routes.END, named("staged", "ready")),
        ErrorCode.ATTEMPT_MISMATCH,
    ),
    "end: a FAILED version again": (post_json(Routes.END, named("failed")), ErrorCode.LOAD_FAILED),
    # cleanup
    "cleanup: not JSON": (post_json(Routes.CLEANUP, lambda w: b"{"), ErrorCode.INVALID_REQUEST),
    "cleanup: a READY version by a token that holds nothing": (
        post_json(Routes.CLEANUP, named("ready", "new")),
        ErrorCode.NOT_ATTEMPT_OWNER,
    ),
    "cleanup: another version than its token's": (
        post_json(Routes.CLEANUP, named("staged", "ready")),
        ErrorCode.ATTEMPT_MISMATCH,
    ),
    "cleanup: a version under reclaim": (
        post_json(Routes.CLEANUP, named("reclaiming")),
        ErrorCode.VERSION_RECLAIMED,
    ),
    "cleanup: a count below zero": (
        post_json(Routes.CLEANUP, named("negative")),
        ErrorCode.IN_FLIGHT_ANOMALY,
    ),
    # reclaim
    "reclaim: not JSON": (post_json(Routes.RECLAIM, lambda w: b"null"), ErrorCode.INVALID_REQUEST),
    "reclaim: a negative timeout": (
        post_json(Routes.RECLAIM, reclaim_of("ready", timeout_s=-1)),
        ErrorCode.INVALID_REQUEST,
    ),
    "reclaim: a version still staging": (
        post_json(Routes.RECLAIM, reclaim_of("staged")),
        ErrorCode.VERSION_NOT_READY,
    ),
    "reclaim: a FAILED version": (
        post_json(Routes.RECLAIM, reclaim_of("failed")),
        ErrorCode.VERSION_NOT_READY,
    ),
    "reclaim: under another reclaim id": (
        post_json(Routes.RECLAIM, reclaim_of("reclaiming")),
        ErrorCode.STALE_ATTEMPT,
    ),
    "reclaim: a count below zero": (
        post_json(Routes.RECLAIM, reclaim_of("negative")),
        ErrorCode.IN_FLIGHT_ANOMALY,
    ),
}


@pytest.mark.parametrize("row", list(ROWS))
async def test_a_refused_control_call_leaves_the_engine_as_it_was(monkeypatch, row: str):
    call, code = ROWS[row]
    w = await engine_in_every_state(monkeypatch)
    try:
        before = w.snapshot()
        r = await call(w)
        assert r.status_code == HTTP_STATUS[code] and 400 <= r.status_code < 500, (r.status_code, r.text)
        assert r.json()["error"]["code"] == code.value, r.text
        assert w.snapshot() == before, f"{row}: the refusal changed the engine"
    finally:
        await w.client.aclose()


def test_the_rows_cover_every_control_route():
    routes = {row.split(":")[0] for row in ROWS}
    assert routes == {"begin", "bucket", "end", "cleanup", "reclaim"}


# ------------------------------------------------------------------ end after a failed load


def visible(w: EngineInEveryState, role: str) -> dict:
    v = w.shell.table.get(w.names[role])
    status = w.shell.table.status_of(v, w.shell.native.in_flight(v.lora_id)).model_dump(mode="json")
    return {k: x for k, x in status.items() if k != "updated_at"}


async def test_an_end_whose_load_is_taken_back_out_changes_nothing_the_caller_can_see(monkeypatch):
    """The probe failed and its load was removed again: LOAD_FAILED, and the version is as the
    end found it (PREPARED, no id, nothing loaded or registered), so the same end may be sent
    again."""
    w = await engine_in_every_state(monkeypatch)
    try:
        before = visible(w, "staged")
        loaded = sorted(w.shell.native.loaded)
        w.shell.native.fail_next("probe")
        r = await post_json(Routes.END, named("staged"))(w)
        assert r.status_code == 422 and r.json()["error"]["code"] == "LOAD_FAILED", r.text
        assert visible(w, "staged") == before and sorted(w.shell.native.loaded) == loaded
        assert w.names["staged"] not in w.shell.native.registry
        again = await post_json(Routes.END, named("staged"))(w)
        assert again.status_code == 200 and again.json()["state"] == "READY_LOCAL", again.text
    finally:
        await w.client.aclose()


async def test_the_one_refusal_that_changes_state_says_so_and_every_repeat_answers_the_same(monkeypatch):
    """The exception (docs/serving.md): an end whose load stays loaded because its removal
    failed. The version is FAILED after the refusal, not PREPARED as before; the refusal says
    so (state FAILED, the leftover id), every repeat of the end answers the identical refusal
    and changes nothing more, and only the attempt's cleanup frees the slot."""
    w = await engine_in_every_state(monkeypatch)
    try:
        w.shell.native.fail_next("probe")
        w.shell.native.fail_next("physical_unload")
        r = await post_json(Routes.END, named("staged"))(w)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        v = w.shell.table.get(w.names["staged"])
        assert error["code"] == "LOAD_FAILED" and error["state"] == "FAILED", error
        assert error["leftover_lora_id"] == v.lora_id and v.lora_id in w.shell.native.loaded
        before = w.snapshot()
        again = await post_json(Routes.END, named("staged"))(w)
        assert again.status_code == 422 and again.json()["error"] == error
        assert w.snapshot() == before
        cleaned = await post_json(Routes.CLEANUP, named("staged"))(w)
        assert cleaned.status_code == 200 and cleaned.json()["state"] == "CLEANED", cleaned.text
        assert v.lora_id is None and w.shell.table.slots_in_use() == CAPACITY - 1
    finally:
        await w.client.aclose()
