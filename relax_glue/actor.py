"""The registry as a named, single-writer Ray actor, and clients that hide where it runs.

Ray is an optional extra (``pip install 'sglang-lora-versions[ray]'``): it is imported lazily, so
``relax_glue`` works without it and the in-process clients never touch it.

Single writer, three ways:

* the actor is **named** and created with ``get_if_exists=True``: every process asking for the
  registry of an epoch gets the same actor, never a second one;
* the pure registry decides **one call at a time**: an in-memory actor runs one call at a time
  (``max_concurrency=1``); a durable actor runs calls on a few threads, and the store decides
  them in order under its lock and commits them in groups (one transaction for every call that
  arrived while the previous group was being written; no reply before its group is durable);
* a durable actor holds the store's **flock** on the database, so even a stray second actor or
  process pointed at the same file is refused (``StoreLockedError``).

Batching: a client through Ray keeps at most one actor call in flight and sends every registry
call made meanwhile in the next one (``call_many``): at low load a call goes at once, alone; at
high load a rollout worker's sessions share one Ray round trip. Each op in a batch keeps its own
answer or typed refusal.

A durable actor is restarted by Ray if its process dies (``max_restarts=-1``): the new process
reopens the database (the OS released the lock with the dead process) and replays the journal,
so every acknowledged transition is still there. Calls are never retried by Ray
(``max_task_retries=0``): a caller whose call died with the process does not know the outcome and
retries it itself; every registry op is idempotent by request id or natural key, so the retry gets
the original answer. An in-memory actor is never restarted: a silently empty registry would hand
out a second "first" binding.

Clients: :class:`RegistryClient` (sync) and :class:`AsyncRegistryClient` (async) have the
registry's method names, arguments and results, and raise the same :class:`LoraVersionError`
(the actor returns refusals as data, so the typed error is rebuilt exactly on the caller side).
Build them with ``.in_process(registry_or_store)`` or ``.for_actor(handle)``.

Publisher authority: publication ops (``PUBLISHER_OPS``) need the publisher token the registry was
opened with, and a client fills it in for them when it carries one. ``in_process`` carries the
token of the registry object it is given (whoever holds the object opened it); ``for_actor``
carries only the ``publisher_token`` passed to it, so a rollout worker's client (the actor by
name) can open, bind and close sessions but never reserve, commit, abort or reclaim
(NOT_PUBLISHER). The trainer draws the token (:func:`new_publisher_token`), starts the actor with
it and builds its own client with it; no actor method returns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.names import MANAGED_CAPACITY
from relax_glue.registry import (
    PUBLIC_OPS,
    PUBLISHER_OPS,
    LoRAVersionRegistry,
    checked_publisher_token,
    new_publisher_token,
    stamp_now,
)
from relax_glue.registry_ops import AsyncRegistryOps, RegistryOps
from relax_glue.store import DurableRegistry, StoreError, StoreMissingError

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)

# How often the registry's host ends the leases that ran out, by default: the actor's reaper
# thread and an in-process client's reaper task. A second is small against any lease TTL worth
# having (the session layer's default is 30 s) and an idle expiry writes nothing.
DEFAULT_LEASE_REAPER_S = 1.0

__all__ = [
    "DEFAULT_LEASE_REAPER_S",
    "DEFAULT_NAMESPACE",
    "AsyncRegistryClient",
    "RegistryActor",
    "RegistryClient",
    "RegistryUnavailable",
    "actor_name",
    "get_registry_actor",
    "new_publisher_token",
    "publisher_fingerprint",
    "start_registry_actor",
]

DEFAULT_NAMESPACE = "relax_lora_versions"
# Actor threads of a durable registry: enough for every rollout worker's one batch in flight to
# join the group being formed; more would only add threads waiting on the same commit.
DURABLE_CONCURRENCY = 16
# Most calls one Ray round trip carries (a bound on the reply's size, not on throughput).
MAX_BATCH = 256
_ALLOWED = frozenset(PUBLIC_OPS)
_PUBLISHER_OPS = frozenset(PUBLISHER_OPS)
Envelope = tuple[Any, ...]


def _ray() -> Any:
    try:
        import ray  # the optional [ray] extra: imported only where a Ray registry is used
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise RuntimeError("the registry actor needs Ray: pip install 'sglang-lora-versions[ray]'") from exc
    return ray


def actor_name(epoch: str | int) -> str:
    """The well-known actor name of an epoch's registry."""
    return f"lora_version_registry@{epoch}"


# ------------------------------------------------------------------------------- the actor


def publisher_fingerprint(token: str) -> str:
    """What an actor says of its publisher token: enough to tell two tokens apart, nothing that
    gives one away (a 256-bit token is not guessed back from its hash)."""
    return hashlib.sha256(b"lora-versions publisher\x1f" + token.encode()).hexdigest()[:16]


def _as_publisher(op: str, kwargs: dict[str, Any], token: str | None) -> dict[str, Any]:
    """``kwargs`` with the client's publisher token for a publication op (a token the caller
    passed itself is kept); everything else goes as it is."""
    if token is None or op not in _PUBLISHER_OPS or kwargs.get("publisher_token") is not None:
        return kwargs
    return {**kwargs, "publisher_token": token}


def _refused(exc: LoraVersionError) -> Envelope:
    return ("err", *exc.parts())


def _call_envelope(registry: Any, op: str, kwargs: dict[str, Any]) -> Envelope:
    """Run one registry call; a refusal travels back as data, not as a Ray task error."""
    if op not in _ALLOWED:
        return _refused(LoraVersionError(ErrorCode.INVALID_REQUEST, f"{op!r} is not a registry operation"))
    kwargs = stamp_now(op, kwargs)  # the host's clock, once, before the (journaled) call
    try:
        return ("ok", getattr(registry, op)(**kwargs))
    except LoraVersionError as exc:
        return _refused(exc)


async def _acall_envelope(registry: Any, op: str, kwargs: dict[str, Any]) -> Envelope:
    """:func:`_call_envelope` for a registry object whose ops may be coroutine functions."""
    envelope = _call_envelope(registry, op, kwargs)
    if envelope[0] == "ok" and inspect.isawaitable(envelope[1]):
        try:
            return ("ok", await envelope[1])
        except LoraVersionError as exc:
            return _refused(exc)
    return envelope


def _outcome_envelope(outcome: Any) -> Envelope:
    return _refused(outcome) if isinstance(outcome, LoraVersionError) else ("ok", outcome)


def _unwrap(envelope: Envelope) -> Any:
    if envelope[0] == "ok":
        return envelope[1]
    _, code, message, details = envelope
    raise LoraVersionError.from_parts(code, message, details)


class _ReaperErrors:
    """What a lease reaper says of its failed ticks: the error once, while it repeats. The
    reaper goes on whatever failed: one that died of an error would leave every lease it reaps
    unexpired for good (a dead worker's sessions holding their versions), and nobody would read
    why."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._said = ""

    def failed(self, exc: Exception) -> None:
        if repr(exc) != self._said:
            logger.warning(
                "lease reaper: expire_leases failed, trying again every %gs: %r", self.interval_s, exc
            )
        self._said = repr(exc)

    def cleared(self) -> None:
        self._said = ""


class RegistryActor:
    """Actor body (wrapped by ``ray.remote`` lazily). Holds a durable or in-memory registry."""

    def __init__(
        self,
        epoch: str | int,
        engines: Sequence[str],
        capacity: int,
        db_path: str | None,
        synchronous: str,
        lease_reaper_s: float | None = None,
        publisher_token: str | None = None,
    ) -> None:
        self._db_path = db_path
        # Serialises an in-memory registry's calls (the reaper thread is another caller); a
        # durable store has its own lock and group commit.
        self._lock = threading.Lock()
        # The cohort the actor was opened with (an engine declared lost later leaves the
        # registry's cohort, not the identity this actor is started and found under).
        self._opened_with = tuple(engines)
        self._registry: LoRAVersionRegistry | DurableRegistry | None = None
        self._refusal: LoraVersionError | None = None
        if db_path is None:
            self._registry = LoRAVersionRegistry(epoch, engines, capacity, publisher_token=publisher_token)
        else:
            # A restart (Ray re-runs __init__) must find the state it served: on a missing or
            # empty database it refuses every call, naming the path, and never serves an empty
            # registry under the epoch's name (nor crashes, which Ray would restart forever).
            restarted = _was_restarted()
            try:
                self._registry = DurableRegistry.open(
                    db_path,
                    epoch,
                    engines,
                    capacity,
                    synchronous=synchronous,
                    must_exist=restarted,
                    publisher_token=publisher_token,
                )
            except StoreMissingError as exc:
                self._refusal = LoraVersionError(ErrorCode.REGISTRY_STATE_LOST, str(exc), db_path=db_path)
        self.reaped = 0  # sessions closed by lease expiry in this process
        self._reaper_stop = threading.Event()
        if lease_reaper_s is not None and self._refusal is None:
            threading.Thread(
                target=self._reap_forever, args=(float(lease_reaper_s),), name="lease-reaper", daemon=True
            ).start()

    def call(self, op: str, kwargs: dict[str, Any]) -> Envelope:
        return self.call_many([(op, kwargs)])[0]

    def call_many(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> list[Envelope]:
        """Run ``calls`` in order; one envelope (answer or refusal) each. On a durable registry
        they are decided together and made durable as (part of) one group commit."""
        if self._refusal is not None:
            return [_refused(self._refusal)] * len(calls)
        reg = self._registry
        if not isinstance(reg, DurableRegistry):
            with self._lock:
                return [_call_envelope(reg, op, kwargs) for op, kwargs in calls]
        unknown = {i for i, (op, _) in enumerate(calls) if op not in _ALLOWED}
        outcomes = iter(reg.dispatch_many([c for i, c in enumerate(calls) if i not in unknown]))
        return [
            _call_envelope(reg, op, kwargs) if i in unknown else _outcome_envelope(next(outcomes))
            for i, (op, kwargs) in enumerate(calls)
        ]

    def _reap_forever(self, interval_s: float) -> None:
        """Close every session whose lease ran out, by the actor's own clock, every
        ``interval_s``; restarted with the actor (Ray re-runs ``__init__``). A tick that fails
        (a store error) is logged and the next one runs."""
        errors = _ReaperErrors(interval_s)
        while not self._reaper_stop.wait(interval_s):
            try:
                envelope = self.call("expire_leases", {})
            except Exception as exc:
                errors.failed(exc)
                continue
            errors.cleared()
            if envelope[0] == "ok":
                self.reaped += len(envelope[1])

    def stop_reaping(self) -> None:
        """End the reaper thread at its next tick (a body used in process; under Ray it ends
        with the actor's process)."""
        self._reaper_stop.set()

    def describe(self) -> dict[str, Any]:
        where = {
            "db_path": self._db_path,
            "pid": os.getpid(),
            "node_id": _ray().get_runtime_context().get_node_id(),
        }
        reg = self._registry
        if reg is None:
            assert self._refusal is not None
            return {**where, "refused": self._refusal.parts()}
        return {
            **where,
            "commits": reg.commits if isinstance(reg, DurableRegistry) else 0,
            "epoch": reg.epoch,
            "engines": self._opened_with,
            "cohort": tuple(reg.engines),
            "capacity": reg.capacity,
            "publisher": publisher_fingerprint(reg.publisher_token),
        }

    def close(self) -> None:
        if isinstance(self._registry, DurableRegistry):
            self._registry.close()


def _was_restarted() -> bool:
    """Whether Ray is re-running this actor's constructor after its process died."""
    return bool(_ray().get_runtime_context().was_current_actor_reconstructed)


def raise_if_refused(desc: dict[str, Any]) -> dict[str, Any]:
    """An actor's description, or its refusal raised (a restart that lost its database)."""
    if "refused" in desc:
        raise LoraVersionError.from_parts(*desc["refused"])
    return desc


_REMOTE_CLASS: Any = None


def _remote_class() -> Any:
    global _REMOTE_CLASS
    if _REMOTE_CLASS is None:
        _REMOTE_CLASS = _ray().remote(RegistryActor)
    return _REMOTE_CLASS


def start_registry_actor(
    epoch: str | int,
    engines: Sequence[str],
    capacity: int = MANAGED_CAPACITY,
    *,
    db_path: str | os.PathLike[str] | None = None,
    name: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    synchronous: str = "FULL",
    detached: bool = False,
    lease_reaper_s: float | None = DEFAULT_LEASE_REAPER_S,
    node_id: str | None = None,
    publisher_token: str | None = None,
) -> ActorHandle:
    """Get the epoch's registry actor, creating it if nobody has yet (``ray.init`` first).

    An existing actor of that name must serve the same epoch, cohort, capacity and database,
    or this raises :class:`StoreError` instead of quietly handing out another registry.

    A durable actor is pinned to one node, the one that holds its database: ``node_id`` (a Ray
    node id), by default the node of the process calling this (the trainer's). Ray restarts it
    there and nowhere else (hard node affinity): on another node ``db_path`` would name another,
    empty file. A restart that finds its database missing or empty refuses every call with
    REGISTRY_STATE_LOST, naming the path.

    ``lease_reaper_s``: the actor ends the leases that ran out every so often, by its own clock
    (on by default; None turns it off, for a registry whose leases someone else reaps).

    ``publisher_token``: the trainer's (:func:`new_publisher_token`); it builds its own client
    with it (``AsyncRegistryClient.for_actor(handle, publisher_token=token)``). A durable actor
    makes it its database's token. An actor that already runs under another publisher's token is
    refused (:class:`StoreError`): stop it first. None: the caller does not publish (the actor
    keeps its database's token, or draws one nobody outside it knows).
    """
    if publisher_token is not None:
        checked_publisher_token(publisher_token)
    ray = _ray()
    name = name or actor_name(epoch)
    path = os.fspath(db_path) if db_path is not None else None
    durable = path is not None
    placement: dict[str, Any] = {}
    if durable:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # optional extra

        home = node_id or ray.get_runtime_context().get_node_id()
        placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=home, soft=False)
    handle = (
        _remote_class()
        .options(
            name=name,
            namespace=namespace,
            get_if_exists=True,
            lifetime="detached" if detached else None,
            # a durable store decides calls one at a time under its own lock; threads let calls
            # arrive while a group is being written (group commit). In memory: one at a time.
            max_concurrency=DURABLE_CONCURRENCY if durable else 1,
            num_cpus=0,  # bookkeeping only; never takes a CPU slot from engines or trainers
            max_restarts=-1 if durable else 0,
            max_task_retries=0,
            **placement,
        )
        .remote(epoch, list(engines), capacity, path, synchronous, lease_reaper_s, publisher_token)
    )
    try:
        desc = raise_if_refused(ray.get(handle.describe.remote()))
    except ray.exceptions.RayActorError as exc:
        raise StoreError(f"registry actor {name!r} failed to start: {exc}") from exc
    expected = LoRAVersionRegistry(epoch, engines, capacity)
    got = (desc["epoch"], tuple(desc["engines"]), desc["capacity"], desc["db_path"])
    if got != (expected.epoch, expected.engines, expected.capacity, path):
        raise StoreError(
            f"actor {name!r} already serves epoch/engines/capacity/db {got}, not the ones asked for"
        )
    if publisher_token is not None and desc["publisher"] != publisher_fingerprint(publisher_token):
        raise StoreError(
            f"actor {name!r} already serves another publisher (a running actor keeps the token it "
            "was started with): stop it, or publish with the token it was started with"
        )
    return handle


def get_registry_actor(
    epoch: str | int, *, name: str | None = None, namespace: str = DEFAULT_NAMESPACE
) -> Any:
    """The running registry actor of an epoch (raises ValueError if there is none)."""
    return _ray().get_actor(name or actor_name(epoch), namespace=namespace)


# ------------------------------------------------------------------------------- clients


class _Backend:
    """Runs ``op(**kwargs)`` somewhere and returns its envelope (sync)."""

    def call(self, op: str, kwargs: dict[str, Any]) -> Envelope:
        raise NotImplementedError


class _LocalBackend(_Backend):
    def __init__(self, registry: Any) -> None:
        self.registry = registry
        # The pure registry is single-threaded and clients may not be; a durable store has its
        # own lock (and groups the commits of calls made concurrently).
        self._lock = contextlib.nullcontext() if isinstance(registry, DurableRegistry) else threading.Lock()

    def call(self, op: str, kwargs: dict[str, Any]) -> Envelope:
        with self._lock:
            return _call_envelope(self.registry, op, kwargs)


class _RayBackend(_Backend):
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def call(self, op: str, kwargs: dict[str, Any]) -> Envelope:
        return _ray().get(self.handle.call.remote(op, kwargs))


class _Describe:
    _describe: Callable[[], dict[str, Any]]
    _info: dict[str, Any] | None = None

    def _desc(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self._describe()
        return self._info

    @property
    def epoch(self) -> str:
        return str(self._desc()["epoch"])

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(self._desc()["engines"])

    @property
    def capacity(self) -> int:
        return int(self._desc()["capacity"])


def _local_describe(registry: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {
        "epoch": registry.epoch,
        "engines": tuple(registry.engines),
        "capacity": registry.capacity,
    }


class RegistryClient(_Describe, RegistryOps):
    """Synchronous client with the registry's API, in-process or through the actor."""

    def __init__(
        self,
        backend: _Backend,
        describe: Callable[[], dict[str, Any]],
        *,
        publisher_token: str | None = None,
    ) -> None:
        self._backend = backend
        self._describe = describe
        self._publisher_token = None if publisher_token is None else checked_publisher_token(publisher_token)

    @classmethod
    def in_process(
        cls, registry: LoRAVersionRegistry | DurableRegistry, *, as_publisher: bool = True
    ) -> RegistryClient:
        """``as_publisher=False``: a client without the registry's publisher token (a worker's)."""
        token = registry.publisher_token if as_publisher else None
        return cls(_LocalBackend(registry), _local_describe(registry), publisher_token=token)

    @classmethod
    def for_actor(cls, handle: Any, *, publisher_token: str | None = None) -> RegistryClient:
        return cls(
            _RayBackend(handle),
            lambda: raise_if_refused(_ray().get(handle.describe.remote())),
            publisher_token=publisher_token,
        )

    @property
    def is_publisher(self) -> bool:
        """Whether this client carries a publisher token (whether it is right, the registry says)."""
        return self._publisher_token is not None

    def _dispatch(self, op: str, /, **kwargs: Any) -> Any:
        return _unwrap(self._backend.call(op, _as_publisher(op, kwargs, self._publisher_token)))

    _call = _dispatch  # the raw entry point (tests call it with ops outside the typed API)


class RegistryUnavailable(Exception):
    """The registry could not be reached for ``op`` (after the client's retries). Its outcome
    is unknown to the caller; every registry op is idempotent, so asking again is safe.

    Not a :class:`LoraVersionError` (no registry decided anything, so no ``except
    LoraVersionError`` may take it for a refusal), but typed all the same: ``code`` is
    REGISTRY_UNAVAILABLE."""

    code = ErrorCode.REGISTRY_UNAVAILABLE

    def __init__(self, op: str, cause: BaseException) -> None:
        super().__init__(f"registry {op}: {type(cause).__name__}: {cause}")
        self.op = op
        self.cause = cause


TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, OSError)


class _Coalescer:
    """At most one ``send_many`` in flight; every call made meanwhile goes in the next one.

    Nothing waits to fill a batch (no timer): a call on an idle client is sent at the loop's next
    step, alone. A failed send fails each of its calls with the same error (each caller then
    retries on its own: every registry op is idempotent)."""

    def __init__(self, send_many: Callable[[list[tuple[str, dict[str, Any]]]], Any]) -> None:
        self._send_many = send_many
        self._queue: list[tuple[str, dict[str, Any], asyncio.Future[Envelope]]] = []
        self._pump: asyncio.Task[None] | None = None
        self.sends = 0  # actor calls made (for benches: calls per round trip)

    async def call(self, op: str, kwargs: dict[str, Any]) -> Envelope:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Envelope] = loop.create_future()
        self._queue.append((op, kwargs, future))
        if self._pump is None or self._pump.done():
            self._pump = loop.create_task(self._send_all(), name="registry-batch")
        return await future

    async def _send_all(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            self.sends += 1
            try:
                envelopes = await self._send_many([(op, kwargs) for op, kwargs, _ in batch])
            except Exception as exc:
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (*_, future), envelope in zip(batch, envelopes, strict=True):
                if not future.done():
                    future.set_result(envelope)


def _registry_identity(desc: dict[str, Any]) -> tuple[Any, ...]:
    """What makes an actor's registry the same registry: its database, epoch, cohort, capacity
    and publisher."""
    return (desc["db_path"], desc["epoch"], tuple(desc["engines"]), desc["capacity"], desc["publisher"])


class _ActorByName:
    """The handle of a named registry actor, looked up at first use and again after the actor it
    named died for good (Ray's actor errors: a restart in place keeps the handle working).

    A name can be taken by another actor than the one this client served. So the first actor's
    identity is read once, and an actor found by a later lookup is used only if it is the same
    durable registry restarted from its database: anything else (another database, epoch or
    publisher, or a registry in memory, which is empty after any restart) is REGISTRY_STATE_LOST,
    never served as this one."""

    def __init__(self, name: str, namespace: str, handle: Any = None) -> None:
        self.name, self.namespace = name, namespace
        self._handle: Any = handle
        self._identity: tuple[Any, ...] | None = None

    async def _current(self) -> Any:
        if self._handle is None:
            try:
                handle = _ray().get_actor(self.name, namespace=self.namespace)
            except ValueError as exc:  # no actor of that name runs (yet, or any more): transient
                raise ConnectionError(f"no registry actor {self.name!r} runs: {exc}") from exc
            if self._identity is not None:
                self._check_same(raise_if_refused(await handle.describe.remote()))
            self._handle = handle
        if self._identity is None:
            self._identity = _registry_identity(raise_if_refused(await self._handle.describe.remote()))
        return self._handle

    def _check_same(self, desc: dict[str, Any]) -> None:
        found = _registry_identity(desc)
        if found != self._identity or desc["db_path"] is None:
            raise LoraVersionError(
                ErrorCode.REGISTRY_STATE_LOST,
                f"the actor now named {self.name!r} is not the registry this client served (its "
                "database, epoch, cohort, capacity or publisher differ, or it keeps no database): "
                "the registry's state is not there",
                name=self.name,
            )

    async def send(self, remote: Callable[[Any], Any]) -> Any:
        handle = self._handle
        try:
            handle = await self._current()
            return await remote(handle)
        except (_ray().exceptions.RayActorError, _ray().exceptions.ActorUnschedulableError):
            if self._handle is handle:
                self._handle = None  # the next call looks the name up again
            raise


class AsyncRegistryClient(_Describe, AsyncRegistryOps):
    """THE async face of the registry for the publisher and the session layer: the registry's
    typed operations, in process or through the Ray actor, with an explicit :meth:`connect`.

    In process, the in-memory registry runs inline (it never blocks), a durable store on one
    dedicated worker thread (serialised, single writer; its fsync never blocks the event loop).
    Through Ray, the ObjectRef is awaited directly. Transient failures (``transient`` errors, Ray's
    own) are retried ``retries`` times, which is safe because every registry op is idempotent by
    request id or natural key (a retry of a call whose reply was lost gets the first answer);
    then :class:`RegistryUnavailable`. A :class:`LoraVersionError` is a decision of the registry
    and is never retried.
    """

    def __init__(
        self,
        call: Callable[[str, dict[str, Any]], Any],
        describe: Callable[[], Any],
        executor: ThreadPoolExecutor | None = None,
        *,
        retries: int = 2,
        retry_delay_s: float = 0.05,
        transient: tuple[type[BaseException], ...] = TRANSIENT_ERRORS,
        lease_reaper_s: float | None = None,
        publisher_token: str | None = None,
    ) -> None:
        self._acall = call
        self._publisher_token = None if publisher_token is None else checked_publisher_token(publisher_token)
        self._adescribe = describe
        self._executor = executor
        self._describe = self._cached_only
        self.retries = retries
        self.retry_delay_s = retry_delay_s
        self.transient = transient
        # In process, this client is the registry's host: it reaps the leases granted through
        # it (started with the first grant, so a registry without leases never sees a reaper).
        self.lease_reaper_s = lease_reaper_s
        self._reaper: asyncio.Task[None] | None = None

    def _cached_only(self) -> dict[str, Any]:
        raise RuntimeError("await client.connect() before reading epoch / engines / capacity")

    @classmethod
    def in_process(
        cls,
        registry: Any,
        *,
        offload: bool | None = None,
        lease_reaper_s: float | None = DEFAULT_LEASE_REAPER_S,
        as_publisher: bool = True,
        **retry: Any,
    ) -> AsyncRegistryClient:
        """``registry``: the in-memory registry, a durable store, or any object with the
        registry's operations (sync or async). ``offload`` (default: for a durable store) runs the
        calls on a worker thread. ``lease_reaper_s``: once a lease is granted through this
        client, it ends the leases that ran out every so often, by this host's clock, until
        :meth:`close` (None: the caller reaps, e.g. with :meth:`reap_leases_forever`).
        ``as_publisher``: carry the registry object's publisher token (False: a worker's client)."""
        token = getattr(registry, "publisher_token", None) if as_publisher else None
        if offload is None:
            offload = isinstance(registry, DurableRegistry)
        executor: ThreadPoolExecutor | None = None
        if offload:
            backend = _LocalBackend(registry)
            # several threads: calls made while a group is being written join the next group
            executor = ThreadPoolExecutor(max_workers=DURABLE_CONCURRENCY, thread_name_prefix="lora-registry")

            async def call(op: str, kwargs: dict[str, Any]) -> Envelope:
                return await asyncio.get_running_loop().run_in_executor(executor, backend.call, op, kwargs)

        else:

            async def call(op: str, kwargs: dict[str, Any]) -> Envelope:
                return await _acall_envelope(registry, op, kwargs)

        async def describe() -> dict[str, Any]:
            return _local_describe(registry)()

        return cls(call, describe, executor, lease_reaper_s=lease_reaper_s, publisher_token=token, **retry)

    @classmethod
    def for_actor(
        cls, handle: Any, *, batch: bool = True, publisher_token: str | None = None, **retry: Any
    ) -> AsyncRegistryClient:
        """``batch``: the calls this client makes while one actor call is in flight go together
        in the next (one Ray round trip); False: one actor call per registry call.
        ``publisher_token``: the trainer's (the one it started the actor with); a worker's
        client has none and is refused every publication op (NOT_PUBLISHER)."""
        if batch:
            coalescer = _Coalescer(lambda calls: handle.call_many.remote(calls))
            call = coalescer.call
        else:

            async def call(op: str, kwargs: dict[str, Any]) -> Envelope:
                return await handle.call.remote(op, kwargs)

        async def describe() -> dict[str, Any]:
            return raise_if_refused(await handle.describe.remote())

        return cls(call, describe, publisher_token=publisher_token, **retry)

    @classmethod
    def for_named_actor(
        cls,
        epoch: str | int,
        *,
        name: str | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        handle: Any = None,
        batch: bool = True,
        publisher_token: str | None = None,
        **retry: Any,
    ) -> AsyncRegistryClient:
        """A client of the epoch's actor found **by name**, looked up again once the actor it
        holds is gone for good. A durable actor is pinned to its database's node: when that node
        is lost, Ray does not start it elsewhere (its calls fail: REGISTRY_UNAVAILABLE), and
        when the database's node is back the trainer starts it there again
        (:func:`start_registry_actor`, same name). A handle cannot follow that (it names the
        dead actor); this client's next call finds the new one. It never finds another
        registry: the name is the epoch's, and a restarted actor serves its database's journal
        or refuses every call (REGISTRY_STATE_LOST). ``handle``: the actor's, when the caller
        started it (held until the actor is gone: an actor not detached lives while a handle
        does)."""
        actor = _ActorByName(name or actor_name(epoch), namespace, handle)
        if batch:
            coalescer = _Coalescer(lambda calls: actor.send(lambda h: h.call_many.remote(calls)))
            call = coalescer.call
        else:

            async def call(op: str, kwargs: dict[str, Any]) -> Envelope:
                return await actor.send(lambda h: h.call.remote(op, kwargs))

        async def describe() -> dict[str, Any]:
            return raise_if_refused(await actor.send(lambda h: h.describe.remote()))

        return cls(call, describe, publisher_token=publisher_token, **retry)

    @classmethod
    def of(cls, registry: Any, **retry: Any) -> AsyncRegistryClient:
        """A client as given, or an in-process client around a registry object."""
        return registry if isinstance(registry, cls) else cls.in_process(registry, **retry)

    async def connect(self) -> AsyncRegistryClient:
        """Fetch ``epoch`` / ``engines`` / ``capacity`` (once; later calls return at once)."""
        if self._info is None:
            self._info = await self._adescribe()
        return self

    def close(self) -> None:
        if self._reaper is not None:
            with contextlib.suppress(RuntimeError):  # its event loop already ended (and the task)
                self._reaper.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def aclose(self) -> None:
        """:meth:`close`, and the lease reaper's end awaited: nothing of this client runs after."""
        self.close()
        if self._reaper is not None:
            await asyncio.gather(self._reaper, return_exceptions=True)  # its end (cancelled), never raised

    @property
    def is_publisher(self) -> bool:
        """Whether this client carries a publisher token (whether it is right, the registry says)."""
        return self._publisher_token is not None

    @property
    def reaping(self) -> bool:
        """Whether this client's own lease reaper runs (in process, after the first grant)."""
        return self._reaper is not None and not self._reaper.done()

    def _start_reaper(self) -> None:
        if self.lease_reaper_s is not None and self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(
                self.reap_leases_forever(self.lease_reaper_s), name="lease-reaper"
            )

    async def reap_leases_forever(self, interval_s: float = 1.0) -> None:
        """The in-process counterpart of the actor's ``lease_reaper_s`` thread: one
        ``expire_leases`` (stamped with this host's clock) every ``interval_s`` until cancelled
        (run it as a task). Give it only to an in-process registry: the actor reaps on its own.
        An unreachable registry is asked again at the next tick; nothing is closed on a guess.
        Any other error of a tick is logged (once while it repeats) and the next tick runs: a
        reaper that died of it would leave every lease of this client unexpired for good."""
        errors = _ReaperErrors(interval_s)
        while True:
            try:
                await self.expire_leases()
                errors.cleared()
            except RegistryUnavailable:
                pass
            except Exception as exc:
                errors.failed(exc)
            await asyncio.sleep(interval_s)

    def _is_transient(self, exc: BaseException) -> bool:
        # Ray's errors (actor died, task failed) are transient for an idempotent op; we do not
        # import ray to recognise them.
        return isinstance(exc, self.transient) or type(exc).__module__.startswith("ray.")

    async def _dispatch(self, op: str, /, **kwargs: Any) -> Any:
        if op == "grant_lease":
            self._start_reaper()
        kwargs = _as_publisher(op, kwargs, self._publisher_token)
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_delay_s * attempt)
            try:
                return _unwrap(await self._acall(op, kwargs))
            except LoraVersionError:
                raise
            except Exception as exc:
                if not self._is_transient(exc):
                    raise
                last = exc
        assert last is not None
        raise RegistryUnavailable(op, last)

    _call = _dispatch
