from types import SimpleNamespace

import pytest

from sglang_ext.setup_checks import setup_problems

GOOD = dict(
    enable_lora=True,
    tokenizer_worker_num=1,
    dp_size=1,
    max_loras_per_batch=3,
    max_loaded_loras=None,
    tp_size=1,
    speculative_algorithm=None,
    disaggregation_mode="null",
    disable_overlap_schedule=True,
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
        ("tp_size", 2, "tp_size=2 > 1"),
        ("speculative_algorithm", "EAGLE", "speculative decoding (EAGLE)"),
        ("disaggregation_mode", "decode", "disaggregation_mode=decode"),
        ("disable_overlap_schedule", False, "overlap scheduler is enabled"),
        ("enable_lora_overlap_loading", True, "--enable-lora-overlap-loading is on"),
        ("pp_size", 2, "pp_size=2 > 1"),
        ("enable_pdmux", True, "--enable-pdmux is on"),
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
    from sglang_ext.setup_checks import OVERLAP_PROOF_ENV, overlap_proof_active

    proof = {OVERLAP_PROOF_ENV: "1"}
    on_cuda = SimpleNamespace(**{**GOOD, "disable_overlap_schedule": False, "device": "cuda"})
    on_cpu = SimpleNamespace(**{**GOOD, "disable_overlap_schedule": False, "device": "cpu"})
    assert setup_problems(on_cuda, proof) == [] and overlap_proof_active(on_cuda, proof)
    assert len(setup_problems(on_cpu, proof)) == 1 and not overlap_proof_active(on_cpu, proof)
    assert len(setup_problems(on_cuda, {})) == 1  # without the switch: refused as always
    assert len(setup_problems(on_cuda, {OVERLAP_PROOF_ENV: "yes"})) == 1
