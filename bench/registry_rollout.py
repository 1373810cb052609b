"""The registry at rollout scale, through the real Ray actor (issue 26's "before" and "after").

Several rollout-worker processes (``--workers``), each with ``--sessions`` concurrent sessions,
drive the durable registry actor as the session layer does with leases on: one lease per worker
renewed by a heartbeat; per session open, bind, ``--turns`` turns with no registry call, then
close_and_release (an idle session's close). A publisher in the driver keeps a default published.
Each worker reports per-op latencies; the driver reports ops/s, session lifecycles/s, p50/p99 per
op, and the actor's CPU time over the run (from its /proc entry, so what the single writer costs is
seen beside what the calls wait).

``--profile`` also records the actor process with py-spy for the run (``--profile-out``, a
speedscope/flame file and the top frames' share) to say where its time goes.

``--hold N`` (issue 42, docs/scale.md): before the timed run the workers open and bind N sessions
between them (N / workers each, on their one lease) and hold them through it; each turn of the
churning sessions is then one replayed bind of a random held session (a registry call the
session layer itself does not make per turn: the worst case), and the held sessions are closed
after it. Reported besides: the hold's and the close's ops/s, the actor's RSS before the hold,
with the sessions held and after their close (from its /proc entry), and the latency of the
status read each publication makes, with them held.

Prints a table and writes ``bench/results/registry_rollout.json``.

    python bench/registry_rollout.py [--workers 4] [--sessions 16] [--turns 4] [--seconds 10]
    python bench/registry_rollout.py --profile
    python bench/registry_rollout.py --hold 10000 --workers 4 --sessions 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EPOCH = "1"  # registry_ops.Workload's, which publishes the default
ENGINES = ("E0", "E1")
RESULTS = ROOT / "bench" / "results" / "registry_rollout.json"
LEASE_TTL_S = 30.0
HEARTBEAT_S = 1.0  # faster than the session layer's TTL / 3, so renewals show in a short run
ACTOR_NAME = "bench-registry-rollout"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


HOLD_CONCURRENCY = 256  # a worker's hold and close calls in flight at once


async def _worker_main(
    gcs: str,
    n_sessions: int,
    turns: int,
    seconds: float,
    tag: str,
    batch: bool,
    once: bool,
    turn_ms: float,
    hold: int = 0,
    ready: Any = None,
    go: Any = None,
) -> dict[str, Any]:
    import ray

    from relax_glue.actor import AsyncRegistryClient, get_registry_actor
    from relax_glue.registry_types import SessionKey

    ray.init(address=gcs, log_to_driver=False)
    client = AsyncRegistryClient.for_actor(get_registry_actor(EPOCH, name=ACTOR_NAME), batch=batch, retries=0)
    await client.connect()
    lat: dict[str, list[float]] = defaultdict(list)
    lifecycles = 0
    turn_calls = 0  # registry calls made on a turn after the bind (the session layer makes none)
    deadline = time.monotonic() + seconds

    async def call(op: str, label: str | None = None, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = await getattr(client, op)(**kw)
        lat[label or op].append((time.perf_counter() - t0) * 1e3)
        return out

    # the session layer's shape: one lease per worker, renewed by a heartbeat, never per turn
    lease_id = f"worker.{tag}.{uuid.uuid4().hex[:8]}"
    await call("grant_lease", lease_id=lease_id, ttl_s=LEASE_TTL_S)

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await call("keep_alive", lease_id=lease_id)

    held: list[Any] = []
    rng = random.Random(tag)

    async def session_loop(i: int) -> None:
        nonlocal lifecycles, turn_calls
        while time.monotonic() < deadline:
            key = SessionKey(EPOCH, f"{tag}.{i}.{uuid.uuid4().hex[:8]}")
            await call("open_session", session_key=key, lease_id=lease_id)
            await call("bind_first", session_key=key)
            for _ in range(turns):  # a turn: generation and tools, no registry call
                if held:  # --hold: the worst case, a replayed bind of a held session per turn
                    await call("bind_first", "turn (replayed bind)", session_key=rng.choice(held))
                    turn_calls += 1
                await asyncio.sleep(turn_ms / 1e3)
            # an idle session's close (its last turn done) is one call (Session._close_once)
            await call("close_and_release", session_key=key)
            lifecycles += 1
            if once:
                return

    async def bounded(jobs: list[Any]) -> float:
        gate = asyncio.Semaphore(HOLD_CONCURRENCY)

        async def one(job: Any) -> None:
            async with gate:
                await job

        t = time.monotonic()
        await asyncio.gather(*(one(j) for j in jobs))
        return time.monotonic() - t

    async def open_held(key: Any) -> None:
        await call("open_session", "open_session (hold)", session_key=key, lease_id=lease_id)
        await call("bind_first", "bind_first (hold)", session_key=key)
        held.append(key)

    beat = asyncio.ensure_future(heartbeat())
    hold_s = close_s = 0.0
    if hold:
        keys = [SessionKey(EPOCH, f"{tag}.held.{j}") for j in range(hold)]
        hold_s = await bounded([open_held(k) for k in keys])
        ready.put(tag)
        await asyncio.to_thread(go.wait)  # every worker holds its share: the run starts together
        deadline = time.monotonic() + seconds
    t0 = time.monotonic()
    await asyncio.gather(*(session_loop(i) for i in range(n_sessions)))
    elapsed = time.monotonic() - t0
    if hold:
        closing = [call("close_and_release", "close_and_release (hold)", session_key=k) for k in held]
        held = []
        close_s = await bounded(closing)
    beat.cancel()
    sends = getattr(getattr(client._acall, "__self__", None), "sends", None)
    ray.shutdown()
    return {
        "lat": dict(lat),
        "lifecycles": lifecycles,
        "elapsed_s": elapsed,
        "turn_calls": turn_calls,
        "actor_calls": sends,
        "hold_s": hold_s,
        "close_s": close_s,
    }


def _worker(out: Any, *args: Any) -> None:
    out.put(asyncio.run(_worker_main(*args)))


class _Publisher:
    """The trainer beside the rollouts: publishes a new default every ``every_s`` and reclaims
    each retired version once its sessions have closed (capacity 2: a publication needs the
    retired one reclaimed first). Through the same actor, on a thread of the driver."""

    def __init__(self, workload: Any, every_s: float) -> None:
        import threading

        self.workload, self.every_s = workload, every_s
        self.published = self.reclaimed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        if self.every_s > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        from lora_contract.errors import LoraVersionError
        from relax_glue.registry_types import UnloadEvidence, VersionState

        reg = self.workload.reg
        while not self._stop.wait(self.every_s):
            for v in reg.status().versions:
                if v.state is VersionState.RETIRED and v.session_refs == 0:
                    try:
                        claim = reg.claim_reclaim(v.version_key)  # the client carries the token
                        for engine in ENGINES:
                            reg.confirm_reclaim(
                                v.version_key, engine, UnloadEvidence(claim.reclaim_id, f"{engine}-i1")
                            )
                        self.reclaimed += 1
                    except LoraVersionError:
                        pass  # a session bound it meanwhile: next tick
            try:
                self.workload.publish()
                self.published += 1
            except LoraVersionError:
                self.workload.n_versions -= 1  # CAPACITY_ERROR: the retired one still has sessions


def _start_profile(args: Any, actor_pid: int) -> subprocess.Popen[str] | None:
    """py-spy on the actor for the run (``--profile``), started just before it."""
    if not args.profile:
        return None
    args.profile_out.parent.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("py-spy")),
            "record",
            "--pid",
            str(actor_pid),
            "--format",
            "raw",
            "--output",
            f"{args.profile_out}.txt",
            "--duration",
            str(int(args.seconds) + 2),
            "--rate",
            "200",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    return spy


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _held_figures(reg: Any, actor_pid: int, rss_before: int, t0: float, held: int) -> dict[str, Any]:
    """With every worker's share held: how long the hold took, the actor's RSS, and what the
    status read each publication makes costs (through the actor, five times)."""
    hold_s = time.monotonic() - t0
    rss = _rss_bytes(actor_pid)
    status_ms = []
    for _ in range(5):
        s0 = time.perf_counter()
        status = reg.status()
        status_ms.append((time.perf_counter() - s0) * 1e3)
    return {
        "sessions": held,
        "sessions_open_in_registry": status.sessions.get("OPEN"),
        "hold_s": round(hold_s, 2),
        "hold_ops_per_s": round(2 * held / hold_s, 1),  # open_session + bind_first each
        "rss_before_bytes": rss_before,
        "rss_held_bytes": rss,
        "rss_per_held_session_bytes": round((rss - rss_before) / held, 1),
        "status_ms_p50": round(sorted(status_ms)[len(status_ms) // 2], 2),
    }


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=16, help="concurrent sessions per worker")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--synchronous", default="FULL")
    parser.add_argument("--no-batch", action="store_true", help="one actor call per registry call")
    parser.add_argument("--once", action="store_true", help="each session runs one lifecycle (a cohort run)")
    parser.add_argument("--turn-ms", type=float, default=0.0, help="simulated generation time per turn")
    parser.add_argument("--publish-every-s", type=float, default=1.0, help="publisher cadence (0: none)")
    parser.add_argument("--hold", type=int, default=0, help="sessions held by the workers through the run")
    parser.add_argument("--profile", action="store_true", help="py-spy record the actor process")
    parser.add_argument("--profile-out", type=Path, default=ROOT / "bench" / "results" / "registry_actor")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import ray

    from relax_glue.actor import new_publisher_token, start_registry_actor

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        address="local",  # a Ray instance of its own, also when another one runs on this host
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    gcs = ray.get_runtime_context().gcs_address
    tmp = Path(tempfile.mkdtemp(prefix="registry-rollout-"))
    token = new_publisher_token()  # this process publishes; the worker processes hold no token
    handle = start_registry_actor(
        EPOCH,
        ENGINES,
        db_path=tmp / "registry.db",
        name=ACTOR_NAME,
        synchronous=args.synchronous,
        publisher_token=token,
    )
    actor_pid = int(ray.get(handle.describe.remote())["pid"])
    # one published default for the sessions to bind, committed as a publisher would
    from registry_ops import EPOCH as OPS_EPOCH
    from registry_ops import Workload

    from relax_glue.actor import RegistryClient

    assert OPS_EPOCH == EPOCH
    workload = Workload(RegistryClient.for_actor(handle, publisher_token=token))

    spy = None if args.hold else _start_profile(args, actor_pid)  # with --hold: once they are held
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # --hold: the workers report their share held on ``ready`` and start the run on ``go``
    ready, go = (ctx.Queue(), ctx.Event()) if args.hold else (None, None)
    rss_before = _rss_bytes(actor_pid)
    cpu0, t0 = _cpu_s(actor_pid), time.monotonic()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                out,
                gcs,
                args.sessions,
                args.turns,
                args.seconds,
                f"w{i}",
                not args.no_batch,
                args.once,
                args.turn_ms,
                args.hold // args.workers,
                ready,
                go,
            ),
        )
        for i in range(args.workers)
    ]
    commits0 = ray.get(handle.describe.remote())["commits"]
    for p in procs:
        p.start()
    held: dict[str, Any] = {}
    if args.hold:
        for _ in procs:
            ready.get(timeout=1200)
        total = args.hold // args.workers * args.workers
        held = _held_figures(workload.reg, actor_pid, rss_before, t0, total)
        cpu0, t0 = _cpu_s(actor_pid), time.monotonic()
        commits0 = ray.get(handle.describe.remote())["commits"]
        spy = _start_profile(args, actor_pid)  # the run with the sessions held, not their hold
        go.set()
    publisher = _Publisher(workload, args.publish_every_s)
    publisher.start()
    results = [out.get(timeout=args.seconds + 600) for _ in procs]
    publisher.stop()
    for p in procs:
        p.join(60)
    wall, cpu = time.monotonic() - t0, _cpu_s(actor_pid) - cpu0
    commits = ray.get(handle.describe.remote())["commits"] - commits0  # the publisher's included
    if spy is not None:
        _, err = spy.communicate(timeout=120)
        if spy.returncode != 0:
            print(f"py-spy failed: {err[-500:]}", file=sys.stderr)

    lat: dict[str, list[float]] = defaultdict(list)
    for r in results:
        for op, v in r["lat"].items():
            lat[op].extend(v)
    if args.hold:
        held["rss_after_close_bytes"] = _rss_bytes(actor_pid)
        held["close_ops_per_s"] = round(
            len(lat.get("close_and_release (hold)", [])) / max(r["close_s"] for r in results), 1
        )
    # the run's own ops (the hold's opens and binds, and their closes, are reported apart)
    window = {op: v for op, v in lat.items() if not op.endswith("(hold)")}
    elapsed = max(r["elapsed_s"] for r in results)
    ops = sum(len(v) for v in window.values())
    lifecycles = sum(r["lifecycles"] for r in results)
    every = [x for v in window.values() for x in v]
    renewals = len(lat.get("keep_alive", []))
    # every other op of a lifecycle journals one row (a renewal and a replayed bind none)
    writes = ops - renewals - len(lat.get("turn (replayed bind)", []))
    report = {
        "workers": args.workers,
        "sessions_per_worker": args.sessions,
        "concurrent_sessions": args.workers * args.sessions,
        "turns": args.turns,
        "synchronous": args.synchronous,
        "seconds": round(elapsed, 2),
        "ops_per_s": round(ops / elapsed, 1),
        "lifecycles_per_s": round(lifecycles / elapsed, 1),
        "p50_ms": round(_pct(every, 0.5), 2),
        "p99_ms": round(_pct(every, 0.99), 2),
        "actor_cpu_share": round(cpu / wall, 3),
        "batched": not args.no_batch,
        "turn_ms": args.turn_ms,
        "actor_calls": sum(r["actor_calls"] or 0 for r in results) or None,
        "commits": commits,
        "fsyncs_per_op": round(commits / ops, 4) if ops else None,
        "fsyncs_per_journaled_op": round(commits / writes, 4) if writes else None,
        "renewals": renewals,
        "registry_calls_on_turns": sum(r["turn_calls"] for r in results),
        "publications": publisher.published,
        "reclaims": publisher.reclaimed,
        "per_op": {
            op: {"n": len(v), "p50_ms": round(_pct(v, 0.5), 2), "p99_ms": round(_pct(v, 0.99), 2)}
            for op, v in sorted(lat.items())
        },
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    if args.hold:
        report["held"] = held
    if spy is not None:
        report["profile"] = _profile_summary(Path(f"{args.profile_out}.txt"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    _print(report)
    ray.kill(handle, no_restart=True)
    ray.shutdown()


# Where the actor's samples land: by the innermost frame that names a layer (every stack runs
# inside Ray's worker loop, so the outermost match would say "ray" for all of them).
_BUCKETS = (
    ("idle (waiting for a call)", ("threading.py", "Worker.main_loop (ray/_private/worker.py")),
    ("sqlite (commit, fsync)", ("sqlite3", "relax_glue/store.py")),
    ("registry (pure, incl. invariant checks)", ("relax_glue/registry.py", "relax_glue/registry_types.py")),
    ("ray (call, serialisation)", ("ray/", "_raylet", "msgpack", "cloudpickle")),
)


def _profile_summary(raw: Path) -> dict[str, Any]:
    """Share of the actor's samples by layer (py-spy ``raw``: ``frame;frame;... count``), and the
    10 leaf frames with the most samples."""
    if not raw.exists():
        return {"error": f"no profile written at {raw}"}
    layers: dict[str, int] = defaultdict(int)
    leaves: dict[str, int] = defaultdict(int)
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        leaves[frames[-1]] += n
        layer = next(
            (name for f in reversed(frames) for name, needles in _BUCKETS if any(k in f for k in needles)),
            "other",
        )
        layers[layer] += n
    return {
        "samples": total,
        "layers": {k: round(v / total, 3) for k, v in sorted(layers.items(), key=lambda kv: -kv[1])},
        "top_leaves": [
            {"frame": f, "share": round(n / total, 3)}
            for f, n in sorted(leaves.items(), key=lambda kv: -kv[1])[:10]
        ],
    }


def _print(r: dict[str, Any]) -> None:
    print(
        f"\nregistry through the Ray actor: {r['workers']} workers x {r['sessions_per_worker']} sessions "
        f"({r['concurrent_sessions']} concurrent), {r['turns']} turns, synchronous={r['synchronous']}"
    )
    print(f"{'ops/s':>10} {'lifecycles/s':>13} {'p50 ms':>8} {'p99 ms':>8} {'actor CPU':>10}")
    print(
        f"{r['ops_per_s']:>10} {r['lifecycles_per_s']:>13} {r['p50_ms']:>8} {r['p99_ms']:>8} "
        f"{r['actor_cpu_share']:>10.0%}"
    )
    print(
        f"fsyncs/op {r['fsyncs_per_op']}  fsyncs/journaled op {r['fsyncs_per_journaled_op']}  "
        f"renewals {r['renewals']} (0 fsync each)  registry calls on turns {r['registry_calls_on_turns']}  "
        f"actor calls {r['actor_calls']}  publications {r['publications']}  reclaims {r['reclaims']}"
    )
    if "held" in r:
        h = r["held"]
        print(
            f"held {h['sessions']} sessions (registry: {h['sessions_open_in_registry']} OPEN): hold "
            f"{h['hold_ops_per_s']} ops/s, close {h['close_ops_per_s']} ops/s; actor RSS "
            f"{h['rss_before_bytes'] / 2**20:.1f} -> {h['rss_held_bytes'] / 2**20:.1f} MiB held "
            f"({h['rss_per_held_session_bytes']:.0f} B/session) -> {h['rss_after_close_bytes'] / 2**20:.1f} "
            f"MiB closed; status p50 {h['status_ms_p50']} ms"
        )
    print(f"\n{'op':<28} {'n':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for op, v in r["per_op"].items():
        print(f"{op:<28} {v['n']:>8} {v['p50_ms']:>8} {v['p99_ms']:>8}")
    if "profile" in r and "layers" in r["profile"]:
        print("\nactor samples by layer:")
        for layer, share in r["profile"]["layers"].items():
            print(f"  {share:>6.1%}  {layer}")
        print("top frames:")
        for leaf in r["profile"]["top_leaves"]:
            print(f"  {leaf['share']:>6.1%}  {leaf['frame'][:110]}")


if __name__ == "__main__":
    main()
