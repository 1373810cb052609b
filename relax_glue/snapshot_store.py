"""A content-addressed, on-disk store of the snapshots of live versions (issue: engine faults).

Why on disk: an engine that restarts after a commit holds none of its versions, and the trainer
that must stage them onto it again may itself have restarted since. So every published snapshot
is written here once, before ``reserve``, keyed by its manifest digest, and is read back to
restore a version onto a restarted engine (:mod:`relax_glue.reconciler`).

Rules:

* **Content-addressed.** An entry is named by the digest of the manifest it holds; writing the
  same digest again is a no-op. Two versions with the same bytes share one entry.
* **Checked when read back.** :meth:`SnapshotStore.get` recomputes the digest from the bytes on
  disk; anything else is ``CHECKSUM_MISMATCH``, never a silently different adapter.
* **Only live versions.** :meth:`SnapshotStore.retain` keeps exactly the digests of versions that
  hold a slot in the registry (the one ``holds_slot`` predicate) and deletes the rest: a version
  that became RECLAIMED or FAILED_CLEAN loses its entry at the next retain.
* **Crash-safe.** An entry is written into a temporary directory and renamed into place, so a
  reader sees a whole entry or none; leftovers of a writer that crashed are removed by retain.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.names import SHA256_RE
from lora_contract.protocol import BucketSpec
from lora_contract.transport import plan_problem
from relax_glue.registry import holds_slot
from relax_glue.registry_types import StatusView
from relax_glue.snapshot import Snapshot

__all__ = ["SnapshotStore", "live_digests"]

_CONFIG_FILE = "config.json"
_TENSORS_FILE = "tensors.safetensors"
_PLAN_FILE = "bucket_plan.json"  # the plan as published: a redriven attempt must send the same buckets
_TMP_PREFIX = ".tmp-"


def live_digests(status: StatusView) -> frozenset[str]:
    """Digests of every version that holds a slot: the only entries the store may keep."""
    return frozenset(v.digest for v in status.versions if holds_slot(v.state))


class SnapshotStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _entry(self, digest: str) -> Path:
        if not isinstance(digest, str) or not SHA256_RE.fullmatch(digest):
            raise LoraVersionError(ErrorCode.INVALID_REQUEST, f"not a sha256 digest: {digest!r}")
        return self.root / digest

    def __contains__(self, digest: object) -> bool:
        return (
            isinstance(digest, str)
            and SHA256_RE.fullmatch(digest) is not None
            and self._entry(digest).is_dir()
        )

    def digests(self) -> frozenset[str]:
        return frozenset(p.name for p in self.root.iterdir() if p.is_dir() and SHA256_RE.fullmatch(p.name))

    def put(self, snapshot: Snapshot) -> Path:
        """Write ``snapshot`` under its digest (once: an existing entry is kept as it is)."""
        from safetensors.torch import save  # lazy heavy import (torch): only on a put or a get

        final = self._entry(snapshot.digest)
        if final.is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=self.root))
        try:
            (tmp / _CONFIG_FILE).write_text(
                json.dumps(dict(snapshot.config), sort_keys=True), encoding="utf-8"
            )
            (tmp / _TENSORS_FILE).write_bytes(save(dict(snapshot.tensors)))
            plan = [spec.model_dump(mode="json") for spec in snapshot.bucket_plan]
            (tmp / _PLAN_FILE).write_text(json.dumps(plan), encoding="utf-8")
            for f in tmp.iterdir():
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
            try:
                tmp.rename(final)
            except OSError:
                if not final.is_dir():  # another writer of the same digest won the race: fine
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def get(self, digest: str) -> Snapshot:
        """The snapshot stored under ``digest`` with its bucket plan, its bytes checked against it.

        UNKNOWN_VERSION when there is no entry; CHECKSUM_MISMATCH when the bytes on disk do not
        hash to ``digest`` or the entry is unreadable (a damaged entry is never served)."""
        from safetensors.torch import load  # lazy heavy import (torch): only on a put or a get

        entry = self._entry(digest)
        try:
            config = json.loads((entry / _CONFIG_FILE).read_text(encoding="utf-8"))
            tensors = load((entry / _TENSORS_FILE).read_bytes())
            plan = tuple(
                BucketSpec.model_validate(b) for b in json.loads((entry / _PLAN_FILE).read_text("utf-8"))
            )
        except FileNotFoundError:
            raise LoraVersionError(
                ErrorCode.UNKNOWN_VERSION, f"no stored snapshot for digest {digest}", digest=digest
            ) from None
        except Exception as exc:  # unreadable or truncated (safetensors raises its own error type)
            raise LoraVersionError(
                ErrorCode.CHECKSUM_MISMATCH, f"stored snapshot {digest} is unreadable: {exc}", digest=digest
            ) from None
        try:
            snap = Snapshot.from_tensors(config, tensors)
        except LoraVersionError as err:
            raise LoraVersionError(
                ErrorCode.CHECKSUM_MISMATCH,
                f"stored snapshot {digest} is not a valid adapter: {err}",
                digest=digest,
            ) from None
        if snap.digest != digest:
            raise LoraVersionError(
                ErrorCode.CHECKSUM_MISMATCH,
                f"stored snapshot {digest} hashes to {snap.digest}",
                digest=digest,
                actual=snap.digest,
            )
        problem = plan_problem(snap.manifest, plan)
        if problem is not None:
            raise LoraVersionError(
                ErrorCode.CHECKSUM_MISMATCH, f"stored bucket plan of {digest}: {problem}", digest=digest
            )
        return dataclasses.replace(snap, bucket_plan=plan)

    def delete(self, digest: str) -> bool:
        entry = self._entry(digest)
        if not entry.exists():
            return False
        shutil.rmtree(entry)
        return True

    def retain(self, keep: Iterable[str]) -> tuple[str, ...]:
        """Delete every entry whose digest is not in ``keep`` (and any half-written leftover);
        returns the digests deleted."""
        wanted = frozenset(keep)
        for p in self.root.iterdir():
            if p.name.startswith(_TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
        gone = sorted(self.digests() - wanted)
        for digest in gone:
            self.delete(digest)
        return tuple(gone)
