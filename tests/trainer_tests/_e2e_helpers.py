"""Helpers for the end-to-end lifecycle tests on REAL engines (not a test module).

Everything here drives the real ``relax_glue`` classes against real SGLang processes; the only
test-side pieces are wrappers around the REAL engine client that hold, corrupt or lose one call
(:class:`Interceptor`), greedy baselines computed on the stock engine, and a teardown that leaves
the shared engines without the managed versions a test created.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _snapshots import snapshot_of as snapshot_of  # re-exported: the engine tests import it here

from lora_contract import protocol
from lora_versions_dev.farm import ADMIN_KEY
from lora_versions_dev.teardown import engine_versions, live_versions, purge
from relax_glue.cohort import open_publisher
from relax_glue.engine_client import AuditEntry, AuditLog, EngineAPI, EngineClient, forbidden_calls
from relax_glue.gateway import GatewayClient
from relax_glue.publisher import Publisher, PublishResult
from relax_glue.registry import LoRAVersionRegistry
from relax_glue.registry_types import VersionKey, VersionState
from relax_glue.sessions import Session, SessionManager

PREFIX = protocol.DEFAULT_LORA_PREFIX
PROMPTS: tuple[tuple[int, ...], ...] = (
    (302, 356, 417, 494, 439),  # "The quick brown"
    (2, 87, 82, 293, 202, 90, 72, 492, 313),  # "<|im_start|>tool\nweather ..."
    (461, 275, 29, 446, 27, 224, 38, 15),
    (288, 79, 82, 88, 71, 92, 3, 202),
)
# "<|im_start|>tool\nweather in Paris: 18 C, cloudy<|im_end|>\n" in the fixture tokenizer
TOOL_IDS: tuple[int, ...] = (
    2,
    87,
    82,
    293,
    202,
    90,
    72,
    492,
    313,
    461,
    275,
    29,
    446,
    27,
    224,
    38,
    15,
    288,
    79,
    82,
    88,
    71,
    92,
    3,
    202,
)


def new_epoch() -> str:
    return f"e{uuid.uuid4().hex[:6]}"


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def make_clients(
    engines: Sequence[Any], admin_key: str | None, names: Sequence[str] | None = None, transport: str = "http"
) -> dict:
    """One REAL EngineClient per engine (``engine.url``), keyed by engine id; with
    ``transport="collective"`` each has its own collective group (this process is the trainer)."""
    from relax_glue.bucket_transport import CollectiveTransport

    ids = list(names) if names is not None else [e.name for e in engines]
    return {
        i: EngineClient(
            i,
            e.url,
            admin_key=admin_key,
            transport=CollectiveTransport() if transport == "collective" else None,
        )
        for i, e in zip(ids, engines, strict=True)
    }


async def aclose_all(clients: Iterable[Any]) -> None:
    for c in clients:
        with contextlib.suppress(Exception):
            await c.aclose()


# ------------------------------------------------------------------------ call interception


Hook = Callable[..., Awaitable[Any]]  # hook(nth, call_inner, *args) -> result


class Interceptor:
    """Wraps a REAL engine client; a hook may hold, alter or replace one op's calls. Every op
    without a hook passes through untouched (audit, pools, timeouts stay the real client's)."""

    OPS = ("begin", "receive_bucket", "end", "cleanup", "reclaim", "status", "version_status", "generate")

    def __init__(self, inner: EngineAPI) -> None:
        self.inner = inner
        self.engine_id = inner.engine_id
        self.calls: collections.Counter[str] = collections.Counter()
        self._hooks: dict[str, Hook] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def on(self, op: str, hook: Hook | None) -> Interceptor:
        """Install (or remove) the hook of ``op``; its call count restarts at 0."""
        if op not in self.OPS:
            raise ValueError(op)
        self.calls[op] = 0
        if hook is None:
            self._hooks.pop(op, None)
        else:
            self._hooks[op] = hook
        return self

    async def _run(self, op: str, *args: Any) -> Any:
        self.calls[op] += 1
        call = getattr(self.inner, op)
        hook = self._hooks.get(op)
        if hook is None:
            return await call(*args)
        return await hook(self.calls[op], call, *args)

    async def begin(self, req: Any) -> Any:
        return await self._run("begin", req)

    async def receive_bucket(self, meta: Any, payload: bytes) -> Any:
        return await self._run("receive_bucket", meta, payload)

    async def end(self, req: Any) -> Any:
        return await self._run("end", req)

    async def cleanup(self, req: Any) -> Any:
        return await self._run("cleanup", req)

    async def reclaim(self, req: Any) -> Any:
        return await self._run("reclaim", req)

    async def status(self) -> Any:
        return await self._run("status")

    async def version_status(self, lora_name: str) -> Any:
        return await self._run("version_status", lora_name)

    async def generate(self, body: Mapping[str, Any]) -> Any:
        return await self._run("generate", body)

    def generate_stream(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return self.inner.generate_stream(body)

    async def abort_request(self, rid: str) -> None:
        return await self.inner.abort_request(rid)


class Gate:
    """Holds the ``nth`` call of an op until :meth:`open`; ``reached`` is set when it arrives."""

    def __init__(self, nth: int = 1) -> None:
        self.nth = nth
        self.reached = asyncio.Event()
        self.opened = asyncio.Event()

    def open(self) -> None:
        self.opened.set()

    async def __call__(self, n: int, call: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        if n == self.nth:
            self.reached.set()
            await self.opened.wait()
        return await call(*args)


def corrupt_bucket(nth: int) -> Hook:
    """The ``nth`` bucket arrives with one tensor byte flipped (its checksum header unchanged):
    the engine must refuse it (CHECKSUM_MISMATCH), a clean 4xx. (A flipped byte of the
    safetensors header is refused before the checksum can be computed, as INVALID_REQUEST or
    MANIFEST_MISMATCH: tests/plugin_tests/test_bucket_receiver.py.)"""

    async def hook(n: int, call: Callable[..., Awaitable[Any]], meta: Any, payload: bytes) -> Any:
        if n == nth:
            payload = payload[:-1] + bytes([payload[-1] ^ 0xFF])
        return await call(meta, payload)

    return hook


def lose_bucket(nth: int) -> Hook:
    """A lossy transport: the ``nth`` bucket never reaches the engine, yet an ack comes back.
    The engine's ``end`` must notice the missing bucket (MANIFEST_MISMATCH), a clean 4xx."""

    async def hook(n: int, call: Callable[..., Awaitable[Any]], meta: Any, payload: bytes) -> Any:
        if n == nth:
            return protocol.BucketAck(index=meta.index, accepted=True)
        return await call(meta, payload)

    return hook


# ------------------------------------------------------------------------------ engine views


async def engine_state(client: EngineAPI, lora_name: str) -> protocol.EngineVersionState | None:
    return {n: v.state for n, v in (await engine_versions(client)).items()}.get(lora_name)


async def versions_on(engines: Sequence[Any], marker: str, *, remove: bool = False) -> dict[str, list[str]]:
    """Per farm engine (``name``, ``url``): the managed versions named with ``marker`` that still
    hold something; with ``remove``, what is left after removing them (for tests that hold no
    engine client of their own, e.g. around training processes)."""
    clients = make_clients(engines, ADMIN_KEY)
    try:
        return await (purge(clients, marker) if remove else live_versions(clients, marker))
    finally:
        await aclose_all(clients.values())


async def version_states(engines: Sequence[Any], marker: str) -> dict[str, dict[str, str]]:
    """Per farm engine: the state of every managed version named with ``marker``."""
    clients = make_clients(engines, ADMIN_KEY)
    try:
        versions = {e: await engine_versions(c, marker) for e, c in clients.items()}
        return {e: {n: v.state.value for n, v in vs.items()} for e, vs in versions.items()}
    finally:
        await aclose_all(clients.values())


# ------------------------------------------------------------------------------ audit checks


def audit_logs(clients: Iterable[Any]) -> list[AuditLog]:
    return [c.audit for c in clients]


def failed_generations(
    logs: Iterable[AuditLog], since_seq: Mapping[int, int] | None = None
) -> list[AuditEntry]:
    out = []
    for log in logs:
        start = (since_seq or {}).get(id(log), 0)
        out.extend(e for e in log.entries(kind="generation") if e.seq > start and e.outcome != "ok")
    return out


def assert_clean_audit(clients: Iterable[Any], *, allow_failed_rids: Iterable[str] = ()) -> dict[str, int]:
    """No pause / flush / abort-all ever; no generation request failed or was aborted by the engine
    (except the listed rids: deliberate refusals and temporary aborts)."""
    logs = audit_logs(clients)
    bad = forbidden_calls(logs)
    assert not bad, f"forbidden control calls: {bad}"
    allowed = set(allow_failed_rids)
    failed = [e for e in failed_generations(logs) if e.detail not in allowed]
    assert not failed, f"generation requests failed: {failed}"
    counts: dict[str, int] = collections.Counter()
    for log in logs:
        for e in log.entries():
            counts[f"{e.kind}:{e.op}"] += 1
    return dict(counts)


def begins_for(clients: Iterable[Any], lora_name: str) -> list[AuditEntry]:
    return [
        e
        for c in clients
        for e in c.audit.entries(kind="control")
        if e.op == "begin" and e.detail == lora_name
    ]


# ------------------------------------------------------------------------- reference tokens


class References:
    """Single-version greedy baselines on the stock engine (plugin off): each adapter loaded
    there with stock ``/load_lora_adapter`` under a name of its own, every prefix sent whole."""

    def __init__(self, stock_url: str, adapter_dirs: Mapping[str, Path]) -> None:
        self.url = stock_url.rstrip("/")
        self.adapter_dirs = dict(adapter_dirs)
        self._loaded: dict[str, str] = {}
        self._cache: dict[tuple[str | None, tuple[int, ...], int], list[int]] = {}
        self.http = httpx.AsyncClient(timeout=120)

    async def _name(self, adapter: str) -> str:
        name = self._loaded.get(adapter)
        if name is None:
            name = f"e2e-ref-{adapter}-{uuid.uuid4().hex[:8]}"
            r = await self.http.post(
                f"{self.url}/load_lora_adapter",
                json={"lora_name": name, "lora_path": str(self.adapter_dirs[adapter])},
            )
            assert r.status_code == 200 and r.json().get("success"), r.text
            self._loaded[adapter] = name
        return name

    async def tokens(self, adapter: str | None, prefix: Sequence[int], n: int) -> list[int]:
        key = (adapter, tuple(prefix), n)
        if key not in self._cache:
            body: dict[str, Any] = {"input_ids": list(prefix), "sampling_params": greedy(n)}
            if adapter is not None:
                body["lora_path"] = await self._name(adapter)
            r = await self.http.post(f"{self.url}/generate", json=body)
            assert r.status_code == 200, r.text
            self._cache[key] = list(r.json()["output_ids"])
        return self._cache[key]

    async def aclose(self) -> None:
        for name in self._loaded.values():
            with contextlib.suppress(Exception):
                await self.http.post(f"{self.url}/unload_lora_adapter", json={"lora_name": name})
        self._loaded.clear()
        await self.http.aclose()


# ------------------------------------------------------------------------------ transcripts


@dataclass
class Turn:
    session: str
    kind: str  # "turn" | "tool" | "retry" | "partial" | "resume"
    engine: str
    lora_path: str
    prefix: list[int]
    tokens: list[int]
    n: int  # tokens asked for (a partial got fewer)


@dataclass
class Transcript:
    turns: list[Turn] = field(default_factory=list)
    aborted_rids: list[str] = field(default_factory=list)  # deliberate temporary aborts

    def add(self, s: Session, kind: str, prefix: Sequence[int], tokens: Sequence[int], n: int) -> list[int]:
        engine = s.requests[-1].engine_id if s.requests else "?"
        assert s.lora_path is not None
        # what the engine attested it ran for the turn's tokens is the binding (issue 39; the
        # session layer refuses any other, this says the record holds it)
        assert not tokens or s.requests[-1].served == (s.lora_path,), s.requests[-1]
        self.turns.append(Turn(s.name, kind, engine, s.lora_path, list(prefix), list(tokens), n))
        return list(tokens)

    async def mismatches(self, refs: References, adapter_of: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every turn against the baseline of its bound version with its full prefix; a partial
        (aborted) stream is compared with the first tokens of that baseline."""
        bad = []
        for t in self.turns:
            ref = await refs.tokens(adapter_of[t.lora_path], t.prefix, t.n)
            want = ref[: len(t.tokens)] if t.kind == "partial" else ref
            if t.tokens != want:
                bad.append({"turn": t.__dict__, "expected": want})
        return bad

    def table(self, adapter_of: Mapping[str, str]) -> str:
        rows = [f"{'session':<8}{'kind':<8}{'engine':<7}{'version':<8}{'prefix':>7}  tokens"]
        for t in self.turns:
            toks = " ".join(map(str, t.tokens[:10])) + (" ..." if len(t.tokens) > 10 else "")
            version = adapter_of[t.lora_path]
            rows.append(f"{t.session:<8}{t.kind:<8}{t.engine:<7}{version:<8}{len(t.prefix):>7}  {toks}")
        return "\n".join(rows)


async def turn(tx: Transcript, s: Session, prefix: Sequence[int], n: int, kind: str = "turn") -> list[int]:
    out = await s.generate({"input_ids": list(prefix), "sampling_params": greedy(n)})
    return tx.add(s, kind, prefix, out["output_ids"], n)


async def abort_and_resume(
    tx: Transcript, s: Session, prefix: Sequence[int], n: int, abort_after: int = 3
) -> tuple[list[int], list[int]]:
    """Stream a long turn, abort it by rid after ``abort_after`` tokens (a temporary abort: the
    binding stays), then resume with the partial output appended to the prefix."""
    rid = f"{s.name}-abort-{uuid.uuid4().hex[:8]}"
    partial: list[int] = []
    finish = None
    aborted = False
    async for chunk in s.generate_stream({"input_ids": list(prefix), "sampling_params": greedy(n)}, rid=rid):
        partial = list(chunk.get("output_ids") or partial)
        finish = (chunk.get("meta_info") or {}).get("finish_reason")
        if not aborted and len(partial) >= abort_after:
            aborted = await s.abort(rid)
    assert aborted and finish is not None and finish.get("type") == "abort", (finish, len(partial))
    assert 0 < len(partial) < n, len(partial)
    assert s.requests[-1].rid == rid and s.requests[-1].outcome == "aborted", s.requests[-1]
    tx.aborted_rids.append(rid)
    tx.add(s, "partial", prefix, partial, n)
    resumed_prefix = [*prefix, *partial]
    rest = await turn(tx, s, resumed_prefix, n - len(partial), kind="resume")
    return partial, rest


def version_key(epoch: str, vid: str) -> VersionKey:
    return VersionKey(epoch, vid)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))


# ------------------------------------------------------------------------------ the world

COHORT = ("E0", "E1")


async def reach(gate: Gate, task: asyncio.Task, timeout_s: float = 60.0) -> None:
    """Wait until the held call arrived at ``gate``; fail at once if the publication ended first."""
    waiter = asyncio.ensure_future(gate.reached.wait())
    done, _ = await asyncio.wait({waiter, task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if waiter not in done:
        waiter.cancel()
        if task in done:
            raise AssertionError(f"the publication ended before reaching the gate: {task.result()}")
        raise AssertionError(f"the gate was not reached within {timeout_s}s")


async def wait_until(pred: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


class Deployment:
    """One test's deployment: a registry of its own epoch, real clients for E0/E1, the
    publisher, the session manager and the stock baselines. ``async with`` tears it down:
    sessions closed, every managed version of this epoch removed from the engines."""

    def __init__(
        self,
        engines: tuple,
        stock: Any,
        fixtures: Any,
        *,
        registry: Any = None,
        cohort: tuple[str, ...] = COHORT,
        epoch: str | None = None,
        store: Any = None,
        transport: str = "http",
        gateway: str | None = None,
    ) -> None:
        self.store = store
        self.epoch = epoch or new_epoch()
        self.cohort = cohort
        self.reg = registry if registry is not None else LoRAVersionRegistry(self.epoch, cohort)
        self.clients: dict[str, Any] = make_clients(engines, ADMIN_KEY, cohort, transport)
        self.pub_engines: dict[str, EngineAPI] = dict(self.clients)
        self.pub = self._publisher()
        # gateway: the URL of an smg gateway in front of the engines; sessions then generate
        # through it (control calls still go to each engine).
        self.gw = GatewayClient(gateway, self.clients) if gateway else None
        self.sm = SessionManager(self.reg, self.clients, gateway=self.gw, drain_timeout_s=10.0)
        self.refs = References(stock.url, {n: fixtures.adapter_dir(n) for n in ("A", "B", "C")})
        self.adapter_of: dict[str, str] = {}  # lora_name -> fixture adapter
        self.name_of: dict[str, str] = {}  # version id -> lora_name
        self.tx = Transcript()
        self.extra_clients: list[Any] = []

    def _publisher(self) -> Publisher:
        return open_publisher(
            self.reg,
            self.pub_engines,
            reclaim_wait_s=1.0,
            reclaim_poll_s=0.05,
            reclaim_deadline_s=60.0,
            store=self.store,
        )

    def wrap(self, engine: str, wrapper: Any) -> Any:
        """The publisher talks to ``engine`` through ``wrapper`` (around the real client)."""
        self.pub_engines[engine] = wrapper
        self.pub = self._publisher()
        return wrapper

    def unwrap(self) -> None:
        self.pub_engines = dict(self.clients)
        self.pub = self._publisher()

    def restore_on_version_missing(self) -> list[str]:
        """A session turn refused before admission with UNKNOWN_VERSION (its engine restarted and
        holds nothing) runs the reconciler for that engine and is sent again (every 0.2 s). The
        list returned fills with the engines restored, in order."""
        restored: list[str] = []

        async def restore(engine_id: str, lora_path: str) -> None:
            restored.append(engine_id)
            await self.pub.reconcile([engine_id])

        self.sm.on_version_missing = restore
        self.sm.resend_interval_s = 0.2
        return restored

    @property
    def marker(self) -> str:
        return f"@{self.epoch}-"

    def key(self, vid: str) -> VersionKey:
        return VersionKey(self.epoch, vid)

    def note(self, snap: Any, vid: str, adapter: str) -> str:
        name = snap.lora_name(protocol.DEFAULT_LORA_PREFIX, self.epoch, vid)
        self.adapter_of[name] = adapter
        self.name_of[vid] = name
        return name

    async def publish(self, snaps: Mapping[str, Any], adapter: str, vid: str | None = None) -> PublishResult:
        vid = vid or adapter
        self.note(snaps[adapter], vid, adapter)
        return await self.pub.publish(snaps[adapter], vid)

    async def reg_call(self, op: str, **kw: Any) -> Any:
        return await getattr(self.pub.registry, op)(**kw)

    async def version(self, vid: str) -> Any:
        return await self.reg_call("version", version_key=self.key(vid))

    async def status(self) -> Any:
        return await self.reg_call("status")

    async def __aenter__(self) -> Deployment:
        # The contract between modules sharing E0/E1: nobody leaves a managed version behind.
        live = await live_versions(self.clients)
        for engine, names in live.items():
            assert not names, f"{engine} starts with managed versions another test left behind: {names}"
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.sm.close_all(), 30)
            left = await purge(self.clients, self.marker)
            assert not any(left.values()), f"versions left on the engines: {left}"
        except Exception:
            if exc is None:
                raise  # otherwise the test's own failure is the one to report, not the purge's
        finally:
            await self.refs.aclose()
            await aclose_all([*self.clients.values(), *self.extra_clients, *([self.gw] if self.gw else [])])


def vstate(view: Any) -> VersionState | None:
    return None if view is None else view.state


def lora_paths(s: Session) -> set[str]:
    return {r.lora_path for r in s.requests}
