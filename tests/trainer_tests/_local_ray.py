"""A local Ray for the tests of one module (not a test module): the actor tests and the RFC 5.2
run through the Ray actor each had their own start-up."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def local_ray(ray: Any) -> Iterator[Any]:
    """One CPU, no dashboard, shut down after; a Ray this process already runs is used and left
    running. Workers get the repository on PYTHONPATH: they import relax_glue / sglang_ext even
    when the project is not pip-installed."""
    owned = not ray.is_initialized()
    if owned:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        ray.init(
            num_cpus=1,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
    try:
        yield ray
    finally:
        if owned:
            ray.shutdown()
