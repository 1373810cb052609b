"""Issue 36: every SGLang fact the plugin reads fails closed. Each field, attribute, message and id
format named in the pin module (``sglang_ext.lora_registry_patch``) is taken away from the real
SGLang 0.5.23 class here, one at a time, as a rename in a pin bump would, and the start check
names it: the plugin refuses to start instead of a guard reading a default and switching off.

The instance attributes that exist only on a live object (the tokenizer manager, the scheduler,
its LoRA manager and memory pool) are checked on a stand-in with every other attribute;
tests/plugin_tests/test_sglang_rename_engines.py renames them inside real engines."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import uuid
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from sglang_ext import lora_registry_patch as upstream


def _without_declared_field(monkeypatch: pytest.MonkeyPatch, owner: str, field: str) -> None:
    """``owner``'s class as a rename of ``field`` leaves it: the field gone from its declaration."""
    cls = upstream.symbol(owner)
    if dataclasses.is_dataclass(cls):
        monkeypatch.delitem(cls.__dataclass_fields__, field)
    elif isinstance(getattr(cls, "__pydantic_fields__", None), dict):
        monkeypatch.delitem(cls.__pydantic_fields__, field)
    else:  # a msgspec Struct, whose fields are read-only: the renamed class in its module
        fields = [f"{f}_renamed" if f == field else f for f in cls.__struct_fields__]
        module, attribute = upstream.SYMBOLS[owner]
        monkeypatch.setattr(
            importlib.import_module(module), attribute, msgspec.defstruct(cls.__name__, fields)
        )


def _declared() -> list[tuple[str, str]]:
    return [*upstream.DECLARED_FIELDS, *upstream.STEP_FIELDS]


def test_the_list_covers_what_the_parallel_sampling_guards_read():
    """The fields the issue names, written out: a field dropped from the pin module's lists must
    fail here, not only stop being checked."""
    normalised = set(upstream.NORMALISED_ATTRIBUTES)
    assert {("GenerateReqInput", a) for a in ("is_single", "batch_size", "parallel_sample_num")} <= normalised
    assert "rid_to_state" in upstream.TOKENIZER_MANAGER_ATTRIBUTES
    assert upstream.ABORT_REQUEST_PARAMETERS == ("rid", "abort_all")
    declared = set(_declared())
    for field in ("rid", "lora_path", "sampling_params", "lora_id", "extra_key", "top_logprobs_num"):
        assert ("GenerateReqInput", field) in declared, field
    assert ("LoRAUpdateOutput", "loaded_adapters") in declared
    assert "max_lora_rank" in upstream.POOL_ATTRIBUTES
    assert ("ServerArgs", "disable_radix_cache") in declared


@pytest.mark.parametrize(("owner", "field"), _declared(), ids=lambda v: v)
def test_a_renamed_declared_field_is_named(monkeypatch, owner, field):
    _without_declared_field(monkeypatch, owner, field)
    assert f"{upstream.SYMBOLS[owner][1]}.{field} is missing" in upstream.surface_problems()


@pytest.mark.parametrize(("owner", "attribute"), upstream.NORMALISED_ATTRIBUTES, ids=lambda v: v)
def test_an_attribute_normalisation_no_longer_sets_is_named(monkeypatch, owner, attribute):
    cls = upstream.symbol(owner)
    real = cls.normalize_batch_and_arguments

    def normalise_without_it(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.__dict__[f"{attribute}_renamed"] = self.__dict__.pop(attribute)

    monkeypatch.setattr(cls, "normalize_batch_and_arguments", normalise_without_it)
    problems = upstream.surface_problems()
    assert problems == [f"{owner}().{attribute} is missing after normalize_batch_and_arguments"]


@pytest.mark.parametrize(("owner", "attribute"), upstream.CLASS_ATTRIBUTES, ids=lambda v: v)
def test_a_renamed_class_attribute_is_named(monkeypatch, owner, attribute):
    cls = upstream.symbol(owner)
    definer = next(c for c in cls.__mro__ if attribute in vars(c))
    monkeypatch.delattr(definer, attribute)
    assert f"{upstream.SYMBOLS[owner][1]}.{attribute} is missing" in upstream.surface_problems()


@pytest.mark.parametrize(
    ("owner", "attribute"),
    [
        *(("LoRARegistry", a) for a in upstream.LORA_REGISTRY_ATTRIBUTES),
        *(("Req", a) for a in upstream.REQ_ATTRIBUTES),
    ],
    ids=lambda v: v,
)
def test_an_attribute_a_constructor_no_longer_sets_is_named(monkeypatch, owner, attribute):
    cls = upstream.symbol(owner)
    real_init = cls.__init__

    def init_without_it(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        delattr(self, attribute)

    monkeypatch.setattr(cls, "__init__", init_without_it)
    assert upstream.surface_problems() == [f"{owner}().{attribute} is missing"]


@pytest.mark.parametrize(("owner", "symbol_name"), list(upstream.SYMBOLS.values()), ids=lambda v: v)
def test_a_renamed_module_symbol_is_named(monkeypatch, owner, symbol_name):
    monkeypatch.delattr(importlib.import_module(owner), symbol_name)
    assert any(f"{owner}.{symbol_name}" in p for p in upstream.surface_problems())


# every hook target but a constructor (a class always has one; a rename cannot take it away)
_TARGETS = upstream.MAIN_PROCESS_TARGETS + upstream.SCHEDULER_PROCESS_TARGETS
_RENAMEABLE_TARGETS = [t for t in _TARGETS if not t.endswith(".__init__")]


@pytest.mark.parametrize("target", _RENAMEABLE_TARGETS)
def test_a_renamed_hook_target_is_named(monkeypatch, target):
    owner_path, _, name = target.rpartition(".")
    owner = upstream._resolve_dotted(owner_path)
    definer = next(c for c in getattr(owner, "__mro__", (owner,)) if name in vars(c))
    monkeypatch.delattr(definer, name)
    assert any(p.startswith(f"hook target {target}:") for p in upstream.surface_problems())


@pytest.mark.parametrize(("owner", "method", "text"), upstream.MESSAGES, ids=lambda v: v)
def test_an_upstream_message_that_changed_is_named(monkeypatch, owner, method, text):
    def reworded(*args: Any, **kwargs: Any) -> str:
        return "a message of another release"

    monkeypatch.setattr(upstream.symbol(owner), method, reworded)
    assert f"{owner}.{method} no longer says {text!r}" in upstream.surface_problems()


@pytest.mark.parametrize("field", list(upstream.RAW_FIELD_DEFAULTS))
def test_a_raw_field_whose_default_changed_is_named(monkeypatch, field):
    declared = upstream.symbol("GenerateReqInput").__dataclass_fields__[field]
    monkeypatch.setattr(declared, "default", "changed")
    problems = upstream.surface_problems()
    assert len(problems) == 1 and problems[0].startswith(f"GenerateReqInput.{field} defaults to 'changed'")


def test_a_lora_id_of_another_format_is_named(monkeypatch):
    """tokenizer_hooks refuses an extra_key ending like a lora_id (Req.extra_key + lora_id): the
    format it matches is SGLang's, so a change of it must not silently let such keys through."""
    lora_registry = importlib.import_module(upstream.SYMBOLS["LoRARef"][0])
    real = lora_registry.LoRARef

    class RefWithADashedId(real):
        lora_id: str = msgspec.field(default_factory=lambda: str(uuid.uuid4()))

    monkeypatch.setattr(lora_registry, "LoRARef", RefWithADashedId)
    problems = upstream.surface_problems()
    assert len(problems) == 1 and problems[0].startswith("LoRARef().lora_id is '"), problems


def test_a_sample_rid_of_another_format_is_named(monkeypatch):
    cls = upstream.symbol("GenerateReqInput")
    monkeypatch.setattr(cls, "regenerate_rid", lambda self: str(uuid.uuid4()))
    problems = upstream.surface_problems()
    assert len(problems) == 1 and problems[0].startswith("GenerateReqInput.regenerate_rid() is '"), problems


def test_prompt_rids_of_another_format_are_named(monkeypatch):
    cls = upstream.symbol("GenerateReqInput")
    real = cls.normalize_batch_and_arguments

    def normalise_renaming_prompts(self, *args, **kwargs):
        real(self, *args, **kwargs)
        if isinstance(self.rid, list):
            self.rid = [r.replace("_", "-") for r in self.rid]

    monkeypatch.setattr(cls, "normalize_batch_and_arguments", normalise_renaming_prompts)
    assert upstream.surface_problems() == [
        "normalisation names a request's prompts ['r-0', 'r-1'], not ['r_0', 'r_1']"
    ]


@pytest.mark.parametrize("position", range(len(upstream.ABORT_REQUEST_PARAMETERS)))
def test_a_renamed_abort_request_parameter_is_named(monkeypatch, position):
    """The parallel-sampling abort reads abort_request's (rid, abort_all) by name or by position:
    a rename or a reorder would make it read the wrong one, so the start check names it."""
    cls = upstream.symbol("TokenizerManager")
    names = list(upstream.ABORT_REQUEST_PARAMETERS)
    names[position] += "_renamed"
    real = cls.abort_request

    def renamed(self, *args, **kwargs):
        return real(self, *args, **kwargs)

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    renamed.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in ["self", *names]])
    monkeypatch.setattr(cls, "abort_request", renamed)
    assert upstream.surface_problems() == [
        f"TokenizerManager.abort_request takes {tuple(names)!r}, not {upstream.ABORT_REQUEST_PARAMETERS!r}"
    ]


def test_the_prompt_rid_tail_matches_exactly_the_prompt_rids_normalisation_makes():
    tail = re.compile("r" + upstream.PROMPT_RID_TAIL)
    assert all(tail.fullmatch(upstream.PROMPT_RID.format(rid="r", i=i)) for i in (0, 7, 12))
    assert not any(tail.fullmatch(r) for r in ("r", "r_", "r_a", "r-0", "rr_0"))


# ------------------------------------------------------------------ the live objects' attributes


def live_tokenizer_manager() -> SimpleNamespace:
    config = SimpleNamespace(**dict.fromkeys(upstream.MODEL_CONFIG_ATTRIBUTES))
    return SimpleNamespace(**{**dict.fromkeys(upstream.TOKENIZER_MANAGER_ATTRIBUTES), "model_config": config})


@pytest.mark.parametrize("attribute", upstream.TOKENIZER_MANAGER_ATTRIBUTES)
def test_a_live_tokenizer_manager_attribute_renamed_is_named(attribute):
    tm = live_tokenizer_manager()
    assert upstream.tokenizer_manager_problems(tm) == []
    delattr(tm, attribute)
    assert f"TokenizerManager.{attribute} is missing" in upstream.tokenizer_manager_problems(tm)


@pytest.mark.parametrize("attribute", upstream.MODEL_CONFIG_ATTRIBUTES)
def test_a_live_model_config_attribute_renamed_is_named(attribute):
    tm = live_tokenizer_manager()
    delattr(tm.model_config, attribute)
    assert upstream.tokenizer_manager_problems(tm) == [f"ModelConfig.{attribute} is missing"]


def live_scheduler() -> SimpleNamespace:
    pool = SimpleNamespace(**dict.fromkeys(upstream.POOL_ATTRIBUTES))
    manager = SimpleNamespace(**{**dict.fromkeys(upstream.LORA_MANAGER_ATTRIBUTES), "memory_pool": pool})
    lora_side = SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager))
    return SimpleNamespace(**dict.fromkeys(upstream.SCHEDULER_ATTRIBUTES), tp_worker=lora_side)


@pytest.mark.parametrize(
    ("owner", "attribute"),
    [
        *(("Scheduler", a) for a in upstream.SCHEDULER_ATTRIBUTES),
        *(("LoRAManager", a) for a in upstream.LORA_MANAGER_ATTRIBUTES),
        *(("LoRAMemoryPool", a) for a in upstream.POOL_ATTRIBUTES),
    ],
    ids=lambda v: v,
)
def test_a_live_scheduler_attribute_renamed_is_named(owner, attribute):
    scheduler = live_scheduler()
    assert upstream.scheduler_problems(scheduler) == []
    manager = scheduler.tp_worker.model_runner.lora_manager
    delattr(
        {"Scheduler": scheduler, "LoRAManager": manager, "LoRAMemoryPool": manager.memory_pool}[owner],
        attribute,
    )
    assert upstream.scheduler_problems(scheduler) == [f"{owner}.{attribute} is missing"]
