"""Fast unit tests of the request rules in ``tokenizer_hooks`` (the engine tests prove them over
HTTP on real engines; these pin the rule itself so a mutation fails in milliseconds). Every
refusal branch of every guard, at its boundary, without an engine."""

from __future__ import annotations

import contextlib
import json
import types
from typing import Any

import pytest
from sglang.srt.sampling.sampling_params import MAX_STOP_REGEX_COUNT, MAX_STOP_REGEX_LEN

from lora_contract.errors import HTTP_STATUS, ErrorCode, LoraVersionError
from sglang_ext import lora_registry_patch as upstream
from sglang_ext.lora_registry_patch import INTERNAL_FIELDS
from sglang_ext.native_lora import managed_call
from sglang_ext.parallel_sampling import (
    abort_every_sample_of_a_parallel_request,
    sample_rids_under_the_request_rid,
)
from sglang_ext.tokenizer_hooks import (
    RequestRefused,
    check_servable,
    forbidden_fields,
    lora_names,
    lru_never_picks_managed,
    precheck_generate,
    precheck_openai,
    raw_forbidden_fields,
    refuse_forged_internal_fields,
    refuse_inputs_that_crash_the_scheduler,
    refuse_what_normalisation_lets_through,
    release_only_what_was_acquired,
    serve_only_ready_managed_versions,
)

LORA_ID = "0123456789abcdef0123456789abcdef"  # the shape of SGLang's lora_id (uuid4().hex)


def req(**fields: object) -> Any:
    """A GenerateReqInput as generate_request receives it (before normalisation)."""
    return upstream.symbol("GenerateReqInput")(text="hi", **fields)


def test_a_plain_request_is_allowed() -> None:
    assert forbidden_fields(req(extra_key="tenant-7")) == []
    assert forbidden_fields(req(extra_key=["a", "b"])) == []


@pytest.mark.parametrize("field", INTERNAL_FIELDS)
def test_every_engine_set_field_is_forbidden(field: str) -> None:
    assert forbidden_fields(req(**{field: "x"})) == [field]


def test_lora_id_is_forbidden_even_when_empty() -> None:
    assert forbidden_fields(req(lora_id="")) == ["lora_id"]


@pytest.mark.parametrize(
    "extra_key",
    [LORA_ID, f"tenant{LORA_ID}", ["ok", f"x{LORA_ID}"]],
)
def test_an_extra_key_ending_like_a_lora_id_is_forbidden(extra_key: object) -> None:
    # Req.extra_key = extra_key + lora_id: such a base request would share an adapter's cache.
    assert forbidden_fields(req(extra_key=extra_key)) == ["extra_key"]


@pytest.mark.parametrize("extra_key", [LORA_ID[:-1], f"{LORA_ID}-x", LORA_ID.upper(), ["a", None]])
def test_an_extra_key_that_does_not_end_like_a_lora_id_is_allowed(extra_key: object) -> None:
    assert forbidden_fields(req(extra_key=extra_key)) == []


@pytest.mark.parametrize("field", [*INTERNAL_FIELDS, "received_time", "positional_embed_overrides"])
@pytest.mark.parametrize("value", ["x", 0, 0.0, False, "", [], {}])
def test_a_raw_body_may_not_set_an_internal_field(field: str, value: object) -> None:
    # 0 and false are not null: only the field's exact upstream default is "not set".
    assert raw_forbidden_fields({"text": "hi", field: value}) == [field]


@pytest.mark.parametrize("value", [True, 1, 0, None, "false"])
def test_return_bytes_is_refused_unless_false(value: object) -> None:
    assert raw_forbidden_fields({"text": "hi", "return_bytes": value}) == ["return_bytes"]


def test_fields_at_their_upstream_default_are_accepted() -> None:
    # What a re-serializing gateway writes (smg 1.13.0 with retries on adds "return_bytes": false).
    body = {"text": "hi", "return_bytes": False, "lora_id": None, "received_time": None}
    assert raw_forbidden_fields(body) == []
    assert raw_forbidden_fields({"text": "hi"}) == []


# --------------------------------------------------------------------------------------------
# The guards below run on real SGLang 0.5.23 request objects, normalised by SGLang itself: the
# shapes (is_single, batch_size, lists repeated per sample) are SGLang's, not a guess of them.
# --------------------------------------------------------------------------------------------

VOCAB = 512
PROMPT = [3, 1, 4]
MANAGED = "relax_policy_lora@t1-7-abcdefabcdef"
OTHER_MANAGED = "relax_policy_lora@t1-8-abcdefabcdef"


def normalized(**fields: Any) -> Any:
    """A GenerateReqInput after SGLang's own normalize_batch_and_arguments (what the hooks see)."""
    obj = upstream.symbol("GenerateReqInput")(**fields)
    obj.normalize_batch_and_arguments()
    return obj


def tokenizer_manager(vocab_size: int = VOCAB, tokenizer: Any = "loaded") -> Any:
    """A TokenizerManager with only what the guards read (no engine behind it)."""
    cls = upstream.symbol("TokenizerManager")
    tm = cls.__new__(cls)
    tm.model_config = types.SimpleNamespace(vocab_size=vocab_size)
    # SamplingParams.normalize reads it only to encode stop strings (none here) and to tell
    # whether the engine runs with skip_tokenizer_init (None)
    tm.tokenizer = object() if tokenizer == "loaded" else tokenizer
    return tm


def refused(call: Any, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> RequestRefused:
    with pytest.raises(RequestRefused) as info:
        call()
    assert info.value.code is code
    assert isinstance(info.value, ValueError), "a ValueError: every stock handler runs its cleanup"
    assert info.value.status_code == HTTP_STATUS[code]  # what SGLang's own error responses read
    return info.value


# ------------------------------------------------ refuse_inputs_that_crash_the_scheduler


def crash_guard(obj: Any, input_ids: Any, vocab_size: int = VOCAB) -> None:
    return refuse_inputs_that_crash_the_scheduler(tokenizer_manager(vocab_size), obj, input_ids)


@pytest.mark.parametrize("token", [0, 1, VOCAB - 1])
def test_token_ids_inside_the_vocabulary_are_admitted(token: int) -> None:
    ids = [*PROMPT, token]
    assert crash_guard(normalized(input_ids=ids), ids) is None


@pytest.mark.parametrize("token", [-1, VOCAB, VOCAB + 1, -VOCAB])
@pytest.mark.parametrize("at", [0, 1, 3])
def test_a_token_id_outside_the_vocabulary_is_refused_wherever_it_is(token: int, at: int) -> None:
    ids = list(PROMPT)
    ids.insert(at, token)
    err = refused(lambda: crash_guard(normalized(input_ids=ids), ids))
    assert str(token) in err.message and err.details == {"vocab_size": VOCAB}


def test_the_vocabulary_bound_is_the_engines_own() -> None:
    ids = [600]
    assert crash_guard(normalized(input_ids=ids), ids, vocab_size=601) is None
    refused(lambda: crash_guard(normalized(input_ids=ids), ids, vocab_size=600))


def test_an_empty_prompt_is_refused_in_every_form_sglang_accepts() -> None:
    # text "" tokenises to [] (the fixture tokenizer adds no BOS): the guard sees the token ids
    refused(lambda: crash_guard(normalized(text=""), []))
    text_batch = normalized(text=["hi", ""])
    refused(lambda: crash_guard(text_batch[1], []))
    ids_batch = normalized(input_ids=[[1], []])
    assert crash_guard(ids_batch[0], ids_batch[0].input_ids) is None
    refused(lambda: crash_guard(ids_batch[1], ids_batch[1].input_ids))


def test_a_top_level_empty_input_ids_never_reaches_the_guard() -> None:
    # why the guard needs no case of its own for it: SGLang refuses it while normalising
    with pytest.raises(ValueError, match="input_ids cannot be empty"):
        normalized(input_ids=[])


def test_embeddings_carry_no_token_ids_and_are_not_checked() -> None:
    obj = normalized(input_embeds=[[0.5, -0.5]])
    assert obj.input_ids is None  # what _tokenize_one_request passes for an embeddings prompt
    assert crash_guard(obj, obj.input_ids) is None
    ids = normalized(input_ids=[1], input_embeds=[[0.5, -0.5]])  # ids win: the embeddings are dropped
    assert ids.input_embeds is None
    refused(lambda: crash_guard(ids, [VOCAB]))


@pytest.mark.parametrize("top", [0, 1, VOCAB - 1, VOCAB])
def test_top_logprobs_num_up_to_the_vocabulary_is_admitted(top: int) -> None:
    # torch.topk over logits cut to vocab_size (LogitsProcessor): any k <= vocab_size is valid
    obj = normalized(input_ids=PROMPT, return_logprob=True, top_logprobs_num=top)
    assert crash_guard(obj, PROMPT) is None


@pytest.mark.parametrize("top", [VOCAB + 1, 10**6])
def test_top_logprobs_num_past_the_vocabulary_is_refused(top: int) -> None:
    obj = normalized(input_ids=PROMPT, return_logprob=True, top_logprobs_num=top)
    err = refused(lambda: crash_guard(obj, PROMPT))
    assert str(top) in err.message


def test_top_logprobs_num_is_not_read_without_return_logprob() -> None:
    obj = normalized(input_ids=PROMPT, return_logprob=False, top_logprobs_num=VOCAB + 1)
    assert crash_guard(obj, PROMPT) is None


def test_each_prompt_of_a_batch_is_checked_with_its_own_top_logprobs_num() -> None:
    obj = normalized(input_ids=[PROMPT, PROMPT], return_logprob=True, top_logprobs_num=[VOCAB, VOCAB + 1])
    assert crash_guard(obj[0], PROMPT) is None
    refused(lambda: crash_guard(obj[1], PROMPT))


# ------------------------------------------------ refuse_what_normalisation_lets_through


def shape_guard(obj: Any, tm: Any = None) -> None:
    return refuse_what_normalisation_lets_through(tm or tokenizer_manager(), obj)


SINGLE = 0  # ``prompts`` below: one prompt sent as a plain prompt, not as a batch of one
# The rule's fields, written out (not the module's tuple: a field dropped there must fail here).
PER_PROMPT_FIELDS = ("lora_path", "sampling_params")


def per_prompt_request(field: str, prompts: int, entries: int, n: int) -> Any:
    """``prompts`` prompts, ``field`` sent as a list of ``entries`` entries, ``n`` samples each."""
    sampling = {"max_new_tokens": 2, "n": n}
    listed = {"lora_path": ["my-plain-adapter"] * entries, "sampling_params": [sampling] * entries}
    fields = {"sampling_params": sampling, field: listed[field]}
    return normalized(input_ids=PROMPT if prompts == SINGLE else [PROMPT] * prompts, **fields)


@pytest.mark.parametrize("field", PER_PROMPT_FIELDS)
@pytest.mark.parametrize(
    ("prompts", "entries", "n"),
    [(2, 2, 1), (3, 3, 1), (2, 2, 2), (1, 1, 1), (SINGLE, 1, 2)],  # the last: n>1 makes a batch
)
def test_a_per_prompt_list_with_one_entry_per_prompt_is_admitted(
    field: str, prompts: int, entries: int, n: int
) -> None:
    assert shape_guard(per_prompt_request(field, prompts, entries, n)) is None


@pytest.mark.parametrize("field", PER_PROMPT_FIELDS)
@pytest.mark.parametrize(
    ("prompts", "entries", "n"),
    [(2, 1, 1), (2, 3, 1), (3, 2, 1), (2, 1, 2), (2, 3, 2), (SINGLE, 2, 2)],
)
def test_a_per_prompt_list_of_another_length_than_the_batch_is_refused(
    field: str, prompts: int, entries: int, n: int
) -> None:
    err = refused(lambda: shape_guard(per_prompt_request(field, prompts, entries, n)))
    expected = max(prompts, 1)
    assert f"{field} has {entries} entries for {expected} prompts" in err.message
    assert err.details == {"entries": entries, "expected": expected}


def test_an_empty_lora_path_list_is_refused_for_a_batch() -> None:
    # stock would index past it (GenerateReqInput.__getitem__); an empty sampling_params list
    # fails inside SGLang's normalisation itself and is refused by the HTTP pre-check
    obj = normalized(input_ids=[PROMPT, PROMPT], lora_path=[])
    assert "lora_path has 0 entries for 2 prompts" in refused(lambda: shape_guard(obj)).message


@pytest.mark.parametrize("field", PER_PROMPT_FIELDS)
def test_a_single_prompt_takes_one_value_not_a_list(field: str) -> None:
    err = refused(lambda: shape_guard(per_prompt_request(field, SINGLE, 1, 1)))
    assert err.message == f"{field} must be one value, not a list, for a single prompt"


def test_plain_values_are_admitted() -> None:
    assert shape_guard(normalized(input_ids=PROMPT, lora_path="x", sampling_params={"n": 1})) is None
    assert shape_guard(normalized(input_ids=[PROMPT] * 2, lora_path="x", sampling_params={"n": 3})) is None
    assert shape_guard(normalized(text="hi")) is None


def test_a_rid_list_for_a_single_prompt_is_refused() -> None:
    for rid in (["a", "b"], ["a"]):
        err = refused(lambda rid=rid: shape_guard(normalized(input_ids=PROMPT, rid=rid)))
        assert err.message == "rid must be a string for a single prompt, not a list"


def test_a_rid_string_or_a_batchs_rid_list_is_admitted() -> None:
    assert shape_guard(normalized(input_ids=PROMPT, rid="a")) is None
    assert shape_guard(normalized(input_ids=[PROMPT, PROMPT], rid=["a", "b"])) is None
    assert shape_guard(normalized(input_ids=PROMPT, rid="a", sampling_params={"n": 2})) is None


@pytest.mark.parametrize(("prompts", "n"), [(SINGLE, 2), (SINGLE, 8), (2, 2)])
def test_a_rid_list_with_parallel_sampling_is_refused(prompts: int, n: int) -> None:
    """Normalisation keeps a rid list as sent (one per prompt) while the acquire takes a count
    per sample: refused, whatever the batch."""
    rid = ["a"] if prompts == SINGLE else [f"r{i}" for i in range(prompts)]
    obj = normalized(
        input_ids=PROMPT if prompts == SINGLE else [PROMPT] * prompts, rid=rid, sampling_params={"n": n}
    )
    err = refused(lambda: shape_guard(obj))
    assert err.message == f"rid as a list with n={n}: send one rid string (each sample's rid starts with it)"


@pytest.mark.parametrize("attribute", ["batch_size", "parallel_sample_num"])
def test_a_normalised_request_without_what_the_shape_guards_read_fails_loudly(attribute: str) -> None:
    """Issue 36: the guards read what normalisation set as it is. An attribute gone (a rename the
    start check missed) is an error, never a default that lets a rid list with n > 1 through."""
    obj = normalized(input_ids=[PROMPT, PROMPT], rid=["a", "b"], sampling_params={"n": 2})
    delattr(obj, attribute)
    with pytest.raises(AttributeError, match=attribute):
        shape_guard(obj)


def test_a_sub_request_cut_from_a_checked_batch_is_not_checked_again() -> None:
    """SGLang's ``obj[i]`` (parallel sampling's _init_req_state calls) has no is_single: SGLang's own
    sign of a sub-request, whose batch was checked as a whole; its stop_regex still is."""
    obj = normalized(input_ids=[PROMPT, PROMPT], rid="r", sampling_params={"n": 2})
    assert not upstream.normalised(obj[0]) and shape_guard(obj[0]) is None
    bad_regex = normalized(input_ids=[PROMPT, PROMPT], sampling_params={"n": 2, "stop_regex": "("})
    refused(lambda: shape_guard(bad_regex[0]))


def test_embedding_requests_pass_the_guards_with_the_fields_their_type_declares() -> None:
    """TokenizerManager.generate_request takes EmbeddingReqInput too: it has no parallel samples,
    logprobs or extra_key, and only two of the engine-set fields."""
    embedding = upstream.symbol("EmbeddingReqInput")
    assert forbidden_fields(embedding(text="hi")) == []
    assert forbidden_fields(embedding(text="hi", lora_id="L", http_worker_ipc="ipc")) == [
        "lora_id",
        "http_worker_ipc",
    ]
    obj = embedding(input_ids=[PROMPT, PROMPT], lora_path=["a", "b"])
    obj.normalize_batch_and_arguments()
    assert shape_guard(obj) is None and crash_guard(obj, PROMPT) is None
    with pytest.raises(TypeError):
        forbidden_fields(types.SimpleNamespace(lora_id=None))  # neither type: no guess of its fields


HEX = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    ("state_rid", "sample"),
    [
        ("r_0", True),
        ("r_11", True),
        (f"r_0-{HEX}", True),
        ("r", False),
        ("rx_0", False),
        ("r_", False),
        ("r_a", False),
        (f"r_0-{HEX[:-1]}", False),
        (f"r_0-{HEX}x", False),
        (f"q_0-{HEX}", False),
    ],
)
def test_an_abort_of_a_parallel_requests_rid_aborts_exactly_its_prompts_and_samples(
    state_rid: str, sample: bool
) -> None:
    aborted: list[tuple[str, bool]] = []

    def original(tm: Any, rid: str = "", abort_all: bool = False) -> None:
        aborted.append((rid, abort_all))

    tm = types.SimpleNamespace(rid_to_state={state_rid: object(), "other": object()})
    abort_every_sample_of_a_parallel_request(original, tm, "r")
    assert aborted == ([(state_rid, False)] if sample else [("r", False)])


def test_an_abort_of_a_known_rid_or_of_all_keeps_stock_behaviour() -> None:
    aborted: list[tuple[Any, ...]] = []

    def original(tm: Any, *args: Any, **kwargs: Any) -> None:
        aborted.append((args, kwargs))

    tm = types.SimpleNamespace(rid_to_state={"r": object(), "r_0": object()})
    abort_every_sample_of_a_parallel_request(original, tm, rid="r")
    abort_every_sample_of_a_parallel_request(original, tm, "", True)
    abort_every_sample_of_a_parallel_request(original, tm, rid="q")
    assert aborted == [((), {"rid": "r"}), (("", True), {}), ((), {"rid": "q"})]


def test_a_samples_new_rid_starts_with_the_rid_it_replaces() -> None:
    obj = normalized(input_ids=PROMPT, rid="turn-7", sampling_params={"n": 2})[0]
    assert obj.rid == "turn-7_0"
    new = sample_rids_under_the_request_rid(type(obj).regenerate_rid, obj)
    assert new == obj.rid and new.startswith("turn-7_0-") and len(new) == len("turn-7_0-") + 32


def with_stop_regex(stop_regex: Any) -> Any:
    return normalized(input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "stop_regex": stop_regex})


@pytest.mark.parametrize(
    "stop_regex",
    ["a+", r"\d{2,3}$", "", [], ["ok", r"(x|y)+"], "a" * MAX_STOP_REGEX_LEN, ["a"] * MAX_STOP_REGEX_COUNT],
)
def test_a_stop_regex_sglang_accepts_is_admitted(stop_regex: Any) -> None:
    assert shape_guard(with_stop_regex(stop_regex)) is None


@pytest.mark.parametrize(
    ("stop_regex", "bad"),
    [("(unclosed", "(unclosed"), ("[z-a]", "[z-a]"), ("*", "*"), ("a{2,1}", "a{2,1}"), (["ok", "(x"], "(x")],
)
def test_a_stop_regex_that_does_not_parse_is_refused(stop_regex: Any, bad: str) -> None:
    err = refused(lambda: shape_guard(with_stop_regex(stop_regex)))
    assert err.message.startswith(f"stop_regex {bad!r} is not a regular expression")


@pytest.mark.parametrize("stop_regex", ["a" * (MAX_STOP_REGEX_LEN + 1), ["a"] * (MAX_STOP_REGEX_COUNT + 1)])
def test_sglangs_own_stop_regex_caps_are_typed_refusals(stop_regex: Any) -> None:
    assert refused(lambda: shape_guard(with_stop_regex(stop_regex))).message.startswith("stop_regex refused")


def test_every_prompt_of_a_batch_has_its_stop_regex_checked() -> None:
    params = [{"max_new_tokens": 2}, {"max_new_tokens": 2, "stop_regex": "ok"}, {"stop_regex": "(x"}]
    obj = normalized(input_ids=[PROMPT] * 3, sampling_params=params)
    assert "'(x'" in refused(lambda: shape_guard(obj)).message


def test_a_stop_regex_without_a_tokenizer_is_refused_as_sglang_would() -> None:
    # skip_tokenizer_init: stock refuses stop_regex later (a ValueError); now typed and before state
    tm = tokenizer_manager(tokenizer=None)
    err = refused(lambda: shape_guard(with_stop_regex("a+"), tm))
    assert "skip_tokenizer_init" in err.message


# ------------------------------------------------ precheck_generate / precheck_openai


class FakeRequest:
    def __init__(self, body: Any) -> None:
        self.body = body

    async def json(self) -> Any:
        return self.body


class Recorder:
    """An ``original`` that records its calls and answers ``reply`` (or raises ``raises``)."""

    def __init__(self, reply: Any = "stock-response", raises: BaseException | None = None) -> None:
        self.reply = reply
        self.raises = raises
        self.calls: list[tuple] = []

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(args)
        if self.raises is not None:
            raise self.raises
        return self.reply() if callable(self.reply) else self.reply


class FakeTable:
    """request_gate refusing the names in ``refuse`` (the rule itself: test_version_table.py)."""

    def __init__(self, refuse: dict[str, ErrorCode] | None = None) -> None:
        self.refuse = dict(refuse or {})
        self.asked: list[tuple[str, Any, bool]] = []

    def request_gate(self, name: str, lora_id: Any, *, probing: bool = False) -> LoraVersionError | None:
        self.asked.append((name, lora_id, probing))
        code = self.refuse.get(name)
        return LoraVersionError(code, f"{name} refused", lora_name=name) if code else None

    def get(self, name: str) -> Any:
        return None


class FakeMetrics:
    def __init__(self) -> None:
        self.served_names: list[str] = []
        self.refusals: list[str] = []

    def served(self, name: str) -> None:
        self.served_names.append(name)

    def refused(self, code: str) -> None:
        self.refusals.append(code)


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """The engine state the guards read: a gate, SGLang's registry ids, metrics."""
    import sglang_ext.engine_state as engine_state_module
    import sglang_ext.http_routes as http_routes
    import sglang_ext.tokenizer_hooks as tokenizer_hooks

    fake = types.SimpleNamespace(
        table=FakeTable(),
        # every id at zero in flight: the LRU's reading (never a reason by itself to evict)
        native=types.SimpleNamespace(lora_id_of=lambda name: f"id-of-{name}", in_flight=lambda lora_id: 0),
        metrics=FakeMetrics(),
    )
    # http_routes and tokenizer_hooks bound the name at import
    for module in (engine_state_module, http_routes, tokenizer_hooks):
        monkeypatch.setattr(module, "engine_state", lambda: fake)
    return fake


def raw(**fields: Any) -> Any:
    """A GenerateReqInput as the /generate route parsed it (before normalisation)."""
    return upstream.symbol("GenerateReqInput")(**fields)


def body_of(response: Any) -> dict:
    return json.loads(response.body)


async def test_precheck_generate_refuses_a_forged_raw_field_before_the_route_runs(state) -> None:
    original = Recorder()
    obj = raw(input_ids=PROMPT)
    response = await precheck_generate(original, obj, FakeRequest({"input_ids": PROMPT, "lora_id": "x"}))
    assert response.status_code == 400 and body_of(response)["error"]["code"] == "FORBIDDEN_FIELD"
    assert body_of(response)["error"]["fields"] == ["lora_id"]
    assert original.calls == []


async def test_precheck_generate_refuses_a_forged_field_on_the_parsed_request(state) -> None:
    original = Recorder()
    obj = raw(input_ids=PROMPT, extra_key="0123456789abcdef" * 2)
    response = await precheck_generate(original, obj, FakeRequest({"input_ids": PROMPT}))
    assert body_of(response)["error"]["code"] == "FORBIDDEN_FIELD" and original.calls == []


async def test_precheck_generate_refuses_an_empty_sampling_params_list(state) -> None:
    original = Recorder()
    obj = raw(input_ids=PROMPT, sampling_params=[])
    response = await precheck_generate(original, obj, FakeRequest({"input_ids": PROMPT}))
    assert response.status_code == 400 and body_of(response)["error"]["code"] == "INVALID_REQUEST"
    assert "sampling_params" in body_of(response)["error"]["message"]
    assert original.calls == []


@pytest.mark.parametrize("sampling_params", [None, {}, [{"max_new_tokens": 2}]])
async def test_precheck_generate_lets_other_sampling_params_through(state, sampling_params: Any) -> None:
    original = Recorder()
    obj = raw(input_ids=PROMPT, sampling_params=sampling_params)
    assert await precheck_generate(original, obj, FakeRequest({"input_ids": PROMPT})) == "stock-response"
    assert len(original.calls) == 1


async def test_precheck_generate_asks_the_gate_for_every_named_version(state) -> None:
    state.table.refuse[OTHER_MANAGED] = ErrorCode.VERSION_NOT_READY
    original = Recorder()
    obj = raw(input_ids=[PROMPT, PROMPT], lora_path=[MANAGED, OTHER_MANAGED])
    response = await precheck_generate(original, obj, FakeRequest({}))
    assert response.status_code == 409 and body_of(response)["error"]["code"] == "VERSION_NOT_READY"
    assert original.calls == []
    assert [name for name, _, _ in state.table.asked] == [MANAGED, OTHER_MANAGED]


async def test_a_refusal_raised_inside_the_route_is_answered_with_its_own_body(state) -> None:
    """A guard deeper in the same request (here: the shape guard) refuses; the stock route
    answers its own untyped 400, which the pre-check replaces with the typed refusal."""
    obj = normalized(input_ids=PROMPT, rid=["a", "b"])  # as the route's generate_request sees it

    def route_that_runs_the_guard() -> str:
        try:
            shape_guard(obj)
        except ValueError:
            return "stock-400"
        return "stock-200"

    response = await precheck_generate(Recorder(route_that_runs_the_guard), obj, FakeRequest({}))
    assert response.status_code == 400 and body_of(response)["error"]["code"] == "INVALID_REQUEST"
    assert state.metrics.refusals == ["INVALID_REQUEST"]
    # the sink is the request's own: the next request answers its route's response
    assert await precheck_generate(Recorder(), raw(input_ids=PROMPT), FakeRequest({})) == "stock-response"


class FakeServing:
    """OpenAIServingBase as the pre-check reads it: ``model="base:adapter"`` wins over lora_path."""

    def _resolve_lora_path(self, model: str, lora_path: Any) -> Any:
        return model.split(":", 1)[1] if ":" in model else lora_path


async def test_precheck_openai_asks_the_gate_for_the_resolved_adapter(state) -> None:
    state.table.refuse[MANAGED] = ErrorCode.VERSION_RECLAIMED
    original = Recorder()
    request = types.SimpleNamespace(model=f"default:{MANAGED}", lora_path=None)
    response = await precheck_openai(original, FakeServing(), request, None)
    assert response.status_code == 410 and body_of(response)["error"]["code"] == "VERSION_RECLAIMED"
    assert original.calls == []
    request = types.SimpleNamespace(model="default", lora_path=MANAGED)
    assert (await precheck_openai(original, FakeServing(), request, None)).status_code == 410


async def test_precheck_openai_lets_a_servable_request_through(state) -> None:
    original = Recorder()
    request = types.SimpleNamespace(model=f"default:{OTHER_MANAGED}", lora_path=None)
    assert await precheck_openai(original, FakeServing(), request, None) == "stock-response"
    assert len(original.calls) == 1 and state.table.asked == [
        (OTHER_MANAGED, f"id-of-{OTHER_MANAGED}", False)
    ]
    no_model = types.SimpleNamespace(input="x")  # e.g. an embeddings request: nothing to gate
    assert await precheck_openai(original, FakeServing(), no_model, None) == "stock-response"


# ------------------------------------------------ check_servable (the gate's plumbing)


def test_check_servable_asks_the_gate_with_sglangs_id_for_each_name(state) -> None:
    check_servable(["my-plain-adapter", MANAGED])
    assert state.table.asked == [
        ("my-plain-adapter", "id-of-my-plain-adapter", False),
        (MANAGED, f"id-of-{MANAGED}", False),
    ]


def test_check_servable_raises_the_first_refusal_with_its_code_and_details(state) -> None:
    state.table.refuse = {MANAGED: ErrorCode.UNKNOWN_VERSION, OTHER_MANAGED: ErrorCode.VERSION_NOT_READY}
    err = refused(lambda: check_servable(["plain", MANAGED, OTHER_MANAGED]), ErrorCode.UNKNOWN_VERSION)
    assert err.message == f"{MANAGED} refused" and err.details == {"lora_name": MANAGED}
    assert err.http_status == 404


def test_only_the_plugins_own_managed_call_probes(state) -> None:
    token = managed_call.set(True)
    try:
        check_servable([MANAGED])
    finally:
        managed_call.reset(token)
    check_servable([MANAGED])
    assert [probing for _, _, probing in state.table.asked] == [True, False]


@pytest.mark.parametrize("missing", ["table", "native"])
def test_before_the_plugin_is_attached_nothing_is_gated(state, missing: str) -> None:
    state.table.refuse[MANAGED] = ErrorCode.UNKNOWN_VERSION
    table = state.table
    setattr(state, missing, None)
    check_servable([MANAGED])
    assert table.asked == []


def test_lora_names_are_the_named_adapters_only() -> None:
    assert lora_names(None) == [] and lora_names("") == [] and lora_names([]) == []
    assert lora_names("a") == ["a"]
    assert lora_names(["a", None, "", "b"]) == ["a", "b"]


# ------------------------------------------------ serve_only_ready_managed_versions (acquire point)


async def test_a_request_naming_no_managed_version_goes_straight_to_stock(state) -> None:
    original = Recorder()
    obj = normalized(input_ids=[PROMPT, PROMPT], lora_path=["plain", None])
    assert await serve_only_ready_managed_versions(original, "tm", obj) == "stock-response"
    assert original.calls == [("tm", obj)] and state.table.asked == []


async def test_a_managed_version_the_gate_refuses_is_never_acquired(state) -> None:
    state.table.refuse[MANAGED] = ErrorCode.VERSION_RECLAIMED
    original = Recorder()
    obj = normalized(input_ids=PROMPT, lora_path=MANAGED)
    with pytest.raises(RequestRefused):
        await serve_only_ready_managed_versions(original, "tm", obj)
    assert original.calls == [] and state.metrics.served_names == []


async def test_an_acquired_managed_version_counts_as_served(state) -> None:
    original = Recorder()
    obj = normalized(input_ids=[PROMPT] * 3, lora_path=[MANAGED, "plain", OTHER_MANAGED])
    assert await serve_only_ready_managed_versions(original, "tm", obj) == "stock-response"
    assert state.metrics.served_names == [MANAGED, OTHER_MANAGED]


async def test_losing_the_race_with_reclaim_is_the_version_error(state) -> None:
    """Stock raises its own ValueError (acquire is all-or-nothing: nothing was acquired); asked
    again, the gate now refuses and that precise error is what the client gets."""
    obj = normalized(input_ids=PROMPT, lora_path=MANAGED)

    class ReclaimedMeanwhile(Recorder):
        async def __call__(self, *args: Any) -> Any:
            state.table.refuse[MANAGED] = ErrorCode.VERSION_RECLAIMED
            raise ValueError("Got LoRA adapter that has never been loaded")

    with pytest.raises(RequestRefused) as info:
        await serve_only_ready_managed_versions(ReclaimedMeanwhile(), "tm", obj)
    assert info.value.code is ErrorCode.VERSION_RECLAIMED and state.metrics.served_names == []


async def test_a_stock_error_the_gate_does_not_explain_is_kept(state) -> None:
    obj = normalized(input_ids=PROMPT, lora_path=MANAGED)
    stock = ValueError("max loaded loras exceeded")
    with pytest.raises(ValueError) as info:
        await serve_only_ready_managed_versions(Recorder(raises=stock), "tm", obj)
    assert info.value is stock


# ------------------------------------------------ refuse_forged_internal_fields (generate_request)


class FakeStream:
    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.closed = False
        self.started = False

    def __call__(self, tm: Any, obj: Any, *args: Any) -> FakeStream:
        self.started = True
        return self

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    async def aclose(self) -> None:
        self.closed = True


@pytest.mark.parametrize("field", INTERNAL_FIELDS)
async def test_a_forged_internal_field_is_refused_before_sglang_runs(field: str) -> None:
    stream = FakeStream(["out"])
    obj = raw(input_ids=PROMPT, **{field: "forged"})
    with pytest.raises(RequestRefused) as info:
        await anext(refuse_forged_internal_fields(stream, "tm", obj))
    assert info.value.code is ErrorCode.FORBIDDEN_FIELD and info.value.details == {"fields": [field]}
    assert not stream.started, "refused before _init_req_state: no state, nothing to release"


async def test_a_clean_request_streams_sglangs_outputs_and_closes_them() -> None:
    stream = FakeStream(["a", "b"])
    obj = raw(input_ids=PROMPT, extra_key="tenant-7")
    assert [out async for out in refuse_forged_internal_fields(stream, "tm", obj)] == ["a", "b"]
    assert stream.closed


# ------------------------------------------------ release_only_what_was_acquired


def req_state(lora_id: str | None, released: bool = False) -> types.SimpleNamespace:
    return types.SimpleNamespace(obj=types.SimpleNamespace(lora_id=lora_id), lora_released=released)


def test_a_request_that_never_acquired_releases_nothing() -> None:
    calls: list[Any] = []
    state = req_state(None)
    assert release_only_what_was_acquired(lambda tm, s: calls.append(s), "tm", state) is None
    assert calls == [] and state.lora_released is True


@pytest.mark.parametrize(("lora_id", "released"), [("id-1", False), ("id-1", True), (None, True)])
def test_an_acquired_or_already_released_state_is_left_to_stock(lora_id: str | None, released: bool) -> None:
    calls: list[Any] = []
    state = req_state(lora_id, released)
    release_only_what_was_acquired(lambda tm, s: calls.append(s) or "stock", "tm", state)
    assert calls == [state] and state.lora_released is released


# ------------------------------------------------ lru_never_picks_managed


class FakeRegistry:
    """LoRARegistry's fields lru_lora_name reads: names in LRU order, each ref with ``pinned``."""

    def __init__(self, refs: dict[str, bool]) -> None:
        self._registry = {name: types.SimpleNamespace(pinned=pinned) for name, pinned in refs.items()}
        self._registry_lock = types.SimpleNamespace(reader_lock=contextlib.nullcontext())


class TableWith(FakeTable):
    def __init__(self, names: dict[str, Any]) -> None:
        super().__init__()
        self.names = names

    def get(self, name: str) -> Any:
        return self.names.get(name)


def registered_version(state_name: str, cleaning: bool = False) -> Any:
    from sglang_ext.version_table import S

    return types.SimpleNamespace(state=S[state_name], cleaning=cleaning)


@pytest.mark.parametrize("state_name", ["READY_LOCAL", "RECLAIMING", "LOADING", "PREPARED"])
async def test_the_lru_never_picks_a_registered_managed_version(state, state_name: str) -> None:
    state.table = TableWith({MANAGED: registered_version(state_name)})
    registry = FakeRegistry({MANAGED: False, "plain-a": False})
    assert await lru_never_picks_managed(registry) == "plain-a"
    assert await lru_never_picks_managed(FakeRegistry({MANAGED: False})) is None


async def test_the_lru_keeps_stock_order_and_pinning_for_other_names(state) -> None:
    state.table = TableWith({})
    registry = FakeRegistry({"plain-pinned": True, MANAGED: False, "plain-b": False})
    assert await lru_never_picks_managed(registry) == "plain-pinned"
    # a managed-looking name the table does not hold is not ours to protect
    assert await lru_never_picks_managed(registry, exclude_pinned=True) == MANAGED


# ------------------------------------------------ request_gate: the rule check_servable asks
# (its other branches: test_version_table.py; these are the states those tests leave out)


def version_in(state_name: str, lora_id: str | None) -> tuple[Any, str]:
    """A table holding one version put in ``state_name`` (as test_version_table.py does)."""
    from test_version_table import LIMITS, begin_req, snap

    from sglang_ext.version_table import S, VersionTable

    table = VersionTable("inc-1", LIMITS)
    req = begin_req(snap(31), "31")
    table.begin(req)
    v = table.get(req.lora_name)
    v.state, v.lora_id = S[state_name], lora_id
    return table, req.lora_name


@pytest.mark.parametrize("probing", [False, True])
def test_a_failed_version_is_never_served_even_under_its_leftover_id(probing: bool) -> None:
    # FAILED: what its load left behind is still registered in SGLang under that id
    table, name = version_in("FAILED", "id-left")
    err = table.request_gate(name, "id-left", probing=probing)
    assert err is not None and err.code is ErrorCode.UNKNOWN_VERSION


@pytest.mark.parametrize(
    ("state_name", "code"),
    [
        ("PREPARED", ErrorCode.VERSION_NOT_READY),
        ("RECLAIMING", ErrorCode.VERSION_RECLAIMED),
        ("UNLOADED", ErrorCode.VERSION_RECLAIMED),
    ],
)
def test_the_plugins_probe_passes_only_a_loading_version(state_name: str, code: ErrorCode) -> None:
    table, name = version_in(state_name, "id-31")
    err = table.request_gate(name, "id-31", probing=True)
    assert err is not None and err.code is code
    loading, loading_name = version_in("LOADING", None)
    assert loading.request_gate(loading_name, "id-new", probing=True) is None
