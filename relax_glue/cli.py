"""``lora-versions``: the operator's command line.

    lora-versions status   [--registry R] --engine E0=URL ...   registry and every engine
    lora-versions sessions --registry R                 the registry's sessions
    lora-versions publish DIR --version-id V --registry R --engine ...   publish a PEFT adapter dir
    lora-versions reclaim  --registry R --engine ...    reclaim every retired, unreferenced version
    lora-versions resolve  --registry R --engine ...    settle a publication with an unknown outcome

``--registry`` is ``sqlite:PATH`` (the durable registry database) or ``ray:EPOCH[@ADDRESS]`` (the
epoch's registry actor). Every command takes ``--json``. Errors print the typed code and a
one-line hint; the exit code is 0 on success, 1 when the operation was refused or did not
complete, 2 for a usage error. (The demo and dev engines are ``lora-versions-dev``:
``lora_versions_dev.cli``.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lora_contract.errors import LoraVersionError
from relax_glue.engine_client import OutcomeUnknown
from relax_glue.operations import (
    aclose_all,
    cohort_status,
    engine_clients,
    open_registry,
    parse_engines,
    publish_dir,
    reclaim_ready,
    resolve_pending,
    session_rows,
)
from relax_glue.store import StoreError, StoreLockedError

ADMIN_KEY_ENV = "LORA_VERSIONS_ADMIN_KEY"

# One line per error code an operator meets, saying what to do next.
HINTS: dict[str, str] = {
    "CAPACITY_ERROR": (
        "all K slots are held: close the sessions of the retired versions, then `lora-versions reclaim`"
    ),
    "PUBLICATION_IN_PROGRESS": "another publication is pending: wait for it, or `lora-versions resolve` it",
    "VERSION_CONFLICT": "that version id is already used with other weights: pick a new --version-id",
    "OUTCOME_UNKNOWN": "an engine's outcome is unknown and its slot is kept: `lora-versions resolve`",
    "NOT_ALL_READY": "not every engine reported READY: `lora-versions status`, then `lora-versions resolve`",
    "STALE_INCARNATION": "an engine restarted during the operation: `lora-versions resolve`",
    "VERSION_IN_USE": "sessions still hold that version (or it is the default): close them first",
    "UNKNOWN_ENGINE": "the --engine ids must be the registry's cohort: see `lora-versions status`",
    "NOT_PUBLISHER": (
        "only the publisher changes what is published: through --registry ray:EPOCH, set "
        "LORA_VERSIONS_PUBLISHER_TOKEN to the token the trainer started the actor with"
    ),
    "INCOMPATIBLE_ADAPTER": (
        "the engines would not serve this adapter as PEFT does: check its rank and modules"
    ),
    "PAYLOAD_TOO_LARGE": "raise the engine's SGLANG_LORA_VERSIONS_MAX_* limits, or use smaller buckets",
}
STORE_LOCKED_HINT = (
    "another process (the trainer) writes this registry: run the command through it or the Ray "
    "actor (--registry ray:EPOCH); `status` and `sessions` read it without the lock"
)


class Output:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def progress(self, line: str) -> None:
        if not self.as_json:
            print(f"  .. {line}", file=sys.stderr, flush=True)

    def result(self, record: Any, render: Callable[[Any], str]) -> None:
        print(json.dumps(record, indent=2, default=str) if self.as_json else render(record))

    def error(self, code: str, message: str, hint: str | None) -> None:
        if self.as_json:
            print(json.dumps({"error": {"code": code, "message": message, "hint": hint}}, indent=2))
        else:
            print(f"error: {code}: {message}", file=sys.stderr)
            if hint:
                print(f"hint: {hint}", file=sys.stderr)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> str:
    cells = [[str(h) for h in headers], *[["-" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(indent + line for line in lines)


# ------------------------------------------------------------------------------ rendering


def render_status(rec: dict[str, Any]) -> str:
    out = []
    reg = rec.get("registry")
    if reg is not None:
        out.append(
            f"registry: epoch {reg['epoch']}, default {reg['default'] or '-'} "
            f"(revision {reg['default_revision']}), slots {reg['slots']}, sessions {reg['sessions']}"
        )
        rows = [
            [v["version"], v["state"], v["session_refs"], "yes" if v["holds_slot"] else "no", v["lora_name"]]
            for v in reg["versions"]
        ]
        out.append(table(["version", "state", "session refs", "slot", "lora_name"], rows))
        if reg["pending_attempt"]:
            out.append(f"  pending attempt: {reg['pending_attempt']}")
        for u in reg["unknown_outcomes"]:
            out.append(f"  unknown outcome: {u['engine_id']} {u['op']} ({u['reason']})")
    for eid, e in rec["engines"].items():
        if not e["reachable"]:
            out.append(f"engine {eid}: UNREACHABLE ({e['error']})")
            continue
        seen = e.get("registry_incarnation")
        note = "" if seen is None or e.get("consistent") else f" (the registry knows {seen}: restarted)"
        out.append(f"engine {eid}: incarnation {e['incarnation']}{note}")
        rows = [[v["lora_name"], v["state"], v["in_flight"], v["buckets"]] for v in e["versions"]]
        out.append(table(["lora_name", "state", "in flight", "buckets"], rows) if rows else "  (no versions)")
    return "\n".join(out)


def render_sessions(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no sessions"
    keys = ["session", "state", "bound", "released", "lease_id"]
    return table(keys, [[r[k] for k in keys] for r in rows])


def render_publish(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "nothing to resolve: no publication is pending"
    phases = " ".join(f"{k}={v:.0f}" for k, v in rec["phase_ms"].items())
    line = f"{rec['outcome']}: {rec['version']} as {rec['lora_name']} in {rec['total_ms']:.0f} ms ({phases})"
    if rec["error"]:
        line += f"\n  refused: {rec['error']['code']}: {rec['error']['message']}"
    if rec["unknown_engines"]:
        line += f"\n  outcome unknown on {rec['unknown_engines']}: the slot is kept; `lora-versions resolve`"
    return line


def render_reclaim(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "nothing to reclaim: no retired version without session refs"
    return table(
        ["version", "done", "registry", "engines", "lora_name"],
        [[r["version"], r["done"], r["registry_state"], r["engines"], r["lora_name"]] for r in rows],
    )


# ------------------------------------------------------------------------------ commands


async def _with_cohort(args: argparse.Namespace, run: Callable[[Any], Any]) -> Any:
    clients = engine_clients(parse_engines(args.engine or []), args.admin_key)
    try:
        return await run(clients)
    finally:
        await aclose_all(clients.values())


async def cmd_status(args: argparse.Namespace, out: Output) -> int:
    async def run(clients: Any) -> dict[str, Any]:
        if args.registry is None:
            return await cohort_status(None, clients)
        async with open_registry(args.registry, writable=False) as reg:
            return await cohort_status(reg, clients)

    rec = await _with_cohort(args, run)
    out.result(rec, render_status)
    return 0 if all(e["reachable"] for e in rec["engines"].values()) else 1


async def cmd_sessions(args: argparse.Namespace, out: Output) -> int:
    async with open_registry(args.registry, writable=False) as reg:
        rows = session_rows(await reg.sessions(include_closed=args.all, limit=args.limit))
    out.result(rows, render_sessions)
    return 0


def _writable(args: argparse.Namespace) -> Any:
    return open_registry(
        args.registry, writable=True, epoch=args.epoch, engines=tuple(parse_engines(args.engine or []))
    )


async def cmd_publish(args: argparse.Namespace, out: Output) -> int:
    async def run(clients: Any) -> dict[str, Any]:
        async with _writable(args) as reg:
            return await publish_dir(
                reg,
                clients,
                args.adapter_dir,
                args.version_id,
                bucket_bytes=int(args.bucket_mib * 2**20),
                snapshot_dir=args.snapshot_store,
                progress=out.progress,
            )

    rec = await _with_cohort(args, run)
    out.result(rec, render_publish)
    return 0 if rec["ok"] else 1


async def cmd_reclaim(args: argparse.Namespace, out: Output) -> int:
    async def run(clients: Any) -> list[dict[str, Any]]:
        async with _writable(args) as reg:
            return await reclaim_ready(reg, clients, deadline_s=args.deadline_s, progress=out.progress)

    rows = await _with_cohort(args, run)
    out.result(rows, render_reclaim)
    return 0 if all(r["done"] for r in rows) else 1


async def cmd_resolve(args: argparse.Namespace, out: Output) -> int:
    async def run(clients: Any) -> dict[str, Any] | None:
        async with _writable(args) as reg:
            return await resolve_pending(
                reg,
                clients,
                snapshot_dir=args.snapshot_store,
                adapter_dir=args.adapter_dir,
                bucket_bytes=int(args.bucket_mib * 2**20),
                progress=out.progress,
            )

    rec = await _with_cohort(args, run)
    out.result(rec, render_publish)
    return 0 if rec is None or rec["ok"] else 1


# ------------------------------------------------------------------------------ the parser


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print the result as JSON")
    cohort = argparse.ArgumentParser(add_help=False)
    cohort.add_argument(
        "--engine", action="append", metavar="ID=URL", help="a cohort engine (repeat, in cohort order)"
    )
    cohort.add_argument(
        "--admin-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help=f"the engines' --admin-api-key (default: ${ADMIN_KEY_ENV})",
    )
    registry = argparse.ArgumentParser(add_help=False)
    registry.add_argument("--registry", required=True, help="sqlite:PATH or ray:EPOCH[@ADDRESS]")
    writer = argparse.ArgumentParser(add_help=False)
    writer.add_argument(
        "--epoch", default=None, help="the deployment epoch (only to create a new sqlite registry)"
    )
    writer.add_argument("--snapshot-store", type=Path, default=None, help="snapshot store dir (for restores)")
    writer.add_argument("--bucket-mib", type=float, default=64.0, help="bucket size for the transfer (MiB)")

    parser = argparse.ArgumentParser(prog="lora-versions", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    status = sub.add_parser("status", parents=[common, cohort], help="registry and every engine")
    status.add_argument("--registry", default=None, help="sqlite:PATH or ray:EPOCH[@ADDRESS] (optional)")

    sessions = sub.add_parser("sessions", parents=[common, registry], help="the registry's sessions")
    sessions.add_argument("--all", action="store_true", help="include CLOSED tombstones")
    sessions.add_argument("--limit", type=int, default=None, help="only the newest N")

    publish = sub.add_parser(
        "publish", parents=[common, cohort, registry, writer], help="publish a PEFT adapter directory"
    )
    publish.add_argument("adapter_dir", type=Path, help="adapter_config.json + adapter_model.safetensors")
    publish.add_argument("--version-id", required=True, help="the new version's id within the epoch")

    reclaim = sub.add_parser(
        "reclaim", parents=[common, cohort, registry, writer], help="reclaim retired versions without refs"
    )
    reclaim.add_argument("--deadline-s", type=float, default=60.0, help="longest wait for drains")

    resolve = sub.add_parser(
        "resolve", parents=[common, cohort, registry, writer], help="settle a pending publication"
    )
    resolve.add_argument("--adapter-dir", type=Path, default=None, help="the pending version's adapter dir")

    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace, Output], Any]] = {
    "status": cmd_status,
    "sessions": cmd_sessions,
    "publish": cmd_publish,
    "reclaim": cmd_reclaim,
    "resolve": cmd_resolve,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Output(getattr(args, "json", False))
    try:
        return asyncio.run(COMMANDS[args.command](args, out))
    except LoraVersionError as err:
        out.error(err.code.value, err.message, HINTS.get(err.code.value))
    except OutcomeUnknown as err:
        out.error("OUTCOME_UNKNOWN", str(err), HINTS["OUTCOME_UNKNOWN"])
    except StoreLockedError as err:
        out.error("REGISTRY_LOCKED", str(err), STORE_LOCKED_HINT)
    except StoreError as err:
        out.error("REGISTRY_ERROR", str(err), "check --registry (and --epoch for a new one)")
    except (ValueError, FileNotFoundError) as err:
        out.error("USAGE", str(err), "see `lora-versions <command> --help`")
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
