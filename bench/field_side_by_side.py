"""This project beside what TRL AsyncGRPO, prime-rl and verl do, on the same multi-turn traffic (issue 39).

One run, four designs, one after the other, each on two fresh CPU SGLang 0.5.23 engines E0/E1
(plugin on for this project, stock for the others: the plugin is off), each with the same three
LoRA slots. The same traffic for each: ``--workers`` closed-loop agent workers, each running
episodes of ``--turns`` assistant turns (greedy, ``--tokens`` streamed tokens each) with a tool turn
between two of them (``--tool-s`` seconds of tool latency, then the tool's tokens appended), and a
new policy every ``--interval`` seconds (version k is fixture adapter A, B or C, k mod 3). Workers
stick to one engine for an episode (worker i on engine i mod 2; no gateway for any design).

The designs, emulated with SGLang's stock HTTP API where the peer runs vLLM:

* ``this project``: the registry, publisher and session layer of this repository (plugin on): a
  session binds the default version at its first generation and every turn carries that exact
  version; a new version is staged, loaded pinned and committed on both engines (no pause, no
  flush); a retired version is reclaimed once no session holds it (capacity K = 2: a publication
  waits for a free slot).
* ``TRL AsyncGRPO``, as TRL 1.16.0 implements its LoRA sync
  (``trl/experimental/async_grpo/async_grpo_trainer.py``, ``_sync_weight_lora``, lines 1802-1858):
  pause the server keeping in-flight requests (``vllm_client.pause``: ``/pause?mode=keep``, line
  1826; SGLang's ``/pause_generation`` mode ``in_place``), load the adapter as
  ``trl-policy-v{N}`` (line 1845), resume (line 1846), unload ``v{N-(max_staleness+1)}`` (line
  1849), then bump the version the rollout worker reads; every turn asks for the current version
  (``async_rollout_worker.py``, ``_request_model``, lines 494-501). ``max_staleness`` is 1 here:
  TRL requires ``max_staleness + 2`` adapter slots (``async_grpo_trainer.py`` line 899) and every
  design gets three.
* ``prime-rl in place``: one adapter name (``policy``) updated in place with no pause and no flush
  (prime-rl#3356/#3358 hot-swap under one name). SGLang 0.5.23 has no in-place reload, so the swap
  is its stock ``/unload_lora_adapter`` (unregister, drain in-flight requests, unload) and
  ``/load_lora_adapter`` under the same name; a turn refused in between is sent again.
* ``verl``: one fixed name; ``/pause_generation`` (mode ``abort``: running requests end),
  ``/flush_cache``, unload + load under the same name, ``/continue_generation``; a turn that was
  aborted is resumed by the client with its partial output appended to the prompt (verl's async
  path), on the new weights. (The same update as the ``pause+flush+overwrite`` phase of
  ``bench/publication_e2e.py``.)

Reported per design, in one table (``bench/results/field_side_by_side.json``):

* episodes whose tokens came from more than one version: this project's from the engine's
  attestation (``meta_info.lora_versions``, read from each step's LoRA batch); the others' from
  the request trail (the version each request named, or the one loaded under the fixed name when
  it was sent, and a resumed turn's two parts);
* requests refused (sent again), aborted, failed; pauses (``/pause_generation`` calls);
* p50 and p99 gap between two tokens of one stream, in the quiet part of the run and during a
  publication (update) window;
* seconds per publication (p50), and for this project the wait for a free slot before it;
* turns (and tokens) that differ from the HF + PEFT (fp32) greedy reference of the version the
  client believes served them, with each turn's full prompt;
* engine memory (RSS of each engine's processes) at the end against the start.

    .venv/bin/python bench/field_side_by_side.py [--duration 40] [--workers 6] [--turns 3]
        [--tokens 16] [--tool-s 0.6] [--interval 4] [--designs ours,trl,prime,verl]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
from _profiling import engine_processes  # noqa: E402

from lora_contract.errors import LoraVersionError  # noqa: E402
from lora_versions_dev.fixtures import ensure_fixtures  # noqa: E402
from lora_versions_dev.launcher import EngineSpec, running_engines  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "field_side_by_side.json"
COHORT = ("E0", "E1")
ADAPTERS = ("A", "B", "C")
PROMPTS: tuple[tuple[int, ...], ...] = (
    (302, 356, 417, 494, 439),
    (2, 87, 82, 293, 202, 90, 72, 492, 313),
    (461, 275, 29, 446, 27, 224, 38, 15),
    (288, 79, 82, 88, 71, 92, 3, 202),
)
TOOL_IDS: tuple[int, ...] = (2, 87, 82, 293, 202, 90, 72, 492, 313, 461, 275, 29, 446, 27, 3, 202)
REFUSAL_BUDGET_S = 30.0  # a refused turn is sent again for this long, then it failed
TRL_MAX_STALENESS = 1  # TRL needs max_staleness + 2 slots; every design has three


def now() -> float:
    return time.monotonic()


def adapter_of(version: int) -> str:
    return ADAPTERS[version % len(ADAPTERS)]


# ------------------------------------------------------------------------------ records


@dataclasses.dataclass
class Segment:
    """Tokens the client believes one version produced, with the prompt they continued."""

    version: int  # what the client believes served them
    prefix: list[int]
    tokens: list[int]
    attested: tuple[str | None, ...] = ()  # this project: what the engine attested it ran


@dataclasses.dataclass
class TurnRec:
    engine: str
    start: float
    end: float = 0.0
    chunks: list[float] = dataclasses.field(default_factory=list)
    segments: list[Segment] = dataclasses.field(default_factory=list)
    refused: int = 0
    aborted: int = 0
    failed: str = ""

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.segments for t in s.tokens]


@dataclasses.dataclass
class EpisodeRec:
    worker: int
    turns: list[TurnRec] = dataclasses.field(default_factory=list)

    def versions(self) -> set[Any]:
        """The versions its tokens came from: attested ones where the engine said, else believed."""
        out: set[Any] = set()
        for t in self.turns:
            for s in t.segments:
                if not s.tokens:
                    continue
                out |= set(s.attested) if s.attested else {s.version}
        return out


@dataclasses.dataclass
class Update:
    version: int
    lo: float
    hi: float
    ok: bool
    pauses: int = 0
    waited_s: float = 0.0  # this project: the wait for a free slot before the publication
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------- stock HTTP


async def stream_generate(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], chunks: list[float]
) -> tuple[int, list[int], str | None, str]:
    """(status, output ids, finish type, error text) of one streamed ``/generate``."""
    out: list[int] = []
    finish = None
    async with http.stream("POST", url + "/generate", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return r.status_code, [], None, (await r.aread()).decode(errors="replace")[:200]
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                return 500, out, None, str(chunk["error"])[:200]
            chunks.append(now())
            out = list(chunk.get("output_ids") or out)
            finish = ((chunk.get("meta_info") or {}).get("finish_reason") or {}).get("type")
    return 200, out, finish, ""


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


class StockDesign:
    """The three peers: stock engines, one update protocol each, requests straight to an engine."""

    name = ""
    pause_mode: str | None = None

    def __init__(self, engines: Sequence[Any], fx: Any) -> None:
        self.urls = {e.name: e.url for e in engines}
        self.fx = fx
        self.http = httpx.AsyncClient(timeout=300)
        self.loaded: dict[str, int] = {}  # engine -> the version loaded under the fixed name
        self.errors: list[dict[str, Any]] = []  # control calls that did not answer 200, in order
        # Set while no update runs. verl's rollout side also stops sending during its update and
        # resumes the aborted turns after it: its turns wait on this; the other peers' do not.
        self.idle = asyncio.Event()
        self.idle.set()
        self.client_waits_for_updates = False

    def engine_of(self, worker: int) -> str:
        return COHORT[worker % len(COHORT)]

    async def call(self, url: str, path: str, body: dict[str, Any] | None = None) -> int:
        r = await self.http.post(url + path, json=body if body is not None else {})
        if r.status_code != 200:
            self.errors.append({"at": now(), "call": path, "status": r.status_code, "text": r.text[:200]})
        return r.status_code

    def errors_since(self, lo: float) -> list[dict[str, Any]]:
        return [{k: v for k, v in e.items() if k != "at"} for e in self.errors if e["at"] >= lo]

    async def load(self, url: str, name: str, version: int) -> int:
        body = {"lora_name": name, "lora_path": str(self.fx.adapter_dir(adapter_of(version)))}
        return await self.call(url, "/load_lora_adapter", body)

    def request_name(self, engine: str) -> tuple[str, int]:
        """The adapter name a turn sends now, and the version the client believes it is."""
        return "policy", self.loaded[engine]

    async def turn(self, worker: int, prefix: list[int], n: int) -> TurnRec:
        engine = self.engine_of(worker)
        rec = TurnRec(engine, now())
        deadline = now() + REFUSAL_BUDGET_S
        left, prompt = n, list(prefix)
        while left > 0:
            if self.client_waits_for_updates:
                await self.idle.wait()
            name, version = self.request_name(engine)
            body = {"input_ids": prompt, "lora_path": name, "sampling_params": greedy(left)}
            status, out, finish, error = await stream_generate(self.http, self.urls[engine], body, rec.chunks)
            if status != 200 and not out:
                rec.refused += 1
                if now() > deadline:
                    rec.failed = f"refused: {error}"
                    break
                await asyncio.sleep(0.1)
                continue
            rec.segments.append(Segment(version, list(prompt), out))
            left -= len(out)
            prompt += out
            if finish == "abort":
                rec.aborted += 1  # verl: resumed with the partial output appended, on the new weights
                if not out:
                    await asyncio.sleep(0.1)  # aborted before its first token: the pause is on
            elif status != 200 or (finish not in ("length", "stop") and left > 0):
                rec.failed = error or f"finish {finish}"
                break
        rec.end = now()
        return rec

    async def aclose(self) -> None:
        await self.http.aclose()


class TrlAsyncGrpo(StockDesign):
    name = "TRL AsyncGRPO (v{N} names, pause)"

    def __init__(self, engines: Sequence[Any], fx: Any) -> None:
        super().__init__(engines, fx)
        self.version = 0  # the rollout worker's model_version (TRL bumps it after the whole sync)

    async def start(self) -> None:
        for url in self.urls.values():
            assert await self.load(url, "trl-policy-v0", 0) == 200

    def request_name(self, engine: str) -> tuple[str, int]:
        return f"trl-policy-v{self.version}", self.version

    async def publish(self, k: int) -> Update:
        lo = now()

        async def one(url: str) -> list[int]:
            statuses = [await self.call(url, "/pause_generation", {"mode": "in_place"})]
            statuses.append(await self.load(url, f"trl-policy-v{k}", k))
            statuses.append(await self.call(url, "/continue_generation"))
            stale = k - (TRL_MAX_STALENESS + 1)
            if stale >= 0:
                statuses.append(
                    await self.call(url, "/unload_lora_adapter", {"lora_name": f"trl-policy-v{stale}"})
                )
            return statuses

        results = await asyncio.gather(*(one(u) for u in self.urls.values()))
        self.version = k
        ok = all(s == 200 for r in results for s in r)
        return Update(k, lo, now(), ok, pauses=len(self.urls), detail={"errors": self.errors_since(lo)})


class OneName(StockDesign):
    """The peers that serve every version under one adapter name (``policy``)."""

    async def start(self) -> None:
        for e, url in self.urls.items():
            assert await self.load(url, "policy", 0) == 200
            self.loaded[e] = 0


class PrimeRlInPlace(OneName):
    name = "prime-rl (one name, in place)"

    async def publish(self, k: int) -> Update:
        lo = now()

        async def one(engine: str, url: str) -> list[int]:
            statuses = [await self.call(url, "/unload_lora_adapter", {"lora_name": "policy"})]
            statuses.append(await self.load(url, "policy", k))
            self.loaded[engine] = k
            return statuses

        results = await asyncio.gather(*(one(e, u) for e, u in self.urls.items()))
        ok = all(s == 200 for r in results for s in r)
        return Update(k, lo, now(), ok, detail={"errors": self.errors_since(lo)})


class VerlFixedName(OneName):
    name = "verl (one name, pause+flush)"

    def __init__(self, engines: Sequence[Any], fx: Any) -> None:
        super().__init__(engines, fx)
        self.client_waits_for_updates = True

    async def publish(self, k: int) -> Update:
        lo = now()

        async def one(engine: str, url: str) -> list[int]:
            statuses = [await self.call(url, "/pause_generation", {"mode": "abort"})]
            await self.call(url, "/flush_cache")  # refused while requests run: not counted as failed
            statuses.append(await self.call(url, "/unload_lora_adapter", {"lora_name": "policy"}))
            statuses.append(await self.load(url, "policy", k))
            self.loaded[engine] = k
            statuses.append(await self.call(url, "/continue_generation"))
            return statuses

        self.idle.clear()
        try:
            results = await asyncio.gather(*(one(e, u) for e, u in self.urls.items()))
        finally:
            self.idle.set()
        ok = all(s == 200 for r in results for s in r)
        return Update(k, lo, now(), ok, pauses=len(self.urls), detail={"errors": self.errors_since(lo)})


# --------------------------------------------------------------------------- this project


class ThisProject:
    name = "this project (bind once, reclaim by refs)"

    def __init__(self, engines: Sequence[Any], fx: Any) -> None:
        from relax_glue.cohort import open_publisher
        from relax_glue.engine_client import EngineClient
        from relax_glue.registry import LoRAVersionRegistry
        from relax_glue.router import StickyRoundRobinRouter
        from relax_glue.sessions import SessionManager
        from relax_glue.snapshot import Snapshot

        self.clients = {e.name: EngineClient(e.name, e.url) for e in engines}
        self.reg = LoRAVersionRegistry("field", COHORT)
        self.pub = open_publisher(
            self.reg, self.clients, reclaim_wait_s=1.0, reclaim_poll_s=0.05, reclaim_deadline_s=60.0
        )
        self.sm = SessionManager(self.reg, self.clients, router=StickyRoundRobinRouter(list(COHORT)))
        self.snaps = {a: Snapshot.from_peft_dir(fx.adapter_dir(a)) for a in ADAPTERS}
        self.version_of: dict[str, int] = {}  # lora_name -> version
        self.sessions: dict[int, Any] = {}

    async def _publish(self, k: int) -> bool:
        from relax_glue.publisher import PublishOutcome

        snap = self.snaps[adapter_of(k)]
        self.version_of[snap.lora_name("relax_policy_lora", "field", f"v{k}")] = k
        res = await self.pub.publish(snap, f"v{k}")
        return res.outcome is PublishOutcome.PUBLISHED

    async def start(self) -> None:
        assert await self._publish(0)

    async def publish(self, k: int) -> Update:
        waited = now()
        while self.reg.status().slots_used >= self.reg.capacity:
            if not await self.pub.reclaim_ready(deadline_s=1.0):
                await asyncio.sleep(0.1)
        lo = now()
        ok = await self._publish(k)
        return Update(k, lo, now(), ok, waited_s=lo - waited)

    async def open(self, worker: int) -> Any:
        self.sessions[worker] = await self.sm.open(f"w{worker}")
        return self.sessions[worker]

    async def close(self, worker: int) -> None:
        s = self.sessions.pop(worker)
        with contextlib.suppress(Exception):
            await s.close()

    async def turn(self, worker: int, prefix: list[int], n: int) -> TurnRec:
        s = self.sessions[worker]
        rec = TurnRec("?", now())
        out: list[int] = []
        try:
            async for chunk in s.generate_stream({"input_ids": list(prefix), "sampling_params": greedy(n)}):
                rec.chunks.append(now())
                out = list(chunk.get("output_ids") or out)
        except LoraVersionError as exc:
            rec.failed = f"{exc.code.value}: {exc.message}"[:200]
        if s.requests:
            sent = s.requests[-1]
            rec.engine = sent.engine_id
            version = self.version_of.get(s.lora_path or "", -1)
            rec.segments.append(Segment(version, list(prefix), out, sent.served))
        rec.end = now()
        return rec

    async def finish(self) -> None:
        await self.sm.close_all()
        await self.pub.reclaim_ready()

    async def aclose(self) -> None:
        for c in self.clients.values():
            await c.aclose()


# ------------------------------------------------------------------------------- traffic


async def run_design(design: Any, args: argparse.Namespace) -> tuple[list[EpisodeRec], list[Update]]:
    episodes: list[EpisodeRec] = []
    updates: list[Update] = []
    t_end = now() + args.duration
    managed = isinstance(design, ThisProject)

    async def worker(i: int) -> None:
        for e in itertools.count():
            if now() >= t_end:
                return
            ep = EpisodeRec(i)
            episodes.append(ep)
            prefix = list(PROMPTS[(i + e) % len(PROMPTS)])
            if managed:
                await design.open(i)
            try:
                for t in range(args.turns):
                    if t:
                        await asyncio.sleep(args.tool_s)  # the tool runs
                        prefix += TOOL_IDS
                    rec = await design.turn(i, prefix, args.tokens)
                    ep.turns.append(rec)
                    if rec.failed:
                        break
                    prefix += rec.tokens
            finally:
                if managed:
                    await design.close(i)

    async def publisher() -> None:
        for k in itertools.count(1):
            await asyncio.sleep(args.interval)
            if now() >= t_end:
                return
            updates.append(await design.publish(k))

    await asyncio.gather(publisher(), *(worker(i) for i in range(args.workers)))
    return episodes, updates


def engine_rss_mib(engines: Sequence[Any]) -> float:
    total = 0
    for e in engines:
        for p in engine_processes(e.name, e.proc.pid).values():
            with contextlib.suppress(Exception):
                total += p.memory_info().rss
    return round(total / 2**20, 1)


# ----------------------------------------------------------------------------- summary


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    return xs[max(0, min(len(xs) - 1, round(q / 100 * (len(xs) - 1))))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def reference_mismatches(episodes: Sequence[EpisodeRec], fx: Any) -> dict[str, Any]:
    """Every turn part against the HF + PEFT greedy reference of the version the client believes
    served it; a part that differs is matched against the previous and the next version's
    reference and the base model's, to say what served it instead."""
    from lora_versions_dev.reference import greedy_tokens

    cache: dict[tuple[str | None, tuple[int, ...], int], list[int]] = {}

    def ref(adapter: str | None, prefix: list[int], n: int) -> list[int]:
        key = (adapter, tuple(prefix), n)
        if key not in cache:
            adapter_dir = fx.adapter_dir(adapter) if adapter is not None else None
            cache[key] = greedy_tokens(fx.model_dir, adapter_dir, list(prefix), n)
        return cache[key]

    out: dict[str, Any] = {"compared": 0, "differ": 0, "tokens_differ": 0, "served_instead": {}}
    for ep in episodes:
        for t in ep.turns:
            for s in t.segments:
                if not s.tokens or s.version < 0:
                    continue
                out["compared"] += 1
                bad = sum(
                    a != b
                    for a, b in zip(
                        s.tokens, ref(adapter_of(s.version), s.prefix, len(s.tokens)), strict=True
                    )
                )
                if not bad:
                    continue
                out["differ"] += 1
                out["tokens_differ"] += bad
                candidates = {
                    "the previous version": adapter_of(s.version - 1),
                    "the next version": adapter_of(s.version + 1),
                    "the base model": None,
                }
                instead = next(
                    (what for what, a in candidates.items() if s.tokens == ref(a, s.prefix, len(s.tokens))),
                    "none of them",
                )
                out["served_instead"][instead] = out["served_instead"].get(instead, 0) + 1
    return out


def implicit_reloads(log_dir: Path) -> int:
    """SGLang's own log line for a request that reloaded an unloaded adapter by its old path."""
    return sum(
        p.read_text(errors="replace").count("Reloading evicted adapter") for p in log_dir.glob("*.log")
    )


def summarize(
    name: str,
    episodes: list[EpisodeRec],
    updates: list[Update],
    fx: Any,
    mem: tuple[float, float],
    log_dir: Path,
) -> dict[str, Any]:
    turns = [t for e in episodes for t in e.turns]
    windows = [(u.lo, u.hi) for u in updates]
    quiet, during = [], []
    for t in turns:
        for a, b in itertools.pairwise(t.chunks):
            (during if any(b >= lo and a <= hi for lo, hi in windows) else quiet).append(b - a)
    finished = [e for e in episodes if e.turns and not any(t.failed for t in e.turns)]
    mixed = [e for e in finished if len(e.versions()) > 1]
    refs = reference_mismatches(episodes, fx)
    pub_s = [u.hi - u.lo for u in updates]
    return {
        "design": name,
        "episodes": len(finished),
        "episodes_failed": len(episodes) - len(finished),
        "mixed_version_episodes": len(mixed),
        "mixed_share": round(len(mixed) / len(finished), 3) if finished else None,
        "requests": sum(1 + t.refused + t.aborted for t in turns),
        "refused": sum(t.refused for t in turns),
        "aborted": sum(t.aborted for t in turns),
        "failed": sum(bool(t.failed) for t in turns),
        "failures": sorted({t.failed for t in turns if t.failed})[:5],
        "publications": len(updates),
        "publications_ok": sum(u.ok for u in updates),
        "pauses": sum(u.pauses for u in updates),
        "s_per_publication_p50": round(statistics.median(pub_s), 3) if pub_s else None,
        "slot_wait_s_p50": round(statistics.median(u.waited_s for u in updates), 3) if updates else None,
        "gap_ms_quiet_p50": ms(pct(quiet, 50)),
        "gap_ms_quiet_p99": ms(pct(quiet, 99)),
        "gap_ms_publication_p50": ms(pct(during, 50)),
        "gap_ms_publication_p99": ms(pct(during, 99)),
        "gaps_quiet": len(quiet),
        "gaps_during_publication": len(during),
        "tokens": sum(len(t.tokens) for t in turns),
        "segments_compared": refs["compared"],
        "segments_differing_from_reference": refs["differ"],
        "tokens_differing_from_reference": refs["tokens_differ"],
        "differing_segments_served_by": refs["served_instead"],
        "implicit_reloads": implicit_reloads(log_dir),
        "failed_publications": [{"version": u.version, **u.detail} for u in updates if not u.ok],
        "engine_rss_mib_start": mem[0],
        "engine_rss_mib_end": mem[1],
    }


COLUMNS = (
    ("design", "design", 40),
    ("episodes", "eps", 4),
    ("mixed_version_episodes", "mixed", 5),
    ("refused", "refus", 5),
    ("aborted", "abort", 5),
    ("failed", "fail", 4),
    ("pauses", "pause", 5),
    ("publications_ok", "pubs", 4),
    ("s_per_publication_p50", "s/pub", 6),
    ("gap_ms_quiet_p50", "gap q50", 7),
    ("gap_ms_quiet_p99", "gap q99", 7),
    ("gap_ms_publication_p50", "gap p50", 7),
    ("gap_ms_publication_p99", "gap p99", 7),
    ("segments_differing_from_reference", "≠ref", 5),
    ("implicit_reloads", "reload", 6),
    ("engine_rss_mib_start", "MiB start", 9),
    ("engine_rss_mib_end", "MiB end", 8),
)


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [" ".join(h.rjust(w) if i else h.ljust(w) for i, (_, h, w) in enumerate(COLUMNS))]
    lines.append("-" * (sum(w for *_, w in COLUMNS) + len(COLUMNS) - 1))
    for r in rows:
        cells = []
        for i, (key, _, w) in enumerate(COLUMNS):
            v = r.get(key)
            v = "-" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))
            cells.append(v.ljust(w) if i == 0 else v.rjust(w))
        lines.append(" ".join(cells))
    return "\n".join(lines)


# -------------------------------------------------------------------------------- main

DESIGNS = {"ours": ThisProject, "trl": TrlAsyncGrpo, "prime": PrimeRlInPlace, "verl": VerlFixedName}


async def one_design(key: str, engines: Sequence[Any], fx: Any, args: argparse.Namespace) -> dict[str, Any]:
    design = DESIGNS[key](engines, fx)
    try:
        await design.start()
        mem_start = engine_rss_mib(engines)
        episodes, updates = await run_design(design, args)
        if isinstance(design, ThisProject):
            await design.finish()
        mem_end = engine_rss_mib(engines)
    finally:
        await design.aclose()
    log_dir = Path(engines[0].log_path).parent
    row = summarize(design.name, episodes, updates, fx, (mem_start, mem_end), log_dir)
    print(
        f"[bench] {key}: {row['episodes']} episodes, {row['mixed_version_episodes']} mixed, "
        f"{row['publications_ok']}/{row['publications']} publications",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=40.0, help="seconds of traffic per design")
    p.add_argument("--workers", type=int, default=6, help="concurrent episodes (closed loop)")
    p.add_argument("--turns", type=int, default=3, help="assistant turns per episode")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per assistant turn")
    p.add_argument("--tool-s", type=float, default=0.6, help="tool latency between two assistant turns")
    p.add_argument("--interval", type=float, default=4.0, help="seconds between two publications")
    p.add_argument("--designs", default="ours,trl,prime,verl")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    t_run = now()
    fx = ensure_fixtures()
    run = ROOT / ".runs" / f"bench-field-{time.strftime('%Y%m%d-%H%M%S')}"
    rows = []
    for key in args.designs.split(","):
        plugin = key == "ours"
        specs = [
            EngineSpec(name=n, model_path=fx.model_dir, log_path=run / key / f"{n}.log", plugin=plugin)
            for n in COHORT
        ]
        with running_engines(specs) as engines:
            rows.append(asyncio.run(one_design(key, engines, fx, args)))
    import sglang

    out = {
        "meta": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": platform.python_version(),
            "sglang": sglang.__version__,
            "cpus": os.cpu_count(),
            "run_time_s": round(now() - t_run, 1),
            "engine_logs": str(run),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        },
        "designs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str))
    print()
    print(table(rows))
    print("(mixed = finished episodes whose tokens came from more than one version; ≠ref = turn parts")
    print(" whose tokens differ from the HF + PEFT reference of the version the client believes served")
    print(" them; gap q/p = between two tokens of a stream, quiet / during a publication, ms)")
    for r in rows:
        if r["differing_segments_served_by"] or r["failed_publications"]:
            print(
                f"[bench] {r['design']}: parts differing from the reference matched "
                f"{r['differing_segments_served_by']};"
            )
            print(f"        failed publications: {r['failed_publications']}")
    print(f"[bench] wrote {args.out} ({out['meta']['run_time_s']}s incl. engine starts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
