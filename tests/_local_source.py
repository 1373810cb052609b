"""The local source directory the shared test engines E0/E1 read handed-over buckets from."""

from __future__ import annotations

from pathlib import Path


def local_source_dir(run_dir: Path) -> Path:
    path = run_dir / "local-source"
    path.mkdir(exist_ok=True)
    return path
