"""Property-based test: random interleavings of every registry operation.

A hypothesis ``RuleBasedStateMachine`` calls every op with valid, stale and wrong arguments from
small pools (so collisions, replays and races are frequent). After every step:

* the full invariant walk runs (slots <= capacity, one default, refs >= 0 and recounted from the
  sessions, no refs on RECLAIMING, terminal states never left, ...);
* a refused call left the complete state unchanged (checked by the ``Checked`` proxy);
* the answer matches a small model of expected answers: replays are identical (reserve by request
  id, commit receipts, claims, bindings), key -> digest conflicts are forever, closed sessions
  never reopen, a new candidate is refused with the right code in the right order, a commit is
  accepted exactly when every engine is READY at the expected revision.

The durable variant runs the same machine on the SQLite store with a ``reopen`` rule: closing and
reopening must restore the identical state and keep answering identically.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from _rg_helpers import ENGINES, EPOCH, Checked, digest, lora_name, sk, vk
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.registry import LoRAVersionRegistry
from relax_glue.registry_types import (
    AttemptPhase,
    Binding,
    CleanupEvidence,
    PreparedEvidence,
    ReadyEvidence,
    ReclaimPhase,
    SessionState,
    UnloadEvidence,
    VersionState,
)
from relax_glue.store import DurableRegistry

VIDS = st.sampled_from(["A", "B", "C", "D", "E"])
ENGINE = st.sampled_from(ENGINES)
SESSIONS = st.sampled_from([f"s{i}" for i in range(6)])
REQUESTS = st.sampled_from([f"r{i}" for i in range(8)])
CAPACITY = 2


def _event(what: str) -> None:
    # statistics for --hypothesis-show-statistics; the seeded random walks run outside hypothesis
    with contextlib.suppress(InvalidArgument):
        event(what)


TERMINAL = (VersionState.FAILED_CLEAN, VersionState.RECLAIMED)


class RegistryMachine(RuleBasedStateMachine):
    vid_pool: tuple[str, ...] = ("A", "B", "C", "D", "E")

    def __init__(self) -> None:
        super().__init__()
        self.reg = Checked(self.make_registry(), fast=True)
        self.incarnations: dict[str, list[str]] = {e: [] for e in ENGINES}
        self.first_digest: dict[str, str] = {}
        self.reserve_answers: dict[str, tuple[tuple[str, str], Any]] = {}
        self.tokens: dict[str, str] = {}
        self.receipts: dict[str, Any] = {}
        self.claims: dict[str, Any] = {}
        self.bindings: dict[str, Binding] = {}
        self.closed: set[str] = set()
        self.terminal: dict[str, VersionState] = {}
        self.revision = 0

    # the durable variant overrides these two
    def make_registry(self) -> Any:
        return LoRAVersionRegistry(EPOCH, ENGINES, CAPACITY)

    def teardown(self) -> None:
        pass

    # ------------------------------------------------------------------ helpers

    def call(self, op: str, *args: Any) -> tuple[Any, ErrorCode | None]:
        try:
            return getattr(self.reg, op)(*args), None
        except LoraVersionError as exc:
            return None, exc.code

    def view(self, vid: str) -> Any:
        return self.reg.version(vk(vid))

    def token(self, vid: str) -> str:
        return self.tokens.get(vid, "att-never-issued")

    def inc(self, engine: str, old: bool = False) -> str:
        history = self.incarnations[engine]
        if not history:
            return f"{engine}-unregistered"
        return history[0] if old else history[-1]

    # ------------------------------------------------------------------ publication

    @rule(vid=VIDS, other_content=st.booleans(), request_id=REQUESTS)
    def reserve(self, vid: str, other_content: bool, request_id: str) -> None:
        dig = digest(vid + ("-other" if other_content else ""))
        before = self.reg.status()
        res, err = self.call("reserve", vk(vid), dig, lora_name(vid, dig), request_id)
        seen = self.reserve_answers.get(request_id)
        if seen is not None:
            if seen[0] == (vid, dig):
                assert res == seen[1], "a retried request id gets the identical answer"
            else:
                assert err is ErrorCode.INVALID_REQUEST
            return
        known = self.first_digest.get(vid)
        if known is not None and known != dig:
            assert err is ErrorCode.VERSION_CONFLICT, "same key, other digest: conflict forever"
            return
        if known is not None:
            assert res is not None and not res.created and res.attempt_token == self.tokens[vid]
            assert res.state is self.view(vid).state
        elif before.unknown_outcomes:
            assert err is ErrorCode.OUTCOME_UNKNOWN
        elif before.pending_attempt is not None:
            assert err is ErrorCode.PUBLICATION_IN_PROGRESS
        elif before.slots_used >= CAPACITY:
            assert err is ErrorCode.CAPACITY_ERROR
            _event("CAPACITY_ERROR")
        else:
            assert res is not None and res.created and res.state is VersionState.LOADING
            self.first_digest[vid] = dig
            self.tokens[vid] = res.attempt_token
        if res is not None:
            self.reserve_answers[request_id] = ((vid, dig), res)

    @rule(vid=VIDS, engine=ENGINE, old=st.booleans())
    def prepared(self, vid: str, engine: str, old: bool) -> None:
        self.call(
            "record_prepared", engine, PreparedEvidence(vk(vid), self.token(vid), self.inc(engine, old))
        )

    @rule(vid=VIDS, engine=ENGINE, old=st.booleans(), wrong_digest=st.booleans())
    def ready(self, vid: str, engine: str, old: bool, wrong_digest: bool) -> None:
        dig = digest("bogus") if wrong_digest else self.first_digest.get(vid, digest(vid))
        inc = self.inc(engine, old)
        res, err = self.call("record_ready", engine, ReadyEvidence(vk(vid), dig, self.token(vid), inc))
        if res is not None:
            assert not wrong_digest and inc == self.inc(engine)
        elif wrong_digest and vid in self.tokens:
            assert err is ErrorCode.VERSION_CONFLICT

    @rule(vid=VIDS, delta=st.sampled_from([0, 0, -1, 1]))
    def commit(self, vid: str, delta: int) -> None:
        before = self.view(vid)
        res, err = self.call("commit", vk(vid), self.token(vid), self.revision + delta)
        if vid in self.receipts:
            assert res == self.receipts[vid], "a replayed commit returns the stored receipt"
            return
        ok = (
            before is not None
            and before.state is VersionState.LOADING
            and all(p is AttemptPhase.READY for p in before.attempt_phases.values())
            and delta == 0
        )
        assert (res is not None) == ok, (before, err)
        if res is not None:
            self.revision += 1
            _event(f"commit accepted (revision {min(self.revision, 3)}+)")
            assert res.default_revision == self.revision
            self.receipts[vid] = res
        elif before is not None and before.state is VersionState.LOADING:
            unknown = AttemptPhase.UNKNOWN in before.attempt_phases.values()
            ready = all(p is AttemptPhase.READY for p in before.attempt_phases.values())
            expected = (
                ErrorCode.OUTCOME_UNKNOWN
                if unknown
                else ErrorCode.DEFAULT_REVISION_CONFLICT
                if ready
                else ErrorCode.NOT_ALL_READY
            )
            assert err is expected

    @rule(vid=VIDS)
    def abort(self, vid: str) -> None:
        before = self.view(vid)
        res, err = self.call("abort", self.token(vid), "random abort")
        if before is None:
            assert err is ErrorCode.STALE_ATTEMPT
        elif before.state in _COMMITTED:
            assert err is ErrorCode.STALE_ATTEMPT, "a committed attempt is never cleaned up"
        else:
            assert res is not None and res.attempt_token == self.tokens[vid]
            assert self.view(vid).state in (VersionState.ABORTED, VersionState.FAILED_CLEAN)

    @rule(vid=VIDS, engine=ENGINE, old=st.booleans())
    def cleanup(self, vid: str, engine: str, old: bool) -> None:
        tok = self.token(vid)
        res, _ = self.call("record_cleanup", engine, tok, CleanupEvidence(tok, self.inc(engine, old)))
        if res is not None and res.state is VersionState.FAILED_CLEAN:
            _event("reached FAILED_CLEAN")

    @rule(engine=ENGINE, back=st.booleans())
    def restart(self, engine: str, back: bool) -> None:
        history = self.incarnations[engine]
        if back and history:
            res, err = self.call("register_engine_incarnation", engine, history[0])
            assert (err is ErrorCode.STALE_INCARNATION) == (len(history) > 1)
            return
        new = f"{engine}-i{len(history) + 1}"
        res, err = self.call("register_engine_incarnation", engine, new)
        assert res is not None and res.previous == (history[-1] if history else None)
        history.append(new)

    @rule(vid=VIDS, engine=ENGINE, reclaim=st.booleans())
    def mark_unknown(self, vid: str, engine: str, reclaim: bool) -> None:
        ref = self.claims[vid].reclaim_id if reclaim and vid in self.claims else self.token(vid)
        before = self.reg.status().slots_used
        res, _ = self.call("mark_engine_unknown", engine, ref, "op", "timeout")
        if res is not None and res.phase == "UNKNOWN":
            _event("unknown outcome marked")
        assert self.reg.status().slots_used == before, "an unknown outcome never frees a slot"

    # ------------------------------------------------------------------ sessions

    @rule(s=SESSIONS)
    def open_session(self, s: str) -> None:
        _, err = self.call("open_session", sk(s))
        assert (err is ErrorCode.SESSION_CLOSED) == (s in self.closed)

    @rule(s=SESSIONS)
    def bind_first(self, s: str) -> None:
        default = self.reg.status().default
        res, err = self.call("bind_first", sk(s))
        if s in self.closed:
            assert err is ErrorCode.SESSION_CLOSED
        elif s in self.bindings:
            assert res == self.bindings[s], "later binds return the first binding"
        elif default is None:
            assert err is ErrorCode.NO_PUBLISHED_VERSION
        else:
            assert res is not None and res.version_key == default
            self.bindings[s] = res

    @rule(s=SESSIONS)
    def begin_close(self, s: str) -> None:
        res, _ = self.call("begin_close", sk(s))
        assert res.state in (SessionState.CLOSING, SessionState.CLOSED)
        self.closed.add(s)

    @rule(s=SESSIONS)
    def close_and_release(self, s: str) -> None:
        binding = self.bindings.get(s)
        refs_before = self.view(binding.version_key.version_id).session_refs if binding else None
        was_released = (self.reg.session(sk(s)) or _NOT_RELEASED).released
        res, _ = self.call("close_and_release", sk(s))
        assert res.state is SessionState.CLOSED
        self.closed.add(s)
        if binding is not None:
            refs_after = self.view(binding.version_key.version_id).session_refs
            assert refs_after == refs_before - (0 if was_released else 1), "released exactly once"

    # ------------------------------------------------------------------ reclaim

    @rule(vid=VIDS)
    def claim(self, vid: str) -> None:
        before = self.view(vid)
        res, err = self.call("claim_reclaim", vk(vid))
        if vid in self.claims:
            assert res == self.claims[vid]
        elif before is None:
            assert err is ErrorCode.UNKNOWN_VERSION
        elif before.state is VersionState.RETIRED and before.session_refs == 0:
            assert res is not None and self.view(vid).state is VersionState.RECLAIMING
            self.claims[vid] = res
        elif before.state in (VersionState.PUBLISHED, VersionState.RETIRED):
            assert err is ErrorCode.VERSION_IN_USE
        else:
            assert err is ErrorCode.INVALID_REQUEST

    @rule(vid=VIDS, engine=ENGINE, old=st.booleans(), wrong=st.booleans())
    def unloaded(self, vid: str, engine: str, old: bool, wrong: bool) -> None:
        rid = "rcl-wrong" if wrong or vid not in self.claims else self.claims[vid].reclaim_id
        res, _ = self.call("confirm_reclaim", vk(vid), engine, UnloadEvidence(rid, self.inc(engine, old)))
        if res is not None and res.state is VersionState.RECLAIMED:
            _event("reached RECLAIMED")

    # ------------------------------------------------------------------ drivers (reach deep states)

    @rule(steps=st.integers(1, 4))
    def drive_publication(self, steps: int) -> None:
        """Do the publisher's next useful steps for the pending attempt (or start one)."""
        for _ in range(steps):
            self._publication_step()

    def _publication_step(self) -> None:
        status = self.reg.status()
        if status.pending_attempt is None:
            fresh = next((v for v in self.vid_pool if v not in self.first_digest), None)
            if fresh is not None:
                self.reserve(fresh, other_content=False, request_id=f"drive-{fresh}")
            return
        pending = next((v for v in status.versions if v.attempt_token == status.pending_attempt), None)
        if pending is None:
            return
        vid = pending.version_key.version_id
        for engine, phase in pending.attempt_phases.items():
            if not self.incarnations[engine]:
                self.restart(engine, back=False)
            if pending.state is VersionState.LOADING and phase is not AttemptPhase.READY:
                return self.ready(vid, engine, old=False, wrong_digest=False)
            if pending.state is VersionState.ABORTED and phase is not AttemptPhase.CLEANED:
                return self.cleanup(vid, engine, old=False)
        return self.commit(vid, 0)

    @rule(steps=st.integers(1, 4))
    def drive_reclaim(self, steps: int) -> None:
        """Close the sessions of retired versions, claim and confirm reclaims."""
        for _ in range(steps):
            self._reclaim_step()

    def _reclaim_step(self) -> None:
        for v in self.reg.status().versions:
            vid = v.version_key.version_id
            if v.state is VersionState.RETIRED and v.session_refs > 0:
                s = next(
                    s
                    for s, b in self.bindings.items()
                    if b.version_key == v.version_key and not self.reg.session(sk(s)).released
                )
                return self.close_and_release(s)
            if v.state is VersionState.RETIRED:
                return self.claim(vid)
            if v.state is VersionState.RECLAIMING:
                engine = next(e for e, p in v.reclaim_phases.items() if p is not ReclaimPhase.UNLOADED)
                if not self.incarnations[engine]:
                    self.restart(engine, back=False)
                return self.unloaded(vid, engine, old=False, wrong=False)
        return None

    # ------------------------------------------------------------------ invariants

    @invariant()
    def invariants_hold(self) -> None:
        self.reg.check_invariants(full=True)
        status = self.reg.status()
        assert status.slots_used <= CAPACITY
        assert status.default_revision == self.revision
        for v in status.versions:
            vid = v.version_key.version_id
            assert v.session_refs >= 0
            if v.session_refs > 0:
                assert v.state not in (VersionState.RECLAIMING, VersionState.RECLAIMED)
            if vid in self.terminal:
                assert v.state is self.terminal[vid], "a terminal version never returns"
            elif v.state in TERMINAL:
                self.terminal[vid] = v.state
            assert v.digest == self.first_digest[vid]


_COMMITTED = (VersionState.PUBLISHED, VersionState.RETIRED, VersionState.RECLAIMING, VersionState.RECLAIMED)


class _NotReleased:
    released = False


_NOT_RELEASED = _NotReleased()


class DurableRegistryMachine(RegistryMachine):
    """The same machine on the SQLite store, plus reopen (a coordinator restart)."""

    def make_registry(self) -> Any:
        self.tmp = Path(tempfile.mkdtemp(prefix="regsm-"))
        return self._open()

    def _open(self) -> DurableRegistry:
        return DurableRegistry.open(self.tmp / "reg.db", EPOCH, ENGINES, CAPACITY, synchronous="OFF")

    @precondition(lambda self: self.reg.status().seq > 0)
    @rule()
    def reopen(self) -> None:
        before = self.reg.dump()
        self.reg.inner.close()
        self.reg = Checked(self._open(), fast=True)
        assert self.reg.dump() == before, "reopen restores the identical state"

    def teardown(self) -> None:
        self.reg.inner.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


_SETTINGS = {"deadline": None, "suppress_health_check": list(HealthCheck)}

TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(max_examples=60, stateful_step_count=80, **_SETTINGS)

TestDurableRegistryMachine = DurableRegistryMachine.TestCase
TestDurableRegistryMachine.settings = settings(max_examples=30, stateful_step_count=50, **_SETTINGS)


# ------------------------------------------------------------------------------- random walks
# Hypothesis' generator favours shrinkable, repetitive programs; a plain seeded walk that picks
# every rule uniformly complements it with long, evenly spread interleavings (same checks).

_WALK_VIDS = tuple("ABCDEFGHIJKL")
_POOLS: dict[str, list[Any]] = {
    "vid": list(_WALK_VIDS),
    "engine": list(ENGINES),
    "s": [f"s{i}" for i in range(40)],
    "request_id": [f"r{i}" for i in range(8)],
    "delta": [0, 0, -1, 1],
    "steps": [1, 2, 3, 4],
}
_RULES = [
    fn
    for name, fn in inspect.getmembers(RegistryMachine, inspect.isfunction)
    if not name.startswith("_") and hasattr(fn, "hypothesis_stateful_rule")
]


def _walk(machine: RegistryMachine, rng: random.Random, steps: int) -> None:
    for _ in range(steps):
        fn = rng.choice(_RULES)
        params = list(inspect.signature(fn).parameters)[1:]
        fn(machine, **{p: rng.choice(_POOLS.get(p, [False, True])) for p in params})
        machine.invariants_hold()


@pytest.mark.parametrize("seed", range(12))
def test_random_walk(seed: int) -> None:
    machine = RegistryMachine()
    machine.vid_pool = _WALK_VIDS
    _walk(machine, random.Random(seed), 400)
