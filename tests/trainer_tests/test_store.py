"""The durable store: commit-before-return, identical reopen, single writer, refusals."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from _rg_helpers import ENGINES, EPOCH, Publisher, refused, sk, vk

from lora_contract.errors import ErrorCode
from relax_glue.registry_types import UnloadEvidence
from relax_glue.store import (
    DurableRegistry,
    JournalDivergenceError,
    SchemaVersionError,
    StoreBrokenError,
    StoreError,
    StoreLockedError,
    StoreMismatchError,
    StoreMissingError,
)

ROOT = Path(__file__).resolve().parents[2]


def _open(path: Path, **kw: object) -> DurableRegistry:
    return DurableRegistry.open(path, EPOCH, ENGINES, 2, **kw)


def _rows(path: Path) -> int:
    with sqlite3.connect(path) as conn:  # a separate reader: sees only committed data
        return conn.execute("SELECT COUNT(*) FROM journal").fetchone()[0]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "registry.db"


def test_every_accepted_call_is_committed_before_it_returns(db: Path) -> None:
    with _open(db) as store:
        pub = Publisher(store)
        assert _rows(db) == 2  # two incarnations registered
        pub.reserve("A")
        assert _rows(db) == 3
        for engine in ENGINES:
            pub.ready("A", engine)
            assert _rows(db) == store.seq
        pub.commit("A")
        store.bind_first(sk("s"))
        assert _rows(db) == store.seq == 7
        mode = sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0]
        assert mode == "wal"


def test_refused_and_replayed_calls_write_nothing(db: Path) -> None:
    with _open(db) as store:
        pub = Publisher(store)
        pub.publish("A")
        store.bind_first(sk("s"))
        rows = _rows(db)
        refused(ErrorCode.VERSION_CONFLICT, pub.reserve, "A", "other content")
        refused(
            ErrorCode.STALE_ATTEMPT, store.commit, vk("A"), "att-x", 1, publisher_token=store.publisher_token
        )
        refused(ErrorCode.VERSION_IN_USE, store.claim_reclaim, vk("A"), publisher_token=store.publisher_token)
        pub.commit("A", 0)  # replay
        store.bind_first(sk("s"))  # replay
        pub.ready("A", "E0")  # duplicate receipt
        assert _rows(db) == rows


def test_a_replayed_close_and_a_duplicate_ready_while_loading_write_no_journal_row(db: Path) -> None:
    with _open(db) as store:
        pub = Publisher(store)
        pub.publish("A")
        store.bind_first(sk("s"))
        store.close_and_release(sk("s"))
        pub.reserve("B")
        pub.prepared("B", "E0")
        pub.ready("B", "E0")
        rows = _rows(db)
        store.close_and_release(sk("s"))
        pub.ready("B", "E0")
        assert _rows(db) == rows


def test_compaction_keeps_the_database_bounded_and_late_closes_safe(db: Path) -> None:
    """Issue 10: thousands of bind/close pairs with compaction every 50 rows and a 20-transition
    tombstone window: journal rows, checkpoints and session records stay bounded; the reopened
    state is identical; a late close of a pruned session answers CLOSED and releases nothing."""
    with DurableRegistry.open(db, EPOCH, ENGINES, 2, compact_every=50, session_window=20) as store:
        Publisher(store).publish("A")
        for i in range(2000):
            store.bind_first(sk(f"s{i}"))
            store.close_and_release(sk(f"s{i}"))
        store.bind_first(sk("open"))
        assert store.compactions >= 70
        assert _rows(db) <= 50 and len(store.status().versions) == 1
        assert sum(store.status().sessions.values()) <= 20 + 50 + 1
        refs = store.version(vk("A")).session_refs
        late = store.close_and_release(sk("s0"))  # pruned long ago
        assert late.state.value == "CLOSED" and not late.released
        assert store.version(vk("A")).session_refs == refs == 1  # nothing released twice
        before = store.dump()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM checkpoint").fetchone()[0] == 1
    with DurableRegistry.open(db, EPOCH, ENGINES, 2) as store:
        assert store.dump() == before
        store.check_invariants(full=True)


def test_compaction_settings_are_checked(db: Path) -> None:
    for bad in ({"compact_every": 0}, {"session_window": -1}, {"compact_every": True}):
        with pytest.raises(ValueError):
            DurableRegistry.open(db, EPOCH, ENGINES, 2, **bad)


def test_reopen_restores_identical_state_and_identical_answers(db: Path) -> None:
    with _open(db) as store:
        pub = Publisher(store)
        receipt_a = pub.publish("A")
        binding = store.bind_first(sk("s1"))
        pub.publish("B")
        store.close_and_release(sk("s1"))
        claim = store.claim_reclaim(vk("A"), publisher_token=store.publisher_token)
        ack = store.confirm_reclaim(
            vk("A"), "E0", UnloadEvidence(claim.reclaim_id, pub.incarnation["E0"]), **pub.auth
        )
        refused(ErrorCode.CAPACITY_ERROR, pub.reserve, "C")  # A is still RECLAIMING on E1
        store.begin_close(sk("early"))
        before, seq = store.dump(), store.seq
        results = dict(pub.results)

    with _open(db) as again:
        assert again.dump() == before and again.seq == seq
        pub2 = Publisher.__new__(Publisher)
        pub2.reg, pub2.incarnation, pub2.results = again, {"E0": "E0-i1", "E1": "E1-i1"}, results
        pub2.auth = {"publisher_token": again.publisher_token}  # read back from the file
        # retries after a coordinator restart get the first answers and change nothing
        assert pub2.reserve("A") == results["A"]
        assert (
            again.commit(vk("A"), results["A"].attempt_token, 0, publisher_token=again.publisher_token)
            == receipt_a
        )
        assert again.claim_reclaim(vk("A"), publisher_token=again.publisher_token) == claim
        assert (
            again.confirm_reclaim(
                vk("A"),
                "E0",
                UnloadEvidence(claim.reclaim_id, "E0-i1"),
                publisher_token=again.publisher_token,
            )
            == ack
        )
        assert again.binding_of(sk("s1")) == binding
        refused(ErrorCode.SESSION_CLOSED, again.bind_first, sk("early"))
        assert again.seq == seq
        # and the state machine goes on where it stopped
        again.confirm_reclaim(
            vk("A"), "E1", UnloadEvidence(claim.reclaim_id, "E1-i1"), publisher_token=again.publisher_token
        )
        assert pub2.reserve("C").created


def test_second_writer_is_refused_in_process_and_across_processes(db: Path) -> None:
    store = _open(db)
    with pytest.raises(StoreLockedError, match="another registry writer"):
        _open(db)
    code = (
        "import sys; from relax_glue.store import DurableRegistry, StoreLockedError\n"
        f"try: DurableRegistry.open({str(db)!r}, {EPOCH!r}, {list(ENGINES)!r}, 2)\n"
        "except StoreLockedError: sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, check=False)
    assert proc.returncode == 3
    store.close()
    store.close()  # idempotent
    with _open(db) as again:  # the lock is released on close
        assert again.seq == 0
    with pytest.raises(StoreError, match="closed"):
        store.status()


@pytest.mark.parametrize(
    ("epoch", "engines", "capacity", "field"),
    [("8", ENGINES, 2, "epoch"), (EPOCH, ("E0",), 2, "engines"), (EPOCH, ENGINES, 3, "capacity")],
)
def test_database_of_another_epoch_cohort_or_capacity_is_refused(
    db: Path, epoch: str, engines: tuple[str, ...], capacity: int, field: str
) -> None:
    with _open(db) as store:
        Publisher(store).publish("A")
    with pytest.raises(StoreMismatchError, match=f"belongs to {field}="):
        DurableRegistry.open(db, epoch, engines, capacity)
    with _open(db) as store:  # a refused open leaves the database and the lock intact
        assert store.status().default == vk("A")


def test_newer_schema_is_refused_not_migrated(db: Path) -> None:
    from relax_glue.store import SCHEMA_VERSION

    _open(db).close()
    with sqlite3.connect(db) as conn:
        conn.execute(f"UPDATE meta SET value='{SCHEMA_VERSION + 1}' WHERE key='schema_version'")
    with pytest.raises(SchemaVersionError, match=rf"schema {SCHEMA_VERSION + 1}.*upgrade the code"):
        _open(db)


def test_older_schema_is_refused_not_misread(db: Path) -> None:
    """Schema 1 journals tagged the per-engine records *Receipt: refused, never decoded wrongly."""
    _open(db).close()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    with pytest.raises(SchemaVersionError, match=r"schema 1.*no migration is defined"):
        _open(db)


def test_foreign_sqlite_file_is_refused(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE something (x)")
    with pytest.raises(StoreMismatchError, match="not a LoRA version registry"):
        _open(db)


def test_tampered_or_gapped_journal_is_refused_on_open(db: Path, tmp_path: Path) -> None:
    with _open(db) as store:
        Publisher(store).publish("A")
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE journal SET result=replace(result, 'LOADING', 'PUBLISHED') WHERE op='reserve'")
    with pytest.raises(JournalDivergenceError, match="another answer"):
        _open(db)

    other = tmp_path / "gap.db"
    with _open(other) as store:
        Publisher(store).publish("A")
    with sqlite3.connect(other) as conn:
        conn.execute("DELETE FROM journal WHERE seq=3")
    with pytest.raises(JournalDivergenceError):
        _open(other)


def test_checkpoint_then_only_the_tail_is_replayed(db: Path) -> None:
    with _open(db) as store:
        pub = Publisher(store)
        pub.publish("A")
        store.bind_first(sk("s"))
        at = store.checkpoint()
        pub.publish("B")
        store.close_and_release(sk("s"))
        before = store.dump()
    # rows before the checkpoint are no longer read: garbling them does not matter
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE journal SET args='garbage' WHERE seq <= ?", (at,))
    with _open(db) as again:
        assert again.dump() == before


def test_failed_commit_breaks_the_store_until_reopen(db: Path) -> None:
    store = _open(db)
    pub = Publisher(store)
    pub.publish("A")
    seq = store.seq
    store._conn.close()  # simulate an I/O failure under the next commit
    with pytest.raises(StoreBrokenError, match="reopen"):
        store.bind_first(sk("s"))
    with pytest.raises(StoreBrokenError):
        store.status()
    store.close()
    with _open(db) as again:  # the transition that was not committed never happened
        assert again.seq == seq and again.binding_of(sk("s")) is None


def test_constructor_is_not_the_way_in_and_bad_sync_mode(db: Path) -> None:
    with pytest.raises(TypeError):
        DurableRegistry()
    with pytest.raises(ValueError):
        _open(db, synchronous="EXTRA")


def test_a_database_that_must_exist_is_never_created_in_its_place(db: Path) -> None:
    """A restarted registry (must_exist) that finds no database, or an empty one, refuses and
    creates nothing: an empty registry under the epoch's name would fork its state."""
    with pytest.raises(StoreMissingError, match=str(db)):
        _open(db, must_exist=True)
    assert not db.exists()
    db.touch()  # an empty file, as a fresh mount or a truncated copy leaves
    with pytest.raises(StoreMissingError, match="missing or empty"):
        _open(db, must_exist=True)
    assert db.stat().st_size == 0
    with sqlite3.connect(db) as conn:  # a SQLite file with no table in it: empty too
        conn.execute("CREATE TABLE t (x)")
        conn.execute("DROP TABLE t")
    assert db.stat().st_size > 0
    with pytest.raises(StoreMissingError):
        _open(db, must_exist=True)
    # the first start creates it; a restart then opens it with every transition
    reg = _open(db)
    Publisher(reg).publish("A")
    reg.close()
    again = _open(db, must_exist=True)
    assert again.status().default_lora_name is not None
    again.close()


def test_the_publisher_token_is_drawn_at_creation_and_read_back_by_whoever_reopens_the_file(db: Path) -> None:
    """Issue 36: the trainer that reopens its database after a crash is still the publisher (it
    commits the attempt it left pending); a caller without the file's token is not, also after
    the reopen; the token is in no journal row and no checkpoint."""
    with _open(db) as store:
        token = store.publisher_token
        pub = Publisher(store)
        pub.publish("A")
        pub.reserve("B")
        for engine in ENGINES:
            pub.ready("B", engine)
        store.checkpoint()
        pending = pub.results["B"].attempt_token
    with _open(db) as again:  # the restarted trainer: same file, same token
        assert again.publisher_token == token
        refused(ErrorCode.NOT_PUBLISHER, again.commit, vk("B"), pending, 1)
        refused(ErrorCode.NOT_PUBLISHER, again.commit, vk("B"), pending, 1, publisher_token="x" * 43)
        assert again.status().default == vk("A")
        again.commit(vk("B"), pending, 1, publisher_token=again.publisher_token)
        assert again.status().default == vk("B")
    with _open(db) as third:
        assert third.publisher_token == token and third.status().default == vk("B")  # replayed
    with sqlite3.connect(db) as conn:
        journal = [row[0] for row in conn.execute("SELECT args FROM journal")]
        checkpoints = [row[0] for row in conn.execute("SELECT state FROM checkpoint")]
        (kept,) = conn.execute("SELECT value FROM meta WHERE key = 'publisher_token'").fetchone()
    assert kept == token and journal and checkpoints
    assert not any(token in text or "publisher_token" in text for text in journal + checkpoints)


def test_an_opener_that_brings_its_own_token_becomes_the_publisher(db: Path) -> None:
    """A registry actor the trainer starts opens the file with the trainer's token: from then on
    that token is the file's (one writer at a time holds the file) and the old one is refused."""
    with _open(db) as store:
        old = store.publisher_token
        Publisher(store).publish("A")
    mine = "t" * 43
    with _open(db, publisher_token=mine) as store:
        assert store.publisher_token == mine
        refused(
            ErrorCode.NOT_PUBLISHER, store.register_engine_incarnation, "E0", "E0-i7", publisher_token=old
        )
        store.register_engine_incarnation("E0", "E0-i7", publisher_token=mine)
    with _open(db) as store:
        assert store.publisher_token == mine and store.status().engines["E0"] == "E0-i7"
    with pytest.raises(ValueError, match="publisher token"):
        _open(db, publisher_token="short")
