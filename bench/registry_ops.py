"""Registry throughput: in memory, durable (SQLite journal), and through the Ray actor.

Measures, in one run and on the same disk:

* ``pairs``  - bind_first + close_and_release of a fresh session (2 accepted transitions);
* ``cycles`` - a full publication and reclaim: reserve, READY x2, commit, claim_reclaim,
  UNLOADED x2 (7 accepted transitions), keeping capacity 2 busy the whole time;
* a bare SQLite ``INSERT + COMMIT`` loop with the same pragmas and a similar row size, the floor
  a durable registry can not beat (one commit per accepted transition);
* journal replay (reopen) speed, the price of the journal-replay design.

Prints a table and writes ``bench/results/registry_ops.json``. Every measurement is bounded by
``--seconds``; the whole run stays under a minute (Ray start-up included) unless told otherwise.

``--pairs N`` is the long run instead (issue 10, bounded growth): N bind/close pairs on a durable
store, once with automatic compaction (defaults: every 100,000 rows, 100,000-transition session
window) and once without; it reports the database size (file + WAL) as it grows and at the end,
and the throughput per tenth of the run (compactions included). Writes
``bench/results/registry_long.json``.

``--hold N`` is the held-sessions run instead (issue 42, docs/scale.md): N sessions opened and
bound under ``--leases`` worker leases and held, in memory and durable (FULL); with them held,
ops/s of a session's whole lifecycle (open, bind, close), a turn (a replayed bind of a held
session: the idempotent answer a worker that lost its binding gets; the session layer itself
calls nothing per turn), a lease keep-alive, the status read every publication makes and the
host's lease-reaper tick, each beside the same op with no session held; the registry state's
own bytes per held session (tracemalloc, a pass of its own), the process RSS, the journal's
size, a checkpoint (the full dump a compaction writes) and a reopen (replay). Writes
``bench/results/registry_hold.json``. Through the Ray actor: ``registry_rollout.py --hold``.

    python bench/registry_ops.py [--seconds 1.0] [--no-ray]
    python bench/registry_ops.py --pairs 1000000 [--synchronous NORMAL]
    python bench/registry_ops.py --hold 10000 [--leases 64]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import sqlite3
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from relax_glue.registry import LoRAVersionRegistry  # noqa: E402
from relax_glue.registry_types import (  # noqa: E402
    ReadyEvidence,
    SessionKey,
    UnloadEvidence,
    VersionKey,
)
from relax_glue.store import DurableRegistry  # noqa: E402

EPOCH = "1"
ENGINES = ("E0", "E1")
RESULTS = ROOT / "bench" / "results" / "registry_ops.json"


def _digest(vid: str) -> str:
    return hashlib.sha256(vid.encode()).hexdigest()


class Workload:
    """Drives any registry-shaped object (registry, durable store, actor client)."""

    def __init__(self, reg: Any) -> None:
        self.reg = reg
        # the publisher's token: a registry or store's own; a client fills in the one it carries
        self.auth = {"publisher_token": getattr(reg, "publisher_token", None)}
        self.n_versions = 0
        self.n_sessions = 0
        for engine in ENGINES:
            reg.register_engine_incarnation(engine, f"{engine}-i1", **self.auth)
        self.publish()

    def publish(self) -> VersionKey:
        vid = f"v{self.n_versions}"
        self.n_versions += 1
        key, dig = VersionKey(EPOCH, vid), _digest(vid)
        name = f"relax_policy_lora@{EPOCH}-{vid}-{dig[:12]}"
        res = self.reg.reserve(key, dig, name, f"req-{vid}", **self.auth)
        for engine in ENGINES:
            ready = ReadyEvidence(key, dig, res.attempt_token, f"{engine}-i1")
            self.reg.record_ready(engine, ready, **self.auth)
        self.reg.commit(key, res.attempt_token, self.n_versions - 1, **self.auth)
        return key

    def pair(self) -> None:
        sk = SessionKey(EPOCH, f"s{self.n_sessions}")
        self.n_sessions += 1
        self.reg.bind_first(sk)
        self.reg.close_and_release(sk)

    def cycle(self) -> None:
        retired = VersionKey(EPOCH, f"v{self.n_versions - 1}")
        self.publish()
        claim = self.reg.claim_reclaim(retired, **self.auth)
        for engine in ENGINES:
            unloaded = UnloadEvidence(claim.reclaim_id, f"{engine}-i1")
            self.reg.confirm_reclaim(retired, engine, unloaded, **self.auth)


def _timed(step: Callable[[], None], seconds: float, max_iters: int = 10**7) -> tuple[int, float]:
    n, start = 0, time.perf_counter()
    deadline = start + seconds
    while n < max_iters:
        step()
        n += 1
        if n % 8 == 0 and time.perf_counter() >= deadline:
            break
    return n, time.perf_counter() - start


def _row(backend: str, op: str, n: int, elapsed: float, transitions: int, note: str = "") -> dict[str, Any]:
    rate = n / elapsed
    return {
        "backend": backend,
        "op": op,
        "iterations": n,
        "seconds": round(elapsed, 3),
        "per_second": round(rate, 1),
        "transitions_per_second": round(rate * transitions, 1),
        "us_per_iteration": round(1e6 / rate, 1),
        "note": note,
    }


class _Acc:
    """Iterations and time summed over interleaved slices."""

    def __init__(self) -> None:
        self.n, self.t = 0, 0.0

    def add(self, n_t: tuple[int, float]) -> None:
        self.n += n_t[0]
        self.t += n_t[1]


def _bare_sqlite(tmp: Path, synchronous: str) -> Callable[[], None]:
    conn = sqlite3.connect(tmp / f"bare-{synchronous}.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("CREATE TABLE journal (seq INTEGER PRIMARY KEY, op TEXT, args TEXT, result TEXT)")
    payload = "x" * 300  # about the size of an encoded bind_first row
    seq = iter(range(1, 10**9))

    def step() -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO journal VALUES (?, ?, ?, ?)", (next(seq), "op", payload, payload))
        conn.execute("COMMIT")

    return step


def bench_durable(tmp: Path, seconds: float, synchronous: str, rounds: int = 3) -> list[dict[str, Any]]:
    """Bare commits and durable registry ops in interleaved slices: fsync latency on a shared
    disk drifts a lot within seconds, so only measurements taken side by side are comparable."""
    bare_step = _bare_sqlite(tmp, synchronous)
    path = tmp / f"registry-{synchronous}.db"
    bare, pairs, cycles = _Acc(), _Acc(), _Acc()
    with DurableRegistry.open(path, EPOCH, ENGINES, 2, synchronous=synchronous) as store:
        work = Workload(store)
        for _ in range(rounds):
            bare.add(_timed(bare_step, seconds / rounds))
            pairs.add(_timed(work.pair, seconds / rounds))
            cycles.add(_timed(work.cycle, seconds / rounds))
    name = f"durable ({synchronous})"
    rows = [
        _row(f"bare sqlite ({synchronous})", "INSERT+COMMIT", bare.n, bare.t, 1),
        _row(name, "bind_first+close_and_release", pairs.n, pairs.t, 2),
        _row(name, "publish/commit/reclaim cycle", cycles.n, cycles.t, 7),
    ]
    if synchronous == "FULL":
        rows.append(bench_replay(path))
    return rows


def bench_backend(name: str, reg: Any, seconds: float) -> list[dict[str, Any]]:
    work = Workload(reg)
    rows = [_row(name, "bind_first+close_and_release", *_timed(work.pair, seconds), 2)]
    rows.append(_row(name, "publish/commit/reclaim cycle", *_timed(work.cycle, seconds), 7))
    return rows


def bench_replay(path: Path) -> dict[str, Any]:
    start = time.perf_counter()
    with DurableRegistry.open(path, EPOCH, ENGINES, 2, debug_checks=False) as store:
        n = store.seq
    elapsed = time.perf_counter() - start
    return _row("durable reopen", "journal replay", n, elapsed, 1, note=f"{n} journal rows")


def bench_ray(tmp: Path, seconds: float) -> tuple[list[dict[str, Any]], str]:
    try:
        import ray
    except ImportError:
        return [], "ray not installed: actor rows skipped (pip install '.[ray]')"
    from relax_glue.actor import RegistryClient, new_publisher_token, start_registry_actor

    start = time.perf_counter()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    init_s = time.perf_counter() - start
    rows: list[dict[str, Any]] = []
    try:
        for label, db in (("ray actor (memory)", None), ("ray actor (durable FULL)", tmp / "actor.db")):
            token = new_publisher_token()
            handle = start_registry_actor(
                EPOCH, ENGINES, db_path=db, name=f"bench-{label}", publisher_token=token
            )
            rows += bench_backend(label, RegistryClient.for_actor(handle, publisher_token=token), seconds / 2)
            ray.kill(handle)
    finally:
        ray.shutdown()
    return rows, f"ray.init took {init_s:.1f}s (not counted)"


def _db_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())


def bench_long(tmp: Path, pairs: int, synchronous: str, compact: bool) -> dict[str, Any]:
    """``pairs`` bind/close pairs on one durable store; size and rate per tenth of the run."""
    path = tmp / f"long-{'compact' if compact else 'plain'}.db"
    settings: dict[str, Any] = {} if compact else {"compact_every": None, "session_window": None}
    tenths: list[dict[str, Any]] = []
    with DurableRegistry.open(
        path, EPOCH, ENGINES, 2, synchronous=synchronous, debug_checks=False, **settings
    ) as store:
        work = Workload(store)
        step = max(1, pairs // 10)
        t0 = time.perf_counter()
        for tenth in range(10):
            start = time.perf_counter()
            n = step if tenth < 9 else pairs - 9 * step
            for _ in range(n):
                work.pair()
            elapsed = time.perf_counter() - start
            tenths.append(
                {
                    "pairs_done": work.n_sessions,
                    "pairs_per_second": round(n / elapsed, 1),
                    "db_bytes": _db_bytes(path),
                    "session_records": sum(store.status().sessions.values()),
                }
            )
            print(
                f"  {'compacting' if compact else 'plain':<10} {work.n_sessions:>9} pairs  "
                f"{n / elapsed:>8.0f} pairs/s  db {_db_bytes(path) / 2**20:>8.1f} MiB  "
                f"sessions kept {tenths[-1]['session_records']:>8}",
                flush=True,
            )
        total = time.perf_counter() - t0
        compactions = store.compactions
    reopen_start = time.perf_counter()
    with DurableRegistry.open(path, EPOCH, ENGINES, 2, debug_checks=False, **settings):
        pass
    return {
        "compaction": compact,
        "pairs": pairs,
        "synchronous": synchronous,
        "seconds": round(total, 1),
        "pairs_per_second": round(pairs / total, 1),
        "compactions": compactions,
        "final_db_bytes": _db_bytes(path),
        "max_db_bytes": max(t["db_bytes"] for t in tenths),
        "reopen_s": round(time.perf_counter() - reopen_start, 2),
        "tenths": tenths,
    }


def main_long(pairs: int, synchronous: str, out: Path) -> None:
    runs = []
    with tempfile.TemporaryDirectory(prefix="registry-long-", dir=ROOT / "bench") as tmp_name:
        for compact in (True, False):
            runs.append(bench_long(Path(tmp_name), pairs, synchronous, compact))
    print(
        f"\n{'compaction':<11} {'pairs':>9} {'pairs/s':>9} {'first 10%':>10} {'last 10%':>9} "
        f"{'final db':>10} {'max db':>10} {'reopen':>7}"
    )
    for r in runs:
        print(
            f"{'on' if r['compaction'] else 'off':<11} {r['pairs']:>9} {r['pairs_per_second']:>9.0f} "
            f"{r['tenths'][0]['pairs_per_second']:>10.0f} {r['tenths'][-1]['pairs_per_second']:>9.0f} "
            f"{r['final_db_bytes'] / 2**20:>8.1f}Mi {r['max_db_bytes'] / 2**20:>8.1f}Mi "
            f"{r['reopen_s']:>6.1f}s"
        )
    out = out.with_name("registry_long.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "sqlite": sqlite3.sqlite_version, "cpus": os.cpu_count()}
    out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=2) + "\n")
    print(f"wrote {out}")


# ------------------------------------------------------------------------- held sessions


class Holder:
    """Sessions opened and bound on ``leases`` worker leases (one per rollout worker, as the
    session layer holds them) and held, and the ops a rollout makes meanwhile. One session is
    held from the start (a turn replays a held session's bind)."""

    TTL_S = 3600.0  # nobody renews every lease of this bench: none may run out during it

    def __init__(self, reg: Any, leases: int, prefix: str = "held", seed: int = 0) -> None:
        self.reg, self.prefix = reg, prefix
        self.leases = [f"{prefix}.worker{i}" for i in range(leases)]
        self.held: list[SessionKey] = []
        self.fresh = 0
        self.rng = random.Random(seed)
        for lease in self.leases:
            reg.grant_lease(lease, self.TTL_S, time.time())
        self.hold(1)

    def hold(self, n: int) -> None:
        for _ in range(n):
            key = SessionKey(EPOCH, f"{self.prefix}{len(self.held)}")
            self.reg.open_session(key, lease_id=self.leases[len(self.held) % len(self.leases)])
            self.reg.bind_first(key)
            self.held.append(key)

    def lifecycle(self) -> None:
        """A fresh session's open, bind and idle close: three transitions."""
        key = SessionKey(EPOCH, f"{self.prefix}.fresh{self.fresh}")
        self.fresh += 1
        self.reg.open_session(key, lease_id=self.rng.choice(self.leases))
        self.reg.bind_first(key)
        self.reg.close_and_release(key)

    def turn(self) -> None:
        """A replayed bind of a held session: the binding it has, no transition."""
        self.reg.bind_first(self.rng.choice(self.held))

    def keep_alive(self) -> None:
        self.reg.keep_alive(self.rng.choice(self.leases), time.time())

    def status(self) -> None:
        self.reg.status()

    def reap(self) -> None:
        """The host's reaper tick: end the leases that ran out (none here)."""
        self.reg.expire_leases(time.time())

    def close_all(self) -> int:
        for key in self.held:
            self.reg.close_and_release(key)
        closed, self.held = len(self.held), []
        return closed


# In this order: a lifecycle leaves a CLOSED record behind (kept until a compaction prunes it),
# and status() counts every record, so the lifecycles come last and their records are pruned
# before the next round.
HOLD_OPS: tuple[tuple[str, int], ...] = (
    ("status", 0),  # every publication reads it (a scan of every session record)
    ("reap", 0),  # the host's tick, every second
    ("keep_alive", 0),  # soft state: no transition
    ("turn", 0),  # a replayed bind: no transition
    ("lifecycle", 3),  # open_session + bind_first + close_and_release
)


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _state_bytes(hold: int, leases: int) -> dict[str, Any]:
    """What the registry's own state holds per held session: tracemalloc's count of the Python
    allocations made while ``hold`` sessions were opened and bound (one pass of its own: tracing
    slows every op)."""
    import gc

    gc.collect()
    tracemalloc.start()
    reg = LoRAVersionRegistry(EPOCH, ENGINES, 2)
    Workload(reg)
    holder = Holder(reg, leases)
    before = tracemalloc.get_traced_memory()[0]
    holder.hold(hold - 1)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "traced_bytes": after - before,
        "traced_bytes_per_session": round((after - before) / (hold - 1), 1),
    }


def bench_hold(name: str, reg: Any, hold: int, leases: int, seconds: float) -> dict[str, Any]:
    """Each op's rate with one session held, then with ``hold`` held; the hold's own rate, the
    RSS it adds, and the close of every held session."""
    Workload(reg)
    holder = Holder(reg, leases)
    rows: list[dict[str, Any]] = []

    def measure() -> None:
        for op, transitions in HOLD_OPS:
            row = _row(name, op, *_timed(getattr(holder, op), seconds), max(transitions, 1))
            row["held"] = len(holder.held)
            row["transitions"] = transitions
            rows.append(row)
        reg.prune_sessions(1)  # the lifecycles' CLOSED records (a compaction's prune)

    measure()
    rss0, t0 = _rss(), time.perf_counter()
    holder.hold(hold - len(holder.held))
    hold_s = time.perf_counter() - t0
    rss1 = _rss()
    measure()
    t0 = time.perf_counter()
    closed = holder.close_all()
    close_s = time.perf_counter() - t0
    return {
        "backend": name,
        "held": hold,
        "leases": leases,
        "hold_ops_per_second": round(2 * (hold - 1) / hold_s, 1),  # open_session + bind_first each
        "hold_seconds": round(hold_s, 2),
        "rss_added_bytes": rss1 - rss0,
        "rss_added_bytes_per_session": round((rss1 - rss0) / (hold - 1), 1),
        "close_ops_per_second": round(closed / close_s, 1),
        "rows": rows,
    }


def main_hold(hold: int, leases: int, seconds: float, out: Path) -> None:
    report: dict[str, Any] = {
        "meta": {
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "seconds_per_measurement": seconds,
        },
        "state": _state_bytes(hold, leases),
        "runs": [],
    }
    report["runs"].append(bench_hold("memory", LoRAVersionRegistry(EPOCH, ENGINES, 2), hold, leases, seconds))
    with tempfile.TemporaryDirectory(prefix="registry-hold-", dir=ROOT / "bench") as tmp_name:
        normal = Path(tmp_name) / "hold-normal.db"
        with DurableRegistry.open(normal, EPOCH, ENGINES, 2, synchronous="NORMAL") as store:
            report["runs"].append(bench_hold("durable (NORMAL)", store, hold, leases, seconds))
        path = Path(tmp_name) / "hold.db"
        with DurableRegistry.open(path, EPOCH, ENGINES, 2, synchronous="FULL") as store:
            run = bench_hold("durable (FULL)", store, hold, leases, seconds)
            # the held state again (the first ones are closed now), for what the journal, a
            # checkpoint (the full dump a compaction writes) and a reopen cost with it
            Holder(store, leases, prefix="again").hold(hold - 1)
            run["db_bytes_with_held"] = _db_bytes(path)
            t0 = time.perf_counter()
            store.checkpoint()
            run["checkpoint_ms_with_held"] = round(1e3 * (time.perf_counter() - t0), 1)
            run["dump_bytes_with_held"] = len(store.dump())
        t0 = time.perf_counter()
        with DurableRegistry.open(path, EPOCH, ENGINES, 2, debug_checks=False) as store:
            run["reopen_s_with_held"] = round(time.perf_counter() - t0, 2)
            run["sessions_after_reopen"] = store.status().sessions
        report["runs"].append(run)
    _print_hold(report)
    out = out.with_name("registry_hold.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


def _print_hold(report: dict[str, Any]) -> None:
    st = report["state"]
    print(f"registry state: {st['traced_bytes_per_session']:.0f} bytes per held session (tracemalloc)")
    header = f"{'backend':<16} {'op':<12} {'held':>7} {'ops/s':>10} {'us/op':>9}"
    print(header)
    print("-" * len(header))
    for run in report["runs"]:
        for r in run["rows"]:
            print(
                f"{run['backend']:<16} {r['op']:<12} {r['held']:>7} {r['per_second']:>10.0f} "
                f"{r['us_per_iteration']:>9.1f}"
            )
        print(
            f"{run['backend']}: hold {run['held']} sessions on {run['leases']} leases at "
            f"{run['hold_ops_per_second']:.0f} ops/s; RSS +{run['rss_added_bytes_per_session']:.0f} "
            f"B/session; close {run['close_ops_per_second']:.0f} ops/s"
        )
        if "db_bytes_with_held" in run:
            print(
                f"  journal {run['db_bytes_with_held'] / 2**20:.1f} MiB, checkpoint "
                f"{run['checkpoint_ms_with_held']} ms ({run['dump_bytes_with_held'] / 2**20:.1f} MiB dump), "
                f"reopen {run['reopen_s_with_held']} s"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="time budget per measurement")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray actor rows")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--pairs", type=int, default=0, help="the long bounded-growth run instead")
    parser.add_argument("--synchronous", default="NORMAL", help="sqlite synchronous mode of the long run")
    parser.add_argument("--hold", type=int, default=0, help="the held-sessions run instead (N sessions)")
    parser.add_argument("--leases", type=int, default=64, help="worker leases the held sessions hang on")
    args = parser.parse_args()
    if args.pairs:
        main_long(args.pairs, args.synchronous, args.out)
        return
    if args.hold:
        main_hold(args.hold, args.leases, args.seconds, args.out)
        return

    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="registry-bench-", dir=ROOT / "bench") as tmp_name:
        tmp = Path(tmp_name)
        rows += bench_backend("memory", LoRAVersionRegistry(EPOCH, ENGINES, 2), args.seconds)
        no_checks = LoRAVersionRegistry(EPOCH, ENGINES, 2, debug_checks=False)
        rows += bench_backend("memory (no debug checks)", no_checks, args.seconds)
        for sync in ("FULL", "NORMAL"):
            rows += bench_durable(tmp, 2 * args.seconds, sync)
        if args.no_ray:
            notes.append("Ray actor rows skipped (--no-ray)")
        else:
            ray_rows, note = bench_ray(tmp, args.seconds)
            rows += ray_rows
            notes.append(note)

    # the durable/actor-durable rows next to the bare commit loop of the same synchronous mode
    bare = {
        r["backend"].split("(")[1].rstrip(")"): r["per_second"]
        for r in rows
        if r["backend"].startswith("bare")
    }
    for r in rows:
        mode = "FULL" if "FULL" in r["backend"] else "NORMAL" if "NORMAL" in r["backend"] else None
        if mode and not r["backend"].startswith("bare") and r["op"] != "journal replay":
            r["vs_bare_commit"] = round(r["transitions_per_second"] / bare[mode], 2)

    _print(rows, notes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "seconds_per_measurement": args.seconds,
    }
    args.out.write_text(json.dumps({"meta": meta, "notes": notes, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


def _print(rows: list[dict[str, Any]], notes: list[str]) -> None:
    header = f"{'backend':<26} {'op':<30} {'ops/s':>10} {'trans/s':>10} {'us/op':>9} {'vs bare':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = f"{r['vs_bare_commit']:.2f}" if "vs_bare_commit" in r else ""
        print(
            f"{r['backend']:<26} {r['op']:<30} {r['per_second']:>10.0f} {r['transitions_per_second']:>10.0f} "
            f"{r['us_per_iteration']:>9.1f} {ratio:>8}"
        )
    for note in notes:
        print(f"note: {note}")
    print("vs bare = accepted transitions/s divided by bare INSERT+COMMIT/s of the same synchronous mode")


if __name__ == "__main__":
    main()
