"""TRL's ``GRPOTrainer`` on immutable LoRA versions: each step's adapter is published as a new
version, and every completion TRL asks for is a multi-turn episode through a session.

The optional ``trl`` extra (``trl==1.16.0``); nothing else in ``relax_glue`` imports this package,
and importing it imports neither ``torch``, ``transformers``, ``trl`` nor ``ray``: each is
imported inside the function that uses it.

What a TRL user adds (docs/trl.md, and the README's "Use it from TRL")::

    versions = GRPOVersions.connect(ENGINES, gateway_url=GATEWAY, admin_key=KEY)
    trainer = GRPOTrainer(..., peft_config=lora,
                          rollout_func=versions.rollout_func(env_turn=tool, max_new_tokens=16),
                          callbacks=[versions.callback()])
    trainer.train(); versions.close()

* **Publication** (:class:`PublishingHooks`, a ``TrainerCallback``): at train begin and after
  every optimizer step the main process freezes the policy's adapter (``Snapshot.from_peft_model``)
  and publishes it as version ``step{global_step}`` through the step publisher
  (:mod:`relax_glue.step_publisher`, the one backpressure loop of every trainer, the showcase's
  too). A ``CAPACITY_ERROR`` is backpressure: reclaim what nobody holds, wait for a reclaim that
  frees a slot (woken when one of rank 0's episodes closes) within a bounded wait, then skip this
  step (counted, bounded by the lag the policy allows), past that a bounded forced wait, then a
  failure. Never a pause: nothing here stops an engine.
* **Rollouts** (:meth:`GRPOVersions.rollout_func`): TRL hands each process its prompts, each
  repeated ``num_generations`` times in a row (a GRPO group). Every completion is one session,
  opened with ``group=`` its prompt's group (smg routes the group to one engine, where the prompt
  is prefilled once); the episode is assistant turn, environment (tool) turn, assistant turn, all
  on the exact ``lora_path`` the session bound at its first generation; the session is closed
  before TRL gets the completion. Per completion TRL gets ``prompt_ids``, ``completion_ids``
  (assistant, tool and assistant tokens), ``logprobs`` (the engine's, 0.0 on tool tokens),
  ``env_mask`` (1 = model token) and, passed on to the reward functions, ``bound_version`` (the
  exact ``lora_path``), ``version_id``, ``assistant_ids`` and ``rollout_error``.
* **The trainer's view and the episodes' versions.** The trainer at ``global_step = t`` holds
  ``W_t``; ``step{t}`` is ``W_t`` frozen. Synchronous publication (the default): ``step{t}`` is
  committed before ``on_step_end`` returns, so the rollouts TRL runs next, at step ``t``, bind
  ``step{t}``: exactly the trainer's weights (a failure or a skip leaves them on an older
  version, which ``version_id`` shows). With ``background=True`` the publication of ``step{t}``
  runs while step ``t``'s rollouts already start: they bind ``step{t-1}`` or ``step{t}``,
  whichever is the default at their first generation, so an episode lags the trainer by at most
  one step (plus skips), and every turn of it stays on that one version. **TRL does not correct
  for that lag**: with ``use_vllm=False`` it treats every sample as on-policy and never uses the
  returned ``logprobs`` for importance correction. Use the default (synchronous) when the loss
  must be exactly on-policy; the ``version_id`` the reward functions receive says which weights
  sampled each completion.
* **Several training processes** (``accelerate launch``, gloo on CPU): only the main process
  snapshots and publishes; every rank learns the same :class:`PublicationOutcome` (published, a
  counted skip, a failure) through one ``broadcast_object_list`` from rank 0. Everything rank 0
  does before that broadcast is bounded (``publish_timeout_s``) and every exception becomes a
  typed FAILED outcome, so rank 0 always reaches it: no rank is left waiting in a collective. A
  failure beyond ``max_failures`` raises :class:`PublicationFailed` on every rank at the same
  point. The registry is then the Ray actor (started by rank 0, joined by the others); each
  process runs its own slice of the rollouts through its own sessions.

The modules, one job each. TRL-specific (a next integration writes its own):

* ``callback.py``: the ``TrainerCallback`` (which hook publishes which step, when a background
  outcome is agreed).
* ``completions.py``: TRL's ``rollout_func`` columns (``env_mask``, ``logprobs``, ...), its
  prompts and ``GRPOConfig`` sampling as engine requests.
* ``versions.py``: :class:`GRPOVersions`, the object a TRL script holds (connect, report, close).

Framework-neutral (a second integration, e.g. for another trainer, reuses them as they are, over
the step publisher and the session layer ``relax_glue/sessions.py``):

* ``outcomes.py``: the outcome every rank agrees on, and the failure every rank raises.
* ``ranks.py``: ranks, rank 0's value on every rank, a bounded barrier (``torch.distributed``).
* ``event_loop.py``: the loop thread synchronous hooks submit async work to.
* ``publication.py``: rank 0 snapshots a PEFT model and hands it to the step publisher, bounded
  so that it always reaches the broadcast; the driver's record becomes the agreed outcome; every
  rank counts failures.
* ``rollouts.py``: an episode of turns on one session, recorded, never raising.
* ``cluster.py``: the registry of a multi-process run (the Ray actor: start, join, leave).
* ``config.py``: :class:`VersionsConfig`.
"""

from relax_glue.trl.callback import PublishingHooks
from relax_glue.trl.config import VersionsConfig
from relax_glue.trl.outcomes import OutcomeKind, PublicationFailed, PublicationOutcome
from relax_glue.trl.versions import GRPOVersions

__all__ = [
    "GRPOVersions",
    "OutcomeKind",
    "PublicationFailed",
    "PublicationOutcome",
    "PublishingHooks",
    "VersionsConfig",
]
