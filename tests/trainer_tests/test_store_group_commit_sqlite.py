"""Group commit, read from the SQLite file itself (docs/fault-semantics.md, "Group commit"): a
separate ``sqlite3`` reader, never the store's own counters, looks at what is durable.

The rules: the store decides calls one at a time in arrival order and writes every row decided
while the previous group was being written in one transaction; no reply, refusal or read leaves
before the group it could observe is durable. So at the moment any caller gets its answer, the
row of every transition that answer reflects is in the file, once, at its place in the order,
with the answer the caller got.

The fault injections wrap the store's REAL write (``_write_all``): a latency on every group (so
groups really form), or a gate that holds one group's write while the test looks."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _rg_helpers import ENGINES, EPOCH, Publisher, refused, sk

from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.registry_types import SessionState, dumps, loads
from relax_glue.store import DurableRegistry

THREADS = 6
LIFECYCLES = 12
OPS = ("bind_first", "begin_close", "close_and_release")


def _journal(conn: sqlite3.Connection) -> list[tuple[int, str, str, str]]:
    return conn.execute("SELECT seq, op, args, result FROM journal ORDER BY seq").fetchall()


def _answers(conn: sqlite3.Connection, op: str, key: str) -> list[str]:
    """The recorded answers of the rows of ``op`` on session ``key`` (arguments decoded: the
    store journals every argument the op was called with, defaults included)."""
    rows = conn.execute("SELECT args, result FROM journal WHERE op = ?", (op,)).fetchall()
    return [result for args, result in rows if loads(args)["session_key"] == sk(key)]


def _reader(path: Path) -> sqlite3.Connection:
    """A reader of its own: sees only what was committed."""
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)


def _wrap_write(store: DurableRegistry, before: Callable[[], None]) -> None:
    """Run ``before`` ahead of each real group write (the store's own transaction)."""
    real = store._write_all

    def write(statements: Any) -> None:
        before()
        real(statements)

    store._write_all = write  # type: ignore[method-assign]


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[DurableRegistry]:
    with DurableRegistry.open(tmp_path / "reg.db", EPOCH, ENGINES, 2) as d:
        Publisher(d).publish("A")
        yield d


def test_every_acknowledged_transition_is_in_the_file_once_in_order_with_its_answer(
    store: DurableRegistry,
) -> None:
    """Six threads run session lifecycles through one store; each group write takes 5 ms more
    (so the calls arriving meanwhile form the next group). Right after each answer, the thread's
    own reader finds that call's row, exactly once, with that answer. At the end the journal is
    seq 1..N without a gap, each transition once, each thread's calls in its order."""
    _wrap_write(store, lambda: time.sleep(0.005))
    base_rows = store.seq
    commits_before = store.commits
    failures: list[str] = []
    acked: dict[int, list[tuple[str, str]]] = {t: [] for t in range(THREADS)}

    def run(t: int) -> None:
        conn = _reader(store.path)
        try:
            for i in range(LIFECYCLES):
                for op in OPS:
                    key = f"t{t}.{i}"
                    result = getattr(store, op)(sk(key))
                    rows = _answers(conn, op, key)
                    if rows != [dumps(result)]:
                        failures.append(f"{key} {op}: acknowledged, on disk {rows}")
                    acked[t].append((op, key))
        except BaseException as exc:
            failures.append(f"thread {t}: {exc!r}")
        finally:
            conn.close()

    workers = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not failures, failures[:5]

    conn = _reader(store.path)
    try:
        rows = _journal(conn)
    finally:
        conn.close()
    transitions = THREADS * LIFECYCLES * len(OPS)
    assert [seq for seq, *_ in rows] == list(range(1, base_rows + transitions + 1))  # no gap, no extra
    sessions = rows[base_rows:]  # after the publication's rows: the threads' transitions
    where = {(op, loads(args)["session_key"].nonce): seq for seq, op, args, _ in sessions}
    assert len(where) == len(sessions) == transitions  # each transition exactly once
    for t, calls in acked.items():
        seqs = [where[call] for call in calls]
        assert seqs == sorted(seqs), f"thread {t}'s calls are out of order in the journal"
    groups = store.commits - commits_before
    assert groups < transitions / 2, f"{groups} commits for {transitions} transitions: no groups formed"


def _started(store: DurableRegistry, target: Callable[[], None]) -> threading.Thread:
    """``target`` on a thread of its own, returned once the store has decided its call (so a
    wait measured from here is the store's, however loaded the machine)."""
    decided = threading.Event()
    real = store._decide

    def decide(op: str, kwargs: dict[str, Any]) -> Any:
        try:
            return real(op, kwargs)
        finally:
            if threading.current_thread() is thread:
                decided.set()

    store._decide = decide  # type: ignore[method-assign]
    thread = threading.Thread(target=target)
    thread.start()
    assert decided.wait(10), "the call never reached the store"
    return thread


def _held_group(store: DurableRegistry) -> tuple[threading.Event, threading.Event]:
    """A gate on the NEXT group write: ``entered`` is set when the leader is about to write (its
    rows decided, in memory only), and the write waits until ``release`` is set."""
    entered, release = threading.Event(), threading.Event()
    armed = [True]

    def before() -> None:
        if armed[0]:
            armed[0] = False
            entered.set()
            assert release.wait(10), "the test never released the held group"

    _wrap_write(store, before)
    return entered, release


def _in_file(path: Path, op: str, key: str) -> bool:
    conn = _reader(path)
    try:
        return len(_answers(conn, op, key)) == 1
    finally:
        conn.close()


def _observe(store: DurableRegistry, how: str) -> Any:
    """A call that observes the held transition (s CLOSING in memory, not yet on disk)."""
    if how == "read":
        return store.session(sk("s"))  # a query: CLOSING in its answer
    if how == "replay":
        return store.begin_close(sk("s"))  # an idempotent repeat: no row of its own
    if how == "refusal":
        return refused(ErrorCode.SESSION_CLOSED, store.bind_first, sk("s"))  # a replay before the close
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["read", "replay", "refusal"])
def test_an_answer_that_observes_a_transition_waits_until_its_group_is_in_the_file(
    store: DurableRegistry, how: str
) -> None:
    """The boundary: a bound session's ``begin_close`` is decided and its group is being written
    (held at the write). A read, a replayed ``begin_close`` and a refused bind all observe that
    close, and none of them answers before its row is in the file; once released, each answers
    with the row there."""
    store.bind_first(sk("s"))
    entered, release = _held_group(store)
    closing: list[Any] = []
    leader = threading.Thread(target=lambda: closing.append(store.begin_close(sk("s"))))
    leader.start()
    assert entered.wait(10)
    assert not _in_file(store.path, "begin_close", "s")  # decided, in memory only

    seen: list[tuple[Any, bool]] = []

    def observer() -> None:
        try:
            answer = _observe(store, how)
        except BaseException as exc:
            answer = exc
        seen.append((answer, _in_file(store.path, "begin_close", "s")))  # at the moment it answered

    watcher = _started(store, observer)
    watcher.join(0.3)
    answered_early = not watcher.is_alive()
    release.set()
    watcher.join(10)
    leader.join(10)
    assert not answered_early, f"the {how} answered before the close it observed was durable: {seen}"
    ((answer, on_disk),) = seen
    assert on_disk, f"the {how} answered with the close's row not in the file"
    assert not isinstance(answer, AssertionError), answer
    if how in ("read", "replay"):
        assert answer == closing[0] and answer.state is SessionState.CLOSING


def test_a_call_decided_while_a_group_is_written_joins_the_next_group_and_answers_after_it(
    store: DurableRegistry,
) -> None:
    """A transition decided while the previous group is being written is not in that group: it
    answers only once its own group is in the file, never with the previous group's commit."""
    entered, release = _held_group(store)
    first = threading.Thread(target=lambda: store.bind_first(sk("first")))
    first.start()
    assert entered.wait(10)
    answers: list[bool] = []

    def second() -> None:
        store.bind_first(sk("second"))
        answers.append(_in_file(store.path, "bind_first", "second"))

    late = _started(store, second)
    late.join(0.3)
    assert late.is_alive()  # decided, waiting for a group of its own
    assert not _in_file(store.path, "bind_first", "first")
    release.set()
    first.join(10)
    late.join(10)
    assert answers == [True]
    assert _in_file(store.path, "bind_first", "first")
    conn = _reader(store.path)
    try:
        ops = [(op, loads(args)["session_key"]) for _, op, args, _ in _journal(conn)[-2:]]
    finally:
        conn.close()
    assert ops == [("bind_first", sk("first")), ("bind_first", sk("second"))]


def test_a_batch_is_one_group_with_the_rows_of_its_accepted_calls_only(store: DurableRegistry) -> None:
    """``dispatch_many`` (what the actor's ``call_many`` runs): the calls are decided in order, a
    refusal or a bad call in the middle refuses only itself, and the batch's transitions are
    written in one transaction; the file holds exactly the accepted rows, in the batch's order,
    each with the answer its caller got."""
    writes: list[int] = []
    _wrap_write(store, lambda: writes.append(1))
    base = store.seq
    outcomes = store.dispatch_many(
        [
            ("bind_first", {"session_key": sk("b1")}),
            ("bind_first", {"session_key": ("other-epoch", "x")}),  # refused: another epoch
            ("begin_close", {"session_key": sk("b1")}),
            ("begin_close", {"no_such_argument": 1}),  # a bad call: refused before any change
            ("bind_first", {"session_key": sk("b1")}),  # refused: closing
            ("session", {"session_key": sk("b1")}),  # a read: sees the close
            ("close_and_release", {"session_key": sk("b1")}),
        ]
    )
    assert len(writes) == 1  # one group, one transaction
    bound, other, closing, bad, late_bind, read, closed = outcomes
    assert isinstance(other, LoraVersionError) and other.code is ErrorCode.INVALID_REQUEST
    assert isinstance(bad, LoraVersionError) and bad.code is ErrorCode.INVALID_REQUEST
    assert isinstance(late_bind, LoraVersionError) and late_bind.code is ErrorCode.SESSION_CLOSED
    assert read.state is SessionState.CLOSING and closed.state is SessionState.CLOSED and closed.released
    conn = _reader(store.path)
    try:
        rows = _journal(conn)[base:]
    finally:
        conn.close()
    assert [seq for seq, *_ in rows] == [base + 1, base + 2, base + 3]
    assert [(op, loads(args)["session_key"], result) for _, op, args, result in rows] == [
        ("bind_first", sk("b1"), dumps(bound)),
        ("begin_close", sk("b1"), dumps(closing)),
        ("close_and_release", sk("b1"), dumps(closed)),
    ]
