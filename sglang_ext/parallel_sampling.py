"""Parallel sampling (``n > 1``) in the engine's main process: the samples of one request keep
its rid, and an abort by that rid reaches every one of them (registered by :mod:`sglang_ext.hooks`).

How SGLang 0.5.23 runs such a request (``TokenizerManager._handle_batch_request``): normalisation
names prompt ``i`` of request ``r`` ``r_i`` (upstream.PROMPT_RID) and repeats each prompt ``n``
times; a prefix request per prompt runs first, then each sample is cut from the batch, given a new
rid (``GenerateReqInput.regenerate_rid``) and sent (``_send_one_request``), each taking and
releasing its own LoRA count. Stock leaves two holes this module closes:

- a sample's new rid is a bare uuid, so an abort by the rid the client sent reaches nothing
  (:func:`sample_rids_under_the_request_rid` names every sample ``r_i-{uuid}``);
- ``abort_request(r)`` finds no state under ``r`` and returns, and samples sent after an abort
  decode to the end (:func:`abort_every_sample_of_a_parallel_request`,
  :func:`abort_samples_sent_after_their_request_was_aborted`).

The refusal of a rid list with ``n > 1`` and the per-prompt shape checks are request guards in
:mod:`sglang_ext.tokenizer_hooks`; they read :func:`parallel_samples` from here. Every SGLang fact
read here (the rid formats, the fields and attributes, ``abort_request``'s parameters) is named
and checked at start in the pin module.
"""

from __future__ import annotations

import re
from typing import Any

from sglang_ext import lora_registry_patch as upstream


def parallel_samples(obj: Any) -> int:
    """How many times SGLang's normalisation repeated each prompt (``n``; 1 for beam search and
    for an embedding request, which has no samples)."""
    return max(upstream.parallel_sample_num(obj) or 1, 1) if upstream.is_generation(obj) else 1


# A sample's rid under parallel sampling: the per-prompt rid ``{rid}_{i}`` (normalisation's,
# upstream.PROMPT_RID), then ``-`` and the fresh hex id SGLang gives it (upstream.UUID_HEX;
# sample_rids_under_the_request_rid).
_SAMPLE_UUID = "-" + upstream.UUID_HEX
_SAMPLE_RID_TAIL = re.compile(rf"{upstream.PROMPT_RID_TAIL}({_SAMPLE_UUID})?")


def sample_rids_under_the_request_rid(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND GenerateReqInput.regenerate_rid, which 0.5.23 calls only for n > 1
    (``TokenizerManager._handle_batch_request``: the prefix request and each sample get a new
    rid). Stock's new rid is a bare uuid, unrelated to the request's: an abort by the rid the
    client sent then reaches nothing, so a session could not abort its own turn. Here the new rid
    keeps the old one in front (``{rid}-{uuid}``), so every sample of request ``r`` is named
    ``r_{i}-{uuid}`` (see abort_every_sample_of_a_parallel_request)."""
    old = self.rid
    new = original(self, *args, **kwargs)
    if isinstance(old, str) and isinstance(new, str):
        self.rid = f"{old}-{new}"
        return self.rid
    return new


def abort_every_sample_of_a_parallel_request(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND TokenizerManager.abort_request(rid, abort_all). A request with n > 1 has no state
    under the rid the client sent (only its prompts ``r_{i}`` and samples ``r_{i}-{uuid}`` do),
    and stock returns without sending anything for a rid it has no state of. An abort of such a
    rid aborts each of them through the stock path (one abort each, sent once). Any other abort
    keeps stock behaviour; an abort of one sample's own rid aborts that sample alone."""
    rid, abort_all = upstream.abort_request_arguments(args, kwargs)
    if abort_all or not isinstance(rid, str) or not rid or upstream.has_request_state(self, rid):
        return original(self, *args, **kwargs)
    samples = [k for k in upstream.live_request_rids(self) if _is_sample_of(k, rid)]
    if not samples:
        return original(self, *args, **kwargs)
    # The samples live now are not all of them: until the prefix request has finished, and between
    # two sample sends, some are not yet sent. Their prompt is remembered, so that each one sent
    # later is aborted as it is sent (abort_samples_sent_after_their_request_was_aborted).
    aborted = _aborted_prompts(self)
    for k in samples:
        aborted[_prompt_rid(k)] = None
    for k in samples:
        original(self, **upstream.abort_one_request(k))
    return None


async def abort_samples_sent_after_their_request_was_aborted(
    original: Any, self: Any, tokenized_obj: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND TokenizerManager._send_one_request(tokenized_obj). _handle_batch_request sends a
    parallel request's samples only after its prefix request has finished, whatever happened
    meanwhile: an abort of the request that arrived before (or between sample sends) reached
    only the states that existed then, and stock sends the rest, which decode to the end. A
    sample of a prompt whose request was aborted is aborted through the stock path right after
    its send (the scheduler receives both in order, so it never decodes)."""
    result = await original(self, tokenized_obj, *args, **kwargs)
    aborted = getattr(self, _ABORTED_PROMPTS, None)
    if aborted:
        rid = tokenized_obj.rid
        prompt = _prompt_rid(rid) if isinstance(rid, str) else None
        if prompt is not None and prompt != rid and prompt in aborted:
            self.abort_request(**upstream.abort_one_request(rid))
        _forget_ended_prompts(aborted, upstream.live_request_rids(self))
    return result


# TokenizerManager attribute (the plugin's own) holding the prompt rids of aborted parallel
# requests; empty unless an abort of a parallel request is in progress.
_ABORTED_PROMPTS = "_lora_versions_aborted_parallel_prompts"
_SAMPLE_UUID_TAIL = re.compile(_SAMPLE_UUID + "$")


def _aborted_prompts(tm: Any) -> dict[str, None]:
    aborted = getattr(tm, _ABORTED_PROMPTS, None)
    if aborted is None:
        aborted = {}
        setattr(tm, _ABORTED_PROMPTS, aborted)
    return aborted


def _prompt_rid(rid: str) -> str:
    """``r_0`` for a sample ``r_0-{uuid}`` (and for the prompt state ``r_0`` itself)."""
    return _SAMPLE_UUID_TAIL.sub("", rid)


def _forget_ended_prompts(aborted: dict[str, None], live_rids: list[Any]) -> None:
    """A prompt is remembered while any state of its request lives: its own (until the prefix
    request has finished) or a sample's. _handle_batch_request drops the prompt's state and makes
    the first sample's without an await between, so no moment between them is seen here."""
    live = {_prompt_rid(k) for k in live_rids if isinstance(k, str)}
    for prompt in [p for p in aborted if p not in live]:
        del aborted[prompt]


def _is_sample_of(state_rid: Any, rid: str) -> bool:
    return (
        isinstance(state_rid, str)
        and state_rid.startswith(rid)
        and _SAMPLE_RID_TAIL.fullmatch(state_rid, len(rid)) is not None
    )
