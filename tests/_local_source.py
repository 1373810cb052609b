"""The local source directory the shared test engines E0/E1 read handed-over buckets from: on
the engines' staging filesystem (``/dev/shm`` here), so a file can be taken over, not copied."""

from __future__ import annotations

import atexit
import shutil
from pathlib import Path

from sglang_ext.staging import default_staging_base


def local_source_dir(run_dir: Path) -> Path:
    path = default_staging_base() / f"lora-versions-test-source-{run_dir.name}"
    if not path.exists():
        path.mkdir()
        atexit.register(shutil.rmtree, path, True)
    return path
