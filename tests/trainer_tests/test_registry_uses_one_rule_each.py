"""The registry applies the one rule each fact has, never a copy of it:

* ``reserve`` takes exactly the ``lora_name`` that ``lora_contract.names`` builds for the version
  key and digest (any prefix): another name is INVALID_REQUEST and changes nothing;
* an epoch (and a version id) is checked by ``names.name_part``: the registry refuses what it
  refuses, with its answer;
* a set of version states the registry names once (``PENDING_STATES``, ...) is not spelled out
  again beside its constant.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
from _rg_helpers import EPOCH, digest, lora_name, new_registry, refused, vk
from _source_trees import parse_text

import relax_glue
from lora_contract import names
from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.registry import LoRAVersionRegistry
from relax_glue.registry_types import VersionState

D = digest("one")
OTHER = digest("other")
_PACKAGE = Path(relax_glue.__file__).parent


@pytest.mark.parametrize(
    "name",
    [
        f"relax_policy_lora@{int(EPOCH) + 1}-v1-{D[:12]}",  # another epoch
        f"relax_policy_lora@{EPOCH}-v2-{D[:12]}",  # another version id
        f"relax_policy_lora@{EPOCH}-v1-{OTHER[:12]}",  # another digest
        f"relax_policy_lora@{EPOCH}-v1-{D[:11]}",  # a short digest prefix
        "my-adapter",  # not a managed name at all
        f"@{EPOCH}-v1-{D[:12]}",  # no prefix
        f"a/b@{EPOCH}-v1-{D[:12]}",  # a prefix outside the name part's charset
        f"relax_policy_lora@{EPOCH}-v1-{D[:12]}\n",  # a trailing newline (fullmatch, not match)
    ],
)
def test_reserve_refuses_a_name_other_than_the_one_the_names_module_builds(name: str) -> None:
    reg = new_registry()  # Checked: a refusal must leave the dump unchanged
    err = refused(ErrorCode.INVALID_REQUEST, reg.reserve, vk("v1"), D, name, "r1")
    assert err.details.get("lora_name") == name
    assert reg.status().versions == ()


@pytest.mark.parametrize("prefix", ["relax_policy_lora", "p", "team.a_1", "x" * 64])
def test_reserve_takes_the_built_name_with_any_prefix(prefix: str) -> None:
    reg = new_registry()
    name = names.make_lora_name(prefix, EPOCH, "v1", D)
    assert reg.reserve(vk("v1"), D, name, "r1").lora_name == name
    assert lora_name("v1", D) == names.make_lora_name("relax_policy_lora", EPOCH, "v1", D)


@pytest.mark.parametrize("epoch", ["", "a-b", "a b", "x" * 65, -3, True, None, 1.5, "é"])
def test_an_epoch_is_refused_with_the_name_parts_own_answer(epoch: object) -> None:
    with pytest.raises(LoraVersionError) as expected:
        names.name_part("epoch", epoch)  # type: ignore[arg-type]
    with pytest.raises(LoraVersionError) as got:
        LoRAVersionRegistry(epoch, ["E0"])  # type: ignore[arg-type]
    assert got.value.parts() == expected.value.parts()
    reg = new_registry()
    with pytest.raises(LoraVersionError) as in_key:
        reg.version((epoch, "v1"))
    assert in_key.value.parts() == expected.value.parts()


def test_ints_and_their_text_are_the_same_epoch() -> None:
    assert LoRAVersionRegistry(7, ["E0"]).epoch == LoRAVersionRegistry("7", ["E0"]).epoch == "7"


def _is_state(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "VersionState"
    )


def _state_sets(tree: ast.AST) -> list[tuple[int, frozenset[str]]]:
    """Every literal tuple / set / list of two or more ``VersionState.X`` in ``tree``, but the
    ones that define a ``*_STATES`` constant."""
    definitions = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name) and target.id.endswith("_STATES") and node.value is not None
        for inner in ast.walk(node.value)
    }
    return [
        (node.lineno, frozenset(e.attr for e in node.elts if isinstance(e, ast.Attribute)))
        for node in ast.walk(tree)
        if isinstance(node, ast.Tuple | ast.Set | ast.List)
        and len(node.elts) >= 2
        and all(_is_state(e) for e in node.elts)
        and id(node) not in definitions
    ]


def test_no_named_set_of_states_is_spelled_out_again() -> None:
    modules = [importlib.import_module(f"relax_glue.{p.stem}") for p in sorted(_PACKAGE.glob("registry*.py"))]
    constants = {
        f"{m.__name__}.{name}": frozenset(s.name for s in value)
        for m in modules
        for name, value in vars(m).items()
        if name.endswith("_STATES") and isinstance(value, frozenset)
    }
    pending = {VersionState.LOADING.name, VersionState.ABORTED.name}
    assert pending in constants.values()  # the one attempt in flight is a named set
    spelled = [
        f"{m.__name__}:{line} spells out {name}"
        for m in modules
        for line, members in _state_sets(parse_text(inspect.getsource(m)))
        for name, value in constants.items()
        if members == value
    ]
    assert not spelled, spelled
