"""The wiring: two CPU engines with the plugin and the smg gateway (started as the lifecycle demo
starts them), the real trainer-side stack (registry, publisher, session layer through the
gateway, engine clients), the trainer, the rollout workers, the reclaimer and a slot sampler.

The loop, for update ``t = 1..steps`` (the trainer holds ``W_{t-1}``)::

    collect a batch: episodes from the queue, admitted by the staleness policy (others dropped)
    one update in a thread (rollouts keep going)                     -> W_t
    snapshot W_t, publish it as version step{t}; on CAPACITY_ERROR follow the policy
    (reclaim + retry within a bounded wait, else skip; past the lag bound, wait)

``W_0`` (the zero LoRA: exactly the base model) is published as ``step0`` before the workers
start. Publication, backpressure and reclaims are the step publisher's
(:mod:`relax_glue.step_publisher`, the driver every trainer integration uses): every closed
episode wakes its background reclaim, which unloads a retired version as soon as no session
holds it. At the end the workers finish their episodes, the last reclaim runs, and the
invariants are checked over everything recorded.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from examples.online_rl import report as rp
from examples.online_rl.config import RunConfig
from examples.online_rl.policy import StalenessPolicy
from examples.online_rl.rollout import Episode, RolloutPool
from examples.online_rl.task import QUESTIONS, Task, build_task
from examples.online_rl.trainer import Sample, Trainer
from lora_versions_demo.local_cohort import local_cohort, run_reporting
from lora_versions_dev.engine_log import await_unload_lines
from relax_glue.cli import table
from relax_glue.step_publisher import FAILED, PublicationRecord, StepPublisher

EPOCH = "onlinerl"
COLLECT_TIMEOUT_S = 300.0  # no episode for this long: the rollouts are stuck, stop the run


def version_id(step: int, tag: str = "") -> str:
    return f"{tag}step{step}"


@dataclasses.dataclass
class Stack:
    """The trainer-side stack over one cohort: one registry epoch, its publisher, the session
    layer through the gateway, the engine clients. One run owns one; the runs of a study
    (bench/why_pin.py) share one, each naming its versions and sessions with its own tag."""

    engines: dict[str, Any]
    cohort: list[str]
    reg: Any
    clients: dict[str, Any]
    pub: Any
    gw: Any
    sm: Any

    @classmethod
    def open(
        cls, engines: Sequence[Any], gateway_url: str, admin_key: str, capacity: int, epoch: str = EPOCH
    ) -> Stack:
        from relax_glue.cohort import open_publisher
        from relax_glue.engine_client import EngineClient
        from relax_glue.gateway import GatewayClient
        from relax_glue.registry import LoRAVersionRegistry
        from relax_glue.sessions import SessionManager

        cohort = [e.name for e in engines]
        reg = LoRAVersionRegistry(epoch, tuple(cohort), capacity=capacity)
        clients = {e.name: EngineClient(e.name, e.url, admin_key=admin_key) for e in engines}
        pub = open_publisher(reg, clients, reclaim_wait_s=1.0, reclaim_poll_s=0.05)
        # Generation goes through the gateway (routing key = session key); control calls go to
        # each engine directly.
        gw = GatewayClient(gateway_url, clients)
        sm = SessionManager(reg, clients, gateway=gw, drain_timeout_s=10.0)
        return cls({e.name: e for e in engines}, cohort, reg, clients, pub, gw, sm)

    @property
    def audit_logs(self) -> list[Any]:
        return [c.audit for c in self.clients.values()] + [self.gw.client.audit]

    async def aclose(self) -> None:
        await self.sm.aclose()
        for c in self.clients.values():
            await c.aclose()
        await self.gw.aclose()


class OnlineRL:
    def __init__(self, cfg: RunConfig, stack: Stack, model_dir: Path, tag: str = "") -> None:
        self.cfg = cfg
        self.tag = tag  # prefix of this run's version ids and session keys
        self.stack = stack
        self.engines, self.cohort = stack.engines, stack.cohort
        self.reg, self.clients, self.pub = stack.reg, stack.clients, stack.pub
        self.gw, self.sm = stack.gw, stack.sm
        self.policy = StalenessPolicy(cfg.max_staleness, cfg.reclaim_wait_s, cfg.forced_wait_s)
        # what the shared audit logs held before this run: its checks read only its own calls
        self.audit_from = [lg.total for lg in stack.audit_logs]  # the last seq each log gave out
        self.task: Task = build_task(model_dir, cfg.tokens_per_turn)
        self.trainer = Trainer(model_dir, rank=cfg.rank, lr=cfg.lr, seed=cfg.seed)
        self.batch_size = cfg.group_size * len(self.task.prompts)
        self.t0 = time.monotonic()
        # publication under backpressure, the reclaims and their records
        self.publishing = StepPublisher(self.pub, self.policy, clock=self.clock)
        self.stopping = asyncio.Event()  # the slot sampler ends at its next turn
        self.pool = RolloutPool(
            self.sm,
            self.task,
            cfg,
            self.clock,
            queue_size=self.batch_size,
            on_closed=lambda _: self.publishing.episode_closed(),
            key_prefix=tag,
        )
        self.versions = self.publishing.versions  # lora_name -> step, for every published version
        self.slots: list[rp.SlotSample] = []
        self.steps: list[rp.StepRecord] = []
        self.lora_ids: dict[str, dict[str, str]] = collections.defaultdict(dict)

    def clock(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ publication

    async def publish(self, step: int) -> PublicationRecord:
        """Publish W_step as version step{step}, following the policy on CAPACITY_ERROR."""
        snapshot = self.trainer.snapshot()  # frozen now: the next update cannot change it
        vid = version_id(step, self.tag)
        pub = await self.publishing.publish_step(snapshot, step, vid, required=step == 0)
        if pub.outcome == FAILED:
            raise RuntimeError(f"{vid}: no slot freed within {self.cfg.forced_wait_s}s")
        return pub

    # -------------------------------------------------------------------- sampling

    async def sample(self) -> None:

        t = self.clock()
        statuses = await asyncio.gather(*(c.status() for c in self.clients.values()), return_exceptions=True)
        engines = {}
        for eid, st in zip(self.clients, statuses, strict=True):
            if isinstance(st, BaseException):
                continue  # a status that did not come back is not a sample
            engines[eid] = sum(1 for v in st.versions if v.state.holds_slot)
            for v in st.versions:
                if v.lora_id:
                    self.lora_ids[v.lora_name][eid] = v.lora_id
        self.slots.append(rp.SlotSample(round(t, 3), self.reg.status().slots_used, engines))

    async def sample_forever(self) -> None:
        while not self.stopping.is_set():
            await self.sample()
            await asyncio.sleep(self.cfg.sample_every_s)

    # ----------------------------------------------------------------------- training

    async def collect(self, trainer_step: int) -> tuple[list[Episode], list[Episode]]:
        used: list[Episode] = []
        dropped: list[Episode] = []
        failed = 0
        while len(used) < self.batch_size:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
            # (Ctrl-C) that arrives just as the queue hands an episode over
            async with asyncio.timeout(COLLECT_TIMEOUT_S):
                ep = await self.pool.get()
            if ep.error:
                failed += 1  # counted by the invariants; a run of failures means the stack is down
                if failed > self.batch_size:
                    raise RuntimeError(f"{failed} episodes failed while collecting a batch: {ep.error}")
                continue
            # each turn's tokens attested as served by that turn's binding (the session layer
            # refused anything else): pinned, one version per episode; per-turn, one per turn
            off = [t.rid for t in ep.turns if set(t.served_by) != {t.bound_lora}]
            if off or ep.bound_lora not in self.versions:
                ep.error, ep.fate = f"turns {off} attested another version than bound", "failed"
                failed += 1
                continue
            # the episode's version: pinned, its binding; per-turn, its first turn's, as TRL
            # dates a group by the version current when it started (and admits it by that)
            ep.version = self.versions[ep.bound_lora or ""]
            ep.trainer_step = trainer_step
            ep.staleness = self.policy.staleness(trainer_step, ep.version)
            if self.policy.admits(trainer_step, ep.version):
                ep.fate = "used"
                used.append(ep)
            else:
                ep.fate = "dropped"
                dropped.append(ep)
        return used, dropped

    def token_staleness(self, ep: Episode) -> list[int]:
        """Per assistant token, the staleness of the version the engine attested it ran."""
        step = ep.trainer_step or 0
        return [self.policy.staleness(step, self.versions[v or ""]) for v in ep.token_versions]

    def samples(self, episodes: Sequence[Episode]) -> list[Sample]:
        return [
            Sample(
                tuple(e.tokens),
                tuple(e.assistant_spans()),
                tuple(e.engine_logprobs),
                e.reward,
                e.prompt_index,
                e.staleness or 0,
                # per token, the staleness of the version the engine attested it ran
                tuple(self.token_staleness(e)),
                e.version,
            )
            for e in episodes
        ]

    async def train(self) -> None:
        first = await self.publish(0)
        if first.outcome != rp.PUBLISHED:
            raise RuntimeError(f"the initial version was not published: {first}")
        # W_0 is published before any worker starts: no episode meets "nothing published yet".
        self.pool.start()
        try:
            print(rp.step_header(), flush=True)
            for t in range(1, self.cfg.steps + 1):
                await self.one_update(t)
                if rp.target_reached([s.stats.reward_mean for s in self.steps], self.cfg.until_reward):
                    break
        finally:
            # The workers finish their episodes (each closes its session); what is still queued
            # was never trained on.
            for ep in await self.pool.shutdown():
                ep.fate = "failed" if ep.error else "unused"

    async def one_update(self, t: int) -> None:
        t_start = self.clock()
        used, dropped = await self.collect(self.trainer.step)
        stats = await asyncio.to_thread(
            self.trainer.train_step,
            self.samples(used),
            self.cfg.correction,
            self.cfg.tis_cap,
            self.cfg.trl_epsilon,
        )
        pub = await self.publish(t)
        rec = rp.StepRecord(
            stats,
            round(t_start, 3),
            round(self.clock(), 3),
            len(used),
            len(dropped),
            [e.staleness or 0 for e in used],
            dict(collections.Counter(e.version or 0 for e in used)),
            len(self.publishing.publications) - 1,
        )
        self.steps.append(rec)
        print(rp.step_line(rp.step_row(rec, pub)), flush=True)

    async def run(self) -> rp.RunRecord:
        error = None
        await self.sample()
        self.publishing.start()  # reclaims as episodes close
        background = [asyncio.create_task(self.sample_forever(), name="slot-sampler")]
        try:
            await self.train()
        except Exception as exc:  # report it; still stop everything cleanly and check what ran
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.stopping.set()
            await asyncio.gather(*background)
        # every session is closed now: the last reclaim takes every retired version
        await self.publishing.close()
        await self.sample()
        final = {v.lora_name: v.state.value for v in self.reg.status().versions}
        unloads = await self.count_unloads(final)
        # this run's calls only (a study's runs share the logs); a log shared by clients once
        logs = {id(lg): (lg, n) for lg, n in zip(self.stack.audit_logs, self.audit_from, strict=True)}
        mine = [e for lg, n in logs.values() for e in lg.entries() if e.seq > n]
        # Every call that did not succeed, generation and control alike (a reclaim that
        # answered DRAINING succeeded: it is a typed progress reply, recorded as ok).
        failed = [dataclasses.asdict(e) for e in mine if e.outcome != "ok"]
        forbidden = [dataclasses.asdict(e) for lg, n in logs.values() for e in lg.forbidden() if e.seq > n]
        sessions_left = len(self.sm.sessions)
        return rp.RunRecord(
            config=dataclasses.asdict(self.cfg),
            capacity=self.reg.status().capacity,
            cohort=list(self.cohort),
            episodes=sorted(self.pool.episodes, key=lambda e: e.index),
            steps=self.steps,
            publications=self.publishing.publications,
            reclaims=self.publishing.reclaims,
            slots=self.slots,
            versions=dict(self.versions),
            final_states=final,
            unloads=unloads,
            failed_requests=failed,
            forbidden_calls=forbidden,
            sessions_left=sessions_left,
            max_staleness=self.cfg.max_staleness,
            error=error,
            run_s=round(self.clock(), 2),
        )

    async def count_unloads(self, final: dict[str, str]) -> dict[str, dict[str, int]]:
        """SGLang's "unloading starts" log lines of each version's engine-local lora_id."""
        out: dict[str, dict[str, int]] = {}
        for name in self.versions:
            want = 1 if final.get(name) == "RECLAIMED" else 0
            out[name] = {}
            for eid in self.cohort:
                lora_id = self.lora_ids.get(name, {}).get(eid)
                if lora_id is None:
                    out[name][eid] = -1  # never seen on that engine: the check fails, as it should
                    continue
                out[name][eid] = await await_unload_lines(
                    self.engines[eid].log_path, lora_id, expect=want, timeout_s=10.0
                )
        return out


# ------------------------------------------------------------------------------ entry point


def run_online_rl(cfg: RunConfig, out_dir: Path, *, as_json: bool = False) -> int:
    """Run it; ``as_json``: the tables go to stderr and the report to stdout. Exit code 0 only
    when every invariant held."""
    return run_reporting(lambda: _main(cfg, out_dir), out_dir / "report.json", as_json=as_json)


def _main(cfg: RunConfig, out_dir: Path) -> int:
    with local_cohort(out_dir, cfg.engines, "online-rl") as lc:
        print(
            f"[online-rl] {cfg.steps} updates"
            + (f" at most (until the reward reaches {cfg.until_reward})" if cfg.until_reward else "")
            + f", {cfg.workers} workers, batch {cfg.group_size} x "
            f"{len(QUESTIONS)} prompts, max staleness {cfg.max_staleness}, seed {cfg.seed}"
        )
        record = asyncio.run(_run(cfg, lc.engines, lc.gateway_url, lc.admin_key, lc.fixtures.model_dir))
    invariants = rp.check_invariants(record)
    doc = rp.to_json(record, invariants)
    doc["engine_start_s"] = lc.engine_start_s
    doc["engine_logs"] = {e: str(out_dir / f"{e}.log") for e in lc.ids}
    (out_dir / "report.json").write_text(json.dumps(doc, indent=2, default=str))
    rp.plot(record, out_dir / "online_rl.png")
    print_summary(doc, out_dir)
    return 0 if doc["ok"] else 1


async def _run(
    cfg: RunConfig, engines: Sequence[Any], gateway_url: str, admin_key: str, model_dir: Path
) -> rp.RunRecord:
    stack = Stack.open(engines, gateway_url, admin_key, cfg.capacity)
    try:
        return await OnlineRL(cfg, stack, model_dir).run()
    finally:
        await stack.aclose()


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def print_summary(doc: dict[str, Any], out_dir: Path) -> None:
    s = doc["summary"]
    print("\n[online-rl] reward of the episodes each version generated:")
    rows = [[f"v{v}", r["episodes"], f"{r['mean']:.3f}"] for v, r in s["reward_by_version"].items()]
    print(table(["version", "episodes", "mean reward"], rows))
    figures = [
        ["reward: base model (v0) -> last updates", f"{s['reward_base']} -> {s['reward_last']}"],
        [
            "publications: published / skipped / after a wait",
            f"{s['published']} / {s['skipped']} / {s['published_after_waiting']}",
        ],
        ["CAPACITY_ERROR refusals (backpressure)", s["capacity_refusals"]],
        ["reclaims (each: one unload per engine)", s["reclaims"]],
        ["episodes by fate", s["episodes_by_fate"]],
        ["staleness of used episodes (max)", f"{s['staleness_used']} ({s['staleness_max_used']})"],
        ["staleness of dropped episodes", s["staleness_dropped"]],
        [
            "logprob mismatch, same weights (max / mean |diff|)",
            f"{_e(s['mismatch_fresh_max'])} / {_e(s['mismatch_fresh_mean'])}",
        ],
        ["policy lag, stale episodes (mean |diff|)", _e(s["policy_lag_stale_mean"])],
        ["slots in use, max (registry / engine)", f"{s['slots_max_registry']} / {s['slots_max_engine']}"],
        [
            f"off-policy correction: {s['correction']} (stale tokens: mean weight / truncated)",
            f"{s['stale_weight_mean']} / {s['stale_weight_truncated']}",
        ],
        ["first turns: prompt tokens from the KV cache (groups)", s["first_turn_cache_share"]],
    ]
    print(table(["figure", "value"], figures))
    print("\n[online-rl] invariants:")
    for inv in doc["invariants"]:
        detail = f"  ({inv['detail']})" if inv["detail"] not in ("", None, [], {}) else ""
        print(f"  [{'ok' if inv['ok'] else 'FAIL'}] {inv['name']}{detail}")
    verdict = "ALL INVARIANTS HELD" if doc["ok"] else "SOME INVARIANTS FAILED"
    print(
        f"\n[online-rl] {verdict} in {s['run_s']}s; "
        f"report {out_dir / 'report.json'}, plot {out_dir / 'online_rl.png'}"
    )
