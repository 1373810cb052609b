"""Helpers of the acceptance suite (not a test module): the cohort under test, the clean
baselines, turn records with their logprobs, the comparison rule and the report.

Everything drives the real ``relax_glue`` stack against real engines; the judgements made here
are :func:`compare` (the one rule every numeric check of the suite goes through), the logprob
epsilon's derivation from the baselines' measured spread (:func:`derive_epsilon`), the choice of
scoring positions (:func:`scoring_positions`) and the no-progress gap of RFC 7.3
(:func:`max_no_progress_gap`). The report records provenance and every threshold before the run
it governs (:meth:`Report.fix`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from lora_contract import protocol
from lora_versions_demo.lifecycle import (
    TOOL_IDS,  # the scripted tool reply (both profiles share the tokenizer)
)
from lora_versions_dev.device_profile import AcceptanceFixtures, DeviceProfile
from lora_versions_dev.farm import ADMIN_KEY
from lora_versions_dev.teardown import live_versions, purge
from relax_glue.cohort import open_publisher
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
REPO = Path(__file__).resolve().parents[1]

# RFC 7.2's pre-run: each clean baseline answers each stability prefix this many times, and the
# logprob epsilon is max(the profile's floor, EPSILON_FACTOR x the largest spread measured). The
# factor leaves room for the managed engine being another process than the baseline that was
# measured; the floor is the profile's (lora_versions_dev.device_profile).
STABILITY_REPEATS = 3
EPSILON_FACTOR = 2.0
# Tokens generated per compared turn (RFC 7.2), and the pre-run's prefixes: fresh prompts of the
# lengths the comparisons use (a first turn, the KV test's shared prefix, a long tool-turn prefix).
TURN_TOKENS = 12
STABILITY_PREFIX_LENGTHS = (24, 48, 96)


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
    # Positions where the two versions' baselines differ by more than 2 epsilon (None: not scored).
    scoring_positions: int | None = None
    separation: float = 0.0  # the smallest |own - other| baseline logprob at those positions


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


def spread(runs: Sequence[Sequence[float]]) -> float:
    """The largest difference between repeats of one request, over its positions."""
    return max((max(col) - min(col) for col in zip(*runs, strict=True)), default=0.0)


def derive_epsilon(spreads: Sequence[float], factor: float, floor: float) -> float:
    """RFC 7.2's tolerance, from the baselines' own measured instability: ``factor`` times the
    largest spread, never below ``floor`` (the profile's: what two processes are known to differ
    by, which a pre-run on one engine may understate; CPU fp32 1e-5)."""
    return max(floor, factor * max(spreads, default=0.0))


def scoring_positions(own: Sequence[float], other: Sequence[float], eps: float) -> list[int]:
    """Where the two versions' clean baselines give the same token logprobs more than ``2 eps``
    apart: a logprob within ``eps`` of one of them is then more than ``eps`` from the other, so a
    match there says which version computed it (RFC 7.2: positions that tell A from B)."""
    return [i for i, (a, b) in enumerate(zip(own, other, strict=True)) if abs(a - b) > 2 * eps]


# ------------------------------------------------------------------------------ provenance


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def tree_digest(root: Path) -> str:
    """One digest of a fixture directory: every file's relative path and content, in order."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        h.update(f"{path.relative_to(root)}\0{_sha256_file(path)}\n".encode())
    return h.hexdigest()


def code_revision(repo: Path = REPO) -> dict[str, Any]:
    """The commit under test and whether the working tree differs from it (files changed)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False).stdout

    changed = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    return {"commit": git("rev-parse", "HEAD").strip() or "unknown", "uncommitted_changes": len(changed)}


def device_name(profile: DeviceProfile) -> str:
    if profile.device == "cuda":
        import torch

        return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return f"cpu {platform.machine()} x{os.cpu_count()} ({platform.processor() or 'unknown'})"


def provenance(profile: DeviceProfile, fixtures: AcceptanceFixtures) -> dict[str, Any]:
    """What RFC 7.2 fixes before the experiment beside the thresholds: the code revision, the
    SGLang (and torch) version, the device, and the digest of the model and of every adapter."""
    import torch

    digests = {"model": tree_digest(fixtures.model_dir)}
    digests |= {name: tree_digest(path) for name, path in sorted(fixtures.adapters.items())}
    return {
        "code": code_revision(),
        "sglang": metadata.version("sglang"),
        "torch": torch.__version__,
        "device": device_name(profile),
        "fixture_sha256": digests,
    }


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

    async def score(self, adapter: str, prefix: Sequence[int], tokens: Sequence[int]) -> list[float]:
        """The logprob of each of ``tokens`` after ``prefix`` on ``adapter``'s clean engine, the
        tokens given (prefill logprobs, which SGLang computes from the position after
        ``logprob_start_len``, whose own entry is None: it starts at the prefix's last token; a
        start also keeps SGLang from serving the positions after it from its prefix cache)."""
        req = {
            "input_ids": [*prefix, *tokens],
            "sampling_params": greedy(1),
            "return_logprob": True,
            "logprob_start_len": len(prefix) - 1,
            "lora_path": adapter,
        }
        r = await self.http.post(f"{self.urls[adapter]}/generate", json=req)
        assert r.status_code == 200, r.text
        entries = r.json()["meta_info"]["input_token_logprobs"]
        scored = [float(e[0]) for e in entries[-len(tokens) :]] if tokens else []
        assert len(scored) == len(tokens), (len(entries), len(tokens))
        return scored

    async def aclose(self) -> None:
        await self.http.aclose()


@dataclass(frozen=True)
class Stability:
    """RFC 7.2's pre-run: every clean baseline answered every prefix ``repeats`` times."""

    repeats: int
    prefixes: int
    tokens_stable: dict[str, bool]  # per adapter: the same tokens in every repeat
    spread: dict[str, float]  # per adapter: the largest logprob spread between repeats


async def baseline_stability(
    baselines: Baselines, prefixes: Sequence[Sequence[int]], n: int, repeats: int
) -> Stability:
    """Each baseline answers each prefix ``repeats`` times, one request at a time (the batch
    shape of the comparisons). The first answer is computed cold, the others from SGLang's prefix
    cache, so the spread includes what a cache hit changes."""
    stable: dict[str, bool] = {}
    spreads: dict[str, float] = {}
    for adapter in sorted(baselines.urls):
        worst, same = 0.0, True
        for prefix in prefixes:
            outs = [await baselines.generate(adapter, prefix, n) for _ in range(repeats)]
            same = same and all(o["output_ids"] == outs[0]["output_ids"] for o in outs)
            if same:
                worst = max(worst, spread([logprobs_of(o) for o in outs]))
        stable[adapter], spreads[adapter] = same, worst
    return Stability(repeats, len(prefixes), stable, spreads)


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
        *,
        epsilon: float | None = None,
        clients: Mapping[str, EngineClient] | None = None,
    ) -> None:
        """``epsilon``: the logprob tolerance the report fixed (``gpu_tests/conftest.py``'s
        ``epsilon`` fixture); :meth:`check` refuses to compare without it. ``clients``: real
        engine clients to use instead of plain HTTP ones (the collective transport's)."""
        self.profile = profile
        self.epsilon = epsilon
        self.engines = engines
        self.epoch = f"acc{uuid.uuid4().hex[:6]}"
        self.registry = LoRAVersionRegistry(self.epoch, cohort)
        self.clients: dict[str, EngineClient] = (
            dict(clients)
            if clients
            else {e: EngineClient(e, engines[e].url, admin_key=ACCEPTANCE_ADMIN_KEY) for e in cohort}
        )
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
        return open_publisher(
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
        """``t`` against the clean baseline of ``adapter`` (default: of the version it carried),
        with the turn's full prefix. A partial (aborted) turn has no logprobs: its tokens must be
        the baseline's first ones. Otherwise the baseline's tokens are also scored on the other
        version's clean engine, and the turn passes only if some of its positions tell the two
        versions apart (:func:`scoring_positions`): a match there cannot be the wrong version's."""
        if self.epsilon is None:
            raise RuntimeError("no logprob epsilon: the stability pre-run fixes it before any comparison")
        own = adapter or self.adapter_of[t.lora_path]
        ref = await self.baselines.generate(own, t.prefix, len(t.tokens))
        if t.kind == "partial":
            return compare(t.tokens, [], ref["output_ids"], [], self.epsilon)
        ref_lps = logprobs_of(ref)
        cmp = compare(t.tokens, t.logprobs, ref["output_ids"], ref_lps, self.epsilon)
        other = next((a for a in sorted(self.baselines.urls) if a != own), None)
        if other is None:
            return cmp
        other_lps = await self.baselines.score(other, t.prefix, ref["output_ids"])
        where = scoring_positions(ref_lps, other_lps, self.epsilon)
        separation = min((abs(ref_lps[i] - other_lps[i]) for i in where), default=0.0)
        return dataclasses.replace(
            cmp, ok=cmp.ok and bool(where), scoring_positions=len(where), separation=separation
        )

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
    """The acceptance report. ``report.json`` / ``report.txt`` in ``path`` are rewritten at every
    change, so a threshold fixed before a run is on disk before that run starts."""

    profile: DeviceProfile
    path: Path | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, dict[str, Any]] = field(default_factory=dict)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)

    def fix(self, name: str, value: Any, why: str = "") -> Any:
        """Fix a threshold (a bound, a load, a tolerance) before the run it governs; returns
        ``value``. A threshold is fixed once: fixing it again to another value raises."""
        value = json.loads(json.dumps(value, default=str))
        if name in self.thresholds and self.thresholds[name]["value"] != value:
            fixed = self.thresholds[name]["value"]
            raise ValueError(f"threshold {name} is fixed at {fixed!r}: not {value!r}")
        self.thresholds.setdefault(name, {"value": value, "why": why, "fixed_at": time.time()})
        self.write()
        return value

    def add(self, name: str, data: Mapping[str, Any]) -> None:
        self.sections[name] = {"device": self.profile.device, "written_at": time.time(), **data}
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "report.json").write_text(json.dumps(self.as_json(), indent=2, default=str))
        (self.path / "report.txt").write_text(self.table() + "\n")

    def as_json(self) -> dict[str, Any]:
        return {
            "profile": self.profile.describe(),
            "gpu_verified": self.profile.device == "cuda",
            "provenance": self.provenance,
            "thresholds": self.thresholds,
            "anchor": RELAX_ANCHOR,
            "sections": self.sections,
        }

    def table(self) -> str:
        lines = [f"RFC 7.2 / 7.3 acceptance on {self.profile.banner()}"]
        lines.append("  provenance")
        lines += [f"    {key:<34} {_short(value)}" for key, value in self.provenance.items()]
        lines.append("  thresholds (fixed before the run)")
        lines += [f"    {key:<34} {_short(t['value'])}" for key, t in self.thresholds.items()]
        for name, data in self.sections.items():
            lines.append(f"  {name}")
            lines += [f"    {key:<34} {_short(value)}" for key, value in data.items()]
        return "\n".join(lines)


def _short(value: Any, width: int = 90) -> Any:
    """A long dict or list cut for the text table (report.json has it whole)."""
    if isinstance(value, dict | list) and len(str(value)) > width:
        return f"{str(value)[: width - 3]}..."
    return value


# ------------------------------------------------------------------------------ load


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    # the smallest value with at least q % of the values at or below it: rank ceil(q/100 n)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def latency_summary(values: Sequence[float]) -> dict[str, float | int]:
    """p50 / p95 / p99 / max of request latencies (seconds), and how many."""
    return {
        "n": len(values),
        **{f"p{q}_s": round(percentile(values, q), 3) for q in (50, 95, 99)},
        "max_s": round(max(values, default=0.0), 3),
    }


def max_no_progress_gap(streams: Sequence[Stream], engine: str, lo: float, hi: float) -> float:
    """RFC 7.3's largest no-progress interval of ``engine`` within [lo, hi]: the longest time
    during which it had a request in flight (from the request's start to its last chunk) and no
    request of it received a chunk. A stalled prefill counts; time with nothing in flight does
    not (an idle engine makes no progress because it has none to make)."""
    mine = sorted(((s.started, s.t[-1]) for s in streams if s.engine == engine and s.t), key=lambda iv: iv[0])
    points = sorted(t for s in streams if s.engine == engine for t in s.t)
    busy: list[list[float]] = []
    for a, b in mine:
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    worst, k = 0.0, 0
    for a, b in busy:
        last = a
        while k < len(points) and points[k] < a:
            k += 1
        while k < len(points) and points[k] <= b:
            worst = max(worst, min(points[k], hi) - max(last, lo))
            last = points[k]
            k += 1
    return max(worst, 0.0)


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
