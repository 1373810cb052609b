"""What the operator CLI (``lora-versions``) does, as async functions over a registry and a
cohort of engines. Each returns plain records (JSON types) that the CLI prints as a table or as
JSON; long operations report progress through a callback.

Where the registry lives, as the CLI names it (``--registry``):

* ``sqlite:PATH``: the durable registry database. Queries (``status``, ``sessions``) read a
  point-in-time copy without the writer lock, so they work while a trainer holds it. Commands
  that change it (``publish``, ``reclaim``, ``resolve``) open it as its single writer, and are
  refused (``StoreLockedError``) while another process holds it.
* ``ray:EPOCH`` or ``ray:EPOCH@ADDRESS``: the epoch's named registry actor on a running Ray
  cluster (the single writer is the actor; the CLI is one more client). Commands that change it
  act for the publisher: they need the token the trainer started the actor with, in the
  environment (``LORA_VERSIONS_PUBLISHER_TOKEN``); without it they are refused (NOT_PUBLISHER).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lora_contract import protocol
from lora_contract.errors import LoraVersionError
from relax_glue.actor import DEFAULT_NAMESPACE, AsyncRegistryClient, get_registry_actor
from relax_glue.cohort import Cohort, open_publisher
from relax_glue.engine_client import EngineAPI, EngineClient, OutcomeUnknown
from relax_glue.publisher import PublishResult
from relax_glue.reclaimer import ReclaimResult
from relax_glue.registry_types import SessionView, StatusView
from relax_glue.snapshot import Snapshot
from relax_glue.snapshot_store import SnapshotStore
from relax_glue.store import DurableRegistry, read_registry

__all__ = [
    "Progress",
    "cohort_status",
    "engine_clients",
    "open_registry",
    "parse_engines",
    "publish_dir",
    "reclaim_ready",
    "resolve_pending",
    "session_rows",
]

Progress = Callable[[str], None]
# Where an operator gives the publisher token to commands that change a registry actor's state.
PUBLISHER_TOKEN_ENV = "LORA_VERSIONS_PUBLISHER_TOKEN"


def _quiet(_: str) -> None:
    pass


def parse_engines(specs: Sequence[str]) -> dict[str, str]:
    """``ID=URL`` pairs in cohort order (``E0=http://127.0.0.1:30000``)."""
    engines: dict[str, str] = {}
    for spec in specs:
        eid, sep, url = spec.partition("=")
        if not sep or not eid or not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine wants ID=URL (e.g. E0=http://127.0.0.1:30000), got {spec!r}")
        if eid in engines:
            raise ValueError(f"engine id {eid!r} given twice")
        engines[eid] = url.rstrip("/")
    return engines


def engine_clients(engines: Mapping[str, str], admin_key: str | None) -> dict[str, EngineClient]:
    return {eid: EngineClient(eid, url, admin_key=admin_key) for eid, url in engines.items()}


# ------------------------------------------------------------------------------ the registry


@contextlib.asynccontextmanager
async def open_registry(
    spec: str, *, writable: bool, epoch: str | None = None, engines: Sequence[str] = ()
) -> AsyncIterator[AsyncRegistryClient]:
    """The registry ``spec`` names (see the module docstring), as an async client."""
    kind, _, rest = spec.partition(":")
    if kind == "sqlite" and rest:
        path = Path(rest)
        if not writable:
            yield AsyncRegistryClient.in_process(read_registry(path), offload=False)
            return
        if path.exists():
            copy = read_registry(path)  # the epoch and cohort it was created with
            if epoch not in (None, copy.epoch) or (engines and tuple(engines) != copy.engines):
                raise ValueError(
                    f"{path} is the registry of epoch {copy.epoch!r} with engines {list(copy.engines)}, "
                    f"not epoch {epoch!r} with {list(engines)}"
                )
            epoch, engines = copy.epoch, copy.engines
        elif epoch is None or not engines:
            raise ValueError(f"{path} does not exist: a new registry needs --epoch and the --engine cohort")
        store = DurableRegistry.open(path, epoch, engines)
        try:
            yield AsyncRegistryClient.in_process(store)
        finally:
            store.close()
        return
    if kind == "ray" and rest:
        import ray  # the optional [ray] extra: only a ray: registry needs it

        actor_epoch, _, address = rest.partition("@")
        ray.init(address=address or "auto", namespace=DEFAULT_NAMESPACE, ignore_reinit_error=True)
        token = (os.environ.get(PUBLISHER_TOKEN_ENV) or None) if writable else None
        yield AsyncRegistryClient.for_actor(get_registry_actor(actor_epoch), publisher_token=token)
        return
    raise ValueError(f"--registry wants sqlite:PATH or ray:EPOCH[@ADDRESS], got {spec!r}")


# ------------------------------------------------------------------------------ status views


def registry_record(status: StatusView) -> dict[str, Any]:
    return {
        "epoch": status.epoch,
        "default": status.default_lora_name,
        "default_revision": status.default_revision,
        "slots": f"{status.slots_used}/{status.capacity}",
        "pending_attempt": status.pending_attempt,
        "engines": dict(status.engines),
        "sessions": dict(status.sessions),
        "versions": [
            {
                "version": f"{v.version_key.epoch}/{v.version_key.version_id}",
                "lora_name": v.lora_name,
                "state": v.state.value + (" (default)" if v.lora_name == status.default_lora_name else ""),
                "session_refs": v.session_refs,
                "holds_slot": v.holds_slot,
                "engines": {e: p.value for e, p in v.attempt_phases.items()},
            }
            for v in status.versions
        ],
        "unknown_outcomes": [dataclasses.asdict(u) for u in status.unknown_outcomes],
    }


async def _engine_record(client: EngineAPI) -> dict[str, Any]:
    try:
        st = await client.status()
    except (OutcomeUnknown, LoraVersionError) as exc:
        return {"reachable": False, "error": str(exc)}
    return {
        "reachable": True,
        "incarnation": st.incarnation,
        "managed_capacity": st.managed_capacity,
        "versions": [
            {
                "lora_name": v.lora_name,
                "state": v.state.value,
                "in_flight": v.in_flight,
                "buckets": f"{v.buckets_received}/{v.buckets_total}",
            }
            for v in st.versions
        ],
    }


async def cohort_status(
    registry: AsyncRegistryClient | None, clients: Mapping[str, EngineAPI]
) -> dict[str, Any]:
    """The registry's view and every engine's own, side by side; ``consistent`` says whether
    each engine runs the incarnation the registry knows (False: a restart the registry has not
    seen yet, which the publisher's next run or ``resolve`` handles)."""

    engines = dict(
        zip(clients, await asyncio.gather(*(_engine_record(c) for c in clients.values())), strict=True)
    )
    out: dict[str, Any] = {"engines": engines}
    if registry is not None:
        reg = registry_record(await registry.status())
        out["registry"] = reg
        for eid, rec in engines.items():
            known = reg["engines"].get(eid)
            rec["registry_incarnation"] = known
            rec["consistent"] = rec.get("incarnation") == known if known and rec["reachable"] else None
    return out


def session_rows(sessions: Iterable[SessionView]) -> list[dict[str, Any]]:
    return [
        {
            "session": f"{s.session_key.epoch}/{s.session_key.nonce}",
            "state": s.state.value + (" (expired)" if s.expired else ""),
            "bound": s.binding.lora_name if s.binding else None,
            "released": s.released,
            "lease_id": s.lease_id,
        }
        for s in sessions
    ]


# ------------------------------------------------------------------------------ progress


class _Reporting:
    """Around a real engine client: forwards every call, reports buckets and drains."""

    def __init__(self, inner: EngineAPI, progress: Progress, buckets_total: int = 0) -> None:
        self.inner = inner
        self.engine_id = inner.engine_id
        self.progress = progress
        self.buckets_total = buckets_total

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def receive_bucket(self, meta: protocol.ReceiveBucketMeta, payload: bytes) -> Any:
        ack = await self.inner.receive_bucket(meta, payload)
        self.progress(f"{self.engine_id}: bucket {meta.index + 1}/{self.buckets_total} acknowledged")
        return ack

    async def end(self, req: protocol.EndRequest) -> Any:
        self.progress(f"{self.engine_id}: end (verify, load pinned, probe)")
        return await self.inner.end(req)

    async def reclaim(self, req: protocol.ReclaimRequest) -> Any:
        reply = await self.inner.reclaim(req)
        if isinstance(reply, protocol.DrainingReply):
            self.progress(f"{self.engine_id}: {req.lora_name} draining, {reply.in_flight} in flight")
        else:
            self.progress(f"{self.engine_id}: {req.lora_name} unloaded")
        return reply


def _reporting(
    clients: Mapping[str, EngineAPI], progress: Progress, buckets: int = 0
) -> dict[str, EngineAPI]:
    return {eid: _Reporting(c, progress, buckets) for eid, c in clients.items()}  # type: ignore[misc]


def publish_record(res: PublishResult) -> dict[str, Any]:
    return {
        "outcome": res.outcome.value,
        "ok": res.ok,
        "version": f"{res.version_key.epoch}/{res.version_key.version_id}",
        "lora_name": res.lora_name,
        "digest": res.digest,
        "error": None if res.error is None else {"code": res.error.code.value, "message": res.error.message},
        "unknown_engines": list(res.unknown),
        "registry_state": res.registry_state.value if res.registry_state else None,
        "phase_ms": {k: round(v * 1000, 1) for k, v in res.phase_s.items()},
        "total_ms": round(res.duration_s * 1000, 1),
    }


def reclaim_record(res: ReclaimResult) -> dict[str, Any]:
    return {
        "version": f"{res.version_key.epoch}/{res.version_key.version_id}",
        "lora_name": res.lora_name,
        "done": res.done,
        "registry_state": res.registry_state.value if res.registry_state else None,
        "engines": {e: str(outcome) for e, outcome in res.engines.items()},
        "error": None if res.error is None else {"code": res.error.code.value, "message": res.error.message},
    }


async def publish_dir(
    registry: AsyncRegistryClient,
    clients: Mapping[str, EngineAPI],
    adapter_dir: Path,
    version_id: str,
    *,
    bucket_bytes: int,
    snapshot_dir: Path | None = None,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """Snapshot a PEFT adapter directory and publish it as ``version_id`` (begin, ordered
    buckets, end on every engine, then commit)."""
    snap = Snapshot.from_peft_dir(adapter_dir, max_bucket_bytes=bucket_bytes)
    mib, n = snap.total_bytes / 2**20, len(snap.bucket_plan)
    progress(f"snapshot: {mib:.1f} MiB in {n} buckets, digest {snap.digest[:12]}")
    store = SnapshotStore(snapshot_dir) if snapshot_dir is not None else None
    pub = open_publisher(registry, _reporting(clients, progress, len(snap.bucket_plan)), store=store)
    return publish_record(await pub.publish(snap, version_id))


async def reclaim_ready(
    registry: AsyncRegistryClient,
    clients: Mapping[str, EngineAPI],
    *,
    deadline_s: float,
    progress: Progress = _quiet,
) -> list[dict[str, Any]]:
    """Reclaim every retired version whose session refs reached zero (drains, then one unload
    per engine)."""
    cohort = Cohort.open(registry, _reporting(clients, progress), reclaim_deadline_s=deadline_s)
    return [reclaim_record(r) for r in await cohort.reclaim_ready(deadline_s=deadline_s)]


async def resolve_pending(
    registry: AsyncRegistryClient,
    clients: Mapping[str, EngineAPI],
    *,
    snapshot_dir: Path | None = None,
    adapter_dir: Path | None = None,
    bucket_bytes: int,
    progress: Progress = _quiet,
) -> dict[str, Any] | None:
    """Settle the pending attempt (LOADING or ABORTED), if any: see Publisher.resolve."""
    snap = Snapshot.from_peft_dir(adapter_dir, max_bucket_bytes=bucket_bytes) if adapter_dir else None
    store = SnapshotStore(snapshot_dir) if snapshot_dir is not None else None
    pub = open_publisher(registry, _reporting(clients, progress), store=store)
    res = await pub.resolve(snap)
    return None if res is None else publish_record(res)


async def aclose_all(clients: Iterable[Any]) -> None:
    for c in clients:
        close: Callable[[], Awaitable[None]] | None = getattr(c, "aclose", None)
        if close is not None:
            await close()
