"""The TRL callback's hooks (relax_glue/trl/callback.py PublishingHooks) as transformers calls them:
the real ``CallbackHandler`` with ``DefaultFlowCallback``, real ``TrainingArguments``,
``TrainerState`` and ``TrainerControl``, a real (tiny) PEFT model frozen by the real
``Snapshot.from_peft_model``, the real ``StepPublication`` and its loop; only the publisher is a
script (its results, how long each publication takes, when a slot frees up).

The rules: the first version is published synchronously at train begin and may not be skipped
(required); after each optimizer step ``step{t}`` is published, in the background when so
configured; a background step's outcome is agreed by every rank before the next publication
starts (and at train end, before the last reclaim); the hooks never touch the trainer's control
flags (publication never stops, saves or evaluates anything). The capacity wait is
test_trl_capacity_backpressure.py's."""

from __future__ import annotations

import asyncio
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _publish_results import result
from peft import LoraConfig, get_peft_model
from transformers import TrainingArguments
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, TrainerControl, TrainerState

from lora_contract.errors import ErrorCode
from relax_glue.publisher import PublishOutcome
from relax_glue.registry_types import VersionState
from relax_glue.trl import OutcomeKind, VersionsConfig
from relax_glue.trl.callback import publishing_callback_class
from relax_glue.trl.event_loop import LoopThread
from relax_glue.trl.publication import StepPublication
from relax_glue.trl.ranks import RankInfo

PUBLISHED = result(PublishOutcome.PUBLISHED, state=VersionState.PUBLISHED)
FULL = result(PublishOutcome.REFUSED, ErrorCode.CAPACITY_ERROR)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x)


def peft_model() -> Any:
    torch.manual_seed(0)
    return get_peft_model(Tiny(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))


class ScriptedPublisher:
    """The publisher as the integration calls it. ``log`` (shared with the test) gets
    ("publish", vid) when a publication starts and ("published", vid) when it returns;
    ``seconds[vid]``: how long that one takes (real time: the test thread waits on it)."""

    def __init__(self, log: list[tuple[Any, ...]], seconds: dict[str, float] | None = None) -> None:
        self.log, self.seconds = log, seconds or {}
        self.registry = types.SimpleNamespace(status=self._status)
        self.gates: dict[str, threading.Event] = {}  # vid -> its publication returns once set

    async def _status(self) -> Any:
        return types.SimpleNamespace(slots_used=1, capacity=2)

    async def resolve(self, snapshot: Any = None) -> None:
        return None

    async def reclaim_ready(self) -> tuple:
        self.log.append(("reclaim",))
        return ()

    async def publish(self, snapshot: Any, vid: str) -> Any:
        self.log.append(("publish", vid))
        await asyncio.sleep(self.seconds.get(vid, 0.0))
        gate = self.gates.get(vid)
        while gate is not None and not gate.is_set():
            await asyncio.sleep(0.01)
        self.log.append(("published", vid))
        return PUBLISHED


class Run:
    """One training run's hooks: the callback in a real CallbackHandler after transformers'
    DefaultFlowCallback, and the same handler without ours to compare the control flags."""

    def __init__(
        self,
        tmp: Path,
        *,
        background: bool,
        seconds: dict[str, float] | None = None,
        publish_timeout_s: float = 30.0,
    ) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.publisher = ScriptedPublisher(self.log, seconds)
        config = VersionsConfig(background=background, publish_timeout_s=publish_timeout_s)
        self.v = StepPublication(LoopThread(), RankInfo(), config, self.publisher)  # type: ignore[arg-type]
        self.submitted: list[tuple[int, bool]] = []  # (step, required) of every publication
        submit = self.v.submit

        def spy(model: Any, step: int, *, required: bool) -> Any:
            self.submitted.append((step, required))
            return submit(model, step, required=required)

        self.v.submit = spy  # type: ignore[method-assign]
        record = self.v.record

        def agreed(outcome: Any) -> None:  # every rank records the agreed outcome here
            self.log.append(("agreed", outcome.version_id, outcome.kind.value))
            record(outcome)

        self.v.record = agreed  # type: ignore[method-assign]
        model = peft_model()
        callback = publishing_callback_class()(self.v)
        self.ours = CallbackHandler([DefaultFlowCallback, callback], model, None, None, None)
        self.stock = CallbackHandler([DefaultFlowCallback], model, None, None, None)
        self.args = TrainingArguments(output_dir=str(tmp), report_to=[], logging_steps=1, save_strategy="no")
        self.state = TrainerState(logging_steps=1)  # as the Trainer sets it from the args
        self.control, self.stock_control = TrainerControl(), TrainerControl()

    def hook(self, event: str, step: int) -> None:
        """Call ``event`` at ``global_step = step`` through both handlers; ours may set no flag
        the stock flow does not set."""
        self.state.global_step = step
        self.control = getattr(self.ours, event)(self.args, self.state, self.control)
        self.stock_control = getattr(self.stock, event)(self.args, self.state, self.stock_control)
        assert self.control.state() == self.stock_control.state(), f"{event} changed the control flags"

    def agreed(self) -> list[str]:
        return [e[1] for e in self.log if e[0] == "agreed"]

    def close(self) -> None:
        self.v.loop.close()


@pytest.fixture()
def runs(tmp_path: Path) -> Iterator[Any]:
    made: list[Run] = []

    def make(**kw: Any) -> Run:
        made.append(Run(tmp_path / f"run{len(made)}", **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_synchronous_hooks_publish_every_step_before_returning(runs: Any) -> None:
    r = runs(background=False)
    r.hook("on_train_begin", 0)
    assert r.submitted == [(0, True)] and r.agreed() == ["step0"]  # the first version: required
    for step in (1, 2):
        r.hook("on_step_end", step)
        assert r.agreed()[-1] == f"step{step}"  # committed before the next rollouts start
    r.hook("on_train_end", 2)
    assert r.submitted == [(0, True), (1, False), (2, False)]  # only the first may not be skipped
    assert [o.kind for o in r.v.outcomes] == [OutcomeKind.PUBLISHED] * 3
    assert r.log[-1] == ("reclaim",)  # train end unloads what the last publication retired


def test_the_first_version_is_synchronous_even_when_steps_publish_in_the_background(runs: Any) -> None:
    r = runs(background=True, seconds={"step0": 0.3})
    r.hook("on_train_begin", 0)
    assert r.agreed() == ["step0"]  # the first rollouts need a version: never in the background
    assert r.submitted == [(0, True)]


def test_a_background_step_is_agreed_before_the_next_publication_starts(runs: Any) -> None:
    # step1's publication returns only when the test opens its gate: on_step_end(1) must not
    # wait for it (a wait would end in a PUBLISH_TIMEOUT failure agreed at once), and
    # on_step_end(2) must wait for it, agree it, and only then publish step2
    r = runs(background=True, publish_timeout_s=3.0)
    step1 = r.publisher.gates["step1"] = threading.Event()
    r.hook("on_train_begin", 0)
    r.hook("on_step_end", 1)
    assert r.agreed() == ["step0"]  # step1 still publishing while the next rollouts run
    opener = threading.Timer(0.5, step1.set)  # step2's publication would start well before this
    opener.start()
    r.hook("on_step_end", 2)
    assert r.agreed() == ["step0", "step1"]
    r.hook("on_train_end", 2)
    # train end agrees the last background step, then reclaims (never before it is settled)
    assert r.agreed() == ["step0", "step1", "step2"]
    events = [e[:2] for e in r.log if e[0] in ("agreed", "publish", "published")]
    assert events.index(("agreed", "step1")) < events.index(("publish", "step2"))
    assert events.index(("published", "step1")) < events.index(("agreed", "step1"))
    assert r.log.index(("agreed", "step2", "PUBLISHED")) < len(r.log) - 1 and r.log[-1] == ("reclaim",)
    assert [o.step for o in r.v.outcomes] == [0, 1, 2] and r.submitted[1:] == [(1, False), (2, False)]


def test_a_sharded_adapter_is_this_steps_typed_failure_with_its_error_code(runs: Any) -> None:
    """A ZeRO-3 partitioned adapter (as DeepSpeed leaves its parameters between steps) cannot be
    snapshot on rank 0 alone: the step fails with the snapshot's own error code and its advice,
    and nothing is published."""
    r = runs(background=False)
    model = peft_model()
    for i, p in enumerate(model.parameters()):
        p.ds_id, p.ds_status = i, types.SimpleNamespace(name="NOT_AVAILABLE")
    o = r.v.settle(3, r.v.submit(model, 3, required=False))
    assert (o.kind, o.code, o.version_id) == (OutcomeKind.FAILED, ErrorCode.INVALID_REQUEST.value, "step3")
    assert "gather the adapter on every rank first" in o.detail
    assert not any(e[0] == "publish" for e in r.log)
