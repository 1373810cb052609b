"""The TRL callback: publishes ``step{global_step}`` at train begin (always synchronously: the
first rollout needs a version) and after every optimizer step, and makes every rank record the
outcome rank 0 broadcasts. ``transformers`` is imported only when the callback class is built."""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any

from relax_glue.trl.publication import StepPublication
from relax_glue.trl.ranks import agree


class PublishingHooks:
    """Publishes ``step{global_step}`` at train begin (always synchronously: the first rollout
    needs a version) and after every optimizer step; every rank records the agreed outcome.
    TRL gets it as a ``transformers.TrainerCallback``: :func:`publishing_callback_class`. The hook
    arguments are transformers' (``TrainingArguments``, ``TrainerState``, ``TrainerControl``, the
    model), typed ``Any`` so that this module imports without transformers."""

    def __init__(self, publication: StepPublication) -> None:
        self.publication = publication
        self._pending: tuple[int, concurrent.futures.Future[Any] | None] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self._publish(model, int(state.global_step), background=False, required=True)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self._join()
        self._publish(model, int(state.global_step), background=self.publication.config.background)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._join()
        p = self.publication
        if p.rank.is_main:
            assert p.loop is not None, "rank 0 publishes on its loop"
            # every episode has ended: unload what the last publications retired
            p.loop.call(p.finish(), p.config.publish_timeout_s)

    def _publish(self, model: Any, step: int, *, background: bool, required: bool = False) -> None:
        p = self.publication
        future = p.submit(model, step, required=required) if p.rank.is_main else None
        if background:
            self._pending = (step, future)
            return
        p.record(agree(p.settle(step, future) if future is not None else None, p.rank))

    def _join(self) -> None:
        """The background publication of the previous step: its outcome, agreed by every rank."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        p = self.publication
        p.record(agree(p.settle(step, future) if future is not None else None, p.rank))


@functools.cache
def publishing_callback_class() -> type:
    """``PublishingCallback``: :class:`PublishingHooks` as a ``transformers.TrainerCallback``,
    built at first use so that importing this package does not import transformers."""
    from transformers import TrainerCallback

    return type(
        "PublishingCallback", (PublishingHooks, TrainerCallback), {"__doc__": PublishingHooks.__doc__}
    )
