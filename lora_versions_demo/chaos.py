"""A seeded chaos campaign on real engines (issue 9): faults at random phases of publication and
reclaim, recovery by the protocol alone, and invariants checked at the end.

The stack is the real one: two CPU SGLang engines E0/E1 with the plugin (own process groups),
the registry as a durable Ray actor (SQLite journal; Ray restarts it when its process dies), the
publisher with an on-disk snapshot store, the reconciler, and sessions whose recovery hook runs
the reconciler. Faults are injected into the real components:

* ``kill_begin`` / ``kill_buckets`` / ``kill_end`` / ``kill_before_commit``: SIGKILL of one
  engine's whole process group right before the publisher's Nth call of that phase reaches it
  (:class:`~lora_versions_dev.fault_injection.FaultInjectingClient` hook), then the engine is
  started again on the same port (a new incarnation that holds nothing);
* ``kill_reclaim_drain``: SIGKILL of an engine while its reclaim answers DRAINING (a request
  admitted before the reclaim keeps the version in flight);
* ``drop_reply``: the Nth reply of one engine call is processed and then lost;
* ``kill_registry``: SIGKILL of the registry actor's process mid-publication; Ray reopens the
  database and replays the journal. The trainer restarts too: a fresh Publisher that knows only
  the registry and the snapshot store finishes the attempt.

Each round: every open session takes a turn (its full history as the prefix), sessions of the
retired version close, retired versions are reclaimed, new sessions bind the default, the next
version is published under the round's fault, the cluster is recovered (resolve, reclaim,
reconcile until settled), and every open session takes another turn. At the end:

1. no commit without a fresh READY status read of the attempt from every cohort engine;
2. every turn equals the HF transformers + PEFT reference of its bound version with the full
   prefix, or ended with a typed error (LoraVersionError / OutcomeUnknown) -- never another
   version, never the base model;
3. no native in-flight count left above 0 (and none unreadable, which a count below 0 would be);
4. no physical unload of one load twice, and every reclaimed version unloaded exactly once on
   each engine incarnation that held it at reclaim time;
5. no snapshot-store entry for a dead version;
6. a fresh publication succeeds at the end (capacity recovered) and serves its reference.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import re
import secrets
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lora_contract.names import MANAGED_CAPACITY
from lora_contract.protocol import EngineVersionState
from lora_versions_demo.lifecycle import PROMPTS, TOOL_IDS
from lora_versions_dev.engine_log import UNLOAD_LOG_LINE
from relax_glue.publisher import PublishOutcome
from relax_glue.registry_types import VersionState

FAULT_KINDS = (
    "kill_begin",
    "kill_buckets",
    "kill_end",
    "kill_before_commit",
    "kill_reclaim_drain",
    "drop_reply",
    "kill_registry",
)
COHORT = ("E0", "E1")
ADAPTERS = ("A", "B", "C")
TURN_TOKENS = 6
# The request that keeps a retired version in flight through its reclaim: long enough to outlast
# the first reclaim call's wait and reach the second (the kill), far below the context (2048).
DRAIN_TOKENS = 1200
_UNLOAD_RE = re.compile(rf"{UNLOAD_LOG_LINE}: .*?lora_id='?([0-9a-f]+)")


class ChaosEngines:
    """The cohort's engines (plugin on, control behind one admin key), for one campaign or for
    several in turn (the test runs its short campaigns on one pair): every incarnation of each
    engine has its own log, which the campaigns' unload checks read."""

    def __init__(self, out_dir: Path) -> None:
        self.out = out_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.admin_key = secrets.token_hex(16)
        self.engines: dict[str, Any] = {}
        self.logs: dict[str, list[Path]] = {e: [] for e in COHORT}

    def spec(self, name: str, port: int | None) -> Any:
        from lora_versions_dev.fixtures import ensure_fixtures
        from lora_versions_dev.launcher import EngineSpec

        log = self.out / f"{name}.{len(self.logs[name])}.log"
        self.logs[name].append(log)
        return EngineSpec(
            name=name,
            model_path=ensure_fixtures().model_dir,
            log_path=log,
            extra_args=["--admin-api-key", self.admin_key],
            port=port,
        )

    def spawn(self) -> None:
        """Start the engines and return at once (a test session boots them early); :meth:`start`
        waits until they serve."""
        from lora_versions_dev.launcher import spawn_engine

        if not self.engines:
            for n in COHORT:
                self.engines[n] = spawn_engine(self.spec(n, None))

    def start(self) -> None:
        from lora_versions_dev.launcher import start_engines

        if not self.engines:
            for e in start_engines([self.spec(n, None) for n in COHORT]):  # each waited for
                self.engines[e.name] = e
            return
        for e in self.engines.values():  # spawned, or left by an earlier campaign: serving
            e.wait_healthy(e.spec.startup_timeout_s)

    def stop(self) -> None:
        from lora_versions_dev.launcher import stop_engine

        for e in self.engines.values():
            stop_engine(e)
        self.engines.clear()

    async def purge(self) -> None:
        """Remove every managed version an earlier campaign left on the engines, through their
        own protocol (a later campaign starts with its capacity free)."""
        from lora_versions_dev.teardown import purge
        from relax_glue.engine_client import EngineClient

        clients = {n: EngineClient(n, e.url, admin_key=self.admin_key) for n, e in self.engines.items()}
        try:
            left = await purge(clients, marker="")
        finally:
            for c in clients.values():
                await c.aclose()
        if left:
            raise RuntimeError(f"an earlier campaign's versions could not be removed: {left}")


def _greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


@dataclasses.dataclass
class ChaosConfig:
    seed: int = 9
    faults: int = 30
    max_s: float = 3600.0
    out_dir: Path = Path(".runs/chaos")
    recover_s: float = 420.0  # bound on one recovery (an engine restart included)
    kinds: tuple[str, ...] = FAULT_KINDS  # drawn in seeded shuffled blocks of these
    # Session turns keep running during the publication and the recovery, so requests meet the
    # fault itself (a killed engine, a version not restored yet): each must end with its
    # reference tokens or a typed error.
    overlap: bool = False
    # "collective": the buckets go over each engine's gloo group (relax_glue.collective_sender),
    # so the engine kills meet a broadcast and a group that a restart made unusable
    transport: str = "http"
    # engines shared with other campaigns (started when needed, purged first, left running);
    # None: the campaign starts its own and stops them at the end
    engines: ChaosEngines | None = None
    # the epoch's capacity K: sessions of the K-1 newest versions stay open across rounds, so up
    # to K versions are live when a fault hits (the engines have 5 slots: K <= 4)
    capacity: int = MANAGED_CAPACITY


@dataclasses.dataclass
class TurnRecord:
    session: str
    engine: str
    lora_path: str | None
    prefix: list[int]
    tokens: list[int] | None
    error: str | None = None  # "refused:<CODE>" or "unknown: ..." for a typed failure


@dataclasses.dataclass
class FaultRecord:
    round: int
    kind: str
    target: str
    injected: bool = False
    survived: bool = False
    detail: str = ""
    recover_s: float = 0.0


class Campaign:
    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.out = cfg.out_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.pool = cfg.engines if cfg.engines is not None else ChaosEngines(self.out)
        self.owns_engines = cfg.engines is None
        self.admin_key = self.pool.admin_key
        self.epoch = f"chaos{cfg.seed}x{secrets.token_hex(3)}"
        self.engines = self.pool.engines
        self.first_log: dict[str, int] = {}  # per engine: its first incarnation in this campaign
        self.restarting: dict[str, asyncio.Task[Any]] = {}
        self.turns: list[TurnRecord] = []
        self.faults: list[FaultRecord] = []
        self.violations: list[str] = []
        self.status_log: list[tuple[float, str, Any]] = []  # (t, engine, EngineStatus) publisher reads
        self.commits: list[tuple[float, Any, Any]] = []  # (t, kwargs, receipt)
        self.reserves: dict[str, float] = {}  # attempt token -> time of reserve
        self.status_5xx: list[str] = []
        self.history: dict[str, list[int]] = {}
        self.sessions: dict[str, Any] = {}
        self.next_vid = 0
        self.published: list[str] = []  # lora names, in the order they were committed
        self.max_live = 0  # the most versions live (published or retired) seen before a round
        self.adapter_of: dict[str, str] = {}  # lora_name -> fixture adapter
        self.reclaimed_on: dict[str, dict[str, str | None]] = {}  # lora_name -> engine -> lora_id
        self.t0 = time.monotonic()

    # ------------------------------------------------------------------------ engines

    @property
    def incarnation_logs(self) -> dict[str, list[Path]]:
        """The logs of the incarnations this campaign used, per engine (earlier campaigns' not)."""
        return {n: logs[self.first_log.get(n, 0) :] for n, logs in self.pool.logs.items()}

    def _spec(self, name: str, port: int | None) -> Any:
        return self.pool.spec(name, port)

    def start_engines(self) -> None:
        from lora_versions_dev.fixtures import ensure_fixtures

        self.fx = ensure_fixtures()
        reused = bool(self.pool.engines)
        self.pool.start()
        if reused:
            asyncio.run(self.pool.purge())
        self.first_log = {n: len(logs) - 1 for n, logs in self.pool.logs.items()}

    def stop_engines(self) -> None:
        if self.owns_engines:
            self.pool.stop()

    async def kill_engine(self, name: str) -> None:
        """SIGKILL the engine's whole process group now, start it again in the background."""
        from lora_versions_dev.launcher import spawn_engine, stop_engine

        old = self.engines[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(old.proc.wait, 60)
        stop_engine(old)  # reaps leftovers of the group, if any

        async def restart() -> None:
            new = await asyncio.to_thread(spawn_engine, self._spec(name, old.port))
            self.engines[name] = new
            await asyncio.to_thread(new.wait_healthy, 300.0)

        self.restarting[name] = asyncio.ensure_future(restart())

    async def engines_up(self) -> None:
        for name, task in list(self.restarting.items()):
            await task
            del self.restarting[name]

    # ----------------------------------------------------------------------- trainer

    async def setup(self) -> None:
        import ray

        from lora_versions_dev.fault_injection import FaultInjectingClient
        from relax_glue.actor import AsyncRegistryClient, new_publisher_token, start_registry_actor
        from relax_glue.engine_client import EngineClient
        from relax_glue.sessions import SessionManager
        from relax_glue.snapshot import Snapshot
        from relax_glue.snapshot_store import SnapshotStore

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        token = new_publisher_token()  # this process publishes: its client carries the token
        self.actor = start_registry_actor(
            self.epoch,
            COHORT,
            self.cfg.capacity,
            db_path=self.out / f"{self.epoch}.db",
            publisher_token=token,
        )
        self.registry = AsyncRegistryClient.for_actor(
            self.actor, retries=3, retry_delay_s=0.2, publisher_token=token
        )
        self._record_registry(self.registry)
        from relax_glue.bucket_transport import CollectiveTransport

        def transport() -> CollectiveTransport | None:
            return CollectiveTransport() if self.cfg.transport == "collective" else None

        self.clients = {
            n: EngineClient(n, e.url, admin_key=self.admin_key, transport=transport())
            for n, e in self.engines.items()
        }
        self.wrapped = {n: FaultInjectingClient(c) for n, c in self.clients.items()}
        self.recorded = {n: _StatusRecorder(w, self) for n, w in self.wrapped.items()}
        self.store = SnapshotStore(self.out / "snapshots")
        self.pub = self.new_publisher()
        self.sm = SessionManager(
            self.registry,
            self.clients,
            drain_timeout_s=5.0,
            not_ready_wait_s=20.0,
            resend_interval_s=0.5,
            on_version_missing=self._restore_hook,
        )
        self.snaps = {
            a: Snapshot.from_peft_dir(self.fx.adapter_dir(a), max_bucket_bytes=16 * 1024) for a in ADAPTERS
        }

    def new_publisher(self) -> Any:
        from relax_glue.cohort import open_publisher

        return open_publisher(
            self.registry,
            self.recorded,
            reclaim_wait_s=0.5,
            reclaim_poll_s=0.1,
            reclaim_deadline_s=20.0,
            store=self.store,
        )

    def _record_registry(self, client: Any) -> None:
        """Record every commit and reserve the publisher makes (for the commit-evidence check)."""
        commit, reserve = client.commit, client.reserve

        async def recorded_commit(**kw: Any) -> Any:
            t = time.monotonic()
            receipt = await commit(**kw)
            self.commits.append((t, kw, receipt))
            return receipt

        async def recorded_reserve(**kw: Any) -> Any:
            t = time.monotonic()
            res = await reserve(**kw)
            self.reserves.setdefault(res.attempt_token, t)
            return res

        client.commit, client.reserve = recorded_commit, recorded_reserve

    async def _restore_hook(self, engine_id: str, lora_path: str) -> None:
        from relax_glue.actor import RegistryUnavailable

        with contextlib.suppress(RegistryUnavailable):
            await self.pub.reconcile([engine_id])

    async def kill_registry(self) -> None:
        import ray

        desc = await self.actor.describe.remote()
        os.kill(int(desc["pid"]), signal.SIGKILL)
        # Ray restarts the actor (max_restarts=-1): the journal is replayed in the new process.
        _ = ray  # the handle stays valid across the restart

    # -------------------------------------------------------------------------- turns

    async def turn(self, label: str) -> None:
        from lora_contract.errors import LoraVersionError
        from relax_glue.actor import RegistryUnavailable
        from relax_glue.engine_client import OutcomeUnknown

        s = self.sessions[label]
        prefix = list(self.history[label])
        engine = self.sm.router.pick(s.key)
        for rid in s.unknown_turns:
            # The rollout's decision on an earlier turn whose outcome was unknown (RFC 4.2): give
            # it up (aborted by rid) and ask again with the same history below.
            with contextlib.suppress(OutcomeUnknown):
                await s.discard(rid)
        try:
            out = await s.generate({"input_ids": prefix, "sampling_params": _greedy(TURN_TOKENS)})
        except LoraVersionError as err:
            self.turns.append(
                TurnRecord(label, engine, s.lora_path, prefix, None, f"refused:{err.code.value}")
            )
            return
        except OutcomeUnknown as exc:
            self.turns.append(
                TurnRecord(label, engine, s.lora_path, prefix, None, f"unknown: {exc.cause[:120]}")
            )
            return
        except RegistryUnavailable as exc:  # the first bind could not reach the registry
            self.turns.append(TurnRecord(label, engine, s.lora_path, prefix, None, f"registry: {exc.op}"))
            return
        tokens = list(out["output_ids"])
        self.turns.append(TurnRecord(label, engine, s.lora_path, prefix, tokens))
        self.history[label] = [*prefix, *tokens, *TOOL_IDS]

    async def open_sessions(self, n: int) -> None:
        for _ in range(n):
            label = f"s{len(self.history)}"
            self.sessions[label] = await self.sm.open(label)
            self.history[label] = list(PROMPTS[len(self.history) % len(PROMPTS)])
            await self.turn(label)

    async def traffic(self) -> None:
        for label in list(self.sessions):
            await self.turn(label)

    async def close_retired_sessions(self) -> None:
        """Close the sessions of every version but the K-1 newest live ones (K = 2: all but the
        default's), so the next publication finds a free slot once they are reclaimed."""
        st = await self.registry.status()
        live = {v.lora_name for v in st.versions if v.state in (VersionState.PUBLISHED, VersionState.RETIRED)}
        self.max_live = max(self.max_live, len(live))
        newest = [n for n in reversed(self.published) if n in live and n != st.default_lora_name]
        keep = {st.default_lora_name, *newest[: self.cfg.capacity - 2]}
        for label, s in list(self.sessions.items()):
            if s.lora_path is None or s.lora_path not in keep:
                with contextlib.suppress(Exception):
                    await s.close()
                del self.sessions[label]

    # ------------------------------------------------------------------------- rounds

    def schedule(self) -> list[str]:
        kinds: list[str] = []
        while len(kinds) < self.cfg.faults:
            block = list(self.cfg.kinds)
            self.rng.shuffle(block)
            kinds.extend(block)
        return kinds[: self.cfg.faults]

    async def publish_next(self) -> Any:
        adapter = ADAPTERS[self.next_vid % len(ADAPTERS)]
        vid = f"v{self.next_vid}"
        self.next_vid += 1
        snap = self.snaps[adapter]
        name = snap.lora_name(self.pub.prefix, self.epoch, vid)
        self.adapter_of[name] = adapter
        res = await self.pub.publish(snap, vid)
        if res.outcome is PublishOutcome.PUBLISHED:
            self.published.append(name)
        return res

    async def round(self, n: int, kind: str) -> None:
        from relax_glue.actor import RegistryUnavailable

        fault = FaultRecord(n, kind, "")
        self.faults.append(fault)
        await self.traffic()
        await self.close_retired_sessions()
        if kind == "kill_reclaim_drain":
            await self._reclaim_with_kill(fault)
            # this round's fault is the reclaim: recover from it before the publication
            t = time.monotonic()
            fault.survived = await self.recover()
            fault.recover_s = round(time.monotonic() - t, 1)
        else:
            with contextlib.suppress(RegistryUnavailable):
                await self.pub.reclaim_ready()
        await self.open_sessions(2)
        seen = {e: len(w.injected) for e, w in self.wrapped.items()}
        stop = asyncio.Event()
        background = asyncio.ensure_future(self._traffic_until(stop)) if self.cfg.overlap else None
        try:
            if kind != "kill_reclaim_drain":
                self._arm(fault)
            res = await self.publish_next()
            fault.detail += f" publish={res.outcome.value}"
        except RegistryUnavailable as exc:
            fault.detail += f" publish=RegistryUnavailable({exc.op})"
        for e, w in self.wrapped.items():
            fault.injected = fault.injected or len(w.injected) > seen[e]
            w.disarm()  # a fault whose call never came is not injected later by surprise
        t = time.monotonic()
        survived = await self.recover()
        if kind != "kill_reclaim_drain":
            fault.survived, fault.recover_s = survived, round(time.monotonic() - t, 1)
        elif not survived:
            fault.survived = False
        if background is not None:
            stop.set()
            await background
        await self.traffic()

    async def _traffic_until(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.traffic()
            await asyncio.sleep(0.2)

    def _arm(self, fault: FaultRecord) -> None:
        engine = self.rng.choice(COHORT)
        w = self.wrapped[engine]
        fault.target = engine
        op = {
            "kill_begin": "begin",
            "kill_buckets": "receive_bucket",
            "kill_end": "end",
            "kill_before_commit": "status",
        }.get(fault.kind)
        if op is not None:
            buckets = len(self.snaps[ADAPTERS[self.next_vid % len(ADAPTERS)]].bucket_plan)
            nth = w.calls[op] + 1 + (self.rng.randrange(buckets) if op == "receive_bucket" else 0)

            async def kill() -> None:
                fault.injected = True
                await self.kill_engine(engine)

            w.before_send(op, nth, kill)
            fault.detail = f"{op}#{nth}"
        elif fault.kind == "drop_reply":
            op = self.rng.choice(("begin", "receive_bucket", "end", "status"))
            w.drop_reply(op, w.calls[op] + 1)
            fault.detail = f"{op}#{w.calls[op] + 1}"
        elif fault.kind == "kill_registry":
            op = self.rng.choice(("begin", "end"))

            async def kill_registry() -> None:
                fault.injected = True
                await self.kill_registry()
                self.pub = self.new_publisher()  # the trainer restarts too: memory gone, store kept

            w.before_send(op, w.calls[op] + 1, kill_registry)
            fault.target = "registry"
            fault.detail = f"before {engine}.{op}"

    async def _reclaim_with_kill(self, fault: FaultRecord) -> None:
        """A request admitted on the retired version keeps it in flight, so reclaim answers
        DRAINING; the engine is killed at its second reclaim call (mid-drain).

        Fires whatever came before: a round with no reclaimable version (the first round, or one
        after a publication that did not commit) publishes one first, and the reclaim starts
        only once the target engine counts the long request in flight."""
        from relax_glue.actor import RegistryUnavailable

        retired = await self._reclaimable()
        if not retired:
            res = await self.publish_next()  # retires the default; its sessions close below
            await self.close_retired_sessions()
            retired = await self._reclaimable()
            fault.detail = f"published {res.outcome.value} to retire one; "
        engine = self.rng.choice(COHORT)
        fault.target = engine
        long_req = None
        if retired:
            name = retired[0].lora_name
            body = {
                "input_ids": list(PROMPTS[0]),
                "sampling_params": _greedy(DRAIN_TOKENS),
                "lora_path": name,
            }
            long_req = asyncio.ensure_future(
                self.clients[engine].generate({**body, "rid": f"drain-{name[-12:]}"})
            )
            fault.detail += f"in_flight={await self._await_in_flight(engine, name)} "
        w = self.wrapped[engine]

        async def kill() -> None:
            fault.injected = True
            await self.kill_engine(engine)

        w.before_send("reclaim", w.calls["reclaim"] + 2, kill)
        fault.detail += f"retired={len(retired)}"
        try:
            with contextlib.suppress(RegistryUnavailable):
                res = await self.pub.reclaim_ready()
                fault.detail += " " + ",".join(
                    f"{r.version_key.version_id}:{ {e: str(o) for e, o in r.engines.items()} }" for r in res
                )
        finally:
            w.disarm()  # a kill whose call never came must not fire in a later reclaim by surprise
        if long_req is not None:
            with contextlib.suppress(Exception):
                await long_req  # killed mid-decode: OutcomeUnknown, as it must be

    async def _reclaimable(self) -> list[Any]:
        st = await self.registry.status()
        return [v for v in st.versions if v.state is VersionState.RETIRED and v.session_refs == 0]

    async def _await_in_flight(self, engine: str, lora_name: str, timeout_s: float = 30.0) -> int:
        """The engine's native in-flight count of ``lora_name`` once it is above 0 (the request
        admitted), or the last count read when ``timeout_s`` ran out."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = await self.clients[engine].version_status(lora_name)
            n = status.in_flight or 0
            if n > 0 or time.monotonic() > deadline:
                return n
            await asyncio.sleep(0.05)

    async def recover(self) -> bool:
        """Resolve, reclaim and reconcile until nothing is pending, unknown or missing."""
        from relax_glue.actor import RegistryUnavailable
        from relax_glue.reconciler import RestoreOutcome

        deadline = time.monotonic() + self.cfg.recover_s
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self.engines_up(), max(1.0, deadline - time.monotonic()))
            except TimeoutError:
                return False
            try:
                st = await self.registry.status()
                if st.pending_attempt is not None:
                    await self.pub.resolve()
                await self.pub.reclaim_ready()
                restored = await self.pub.reconcile()
                st = await self.registry.status()
            except RegistryUnavailable:
                await asyncio.sleep(1.0)
                continue
            settled = (
                st.pending_attempt is None
                and not st.unknown_outcomes
                and all(v.state is not VersionState.RECLAIMING for v in st.versions)
                and all(r.outcome is RestoreOutcome.HELD for r in restored)
            )
            if settled:
                return True
            await asyncio.sleep(1.0)
        return False

    # ---------------------------------------------------------------------- invariants

    async def check(self) -> dict[str, Any]:
        from lora_versions_dev.reference import greedy_tokens

        counts: dict[str, Any] = {"max_live_versions": self.max_live}
        if self.max_live > self.cfg.capacity:
            self.violations.append(f"{self.max_live} versions live at once, capacity {self.cfg.capacity}")
        # 1. commit evidence
        bad_commits = []
        st = await self.registry.status()
        cohort = tuple(st.engines)
        first_commit: dict[str, tuple[float, Any]] = {}
        for t, kw, receipt in self.commits:
            first_commit.setdefault(kw["attempt_token"], (t, receipt))
        for token, (t, receipt) in first_commit.items():
            start = self.reserves.get(token, 0.0)
            for engine in cohort:
                fresh = [
                    s
                    for (ts, e, s) in self.status_log
                    if e == engine
                    and start <= ts <= t
                    and any(
                        v.lora_name == receipt.lora_name
                        and v.state is EngineVersionState.READY_LOCAL
                        and v.attempt_token == token
                        and v.incarnation == s.incarnation
                        for v in s.versions
                    )
                ]
                if not fresh:
                    bad_commits.append(f"{receipt.lora_name} committed without a fresh READY from {engine}")
        counts["commits"] = len(first_commit)
        counts["commit_without_evidence"] = len(bad_commits)
        self.violations.extend(bad_commits)

        # 2. every turn: its version's reference, or a typed error
        wrong, typed_errors, served = [], 0, 0
        for tr in self.turns:
            if tr.tokens is None:
                typed_errors += 1
                continue
            served += 1
            adapter = self.adapter_of.get(tr.lora_path or "")
            if adapter is None:
                wrong.append(f"{tr.session}: served under unknown lora_path {tr.lora_path}")
                continue
            ref = await asyncio.to_thread(
                greedy_tokens, self.fx.model_dir, self.fx.adapter_dir(adapter), tr.prefix, TURN_TOKENS
            )
            if ref != tr.tokens:
                wrong.append(f"{tr.session} on {tr.engine} ({adapter}): {tr.tokens} != reference {ref}")
        counts["turns_served"] = served
        counts["turns_typed_error"] = typed_errors
        counts["turns_wrong"] = len(wrong)
        self.violations.extend(wrong)

        # 3. in-flight counts
        left = []
        for name, c in self.clients.items():
            status = await c.status()
            left.extend(
                f"{name}:{v.lora_name}={v.in_flight}" for v in status.versions if (v.in_flight or 0) > 0
            )
        counts["in_flight_left"] = len(left)
        counts["status_5xx"] = len(self.status_5xx)
        self.violations.extend(f"in flight left {x}" for x in left)
        self.violations.extend(f"status unreadable: {x}" for x in self.status_5xx)

        # 4. unloads: never twice per load; once per reclaimed version on a live incarnation
        twice = []
        for logs in self.incarnation_logs.values():
            for log in logs:
                ids = collections.Counter(_UNLOAD_RE.findall(log.read_text(errors="replace")))
                twice.extend(f"{log.name}: lora_id {i} unloaded {n} times" for i, n in ids.items() if n > 1)
        missing = []
        for name, c in self.clients.items():
            status = await c.status()
            log = self.incarnation_logs[name][-1]
            ids = collections.Counter(_UNLOAD_RE.findall(log.read_text(errors="replace")))
            for v in status.versions:
                if self.epoch not in v.lora_name:
                    continue  # an earlier campaign's, on shared engines (its own check read it)
                if v.state is EngineVersionState.UNLOADED and v.lora_id and ids.get(v.lora_id, 0) != 1:
                    missing.append(
                        f"{name}: {v.lora_name} ({v.lora_id}) unloaded {ids.get(v.lora_id, 0)} times"
                    )
        counts["unloaded_twice"] = len(twice)
        counts["unload_not_once"] = len(missing)
        counts["reclaimed"] = sum(1 for v in st.versions if v.state is VersionState.RECLAIMED)
        self.violations.extend(twice + missing)

        # 5. snapshot store
        from relax_glue.snapshot_store import live_digests

        dead = sorted(self.store.digests() - live_digests(st))
        counts["store_dead_entries"] = len(dead)
        self.violations.extend(f"store keeps dead digest {d}" for d in dead)

        # 6. a fresh publication at the end, served exactly
        await self.close_retired_sessions()
        await self.pub.reclaim_ready()
        res = await self.publish_next()
        ok = res.outcome is PublishOutcome.PUBLISHED
        if ok:
            await self.open_sessions(1)
            last = self.turns[-1]
            adapter = self.adapter_of[last.lora_path or ""]
            ref = await asyncio.to_thread(
                greedy_tokens, self.fx.model_dir, self.fx.adapter_dir(adapter), last.prefix, TURN_TOKENS
            )
            ok = last.tokens == ref and last.lora_path == res.lora_name
        counts["final_publication_ok"] = ok
        if not ok:
            self.violations.append(f"final publication: {res.outcome.value} {res.error}")
        return counts

    # ------------------------------------------------------------------------------ run

    async def run(self) -> dict[str, Any]:
        await self.setup()
        res = await self.publish_next()
        if res.outcome is not PublishOutcome.PUBLISHED:
            raise RuntimeError(f"the first publication failed: {res}")
        deadline = self.t0 + self.cfg.max_s
        for n, kind in enumerate(self.schedule(), 1):
            if time.monotonic() > deadline:
                break
            t = time.monotonic()
            await self.round(n, kind)
            f = self.faults[-1]
            print(
                f"[chaos] round {n:>2} {kind:<19} target={f.target:<8} injected={f.injected!s:<5} "
                f"survived={f.survived!s:<5} recover={f.recover_s:>5.1f}s "
                f"round={time.monotonic() - t:>5.1f}s "
                f"{f.detail.strip()}",
                flush=True,
            )
            if not f.survived:
                self.violations.append(f"round {n} ({kind}) did not recover within {self.cfg.recover_s}s")
                break
        counts = await self.check()
        await self.sm.close_all()
        return counts

    async def aclose(self) -> None:
        for c in self.clients.values():
            await c.aclose()


class _StatusRecorder:
    """The publisher's view of one engine: every status reply it reads is recorded with its
    time (the commit-evidence check replays them); a 5xx on status from a live engine is noted."""

    def __init__(self, inner: Any, campaign: Campaign) -> None:
        self.inner = inner
        self.engine_id = inner.engine_id
        self._c = campaign

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def status(self) -> Any:
        from relax_glue.engine_client import OutcomeUnknown

        try:
            s = await self.inner.status()
        except OutcomeUnknown as exc:
            if exc.status_code is not None and exc.status_code >= 500 and exc.status_code != 503:
                self._c.status_5xx.append(f"{self.engine_id}: {exc.cause[:200]}")
            raise
        self._c.status_log.append((time.monotonic(), self.engine_id, s))
        return s


def run_campaign(cfg: ChaosConfig) -> dict[str, Any]:
    """Start the engines, run the campaign, stop everything; returns the report (also written
    to ``<out_dir>/chaos.json``)."""
    from relax_glue.bucket_transport import CollectiveTransport

    camp = Campaign(cfg)
    t0 = time.monotonic()
    camp.start_engines()
    report: dict[str, Any] = {"seed": cfg.seed, "faults_planned": cfg.faults}
    try:
        counts = asyncio.run(_run(camp))
        report["invariants"] = counts
    except Exception as exc:  # still report what happened
        camp.violations.append(f"campaign aborted: {type(exc).__name__}: {exc}")
        report["invariants"] = {}
    finally:
        camp.stop_engines()
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
    injected = [f for f in camp.faults if f.injected]
    report.update(
        {
            "faults_injected": len(injected),
            "faults_survived": sum(f.survived for f in injected),
            "by_kind": dict(collections.Counter(f.kind for f in injected)),
            "violations": camp.violations,
            "faults": [dataclasses.asdict(f) for f in camp.faults],
            "duration_s": round(time.monotonic() - t0, 1),
            "engine_restarts": {e: len(logs) - 1 for e, logs in camp.incarnation_logs.items()},
            "transport": cfg.transport,
            # groups the trainer connected per engine (collective: one per engine incarnation used)
            "collective_connects": {
                n: c.transport.sender.connects
                for n, c in getattr(camp, "clients", {}).items()
                if isinstance(c.transport, CollectiveTransport)
            },
        }
    )
    (cfg.out_dir / "chaos.json").write_text(json.dumps(report, indent=2, default=str))
    return report


async def _run(camp: Campaign) -> dict[str, Any]:
    try:
        return await camp.run()
    finally:
        await camp.aclose()


def print_report(report: dict[str, Any]) -> None:
    rows: Sequence[tuple[str, Any]] = [
        ("seed", report["seed"]),
        ("faults injected", report["faults_injected"]),
        ("faults survived", report["faults_survived"]),
        ("by kind", report["by_kind"]),
        ("engine restarts", report["engine_restarts"]),
        *((k, v) for k, v in report.get("invariants", {}).items()),
        ("invariant violations", len(report["violations"])),
        ("duration", f"{report['duration_s']} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    for v in report["violations"][:20]:
        print(f"  VIOLATION: {v}")
