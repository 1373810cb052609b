"""Sessions through the real SGLang gateway (``smg`` 1.13.0) in front of real CPU engines.

* The lifecycle through it: sessions generate through the gateway only; each session's turns
  stay on one engine (its key is the routing key) and find their prefix in that engine's KV
  cache; every request carries the exact bound ``lora_path``; a publication and a reclaim
  happen underneath with the engines addressed directly; tokens equal the single-version stock
  baselines; aborts by rid reach the engine that serves the turn.
* Pass-through: the plugin's typed errors reach the client through the gateway with the same
  status and body as from the engine itself.
* No hidden resend (RFC 4.2): with the gateway's default retries, a turn the engine served but
  whose reply was lost on the way back is served again (five times in all), though the client
  sent it once; with the launch this project uses (``--disable-retries``) it is served exactly
  once and the client sees an unknown outcome it must settle itself.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest
from _e2e_helpers import (
    PROMPTS,
    TOOL_IDS,
    Deployment,
    abort_and_resume,
    assert_clean_audit,
    greedy,
    turn,
    write_json,
)
from _reply_dropping_proxy import DROP_REPLY, ReplyDroppingProxy

from lora_versions_dev.gateway_process import running_gateway
from relax_glue.engine_client import OutcomeUnknown
from relax_glue.gateway import GATEWAY_ID, ROUTED_WORKER_HEADER, ROUTING_KEY_HEADER, GatewayClient
from relax_glue.publisher import PublishOutcome

pytestmark = pytest.mark.engine

N = 8


@pytest.fixture(scope="module")
def gateway(engines, run_dir):
    with running_gateway([e.url for e in engines], run_dir / "gateway.log") as gw:
        yield gw


async def test_sessions_through_the_gateway_stay_on_one_engine_with_their_exact_version(
    engines, stock_engine, fixtures, snaps, gateway, run_dir
) -> None:
    async with Deployment(engines, stock_engine, fixtures, gateway=gateway.url) as w:
        assert w.gw is not None
        res = await w.publish(snaps, "A")
        assert res.outcome is PublishOutcome.PUBLISHED, res
        name_a = w.name_of["A"]

        # --- six A sessions, three turns each (prompt, tool turn, tool turn), concurrently
        sessions = [await w.sm.open(f"G{i}") for i in range(6)]
        prefix = {s.name: list(PROMPTS[i % len(PROMPTS)]) for i, s in enumerate(sessions)}
        later: list[tuple[int, int]] = []  # (cached, prompt) tokens of every turn but the first

        async def one_turn(s, kind: str) -> None:
            p = prefix[s.name]
            out = await s.generate({"input_ids": p, "sampling_params": greedy(N)})
            w.tx.add(s, kind, p, out["output_ids"], N)
            if kind != "turn":
                later.append((int(out["meta_info"].get("cached_tokens") or 0), len(p)))
            prefix[s.name] = [*p, *out["output_ids"], *TOOL_IDS]

        for kind in ("turn", "tool", "tool"):
            await asyncio.gather(*(one_turn(s, kind) for s in sessions))

        # --- B published underneath (control calls go to each engine, not through the gateway)
        res_b = await w.publish(snaps, "B")
        assert res_b.outcome is PublishOutcome.PUBLISHED, res_b
        name_b = w.name_of["B"]
        s_new = await w.sm.open("G_new")
        await turn(w.tx, s_new, PROMPTS[2], N)
        assert s_new.lora_path == name_b
        await asyncio.gather(*(one_turn(s, "tool") for s in sessions))  # the old ones stay on A
        # an abort by rid through the gateway's route reaches the engine serving the turn
        s0 = sessions[0]
        await abort_and_resume(w.tx, s0, [*prefix[s0.name]], 160, abort_after=3)

        # --- what the gateway did
        engine_of = {s.name: {r.engine_id for r in s.requests} for s in [*sessions, s_new]}
        assert all(len(e) == 1 and e <= {"E0", "E1"} for e in engine_of.values()), engine_of
        assert {s.lora_path for s in sessions} == {name_a}
        assert all({r.lora_path for r in s.requests} == {name_a} for s in sessions)
        hit = sum(c for c, _ in later) / sum(p for _, p in later)
        bad = await w.tx.mismatches(w.refs, w.adapter_of)
        write_json(
            run_dir / "gateway_sessions.json",
            {
                "engine_of": {k: sorted(v) for k, v in engine_of.items()},
                "cache_hit_rate": hit,
                "later": later,
            },
        )
        print(f"\ngateway: sessions -> engines {engine_of}; KV cache hit rate of later turns {hit:.0%}")
        assert not bad, f"token streams differ from the single-version baselines: {bad}"
        assert hit >= 0.5, f"later turns should find their prefix in their engine's cache: {hit:.0%}"
        assert w.gw.client.audit.entries(kind="generation"), "sessions generated through the gateway"
        assert not any(e.kind == "generation" for c in w.clients.values() for e in c.audit.entries())
        assert_clean_audit([*w.clients.values(), w.gw.client], allow_failed_rids=w.tx.aborted_rids)

        # --- A is reclaimed once its sessions closed; a late A request, through the gateway and
        # straight to the engine the gateway chose, gets the same typed refusal
        for s in sessions:
            await s.close()
        done = await w.pub.reclaim_ready()
        assert [r.version_key for r in done if r.done] == [w.key("A")]
        body = {"input_ids": list(PROMPTS[0]), "sampling_params": greedy(2), "lora_path": name_a}
        async with httpx.AsyncClient(timeout=30) as http:
            for late in (body, {**body, "lora_id": "forged"}):
                rid = f"late-{uuid.uuid4().hex}"
                via = await http.post(
                    f"{gateway.url}/generate", json={**late, "rid": rid}, headers={ROUTING_KEY_HEADER: rid}
                )
                direct = await http.post(
                    f"{via.headers[ROUTED_WORKER_HEADER]}/generate", json={**late, "rid": rid}
                )
                assert (via.status_code, via.json()) == (direct.status_code, direct.json())
                assert via.json()["error"]["code"] in {"VERSION_RECLAIMED", "FORBIDDEN_FIELD"}, via.text


async def test_groups_of_completions_through_the_gateway_share_one_engine_and_one_prefix(
    engines, stock_engine, fixtures, snaps, gateway, run_dir
) -> None:
    """Issue 27, a GRPO group of G = 4 completions of one prompt, two ways through smg: one
    session with ``sample(n=4)``, and four sessions of one ``group``. Either way the group runs
    on one engine, its prompt is computed there once (the others find it in the KV cache),
    every completion carries the exact bound version (greedy: each equals the stock baseline of
    A), and after close and reclaim the engines' native counts are 0 and A is unloaded."""
    g = 4
    prompt = [*PROMPTS[2], *PROMPTS[3], *PROMPTS[0]]  # fresh in every cache of this module
    async with Deployment(engines, stock_engine, fixtures, gateway=gateway.url) as w:
        assert w.gw is not None
        assert (await w.publish(snaps, "A")).outcome is PublishOutcome.PUBLISHED
        one = await w.sm.open("one")
        outs = await one.sample({"input_ids": prompt, "sampling_params": greedy(N)}, g)
        assert len(outs) == g and len({r.engine_id for r in one.requests}) == 1
        for out in outs:
            w.tx.add(one, "turn", prompt, out["output_ids"], N)

        group_prompt = [*PROMPTS[3], *PROMPTS[2], *PROMPTS[1]]
        members = [await w.sm.open(f"grp{i}", group="prompt-1") for i in range(g)]
        cached = []
        for m in members:
            out = await m.generate({"input_ids": group_prompt, "sampling_params": greedy(N)})
            w.tx.add(m, "turn", group_prompt, out["output_ids"], N)
            cached.append(int(out["meta_info"].get("cached_tokens") or 0))
        served = {r.engine_id for m in members for r in m.requests}
        assert len(served) == 1 and served <= {"E0", "E1"}, served
        # the first member computed the prompt; every later one found it on that engine
        assert cached[0] == 0 and all(c >= len(group_prompt) - 1 for c in cached[1:]), cached
        assert {m.lora_path for m in [one, *members]} == {w.name_of["A"]}
        bad = await w.tx.mismatches(w.refs, w.adapter_of)
        assert not bad, f"completions differ from the single-version baseline: {bad}"

        for m in [one, *members]:
            await m.close()
        assert (await w.publish(snaps, "B")).outcome is PublishOutcome.PUBLISHED  # A retires
        (done,) = await w.pub.reclaim_ready()
        assert done.done and {str(e.state) for e in done.engines.values()} == {"UNLOADED"}, done
        write_json(run_dir / "gateway_groups.json", {"engine": sorted(served), "cached_tokens": cached})


async def test_the_gateway_default_resends_an_admitted_turn_and_our_launch_does_not(engines, run_dir) -> None:
    """smg 1.13.0 resends a request whose reply was a 502/503/504 (five attempts in all); it does
    not resend a 500. A turn the engine admitted and served, whose reply was lost on the way
    back (a 502, as a timed-out sidecar answers), is served again and again by the gateway's
    default, though the client sent it once. With ``--disable-retries`` it is served once and the
    client holds an unknown outcome it settles itself (RFC 4.2)."""
    served: dict[bool, int] = {}
    with ReplyDroppingProxy(engines[0].url) as proxy:
        for retries in (True, False):
            log = run_dir / f"gateway-retries-{retries}.log"
            with running_gateway([proxy.url], log, retries=retries) as gw:
                gc = GatewayClient(gw.url, {})
                rid = f"{uuid.uuid4().hex}{DROP_REPLY}"
                body = {"rid": rid, "input_ids": list(PROMPTS[0]), "sampling_params": greedy(N)}
                try:
                    with pytest.raises(OutcomeUnknown) as err:
                        await gc.route("session-1").generate(body)
                finally:
                    await gc.aclose()
                assert err.value.engine_id == GATEWAY_ID and err.value.status_code == 502, err.value
                sent = gc.client.audit.entries(kind="generation")
                assert [e.detail for e in sent] == [rid], "the client sent the turn exactly once"
                served[retries] = proxy.served[rid]
    print(f"\nan admitted turn whose reply was lost was served {json.dumps(served)} times (retries on/off)")
    assert served[True] >= 2, f"smg's default retries should have served the admitted turn again: {served}"
    assert served[False] == 1, f"with --disable-retries the turn is served once: {served}"
