"""TRL's ``GRPOTrainer`` on immutable LoRA versions: each step's adapter is published as a new
version, and every completion TRL asks for is a multi-turn episode through a session.

The optional ``trl`` extra (``trl==1.16.0``); nothing else in ``relax_glue`` imports this module,
and it imports ``torch``, ``transformers`` and ``trl`` only inside the functions that use them.

What a TRL user adds (docs/trl.md, and the README's "Use it from TRL")::

    versions = GRPOVersions.connect(ENGINES, gateway_url=GATEWAY, admin_key=KEY)
    trainer = GRPOTrainer(..., peft_config=lora,
                          rollout_func=versions.rollout_func(env_turn=tool, max_new_tokens=16),
                          callbacks=[versions.callback()])
    trainer.train(); versions.close()

* **Publication** (:class:`PublishingHooks`, a ``TrainerCallback``): at train begin and after
  every optimizer step the main process freezes the policy's adapter (``Snapshot.from_peft_model``)
  and publishes it as version ``step{global_step}`` through the
  :class:`~relax_glue.publisher.Publisher`. A ``CAPACITY_ERROR`` is backpressure, handled by
  the showcase's rule (:mod:`relax_glue.backpressure`): reclaim what nobody holds, retry within a
  bounded wait, then skip this step (counted, bounded by the lag the policy allows), past that a
  bounded forced wait, then a failure. Never a pause: nothing here stops an engine.
* **Rollouts** (:meth:`GRPOVersions.rollout_func`): TRL hands each process its prompts, each
  repeated ``num_generations`` times in a row (a GRPO group). Every completion is one session,
  opened with ``group=`` its prompt's group (smg routes the group to one engine, where the prompt
  is prefilled once); the episode is assistant turn, environment (tool) turn, assistant turn, all
  on the exact ``lora_path`` the session bound at its first generation; the session is closed
  before TRL gets the completion. Per completion TRL gets ``prompt_ids``, ``completion_ids``
  (assistant, tool and assistant tokens), ``logprobs`` (the engine's, 0.0 on tool tokens),
  ``env_mask`` (1 = model token) and, passed on to the reward functions, ``bound_version`` (the
  exact ``lora_path``), ``version_id``, ``assistant_ids`` and ``rollout_error``.
* **The trainer's view and the episodes' versions.** The trainer at ``global_step = t`` holds
  ``W_t``; ``step{t}`` is ``W_t`` frozen. Synchronous publication (the default): ``step{t}`` is
  committed before ``on_step_end`` returns, so the rollouts TRL runs next, at step ``t``, bind
  ``step{t}``: exactly the trainer's weights (a failure or a skip leaves them on an older
  version, which ``version_id`` shows). With ``background=True`` the publication of ``step{t}``
  runs while step ``t``'s rollouts already start: they bind ``step{t-1}`` or ``step{t}``,
  whichever is the default at their first generation, so an episode lags the trainer by at most
  one step (plus skips), and every turn of it stays on that one version. **TRL does not correct
  for that lag**: with ``use_vllm=False`` it treats every sample as on-policy and never uses the
  returned ``logprobs`` for importance correction. Use the default (synchronous) when the loss
  must be exactly on-policy; the ``version_id`` the reward functions receive says which weights
  sampled each completion.
* **Several training processes** (``accelerate launch``, gloo on CPU): only the main process
  snapshots and publishes; every rank learns the same :class:`PublicationOutcome` (published, a
  counted skip, a failure) through one ``broadcast_object_list`` from rank 0. Everything rank 0
  does before that broadcast is bounded (``publish_timeout_s``) and every exception becomes a
  typed FAILED outcome, so rank 0 always reaches it: no rank is left waiting in a collective. A
  failure beyond ``max_failures`` raises :class:`PublicationFailed` on every rank at the same
  point. The registry is then the Ray actor (started by rank 0, joined by the others); each
  process runs its own slice of the rollouts through its own sessions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import inspect
import json
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from enum import StrEnum
from typing import Any, TypeVar

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.names import MANAGED_CAPACITY
from relax_glue.backpressure import (
    Decision,
    PublishDecision,
    StalenessPolicy,
    publish_with_backpressure,
)

__all__ = [
    "CompletionRecord",
    "GRPOVersions",
    "OutcomeKind",
    "PublicationFailed",
    "PublicationOutcome",
    "PublishingHooks",
    "RankInfo",
    "Segment",
    "VersionsConfig",
    "assemble_completion",
    "group_names",
    "publishing_callback_class",
    "rollout_output",
    "sampling_params",
    "trainer_logprobs",
    "turn_logprobs",
]

T = TypeVar("T")
RAY_AUTH = "RAY_AUTH_MODE"  # how a process joins the Ray cluster rank 0 started
EnvTurn = Callable[[Any, list[list[int]]], "Sequence[int] | Awaitable[Sequence[int]]"]


def version_id(step: int, prefix: str = "step") -> str:
    return f"{prefix}{step}"


# ================================================================= outcomes (pure, broadcast)


class OutcomeKind(StrEnum):
    PUBLISHED = "PUBLISHED"  # the step's version is committed: the new default
    SKIPPED = "SKIPPED"  # capacity backpressure: this step was not published (counted, bounded)
    FAILED = "FAILED"  # refused, failed on an engine, timed out, or raised: typed in ``code``


@dataclasses.dataclass(frozen=True)
class PublicationOutcome:
    """What every rank learns about one step's publication (rank 0 decides, all agree)."""

    step: int
    version_id: str
    kind: OutcomeKind
    lora_name: str | None = None  # the committed exact name (PUBLISHED)
    code: str | None = None  # the error code or publish outcome that decided a SKIP or a FAILED
    detail: str = ""
    attempts: int = 0
    capacity_refusals: int = 0
    seconds: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        """Builtins only: a small pickle for ``broadcast_object_list``."""
        return {**dataclasses.asdict(self), "kind": self.kind.value}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> PublicationOutcome:
        return cls(**{**wire, "kind": OutcomeKind(wire["kind"])})

    @classmethod
    def failed(cls, step: int, vid: str, code: str, detail: str = "", **kw: Any) -> PublicationOutcome:
        return cls(step, vid, OutcomeKind.FAILED, code=code, detail=detail[:500], **kw)

    @classmethod
    def raised(cls, step: int, vid: str, exc: BaseException) -> PublicationOutcome:
        """The step failed with ``exc``: a typed error keeps its code (a sharded adapter's
        INVALID_REQUEST), anything else is named by its type."""
        code = exc.code.value if isinstance(exc, LoraVersionError) else type(exc).__name__
        return cls.failed(step, vid, code, str(exc))


class PublicationFailed(RuntimeError):
    """Raised on every rank, at the same step, once failures exceed ``max_failures``."""

    def __init__(self, outcome: PublicationOutcome, failures: int) -> None:
        super().__init__(
            f"publication of {outcome.version_id} failed ({outcome.code}: {outcome.detail}); "
            f"{failures} failed publication(s) in this run"
        )
        self.outcome = outcome
        self.failures = failures


def outcome_of(
    step: int, vid: str, result: Any, *, attempts: int, capacity_refusals: int, seconds: float
) -> PublicationOutcome:
    """A :class:`~relax_glue.publisher.PublishResult` (not a capacity refusal) as an outcome."""
    common = {"attempts": attempts, "capacity_refusals": capacity_refusals, "seconds": round(seconds, 4)}
    if result.ok:
        return PublicationOutcome(step, vid, OutcomeKind.PUBLISHED, lora_name=result.lora_name, **common)
    error = result.error
    code = error.code.value if error is not None else str(result.outcome)
    detail = f"{result.outcome}: {error.message}" if error is not None else str(result.outcome)
    return PublicationOutcome.failed(step, vid, code, detail, **common)


# ================================================================ completions (pure assembly)


@dataclasses.dataclass(frozen=True)
class Segment:
    """One piece of a completion: an assistant turn (with the engine's log-probabilities of its
    tokens) or an environment turn (``logprobs`` None: not the model's tokens)."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None

    @property
    def is_model(self) -> bool:
        return self.logprobs is not None


def assemble_completion(segments: Sequence[Segment]) -> tuple[list[int], list[float], list[int]]:
    """``completion_ids``, ``logprobs`` and ``env_mask`` of one multi-turn completion: the
    segments in order; model tokens carry the engine's log-probability and mask 1, environment
    tokens 0.0 and mask 0 (TRL leaves them out of the loss)."""
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    for seg in segments:
        if seg.logprobs is not None and len(seg.logprobs) != len(seg.ids):
            raise ValueError(f"{len(seg.logprobs)} logprobs for {len(seg.ids)} tokens")
        ids.extend(seg.ids)
        logprobs.extend(seg.logprobs if seg.logprobs is not None else [0.0] * len(seg.ids))
        mask.extend([1 if seg.is_model else 0] * len(seg.ids))
    return ids, logprobs, mask


def turn_logprobs(reply: Mapping[str, Any]) -> list[float]:
    """The sampled tokens' log-probabilities from ``meta_info.output_token_logprobs``
    (``[logprob, token_id, text]`` per token), checked against ``output_ids``."""
    entries = (reply.get("meta_info") or {}).get("output_token_logprobs") or []
    ids = [int(t) for t in reply.get("output_ids") or []]
    if [int(e[1]) for e in entries] != ids:
        raise ValueError(f"output_token_logprobs do not match output_ids ({len(entries)} vs {len(ids)})")
    return [float(e[0]) for e in entries]


def group_names(prompts: Sequence[Any], step: int) -> list[str]:
    """One session group per prompt: TRL repeats each prompt ``num_generations`` times in a row,
    so a run of equal consecutive prompts is one GRPO group. The name is the step and the
    prompt's content, so members on other ranks (a group split across processes) share it."""
    names: list[str] = []
    for p in prompts:
        text = p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str)
        names.append(f"s{step}-{hashlib.sha256(text.encode()).hexdigest()[:12]}")
    return names


def sampling_params(args: Any, max_new_tokens: int, *, ignore_eos: bool = False) -> dict[str, Any]:
    """SGLang sampling parameters from TRL's own (``GRPOConfig``): the distribution the trainer's
    log-probabilities assume. TRL's ``top_k=0`` (off) is SGLang's ``-1``."""
    top_k = getattr(args, "top_k", 0) or 0
    params: dict[str, Any] = {
        "temperature": float(getattr(args, "temperature", 1.0)),
        "top_p": float(getattr(args, "top_p", 1.0)),
        "top_k": int(top_k) if top_k > 0 else -1,
        "max_new_tokens": int(max_new_tokens),
        "ignore_eos": ignore_eos,
    }
    if getattr(args, "min_p", None):
        params["min_p"] = float(args.min_p)
    if getattr(args, "repetition_penalty", 1.0) != 1.0:
        params["repetition_penalty"] = float(args.repetition_penalty)
    return params


@dataclasses.dataclass(frozen=True)
class TurnRecord:
    rid: str
    lora_path: str  # as sent on this request
    engine_id: str  # as the gateway reported it
    outcome: str
    tokens: int
    cached_tokens: int


@dataclasses.dataclass
class CompletionRecord:
    """One completion (one session, one episode), as this process ran it."""

    step: int  # the trainer's global_step when TRL asked for it
    rank: int
    index: int  # its position in this process's batch
    group: str
    session: str
    prompt_ids: list[int]
    segments: list[Segment] = dataclasses.field(default_factory=list)
    turns: list[TurnRecord] = dataclasses.field(default_factory=list)
    bound_version: str | None = None  # the session's binding (exact lora_path), read at close
    version_id: str | None = None
    released: bool = False  # the registry released the session's ref
    error: str | None = None
    t_open: float = 0.0  # wall clock (comparable across processes of one host)
    t_close: float = 0.0

    @property
    def assistant_ids(self) -> list[int]:
        return [t for s in self.segments if s.is_model for t in s.ids]

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["segments"] = [{"ids": list(s.ids), "model": s.is_model} for s in self.segments]
        d["engine_logprobs"] = [lp for s in self.segments if s.logprobs is not None for lp in s.logprobs]
        return d


def rollout_output(records: Sequence[CompletionRecord], fallback_id: int) -> dict[str, list[Any]]:
    """TRL's rollout_func result, one entry per completion in order. A failed episode becomes a
    one-token completion with mask 0 (no gradient from it) and its error for the reward
    functions: counted in ``rollout_error``, never a silent success."""
    out: dict[str, list[Any]] = {
        k: []
        for k in (
            "prompt_ids",
            "completion_ids",
            "logprobs",
            "env_mask",
            "bound_version",
            "version_id",
            "assistant_ids",
            "rollout_error",
        )
    }
    for r in records:
        if r.error is None and r.segments:
            ids, lps, mask = assemble_completion(r.segments)
        else:
            ids, lps, mask = [fallback_id], [0.0], [0]
        out["prompt_ids"].append(list(r.prompt_ids))
        out["completion_ids"].append(ids)
        out["logprobs"].append(lps)
        out["env_mask"].append(mask)
        out["bound_version"].append(r.bound_version)
        out["version_id"].append(r.version_id)
        out["assistant_ids"].append(r.assistant_ids if r.error is None else [])
        out["rollout_error"].append(r.error)
    return out


# ====================================================================== ranks and the loop


@dataclasses.dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls) -> RankInfo:
        """This process's rank. Under ``accelerate launch``/``torchrun`` the process group is
        initialized here if TRL has not done it yet (accelerate's ``PartialState``: gloo on CPU)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            from accelerate import PartialState

            PartialState()
        return cls(dist.get_rank(), dist.get_world_size())


def broadcast_from_main(value: Any, rank: RankInfo) -> Any:
    """Rank 0's ``value`` on every rank: one ``broadcast_object_list`` (a no-op alone)."""
    if rank.world_size == 1:
        return value
    import torch.distributed as dist

    box = [value if rank.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(outcome: PublicationOutcome | None, rank: RankInfo) -> PublicationOutcome:
    """Every rank gets rank 0's outcome (rank 0 passes it, the others None)."""
    wire = broadcast_from_main(outcome.to_wire() if outcome is not None else None, rank)
    if wire is None:
        raise RuntimeError("rank 0 broadcast no publication outcome")
    return PublicationOutcome.from_wire(wire)


class _Loop:
    """One asyncio loop in a daemon thread: the async stack (registry client, sessions,
    publisher, HTTP pools) lives on it, and TRL's synchronous hooks submit work to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lora-versions-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return self.submit(coro).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


# ========================================================================== configuration


@dataclasses.dataclass(frozen=True)
class VersionsConfig:
    capacity: int = MANAGED_CAPACITY  # the epoch's K (engines need K + 1 LoRA slots)
    background: bool = False  # publish while the next step's rollouts run (a lag of <= 1 step)
    max_failures: int = 0  # failed publications tolerated (counted) before every rank raises
    # capacity backpressure: reclaim and a bounded wait, a bounded skip, a bounded forced wait
    policy: StalenessPolicy = dataclasses.field(default_factory=StalenessPolicy)
    publish_timeout_s: float = 120.0  # rank 0 reaches the outcome broadcast within this
    episode_timeout_s: float = 300.0  # one episode; then it is a recorded, masked failure
    rollout_timeout_s: float = 900.0  # one process's batch (a last resort past the episodes')
    keep_completions: bool = True  # keep every episode's record for report() (memory grows)
    setup_timeout_s: float = 120.0
    lease_ttl_s: float = 60.0  # a dead process's sessions close when their lease runs out
    version_prefix: str = "step"
    ray_num_cpus: int = 1  # the local Ray cluster rank 0 starts for the registry actor (world > 1)


@dataclasses.dataclass
class PublishRecord:
    """Rank 0's record of one publication: the outcome and each engine's local ``lora_id``
    (what SGLang's unload log line names)."""

    outcome: PublicationOutcome
    t_start: float
    t_end: float
    lora_ids: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ReclaimRecord:
    lora_name: str
    version_id: str
    done: bool
    engines: dict[str, str]
    trigger: str
    t_start: float  # wall clock
    t_end: float


# ============================================================================ the integration


class GRPOVersions:
    """The TRL side of one run: sessions (every rank), the publisher (rank 0), the loop they run
    on. Build with :meth:`connect`; hand TRL :meth:`rollout_func` and :meth:`callback`."""

    def __init__(
        self,
        loop: _Loop,
        rank: RankInfo,
        epoch: str,
        sessions: Any,
        publisher: Any | None,
        clients: Mapping[str, Any],
        gateway: Any,
        config: VersionsConfig,
        ray: RayRole | None = None,
    ) -> None:
        self.loop, self.rank, self.epoch, self.config = loop, rank, epoch, config
        self.sessions, self.publisher, self.clients, self.gateway = sessions, publisher, clients, gateway
        self.ray = ray or RayRole()  # what this process did with Ray (several processes only)
        self.outcomes: list[PublicationOutcome] = []  # every rank: the agreed outcomes, in order
        self.publications: list[PublishRecord] = []  # rank 0
        self.reclaims: list[ReclaimRecord] = []  # rank 0
        self.completions: list[CompletionRecord] = []  # this rank's episodes
        self.last_published = -1  # rank 0: the step of the engines' default
        self.failures = 0
        self._closed = False

    # ------------------------------------------------------------------------- building

    @classmethod
    def connect(
        cls,
        engines: Mapping[str, str],
        *,
        gateway_url: str,
        admin_key: str | None = None,
        epoch: str | None = None,
        config: VersionsConfig | None = None,
        wrap_publisher_client: Callable[[Any], Any] | None = None,
    ) -> GRPOVersions:
        """Clients for ``engines`` (id -> URL, control calls go there), sessions through the smg
        gateway at ``gateway_url``, a registry of ``epoch`` (one per run: names never repeat;
        default a fresh one, agreed by every rank) and, on rank 0, the publisher.
        ``wrap_publisher_client``: wraps each engine client the publisher uses (fault injection
        in tests; ``None`` in production)."""
        config = config or VersionsConfig()
        rank = RankInfo.current()
        epoch = broadcast_from_main(epoch or f"trl{uuid.uuid4().hex[:8]}", rank)
        registry, ray = _registry(rank, epoch, tuple(engines), config)
        loop = _Loop()
        try:
            built = loop.call(
                _build(engines, gateway_url, admin_key, registry, rank, config, wrap_publisher_client),
                config.setup_timeout_s,
            )
        except BaseException:
            loop.close()
            raise
        return cls(loop, rank, epoch, *built, config=config, ray=ray)

    def callback(self) -> PublishingHooks:
        """The publication callback for ``GRPOTrainer(callbacks=[...])``."""
        return publishing_callback_class()(self)

    # ----------------------------------------------------------------------- publication

    def vid(self, step: int) -> str:
        return version_id(step, self.config.version_prefix)

    def submit_publication(self, model: Any, step: int, *, required: bool) -> concurrent.futures.Future[Any]:
        """Rank 0: freeze ``model``'s adapter now (training may go on), publish it on the loop."""
        from relax_glue.snapshot import Snapshot

        try:
            snapshot = Snapshot.from_peft_model(_unwrap(model))
        except Exception as exc:  # a snapshot that cannot be taken is this step's typed failure
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            done.set_result(PublicationOutcome.raised(step, self.vid(step), exc))
            return done
        return self.loop.submit(self._publish_step(snapshot, step, required))

    def settle(self, step: int, future: concurrent.futures.Future[Any]) -> PublicationOutcome:
        """Rank 0: the publication's outcome within ``publish_timeout_s``, whatever happens. A
        publication still running then is left to finish (a cancelled control call would only
        make an unknown outcome); the next one first settles what it left (``resolve``)."""
        vid = self.vid(step)
        try:
            return future.result(self.config.publish_timeout_s)
        except concurrent.futures.TimeoutError:
            return PublicationOutcome.failed(
                step, vid, "PUBLISH_TIMEOUT", f"no outcome within {self.config.publish_timeout_s}s"
            )
        except Exception as exc:
            return PublicationOutcome.raised(step, vid, exc)

    def record(self, outcome: PublicationOutcome) -> None:
        """Every rank, with the agreed outcome: count it; past ``max_failures`` raise (on every
        rank at once, after the broadcast, so no rank waits in a collective)."""
        self.outcomes.append(outcome)
        if outcome.kind is OutcomeKind.FAILED:
            self.failures += 1
            if self.failures > self.config.max_failures:
                raise PublicationFailed(outcome, self.failures)

    async def _publish_step(self, snapshot: Any, step: int, required: bool) -> PublicationOutcome:
        t0, wall0 = time.monotonic(), time.time()
        vid = self.vid(step)
        try:
            outcome = await self._publish_with_backpressure(snapshot, step, vid, required, t0)
        except Exception as exc:  # a registry that cannot be reached, a bug: typed, never a hang
            outcome = PublicationOutcome.raised(step, vid, exc)
        rec = PublishRecord(outcome, wall0, time.time())
        if outcome.kind is OutcomeKind.PUBLISHED:
            self.last_published = step
            rec.lora_ids = await self._lora_ids(outcome.lora_name or "")
        self.publications.append(rec)
        return outcome

    async def _publish_with_backpressure(
        self, snapshot: Any, step: int, vid: str, required: bool, t0: float
    ) -> PublicationOutcome:
        assert self.publisher is not None, "only rank 0 publishes"
        publisher = self.publisher
        await publisher.resolve()  # settle what an earlier attempt left pending (slot held)
        await self.reclaim("before publish")

        async def attempt() -> Any:
            result = await publisher.publish(snapshot, vid)
            if not result.ok and result.holds_slot and result.registry_state is not None:
                # an unknown or unconfirmed outcome keeps its slot: settle it now, once
                result = await publisher.resolve(snapshot) or result
            return result

        def decide(waited_s: float) -> Decision:
            return self.config.policy.on_capacity_error(
                step=step, last_published=self.last_published, waited_s=waited_s, required=required
            )

        run = await publish_with_backpressure(attempt, decide, self._wait_for_slot, started=t0)
        counts = {"attempts": run.attempts, "capacity_refusals": run.capacity_refusals}
        if run.gave_up is None:
            return outcome_of(step, vid, run.result, seconds=time.monotonic() - t0, **counts)
        kind = OutcomeKind.SKIPPED if run.gave_up is PublishDecision.SKIP else OutcomeKind.FAILED
        return PublicationOutcome(
            step,
            vid,
            kind,
            code=ErrorCode.CAPACITY_ERROR.value,
            detail="capacity backpressure: every slot held after the bounded wait",
            seconds=round(time.monotonic() - t0, 4),
            **counts,
        )

    async def _wait_for_slot(self, timeout_s: float) -> None:
        """Reclaim what nobody holds, until a slot is free or ``timeout_s`` passed."""
        assert self.publisher is not None
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            await self.reclaim("capacity wait")
            status = await self.publisher.registry.status()
            if status.slots_used < status.capacity or time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))

    async def reclaim(self, trigger: str) -> None:
        """Rank 0: unload every retired version no session holds (each once per engine)."""
        assert self.publisher is not None
        t = time.time()
        for r in await self.publisher.reclaim_ready():
            self.reclaims.append(
                ReclaimRecord(
                    r.lora_name,
                    r.version_key.version_id,
                    r.done,
                    {e: str(o) for e, o in r.engines.items()},
                    trigger,
                    t,
                    time.time(),
                )
            )

    async def _lora_ids(self, lora_name: str) -> dict[str, str]:
        """Each engine's local ``lora_id`` of a version just published (best effort: a status
        that does not come back leaves that engine out of the record, not the run)."""
        out: dict[str, str] = {}
        for eid, client in self.clients.items():
            try:
                status = await client.status()
            except Exception:
                continue
            for v in status.versions:
                if v.lora_name == lora_name and v.lora_id:
                    out[eid] = v.lora_id
        return out

    # -------------------------------------------------------------------------- rollouts

    def rollout_func(
        self,
        *,
        env_turn: EnvTurn,
        max_new_tokens: int,
        assistant_turns: int = 2,
        ignore_eos: bool = False,
    ) -> Callable[[list[Any], Any], dict[str, list[Any]]]:
        """TRL's ``rollout_func(prompts, trainer)``: one session per completion, one session
        group per prompt, ``assistant_turns`` assistant turns with an environment turn between
        each two (``env_turn(prompt, assistant_turns_so_far) -> token ids``, sync or async:
        the tool's reply in the chat format, closing the assistant turn and opening the next)."""
        if assistant_turns < 1:
            raise ValueError("an episode has at least one assistant turn")

        def rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
            tok = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
            kwargs = getattr(trainer, "chat_template_kwargs", None) or {}
            prompt_ids = [encode_prompt(tok, p, kwargs) for p in prompts]
            params = sampling_params(trainer.args, max_new_tokens, ignore_eos=ignore_eos)
            step = int(trainer.state.global_step)
            batch = self._rollout_batch(prompts, prompt_ids, step, params, env_turn, assistant_turns)
            records = self.loop.call(batch, self.config.rollout_timeout_s)
            if self.config.keep_completions:
                self.completions.extend(records)
            fallback = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
            return rollout_output(records, int(fallback or 0))

        return rollout

    async def _rollout_batch(
        self,
        prompts: Sequence[Any],
        prompt_ids: Sequence[list[int]],
        step: int,
        params: Mapping[str, Any],
        env_turn: EnvTurn,
        turns: int,
    ) -> list[CompletionRecord]:
        groups = group_names(prompts, step)
        return list(
            await asyncio.gather(
                *(
                    self._episode(i, prompts[i], prompt_ids[i], groups[i], step, params, env_turn, turns)
                    for i in range(len(prompts))
                )
            )
        )

    async def _episode(
        self,
        index: int,
        prompt: Any,
        prompt_ids: list[int],
        group: str,
        step: int,
        params: Mapping[str, Any],
        env_turn: EnvTurn,
        turns: int,
    ) -> CompletionRecord:
        """One completion on one session, then its close. Never raises: a failure (a typed
        refusal, an unknown outcome, ``episode_timeout_s`` running out) is recorded in
        ``error``; the close aborts by rid whatever the episode still had in flight."""
        rec = CompletionRecord(step, self.rank.rank, index, group, "", list(prompt_ids), t_open=time.time())
        session = None
        try:
            async with asyncio.timeout(self.config.episode_timeout_s):
                session = await self.sessions.open(f"s{step}.r{self.rank.rank}.c{index}", group=group)
                rec.session = str(session.key)
                await self._turns(session, rec, prompt, params, env_turn, turns)
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            await self._close(session, rec)
        return rec

    async def _turns(
        self,
        session: Any,
        rec: CompletionRecord,
        prompt: Any,
        params: Mapping[str, Any],
        env_turn: EnvTurn,
        turns: int,
    ) -> None:
        """Assistant turn, environment turn, assistant turn, ...: every turn on the exact
        ``lora_path`` the session bound at its first generation, with the engine's log-probs."""
        history = list(rec.prompt_ids)
        for k in range(turns):
            if k:
                so_far = [list(s.ids) for s in rec.segments if s.is_model]
                env_ids = await _maybe_await(env_turn(prompt, so_far))
                rec.segments.append(Segment(tuple(int(t) for t in env_ids)))
                history += rec.segments[-1].ids
            # a copy: the session layer keeps the body it sent (a resend must send those very ids)
            body = {"input_ids": list(history), "sampling_params": dict(params), "return_logprob": True}
            reply = await session.generate(body)
            out = [int(t) for t in reply["output_ids"]]
            rec.segments.append(Segment(tuple(out), tuple(turn_logprobs(reply))))
            sent = session.requests[-1]  # what the session layer sent: rid, lora_path, engine
            cached = int((reply.get("meta_info") or {}).get("cached_tokens") or 0)
            rec.turns.append(
                TurnRecord(sent.rid, sent.lora_path, sent.engine_id, sent.outcome, len(out), cached)
            )
            history += out

    async def _close(self, session: Any, rec: CompletionRecord) -> None:
        if session is None:
            rec.t_close = time.time()
            return
        try:
            view = await session.close()
            rec.released = bool(view.released)
            if view.binding is not None:
                rec.bound_version = view.binding.lora_name
                rec.version_id = view.binding.version_key.version_id
        except Exception as exc:
            rec.error = ((rec.error or "") + f" close: {type(exc).__name__}: {exc}")[:500]
        rec.t_close = time.time()

    # ---------------------------------------------------------------------------- the end

    def registry_states(self) -> dict[str, str]:
        """Rank 0: every version of the epoch and its registry state (empty on other ranks)."""
        if self.publisher is None:
            return {}

        async def read() -> dict[str, str]:
            status = await self.publisher.registry.status()  # type: ignore[union-attr]
            return {v.lora_name: v.state.value for v in status.versions}

        return self.loop.call(read(), self.config.setup_timeout_s)

    def report(self) -> dict[str, Any]:
        """This rank's record of the run (JSON-able): the agreed outcomes, rank 0's publications,
        reclaims and registry states, this rank's episodes and the calls that did not succeed."""
        failed = [dataclasses.asdict(e) for e in self.audit_entries() if e.outcome != "ok"]
        return {
            "rank": self.rank.rank,
            "world_size": self.rank.world_size,
            "epoch": self.epoch,
            "config": {k: str(v) for k, v in dataclasses.asdict(self.config).items()},
            "outcomes": [o.to_wire() for o in self.outcomes],
            "publications": [
                {**dataclasses.asdict(p), "outcome": p.outcome.to_wire()} for p in self.publications
            ],
            "reclaims": [dataclasses.asdict(r) for r in self.reclaims],
            "completions": [c.summary() for c in self.completions],
            "failures": self.failures,
            "registry_states": self.registry_states(),
            "failed_requests": failed,
            "forbidden_calls": [dataclasses.asdict(e) for e in self.forbidden_calls()],
        }

    def audit_entries(self) -> list[Any]:
        """Every call of this rank's clients (engines directly, and the gateway)."""
        logs = {id(c.audit): c.audit for c in self.clients.values()}
        logs[id(self.gateway.client.audit)] = self.gateway.client.audit
        return [e for log in logs.values() for e in log.entries()]

    def forbidden_calls(self) -> list[Any]:
        """Pause, flush or abort-all calls in this rank's audit logs (there must be none)."""
        from relax_glue.engine_client import forbidden_calls

        logs = {id(c.audit): c.audit for c in self.clients.values()}
        logs[id(self.gateway.client.audit)] = self.gateway.client.audit
        return forbidden_calls(logs.values())

    def close(self) -> None:
        """Close the sessions and clients of this rank, stop its loop; then leave Ray (the
        process that started it stops it last, once every rank left)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.loop.call(self._aclose(), self.config.setup_timeout_s)
        finally:
            self.loop.close()
            _leave_ray(self.rank, self.ray)

    async def _aclose(self) -> None:
        await self.sessions.aclose()
        for c in self.clients.values():
            await c.aclose()
        await self.gateway.aclose()


class PublishingHooks:
    """Publishes ``step{global_step}`` at train begin (always synchronously: the first rollout
    needs a version) and after every optimizer step; every rank records the agreed outcome.
    TRL gets it as a ``transformers.TrainerCallback``: :func:`publishing_callback_class`."""

    def __init__(self, versions: GRPOVersions) -> None:
        self.versions = versions
        self._pending: tuple[int, concurrent.futures.Future[Any] | None] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self._publish(model, int(state.global_step), background=False, required=True)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self._join()
        self._publish(model, int(state.global_step), background=self.versions.config.background)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._join()
        v = self.versions
        if v.rank.is_main:
            # every episode has ended: unload what the last publications retired
            v.loop.call(v.reclaim("train end"), v.config.publish_timeout_s)

    def _publish(self, model: Any, step: int, *, background: bool, required: bool = False) -> None:
        v = self.versions
        future = v.submit_publication(model, step, required=required) if v.rank.is_main else None
        if background:
            self._pending = (step, future)
            return
        v.record(agree(v.settle(step, future) if future is not None else None, v.rank))

    def _join(self) -> None:
        """The background publication of the previous step: its outcome, agreed by every rank."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        v = self.versions
        v.record(agree(v.settle(step, future) if future is not None else None, v.rank))


@functools.cache
def publishing_callback_class() -> type:
    """``PublishingCallback``: :class:`PublishingHooks` as a ``transformers.TrainerCallback``,
    built at first use so that importing this module does not import transformers."""
    from transformers import TrainerCallback

    return type(
        "PublishingCallback", (PublishingHooks, TrainerCallback), {"__doc__": PublishingHooks.__doc__}
    )


# ============================================================================ the trainer side


def encode_prompt(tokenizer: Any, prompt: Any, chat_template_kwargs: Mapping[str, Any]) -> list[int]:
    """A TRL prompt as token ids: a message list through the chat template (with the generation
    prompt), a string as it is."""
    if isinstance(prompt, str):
        return [int(t) for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    ids = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, **dict(chat_template_kwargs)
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5: a BatchEncoding
    return [int(t) for t in ids]


def trainer_logprobs(
    trainer: Any, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
) -> list[list[float]]:
    """The log-probabilities TRL's loss computes for these completions with the trainer's current
    weights: its own padding (prompts left, completions right) and its own per-token function
    (``GRPOTrainer._get_per_token_logps_and_entropies``, trl 1.16.0), without gradients."""
    import torch
    from trl.trainer.utils import pad

    tok = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    device = trainer.accelerator.device
    p = [torch.tensor(list(x)) for x in prompt_ids]
    c = [torch.tensor(list(x)) for x in completion_ids]
    ids = torch.cat(
        [pad(p, tok.pad_token_id, padding_side="left"), pad(c, tok.pad_token_id, padding_side="right")], dim=1
    )
    ones = [torch.ones(len(x), dtype=torch.long) for x in (*p, *c)]
    mask = torch.cat(
        [pad(ones[: len(p)], 0, padding_side="left"), pad(ones[len(p) :], 0, padding_side="right")], dim=1
    )
    width = max(len(x) for x in completion_ids)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids.to(device), mask.to(device), width
        )
    return [logps[i, : len(x)].tolist() for i, x in enumerate(completion_ids)]


# ============================================================================== the plumbing


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _unwrap(model: Any) -> Any:
    """The PEFT model behind a DDP wrapper (TRL hands callbacks the unwrapped one already)."""
    import torch

    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


@dataclasses.dataclass(frozen=True)
class RayRole:
    started: bool = False  # this process started the local Ray cluster: it stops it, last
    joined: bool = False  # this process connected to it: it disconnects, first
    used: bool = False  # several processes share the Ray registry (every rank leaves together)


def _registry(
    rank: RankInfo, epoch: str, cohort: tuple[str, ...], config: VersionsConfig
) -> tuple[Any, RayRole]:
    """One process: an in-process registry. Several: the epoch's Ray actor, started by rank 0 on
    a local Ray cluster of its own (its address reaches the others in one broadcast) and joined
    by the other ranks. Returns the registry (or its client) and what this process did with Ray."""
    if rank.world_size == 1:
        from relax_glue.registry import LoRAVersionRegistry

        return LoRAVersionRegistry(epoch, cohort, capacity=config.capacity), RayRole()
    handle, started, joined, answer, token = None, False, False, {}, None
    if rank.is_main:
        try:
            handle, started, answer, token = _start_ray_registry(epoch, cohort, config)
        except Exception as exc:  # every rank learns it and raises: nobody waits for a registry
            answer = {"error": f"{type(exc).__name__}: {exc}"}
    answer = broadcast_from_main(answer, rank)
    if "error" in answer:
        raise RuntimeError(f"rank 0 could not start the registry actor: {answer['error']}")
    if not rank.is_main:
        handle, joined = _join_ray_registry(epoch, answer)
    from relax_glue.actor import AsyncRegistryClient

    # only rank 0 publishes: its client alone carries the publisher token (never broadcast)
    return AsyncRegistryClient.for_actor(handle, publisher_token=token), RayRole(started, joined, used=True)


def _start_ray_registry(
    epoch: str, cohort: tuple[str, ...], config: VersionsConfig
) -> tuple[Any, bool, dict, str]:
    import ray

    from relax_glue.actor import new_publisher_token, start_registry_actor

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=config.ray_num_cpus, include_dashboard=False, log_to_driver=False)
    # the handle is kept (by the client): a non-detached actor dies with its last handle
    token = new_publisher_token()
    handle = start_registry_actor(epoch, cohort, config.capacity, publisher_token=token)
    # Ray turns token auth on for a new local cluster (RAY_AUTH_MODE in this process only): the
    # other ranks must join in the same mode (the token itself: ~/.ray/auth_token, one host)
    answer = {"address": ray.get_runtime_context().gcs_address, "auth": os.environ.get(RAY_AUTH, "")}
    return handle, started, answer, token


def _join_ray_registry(epoch: str, answer: Mapping[str, str]) -> tuple[Any, bool]:
    # Ray reads its auth mode when it is imported: set it first
    if answer["auth"]:
        os.environ.setdefault(RAY_AUTH, answer["auth"])
    import ray

    from relax_glue.actor import get_registry_actor

    joined = not ray.is_initialized()
    if joined:
        ray.init(address=answer["address"], log_to_driver=False)
    return get_registry_actor(epoch), joined


async def _build(
    engines: Mapping[str, str],
    gateway_url: str,
    admin_key: str | None,
    registry: Any,
    rank: RankInfo,
    config: VersionsConfig,
    wrap: Callable[[Any], Any] | None,
) -> tuple[Any, Any, dict[str, Any], Any]:
    """The async stack, created on the loop it will run on."""
    from relax_glue.engine_client import EngineClient
    from relax_glue.gateway import GatewayClient
    from relax_glue.publisher import Publisher
    from relax_glue.sessions import SessionManager

    clients = {eid: EngineClient(eid, url, admin_key=admin_key) for eid, url in engines.items()}
    gateway = GatewayClient(gateway_url, clients)
    sessions = SessionManager(
        registry, clients, gateway=gateway, drain_timeout_s=10.0, lease_ttl_s=config.lease_ttl_s
    )
    publisher = None
    if rank.is_main:
        pub_clients = {eid: (wrap(c) if wrap is not None else c) for eid, c in clients.items()}
        publisher = Publisher(registry, pub_clients, reclaim_wait_s=1.0, reclaim_poll_s=0.05)
    return sessions, publisher, clients, gateway


def _leave_ray(rank: RankInfo, ray_role: RayRole) -> None:
    """The ranks that joined leave Ray first; the one that started the cluster stops it after a
    barrier. A Ray the user had started before is left as it was."""
    if not ray_role.used:
        return
    import ray

    if ray_role.joined:
        ray.shutdown()
    _barrier(rank)
    if ray_role.started:
        ray.shutdown()


def _barrier(rank: RankInfo, timeout_s: float = 60.0) -> None:
    import datetime

    import torch.distributed as dist

    if rank.world_size == 1 or not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":  # bounded: a rank that died fails the barrier, not hangs it
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
    else:
        dist.barrier()
