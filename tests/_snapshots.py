"""The fixture adapters as the engine tests send them (not a test module): one bucket cap for every
engine test, the shared ``snaps`` fixture (tests/conftest.py) and both engine helper modules."""

from __future__ import annotations

from pathlib import Path

from relax_glue.snapshot import Snapshot

BUCKET_CAP = 16 * 1024  # small, so the tiny fixture adapters travel in several ordered buckets


def snapshot_of(adapter_dir: Path, max_bucket_bytes: int = BUCKET_CAP) -> Snapshot:
    return Snapshot.from_peft_dir(adapter_dir, max_bucket_bytes=max_bucket_bytes)
