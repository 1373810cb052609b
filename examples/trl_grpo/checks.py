"""The checks over a TRL run, pure functions of what every rank recorded (``GRPOVersions.report()``
plus the probes, one JSON document per rank) and of the unload lines counted in the engine logs.
The example prints them; ``tests/trainer_tests/test_trl_grpo_engines.py`` asserts each by name."""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Report = Mapping[str, Any]  # one rank's document


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: Any = ""


def main_report(reports: Sequence[Report]) -> Report:
    return next(r for r in reports if r["rank"] == 0)


def completions(reports: Sequence[Report]) -> list[Mapping[str, Any]]:
    return [c for r in reports for c in r["completions"]]


def turns_on_one_version(reports: Sequence[Report], turns: int = 2) -> Check:
    """Every completion ran all its turns, each on the version its session bound (as sent, and as
    the engine attested it ran), and released its session's ref at close."""
    bad = []
    for c in completions(reports):
        paths = {t["lora_path"] for t in c["turns"]}
        served = {v for t in c["turns"] for v in t["served"]}
        one = paths == served == {c["bound_version"]}
        if c["error"] or len(c["turns"]) != turns or not one or not c["released"]:
            bad.append({k: c[k] for k in ("rank", "step", "index", "error", "bound_version", "released")})
    n = len(completions(reports))
    return Check(
        "every completion's turns carried one and the same bound version", n > 0 and not bad, bad[:3] or n
    )


def rewards_received_versions(reports: Sequence[Report]) -> Check:
    """On every rank, the reward functions got, for each completion in order, the exact version
    its rollout bound, that version alone as what the engines attested they ran, and the same
    completion tokens."""
    bad = []
    for r in reports:
        rolled, rewarded = r["rollout_calls"], r["reward_calls"]
        if len(rolled) != len(rewarded):
            bad.append({"rank": r["rank"], "rollouts": len(rolled), "reward_calls": len(rewarded)})
            continue
        for ro, rw in zip(rolled, rewarded, strict=True):
            same = (ro["bound_version"], ro["completion_ids"]) == (rw["bound_version"], rw["completion_ids"])
            attested = rw["served_versions"] == [[v] for v in rw["bound_version"]]
            if not same or not attested or None in rw["bound_version"]:
                bad.append({"rank": r["rank"], "step": ro["step"]})
    calls = sum(len(r["reward_calls"]) for r in reports)
    return Check(
        "the reward functions received each completion's bound version", calls > 0 and not bad, bad or calls
    )


def ranks_agree(reports: Sequence[Report]) -> Check:
    outcomes = [r["outcomes"] for r in reports]
    same = all(o == outcomes[0] for o in outcomes)
    return Check("every rank recorded the same publication outcomes", same, [len(o) for o in outcomes])


def one_outcome_per_step(
    outcomes: Sequence[Mapping[str, Any]], steps: int, failures: Mapping[int, str]
) -> Check:
    """Steps 0..steps each have exactly one outcome: a new version (a name never seen before), a
    skip after capacity backpressure, or the failure expected at that step (``failures``)."""
    bad = []
    by_step = collections.Counter(o["step"] for o in outcomes)
    if sorted(by_step) != list(range(steps + 1)) or set(by_step.values()) != {1}:
        bad.append({"outcomes per step": dict(by_step)})
    names = [o["lora_name"] for o in outcomes if o["kind"] == "PUBLISHED"]
    if len(set(names)) != len(names):
        bad.append({"names repeated": names})
    for o in outcomes:
        expected = failures.get(o["step"])
        ok = {
            "PUBLISHED": expected is None and o["lora_name"],
            "SKIPPED": expected is None and o["code"] == "CAPACITY_ERROR",
            "FAILED": expected is not None and o["code"] == expected,
        }[o["kind"]]
        if not ok:
            bad.append({k: o[k] for k in ("step", "kind", "code", "detail")})
    kinds = collections.Counter(o["kind"] for o in outcomes)
    return Check(
        "each step published one new version (or a counted skip, or the expected failure)",
        not bad,
        bad or dict(kinds),
    )


def retired_unloaded_once(
    reports: Sequence[Report], unloads: Mapping[str, Mapping[str, int]], cohort: Sequence[str]
) -> Check:
    """Every published version but the last is RECLAIMED and was unloaded exactly once on every
    engine; the last is still the live default, never unloaded."""
    main = main_report(reports)
    published = [o["lora_name"] for o in main["outcomes"] if o["kind"] == "PUBLISHED"]
    states = main["registry_states"]
    bad = {}
    for i, name in enumerate(published):
        last = i == len(published) - 1
        want_state, want_n = ("PUBLISHED", 0) if last else ("RECLAIMED", 1)
        got = {e: unloads.get(name, {}).get(e) for e in cohort}
        if states.get(name) != want_state or any(n != want_n for n in got.values()):
            bad[name] = {"state": states.get(name), "unloads": got, "want": [want_state, want_n]}
    detail = bad or f"{len(published) - 1} retired versions x {len(cohort)} engines, one unload each"
    return Check(
        "every retired version was unloaded exactly once per engine", bool(published) and not bad, detail
    )


def reclaimed_after_last_close(reports: Sequence[Report]) -> Check:
    """The reclaim that unloaded a version started after the last session bound to it closed
    (on every rank: wall clocks of one host)."""
    last_close: dict[str, float] = {}
    for c in completions(reports):
        name = c["bound_version"]
        last_close[name] = max(last_close.get(name, 0.0), c["t_close"])
    bad = [
        {"version": r["version_id"], "reclaim_start": r["t_start"], "last_close": last_close[r["lora_name"]]}
        for r in main_report(reports)["reclaims"]
        if r["done"] and r["lora_name"] in last_close and r["t_start"] < last_close[r["lora_name"]]
    ]
    done = sum(1 for r in main_report(reports)["reclaims"] if r["done"])
    return Check(
        "each reclaim began after the version's last session closed", done > 0 and not bad, bad or done
    )


def no_pause_flush_abort_all(reports: Sequence[Report]) -> Check:
    bad = [c for r in reports for c in r["forbidden_calls"]]
    return Check("no pause, flush or abort-all call in any audit log", not bad, bad[:3])


def only_expected_failed_requests(reports: Sequence[Report], expected: Sequence[str] = ()) -> Check:
    """No generation failed; the control calls that did not succeed are exactly ``expected``
    (each ``engine:op:outcome``, e.g. an injected refusal)."""
    failed = sorted(
        f"{e['engine_id']}:{e['op']}:{e['outcome']}" for r in reports for e in r["failed_requests"]
    )
    return Check("no request failed except the injected fault", failed == sorted(expected), failed)


def same_weights_logprobs(reports: Sequence[Report], tolerance: float) -> Check:
    """Completions sampled by the trainer's own weights: the trainer's log-probability of each
    model token equals the engine's within fp32 noise."""
    diffs = [
        d
        for r in reports
        for call in r["rollout_calls"]
        for per in call["same_weights_diff"]
        if per is not None
        for d in per
    ]
    worst = max(diffs, default=None)
    ok = worst is not None and worst <= tolerance
    detail = {"tokens": len(diffs), "max": worst, "mean": statistics.fmean(diffs) if diffs else None}
    return Check(
        f"trainer and engine log-probabilities agree within {tolerance:g} on the same weights", ok, detail
    )


def rewards_by_step(reports: Sequence[Report]) -> dict[int, float]:
    """The mean reward of each step's completions, over every rank."""
    by_step: dict[int, list[float]] = collections.defaultdict(list)
    for r in reports:
        for call in r["reward_calls"]:
            by_step[call["step"]].extend(call["rewards"])
    return {s: statistics.fmean(v) for s, v in sorted(by_step.items())}


def staleness_by_step(reports: Sequence[Report], prefix: str = "step") -> dict[int, dict[int, int]]:
    """For each step: how many completions each lag (trainer step minus the version's step) had."""
    out: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for r in reports:
        for call in r["rollout_calls"]:
            for vid in call["version_id"]:
                if vid is not None:
                    out[call["step"]][call["step"] - int(vid.removeprefix(prefix))] += 1
    return {s: dict(c) for s, c in sorted(out.items())}


# --------------------------------------------------------------------------- engine logs (IO)


def count_unloads(
    reports: Sequence[Report], log_paths: Mapping[str, Path], wait_s: float = 10.0
) -> dict[str, dict[str, int]]:
    """SGLang's unload log lines of each published version's engine-local ``lora_id`` (waiting up
    to ``wait_s`` for the lines a scheduler writes after its reply). -1: id never seen there."""
    from lora_versions_dev.engine_log import unload_lines

    states = main_report(reports)["registry_states"]
    out: dict[str, dict[str, int]] = {}
    deadline = time.monotonic() + wait_s
    for pub in main_report(reports)["publications"]:
        name = pub["lora_name"]
        if name is None:
            continue
        want = 1 if states.get(name) == "RECLAIMED" else 0
        out[name] = {}
        for eid, path in log_paths.items():
            lora_id = pub["lora_ids"].get(eid)
            n = -1 if lora_id is None else unload_lines(path, lora_id)
            while lora_id is not None and n < want and time.monotonic() < deadline:
                time.sleep(0.1)
                n = unload_lines(path, lora_id)
            out[name][eid] = n
    return out
