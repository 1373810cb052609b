"""The local deployment the demo and the examples run on: CPU SGLang engines E0..E{n-1} (plugin
on, control endpoints behind a fresh admin key, logs in the run's folder) with the real smg
gateway in front, started and stopped as one; and the ``--json`` convention they share."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


def cohort_of(n: int) -> tuple[str, ...]:
    if n < 1:
        raise ValueError("a cohort needs at least one engine")
    return tuple(f"E{i}" for i in range(n))


@dataclasses.dataclass(frozen=True)
class LocalCohort:
    fixtures: Any  # lora_versions_dev.fixtures.Fixtures
    admin_key: str
    engines: Sequence[Any]  # launcher Engines, in cohort order
    gateway_url: str
    engine_start_s: float

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.engines)


@contextlib.contextmanager
def local_cohort(
    out_dir: Path, n_engines: int, tag: str, engine_args: Sequence[str] = (), last_engine_tp: int = 1
) -> Iterator[LocalCohort]:
    """Fixtures, ``n_engines`` CPU engines in parallel (each also given ``engine_args``; the last
    one with ``last_engine_tp`` tensor-parallel ranks) and smg in front of them; everything is
    stopped on the way out (also on Ctrl-C or SIGTERM unwinding)."""
    from lora_versions_dev.fixtures import ensure_fixtures
    from lora_versions_dev.gateway_process import running_gateway
    from lora_versions_dev.launcher import EngineSpec, running_engines
    from relax_glue.gateway import SMG_VERSION

    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[{tag}] preparing fixtures (tiny Qwen3 + BPE tokenizer + adapters; cached)")
    fx = ensure_fixtures()
    admin_key = secrets.token_hex(16)
    cohort = cohort_of(n_engines)
    specs = [
        EngineSpec(
            name=n,
            model_path=fx.model_dir,
            log_path=out_dir / f"{n}.log",
            extra_args=["--admin-api-key", admin_key, *engine_args],
            tp=last_engine_tp if n == cohort[-1] else 1,
        )
        for n in cohort
    ]
    shown = "/".join(f"{s.name} (tp {s.tp})" if s.tp > 1 else s.name for s in specs)
    print(f"[{tag}] starting {shown} in parallel (CPU dev mode, plugin on; logs in {out_dir})")
    t0 = time.monotonic()
    with running_engines(specs) as engines:
        started = round(time.monotonic() - t0, 1)
        print(f"[{tag}] {len(cohort)} engines healthy after {started}s")
        with running_gateway([e.url for e in engines], out_dir / "gateway.log") as gw:
            print(
                f"[{tag}] gateway smg {SMG_VERSION} at {gw.url} in front of {'/'.join(cohort)} "
                "(consistent_hashing on X-SMG-Routing-Key = the session key, --disable-retries); "
                "sessions generate through it, control calls go to each engine"
            )
            yield LocalCohort(fx, admin_key, engines, gw.url, started)


def run_reporting(main: Callable[[], int], report_path: Path, *, as_json: bool) -> int:
    """Run ``main``; with ``as_json`` its tables go to stderr and the report file to stdout (what
    the tests read)."""
    if not as_json:
        return main()
    with contextlib.redirect_stdout(sys.stderr):
        code = main()
    print(report_path.read_text())
    return code
