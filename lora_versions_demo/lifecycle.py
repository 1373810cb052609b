"""The main job: the full lifecycle of immutable LoRA versions on real CPU SGLang engines.

A cohort of engines (E0/E1 by default, ``--engines N``; plugin on, admin key on the control
endpoints) serves the tiny fixture Qwen3 behind the smg gateway;
the trainer side is the real ``relax_glue`` stack: the registry (in process), the publisher
(staged begin / ordered buckets / end / commit, reclaim), the session layer (first-bind, the
exact ``lora_path`` on every request, close) and the engine client (separate pools, audit log).

Steps: bootstrap A through the protocol (a session that generates before A commits gets
NO_PUBLISHED_VERSION) -> sessions bind A and generate -> B is published while the A sessions
keep streaming (no pause, no flush) -> new sessions bind B, old ones stay on A -> C is refused
with CAPACITY_ERROR before any engine sees it -> the A sessions close -> A is reclaimed (one
physical unload per engine, a late A request is refused) -> C is published. Every generated
turn is checked token for token against an independent HF transformers + PEFT (fp32) reference
of the session's bound adapter with the turn's full prefix. Prints a table per step, writes
``demo.json``; the exit code is 0 only if every check held.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lora_versions_demo.local_cohort import local_cohort, run_reporting
from lora_versions_dev.engine_log import await_unload_lines
from relax_glue.cli import table

PROMPTS: tuple[tuple[int, ...], ...] = (
    (302, 356, 417, 494, 439),  # "The quick brown" in the fixture tokenizer
    (2, 87, 82, 293, 202, 90, 72, 492, 313),
    (461, 275, 29, 446, 27, 224, 38, 15),
    (288, 79, 82, 88, 71, 92, 3, 202),
)
# "<|im_start|>tool\nweather in Paris: 18 C, cloudy<|im_end|>\n": what a tool call returns
TOOL_IDS: tuple[int, ...] = (
    2, 87, 82, 293, 202, 90, 72, 492, 313, 461, 275, 29, 446, 27, 224, 38, 15, 288, 79, 82, 88, 71, 92,
    3, 202,
)  # fmt: skip
TURN_TOKENS = 8
EPOCH = "demo"
DEFAULT_ENGINES = 2


_ACCESS_PATH_RE = re.compile(r'"(?:GET|POST|PUT|DELETE) (/[^ ?"]*)')


def forbidden_paths_served(log_path: Path) -> dict[str, int]:
    """Forbidden endpoints (pause, flush, memory release) in an engine's HTTP access log, with
    their count: whoever called them (our clients, the gateway, anyone) shows up here."""
    from relax_glue.engine_client import FORBIDDEN_PATHS

    seen = collections.Counter(_ACCESS_PATH_RE.findall(Path(log_path).read_text(errors="replace")))
    return {path: n for path, n in sorted(seen.items()) if path in FORBIDDEN_PATHS}


def _greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def _toks(tokens: Sequence[int], k: int = 8) -> str:
    return " ".join(map(str, tokens[:k])) + (" .." if len(tokens) > k else "")


@dataclasses.dataclass
class TurnRecord:
    session: str
    engine: str
    lora_path: str
    adapter: str
    prefix: list[int]
    tokens: list[int]
    cached_tokens: int = 0  # of the prompt, served from the engine's KV (radix) cache
    reference_ok: bool | None = None


class Demo:
    def __init__(
        self, engines: Sequence[Any], fixtures: Any, out_dir: Path, admin_key: str, gateway_url: str
    ) -> None:
        from relax_glue.cohort import open_publisher
        from relax_glue.engine_client import EngineClient
        from relax_glue.gateway import GatewayClient
        from relax_glue.registry import LoRAVersionRegistry
        from relax_glue.sessions import SessionManager
        from relax_glue.snapshot import Snapshot

        self.engines = {e.name: e for e in engines}
        self.fx = fixtures
        self.out_dir = out_dir
        self.epoch = EPOCH
        self.cohort = tuple(e.name for e in engines)
        self.all_engines = "both engines" if len(self.cohort) == 2 else f"all {len(self.cohort)} engines"
        self.reg = LoRAVersionRegistry(self.epoch, self.cohort)
        self.clients = {e.name: EngineClient(e.name, e.url, admin_key=admin_key) for e in engines}
        self.pub = open_publisher(self.reg, self.clients, reclaim_wait_s=1.0, reclaim_poll_s=0.05)
        # Every generation goes through the smg gateway (the session key is its routing key);
        # publication and reclaim talk to each engine directly.
        self.gw = GatewayClient(gateway_url, self.clients)
        self.sm = SessionManager(self.reg, self.clients, gateway=self.gw, drain_timeout_s=10.0)
        # Frozen snapshots of the fixture PEFT adapters, 16 KB buckets (several per adapter).
        self.snaps = {
            n: Snapshot.from_peft_dir(fixtures.adapter_dir(n), max_bucket_bytes=16 * 1024) for n in "ABC"
        }
        self.names = {n: s.lora_name(self.pub.prefix, self.epoch, n) for n, s in self.snaps.items()}
        self.adapter_of = {v: k for k, v in self.names.items()}
        self.sessions: dict[str, Any] = {}
        self.history: dict[str, list[int]] = {}
        self.turns: list[TurnRecord] = []
        self.checks: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self._step: dict[str, Any] = {}

    # ------------------------------------------------------------------ bookkeeping

    def step(self, title: str) -> None:
        self._step = {"title": title, "checks": [], "t": round(time.monotonic() - self.t0, 2)}
        self.steps.append(self._step)
        print(f"\n== step {len(self.steps)}: {title}")

    def check(self, name: str, what: str, ok: bool, detail: Any = "") -> bool:
        """Record one check: ``name`` is its stable identifier (what the tests pin, whatever the
        run's counts are), ``what`` the sentence the table prints."""
        entry = {"step": len(self.steps), "name": name, "check": what, "ok": bool(ok), "detail": detail}
        self.checks.append(entry)
        self._step["checks"].append(entry)
        print(f"  [{'ok' if ok else 'FAIL'}] {what}" + (f"  ({detail})" if detail not in ("", None) else ""))
        return bool(ok)

    def show(self, headers: Sequence[str], rows: Sequence[Sequence[Any]], key: str) -> None:
        print(table(headers, rows))
        self._step[key] = [dict(zip(headers, r, strict=True)) for r in rows]

    # --------------------------------------------------------------------- helpers

    def engine_of(self, session: Any) -> str:
        return self.sm.router.pick(session.key)  # sticky: the engine that serves the session

    async def open(self, label: str) -> Any:
        s = await self.sm.open(label)
        self.sessions[label] = s
        self.history[label] = list(PROMPTS[(len(self.sessions) - 1) % len(PROMPTS)])
        return s

    async def turn(self, label: str, stream: list[float] | None = None) -> TurnRecord:
        """One agent turn: the session's full history (earlier outputs + tool results) as the
        prompt; streamed when ``stream`` collects token arrival times."""
        s = self.sessions[label]
        prefix = list(self.history[label])
        body = {"input_ids": prefix, "sampling_params": _greedy(TURN_TOKENS)}
        if stream is None:
            last = await s.generate(body)
        else:
            last = {}
            async for chunk in s.generate_stream(body):
                stream.append(time.monotonic())
                last = chunk
        tokens = list(last["output_ids"])
        cached = int(last.get("meta_info", {}).get("cached_tokens") or 0)
        engine = s.requests[-1].engine_id  # as the gateway reported it for this very request
        rec = TurnRecord(label, engine, s.lora_path, self.adapter_of[s.lora_path], prefix, tokens, cached)
        self.turns.append(rec)
        self.history[label] = [*prefix, *tokens, *TOOL_IDS]
        return rec

    async def engine_view(self) -> dict[str, dict[str, str]]:
        out = {}
        for eid, c in self.clients.items():
            status = await c.status()
            out[eid] = {
                self.adapter_of[v.lora_name]: v.state.value
                for v in status.versions
                if v.lora_name in self.adapter_of
            }
        return out

    def registry_rows(self) -> list[list[Any]]:
        st = self.reg.status()
        rows = []
        for v in st.versions:
            is_default = v.version_key == st.default
            rows.append(
                [
                    self.adapter_of[v.lora_name],
                    v.state.value + (" (default)" if is_default else ""),
                    v.session_refs,
                    "yes" if v.holds_slot else "no",
                    v.lora_name,
                ]
            )
        return rows

    def show_registry(self) -> None:
        st = self.reg.status()
        print(
            f"  registry: default={self.adapter_of.get(st.default_lora_name or '', None)}, "
            f"slots {st.slots_used}/{st.capacity}, default_revision {st.default_revision}"
        )
        self.show(["version", "state", "session refs", "slot", "lora_name"], self.registry_rows(), "registry")

    async def show_engines(self) -> dict[str, dict[str, str]]:
        view = await self.engine_view()
        names = sorted({n for v in view.values() for n in v})
        self.show(
            ["engine", *names], [[e, *(view[e].get(n, "-") for n in names)] for e in self.cohort], "engines"
        )
        return view

    def session_rows(self, labels: Sequence[str]) -> list[list[Any]]:
        rows = []
        for label in labels:
            s = self.sessions[label]
            mine = [t for t in self.turns if t.session == label]
            rows.append(
                [
                    label,
                    self.engine_of(s) if s.lora_path else "-",
                    self.adapter_of.get(s.lora_path or "", "-"),
                    s.lora_path or "-",
                    len(mine),
                    _toks(mine[-1].tokens) if mine else "-",
                ]
            )
        return rows

    def show_sessions(self, labels: Sequence[str]) -> None:
        self.show(
            ["session", "engine", "bound", "lora_path (on every request)", "turns", "last tokens"],
            self.session_rows(labels),
            "sessions",
        )

    def publish_row(self, label: str, res: Any) -> list[Any]:
        phases = " ".join(f"{k}={v * 1000:.0f}" for k, v in res.phase_s.items())
        code = res.error.code.value if res.error is not None else ""
        return [label, res.outcome.value, code, f"{res.duration_s * 1000:.0f}", phases]

    def show_publish(self, label: str, res: Any) -> None:
        self.show(
            ["version", "outcome", "error", "total ms", "phases (ms)"],
            [self.publish_row(label, res)],
            "publish",
        )

    def staged_calls(self, lora_name: str) -> dict[str, list[tuple[str, str, str]]]:
        """Per engine, the control calls that named ``lora_name`` (op, detail, outcome), in order."""
        return {
            eid: [
                (e.op, e.detail, e.outcome)
                for e in cl.audit.entries(kind="control")
                if e.detail == lora_name or e.detail.startswith(f"{lora_name}#")
            ]
            for eid, cl in self.clients.items()
        }

    @staticmethod
    def staging_plan(lora_name: str, snap: Any) -> list[tuple[str, str, str]]:
        """The staged protocol for one version on one engine, every call answered ok: begin, each
        bucket once in index order, end."""
        buckets = [("receive_bucket", f"{lora_name}#{b.index}", "ok") for b in snap.bucket_plan]
        return [("begin", lora_name, "ok"), *buckets, ("end", lora_name, "ok")]

    # ------------------------------------------------------------------ the steps

    async def run(self) -> None:
        from lora_contract.errors import ErrorCode, LoraVersionError
        from relax_glue.engine_client import forbidden_calls
        from relax_glue.publisher import PublishOutcome

        self.t0 = time.monotonic()
        a, b, c = self.names["A"], self.names["B"], self.names["C"]

        # 1 -------------------------------------------------------------------------
        self.step("bootstrap: A goes through the same staged protocol")
        s0 = await self.open("S0")
        try:
            await s0.generate({"input_ids": list(PROMPTS[0]), "sampling_params": _greedy(4)})
            refused = None
        except LoraVersionError as err:
            refused = err.code
        self.check(
            "refused_before_commit",
            "a session that generates before A commits is refused",
            refused is ErrorCode.NO_PUBLISHED_VERSION and not s0.requests,
            refused.value if refused else "accepted",
        )
        res = await self.pub.publish(self.snaps["A"], "A")
        self.show_publish("A", res)
        self.check(
            "a_committed", f"A committed on {'/'.join(self.cohort)}", res.outcome is PublishOutcome.PUBLISHED
        )
        view = await self.show_engines()
        staged = self.staged_calls(a)
        want = self.staging_plan(a, self.snaps["A"])
        self.check(
            "a_staged_in_order",
            f"A went to {self.all_engines} as begin, {len(want) - 2} ordered buckets, end, and is "
            "READY_LOCAL on each",
            len(want) > 3
            and all(calls == want for calls in staged.values())
            and all(view[e].get("A") == "READY_LOCAL" for e in self.cohort),
            {
                e: {"calls": len(calls), "in_order": calls == want, "state": view[e].get("A")}
                for e, calls in staged.items()
            },
        )

        # 2 -------------------------------------------------------------------------
        self.step("sessions bind A at their first generation and generate")
        labels_a = ["S1", "S2", "S3", "S4"]
        for label in labels_a:
            await self.open(label)
        unbound_at_open = [x for x in labels_a if self.sessions[x].lora_path is None]
        refs_at_open = self.reg.version((self.epoch, "A")).session_refs
        await asyncio.gather(*(self.turn(label) for label in labels_a))
        # The gateway hashes each session key to an engine; the demo wants A traffic on both
        # engines while B is published, so it opens sessions until the gateway used both.
        while {self.engine_of(self.sessions[x]) for x in labels_a} != set(self.cohort) and len(labels_a) < 24:
            labels_a.append(f"S{len(labels_a) + 1}")
            await self.open(labels_a[-1])
            await self.turn(labels_a[-1])
        self.show_sessions(labels_a)
        refs = self.reg.version((self.epoch, "A")).session_refs
        self.check(
            "a_bound_at_first_generation",
            "the A sessions were unbound when opened and bound A at their first generation",
            unbound_at_open == labels_a[:4] and refs_at_open == 0 and refs == len(labels_a),
            {"unbound_at_open": len(unbound_at_open), "a_refs_at_open": refs_at_open, "a_refs_after": refs},
        )
        self.check(
            "a_sessions_bound_to_a",
            "every session is bound to A",
            {self.sessions[x].lora_path for x in labels_a} == {a},
        )
        self.check(
            "a_sessions_on_every_engine",
            f"the A sessions run on {self.all_engines}",
            {self.engine_of(self.sessions[x]) for x in labels_a} == set(self.cohort),
        )

        # 3 -------------------------------------------------------------------------
        self.step("publish B while the A sessions keep streaming (no pause, no flush)")
        stamps: dict[str, list[float]] = {x: [] for x in labels_a}
        stop = asyncio.Event()

        async def keep_going(label: str) -> int:
            n = 0
            while not stop.is_set():
                await self.turn(label, stamps[label])
                n += 1
            return n

        traffic = [asyncio.create_task(keep_going(x)) for x in labels_a]
        await asyncio.sleep(2.0)
        pub_lo = time.monotonic()
        res = await self.pub.publish(self.snaps["B"], "B")
        pub_hi = time.monotonic()
        await asyncio.sleep(0.5)
        stop.set()
        done = await asyncio.gather(*traffic, return_exceptions=True)
        self.show_publish("B", res)
        errors = [d for d in done if isinstance(d, BaseException)]
        self.check("b_committed", "B committed", res.outcome is PublishOutcome.PUBLISHED)
        self.check(
            "no_a_request_failed_during_b",
            "no A request failed while B was published",
            not errors,
            errors or "",
        )
        gaps_during, gaps_before = [], []
        per_engine = dict.fromkeys(self.cohort, 0)
        for label, ts in stamps.items():
            engine = self.engine_of(self.sessions[label])
            per_engine[engine] += sum(1 for t in ts if pub_lo <= t <= pub_hi)
            for x, y in itertools.pairwise(ts):
                if y >= pub_lo and x <= pub_hi:
                    gaps_during.append(y - x)
                elif y < pub_lo:
                    gaps_before.append(y - x)
        gap_row = {
            "max_gap_before_ms": round(1000 * max(gaps_before, default=0.0), 1),
            "max_gap_during_publication_ms": round(1000 * max(gaps_during, default=0.0), 1),
            "tokens_during_publication": per_engine,
            "publication_ms": round(1000 * (pub_hi - pub_lo), 1),
        }
        self._step["decode"] = gap_row
        print(
            f"  decode: largest gap between tokens {gap_row['max_gap_before_ms']} ms before vs "
            f"{gap_row['max_gap_during_publication_ms']} ms during the {gap_row['publication_ms']} ms "
            f"publication; tokens streamed during it: {per_engine}"
        )
        self.check(
            "decoded_during_b",
            f"{self.all_engines} kept decoding during the publication",
            all(per_engine.values()),
            per_engine,
        )
        self.check(
            "a_sessions_stayed_on_a",
            "the A sessions stayed on A",
            all(t.lora_path == a for t in self.turns if t.session in labels_a),
        )

        # 4 -------------------------------------------------------------------------
        self.step("new sessions bind B; the old ones stay on A (tool turns)")
        labels_b = [f"S{len(labels_a) + 1}", f"S{len(labels_a) + 2}"]
        for label in labels_b:
            await self.open(label)
        await asyncio.gather(*(self.turn(x) for x in [*labels_a, *labels_b]))
        self.show_sessions([*labels_a, *labels_b])
        self.check(
            "new_sessions_bound_to_b",
            "new sessions are bound to B",
            {self.sessions[x].lora_path for x in labels_b} == {b},
        )
        self.check(
            "old_sessions_still_on_a",
            "old sessions are still bound to A",
            {self.sessions[x].lora_path for x in labels_a} == {a},
        )
        self.show_registry()

        # 5 -------------------------------------------------------------------------
        self.step("C is refused: A (retired, still in use) and B hold both slots")
        before = sum(len(cl.audit.entries(kind="control")) for cl in self.clients.values())
        res = await self.pub.publish(self.snaps["C"], "C")
        self.show_publish("C", res)
        code = res.error.code if res.error is not None else None
        self.check(
            "c_refused_capacity",
            "reserve(C) is CAPACITY_ERROR",
            code is ErrorCode.CAPACITY_ERROR,
            {"code": code.value if code else "accepted"},
        )
        begins = [
            e for cl in self.clients.values() for e in cl.audit.entries(kind="control") if e.detail == c
        ]
        after = sum(len(cl.audit.entries(kind="control")) for cl in self.clients.values())
        view = await self.show_engines()
        holding_c = sorted(e for e, v in view.items() if "C" in v)
        self.check(
            "c_unseen_by_engines",
            "no engine saw anything of C (no begin, no bytes)",
            not begins and after == before and not holding_c,
            {
                "control_calls_before": before,
                "control_calls_after": after,
                "calls_naming_c": len(begins),
                "engines_holding_c": holding_c,
            },
        )

        # 6 -------------------------------------------------------------------------
        self.step("the A sessions close (idle: close_and_release, one release each)")
        closed = [await self.sessions[x].close() for x in [*labels_a, "S0"]]
        self.check(
            "a_sessions_released_once",
            "every A session released its ref exactly once",
            all(v.released for v in closed[:-1]),
        )
        self.show_registry()
        self.check(
            "a_refs_zero", "A has no session refs left", self.reg.version((self.epoch, "A")).session_refs == 0
        )

        # 7 -------------------------------------------------------------------------
        self.step("reclaim A: unregister -> drain in-flight -> one physical unload per engine")
        lora_ids = {}
        for eid, cl in self.clients.items():
            lora_ids[eid] = {v.lora_name: v.lora_id for v in (await cl.status()).versions}[a]
        results = await self.pub.reclaim_ready()
        rows = []
        unload_counts = {}
        for eid in self.cohort:
            unload_counts[eid] = await await_unload_lines(self.engines[eid].log_path, lora_ids[eid])
            r = str(results[0].engines.get(eid, "-")) if results else "-"
            rows.append([eid, r, lora_ids[eid], unload_counts[eid]])
        self.show(["engine", "reclaim", "engine-local lora_id", "unload log lines"], rows, "reclaim")
        self.check(
            "a_reclaimed",
            f"A is RECLAIMED (UNLOADED receipts from {'/'.join(self.cohort)})",
            bool(results) and results[0].done,
        )
        ranks = {eid: self.engines[eid].spec.tp for eid in self.cohort}  # one unload line per TP rank
        self.check(
            "a_unloaded_once_per_engine",
            "A was physically unloaded exactly once per engine, on each of its ranks (engine log lines)",
            unload_counts == ranks,
            {"unload_lines": unload_counts, "tp_ranks": ranks},
        )
        try:
            await self.gw.route("late-A").generate(
                {
                    "input_ids": list(PROMPTS[0]),
                    "sampling_params": _greedy(2),
                    "lora_path": a,
                    "rid": "late-A",
                }
            )
            late = None
        except LoraVersionError as err:
            late = err
        self.check(
            "late_a_refused",
            "a late request naming A, through the gateway, is refused (no fallback, no implicit reload)",
            late is not None and late.code is ErrorCode.VERSION_RECLAIMED,
            {"code": late.code.value, "engine_id": late.details.get("engine_id")} if late else "served",
        )
        self.show_registry()

        # 8 -------------------------------------------------------------------------
        self.step("publish C (the B sessions keep generating), then new sessions bind C")
        pub_task = asyncio.create_task(self.pub.publish(self.snaps["C"], "C"))
        await asyncio.gather(*(self.turn(x) for x in labels_b))
        res = await pub_task
        self.show_publish("C", res)
        self.check(
            "c_committed_default",
            "C committed; default is C",
            res.outcome is PublishOutcome.PUBLISHED and self.reg.status().default_lora_name == c,
        )
        label_c = f"S{len(labels_a) + 3}"
        await self.open(label_c)
        await asyncio.gather(*(self.turn(x) for x in [*labels_b, label_c]))
        self.show_sessions([*labels_b, label_c])
        self.check(
            "c_session_bound_b_kept",
            f"{label_c} is bound to C; {'/'.join(labels_b)} are still on B",
            self.sessions[label_c].lora_path == c and {self.sessions[x].lora_path for x in labels_b} == {b},
        )
        self.show_registry()
        await self.show_engines()

        # 9 -------------------------------------------------------------------------
        self.step("checks over the whole run")
        await asyncio.to_thread(self.check_references)
        bad = [t for t in self.turns if not t.reference_ok]
        self.check(
            "turns_equal_reference",
            f"all {len(self.turns)} turns equal the HF+PEFT reference of their bound version (full prefix)",
            not bad,
            {"turns": len(self.turns), "wrong": [dataclasses.asdict(t) for t in bad][:3]},
        )
        self.check_gateway()
        logs = [cl.audit for cl in (*self.clients.values(), self.gw.client)]
        # The audit sees what our clients sent; the engines' access logs see every caller (the
        # gateway included).
        served = {e: forbidden_paths_served(self.engines[e].log_path) for e in self.cohort}
        audited = forbidden_calls(logs)
        self.check(
            "no_pause_flush_abort_all",
            "no pause / flush / abort-all endpoint was ever called (audit logs and engine access logs)",
            not audited and not any(served.values()),
            {"audited": [dataclasses.asdict(e) for e in audited][:3], "engine_logs": served},
        )
        failed = [e for lg in logs for e in lg.entries(kind="generation") if e.outcome != "ok"]
        expected = {("late-A", "refused:VERSION_RECLAIMED")}  # S0's early turn was never sent
        unexpected = [e for e in failed if (e.detail, e.outcome) not in expected]
        self.check(
            "no_generation_failed",
            "no generation request failed (besides the deliberate late A)",
            not unexpected,
            unexpected or "",
        )
        counts = {
            eid: dict(sorted(collections.Counter(e.op for e in cl.audit.entries(kind="control")).items()))
            for eid, cl in self.clients.items()
        }
        self._step["control_calls"] = counts
        for eid, ops in counts.items():
            print(f"  {eid} control calls: " + ", ".join(f"{k}={v}" for k, v in ops.items()))
        await self.sm.close_all()

    def check_references(self) -> None:
        from transformers.utils import logging as hf_logging

        from lora_versions_dev import reference

        hf_logging.disable_progress_bar()

        for t in self.turns:
            want = reference.greedy_tokens(
                self.fx.model_dir, self.fx.adapter_dir(t.adapter), t.prefix, len(t.tokens)
            )
            t.reference_ok = want == t.tokens

    def check_gateway(self) -> None:
        """Stickiness through the gateway: one engine per session, and what it buys (the share
        of each later turn's prompt served from that engine's KV cache)."""
        per_session: dict[str, set[str]] = collections.defaultdict(set)
        later: list[TurnRecord] = []  # every turn but each session's first (which meets a cold cache)
        for t in self.turns:
            if t.session in per_session:
                later.append(t)
            per_session[t.session].add(t.engine)
        prompt = sum(len(t.prefix) for t in later)
        hit = sum(t.cached_tokens for t in later) / prompt if prompt else 0.0
        self._step["gateway"] = {
            "engines_per_session": {k: sorted(v) for k, v in per_session.items()},
            "later_turns": len(later),
            "cache_hit_rate_later_turns": round(hit, 3),
        }
        self.check(
            "gateway_sticky",
            "through the gateway, every session's turns ran on one engine (routing key = session key)",
            all(len(v) == 1 for v in per_session.values()),
            f"{len(per_session)} sessions, {len(self.turns)} turns",
        )
        self.check(
            "gateway_kv_cache_hits",
            "later turns found their prefix in that engine's KV cache (cached / prompt tokens)",
            hit >= 0.5,
            f"{hit:.0%} over {len(later)} turns",
        )

    async def aclose(self) -> None:
        for cl in self.clients.values():
            await cl.aclose()
        await self.gw.aclose()

    def report(self) -> dict[str, Any]:
        return {
            "ok": all(c["ok"] for c in self.checks),
            "checks": self.checks,
            "steps": self.steps,
            "turns": [dataclasses.asdict(t) for t in self.turns],
            "lora_names": self.names,
            "engines": {n: {"url": e.url, "log": str(e.log_path)} for n, e in self.engines.items()},
        }


def run_demo(
    out_dir: Path, n_engines: int = DEFAULT_ENGINES, *, as_json: bool = False, last_engine_tp: int = 1
) -> int:
    """Run the demo; ``as_json``: the tables go to stderr and the report (demo.json) to stdout;
    ``last_engine_tp``: the cohort's last engine runs that many tensor-parallel ranks."""
    return run_reporting(
        lambda: _demo(out_dir, n_engines, last_engine_tp), out_dir / "demo.json", as_json=as_json
    )


def _demo(out_dir: Path, n_engines: int, last_engine_tp: int = 1) -> int:
    t0 = time.monotonic()
    with local_cohort(out_dir, n_engines, "demo", last_engine_tp=last_engine_tp) as lc:
        report = _run_demo(lc.engines, lc.fixtures, out_dir, lc.admin_key, lc.gateway_url, t0)
    (out_dir / "demo.json").write_text(json.dumps(report, indent=2, default=str))
    n_ok = sum(c["ok"] for c in report["checks"])
    verdict = "ALL CHECKS HELD" if report["ok"] else "SOME CHECKS FAILED"
    print(
        f"\n[demo] {verdict}: {n_ok}/{len(report['checks'])} in {report['run_s']}s after engine start; "
        f"engines stopped; results in {out_dir / 'demo.json'}"
    )
    return 0 if report["ok"] else 1


def _run_demo(
    engines: Sequence[Any], fx: Any, out_dir: Path, admin_key: str, gateway_url: str, t0: float
) -> dict[str, Any]:
    demo = Demo(engines, fx, out_dir, admin_key, gateway_url)
    t1 = time.monotonic()
    try:
        asyncio.run(_run(demo))
    except Exception as exc:  # report what happened, still write demo.json
        demo.check("ran_to_the_end", "the demo ran to the end", False, f"{type(exc).__name__}: {exc}")
    report = demo.report()
    report["run_s"] = round(time.monotonic() - t1, 1)
    report["engine_start_s"] = round(t1 - t0, 1)
    report["gateway"] = gateway_url
    return report


async def _run(demo: Demo) -> None:
    try:
        await demo.run()
    finally:
        await demo.aclose()
