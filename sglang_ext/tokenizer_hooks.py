"""Request-path guards in the engine's main process (registered by :mod:`sglang_ext.hooks`).

- No forged internal fields: ``lora_id`` and the other fields SGLang sets itself are refused with
  FORBIDDEN_FIELD before any request state exists and before anything is acquired (a forged id
  bypasses the refcount, wedges a victim's counter, or crashes the scheduler on an unknown id).
- Managed names are served only while READY on this engine: never a fallback to the base model or
  the latest version, never an implicit reload (UNKNOWN_VERSION, VERSION_NOT_READY,
  VERSION_RECLAIMED), checked again at the acquire point so a race with reclaim cannot slip by.
- Release only what was acquired.
- Inputs that stock 0.5.23 lets through to a crash are INVALID_REQUEST, checked before the step
  that crashes: a per-prompt list (``lora_path``, ``sampling_params``) without one entry per
  prompt, a ``rid`` list for a single prompt and a ``stop_regex`` SGLang's own parse refuses
  (before any request state), an empty prompt, a token id outside the vocabulary and
  ``top_logprobs_num`` past it (after tokenisation, before the scheduler).
- With ``n > 1``: one entry per prompt in a per-prompt list, read against the samples SGLang's
  normalisation repeated, and a ``rid`` sent as one string (a list would leave LoRA counts that
  nothing releases). What happens to the samples themselves (their rids, an abort reaching each
  one) is :mod:`sglang_ext.parallel_sampling`'s.
- The ``max_loaded_loras`` eviction never picks a managed version (the one unload rule decides).
- HTTP pre-checks answer with our own status and body before a streaming response starts.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import AsyncIterator
from typing import Any

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import is_managed_name
from sglang_ext import lora_registry_patch as upstream
from sglang_ext.engine_state import engine_state
from sglang_ext.http_routes import error_response
from sglang_ext.native_lora import managed_call
from sglang_ext.parallel_sampling import parallel_samples
from sglang_ext.served_version import with_served_versions
from sglang_ext.version_table import may_unload_now

# The request fields the guards read, their defaults and the formats of SGLang's ids are SGLang
# facts: named and checked at start in the pin module (upstream.INTERNAL_FIELDS,
# RAW_FIELD_DEFAULTS, PER_PROMPT_LISTS, UUID_HEX, DECLARED_FIELDS, NORMALISED_ATTRIBUTES), and
# read here as they are, never through a default that would switch a guard off on a rename.

# Req.extra_key = client extra_key + lora_id (plain concatenation): a base request whose extra_key
# ends like a lora_id would share that adapter's prefix-cache namespace.
_LORA_ID_SUFFIX = re.compile(upstream.UUID_HEX + "$")


class RequestRefused(LoraVersionError, ValueError):
    """A refused generation request. Also a ValueError so every stock handler on the way runs its
    own cleanup and answers a 4xx; ``status_code`` is read by SGLang's error responses."""

    @property
    def status_code(self) -> int:
        return self.http_status


# Set by the HTTP pre-checks: a refusal raised deeper in the same task (a race with reclaim) is
# collected here so the HTTP layer can still answer with our body and status.
_refusals: contextvars.ContextVar[list[LoraVersionError] | None] = contextvars.ContextVar(
    "lora_versions_refusals", default=None
)


def refuse(code: ErrorCode, message: str, **details: Any) -> RequestRefused:
    err = RequestRefused(code, message, **details)
    sink = _refusals.get()
    if sink is not None:
        sink.append(err)
    return err


def lora_names(lora_path: Any) -> list[str]:
    if not lora_path:
        return []
    if isinstance(lora_path, str):
        return [lora_path]
    return [n for n in lora_path if isinstance(n, str) and n]


def check_servable(names: list[str]) -> None:
    """Raise the version error for the first managed name this engine may not serve now (the
    rule is the table's; this only supplies what SGLang's registry says about the name)."""
    state = engine_state()
    if state.table is None or state.native is None:
        return
    for name in names:
        err = state.table.request_gate(name, state.native.lora_id_of(name), probing=managed_call.get())
        if err is not None:
            raise refuse(err.code, err.message, **err.details)


def raw_forbidden_fields(body: dict[str, Any]) -> list[str]:
    """Engine-internal fields a raw request body sets to anything but their upstream default
    (``is``: JSON null and false are singletons; 0 is not false here)."""
    defaults = upstream.RAW_FIELD_DEFAULTS
    return sorted(f for f, default in defaults.items() if f in body and body[f] is not default)


def forbidden_fields(obj: Any) -> list[str]:
    """The engine-set fields a request sets (a GenerateReqInput or an EmbeddingReqInput, each with
    the fields its type declares), and an extra_key ending like a lora_id."""
    bad = [f for f in upstream.internal_fields(obj) if getattr(obj, f) is not None]
    if not upstream.is_generation(obj):
        return bad  # an embedding request has no extra_key
    keys = obj.extra_key if isinstance(obj.extra_key, list) else [obj.extra_key]
    if any(isinstance(k, str) and _LORA_ID_SUFFIX.search(k) for k in keys):
        bad.append("extra_key")
    return bad


# --------------------------------------------------------------------------------------------
# Hooks on TokenizerManager (every generation request passes here: HTTP routes and Engine API)
# --------------------------------------------------------------------------------------------


async def refuse_forged_internal_fields(
    original: Any, self: Any, obj: Any, *args: Any, **kwargs: Any
) -> AsyncIterator:
    """AROUND TokenizerManager.generate_request (an async generator). Runs before
    ``_init_req_state``: refusing later would make the failure cleanup release the forged id.
    Every generation reply it yields names what served its tokens (:mod:`sglang_ext.served_version`)."""
    bad = forbidden_fields(obj)
    if bad:
        raise refuse(
            ErrorCode.FORBIDDEN_FIELD, f"fields set by the engine itself may not be sent: {bad}", fields=bad
        )
    generation = upstream.is_generation(obj)
    agen = original(self, obj, *args, **kwargs)
    try:
        async for out in agen:
            yield with_served_versions(out, managed_digest) if generation else out
    finally:
        await agen.aclose()


def managed_digest(lora_name: str) -> str | None:
    """The full digest of a managed version this engine knows (its record outlives its unload)."""
    table = engine_state().table
    v = table.get(lora_name) if table is not None else None
    return v.digest if v is not None else None


def refuse_what_normalisation_lets_through(self: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE TokenizerManager._init_req_state: after SGLang's normalisation (batch size, parallel
    samples and per-prompt lists are settled), before any request state exists and before anything
    is acquired. Stock 0.5.23 normalisation lets each of these through, and a later step fails
    with something that is not a ValueError (an untyped 500) or acquires what nothing releases
    (tests/plugin_tests/test_control_hardening_engines.py). The shape checks read what
    normalisation set; a sub-request SGLang cuts from a normalised batch (``obj[i]``, for parallel
    sampling) has none of it, and its batch was checked as a whole."""
    if upstream.normalised(obj):
        for field in upstream.PER_PROMPT_LISTS:
            check_one_entry_per_prompt(obj, field)
        check_rid_names_one_request(obj)
        check_parallel_rids(obj)
    check_stop_regexes(self, obj)
    return None


def check_one_entry_per_prompt(obj: Any, field: str) -> None:
    """A per-prompt list has exactly one entry per prompt (SGLang's own rule for its ``rid`` and
    ``watermark`` lists); a single prompt takes one value. Otherwise stock acquires a
    ``lora_path`` entry nothing releases, reaches the scheduler with a list as a lora id, or
    indexes past a short ``sampling_params`` list (IndexError) and reads a single prompt's list
    as its parameters (AttributeError). Normalisation repeated the list once per parallel
    sample, so the user's own count is ``len // samples``."""
    value = getattr(obj, field)
    if not isinstance(value, list):
        return
    if obj.is_single:
        raise refuse(ErrorCode.INVALID_REQUEST, f"{field} must be one value, not a list, for a single prompt")
    samples = parallel_samples(obj)
    prompts = obj.batch_size
    if len(value) != prompts * samples:
        entries = len(value) // samples
        raise refuse(
            ErrorCode.INVALID_REQUEST,
            f"{field} has {entries} entries for {prompts} prompts: send one per prompt",
            entries=entries,
            expected=prompts,
        )


def check_rid_names_one_request(obj: Any) -> None:
    """A single prompt's ``rid`` is one string. SGLang checks a batch's rid list against the batch
    but not this: a list becomes the request's key in ``rid_to_state`` (unhashable, a TypeError)."""
    if obj.is_single and isinstance(obj.rid, list):
        raise refuse(ErrorCode.INVALID_REQUEST, "rid must be a string for a single prompt, not a list")


def check_parallel_rids(obj: Any) -> None:
    """With n > 1, ``rid`` is one string (or none). Normalisation expands a string into one rid
    per prompt and sample, but keeps a list as sent (one per prompt): then ``_init_req_state``
    makes one state per prompt while the acquire takes a LoRA count per sample, and every
    failure before the samples take over (a long prompt, a refusal, a disconnect) releases only
    the prompts' counts. The rest would hold the version's native count above 0 forever, so
    its unload would never happen."""
    samples = parallel_samples(obj)
    rid = obj.rid
    if samples > 1 and isinstance(rid, list) and len(rid) != obj.batch_size * samples:
        raise refuse(
            ErrorCode.INVALID_REQUEST,
            f"rid as a list with n={samples}: send one rid string (each sample's rid starts with it)",
        )


def check_stop_regexes(tm: Any, obj: Any) -> None:
    """Every ``stop_regex`` passes SGLang's own normalisation of it, run here instead of in
    ``_create_tokenized_object`` (after the LoRA acquire), where the parse's ``re.error`` is not a
    ValueError and became a 500. Each distinct parameter dict once: normalisation repeats one dict
    for every prompt and sample."""
    params = obj.sampling_params
    distinct = {id(p): p for p in (params if isinstance(params, list) else [params]) if isinstance(p, dict)}
    for sampling_params in distinct.values():
        stop_regex = sampling_params.get("stop_regex")
        if stop_regex is None:
            continue
        try:
            upstream.normalize_stop_regex(tm, stop_regex)
        except re.error as exc:
            raise refuse(
                ErrorCode.INVALID_REQUEST, f"stop_regex {exc.pattern!r} is not a regular expression: {exc}"
            ) from None
        except ValueError as exc:  # SGLang's caps on the patterns' count and length
            raise refuse(ErrorCode.INVALID_REQUEST, f"stop_regex refused: {exc}") from None


def refuse_inputs_that_crash_the_scheduler(
    self: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any
) -> None:
    """BEFORE TokenizerManager._validate_one_request(obj, input_ids): runs once per (sub-)request
    after tokenisation, on every route (/generate, OpenAI, Engine API) and before anything is
    sent to the scheduler. Stock 0.5.23 forwards these inputs, and the scheduler process dies on
    each of them (seen on CPU; tests/plugin_tests/test_control_hardening_engines.py), which takes the
    whole engine and every session on it down:

    - an empty prompt (``text: ""``, or ``[]`` inside a batch; stock refuses only a top-level
      empty ``input_ids``);
    - a token id outside ``[0, vocab_size)`` (a negative id crashes the embedding; an id past the
      vocabulary silently embeds garbage on CPU and is a device-side assert on a GPU);
    - ``top_logprobs_num`` larger than the vocabulary (``topk`` out of range in the scheduler).

    The refusal is a ValueError, so the stock failure path releases whatever was acquired."""
    if input_ids is None:
        # embeddings (normalisation keeps input_embeds only when no input_ids were sent) or a
        # multimodal placeholder: no token ids to check
        return None
    if len(input_ids) == 0:
        raise refuse(ErrorCode.INVALID_REQUEST, "the prompt is empty: send at least one token")
    vocab_size = upstream.vocab_size(self)
    bad = next((t for t in input_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise refuse(
            ErrorCode.INVALID_REQUEST,
            f"token id {bad} is outside the vocabulary [0, {vocab_size})",
            vocab_size=vocab_size,
        )
    if not upstream.is_generation(obj):
        return None  # an embedding request has no logprobs
    top = obj.top_logprobs_num
    if obj.return_logprob and isinstance(top, int) and top > vocab_size:
        raise refuse(
            ErrorCode.INVALID_REQUEST,
            f"top_logprobs_num {top} exceeds the vocabulary size {vocab_size}",
            vocab_size=vocab_size,
        )
    return None


async def serve_only_ready_managed_versions(
    original: Any, self: Any, obj: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND TokenizerManager._resolve_lora_path, the acquire point. Managed names: served only
    while READY, never implicitly reloaded; a stock ValueError after losing a race with reclaim
    (nothing was acquired: acquire is all-or-nothing) becomes the precise version error."""
    managed = [n for n in lora_names(obj.lora_path) if is_managed_name(n)]
    if not managed:
        return await original(self, obj, *args, **kwargs)
    check_servable(managed)
    try:
        result = await original(self, obj, *args, **kwargs)
    except ValueError:
        check_servable(managed)
        raise
    metrics = engine_state().metrics
    for name in managed:
        metrics.served(name)  # acquired: admitted for that version
    return result


def release_only_what_was_acquired(original: Any, self: Any, state: Any) -> Any:
    """AROUND TokenizerManager._release_lora_once: a request that failed before acquire has no
    lora_id; stock would schedule release(None) (a TypeError in a fire-and-forget task)."""
    if not upstream.lora_released(state) and upstream.acquired_lora_id(state) is None:
        upstream.mark_lora_released(state)
        return None
    return original(self, state)


async def lru_never_picks_managed(self: Any, exclude_pinned: bool = False) -> str | None:
    """REPLACE LoRARegistry.lru_lora_name: the max_loaded_loras eviction path asks the one rule of
    every unload (version_table.may_unload_now) with SGLang's reading of each candidate: its
    count, and that its name resolves (every candidate comes from the registry). So a managed
    version is never the stock path's to evict: its removal (reclaim, cleanup) unregisters it
    first. A managed-looking name the table does not hold is not ours: stock rules."""
    state = engine_state()
    table, native = state.table, state.native

    def may_evict(name: str) -> bool:
        if not is_managed_name(name):
            return True
        in_flight = native.in_flight(native.lora_id_of(name)) if native is not None else None
        return may_unload_now(table.get(name) if table else None, in_flight, resolvable=True)

    return await upstream.lru_lora_name_never_managed(self, exclude_pinned, may_evict)


# --------------------------------------------------------------------------------------------
# HTTP pre-checks (answer with our status and body before any streaming response starts)
# --------------------------------------------------------------------------------------------


async def _with_refusal_sink(call: Any) -> Any:
    sink: list[LoraVersionError] = []
    token = _refusals.set(sink)
    try:
        response = await call()
    finally:
        _refusals.reset(token)
    return error_response(sink[-1]) if sink else response


def check_sampling_params_not_empty(obj: Any) -> None:
    """An empty ``sampling_params`` list has no entry for any prompt; stock normalisation reads its
    first entry for ``n`` (IndexError, a 500). Only a raw /generate body can send a list."""
    if obj.sampling_params == []:
        raise refuse(ErrorCode.INVALID_REQUEST, "sampling_params is an empty list: send one per prompt")


async def precheck_generate(original: Any, obj: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND http_server.serve_generate_request (looked up at call time by the /generate route)."""
    try:
        body = await request.json()
        raw_bad = raw_forbidden_fields(body) if isinstance(body, dict) else []
        bad = sorted(set(raw_bad) | set(forbidden_fields(obj)))
        if bad:
            raise refuse(
                ErrorCode.FORBIDDEN_FIELD,
                f"fields set by the engine itself may not be sent: {bad}",
                fields=bad,
            )
        check_sampling_params_not_empty(obj)
        check_servable(lora_names(obj.lora_path))
    except LoraVersionError as err:
        return error_response(err)
    return await _with_refusal_sink(lambda: original(obj, request, *args, **kwargs))


async def precheck_openai(
    original: Any, self: Any, request: Any, raw_request: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND OpenAIServingBase.handle_request (/v1/completions, /v1/chat/completions, ...)."""
    try:
        if hasattr(request, "model") and hasattr(request, "lora_path"):
            check_servable(lora_names(upstream.openai_lora_path(self, request)))
    except LoraVersionError as err:
        return error_response(err)
    return await _with_refusal_sink(lambda: original(self, request, raw_request, *args, **kwargs))
