"""What a session makes of an engine's answer to ``n > 1`` (parallel sampling) beyond the happy
path: a streamed group whose samples' chunks interleave and where only some samples are aborted,
and an engine that answers another number of completions than asked.

The session, registry, publisher and engine client are the real ones (the version is published
on ``_fake_engine`` engines, as in test_sessions); for the generation itself the session talks
through a REAL :class:`EngineClient` to a scripted ``/generate`` (``httpx.MockTransport``) that
answers as SGLang 0.5.23's ``_stream_batch_responses`` does: one SSE chunk at a time, each with
the ``index`` of its sample and the sample's own rid in ``meta_info.id``, the sample's finish
reason on its last chunk. The engine tests (test_parallel_sampling_engines.py) prove the engine
side; these pin the assembly rules so that a mutation fails in milliseconds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _fake_engine import Cluster, make_cluster, make_snapshot
from _in_process_world import InProcessWorld
from _rg_helpers import EPOCH

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.served_version import SERVED_TOKENS_KEY, attach_served_versions
from relax_glue.engine_client import EngineClient
from relax_glue.registry_types import VersionKey

SNAP = make_snapshot(seed=0)
NAME = SNAP.lora_name("relax_policy_lora", EPOCH, "A")
BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
HEX = "0123456789abcdef0123456789abcdef"


def attested(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` saying its one token was served by the bound version, as the plugin says it."""
    out = {**meta, SERVED_TOKENS_KEY: [NAME]}
    attach_served_versions(out, {NAME: SNAP.digest}.get)
    return out


def chunk(rid: str, index: int, text: str, finish: str | None = None) -> dict[str, Any]:
    """One SSE chunk of sample ``index`` of request ``rid`` (SGLang's shape under the plugin's
    sample rids: ``{rid}_0-{uuid}``)."""
    meta: dict[str, Any] = {"id": f"{rid}_0-{HEX[:-1]}{index}", "finish_reason": None}
    if finish is not None:
        meta["finish_reason"] = {"type": finish}
    return {"text": text, "output_ids": [index], "index": index, "meta_info": attested(meta)}


class ScriptedGenerate:
    """``/generate`` as a script: ``stream(rid)`` gives the chunks of a streamed request,
    ``reply(rid, n)`` the JSON of a non-streamed one. Keeps every body it received."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.stream: Any = None
        self.reply: Any = None

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        n = body["sampling_params"].get("n", 1)
        if body.get("stream"):
            lines = [f"data: {json.dumps(c)}\n\n" for c in self.stream(body["rid"])]
            return httpx.Response(200, text="".join(lines) + "data: [DONE]\n\n")
        return httpx.Response(200, json=self.reply(body["rid"], n))


class World(InProcessWorld):
    """The version is published on the fake engines; the sessions generate through ``scripted``."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster=cluster)
        self.script = ScriptedGenerate()
        transport = httpx.MockTransport(self.script.handler)
        # every engine id answers generations through the script (the router picks one)
        self.scripted = {
            e: EngineClient(
                e, f"http://{e}.mock", generation_transport=transport, control_transport=transport
            )
            for e in cluster.clients
        }
        self.mgr = self.sessions(engines=self.scripted, drain_timeout_s=1.0, abort_interval_s=0.02)

    def refs(self) -> int:
        return self.reg.version(VersionKey(EPOCH, "A")).session_refs

    def audit(self) -> list[Any]:
        return [e for c in self.scripted.values() for e in c.audit.entries() if e.op.startswith("generate")]


@pytest.fixture()
async def world() -> Iterator[World]:
    w = World(make_cluster())
    assert (await w.pub.publish(SNAP, "A")).ok
    yield w
    for c in w.scripted.values():
        await c.aclose()
    await w.cluster.aclose()


def interleaved(rid: str, finishes: list[str]) -> list[dict[str, Any]]:
    """Three rounds of chunks over the samples, in a mixed order; sample i ends with
    ``finishes[i]``, and the samples end in index order, the last one last."""
    n = len(finishes)
    first = [chunk(rid, i, "a") for i in reversed(range(n))]
    second = [chunk(rid, i, "ab") for i in range(n)]
    last = [chunk(rid, i, "abc", finishes[i]) for i in range(n)]
    return first + second + last


@pytest.mark.parametrize(
    ("finishes", "outcome"),
    [
        (["length", "abort", "stop"], "aborted"),  # one sample aborted, in the middle
        (["abort", "stop", "length"], "aborted"),  # aborted first, every later chunk fine
        (["stop", "length", "abort"], "aborted"),  # aborted last
        (["stop", "length", "stop"], "ok"),
    ],
)
async def test_a_streamed_group_with_some_samples_aborted_is_an_aborted_turn_with_every_chunk(
    world: World, finishes: list[str], outcome: str
) -> None:
    world.script.stream = lambda rid: interleaved(rid, finishes)
    s = await world.mgr.open()
    got = [c async for c in s.generate_stream({**BODY, "sampling_params": {"n": 3}}, rid="g")]
    assert got == interleaved("g", finishes)  # every chunk of every sample, in arrival order
    last = {
        c["index"]: c["meta_info"]["finish_reason"]["type"] for c in got if c["meta_info"]["finish_reason"]
    }
    assert last == dict(enumerate(finishes))  # each sample's own result
    (sent,) = world.script.bodies
    assert sent["sampling_params"]["n"] == 3 and sent["lora_path"] == NAME and sent["rid"] == "g"
    # the turn is ABORTED when any sample was (its completions are not all results)
    assert [(r.rid, r.outcome) for r in s.requests] == [("g", outcome)]
    assert s.in_flight == () and s.unknown_turns == ()  # nothing left behind
    assert world.refs() == 1
    view = await s.close()
    assert view.released and world.refs() == 0  # the session's one ref, released once


async def test_the_engine_clients_audit_of_a_streamed_group_names_an_aborted_sample(world: World) -> None:
    world.script.stream = lambda rid: interleaved(rid, ["abort", "stop", "length"])
    s = await world.mgr.open()
    _ = [c async for c in s.generate_stream({**BODY, "sampling_params": {"n": 3}}, rid="g")]
    assert [e.outcome for e in world.audit()] == ["aborted"]


@pytest.mark.parametrize("answered", [1, 2, 4, "one object"])
async def test_an_engine_answering_another_number_of_completions_is_a_typed_error(
    world: World, answered: Any
) -> None:
    def reply(rid: str, n: int) -> Any:
        if answered == "one object":  # what SGLang answers for n = 1
            meta = attested({"id": rid, "finish_reason": {"type": "stop"}})
            return {**chunk(rid, 0, "x", "stop"), "meta_info": meta}
        return [chunk(rid, i, "x", "stop") for i in range(answered)]

    world.script.reply = reply
    s = await world.mgr.open()
    with pytest.raises(LoraVersionError) as err:
        await s.sample(BODY, 3, rid="g")
    assert err.value.code is ErrorCode.INVALID_REQUEST
    assert "3" in err.value.message  # it says what was asked
    assert s.in_flight == () and s.unknown_turns == ()  # the turn is over: nothing leaked
    # the session goes on: the next group, answered in full, is n completions in order
    world.script.reply = lambda rid, n: [chunk(rid, i, "x", "stop") for i in range(n)]
    outs = await s.sample(BODY, 3, rid="h")
    assert [o["index"] for o in outs] == [0, 1, 2] and s.requests[-1].outcome == "ok"
    await s.close()
    assert world.refs() == 0


async def test_a_group_with_some_samples_aborted_is_an_aborted_turn_with_each_samples_result(
    world: World,
) -> None:
    finishes = ["stop", "abort", "abort", "length"]  # the last one is a result
    world.script.reply = lambda rid, n: [chunk(rid, i, "x", finishes[i]) for i in range(n)]
    s = await world.mgr.open()
    outs = await s.sample(BODY, 4, rid="g")
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == finishes  # nothing dropped
    assert s.requests[-1].outcome == "aborted" and [e.outcome for e in world.audit()] == ["aborted"]
    world.script.reply = lambda rid, n: [chunk(rid, i, "x", "stop") for i in range(n)]
    await s.sample(BODY, 4, rid="h")
    assert s.requests[-1].outcome == "ok" and s.in_flight == ()


async def test_a_streamed_group_with_fewer_samples_than_asked_is_a_typed_error(world: World) -> None:
    world.script.stream = lambda rid: interleaved(rid, ["stop", "stop"])  # 2 samples for n = 3
    s = await world.mgr.open()
    with pytest.raises(LoraVersionError):
        _ = [c async for c in s.generate_stream({**BODY, "sampling_params": {"n": 3}}, rid="g")]
