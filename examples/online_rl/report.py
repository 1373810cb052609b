"""What a run recorded, the checks over it, and how it is shown: the JSON report, the plot and
the printed tables.

:func:`check_invariants` and :func:`summarize` are pure functions of a :class:`RunRecord`; the
shell (``run.py``) only gathers the record (episodes, steps, publications, reclaims, slot
samples, audit logs, unload lines counted in the engine logs).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from examples.online_rl.rollout import Episode
from examples.online_rl.trainer import StepStats
from lora_contract.errors import ErrorCode
from relax_glue.step_publisher import PUBLISHED, SKIPPED, PublicationRecord, ReclaimRecord

CAPACITY_ERROR = ErrorCode.CAPACITY_ERROR.value  # the one refusal the policy answers


@dataclasses.dataclass
class SlotSample:
    t: float
    registry: int  # managed versions holding a slot, per the registry
    engines: dict[str, int]  # per engine, from its own status


@dataclasses.dataclass
class StepRecord:
    stats: StepStats
    t_start: float  # batch collection began
    t_end: float  # publication decided
    used: int
    dropped: int
    staleness: list[int]  # of the used episodes
    versions: dict[int, int]  # version -> used episodes
    publication: int  # index into RunRecord.publications


@dataclasses.dataclass
class RunRecord:
    config: dict[str, Any]
    capacity: int
    cohort: list[str]
    episodes: list[Episode]
    steps: list[StepRecord]
    publications: list[PublicationRecord]  # the step publisher's records
    reclaims: list[ReclaimRecord]
    slots: list[SlotSample]
    versions: dict[str, int]  # lora_name -> step, for every published version
    final_states: dict[str, str]  # lora_name -> registry state at the end
    unloads: dict[str, dict[str, int]]  # lora_name -> engine -> SGLang unload log lines of its lora_id
    failed_requests: list[dict[str, Any]]  # audit entries (generation and control) that did not succeed
    forbidden_calls: list[dict[str, Any]]  # pause / flush / abort-all (must stay empty)
    sessions_left: int  # sessions the session layer still held at the end
    max_staleness: int
    error: str | None = None  # the run stopped on an exception
    run_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Invariant:
    name: str
    ok: bool
    detail: Any = ""


# ---------------------------------------------------------------------------------- checks


def _episode_problems(ep: Episode, rollout: str, turns: int) -> list[str]:
    """Pinned: one session, bound once, every turn on its binding. Per-turn: one session per
    turn, each bound once, its turn on its binding. Both: the engine attested, for every token,
    the version its turn's session was bound to."""
    out = []
    if ep.error:
        out.append(f"ep{ep.index}: {ep.error}")
    if ep.bound_lora is None:
        out.append(f"ep{ep.index}: no binding")
    sessions = 1 if rollout == "pinned" else len(ep.turns)
    if ep.sessions != sessions or ep.bind_calls != sessions:
        out.append(f"ep{ep.index}: {ep.bind_calls} bind_first calls over {ep.sessions} sessions")
    if rollout == "pinned" and len({t.bound_lora for t in ep.turns}) > 1:
        out.append(f"ep{ep.index}: one session, several bindings")
    off = [t.rid for t in ep.turns if t.lora_path != t.bound_lora]
    if off:
        out.append(f"ep{ep.index}: turns {off} not on their session's binding")
    attested = [t.rid for t in ep.turns if set(t.served_by) != {t.bound_lora}]
    if attested:
        out.append(f"ep{ep.index}: turns {attested} attested as served by another version")
    if len(ep.turns) != turns and not ep.error:
        out.append(f"ep{ep.index}: {len(ep.turns)} turns")
    return out


def check_invariants(rec: RunRecord) -> list[Invariant]:
    out = [Invariant("the run finished", rec.error is None, rec.error or "")]
    rollout = rec.config.get("rollout", "pinned")
    turns = int(rec.config.get("assistant_turns", 2))
    bad = [p for ep in rec.episodes for p in _episode_problems(ep, rollout, turns)]
    out.append(
        Invariant(
            (
                "every turn of every episode carried the version the episode bound at its first generation,"
                if rollout == "pinned"
                else "every turn carried the version its own session bound (per-turn rollout),"
            )
            + " and the engine attested it ran that version for every token",
            not bad,
            bad[:5] or f"{len(rec.episodes)} episodes, {sum(len(e.turns) for e in rec.episodes)} turns",
        )
    )
    unreleased = [e.index for e in rec.episodes if not e.released]
    out.append(
        Invariant(
            "every episode's session was closed and released its ref",
            not unreleased and rec.sessions_left == 0,
            f"unreleased {unreleased[:5]}, left open {rec.sessions_left}"
            if unreleased or rec.sessions_left
            else "",
        )
    )
    refusals = collections.Counter(code for p in rec.publications for code in p.refusals)
    odd_pubs = [p.version_id for p in rec.publications if p.outcome not in (PUBLISHED, SKIPPED)]
    failed_eps = [e.index for e in rec.episodes if e.error]
    fine = not rec.failed_requests and not odd_pubs and set(refusals) <= {CAPACITY_ERROR} and not failed_eps
    out.append(
        Invariant(
            "no request failed; the only refusals were the policy's CAPACITY_ERROR",
            fine,
            {
                "refusals": dict(refusals),
                "failed_requests": rec.failed_requests[:5],
                "odd_publications": odd_pubs,
                "failed_episodes": failed_eps[:5],
            },
        )
    )
    out.append(
        Invariant("no pause, flush or abort-all call", not rec.forbidden_calls, rec.forbidden_calls[:5] or "")
    )
    unload_bad = {}
    for name, per_engine in rec.unloads.items():
        want = 1 if rec.final_states.get(name) == "RECLAIMED" else 0
        if any(per_engine.get(e) != want for e in rec.cohort):
            unload_bad[name] = {"want": want, **per_engine}
    n_reclaimed = sum(1 for s in rec.final_states.values() if s == "RECLAIMED")
    out.append(
        Invariant(
            "every reclaimed version was unloaded exactly once per engine (and no live one was unloaded)",
            not unload_bad and set(rec.unloads) == set(rec.versions),
            unload_bad or f"{n_reclaimed} reclaimed x {len(rec.cohort)} engines",
        )
    )
    live = sorted(n for n, s in rec.final_states.items() if s not in ("RECLAIMED",))
    out.append(
        Invariant(
            "reclaim kept up: at the end only the default still holds a slot",
            len(live) == 1 and rec.final_states.get(live[0]) == PUBLISHED,
            live,
        )
    )
    reg_max = max((s.registry for s in rec.slots), default=0)
    eng_max = max((n for s in rec.slots for n in s.engines.values()), default=0)
    out.append(
        Invariant(
            f"at most {rec.capacity} versions held slots (registry and every engine, sampled)",
            bool(rec.slots) and reg_max <= rec.capacity and eng_max <= rec.capacity,
            f"max {reg_max} (registry), {eng_max} (engines) over {len(rec.slots)} samples",
        )
    )
    used = [e for e in rec.episodes if e.fate == "used"]
    too_stale = [e.index for e in used if e.staleness is None or not 0 <= e.staleness <= rec.max_staleness]
    lag_max = max((p.lag_after for p in rec.publications), default=0)
    out.append(
        Invariant(
            f"staleness bounded: every used episode within {rec.max_staleness} steps, engines at most "
            f"{rec.max_staleness - 1} behind",
            not too_stale and lag_max <= rec.max_staleness - 1,
            f"too stale {too_stale[:5]}, max lag {lag_max}"
            if too_stale or lag_max >= rec.max_staleness
            else "",
        )
    )
    return out


# --------------------------------------------------------------------------------- figures


def _mean(xs: Sequence[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def reward_by_version(episodes: Sequence[Episode]) -> dict[int, dict[str, float]]:
    by: dict[int, list[float]] = collections.defaultdict(list)
    for e in episodes:
        if e.version is not None and not e.error:
            by[e.version].append(e.reward)
    return {v: {"mean": round(statistics.fmean(rs), 4), "episodes": len(rs)} for v, rs in sorted(by.items())}


REWARD_WINDOW = 3  # reward_first / reward_last, and the target-reward stop, average this many updates
TARGET_REWARD = 0.5  # updates_to_target without --until-reward


def target_reached(batch_rewards: list[float], target: float | None) -> bool:
    """Whether the last REWARD_WINDOW updates' mean batch reward (``reward_last``) reaches
    ``target`` (None: never)."""
    if target is None or len(batch_rewards) < REWARD_WINDOW:
        return False
    return statistics.fmean(batch_rewards[-REWARD_WINDOW:]) >= target


def updates_to_target(batch_rewards: Sequence[float], target: float) -> int | None:
    """The first update at which :func:`target_reached` held (where a run with
    ``--until-reward target`` would have stopped)."""
    rewards = list(batch_rewards)
    return next((n for n in range(1, len(rewards) + 1) if target_reached(rewards[:n], target)), None)


def spans_a_publication(ep: Episode, pubs: Sequence[PublicationRecord]) -> bool:
    """Whether a publication committed while the episode ran (its turns could change version)."""
    return any(p.outcome == PUBLISHED and ep.t_start < p.t_end < ep.t_end for p in pubs)


def summarize(rec: RunRecord, window: int = REWARD_WINDOW) -> dict[str, Any]:
    """The headline figures. ``reward_base``: mean reward of the episodes the base model (W_0,
    the zero LoRA) generated; ``reward_first`` / ``reward_last``: mean batch reward of the first /
    last ``window`` updates."""
    steps = [s.stats for s in rec.steps]
    by_version = reward_by_version(rec.episodes)
    used = [e for e in rec.episodes if e.fate == "used"]
    fates = collections.Counter(e.fate for e in rec.episodes)
    done = [e for e in rec.episodes if not e.error and e.turns]
    pubs = [p for p in rec.publications if p.step > 0]
    fresh_max = [s.fresh_abs_diff_max for s in steps if s.fresh_abs_diff_max is not None]
    fresh_mean = [s.fresh_abs_diff_mean for s in steps if s.fresh_abs_diff_mean is not None]
    stale_mean = [s.stale_abs_diff_mean for s in steps if s.stale_abs_diff_mean is not None]
    return {
        "reward_base": by_version.get(0, {}).get("mean"),
        "reward_first": _mean([s.reward_mean for s in steps[:window]]),
        "reward_last": _mean([s.reward_mean for s in steps[-window:]]),
        "reward_last_version": by_version[max(by_version)] | {"version": max(by_version)}
        if by_version
        else None,
        "reward_by_version": {str(k): v for k, v in by_version.items()},
        "updates": len(steps),
        "published": sum(p.outcome == PUBLISHED for p in pubs),
        "skipped": sum(p.outcome == SKIPPED for p in pubs),
        "capacity_refusals": sum(c == CAPACITY_ERROR for p in pubs for c in p.refusals),
        "published_after_waiting": sum(p.outcome == PUBLISHED and bool(p.refusals) for p in pubs),
        "max_wait_s": round(max((p.waited_s for p in pubs), default=0.0), 3),
        "reclaims": sum(r.done for r in rec.reclaims),
        "episodes": len(rec.episodes),
        "episodes_by_fate": dict(fates),
        "staleness_used": dict(sorted(collections.Counter(e.staleness for e in used).items())),
        "staleness_max_used": max((e.staleness or 0 for e in used), default=0),
        "staleness_dropped": dict(
            sorted(collections.Counter(e.staleness for e in rec.episodes if e.fate == "dropped").items())
        ),
        "mismatch_fresh_max": max(fresh_max, default=None),
        # not rounded: the serving mismatch lives around 1e-7..1e-6
        "mismatch_fresh_mean": statistics.fmean(fresh_mean) if fresh_mean else None,
        "policy_lag_stale_mean": statistics.fmean(stale_mean) if stale_mean else None,
        "slots_max_registry": max((s.registry for s in rec.slots), default=0),
        "slots_max_engine": max((n for s in rec.slots for n in s.engines.values()), default=0),
        "correction": rec.config.get("correction"),
        "stale_weight_mean": _mean([s.stale_weight_mean for s in steps if s.stale_weight_mean is not None]),
        "stale_weight_truncated": _mean(
            [s.stale_weight_truncated for s in steps if s.stale_weight_truncated is not None]
        ),
        # issue 40: what per-turn switching does to the episodes and to the estimator
        "rollout": rec.config.get("rollout", "pinned"),
        "batch_rewards": [round(s.reward_mean, 4) for s in steps],
        "updates_to_target": updates_to_target(
            [s.reward_mean for s in steps], rec.config.get("until_reward") or TARGET_REWARD
        ),
        "multi_version_share": _share(sum(len(e.versions) > 1 for e in done), len(done)),
        "spanning_publication_share": _share(
            sum(spans_a_publication(e, rec.publications) for e in done), len(done)
        ),
        "ratio_var": _mean([s.ratio_var for s in steps if s.ratio_var is not None]),
        "cut_share": _mean([s.cut_share for s in steps if s.cut_share is not None]),
        # not rounded: pinned, the gap is the serving mismatch (about 1e-6)
        "assumed_gap_mean": _fmean([s.assumed_gap_mean for s in steps if s.assumed_gap_mean is not None]),
        "switched_tokens": sum(s.switched_tokens for s in steps),
        "switched_gap_mean": _fmean([s.switched_gap_mean for s in steps if s.switched_gap_mean is not None]),
        "update_s": _mean([r.t_end - r.t_start for r in rec.steps]),
        # first turns: the prompt's tokens the engine found in its KV cache (a group's later
        # episodes on the engine that already prefilled that prompt)
        "first_turn_cache_share": _share(
            sum(e.turns[0].cached_tokens for e in rec.episodes if e.turns),
            sum(e.turns[0].input_len for e in rec.episodes if e.turns),
        ),
        "run_s": rec.run_s,
    }


def _fmean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def to_json(rec: RunRecord, invariants: Sequence[Invariant]) -> dict[str, Any]:
    def episode(e: Episode) -> dict[str, Any]:
        return {
            "index": e.index,
            "worker": e.worker,
            "prompt": e.prompt_index,
            "version": e.version,
            "bound_lora": e.bound_lora,
            "turn_lora_paths": [t.lora_path for t in e.turns],
            "versions": e.versions,
            "engines": [t.engine_id for t in e.turns],
            "reward": round(e.reward, 4),
            "fate": e.fate,
            "trainer_step": e.trainer_step,
            "staleness": e.staleness,
            "tool_latency_s": round(e.tool_latency_s, 3),
            "t_start": round(e.t_start, 3),
            "t_end": round(e.t_end, 3),
            "output_ids": [t.output_ids for t in e.turns],
            "error": e.error,
        }

    return {
        "ok": all(i.ok for i in invariants),
        "invariants": [dataclasses.asdict(i) for i in invariants],
        "summary": summarize(rec),
        "config": rec.config,
        "steps": [
            {
                **dataclasses.asdict(s.stats),
                "t_start": round(s.t_start, 3),
                "t_end": round(s.t_end, 3),
                "used": s.used,
                "dropped": s.dropped,
                "staleness": dict(sorted(collections.Counter(s.staleness).items())),
                "versions": {str(k): v for k, v in sorted(s.versions.items())},
                "publication": rec.publications[s.publication].outcome,
            }
            for s in rec.steps
        ],
        "publications": [dataclasses.asdict(p) for p in rec.publications],
        "reclaims": [dataclasses.asdict(r) for r in rec.reclaims],
        "slots": [dataclasses.asdict(s) for s in rec.slots],
        "versions": rec.versions,
        "final_states": rec.final_states,
        "unloads": rec.unloads,
        "episodes": [episode(e) for e in rec.episodes],
        "error": rec.error,
    }


# ---------------------------------------------------------------------------------- output


def step_row(s: StepRecord, pub: PublicationRecord) -> list[Any]:
    st = s.stats
    fresh = f"{st.fresh_abs_diff_max:.1e}" if st.fresh_abs_diff_max is not None else "-"
    lag = f"{st.stale_abs_diff_mean:.3f}" if st.stale_abs_diff_mean is not None else "-"
    decision = pub.outcome
    if pub.refusals:
        decision += f" after {len(pub.refusals)}x CAPACITY_ERROR, {pub.waited_s:.2f}s"
    return [
        st.step,
        f"{st.reward_mean:.3f}",
        s.used,
        s.dropped,
        " ".join(f"v{v}:{n}" for v, n in sorted(s.versions.items())),
        max(s.staleness, default=0),
        f"{st.loss:+.3f}",
        fresh,
        lag,
        f"{pub.version_id} {decision}",
    ]


# (header, width): rows are printed one at a time as the updates happen, so the widths are fixed.
STEP_COLUMNS: tuple[tuple[str, int], ...] = (
    ("step", 4),
    ("reward", 6),
    ("used", 4),
    ("dropped", 7),
    ("versions used", 18),
    ("stale max", 9),
    ("loss", 6),
    ("mismatch fresh max", 18),
    ("lag stale mean", 14),
    ("publication", 0),
)


def step_line(cells: Sequence[Any]) -> str:
    return "  " + "  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, STEP_COLUMNS, strict=True)).rstrip()


def step_header() -> str:
    return step_line([h for h, _ in STEP_COLUMNS])


def plot(rec: RunRecord, path: Path) -> None:
    """One PNG, six panels: reward, staleness, publications and reclaims in time, slots in use,
    the logprob mismatch, and how long each publication waited."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(18, 9.5))
    steps = [s.stats for s in rec.steps]
    by_version = reward_by_version(rec.episodes)

    a = ax[0, 0]
    a.plot([s.step for s in steps], [s.reward_mean for s in steps], "o-", label="batch mean (update t)")
    a.plot(
        list(by_version),
        [v["mean"] for v in by_version.values()],
        "s--",
        alpha=0.7,
        label="episodes of version v",
    )
    if 0 in by_version:
        a.axhline(by_version[0]["mean"], color="grey", ls=":", label="base model (v0)")
    a.set(
        title="reward",
        xlabel="update t / version v",
        ylabel="mean reward (share of digit tokens)",
        ylim=(-0.02, 1.02),
    )
    a.legend(loc="center right", fontsize=8)

    a = ax[0, 1]
    used = collections.Counter((e.trainer_step + 1, e.version) for e in rec.episodes if e.fate == "used")
    dropped = collections.Counter(
        (e.trainer_step + 1, e.version) for e in rec.episodes if e.fate == "dropped"
    )
    for pts, style, label in ((used, "o", "used"), (dropped, "x", "dropped (too stale)")):
        if pts:
            xs, ys = zip(*pts, strict=True)
            a.scatter(xs, ys, s=[8 + 6 * n for n in pts.values()], marker=style, label=label)
    xs = [s.step for s in steps]
    a.plot(xs, [x - 1 for x in xs], "g-", lw=0.8, label="on-policy (version = t-1)")
    a.plot(
        xs,
        [x - 1 - rec.max_staleness for x in xs],
        "r:",
        lw=0.8,
        label=f"bound (staleness {rec.max_staleness})",
    )
    a.set(title="staleness: version of each episode vs update", xlabel="update t", ylabel="episode's version")
    a.legend(loc="upper left", fontsize=8)

    a = ax[0, 2]
    reclaimed_at = {r.lora_name: r.t_end for r in rec.reclaims if r.done}
    end = max([rec.run_s, *(s.t for s in rec.slots)], default=0.0)
    for p in rec.publications:
        if p.outcome == PUBLISHED and p.lora_name:
            a.hlines(p.step, p.t_end, reclaimed_at.get(p.lora_name, end), color="tab:blue", alpha=0.35, lw=3)
            a.plot(p.t_end, p.step, "^", color="tab:green", ms=5)
        elif p.outcome == SKIPPED:
            a.plot(p.t_end, p.step, "x", color="tab:orange", ms=7)
    refused = [(p.t_start, p.step) for p in rec.publications if p.refusals]
    if refused:
        a.plot(*zip(*refused, strict=True), "|", color="tab:red", ms=10, label="CAPACITY_ERROR")
    rs = [(r.t_end, r.step) for r in rec.reclaims if r.done and r.step is not None]
    if rs:
        a.plot(*zip(*rs, strict=True), "v", color="tab:purple", ms=5, label="reclaimed")
    a.plot([], [], "^", color="tab:green", label="published")
    a.plot([], [], "x", color="tab:orange", label="skipped")
    a.set(title="publications and reclaims (bar: version alive)", xlabel="time (s)", ylabel="version")
    a.legend(loc="upper left", fontsize=8)

    a = ax[1, 0]
    ts = [s.t for s in rec.slots]
    a.step(ts, [s.registry for s in rec.slots], where="post", label="registry", lw=2)
    for eid in rec.cohort:
        a.step(ts, [s.engines.get(eid, 0) for s in rec.slots], where="post", label=eid, alpha=0.7, ls="--")
    a.axhline(rec.capacity, color="red", ls=":", label=f"capacity {rec.capacity}")
    a.set(
        title="managed versions holding slots",
        xlabel="time (s)",
        ylabel="slots in use",
        ylim=(0, rec.capacity + 1),
    )
    a.legend(loc="lower right", fontsize=8)

    a = ax[1, 1]
    f = [
        (s.step, s.fresh_abs_diff_max, s.fresh_abs_diff_mean)
        for s in steps
        if s.fresh_abs_diff_max is not None
    ]
    g = [(s.step, s.stale_abs_diff_mean) for s in steps if s.stale_abs_diff_mean is not None]
    if f:
        a.semilogy([x[0] for x in f], [max(x[1], 1e-9) for x in f], "o-", label="same weights: max |diff|")
        a.semilogy([x[0] for x in f], [max(x[2], 1e-9) for x in f], "o:", label="same weights: mean |diff|")
    if g:
        a.semilogy(
            [x[0] for x in g],
            [max(x[1], 1e-9) for x in g],
            "s-",
            label="stale episodes: mean |diff| (policy lag)",
        )
    a.set(
        title="trainer vs engine log-prob of sampled tokens",
        xlabel="update t",
        ylabel="|log p_trainer - log p_engine|",
    )
    a.set_ylim(1e-9, 1e2)
    a.legend(loc="upper right", fontsize=8)

    a = ax[1, 2]
    pubs = [p for p in rec.publications if p.step > 0]
    colors = [
        "tab:orange" if p.outcome == SKIPPED else "tab:red" if p.refusals else "tab:green" for p in pubs
    ]
    xs = [p.step for p in pubs]
    waits = [p.waited_s for p in pubs]
    a.bar(xs, waits, color=colors)
    a.bar(xs, [p.publish_s or 0.0 for p in pubs], bottom=waits, color="tab:grey", alpha=0.6)
    a.plot([], [], "s", color="tab:green", label="published at once")
    a.plot([], [], "s", color="tab:red", label="waited: CAPACITY_ERROR until a reclaim")
    a.plot([], [], "s", color="tab:orange", label="waited, then skipped")
    a.plot([], [], "s", color="tab:grey", alpha=0.6, label="the publication (reserve .. commit)")
    top = max((w + (p.publish_s or 0.0) for w, p in zip(waits, pubs, strict=True)), default=1.0)
    a.set_ylim(0, 1.45 * top)  # room for the legend above the bars
    a.set(title="backpressure: time to each publication decision", xlabel="step", ylabel="seconds")
    a.legend(loc="upper left", fontsize=8)

    from matplotlib.ticker import MaxNLocator

    for a in (ax[0, 0], ax[0, 1], ax[1, 1], ax[1, 2]):
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    for a in (ax[0, 1], ax[0, 2], ax[1, 0]):
        a.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(
        f"online RL on CPU: {len(steps)} updates, {rec.config.get('workers')} workers, "
        f"{len(rec.cohort)} engines behind smg, seed {rec.config.get('seed')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
