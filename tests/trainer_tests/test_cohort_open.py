"""Cohort.open is the composition root (relax_glue/cohort.py): the only code that builds the
publisher, the reclaimer and the reconciler, all three over the one cohort it opens (its
registry client, incarnation memory, snapshot store and locks); snapshot retention is the
cohort's, so a reclaim through the cohort alone (no publisher asked) drops a reclaimed
version's stored snapshot."""

from __future__ import annotations

import ast
from pathlib import Path

from _fake_engine import make_cluster, make_snapshot
from _in_process_world import FAST_RECLAIM
from _rg_helpers import EPOCH, new_registry, sk
from _source_trees import parse_file

from relax_glue.cohort import Cohort
from relax_glue.snapshot_store import SnapshotStore

REPO = Path(__file__).resolve().parents[2]
DRIVERS = {"Publisher", "Reclaimer", "Reconciler"}
SHIPPED = ("relax_glue", "lora_contract", "sglang_ext", "lora_versions_dev", "lora_versions_demo", "examples")


def driver_constructions(path: Path) -> list[str]:
    """Every ``Publisher(...)``, ``Reclaimer(...)`` or ``Reconciler(...)`` call in a module."""
    tree = parse_file(path)
    return [
        f"{path.relative_to(REPO)}:{node.lineno} {node.func.id}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in DRIVERS
    ]


def test_only_cohort_open_builds_the_publisher_the_reclaimer_and_the_reconciler() -> None:
    modules = [p for pkg in SHIPPED for p in sorted((REPO / pkg).rglob("*.py"))]
    found = [c for p in modules for c in driver_constructions(p)]
    assert found and all(c.startswith("relax_glue/cohort.py:") for c in found), found
    assert sorted(c.split()[-1] for c in found) == sorted(DRIVERS)


async def test_the_three_drivers_share_the_one_cohort(tmp_path: Path) -> None:
    clients = make_cluster().clients
    cohort = Cohort.open(new_registry(), clients, store=SnapshotStore(tmp_path))
    assert cohort.reconciler is not None
    for driver in (cohort.publisher, cohort.reclaimer, cohort.reconciler):
        assert driver.cohort is cohort and driver.registry is cohort.registry
        assert driver._incarnations is cohort.incarnations
    assert cohort.publisher._lock is cohort.publication_lock and cohort.reclaimer.lock is cohort.reclaim_lock
    assert cohort.publisher.reclaimer is cohort.reclaimer and cohort.publisher.reconciler is cohort.reconciler
    assert Cohort.open(new_registry(), clients).reconciler is None  # no store: no restore


async def test_a_reclaim_through_the_cohort_drops_the_reclaimed_snapshot(tmp_path: Path) -> None:
    reg, store = new_registry(), SnapshotStore(tmp_path)
    cohort = Cohort.open(reg, make_cluster().clients, store=store, **FAST_RECLAIM)
    a, b = make_snapshot(seed=1), make_snapshot(seed=2)
    assert (await cohort.publisher.publish(a, "A")).ok
    reg.bind_first(sk("S0"))
    assert (await cohort.publisher.publish(b, "B")).ok
    assert store.digests() == {a.digest, b.digest}  # A retired, held by S0: kept
    reg.close_and_release(sk("S0"))
    (done,) = await cohort.reclaim_ready()
    assert done.done and done.lora_name == a.lora_name("relax_policy_lora", EPOCH, "A")
    assert store.digests() == {b.digest}
