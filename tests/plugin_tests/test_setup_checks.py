from types import SimpleNamespace

import pytest

from sglang_ext.lora_registry_patch import DECLARED_FIELDS
from sglang_ext.setup_checks import managed_slots, setup_problems

# Every server argument the rules read, at a supported value (the resolved ServerArgs' shape).
GOOD = dict(
    enable_lora=True,
    tokenizer_worker_num=1,
    dp_size=1,
    max_loras_per_batch=3,
    max_loaded_loras=None,
    nnodes=1,
    enable_dp_attention=False,
    attn_cp_size=1,
    ep_size=1,
    pp_size=1,
    enable_pdmux=False,
    enable_lora_overlap_loading=False,
    speculative_algorithm=None,
    disaggregation_mode="null",
    disable_overlap_schedule=True,
    disable_radix_cache=False,
    device="cpu",
)


def test_supported_setup_has_no_problem():
    assert setup_problems(SimpleNamespace(**GOOD)) == []


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("enable_lora", False, "--enable-lora is off"),
        ("tokenizer_worker_num", 4, "tokenizer_worker_num=4 > 1"),
        ("dp_size", 2, "dp_size=2 > 1"),
        ("max_loras_per_batch", 2, "max_loras_per_batch=2 < 3"),
        ("max_loaded_loras", 2, "max_loaded_loras=2 < 3"),
        ("nnodes", 2, "nnodes=2 > 1: a version is staged on the first node's disk"),
        ("enable_dp_attention", True, "--enable-dp-attention is on"),
        ("attn_cp_size", 2, "attn_cp_size=2 > 1"),
        ("ep_size", 2, "ep_size=2 > 1"),
        ("speculative_algorithm", "EAGLE", "speculative decoding (EAGLE)"),
        ("disaggregation_mode", "decode", "disaggregation_mode=decode"),
        ("disable_overlap_schedule", False, "overlap scheduler is enabled"),
        ("enable_lora_overlap_loading", True, "--enable-lora-overlap-loading is on"),
        ("pp_size", 2, "pp_size=2 > 1"),
        ("enable_pdmux", True, "--enable-pdmux is on"),
        ("disable_radix_cache", True, "the radix cache is off (--disable-radix-cache"),
    ],
)
def test_each_unsupported_setting_is_named(field, value, needle):
    problems = setup_problems(SimpleNamespace(**{**GOOD, field: value}))
    assert len(problems) == 1 and needle in problems[0]


def test_all_problems_are_reported_together():
    bad = SimpleNamespace(**{**GOOD, "dp_size": 2, "max_loras_per_batch": 1})
    assert len(setup_problems(bad)) == 2


def test_max_loaded_loras_of_three_or_unset_is_fine():
    for value in (None, 3, 6):
        assert setup_problems(SimpleNamespace(**{**GOOD, "max_loaded_loras": value})) == []


def test_the_overlap_proof_switch_opens_only_on_cuda():
    from sglang_ext.settings import OVERLAP_PROOF_ENV
    from sglang_ext.setup_checks import overlap_proof_active

    proof = {OVERLAP_PROOF_ENV: "1"}
    on_cuda = SimpleNamespace(**{**GOOD, "disable_overlap_schedule": False, "device": "cuda"})
    on_cpu = SimpleNamespace(**{**GOOD, "disable_overlap_schedule": False, "device": "cpu"})
    assert setup_problems(on_cuda, proof) == [] and overlap_proof_active(on_cuda, proof)
    assert len(setup_problems(on_cpu, proof)) == 1 and not overlap_proof_active(on_cpu, proof)
    assert len(setup_problems(on_cuda, {})) == 1  # without the switch: refused as always
    assert len(setup_problems(on_cuda, {OVERLAP_PROOF_ENV: "off"})) == 1  # read by the one parser (settings)


# Each rule row by row: every value that means "off" is accepted, every value that turns the
# feature on is refused, and each threshold is checked on both sides of its boundary.
_ROWS = [
    ("speculative_algorithm", [None, "", "NONE", "none"], ["EAGLE", "EAGLE3", "NGRAM", "STANDALONE"]),
    ("disaggregation_mode", [None, "", "null"], ["prefill", "decode"]),
    ("max_loras_per_batch", [3, 4, 8], [0, None, 1, 2]),
    ("max_loaded_loras", [None, 3, 4], [0, 1, 2]),
    ("tokenizer_worker_num", [None, 0, 1], [2, 3]),
    ("dp_size", [None, 0, 1], [2, 3]),
    ("tp_size", [None, 0, 1, 2, 4, 8], []),  # issue 38: every rank answers each managed step
    ("nnodes", [None, 0, 1], [2, 4]),
    ("enable_dp_attention", [False, None], [True]),
    ("attn_cp_size", [None, 0, 1], [2]),
    ("ep_size", [None, 0, 1], [2, 8]),
    ("pp_size", [None, 0, 1], [2, 3]),
    ("enable_pdmux", [False, None], [True]),
    ("enable_lora_overlap_loading", [False, None], [True]),
    ("enable_lora", [True], [False, None]),
    ("disable_overlap_schedule", [True], [False, None]),
    ("disable_radix_cache", [False, None], [True]),
]


@pytest.mark.parametrize(
    ("field", "value", "supported"),
    [(f, v, True) for f, ok, _ in _ROWS for v in ok] + [(f, v, False) for f, _, bad in _ROWS for v in bad],
)
def test_every_value_of_every_rule_is_accepted_or_refused(field, value, supported):
    problems = setup_problems(SimpleNamespace(**{**GOOD, field: value}), {})
    assert (problems == []) == supported, problems
    if not supported:
        assert len(problems) == 1


@pytest.mark.parametrize("field", sorted(GOOD))
def test_a_setting_missing_from_the_config_is_never_read_as_off(field):
    """Server args without a field (a rename in another SGLang): no rule reads a default for it
    ("off" would let the setup through). Each field is a ServerArgs field the start check names
    when it is missing (test_sglang_renames_refuse_the_start), before these rules run."""
    assert ("ServerArgs", field) in DECLARED_FIELDS
    from sglang_ext.settings import OVERLAP_PROOF_ENV

    # with the overlap scheduler on and the proof switch set, every rule reads its field (device too)
    every_rule = {**GOOD, "disable_overlap_schedule": False}
    cfg = SimpleNamespace(**{k: v for k, v in every_rule.items() if k != field})
    with pytest.raises(AttributeError, match=field):
        setup_problems(cfg, {OVERLAP_PROOF_ENV: "1"})


@pytest.mark.parametrize(
    ("device", "proof"),
    [
        ("cuda", True),
        ("cuda:0", True),
        ("cuda:3", True),
        ("cpu", False),
        ("", False),
        (None, False),
        ("xpu", False),
        ("npu", False),
        ("mps", False),
    ],
)
def test_the_overlap_proof_switch_opens_on_every_cuda_device_and_nowhere_else(device, proof):
    from sglang_ext.settings import OVERLAP_PROOF_ENV
    from sglang_ext.setup_checks import overlap_proof_active

    cfg = SimpleNamespace(**{**GOOD, "disable_overlap_schedule": False, "device": device})
    assert overlap_proof_active(cfg, {OVERLAP_PROOF_ENV: "1"}) is proof
    assert (setup_problems(cfg, {OVERLAP_PROOF_ENV: "1"}) == []) is proof
    assert not overlap_proof_active(cfg, {})


@pytest.mark.parametrize(
    ("per_batch", "loaded", "slots"),
    [(3, None, 2), (5, None, 4), (5, 5, 4), (8, 5, 4), (5, 8, 4), (3, 3, 2), (5, 3, 2)],
)
def test_managed_slots_are_every_slot_of_the_smaller_pool_but_one(per_batch, loaded, slots):
    """What the engine reports as its managed capacity: an epoch of capacity K needs K here."""
    cfg = SimpleNamespace(**{**GOOD, "max_loras_per_batch": per_batch, "max_loaded_loras": loaded})
    assert managed_slots(cfg) == slots
