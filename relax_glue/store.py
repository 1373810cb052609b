"""Durability for the LoRA version registry: a journal of accepted calls in SQLite (stdlib, WAL).

Why a journal and not a state snapshot
--------------------------------------
The registry is deterministic (no clocks, no randomness, derived ids), so its state is a pure
function of the accepted calls. We therefore store each accepted call (op name, arguments and the
answer it got) as one row and rebuild the state on open by replaying the rows through the very
same pure code:

* one small INSERT + COMMIT per accepted transition, whatever the size of the state (a snapshot
  would rewrite every session tombstone on every bind);
* there is no second write path that could drift from the state machine: the registry is the
  only code that computes transitions, on the live path and on replay;
* replay recomputes every answer and compares it with the stored one, so a code change that
  would alter history is detected at open (``JournalDivergenceError``) instead of silently
  producing another state; the journal is also the audit log of the epoch.

The price is open time linear in the history. :meth:`DurableRegistry.checkpoint` stores a full
state dump at the current sequence number; open then loads the newest checkpoint and replays only
the rows after it (the journal itself is kept as the audit log).

Bounded growth: :meth:`DurableRegistry.compact` (automatic every ``compact_every`` journal rows)
first prunes CLOSED session records older than ``session_window`` transitions (a journaled
``prune_sessions`` call), then, in ONE SQLite transaction, writes a checkpoint and deletes the
journal rows and older checkpoints it covers. A SIGKILL at any point leaves either the state
before or the state after (SQLite's atomic commit); the audit log then starts at the newest
checkpoint. Freed pages are reused by later rows, so the file stays bounded without VACUUM.

Guarantees
----------
* Every accepted transition is committed (``synchronous=FULL`` by default) before its result is
  returned. A refused call raises before anything is written; a replay (idempotent repeat)
  changes no state and writes nothing. Reopening restores the identical state, including the
  stored op results, so a retry after a coordinator restart gets the same answer.
* Single writer: an exclusive ``flock`` on ``<db>.lock`` is held for the registry's lifetime.
  The OS drops it when the process dies (also on SIGKILL), so crash recovery needs no cleanup,
  while a second live writer is refused with :class:`StoreLockedError` (no split brain).
* A database of another epoch / cohort / capacity, of a newer schema, or not written by this
  module is refused with a clear error; nothing is migrated silently.
* Publisher authority lives in the file: a publisher token is drawn when the database is
  created and kept in its ``meta`` table (never in a journal row, a dump or an answer), so the
  process that opens the file (the trainer, also after a restart) holds it
  (:attr:`DurableRegistry.publisher_token`). An opener that brings its own token (a registry
  actor started by the trainer) makes it the file's: one writer at a time holds the file, and
  that writer is the publisher.
* If a commit itself fails (disk full, I/O error) the in-memory state is ahead of the disk: the
  instance refuses every further call (:class:`StoreBrokenError`) until it is reopened.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.names import MANAGED_CAPACITY
from relax_glue.registry import (
    DERIVED_OPS,
    MUTATING_OPS,
    PUBLISHER_OPS,
    LoRAVersionRegistry,
    checked_publisher_token,
    new_publisher_token,
    stamp_now,
)
from relax_glue.registry_ops import RegistryOps
from relax_glue.registry_types import dumps, loads

__all__ = [
    "SCHEMA_VERSION",
    "DurableRegistry",
    "JournalDivergenceError",
    "SchemaVersionError",
    "StoreBrokenError",
    "StoreError",
    "StoreLockedError",
    "StoreMismatchError",
    "StoreMissingError",
    "read_registry",
]

# 2: the registry's per-engine records renamed from *Receipt to *Evidence (journal type tags).
# 3: worker leases (grant_lease / end_leases journaled; renewals soft); per-session leases gone.
# 4: the publisher token in ``meta`` (publication ops are refused without it).
SCHEMA_VERSION = 4
# PRAGMA application_id: marks a file as ours, so a foreign SQLite file is refused, not adopted.
APPLICATION_ID = 0x4C525631  # "LRV1"
_SYNC_MODES = ("FULL", "NORMAL", "OFF")
# Compaction defaults: large enough that a normal epoch keeps its whole audit log for a long time,
# small enough that a long RL run (millions of session binds) keeps a bounded database.
DEFAULT_COMPACT_EVERY = 100_000  # journal rows between automatic compactions (None: never)
DEFAULT_SESSION_WINDOW = 100_000  # transitions a CLOSED session record is kept after its close
_TOKEN_KEY = "publisher_token"  # its row in meta (not in _meta_of: it is no identity to compare)

T = TypeVar("T")


class StoreError(RuntimeError):
    """The store cannot be used as asked (an operational error, not a registry refusal)."""


class StoreLockedError(StoreError):
    """Another live writer holds the database."""


class StoreMismatchError(StoreError):
    """The database belongs to another epoch, cohort or capacity, or is not a registry DB."""


class SchemaVersionError(StoreError):
    """The database was written by another (newer) schema version."""


class JournalDivergenceError(StoreError):
    """Replaying the journal does not reproduce the recorded answers (code drift or corruption)."""


class StoreMissingError(StoreError):
    """A database that must exist (the registry restarted) is missing or empty."""


class StoreBrokenError(StoreError):
    """A commit failed after the in-memory state moved: reopen the store."""


class DurableRegistry(RegistryOps):
    """A :class:`LoRAVersionRegistry` whose every accepted transition is journaled in SQLite.

    Same method names, arguments, results and errors as the registry; open with :meth:`open`
    and close with :meth:`close` (or use it as a context manager).
    """

    def __init__(self, *_: Any, **__: Any) -> None:
        raise TypeError("use DurableRegistry.open(path, epoch, engines, capacity)")

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        epoch: str | int,
        engines: Sequence[str],
        capacity: int = MANAGED_CAPACITY,
        *,
        synchronous: str = "FULL",
        debug_checks: bool = __debug__,
        compact_every: int | None = DEFAULT_COMPACT_EVERY,
        session_window: int | None = DEFAULT_SESSION_WINDOW,
        must_exist: bool = False,
        publisher_token: str | None = None,
    ) -> DurableRegistry:
        """Open (or create) the registry database at ``path`` and take the writer lock.

        ``must_exist``: the caller served this epoch before (a restarted actor), so a missing or
        empty database is not a first start but lost state: :class:`StoreMissingError`, and
        nothing is created (an empty registry under the epoch's name would fork it).

        ``publisher_token``: None keeps the file's token (drawn at its creation); a token given
        becomes the file's (the opener is the publisher: a trainer that started the actor)."""
        if synchronous not in _SYNC_MODES:
            raise ValueError(f"synchronous must be one of {_SYNC_MODES}")
        if publisher_token is not None:
            checked_publisher_token(publisher_token)
        for name, value in (("compact_every", compact_every), ("session_window", session_window)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None")
        self = object.__new__(cls)
        self.path = Path(path)
        # One lock for the state, the group being formed and the flag of the group being
        # written; never taken recursively (a Condition over a plain Lock).
        self._mutex = threading.Condition(threading.Lock())
        self._pending: list[tuple[int, str, str, str]] = []  # decided rows not yet written
        self._flushing = False  # a leader is writing a group (outside the lock)
        self.commits = 0  # transactions written (one fsync each with synchronous=FULL)
        self._broken = False
        self._closed = True
        if must_exist and not (self.path.is_file() and self.path.stat().st_size > 0):
            raise StoreMissingError(_missing(self.path))
        self._lock_fd = _take_writer_lock(self.path)
        try:
            self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            try:
                self._registry = _open_db(
                    self._conn, self.path, epoch, engines, capacity, synchronous, must_exist, publisher_token
                )
            except BaseException:
                self._conn.close()
                raise
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._registry.debug_checks = debug_checks
        # The deadlines of before the restart are gone with the old process: every live lease
        # gets a fresh TTL from now (a live worker keeps its sessions, a dead one loses them
        # one TTL later).
        self._registry.refresh_leases(time.time())
        self._durable = self._registry.seq  # everything replayed is on disk
        self.compact_every = compact_every
        self.session_window = session_window
        row = self._conn.execute("SELECT MAX(seq) FROM checkpoint").fetchone()
        self._compacted_at = int(row[0] or 0)
        self.compactions = 0
        self._closed = False
        return self

    # ------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        with self._mutex:
            self._mutex.wait_for(lambda: not self._flushing)  # never close under a writing leader
            if self._closed:
                return
            self._closed = True
            try:
                self._conn.close()
            finally:
                os.close(self._lock_fd)  # releases the flock

    def __enter__(self) -> DurableRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def registry(self) -> LoRAVersionRegistry:
        """The in-memory state machine (read it; mutate only through this store)."""
        return self._registry

    @property
    def publisher_token(self) -> str:
        """The file's publisher token: whoever opened the file is the publisher (no op returns it)."""
        return self._registry.publisher_token

    @property
    def epoch(self) -> str:
        return self._registry.epoch

    @property
    def engines(self) -> tuple[str, ...]:
        return self._registry.engines

    @property
    def capacity(self) -> int:
        return self._registry.capacity

    @property
    def seq(self) -> int:
        return self._registry.seq

    def checkpoint(self) -> int:
        """Store a full state dump at the current sequence number; later opens replay only the
        journal rows after it. Returns that sequence number."""
        return self._flush(checkpoint=True)

    def compact(self) -> int:
        """Prune old CLOSED sessions (journaled), then checkpoint and drop what the checkpoint
        covers, in one transaction. Returns the checkpoint's sequence number."""
        return self._flush(compact=True)

    # ---------------------------------------------------------------------------- ops
    # reserve ... dump come from RegistryOps through _dispatch; check_invariants is store-only.

    def check_invariants(self, full: bool = True) -> None:
        with self._mutex:
            self._check_usable()
            self._registry.check_invariants(full)

    def dispatch_many(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> list[Any]:
        """Decide ``calls`` in order, then wait until every transition they made (and every
        one they could observe) is durable: one group, at most one commit. Each entry of the
        answer is the op's result, or the :class:`LoraVersionError` that refused it (as a
        value); an operational failure (a broken store) raises for the whole batch."""
        outcomes: list[Any] = []
        with self._mutex:
            self._check_usable()
            for op, kwargs in calls:
                try:
                    outcomes.append(self._decide(op, stamp_now(op, kwargs)))
                except LoraVersionError as exc:
                    outcomes.append(exc)
                except TypeError as exc:  # wrong arguments: refused before any change
                    outcomes.append(LoraVersionError(ErrorCode.INVALID_REQUEST, f"{op}: {exc}"))
            seen = self._registry.seq
        self._flush(until=seen)
        return outcomes

    # -------------------------------------------------------------------------- helpers

    def _check_usable(self) -> None:
        if self._closed:
            raise StoreError(f"registry store {self.path} is closed")
        if self._broken:
            raise StoreBrokenError(f"a commit to {self.path} failed earlier; reopen the store")

    def _dispatch(self, op: str, /, **kwargs: Any) -> Any:
        (outcome,) = self.dispatch_many([(op, kwargs)])
        if isinstance(outcome, LoraVersionError):
            raise outcome
        return outcome

    def _decide(self, op: str, kwargs: dict[str, Any]) -> Any:
        """Run one op on the pure registry (lock held). A transition appends its journal row to
        the group being formed; a refusal raises having changed and appended nothing; soft ops
        and queries append nothing."""
        if op in DERIVED_OPS:  # expire_leases: journal the decision, never the clock
            due = self._registry.leases_due(kwargs["now"])
            return self._decide("end_leases", {"lease_ids": list(due)}) if due else ()
        before = self._registry.seq
        result = getattr(self._registry, op)(**kwargs)
        if self._registry.seq != before:
            assert op in MUTATING_OPS and self._registry.seq == before + 1, op
            # The journal keeps the call, not the caller's credential: replay supplies the token.
            args = {k: v for k, v in kwargs.items() if k != "publisher_token"}
            self._pending.append((self._registry.seq, op, dumps(args), dumps(result)))
        return result

    def _compaction_due(self) -> bool:
        return (
            self.compact_every is not None and self._registry.seq - self._compacted_at >= self.compact_every
        )

    def _flush(self, until: int | None = None, *, checkpoint: bool = False, compact: bool = False) -> int:
        """Group commit: make every transition up to ``until`` durable (all decided ones when
        None), as a leader writing the whole group formed so far, or as a follower waiting for
        the leader's group. The write happens outside the lock, so calls arriving meanwhile
        are decided and form the next group; no caller returns before its group is durable.
        ``checkpoint`` / ``compact`` add a state dump (and the journal prune) to the group."""
        forced = checkpoint or compact
        with self._mutex:
            target = self._registry.seq if until is None else until
            while True:
                self._check_usable()
                if self._durable >= target and not forced:
                    return self._durable
                if not self._flushing:
                    break
                self._mutex.wait()
            self._flushing = True
            try:
                compact = compact or self._compaction_due()
                if compact and self.session_window is not None:
                    self._decide("prune_sessions", {"keep_last": self.session_window})
                rows, upto = self._pending, self._registry.seq
                self._pending = []
                state = self._registry.dump() if (compact or checkpoint) else None
            except BaseException:
                self._flushing = False
                self._mutex.notify_all()
                raise
        statements: list[tuple[str, Sequence[Any]]] = [
            ("INSERT INTO journal(seq, op, args, result) VALUES (?, ?, ?, ?)", row) for row in rows
        ]
        if state is not None:
            statements.append(("INSERT OR REPLACE INTO checkpoint(seq, state) VALUES (?, ?)", (upto, state)))
        if compact:
            statements += [
                ("DELETE FROM journal WHERE seq <= ?", (upto,)),
                ("DELETE FROM checkpoint WHERE seq < ?", (upto,)),
            ]
        try:
            if statements:
                self._write_all(statements)  # marks the store broken on failure
        finally:
            with self._mutex:
                if not self._broken:
                    self._durable = upto
                    if compact:
                        self._compacted_at = upto
                        self.compactions += 1
                self._flushing = False
                self._mutex.notify_all()
        return upto

    def _write_all(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> None:
        """Run ``statements`` as one transaction: all of them are durable, or none."""
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            for sql, params in statements:
                self._conn.execute(sql, params)
            self._conn.execute("COMMIT")
            self.commits += 1
        except BaseException as exc:
            # The in-memory registry may be ahead of the disk now: refuse to go on, so no answer
            # is ever returned for a transition that is not durable.
            self._broken = True
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            raise StoreBrokenError(f"commit to {self.path} failed: {exc!r}; reopen the store") from exc


def read_registry(path: str | os.PathLike[str]) -> LoRAVersionRegistry:
    """A point-in-time copy of the registry in ``path``, read without the writer lock (for
    operators: ``lora-versions status`` while the trainer holds the registry). Opened read-only
    (WAL readers never block the writer); the copy is never written back."""
    path = Path(path)
    if not path.exists():
        raise StoreError(f"{path}: no registry database")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    try:
        conn.execute("BEGIN")  # one snapshot of the checkpoint and the journal after it
        try:
            if conn.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
                raise StoreMismatchError(f"{path} is not a LoRA version registry database")
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            fresh = LoRAVersionRegistry(
                meta["epoch"],
                tuple(loads(meta["engines"])),
                int(meta["capacity"]),
                debug_checks=False,
                publisher_token=meta.get(_TOKEN_KEY),  # a reader of the file holds it anyway
            )
            return _replay(conn, path, fresh)
        finally:
            conn.execute("ROLLBACK")
    finally:
        conn.close()


def _take_writer_lock(path: Path) -> int:
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreLockedError(
            f"{path} is already open by another registry writer (pid {holder}); "
            "only one writer per registry database is allowed"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _open_db(
    conn: sqlite3.Connection,
    path: Path,
    epoch: str | int,
    engines: Sequence[str],
    capacity: int,
    synchronous: str,
    must_exist: bool = False,
    publisher_token: str | None = None,
) -> LoRAVersionRegistry:
    # Constructing the registry first validates the arguments before the file is touched.
    token = publisher_token or new_publisher_token()
    fresh = LoRAVersionRegistry(epoch, engines, capacity, debug_checks=False, publisher_token=token)
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise StoreError(f"could not switch {path} to WAL mode (got {mode})")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA busy_timeout=1000")

    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if app_id == 0 and not tables:
        if must_exist:
            raise StoreMissingError(_missing(path))
        _create_schema(conn, fresh)
        return fresh
    if app_id != APPLICATION_ID or "meta" not in tables:
        raise StoreMismatchError(f"{path} is not a LoRA version registry database")
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    schema = int(meta.get("schema_version", "0"))
    if schema != SCHEMA_VERSION:
        newer = schema > SCHEMA_VERSION
        raise SchemaVersionError(
            f"{path} has registry schema {schema}, this code reads {SCHEMA_VERSION}"
            + ("; upgrade the code" if newer else "; no migration is defined")
        )
    expected = _meta_of(fresh)
    for field in ("epoch", "engines", "capacity"):
        if meta.get(field) != expected[field]:
            raise StoreMismatchError(
                f"{path} belongs to {field}={meta.get(field)}, not {expected[field]}: "
                "a new deployment epoch needs a new registry database"
            )
    stored = meta.get(_TOKEN_KEY)
    if stored is None:
        raise StoreMismatchError(f"{path} has no publisher token: not written by this module")
    if publisher_token is None:
        fresh = LoRAVersionRegistry(epoch, engines, capacity, debug_checks=False, publisher_token=stored)
    reg = _replay(conn, path, fresh)
    if reg.publisher_token != stored:  # the opener brought its own: from now on it is the file's
        conn.execute("UPDATE meta SET value = ? WHERE key = ?", (reg.publisher_token, _TOKEN_KEY))
    return reg


def _missing(path: Path) -> str:
    return (
        f"{path}: no registry database (missing or empty) where this registry's state must be; "
        "refusing to start an empty registry in its place (was the path changed, or the actor "
        "restarted on another node?)"
    )


def _meta_of(reg: LoRAVersionRegistry) -> dict[str, str]:
    return {
        "schema_version": str(SCHEMA_VERSION),
        "epoch": reg.epoch,
        "engines": dumps(list(reg.engines)),
        "capacity": str(reg.capacity),
    }


def _create_schema(conn: sqlite3.Connection, reg: LoRAVersionRegistry) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute(
            "CREATE TABLE journal (seq INTEGER PRIMARY KEY, op TEXT NOT NULL, "
            "args TEXT NOT NULL, result TEXT NOT NULL)"
        )
        conn.execute("CREATE TABLE checkpoint (seq INTEGER PRIMARY KEY, state TEXT NOT NULL)")
        rows = {**_meta_of(reg), _TOKEN_KEY: reg.publisher_token}
        conn.executemany("INSERT INTO meta(key, value) VALUES (?, ?)", sorted(rows.items()))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _replay(conn: sqlite3.Connection, path: Path, reg: LoRAVersionRegistry) -> LoRAVersionRegistry:
    """``reg`` (fresh, holding the file's publisher token) brought to the file's state."""
    row = conn.execute("SELECT seq, state FROM checkpoint ORDER BY seq DESC LIMIT 1").fetchone()
    if row is not None:
        reg = LoRAVersionRegistry.load(row[1], debug_checks=False, publisher_token=reg.publisher_token)
        if reg.seq != row[0]:
            raise JournalDivergenceError(f"{path}: checkpoint {row[0]} holds state of seq {reg.seq}")
    rows = conn.execute("SELECT seq, op, args, result FROM journal WHERE seq > ? ORDER BY seq", (reg.seq,))
    for seq, op, args, stored in rows:
        where = f"{path}: journal row {seq} ({op})"
        if op not in MUTATING_OPS:
            raise JournalDivergenceError(f"{where}: not a registry operation")
        kwargs = loads(args)
        if op in PUBLISHER_OPS:  # every journaled call was the publisher's: it was accepted
            kwargs["publisher_token"] = reg.publisher_token
        try:
            result = getattr(reg, op)(**kwargs)
        except LoraVersionError as exc:
            raise JournalDivergenceError(f"{where} is refused on replay: {exc}") from exc
        if reg.seq != seq:
            raise JournalDivergenceError(f"{where} replays to sequence {reg.seq}")
        if dumps(result) != stored:
            raise JournalDivergenceError(f"{where} replays to another answer than the one recorded")
    reg.check_invariants(full=True)
    return reg
