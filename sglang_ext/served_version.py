"""Every reply names the version the engine ran for it (issue 39), read from the batch, not from
the request.

Scheduler process (one forward step at a time, on the scheduler thread):

1. The LoRA backend SGLang builds for the engine is a subclass (:func:`backend_that_reports_its_rows`)
   whose ``prepare_lora_batch`` notes the slot index and rank of every row as it receives them:
   what the LoRA kernels of this step read. A row whose slot has rank 0 this step runs on the base
   model, whatever its slot held before (upstream's rule: a row of an adapter not in the pool gets
   the base model's slot index, and only the adapters of this batch get a rank).
2. Right after the manager prepared the batch (:func:`read_the_rows_each_batch_runs`), each row's
   slot is named by what the pool holds there now: the adapter's ``lora_name``, or
   :data:`~lora_contract.served_version.BASE_MODEL`.
3. After the step (:func:`mark_each_request_with_what_ran`), each request of the batch (rows are
   ``ScheduleBatch.reqs`` in order) remembers what its last step ran; a step whose rows cannot be
   matched to its requests leaves them unattested, never guessed.
4. Before each output is streamed (:func:`streamer_class_that_attests_tokens`), every new output
   token of a request gets one entry: what its request's last step ran. Entries travel in SGLang's
   per-request ``customized_info`` (a token-level key, sliced with the tokens sent), so stock
   code carries them to the tokenizer manager for every reply path: non-streamed, every streamed
   chunk, every sample of ``n > 1``.

Main process: :func:`with_served_versions` replaces the entries in each reply's ``meta_info`` by
spans in the shape of SGLang's ``weight_versions`` (:mod:`lora_contract.served_version`), with a
managed version's full digest from this engine's version table.

Limits: under the overlap scheduler (the GPU proof test only, never served) a step's rows are
read before the previous step's tokens are streamed, so a version change between two steps of a
request would be attested one step late; SGLang's Rust egress does not carry ``customized_info``
(SGLang itself refuses this streamer with it). With tensor parallelism every rank reads its own
rows; rank 0's outputs are the ones streamed.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

from lora_contract.served_version import BASE_MODEL, LAST_KEY, SPANS_KEY, attach_served_versions
from sglang_ext import lora_registry_patch as upstream

UNREADABLE = "unreadable"  # the backend was asked, but what it received could not be read


class _Step(threading.local):
    """What the LoRA backend and manager saw of the step under way (scheduler thread)."""

    def __init__(self) -> None:
        # (weight_indices, lora_ranks) as the backend received them; None: it was not asked
        self.slots: tuple[list[int], list[int]] | str | None = None
        self.rows: list[str | None] | None = None  # per row: adapter name, BASE_MODEL, None (unknown)


_STEP = _Step()
# Per request (its Req object): what its last step ran. Weak: the entry goes with the request.
_SERVED: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------------- scheduler process


def note_the_rows_received(call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> None:
    try:
        weight_indices, lora_ranks = upstream.backend_batch_rows(call_args, call_kwargs)
        _STEP.slots = (list(weight_indices), list(lora_ranks))
    except (upstream.SchedulerUnreadable, TypeError):
        _STEP.slots = UNREADABLE  # never fails the step: its tokens go unattested


def backend_that_reports_its_rows(backend_class: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER lora.backend.lora_registry.get_backend_from_name (LoRAManager.__init__ builds its
    backend from the class returned): the same class, whose ``prepare_lora_batch`` first notes
    the rows it receives. Every behaviour, ``isinstance`` included, is the backend's own."""
    return _reporting(backend_class)


@functools.cache  # one subclass per backend class, however often the factory is asked
def _reporting(backend_class: type) -> type:
    def prepare_lora_batch(self: Any, *call_args: Any, **call_kwargs: Any) -> Any:
        note_the_rows_received(call_args, call_kwargs)
        return super(reporting, self).prepare_lora_batch(*call_args, **call_kwargs)

    reporting = type(
        backend_class.__name__,
        (backend_class,),
        {"prepare_lora_batch": prepare_lora_batch, "__module__": __name__},
    )
    return reporting


def rows_served(
    slots: tuple[list[int], list[int]] | str | None, lora_ids: list[Any], slot_names: list[str | None]
) -> list[str | None]:
    """Per row, what ran: the name of the adapter in its slot, BASE_MODEL for a slot of rank 0
    this step, None when it cannot be read. ``slots`` None: the backend was not asked (upstream
    skips it only for an all-base batch, on the backends that route explicitly)."""
    if slots is None:
        every_row_base = all(i is None for i in lora_ids)
        return [BASE_MODEL if every_row_base else None for _ in lora_ids]
    if not isinstance(slots, tuple) or len(slots[0]) != len(lora_ids):
        return [None] * len(lora_ids)
    indices, ranks = slots
    out: list[str | None] = []
    for index in indices:
        if not (isinstance(index, int) and 0 <= index < len(ranks) and index < len(slot_names)):
            out.append(None)
        elif ranks[index] == 0:
            out.append(BASE_MODEL)  # upstream gives a rank only to the adapters of this batch
        else:
            out.append(slot_names[index])
    return out


def read_the_rows_each_batch_runs(
    original: Any, manager: Any, forward_batch: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND LoRAManager.prepare_lora_batch(forward_batch): after upstream prepared the step's
    LoRA batch, name what each row runs, from the slots the backend received and what the pool
    holds in them now (no load or unload runs between here and the forward: same thread)."""
    _STEP.slots = None
    result = original(manager, forward_batch, *args, **kwargs)
    try:
        _STEP.rows = rows_served(
            _STEP.slots, upstream.forward_lora_ids(forward_batch), upstream.slot_lora_names(manager)
        )
    except upstream.SchedulerUnreadable:
        _STEP.rows = None
    return result


def mark_each_request_with_what_ran(
    original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND Scheduler.run_batch(batch): after the step, each of its requests remembers what its
    row ran (the tokens this step adds are attested with it when they are streamed)."""
    _STEP.rows = None
    result = original(scheduler, batch, *args, **kwargs)
    rows, _STEP.rows = _STEP.rows, None
    try:
        reqs = upstream.batch_reqs(batch)
        if rows is None or len(rows) != len(reqs):
            rows = [None] * len(reqs)
        for req, served in zip(reqs, rows, strict=True):
            attest_new_tokens(req)  # tokens of an earlier step not streamed yet keep its attestation
            _SERVED[req] = served
    except upstream.SchedulerUnreadable:
        pass  # checked at start (scheduler_problems); never fails a step: its tokens go unattested
    return result


def attest_new_tokens(req: Any) -> None:
    """One entry per output token not attested yet: what the request's last step ran."""
    entries = upstream.served_token_entries(req)
    tokens = upstream.output_token_count(req)
    if len(entries) > tokens:  # upstream dropped output tokens (a retraction restarting one)
        del entries[tokens:]
    elif len(entries) < tokens:
        entries.extend([_SERVED.get(req)] * (tokens - len(entries)))


def streamer_class_that_attests_tokens(scheduler: Any, *args: Any, **kwargs: Any) -> type:
    """REPLACE Scheduler.get_output_streamer_class (its only caller builds the scheduler's output
    streamer): upstream's streamer, whose ``stream_output`` first attests every new token of the
    requests it streams."""
    return _attesting_streamer()


@functools.cache  # built once per process
def _attesting_streamer() -> type:
    base = upstream.symbol("SchedulerOutputStreamer")

    def stream_output(self: Any, reqs: Any, *call_args: Any, **call_kwargs: Any) -> Any:
        for req in reqs:
            attest_new_tokens(req)
        return base.stream_output(self, reqs, *call_args, **call_kwargs)

    return type(base.__name__, (base,), {"stream_output": stream_output, "__module__": __name__})


# ------------------------------------------------------------------------------ main process


def name_the_served_versions_in_openai_metadata(
    metadata: Any, meta_info: Any, *args: Any, **kwargs: Any
) -> Any:
    """AFTER weight_versions.build_endpoint_weight_version_metadata(meta_info): a non-streamed
    OpenAI chat or completion response's ``metadata`` also carries the served versions (of its
    first choice, the one upstream reads the weight version from)."""
    if isinstance(metadata, dict) and isinstance(meta_info, dict) and SPANS_KEY in meta_info:
        return {**metadata, SPANS_KEY: meta_info[SPANS_KEY], LAST_KEY: meta_info.get(LAST_KEY)}
    return metadata


def with_served_versions(out: Any, digest_of: Any) -> Any:
    """A reply of TokenizerManager.generate_request (one dict, or a list of one per sample) with
    its per-token entries replaced by the spans."""
    for one in out if isinstance(out, list) else (out,):
        meta = one.get("meta_info") if isinstance(one, dict) else None
        if isinstance(meta, dict):
            attach_served_versions(meta, digest_of)
    return out
