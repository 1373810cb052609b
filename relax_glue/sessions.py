"""The session layer a rollout service calls (RFC 4): first-bind, exact lora_path, close.

* A session is OPEN at creation and has **no version** yet. Its first generation binds it:
  ``registry.bind_first`` runs in **one shared task per session**; every waiter awaits it through
  ``asyncio.shield``, so cancelling a waiter (an IR cancelled mid-turn) never cancels the binding
  and never causes a second ``bind_first``. A bind that failed (nothing published yet, registry
  unreachable) is retried by the next request: ``bind_first`` is idempotent, so a retry after a
  lost reply returns the first binding.
* Every backend request of the session carries the bound exact ``lora_path``; tool turns,
  explicit retries and abort/resume never read the current default again.
* **No silent retries of anything admitted.** The engine client never re-sends. This layer
  re-sends only a request the engine refused *before admitting it* and said it will serve soon:
  VERSION_NOT_READY (the engine is staging that exact version, e.g. restoring it after a
  restart; it answers Retry-After), and UNKNOWN_VERSION when a recovery hook is configured
  (``on_version_missing``: the engine lost the version and the hook starts its restore). The
  same request, the same exact ``lora_path``, within ``not_ready_wait_s``; then the typed error
  surfaces. A request that never left this process (connection refused), or that the engine's
  scheduler turned away because its waiting queue was full (503), is re-sent the same way. Any
  other version error surfaces as the typed :class:`LoraVersionError` (no fallback to the base
  model or to the latest version).
* **No blind resend (RFC 4.2).** A turn the engine may have admitted but whose outcome is
  unknown (the connection broke after the request was sent, a 5xx, a broken stream) raises
  :class:`TurnOutcomeUnknown` with its rid, and the session refuses further turns until the
  caller decides: :meth:`Session.resend` (abort that rid, send the same body again under a new
  rid, same binding) or :meth:`Session.discard` (abort it and go on). A duplicated trajectory
  turn is never the session layer's doing.
* **Groups of completions** (GRPO and its relatives sample G completions per prompt).
  :meth:`Session.sample` asks for ``n`` completions of one prompt in ONE request (SGLang's parallel
  sampling: the prompt is prefilled once, every completion runs on the bound version, the engine
  counts one in-flight request per completion, and an abort by the turn's rid ends all of
  them). Several sessions may also declare one ``group`` at open: they route by the group's key
  (one engine for the group, so its shared prompt prefix is computed once there) while each keeps
  its own binding and close.
* **What served each reply is checked** (issue 39). Every generation reply of a plugin engine names
  the version its scheduler ran for every output token (``meta_info.lora_versions``, read from the
  batch: :mod:`lora_contract.served_version`). Each reply (each sample, each streamed chunk) is
  checked against the binding: a token served by anything else, or a reply that attests nothing,
  raises SERVED_VERSION_MISMATCH and counts in ``served_mismatches``, never handed on as the
  binding's. The versions each request was served by are kept in its :class:`RequestRecord`.
* **Close** (RFC 4.3), exactly once however many callers ask: FINALIZING (no new dispatch) ->
  ``registry.begin_close`` (late open/bind are refused) -> wait for the binding task, abort the
  requests already sent (by rid, never abort-all) -> ``registry.close_and_release`` (the session ref
  is released once) -> drop the local record. A session with nothing in flight and no bind under way
  has nothing to fence: its close is ``close_and_release`` alone (one registry call). Requests
  already admitted by an engine stay protected by SGLang's native refcount; the session ref is about
  future requests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.served_version import read_served_spans, spans_problem, versions_of
from relax_glue.actor import AsyncRegistryClient, RegistryUnavailable
from relax_glue.engine_client import (
    CallOutcome,
    EngineAPI,
    GenerationReply,
    OutcomeUnknown,
    generation_aborted,
    generation_outcome,
    outcome_label,
)
from relax_glue.gateway import GatewayClient
from relax_glue.registry_types import Binding, SessionKey, SessionView
from relax_glue.router import Router, StickyRoundRobinRouter

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "RequestRecord",
    "Session",
    "SessionManager",
    "SessionPhase",
    "TurnOutcomeUnknown",
]


class SessionPhase(StrEnum):
    OPEN = "OPEN"  # may bind (once) and dispatch
    FINALIZING = "FINALIZING"  # close started: no new dispatch
    CLOSED = "CLOSED"  # ref released, local record dropped
    EXPIRED = "EXPIRED"  # the registry closed it when its lease ran out: refused, never rebinds


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One backend request of a session, as sent (for audits: which lora_path, which engine)."""

    rid: str
    engine_id: str
    lora_path: str
    outcome: str  # a CallOutcome value, or "refused:<CODE>"
    started_at: float
    duration_s: float
    # What the engine attested it ran for the request's tokens, in order (None: base model or
    # unattested); empty when no reply said (a refusal, an unknown outcome)
    served: tuple[str | None, ...] = ()


class TurnOutcomeUnknown(OutcomeUnknown):
    """A turn that the engine may have admitted ended without a known outcome (RFC 4.2). The
    session does not resend it; the caller calls ``resend(rid)`` or ``discard(rid)``."""

    def __init__(self, cause: OutcomeUnknown, rid: str, lora_path: str) -> None:
        super().__init__(
            cause.engine_id,
            cause.op,
            f"turn {rid} on {lora_path}: {cause.cause}",
            status_code=cause.status_code,
            maybe_sent=cause.maybe_sent,
            admitted=cause.admitted,
        )
        self.rid = rid
        self.lora_path = lora_path
        self.inner = cause

    def __reduce__(self) -> tuple[Any, ...]:
        # Through the inner OutcomeUnknown (which pickles every field), so that a copy that
        # crossed a Ray or process boundary is the same exception, not a re-prefixed one.
        return (TurnOutcomeUnknown, (self.inner, self.rid, self.lora_path))


@dataclasses.dataclass(frozen=True)
class _UnknownTurn:
    rid: str
    engine_id: str
    body: dict[str, Any]  # as sent (rid and lora_path included); a resend never streams


@dataclasses.dataclass
class _InFlight:
    rid: str
    engine_id: str
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


def _closed(session: Session) -> LoraVersionError:
    code = ErrorCode.SESSION_EXPIRED if session.phase is SessionPhase.EXPIRED else ErrorCode.SESSION_CLOSED
    return LoraVersionError(
        code, f"session {session.key} is {session.phase.value}", state=session.phase.value
    )


def _invalid(message: str, **details: Any) -> LoraVersionError:
    return LoraVersionError(ErrorCode.INVALID_REQUEST, message, **details)


def samples_asked(body: Mapping[str, Any]) -> int:
    """The completions a request body asks for (``sampling_params.n``, 1 when absent); refused
    unless a positive int."""
    params = body.get("sampling_params") or {}
    n = params.get("n", 1) if isinstance(params, Mapping) else 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise _invalid(f"sampling_params.n must be a positive int, not {n!r}")
    return int(n)


def _retrieve(task: asyncio.Task[Any]) -> None:
    # Mark a failed shared task's exception as retrieved: every waiter may have been cancelled,
    # and the error was (or will be) delivered through shield to whoever still waits.
    if not task.cancelled():
        task.exception()


class Session:
    """One agent session. Create through :meth:`SessionManager.open`."""

    def __init__(self, manager: SessionManager, key: SessionKey, name: str, group: str | None = None) -> None:
        self._m = manager
        self.key = key
        self.name = name
        self.group = group
        # What its requests are routed by: its own key, or its group's (one engine for the group).
        self.route_key: Hashable = key if group is None else f"{key.epoch}/group:{group}"
        self.phase = SessionPhase.OPEN
        self.lease_id: str | None = None  # the worker lease it hangs on (None: leases off)
        self.bind_calls = 0  # bind_first calls this session made (one, unless a bind failed)
        self.resends = 0  # requests sent again after a not-yet-admitted refusal
        self.served_mismatches = 0  # replies whose attested version was not the binding
        self.requests: list[RequestRecord] = []
        self.close_view: SessionView | None = None
        self._binding: Binding | None = None
        self._bind_task: asyncio.Task[Binding] | None = None
        self._close_task: asyncio.Task[SessionView] | None = None
        self._in_flight: dict[str, _InFlight] = {}
        self._unknown_turns: dict[str, _UnknownTurn] = {}  # rid -> a turn awaiting the caller's decision

    def __repr__(self) -> str:
        return f"Session({self.key}, {self.phase.value}, lora={self.lora_path})"

    @property
    def binding(self) -> Binding | None:
        return self._binding

    @property
    def lora_path(self) -> str | None:
        return self._binding.lora_name if self._binding else None

    @property
    def in_flight(self) -> tuple[str, ...]:
        return tuple(self._in_flight)

    @property
    def unknown_turns(self) -> tuple[str, ...]:
        """Rids of turns whose outcome is unknown and that the caller has not settled yet."""
        return tuple(self._unknown_turns)

    def _check_open(self) -> None:
        if self.phase is not SessionPhase.OPEN:
            raise _closed(self)

    # ------------------------------------------------------------------------ binding

    async def bind(self) -> Binding:
        """The session's binding, made on first use through the one shared binding task."""
        self._check_open()
        if self._binding is not None:
            return self._binding
        task = self._bind_task
        if task is None:
            task = asyncio.get_running_loop().create_task(self._bind_once(), name=f"bind_first:{self.key}")
            task.add_done_callback(self._bind_done)
            self._bind_task = task
        # shield: cancelling this waiter cancels only its wait, never the shared binding.
        return await asyncio.shield(task)

    async def _bind_once(self) -> Binding:
        self.bind_calls += 1
        try:
            binding: Binding = await self._m.registry.bind_first(session_key=self.key)
        except LoraVersionError as err:
            if err.code is ErrorCode.SESSION_EXPIRED and self.lease_id is not None:
                # Only its lease's end expires a session: the registry closed every one on it.
                self._m._lease_ended(self.lease_id)
            raise
        return binding

    def _bind_done(self, task: asyncio.Task[Binding]) -> None:
        _retrieve(task)
        if not task.cancelled() and task.exception() is None:
            self._binding = task.result()
        elif self._bind_task is task:
            # Nothing was bound (or we did not hear about it): the next request asks again;
            # bind_first is idempotent, so a bind whose reply was lost is returned, not redone.
            self._bind_task = None

    # -------------------------------------------------------------------------- requests

    def _prepare(self, body: Mapping[str, Any], rid: str | None) -> dict[str, Any]:
        """Checks that need no binding; nothing is bound or sent for a request refused here."""
        if self._unknown_turns:
            raise _invalid(
                "a turn of this session has an unknown outcome (RFC 4.2): resend(rid) or discard(rid) first",
                unknown_rids=list(self._unknown_turns),
            )
        if "lora_id" in body:
            raise LoraVersionError(
                ErrorCode.FORBIDDEN_FIELD, "lora_id is engine-internal; the session sends lora_path"
            )
        for field in ("text", "input_ids"):
            value = body.get(field)
            if isinstance(value, list) and (field == "text" or (value and isinstance(value[0], list))):
                raise _invalid(f"batched {field}: one request per session turn (n=1)")
        samples_asked(body)  # n, when given, is a positive int
        rid = rid or body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str) or rid in self._in_flight:
            raise _invalid(f"rid {rid!r} is not a fresh request id")
        return {**body, "rid": rid}

    def _stamp(self, req: dict[str, Any], binding: Binding) -> dict[str, Any]:
        given = req.get("lora_path")
        if given is not None and given != binding.lora_name:
            raise _invalid(
                "lora_path is not the session's bound version", bound=binding.lora_name, got=str(given)
            )
        req["lora_path"] = binding.lora_name  # the exact bound name, on every request
        return req

    async def _dispatch_ready(self, body: Mapping[str, Any], rid: str | None) -> tuple[dict[str, Any], str]:
        req = self._prepare(body, rid)
        binding = await self.bind()
        req = self._stamp(req, binding)
        await self._m._check_lease()  # no registry call while the worker's lease is fresh
        # Close (or expiry) may have come while we waited: no new dispatch after that.
        self._check_open()
        return req, self._m.router.pick(self.route_key)

    def _finish(
        self,
        flight: _InFlight,
        lora_path: str,
        outcome: str,
        started: float,
        t0: float,
        served: list[str | None],
    ) -> None:
        flight.done.set()
        self._in_flight.pop(flight.rid, None)
        engine_id = self._m._served_by(flight.rid, flight.engine_id)
        duration, distinct = time.monotonic() - t0, tuple(dict.fromkeys(served))
        record = RequestRecord(flight.rid, engine_id, lora_path, outcome, started, duration, distinct)
        self.requests.append(record)

    def _check_served(
        self, reply: Any, rid: str, engine_id: str, served: list[str | None], *, chunk: bool
    ) -> None:
        """Every token of ``reply`` (a reply, a list of one per sample, or a streamed chunk)
        attested as served by the binding; else SERVED_VERSION_MISMATCH, counted. ``served``
        collects the attested versions in order (repeats included: a cumulative stream names them
        again in every chunk)."""
        binding = self._binding
        assert binding is not None  # every dispatch binds first
        for one in reply if isinstance(reply, list) else (reply,):
            meta = one.get("meta_info") if isinstance(one, Mapping) else None
            ids = one.get("output_ids") if isinstance(one, Mapping) and not chunk else None
            tokens = len(ids) if isinstance(ids, list) else None  # a chunk may cover a delta only
            spans = read_served_spans(meta)
            served.extend(versions_of(spans or ()))
            problem = spans_problem(spans, binding.lora_name, binding.digest, tokens)
            if problem is None:
                continue
            self.served_mismatches += 1
            self._m.served_mismatches += 1
            logger.warning("session %s, request %s on %s: %s", self.key, rid, engine_id, problem)
            raise LoraVersionError(
                ErrorCode.SERVED_VERSION_MISMATCH,
                f"request {rid} of session {self.key}: {problem}",
                rid=rid,
                engine_id=engine_id,
                bound=binding.lora_name,
                served=[s.to_wire() for s in spans or ()],
            )

    async def generate(self, body: Mapping[str, Any], *, rid: str | None = None) -> dict[str, Any]:
        """One backend generation with the bound ``lora_path``, sent exactly once (one
        completion; ``n`` completions of one prompt: :meth:`sample`)."""
        if samples_asked(body) != 1:
            raise _invalid("n > 1 answers n completions: use sample(body, n)")
        reply = await self._generate(body, rid)
        if not isinstance(reply, dict):  # SGLang answers one object for n = 1
            raise TypeError(f"the engine answered {type(reply).__name__} for one completion")
        return reply

    async def sample(
        self, body: Mapping[str, Any], n: int, *, rid: str | None = None
    ) -> list[dict[str, Any]]:
        """``n`` completions of one prompt in one request, sent exactly once (SGLang's parallel
        sampling, ``sampling_params.n``): the prompt is prefilled once, every completion runs on
        the bound ``lora_path``, and an abort of ``rid`` (or the session's close) ends them all.
        One completion per sample, in order; each ``meta_info.id`` starts with ``rid``. ``n`` is
        checked with every other field, before anything is bound or sent."""
        params = body.get("sampling_params") or {}
        if not isinstance(params, Mapping):
            raise _invalid("sampling_params must be an object")
        reply = await self._generate({**body, "sampling_params": {**params, "n": n}}, rid)
        replies = reply if isinstance(reply, list) else [reply]
        if len(replies) != n:
            raise _invalid(f"the engine answered {len(replies)} completions for n={n}")
        return replies

    async def _generate(self, body: Mapping[str, Any], rid: str | None) -> GenerationReply:
        if body.get("stream"):
            raise _invalid("use generate_stream for streaming")
        self._check_open()
        req, engine_id = await self._dispatch_ready(body, rid)
        flight = self._in_flight[req["rid"]] = _InFlight(req["rid"], engine_id)
        started, t0, outcome = time.time(), time.monotonic(), CallOutcome.CANCELLED
        deadline = t0 + self._m.not_ready_wait_s
        served: list[str | None] = []
        try:
            while True:
                try:
                    result = await self._m._target(self.route_key, engine_id).generate(req)
                    break
                except (LoraVersionError, OutcomeUnknown) as err:
                    if not await self._wait_to_resend(err, engine_id, req["lora_path"], deadline):
                        raise self._settled_by_caller(err, engine_id, req) from None
            self._check_served(result, req["rid"], engine_id, served, chunk=False)
            outcome = generation_outcome(result)
            return result
        except (LoraVersionError, OutcomeUnknown) as exc:
            outcome = outcome_label(exc)
            raise
        finally:
            self._finish(flight, req["lora_path"], outcome, started, t0, served)

    async def generate_stream(
        self, body: Mapping[str, Any], *, rid: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Streaming variant of :meth:`generate` (same binding, same rules)."""
        self._check_open()
        req, engine_id = await self._dispatch_ready(body, rid)
        flight = self._in_flight[req["rid"]] = _InFlight(req["rid"], engine_id)
        started, t0, outcome = time.time(), time.monotonic(), CallOutcome.CANCELLED
        aborted_samples: dict[int, bool] = {}
        deadline = t0 + self._m.not_ready_wait_s
        served: list[str | None] = []
        try:
            while True:
                streamed = False
                try:
                    async for chunk in self._m._target(self.route_key, engine_id).generate_stream(req):
                        streamed = True
                        self._check_served(chunk, req["rid"], engine_id, served, chunk=True)
                        # with n > 1 the samples' chunks interleave, each with its "index"
                        aborted_samples[chunk.get("index", 0)] = generation_aborted(chunk)
                        yield chunk
                    break
                except (LoraVersionError, OutcomeUnknown) as err:
                    # Only a refusal before the first chunk: nothing was admitted.
                    if streamed or not await self._wait_to_resend(err, engine_id, req["lora_path"], deadline):
                        raise self._settled_by_caller(err, engine_id, req) from None
            aborted = any(aborted_samples.values())
            n = samples_asked(req)
            if not aborted and sorted(aborted_samples) != list(range(n)):
                # sample()'s rule: a short (or padded) group is never a silent result (an aborted
                # group is ABORTED already, whichever of its samples got a chunk before the abort)
                raise _invalid(f"the engine streamed samples {sorted(aborted_samples)} for n={n}")
            outcome = CallOutcome.ABORTED if aborted else CallOutcome.OK
        except (LoraVersionError, OutcomeUnknown) as exc:
            outcome = outcome_label(exc)
            raise
        finally:
            self._finish(flight, req["lora_path"], outcome, started, t0, served)

    def _settled_by_caller(
        self, err: LoraVersionError | OutcomeUnknown, engine_id: str, req: dict[str, Any]
    ) -> LoraVersionError | OutcomeUnknown:
        """What a failed turn raises: a refusal as is; a maybe-admitted turn as
        :class:`TurnOutcomeUnknown`, remembered until the caller resends or discards it."""
        if isinstance(err, LoraVersionError):
            return err
        rid = req["rid"]
        self._unknown_turns[rid] = _UnknownTurn(rid, engine_id, dict(req))
        return TurnOutcomeUnknown(err, rid, req["lora_path"])

    async def _wait_to_resend(
        self, err: LoraVersionError | OutcomeUnknown, engine_id: str, lora_path: str, deadline: float
    ) -> bool:
        """True after waiting, when the refused request may be sent again (see the module
        docstring); False when ``err`` is final or the bound has passed. Never changes the
        request: the same rid and the same exact ``lora_path`` go out again."""
        m = self._m
        if isinstance(err, OutcomeUnknown):
            if err.maybe_sent and err.admitted is not False:
                return False  # it may have been admitted: never resent blindly (RFC 4.2)
            # It never left this process, or the engine's queue was full: nothing was admitted.
            wait = m.resend_interval_s
        elif err.code is ErrorCode.VERSION_NOT_READY:
            wait = float(err.details.get("retry_after_s") or err.retry_after_s or m.resend_interval_s)
        elif err.code is ErrorCode.UNKNOWN_VERSION and m.on_version_missing is not None:
            await m.on_version_missing(str(err.details.get("engine_id") or engine_id), lora_path)
            wait = m.resend_interval_s
        else:
            return False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        await asyncio.sleep(min(wait, remaining))
        self._check_open()  # a close that started meanwhile: no new dispatch
        self.resends += 1
        return True

    async def resend(self, rid: str) -> dict[str, Any]:
        """The caller's explicit decision to send again a turn whose outcome was unknown: the
        old rid is aborted first (an abort of a request that is not running is a no-op), then
        the same body goes out under a new rid with the same binding (non-streaming)."""
        turn = await self._settle(rid)
        body = {k: v for k, v in turn.body.items() if k not in ("rid", "stream")}
        n = sum(1 for r in self.requests if r.rid.startswith(f"{rid}.resend"))
        return await self.generate(body, rid=f"{rid}.resend{n + 1}")

    async def discard(self, rid: str) -> None:
        """The caller's decision to give up a turn whose outcome was unknown (aborted by rid)."""
        await self._settle(rid)

    async def _settle(self, rid: str) -> _UnknownTurn:
        self._check_open()
        turn = self._unknown_turns.get(rid)
        if turn is None:
            raise _invalid(
                f"{rid!r} is not a turn with an unknown outcome", unknown_rids=list(self._unknown_turns)
            )
        try:
            await self._m._target(self.route_key, turn.engine_id).abort_request(rid)
        except OutcomeUnknown as exc:
            # Refused connection: no engine process listens there, so nothing of ours runs. Any
            # other failure leaves the turn unsettled (it may still run): the caller asks again.
            if exc.maybe_sent:
                raise
        del self._unknown_turns[rid]
        return turn

    async def abort(self, rid: str) -> bool:
        """Abort one in-flight request of this session (temporary abort: the binding stays).
        False when the request is not in flight here (already finished)."""
        flight = self._in_flight.get(rid)
        if flight is None:
            return False
        await self._m._target(self.route_key, flight.engine_id).abort_request(rid)
        return True

    # ---------------------------------------------------------------------------- close

    async def close(self) -> SessionView:
        """Close the session (RFC 4.3); concurrent and repeated calls share one close."""
        task = self._close_task
        if task is None:
            if self.phase is SessionPhase.CLOSED and self.close_view is not None:
                return self.close_view
            task = asyncio.get_running_loop().create_task(self._close_once(), name=f"close:{self.key}")
            task.add_done_callback(self._close_done)
            self._close_task = task
        return await asyncio.shield(task)

    def _close_done(self, task: asyncio.Task[SessionView]) -> None:
        _retrieve(task)
        if (task.cancelled() or task.exception() is not None) and self._close_task is task:
            # A registry call failed part way; the session stays FINALIZING (still no dispatch)
            # and a later close() goes on from there (both registry calls are idempotent).
            self._close_task = None

    async def _close_once(self) -> SessionView:
        self.phase = SessionPhase.FINALIZING  # from here no request of ours is dispatched
        task = self._bind_task
        if self._in_flight or (task is not None and not task.done()):
            # Something may still land: fence the registry first (a late bind is refused), let
            # the binding finish or fail, abort what was sent. An idle session (the usual close,
            # after its last turn) has nothing to fence, so its close is one registry call.
            await self._m.registry.begin_close(session_key=self.key)
            if task is not None:
                await asyncio.wait([task])
            await self._abort_in_flight()
        view: SessionView = await self._m.registry.close_and_release(session_key=self.key)
        self.close_view = view
        self.phase = SessionPhase.CLOSED
        self._m._drop(self)
        return view

    async def _abort_in_flight(self) -> None:
        """Abort every request this session already sent; repeat until they return or the
        drain bound passes. Repeating covers an abort that overtook its own request (SGLang
        ignores an abort for a rid it has not seen yet)."""
        deadline = time.monotonic() + self._m.drain_timeout_s
        while self._in_flight:
            flights = list(self._in_flight.values())
            results = await asyncio.gather(
                *(self._m._target(self.route_key, f.engine_id).abort_request(f.rid) for f in flights),
                return_exceptions=True,
            )
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, LoraVersionError | OutcomeUnknown):
                    raise r
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return  # the engines' native refcount still protects what is running
            waiters = [asyncio.ensure_future(f.done.wait()) for f in flights]
            try:
                await asyncio.wait(
                    waiters,
                    timeout=min(self._m.abort_interval_s, remaining),
                    return_when=asyncio.ALL_COMPLETED,
                )
            finally:
                for w in waiters:
                    w.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await w


# Leases are on by default: a worker that dies must not pin a retired version forever. 30 s is
# etcd's order of magnitude for a worker lease: long enough that a GC pause or a slow registry
# never expires a live worker (it renews every 10 s), short enough that a dead worker's versions
# become reclaimable within a minute.
DEFAULT_LEASE_TTL_S = 30.0


class SessionManager:
    """Sessions of one rollout service over a fixed set of engines and one registry.

    ``registry``: an :class:`~relax_glue.actor.AsyncRegistryClient` (in process or through the Ray
    actor), or a registry object, which is wrapped in an in-process client that does not retry
    (``registry_retries=0``): every retry is then a visible decision of the caller.
    """

    def __init__(
        self,
        registry: Any,
        engines: Mapping[str, EngineAPI],
        *,
        router: Router | None = None,
        gateway: GatewayClient | None = None,
        drain_timeout_s: float = 30.0,
        abort_interval_s: float = 0.5,
        registry_retries: int = 0,
        not_ready_wait_s: float = 30.0,
        resend_interval_s: float = 0.5,
        on_version_missing: Callable[[str, str], Awaitable[Any]] | None = None,
        lease_ttl_s: float | None = DEFAULT_LEASE_TTL_S,
        heartbeat_s: float | None = None,
    ) -> None:
        # A registry object is wrapped in an in-process client, which this manager then owns (and
        # stops with it: its lease reaper runs from the first lease granted); a client passed in
        # keeps its own retries and stays its caller's to close.
        self._owns_registry = not isinstance(registry, AsyncRegistryClient)
        self.registry = AsyncRegistryClient.of(registry, retries=registry_retries)
        self.engines: dict[str, EngineAPI] = dict(engines)
        if gateway is not None and router is not None:
            raise ValueError("either a gateway routes the sessions or a router does, not both")
        # Through a gateway, the gateway picks the engine (by the session key); without one, the
        # in-process sticky router does (tests with in-memory engines, setups with no gateway).
        self.gateway = gateway
        self.router: Router = gateway or router or StickyRoundRobinRouter(sorted(self.engines))
        self.drain_timeout_s = drain_timeout_s
        self.abort_interval_s = abort_interval_s
        # Bound on re-sending a request refused before admission (VERSION_NOT_READY, or
        # UNKNOWN_VERSION with on_version_missing(engine_id, lora_path), e.g. a reconcile trigger).
        self.not_ready_wait_s = not_ready_wait_s
        self.resend_interval_s = resend_interval_s
        self.on_version_missing = on_version_missing
        # Leases (beyond the RFC): the manager is one rollout worker and holds ONE lease, of
        # lease_ttl_s on the registry's clock; every session it opens hangs on it. A heartbeat
        # (every heartbeat_s, default a third of the TTL) keeps it alive with one call whatever
        # the number of sessions, and no turn calls the registry while the lease is fresh by the
        # worker's own clock (a lease older than its TTL is checked before the next dispatch).
        # When the worker dies its lease runs out and the registry closes all its sessions.
        # None: no leases (a crashed worker's sessions then hold their refs forever).
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else (lease_ttl_s or 0) / 3
        self.lease_id: str | None = None
        self._lease_sent_at = -math.inf  # monotonic send time of the last accepted keep-alive
        self._heartbeat: asyncio.Task[None] | None = None
        self.renewals = 0
        self.fenced_turns = 0  # turns refused because the lease could not be renewed in time
        # Replies of this worker's sessions whose attested version was not their binding (issue 39)
        self.served_mismatches = 0
        self._epoch: str | None = None
        self._sessions: dict[SessionKey, Session] = {}
        self._routed: collections.Counter[Hashable] = collections.Counter()  # open sessions per route key

    def _target(self, route_key: Hashable, engine_id: str) -> EngineAPI:
        """Where a session's request (or an abort of one) goes: its route through the gateway
        (by its route key: its own, or its group's), or the engine the router picked."""
        if self.gateway is not None:
            return self.gateway.route(route_key)  # type: ignore[return-value]
        return self.engines[engine_id]

    def _served_by(self, rid: str, engine_id: str) -> str:
        """The engine that served ``rid`` (through a gateway: as the gateway reported it)."""
        if self.gateway is not None:
            return self.gateway.served_by(rid) or engine_id
        return engine_id

    @property
    def sessions(self) -> Mapping[SessionKey, Session]:
        return MappingProxyType(self._sessions)

    async def open(self, name: str = "session", *, group: str | None = None) -> Session:
        """A new OPEN session without a version, on this worker's lease (when leases are on).
        The key carries a fresh nonce, so a reused name is a new lifecycle and never meets the
        tombstone of an earlier one. ``group``: sessions of one group (a GRPO group: G
        completions of one prompt) are routed together, to one engine, so the shared prompt
        prefix is computed once there; each keeps its own binding, refs and close."""
        if group is not None and (not isinstance(group, str) or not group):
            raise _invalid(f"group must be a non-empty string, not {group!r}")
        if self._epoch is None:
            self._epoch = (await self.registry.connect()).epoch
        key = SessionKey(self._epoch, f"{name}.{uuid.uuid4().hex}")
        lease_id = await self._lease()
        try:
            await self.registry.open_session(session_key=key, lease_id=lease_id)
        except LoraVersionError as err:
            if err.code is not ErrorCode.SESSION_EXPIRED or lease_id is None:
                raise
            # The lease ran out before this worker heard of it (its heartbeat stalled past the
            # TTL). The key is new, so the refusal can only be the lease's and changed nothing:
            # the old sessions are expired, and this one opens on a new lease.
            self._lease_ended(lease_id)
            lease_id = await self._lease()
            await self.registry.open_session(session_key=key, lease_id=lease_id)
        session = Session(self, key, name, group)
        session.lease_id = lease_id
        self._sessions[key] = session
        self._routed[session.route_key] += 1
        return session

    async def _lease(self) -> str | None:
        """This worker's live lease, granted at the first open (and again after one ran out),
        with its heartbeat started."""
        if self.lease_ttl_s is None:
            return None
        if self.lease_id is None:
            lease_id = f"worker.{uuid.uuid4().hex}"
            sent = time.monotonic()
            await self.registry.grant_lease(lease_id=lease_id, ttl_s=self.lease_ttl_s)
            self.lease_id, self._lease_sent_at = lease_id, sent
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeat_forever(), name="lease")
        return self.lease_id

    def _lease_fresh(self) -> bool:
        # Measured from the keep-alive's SEND time: the registry's deadline is at least one TTL
        # after it received that keep-alive, so a fresh lease here is live there.
        return self.lease_ttl_s is not None and time.monotonic() - self._lease_sent_at < self.lease_ttl_s

    async def _check_lease(self) -> None:
        """Before a dispatch: nothing while the lease is fresh; otherwise one keep-alive, which
        marks this worker's sessions EXPIRED if the registry ended the lease meanwhile.

        If that keep-alive does not renew the lease (the registry unreachable, or no answer
        within a heartbeat), the worker **fences itself**: the registry may already have ended
        the lease and released its sessions' refs, so a turn dispatched now could run on a
        version being reclaimed, with the engine as the only guard. The turn is refused with
        WORKER_FENCED (nothing sent, the session unchanged) until a keep-alive gets through: then
        the session is either still valid (the lease renewed) or EXPIRED, never half."""
        lease_id = self.lease_id
        if lease_id is None or self._lease_fresh():
            return
        # bounded: a registry that does not answer must not hold the turn (a lost keep-alive
        # changes nothing: renewals are soft state, and the next one asks again)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.heartbeat_s or self.lease_ttl_s):
                await self._keep_alive()
        if self.lease_id == lease_id and not self._lease_fresh():
            self.fenced_turns += 1
            since = time.monotonic() - self._lease_sent_at
            ttl = self.lease_ttl_s
            logger.warning("worker fenced: lease %s not renewed for %.1fs (TTL %ss)", lease_id, since, ttl)
            raise LoraVersionError(
                ErrorCode.WORKER_FENCED,
                f"lease {lease_id} was not renewed within its TTL of {ttl}s (the registry did not "
                "answer): this worker dispatches no turn until it is",
                lease_id=lease_id,
            )

    async def _keep_alive(self) -> None:
        """Renew this worker's lease (one call for all its sessions). SESSION_EXPIRED: the
        registry closed every session on it, so they are marked EXPIRED here (refused from now
        on, never rebound) and the next open takes a new lease. An unreachable registry is asked
        again at the next heartbeat; nothing is decided on a guess."""
        lease_id = self.lease_id
        if lease_id is None:
            return
        sent = time.monotonic()
        try:
            await self.registry.keep_alive(lease_id=lease_id)
        except LoraVersionError as err:
            if err.code is not ErrorCode.SESSION_EXPIRED:
                raise
            self._lease_ended(lease_id)
            return
        except RegistryUnavailable:
            return
        self._lease_sent_at = max(self._lease_sent_at, sent)
        self.renewals += 1

    def _lease_ended(self, lease_id: str) -> None:
        """The registry ended ``lease_id`` and closed every session on it: they are marked
        EXPIRED here (refused from now on, never rebound) and the next open takes a new lease.
        A late answer about an earlier lease leaves the worker's current lease alone."""
        for s in self._sessions.values():
            if s.lease_id == lease_id and s.phase is SessionPhase.OPEN:
                s.phase = SessionPhase.EXPIRED
        if self.lease_id == lease_id:
            self.lease_id = None

    async def _heartbeat_forever(self) -> None:
        while self.lease_id is not None:
            await asyncio.sleep(self.heartbeat_s)
            with contextlib.suppress(LoraVersionError):
                await self._keep_alive()

    async def aclose(self) -> None:
        """Stop the heartbeat, and the registry client this manager made from a registry object
        (sessions stay as they are; close them first if you mean to). That client's lease reaper
        outlived the manager in CI: it met the registry's closed store and died with an error
        nobody read."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if self._owns_registry:
            await self.registry.aclose()

    def get(self, key: SessionKey) -> Session | None:
        return self._sessions.get(key)

    async def close_all(self) -> list[SessionView | BaseException]:
        results = await asyncio.gather(
            *(s.close() for s in list(self._sessions.values())), return_exceptions=True
        )
        return list(results)

    def _drop(self, session: Session) -> None:
        if self._sessions.pop(session.key, None) is None:
            return
        self._routed[session.route_key] -= 1
        if self._routed[session.route_key] <= 0:  # the group's last session: its route goes
            del self._routed[session.route_key]
            self.router.forget(session.route_key)
