"""The session layer checks what served each turn, on real engines (issue 39).

Every real-engine test of the trainer side runs the check on every reply it gets (publication,
reclaim, restart and restore, ``n > 1``, streaming, the gateway: ``Transcript.add`` also asserts
each turn's recorded attestation is its binding). This one plants the defect the check exists
for, in E1's real scheduler (the ``served_slot_swap`` probe: rows of version A built with B's
lora id): a session bound to A gets SERVED_VERSION_MISMATCH naming B, counted, instead of B's
tokens handed on as A's; once the defect is gone the same session goes on, on A, with A's
reference tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _e2e_helpers import PROMPTS, Deployment, turn

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_versions_dev.farm import local_source_dir

pytestmark = pytest.mark.engine

sys.path.insert(0, str(Path(__file__).parents[1] / "engine_wrappers"))
import served_slot_swap  # noqa: E402


async def test_the_session_layer_catches_a_planted_slot_swap(engines, stock_engine, fixtures, snaps, run_dir):
    async with Deployment(engines, stock_engine, fixtures) as w:
        assert (await w.publish(snaps, "A")).ok
        sessions = [await w.sm.open(f"S{i}") for i in range(2)]
        (s,) = [x for x in sessions if w.sm.router.pick(x.route_key) == "E1"]  # E1 carries the probe
        await turn(w.tx, s, PROMPTS[0], 8)  # binds A
        assert (await w.publish(snaps, "B")).ok  # the default now; A and B both held on E1
        a, b = w.name_of["A"], w.name_of["B"]
        assert s.lora_path == a

        trigger = served_slot_swap.trigger_path(local_source_dir(run_dir))
        trigger.write_text(f"{a} {b}")
        try:
            with pytest.raises(LoraVersionError) as exc:
                await turn(w.tx, s, PROMPTS[1], 8)
        finally:
            trigger.unlink()
        err = exc.value
        assert err.code is ErrorCode.SERVED_VERSION_MISMATCH, err
        assert [span["version"] for span in err.details["served"]] == [b] and err.details["bound"] == a
        assert s.served_mismatches == 1 and w.sm.served_mismatches == 1
        assert s.requests[-1].outcome == "refused:SERVED_VERSION_MISMATCH" and s.requests[-1].served == (b,)

        # the defect gone, the same session goes on, on A (on the prompt whose cached KV under
        # A's namespace the swapped turn did not write)
        await turn(w.tx, s, PROMPTS[0], 8)
        assert s.lora_path == a and s.requests[-1].served == (a,)
        assert await w.tx.mismatches(w.refs, w.adapter_of) == []
