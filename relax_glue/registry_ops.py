"""The registry's operations as typed client surfaces, for everything that forwards them.

Each operation is declared once, on the registry's method (``@operation(kind)``,
:mod:`relax_glue.registry_spec`); ``PUBLIC_OPS`` is derived from those declarations.
:class:`~relax_glue.store.DurableRegistry` (journal) and the clients in :mod:`relax_glue.actor`
(in process or through the Ray actor) expose exactly those operations, with the same names,
arguments and results. Each typed method below forwards its keyword arguments, in signature
order, to one hook, ``_dispatch(op, **kwargs)``, that the user class implements. A timed op's
``now`` may be left out here: the host stamps its clock.

The async client uses :class:`AsyncRegistryOps`, generated from the sync table: every method is a
coroutine function that awaits what the (async) ``_dispatch`` returns. The generated methods
carry the typed signatures at runtime (``inspect.signature``, ``help``) through
``functools.wraps``; static checkers read them from :class:`AsyncRegistryAPI`, the coroutine
forms written out, so no generated method is ``Any`` to them.

The written-out forms are held to the declarations mechanically: ``test_registry_op_surfaces``
fails, naming the operation, when any surface (the registry's declarations, this sync table,
the async stubs, the generated coroutines, the clients, the actor's dispatch) misses an
operation, has one more, or gives one another signature.

Publication ops (``PUBLISHER_OPS``) take a keyword-only ``publisher_token`` (None by default); a
client that carries the publisher token fills it in for them (:mod:`relax_glue.actor`).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from relax_glue.registry import PUBLIC_OPS
from relax_glue.registry_types import (
    AbortResult,
    Binding,
    CleanupEvidence,
    CommitReceipt,
    EngineAck,
    EngineLostResult,
    IncarnationResult,
    LeaseView,
    PreparedEvidence,
    ReadyEvidence,
    ReclaimClaim,
    ReserveResult,
    SessionKey,
    SessionView,
    StatusView,
    UnloadEvidence,
    VersionKey,
    VersionView,
)

__all__ = ["AsyncRegistryAPI", "AsyncRegistryOps", "RegistryOps"]


class RegistryOps:
    """Typed registry operations forwarding to ``self._dispatch(op, **kwargs)``."""

    def _dispatch(self, op: str, /, **kwargs: Any) -> Any:
        # ``op`` is positional-only: mark_engine_unknown has an argument named ``op`` too.
        raise NotImplementedError

    # --------------------------------------------------------------------- mutating ops

    def record_base(self, fingerprint: str, *, publisher_token: str | None = None) -> str:
        return self._dispatch("record_base", fingerprint=fingerprint, publisher_token=publisher_token)

    def reserve(
        self,
        version_key: VersionKey | Sequence[str],
        digest: str,
        lora_name: str,
        request_id: str,
        *,
        publisher_token: str | None = None,
    ) -> ReserveResult:
        return self._dispatch(
            "reserve",
            version_key=version_key,
            digest=digest,
            lora_name=lora_name,
            request_id=request_id,
            publisher_token=publisher_token,
        )

    def record_prepared(
        self, engine_id: str, receipt: PreparedEvidence, *, publisher_token: str | None = None
    ) -> EngineAck:
        return self._dispatch(
            "record_prepared", engine_id=engine_id, receipt=receipt, publisher_token=publisher_token
        )

    def record_ready(
        self, engine_id: str, receipt: ReadyEvidence, *, publisher_token: str | None = None
    ) -> EngineAck:
        return self._dispatch(
            "record_ready", engine_id=engine_id, receipt=receipt, publisher_token=publisher_token
        )

    def commit(
        self,
        version_key: VersionKey | Sequence[str],
        attempt_token: str,
        expected_default_revision: int,
        *,
        publisher_token: str | None = None,
    ) -> CommitReceipt:
        return self._dispatch(
            "commit",
            version_key=version_key,
            attempt_token=attempt_token,
            expected_default_revision=expected_default_revision,
            publisher_token=publisher_token,
        )

    def abort(self, attempt_token: str, reason: str, *, publisher_token: str | None = None) -> AbortResult:
        return self._dispatch(
            "abort", attempt_token=attempt_token, reason=reason, publisher_token=publisher_token
        )

    def record_cleanup(
        self,
        engine_id: str,
        attempt_token: str,
        receipt: CleanupEvidence,
        *,
        publisher_token: str | None = None,
    ) -> EngineAck:
        return self._dispatch(
            "record_cleanup",
            engine_id=engine_id,
            attempt_token=attempt_token,
            receipt=receipt,
            publisher_token=publisher_token,
        )

    def register_engine_incarnation(
        self, engine_id: str, incarnation: str, *, publisher_token: str | None = None
    ) -> IncarnationResult:
        return self._dispatch(
            "register_engine_incarnation",
            engine_id=engine_id,
            incarnation=incarnation,
            publisher_token=publisher_token,
        )

    def mark_engine_unknown(
        self, engine_id: str, ref: str, op: str, reason: str, *, publisher_token: str | None = None
    ) -> EngineAck:
        return self._dispatch(
            "mark_engine_unknown",
            engine_id=engine_id,
            ref=ref,
            op=op,
            reason=reason,
            publisher_token=publisher_token,
        )

    def declare_engine_lost(
        self, engine_id: str, reason: str, *, publisher_token: str | None = None
    ) -> EngineLostResult:
        return self._dispatch(
            "declare_engine_lost", engine_id=engine_id, reason=reason, publisher_token=publisher_token
        )

    def open_session(
        self, session_key: SessionKey | Sequence[str], lease_id: str | None = None
    ) -> SessionView:
        return self._dispatch("open_session", session_key=session_key, lease_id=lease_id)

    def bind_first(self, session_key: SessionKey | Sequence[str], lease_id: str | None = None) -> Binding:
        return self._dispatch("bind_first", session_key=session_key, lease_id=lease_id)

    def begin_close(self, session_key: SessionKey | Sequence[str]) -> SessionView:
        return self._dispatch("begin_close", session_key=session_key)

    def close_and_release(self, session_key: SessionKey | Sequence[str]) -> SessionView:
        return self._dispatch("close_and_release", session_key=session_key)

    def grant_lease(self, lease_id: str, ttl_s: float, now: float | None = None) -> LeaseView:
        return self._dispatch("grant_lease", lease_id=lease_id, ttl_s=ttl_s, now=now)

    def end_leases(self, lease_ids: Sequence[str]) -> tuple[SessionKey, ...]:
        return self._dispatch("end_leases", lease_ids=lease_ids)

    def keep_alive(self, lease_id: str, now: float | None = None) -> LeaseView:
        return self._dispatch("keep_alive", lease_id=lease_id, now=now)

    def expire_leases(self, now: float | None = None) -> tuple[SessionKey, ...]:
        return self._dispatch("expire_leases", now=now)

    def prune_sessions(self, keep_last: int) -> int:
        return self._dispatch("prune_sessions", keep_last=keep_last)

    def claim_reclaim(
        self, version_key: VersionKey | Sequence[str], *, publisher_token: str | None = None
    ) -> ReclaimClaim:
        return self._dispatch("claim_reclaim", version_key=version_key, publisher_token=publisher_token)

    def confirm_reclaim(
        self,
        version_key: VersionKey | Sequence[str],
        engine_id: str,
        receipt: UnloadEvidence,
        *,
        publisher_token: str | None = None,
    ) -> EngineAck:
        return self._dispatch(
            "confirm_reclaim",
            version_key=version_key,
            engine_id=engine_id,
            receipt=receipt,
            publisher_token=publisher_token,
        )

    # -------------------------------------------------------------------------- queries

    def status(self) -> StatusView:
        return self._dispatch("status")

    def version(self, version_key: VersionKey | Sequence[str]) -> VersionView | None:
        return self._dispatch("version", version_key=version_key)

    def binding_of(self, session_key: SessionKey | Sequence[str]) -> Binding | None:
        return self._dispatch("binding_of", session_key=session_key)

    def session(self, session_key: SessionKey | Sequence[str]) -> SessionView | None:
        return self._dispatch("session", session_key=session_key)

    def sessions(self, include_closed: bool = False, limit: int | None = None) -> tuple[SessionView, ...]:
        return self._dispatch("sessions", include_closed=include_closed, limit=limit)

    def lease(self, lease_id: str) -> LeaseView | None:
        return self._dispatch("lease", lease_id=lease_id)

    def leases_due(self, now: float | None = None) -> tuple[str, ...]:
        return self._dispatch("leases_due", now=now)

    def dump(self) -> str:
        return self._dispatch("dump")


def _async_op(sync_op: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    # The sync body only packs the arguments and returns what _dispatch returns: with an async
    # _dispatch that is an awaitable, so awaiting it here gives the same result and errors.
    @functools.wraps(sync_op)
    async def op(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await sync_op(self, *args, **kwargs)

    op.__qualname__ = f"AsyncRegistryOps.{sync_op.__name__}"
    return op


class AsyncRegistryAPI(Protocol):
    """The async operations' typed signatures, for static checkers and readers: each is the
    coroutine form of the :class:`RegistryOps` method of the same name (a test holds the two
    equal, op by op). The bodies are generated by :class:`AsyncRegistryOps`."""

    async def record_base(self, fingerprint: str, *, publisher_token: str | None = None) -> str: ...

    async def reserve(
        self,
        version_key: VersionKey | Sequence[str],
        digest: str,
        lora_name: str,
        request_id: str,
        *,
        publisher_token: str | None = None,
    ) -> ReserveResult: ...

    async def record_prepared(
        self, engine_id: str, receipt: PreparedEvidence, *, publisher_token: str | None = None
    ) -> EngineAck: ...

    async def record_ready(
        self, engine_id: str, receipt: ReadyEvidence, *, publisher_token: str | None = None
    ) -> EngineAck: ...

    async def commit(
        self,
        version_key: VersionKey | Sequence[str],
        attempt_token: str,
        expected_default_revision: int,
        *,
        publisher_token: str | None = None,
    ) -> CommitReceipt: ...

    async def abort(
        self, attempt_token: str, reason: str, *, publisher_token: str | None = None
    ) -> AbortResult: ...

    async def record_cleanup(
        self,
        engine_id: str,
        attempt_token: str,
        receipt: CleanupEvidence,
        *,
        publisher_token: str | None = None,
    ) -> EngineAck: ...

    async def register_engine_incarnation(
        self, engine_id: str, incarnation: str, *, publisher_token: str | None = None
    ) -> IncarnationResult: ...

    async def mark_engine_unknown(
        self, engine_id: str, ref: str, op: str, reason: str, *, publisher_token: str | None = None
    ) -> EngineAck: ...

    async def declare_engine_lost(
        self, engine_id: str, reason: str, *, publisher_token: str | None = None
    ) -> EngineLostResult: ...

    async def open_session(
        self, session_key: SessionKey | Sequence[str], lease_id: str | None = None
    ) -> SessionView: ...

    async def bind_first(
        self, session_key: SessionKey | Sequence[str], lease_id: str | None = None
    ) -> Binding: ...

    async def begin_close(self, session_key: SessionKey | Sequence[str]) -> SessionView: ...

    async def close_and_release(self, session_key: SessionKey | Sequence[str]) -> SessionView: ...

    async def grant_lease(self, lease_id: str, ttl_s: float, now: float | None = None) -> LeaseView: ...

    async def end_leases(self, lease_ids: Sequence[str]) -> tuple[SessionKey, ...]: ...

    async def keep_alive(self, lease_id: str, now: float | None = None) -> LeaseView: ...

    async def expire_leases(self, now: float | None = None) -> tuple[SessionKey, ...]: ...

    async def prune_sessions(self, keep_last: int) -> int: ...

    async def claim_reclaim(
        self, version_key: VersionKey | Sequence[str], *, publisher_token: str | None = None
    ) -> ReclaimClaim: ...

    async def confirm_reclaim(
        self,
        version_key: VersionKey | Sequence[str],
        engine_id: str,
        receipt: UnloadEvidence,
        *,
        publisher_token: str | None = None,
    ) -> EngineAck: ...

    async def status(self) -> StatusView: ...

    async def version(self, version_key: VersionKey | Sequence[str]) -> VersionView | None: ...

    async def binding_of(self, session_key: SessionKey | Sequence[str]) -> Binding | None: ...

    async def session(self, session_key: SessionKey | Sequence[str]) -> SessionView | None: ...

    async def sessions(
        self, include_closed: bool = False, limit: int | None = None
    ) -> tuple[SessionView, ...]: ...

    async def lease(self, lease_id: str) -> LeaseView | None: ...

    async def leases_due(self, now: float | None = None) -> tuple[str, ...]: ...

    async def dump(self) -> str: ...


class AsyncRegistryOps(AsyncRegistryAPI):
    """The same operations as coroutine functions; ``_dispatch`` must be ``async``."""

    async def _dispatch(self, op: str, /, **kwargs: Any) -> Any:
        raise NotImplementedError


for _name in PUBLIC_OPS:
    setattr(AsyncRegistryOps, _name, _async_op(getattr(RegistryOps, _name)))
del _name
