"""Helpers of the acceptance suite (not a test module): the cohort under test, the clean
baselines, turn records with their logprobs, the comparison rule and the report.

Everything drives the real ``relax_glue`` stack against real engines; the only judgement made
here is :func:`compare`, the one rule every numeric check of the suite goes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from lora_contract import protocol
from lora_versions_demo.lifecycle import (
    TOOL_IDS,  # the scripted tool reply (both profiles share the tokenizer)
)
from lora_versions_dev.device_profile import AcceptanceFixtures, DeviceProfile
from lora_versions_dev.farm import ADMIN_KEY
from lora_versions_dev.teardown import live_versions, purge
from relax_glue.engine_client import EngineAPI, EngineClient, forbidden_calls
from relax_glue.publisher import Publisher, PublishResult
from relax_glue.registry import LoRAVersionRegistry
from relax_glue.sessions import Session, SessionManager
from relax_glue.snapshot import Snapshot

# The shared farm's key: on CPU the acceptance suite runs on the farm (gpu_tests/conftest.py).
ACCEPTANCE_ADMIN_KEY = ADMIN_KEY
COHORT = ("E0", "E1")
# Relax's published figures for its No.7 online run on an RTX 6000 Ada: the anchor of RFC 7.3.
RELAX_ANCHOR = {"throughput_ratio": 0.98, "max_gap_s": 0.05, "hardware": "RTX 6000 Ada"}


# An aborted stream's length: long enough that the abort always lands before it ends (the
# trainer-side abort tests use the same figure).
ABORT_STREAM_TOKENS = 160


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def prompt(seed: int, length: int = 24) -> list[int]:
    """A prompt of fixture-tokenizer ids no other test sends (fresh in every radix cache)."""
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(length)]


def body(prefix: Sequence[int], n: int) -> dict[str, Any]:
    return {"input_ids": list(prefix), "sampling_params": greedy(n), "return_logprob": True}


def logprobs_of(out: Mapping[str, Any]) -> list[float]:
    """Per output token: its logprob (``meta_info.output_token_logprobs`` = [(lp, id, text)])."""
    return [float(entry[0]) for entry in out["meta_info"]["output_token_logprobs"]]


# --------------------------------------------------------------------------- the comparison


@dataclass(frozen=True)
class Comparison:
    ok: bool
    max_abs_delta: float  # over the positions whose tokens agree
    first_token_mismatch: int | None  # index of the first differing token, if any
    positions: int


def compare(
    tokens: Sequence[int],
    lps: Sequence[float],
    ref_tokens: Sequence[int],
    ref_lps: Sequence[float],
    eps: float,
) -> Comparison:
    """Same tokens, and every logprob within ``eps`` of the baseline's (0 on CPU fp32: equal)."""
    n = min(len(tokens), len(ref_tokens))
    first = next((i for i in range(n) if tokens[i] != ref_tokens[i]), None)
    if first is None and len(tokens) != len(ref_tokens):
        first = n
    agree = n if first is None else first
    deltas = [abs(a - b) for a, b in zip(lps[:agree], ref_lps[:agree], strict=True)]
    worst = max(deltas, default=0.0)
    return Comparison(first is None and worst <= eps, worst, first, len(tokens))


# ------------------------------------------------------------------------------ baselines


class Baselines:
    """The clean single-adapter engines (plugin off, the adapter loaded at start through the
    stock ``--lora-paths``): what a session bound to that version must reproduce."""

    def __init__(self, urls: Mapping[str, str]) -> None:
        self.urls = dict(urls)  # adapter -> base URL
        self.http = httpx.AsyncClient(timeout=600)

    async def generate(
        self, adapter: str, prefix: Sequence[int], n: int, sampling: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        req = {**body(prefix, n), "lora_path": adapter}
        if sampling:
            req["sampling_params"] = {**req["sampling_params"], **sampling}
        r = await self.http.post(f"{self.urls[adapter]}/generate", json=req)
        assert r.status_code == 200, r.text
        return r.json()

    async def aclose(self) -> None:
        await self.http.aclose()


# ------------------------------------------------------------------------------ turn records


@dataclass
class Turn:
    session: str
    kind: str  # "turn" | "tool" | "retry" | "forced" (a negative control)
    engine: str
    lora_path: str
    prefix: list[int]
    tokens: list[int]
    logprobs: list[float]
    cached_tokens: int

    def short(self) -> dict[str, Any]:
        d = asdict(self)
        d["prefix"] = len(self.prefix)
        d.pop("logprobs")
        return d


# ------------------------------------------------------------------------------ the cohort


class Cohort:
    """One test's deployment over the shared engines: a registry of its own epoch, real clients
    for E0/E1, the publisher and the session layer. ``async with`` leaves E0/E1 without any
    managed version of this epoch (removed through the engines' own protocol)."""

    def __init__(
        self,
        engines: Mapping[str, Any],
        fixtures: AcceptanceFixtures,
        profile: DeviceProfile,
        cohort: tuple[str, ...] = COHORT,
    ) -> None:
        self.profile = profile
        self.engines = engines
        self.epoch = f"acc{uuid.uuid4().hex[:6]}"
        self.registry = LoRAVersionRegistry(self.epoch, cohort)
        self.clients: dict[str, EngineClient] = {
            e: EngineClient(e, engines[e].url, admin_key=ACCEPTANCE_ADMIN_KEY) for e in cohort
        }
        self.pub_engines: dict[str, EngineAPI] = dict(self.clients)
        self.publisher = self._publisher()
        self.sm = SessionManager(self.registry, self.clients, drain_timeout_s=30.0)
        self.snapshots = {n: Snapshot.from_peft_dir(fixtures.adapter_dir(n)) for n in fixtures.adapters}
        self.baselines = Baselines(
            {a: engines[f"base_{a}"].url for a in ("A", "B") if f"base_{a}" in engines}
        )
        self.adapter_of: dict[str, str] = {}  # lora_name -> adapter
        self.name_of: dict[str, str] = {}  # adapter -> lora_name
        self.turns: list[Turn] = []

    def _publisher(self) -> Publisher:
        return Publisher(
            self.registry, self.pub_engines, reclaim_wait_s=1.0, reclaim_poll_s=0.05, reclaim_deadline_s=120.0
        )

    def wrap(self, engine: str, wrapper: EngineAPI) -> None:
        """The publisher talks to ``engine`` through ``wrapper`` (around the real client)."""
        self.pub_engines[engine] = wrapper
        self.publisher = self._publisher()

    def unwrap(self) -> None:
        self.pub_engines = dict(self.clients)
        self.publisher = self._publisher()

    async def publish(self, adapter: str, version_id: str | None = None) -> PublishResult:
        """Publish the fixture ``adapter`` as version ``version_id`` (default: the adapter's name).
        A failed version id is spent (a replay returns the same outcome): a retry takes a new one."""
        snap = self.snapshots[adapter]
        vid = version_id or adapter
        name = snap.lora_name(protocol.DEFAULT_LORA_PREFIX, self.epoch, vid)
        self.adapter_of[name] = adapter
        self.name_of[adapter] = name
        return await self.publisher.publish(snap, vid)

    async def turn(self, s: Session, prefix: Sequence[int], n: int, kind: str = "turn") -> Turn:
        out = await s.generate(body(prefix, n))
        meta = out["meta_info"]
        assert s.lora_path is not None
        t = Turn(
            s.name,
            kind,
            s.requests[-1].engine_id,
            s.lora_path,
            list(prefix),
            list(out["output_ids"]),
            logprobs_of(out),
            int(meta.get("cached_tokens") or 0),
        )
        self.turns.append(t)
        return t

    async def episode(self, s: Session, first_prompt: Sequence[int], n: int) -> list[Turn]:
        """An agent episode: assistant turn, scripted tool reply, assistant turn, and a retry of
        that turn (same prefix: it must reproduce the same tokens on the same version)."""
        t1 = await self.turn(s, first_prompt, n)
        prefix = [*first_prompt, *t1.tokens, *TOOL_IDS]
        t2 = await self.turn(s, prefix, n, kind="tool")
        t3 = await self.turn(s, prefix, n, kind="retry")
        return [t1, t2, t3]

    async def abort_and_resume(self, s: Session, prefix: Sequence[int], n: int, after: int = 3) -> Turn:
        """Stream a turn, abort it by rid after ``after`` tokens (a temporary abort: the binding
        stays), then resume it for ``n`` more tokens with the partial output appended to the
        prefix. The partial is kept as a "partial" turn (its tokens must be the baseline's first
        ones), the resumed turn as a "resume" turn with its full prefix.

        The aborted stream asks for ``ABORT_STREAM_TOKENS``, far more than ``after``: the abort
        travels to the engine while it keeps decoding, and a tiny CPU model can finish a short
        turn before the abort lands (seen in CI: all 12 of 12 tokens streamed)."""
        rid = f"{s.name}-abort-{uuid.uuid4().hex[:8]}"
        partial: list[int] = []
        aborted = False
        async for chunk in s.generate_stream(
            {"input_ids": list(prefix), "sampling_params": greedy(ABORT_STREAM_TOKENS)}, rid=rid
        ):
            partial = list(chunk.get("output_ids") or partial)
            if not aborted and len(partial) >= after:
                aborted = await s.abort(rid)
        assert aborted and 0 < len(partial) < ABORT_STREAM_TOKENS, (aborted, len(partial))
        assert s.lora_path is not None
        engine = s.requests[-1].engine_id
        self.turns.append(Turn(s.name, "partial", engine, s.lora_path, list(prefix), partial, [], 0))
        return await self.turn(s, [*prefix, *partial], n, kind="resume")

    async def check(self, t: Turn, adapter: str | None = None) -> Comparison:
        """``t`` against the clean baseline of ``adapter`` (default: of the version it carried). A
        partial (aborted) turn has no logprobs: its tokens must be the baseline's first ones."""
        ref = await self.baselines.generate(adapter or self.adapter_of[t.lora_path], t.prefix, len(t.tokens))
        ref_lps = [] if t.kind == "partial" else logprobs_of(ref)
        return compare(t.tokens, t.logprobs, ref["output_ids"], ref_lps, self.profile.logprob_epsilon)

    async def live(self) -> dict[str, list[str]]:
        """Per engine: this epoch's managed versions that still hold something."""
        return await live_versions(self.clients, self.epoch)

    def forbidden(self) -> list[Any]:
        return forbidden_calls([c.audit for c in self.clients.values()])

    async def __aenter__(self) -> Cohort:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.sm.close_all(), 60)
            left = await purge(self.clients, self.epoch, timeout_s=120.0)
            assert not left, f"versions left on the engines: {left}"
        finally:
            await self.baselines.aclose()
            for c in self.clients.values():
                with contextlib.suppress(Exception):
                    await c.aclose()


# ------------------------------------------------------------------------------ the report


@dataclass
class Report:
    profile: DeviceProfile
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, name: str, data: Mapping[str, Any]) -> None:
        self.sections[name] = {"device": self.profile.device, **data}

    def as_json(self) -> dict[str, Any]:
        return {
            "profile": self.profile.describe(),
            "gpu_verified": self.profile.device == "cuda",
            "anchor": RELAX_ANCHOR,
            "sections": self.sections,
        }

    def table(self) -> str:
        lines = [f"RFC 7.2 / 7.3 acceptance on {self.profile.banner()}"]
        for name, data in self.sections.items():
            lines.append(f"  {name}")
            for key, value in data.items():
                if isinstance(value, dict | list) and len(str(value)) > 90:
                    value = f"{str(value)[:87]}..."
                lines.append(f"    {key:<34} {value}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------ load


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


@dataclass
class Stream:
    """One streamed request: when it started and when each chunk of tokens arrived."""

    label: str
    lora_path: str
    engine: str
    started: float
    t: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @property
    def latency_s(self) -> float:
        return (self.t[-1] - self.started) if self.t else 0.0

    def gaps(self, lo: float, hi: float) -> list[float]:
        """Gaps between consecutive chunks that overlap [lo, hi] (the first chunk's wait is the
        prefill, not a gap)."""
        return [b - a for a, b in zip(self.t, self.t[1:], strict=False) if b >= lo and a <= hi]


async def stream_once(
    client: EngineClient, lora_path: str, prefix: Sequence[int], n: int, label: str
) -> Stream:
    """One streamed /generate through the project's engine client (the same code for the managed
    and the plain engine)."""
    st = Stream(label, lora_path, client.engine_id, time.monotonic())
    req = {**body(prefix, n), "return_logprob": False, "lora_path": lora_path}
    async for chunk in client.generate_stream(req):
        st.t.append(time.monotonic())
        st.tokens = list(chunk.get("output_ids") or st.tokens)
    return st


@dataclass(frozen=True)
class LoadFigures:
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    p95_latency_s: float
    max_gap_s: float


async def measure_load(
    url: str, lora_path: str, *, streams: int, rounds: int, n: int, seed: int
) -> LoadFigures:
    """``streams`` concurrent clients, each sending ``rounds`` streamed requests of ``n`` tokens
    one after another: the same load for whichever engine ``url`` is."""
    engine = EngineClient(url, url)
    try:

        async def client(i: int) -> list[Stream]:
            return [
                await stream_once(engine, lora_path, prompt(seed + 17 * i + k), n, f"load{i}")
                for k in range(rounds)
            ]

        t0 = time.monotonic()
        done = [s for group in await asyncio.gather(*(client(i) for i in range(streams))) for s in group]
        wall = time.monotonic() - t0
    finally:
        await engine.aclose()
    tokens = sum(len(s.tokens) for s in done)
    gaps = [g for s in done for g in s.gaps(0, float("inf"))]
    return LoadFigures(
        requests=len(done),
        tokens=tokens,
        wall_s=round(wall, 3),
        tokens_per_s=round(tokens / wall, 2),
        p95_latency_s=round(percentile([s.latency_s for s in done], 95), 3),
        max_gap_s=round(max(gaps, default=0.0), 3),
    )
