"""Shared helpers for the relax_glue registry tests (not a test module).

The ``Checked`` wrapper enforces, on every call, the two rules the registry promises: after an
accepted transition every invariant holds (full walk), and a refused call leaves the complete
state byte-for-byte unchanged (check before you mutate).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.registry import MUTATING_OPS, PUBLISHER_OPS, LoRAVersionRegistry
from relax_glue.registry_types import (
    CleanupEvidence,
    CommitReceipt,
    PreparedEvidence,
    ReadyEvidence,
    ReclaimClaim,
    ReserveResult,
    SessionKey,
    UnloadEvidence,
    VersionKey,
    VersionState,
)

EPOCH = "7"
ENGINES = ("E0", "E1")


def digest(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()


def lora_name(version_id: str, dig: str) -> str:
    return f"relax_policy_lora@{EPOCH}-{version_id}-{dig[:12]}"


def vk(version_id: str) -> VersionKey:
    return VersionKey(EPOCH, version_id)


def sk(nonce: str) -> SessionKey:
    return SessionKey(EPOCH, nonce)


def snapshot(reg: Any) -> dict[str, Any]:
    """A cheap comparable copy of the registry's whole state (records are frozen, containers
    are copied), used where a full ``dump()`` per call would be too slow."""
    core = getattr(reg, "registry", reg)  # a DurableRegistry wraps the pure registry
    return {k: (type(v)(v) if isinstance(v, dict | set | list) else v) for k, v in vars(core).items()}


class Checked:
    """Proxy over a registry (or durable store) that checks invariants and no-side-effect.

    It calls as the publisher (the holder of the registry object): a publication op gets the
    registry's publisher token unless the test passes one itself (``publisher_token=None`` too:
    a worker's call). ``fast=True`` compares :func:`snapshot` instead of the canonical ``dump()``.
    """

    def __init__(self, reg: Any, fast: bool = False) -> None:
        self.inner = reg
        self.state = (lambda: snapshot(reg)) if fast else reg.dump

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in MUTATING_OPS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if name in PUBLISHER_OPS:
                kwargs.setdefault("publisher_token", self.inner.publisher_token)
            before = self.state()
            try:
                result = attr(*args, **kwargs)
            except LoraVersionError:
                assert self.state() == before, f"refused {name} changed the state"
                raise
            self.inner.check_invariants(full=True)
            return result

        return call


def new_registry(capacity: int = 2, engines: tuple[str, ...] = ENGINES) -> Any:
    return Checked(LoRAVersionRegistry(EPOCH, engines, capacity))


def refused(code: ErrorCode, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> LoraVersionError:
    """Call ``fn`` and assert it is refused with ``code``; return the error."""
    try:
        fn(*args, **kwargs)
    except LoraVersionError as exc:
        assert exc.code is code, f"expected {code.value}, got {exc.code.value}: {exc.message}"
        return exc
    raise AssertionError(f"expected {code.value}, call was accepted")


class Publisher:
    """The publisher's bookkeeping in tests: incarnations, receipts, the happy paths."""

    def __init__(self, reg: Any) -> None:
        self.reg = reg
        # The holder of a registry object (or store) publishes with its token; a client fills
        # in the one it carries.
        self.auth = {"publisher_token": getattr(reg, "publisher_token", None)}
        self.incarnation: dict[str, str] = {}
        self.results: dict[str, ReserveResult] = {}
        for engine in reg.engines:
            self.restart(engine)

    def restart(self, engine: str) -> str:
        n = int(self.incarnation.get(engine, f"{engine}-i0").rsplit("i", 1)[1]) + 1
        self.incarnation[engine] = f"{engine}-i{n}"
        self.reg.register_engine_incarnation(engine, self.incarnation[engine], **self.auth)
        return self.incarnation[engine]

    def reserve(self, vid: str, content: str | None = None, request_id: str | None = None) -> ReserveResult:
        dig = digest(content or vid)
        res = self.reg.reserve(
            vk(vid), dig, lora_name(vid, dig), request_id or f"req-{vid}-{content or vid}", **self.auth
        )
        self.results[vid] = res
        return res

    def token(self, vid: str) -> str:
        return self.results[vid].attempt_token

    def prepared(self, vid: str, engine: str) -> Any:
        return self.reg.record_prepared(
            engine, PreparedEvidence(vk(vid), self.token(vid), self.incarnation[engine]), **self.auth
        )

    def ready(self, vid: str, engine: str, incarnation: str | None = None) -> Any:
        res = self.results[vid]
        inc = incarnation or self.incarnation[engine]
        return self.reg.record_ready(
            engine, ReadyEvidence(vk(vid), res.digest, res.attempt_token, inc), **self.auth
        )

    def commit(self, vid: str, revision: int | None = None) -> CommitReceipt:
        rev = self.reg.status().default_revision if revision is None else revision
        return self.reg.commit(vk(vid), self.token(vid), rev, **self.auth)

    def publish(self, vid: str) -> CommitReceipt:
        self.reserve(vid)
        for engine in self.reg.engines:
            self.prepared(vid, engine)
            self.ready(vid, engine)
        return self.commit(vid)

    def cleanup(self, vid: str, engine: str) -> Any:
        tok = self.token(vid)
        return self.reg.record_cleanup(
            engine, tok, CleanupEvidence(tok, self.incarnation[engine]), **self.auth
        )

    def fail(self, vid: str) -> None:
        self.reserve(vid)
        self.reg.abort(self.token(vid), "test failure", **self.auth)
        for engine in self.reg.engines:
            self.cleanup(vid, engine)

    def unloaded(self, vid: str, engine: str, claim: ReclaimClaim) -> Any:
        return self.reg.confirm_reclaim(
            vk(vid), engine, UnloadEvidence(claim.reclaim_id, self.incarnation[engine]), **self.auth
        )

    def reclaim(self, vid: str) -> ReclaimClaim:
        claim = self.reg.claim_reclaim(vk(vid), **self.auth)
        for engine in self.reg.engines:
            self.unloaded(vid, engine, claim)
        return claim


def random_ops(reg: Any, rng: Any, limit: int = 100_000) -> Any:
    """A deterministic stream of mostly-useful calls ``(op, kwargs)`` driven by ``reg.status()``.

    Given the same seed and the same (deterministic) registry answers, two runs yield the same
    stream: the crash test replays it in memory to know what the killed child had done.
    """
    engines = list(reg.engines)
    incarnation = {e: 1 for e in engines}
    for e in engines:
        yield "register_engine_incarnation", {"engine_id": e, "incarnation": f"{e}-i1"}
    sessions: list[str] = []
    live: list[str] = []
    n_versions = 0
    for _ in range(limit):
        status = reg.status()
        views = {v.version_key.version_id: v for v in status.versions}
        pending = next((v for v in status.versions if v.attempt_token == status.pending_attempt), None)
        roll = rng.random()
        engine = rng.choice(engines)
        inc = f"{engine}-i{incarnation[engine]}"
        if roll < 0.2:
            s = f"s{len(sessions)}"
            sessions.append(s)
            live.append(s)
            yield "bind_first", {"session_key": sk(s)}
        elif roll < 0.42 and live:
            s = live[0] if rng.random() < 0.7 else rng.choice(live)  # sessions mostly end in order
            if rng.random() < 0.3:
                yield "begin_close", {"session_key": sk(s)}
            else:
                live.remove(s)
                yield "close_and_release", {"session_key": sk(s)}
        elif roll < 0.62 and pending is not None and pending.state is VersionState.LOADING:
            vid = pending.version_key.version_id
            if rng.random() < 0.04:
                yield "abort", {"attempt_token": pending.attempt_token, "reason": "random"}
            elif rng.random() < 0.03:
                yield (
                    "mark_engine_unknown",
                    {"engine_id": engine, "ref": pending.attempt_token, "op": "end", "reason": "t"},
                )
            elif all(p.value == "READY" for p in pending.attempt_phases.values()):
                rev = status.default_revision + (1 if rng.random() < 0.1 else 0)
                yield (
                    "commit",
                    {
                        "version_key": vk(vid),
                        "attempt_token": pending.attempt_token,
                        "expected_default_revision": rev,
                    },
                )
            else:
                receipt = ReadyEvidence(vk(vid), pending.digest, pending.attempt_token, inc)
                yield "record_ready", {"engine_id": engine, "receipt": receipt}
        elif roll < 0.68 and pending is not None:  # ABORTED: clean up
            tok = pending.attempt_token
            yield (
                "record_cleanup",
                {"engine_id": engine, "attempt_token": tok, "receipt": CleanupEvidence(tok, inc)},
            )
        elif roll < 0.76:
            retired = [v for v in views.values() if v.state.value in ("RETIRED", "RECLAIMING")]
            if retired:
                v = rng.choice(retired)
                if v.reclaim_id is None:
                    yield "claim_reclaim", {"version_key": v.version_key}
                else:
                    receipt = UnloadEvidence(v.reclaim_id, inc)
                    yield (
                        "confirm_reclaim",
                        {"version_key": v.version_key, "engine_id": engine, "receipt": receipt},
                    )
        elif roll < 0.90:
            replay = rng.random() < 0.2 and n_versions > 0
            vid = f"v{rng.randrange(n_versions) if replay else n_versions}"
            n_versions += 0 if replay else 1
            content = vid + ("x" if rng.random() < 0.05 else "")
            dig = digest(content)
            yield (
                "reserve",
                {
                    "version_key": vk(vid),
                    "digest": dig,
                    "lora_name": lora_name(vid, dig),
                    "request_id": f"q{rng.randrange(10**6)}",
                },
            )
        elif roll < 0.92:
            incarnation[engine] += 1
            yield (
                "register_engine_incarnation",
                {"engine_id": engine, "incarnation": f"{engine}-i{incarnation[engine]}"},
            )
        else:
            yield "open_session", {"session_key": sk(f"s{rng.randrange(len(sessions) + 1)}")}


async def async_scenario(client: Any) -> str:
    """Publish A, race 20 first-binds of one session and 5 closes, publish B, reclaim A.

    Works on any async client; returns the final dump so callers can compare backends.
    """
    await client.connect()
    engines = client.engines

    async def publish(vid: str, revision: int) -> None:
        dig = digest(vid)
        res = await client.reserve(vk(vid), dig, lora_name(vid, dig), f"req-{vid}")
        receipts = [ReadyEvidence(vk(vid), dig, res.attempt_token, f"{e}-i1") for e in engines]
        await asyncio.gather(*(client.record_ready(e, r) for e, r in zip(engines, receipts, strict=True)))
        await client.commit(vk(vid), res.attempt_token, revision)

    await asyncio.gather(*(client.register_engine_incarnation(e, f"{e}-i1") for e in engines))
    await publish("A", 0)
    bindings = await asyncio.gather(*(client.bind_first(sk("s")) for _ in range(20)))
    assert len(set(bindings)) == 1 and bindings[0].version_key == vk("A")
    assert (await client.version(vk("A"))).session_refs == 1
    await publish("B", 1)
    try:
        await client.claim_reclaim(vk("A"))
        raise AssertionError("A is still bound")
    except LoraVersionError as exc:
        assert exc.code is ErrorCode.VERSION_IN_USE and exc.details["session_refs"] == 1
    closes = await asyncio.gather(*(client.close_and_release(sk("s")) for _ in range(5)))
    assert len(set(closes)) == 1 and (await client.version(vk("A"))).session_refs == 0
    claim = await client.claim_reclaim(vk("A"))
    await asyncio.gather(
        *(client.confirm_reclaim(vk("A"), e, UnloadEvidence(claim.reclaim_id, f"{e}-i1")) for e in engines)
    )
    assert (await client.version(vk("A"))).state is VersionState.RECLAIMED
    return await client.dump()
