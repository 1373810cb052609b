"""Foundation, proven on real engines: E0/E1 with the plugin on, and a stock engine with it off."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _engine_helpers import ADMIN

from lora_versions_dev import prestart, reference
from lora_versions_dev.farm import PROMPT
from lora_versions_dev.launcher import (
    LORA_FLAGS,
    EngineSpec,
    EngineStartError,
    refused_launches,
    start_engine,
)
from sglang_ext.plugin_log import REFUSED_EXIT_CODE

pytestmark = pytest.mark.engine

WRAPPERS = Path(__file__).parents[1] / "engine_wrappers"
sys.path.insert(0, str(WRAPPERS))

PROMPTS = [PROMPT, [60, 61, 62, 63, 64, 65, 66, 67]]
MAX_NEW = 12


def generate(url: str, input_ids: list[int], lora: str | None = None) -> list[int]:
    body: dict = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
    }
    if lora is not None:
        body["lora_path"] = lora
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def load_adapter(url: str, name: str, path: Path) -> None:
    r = httpx.post(
        f"{url}/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        headers=ADMIN,
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["success"], r.text


def unload_adapter(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN, timeout=120)


@pytest.fixture(scope="module")
def served(engines, fixtures) -> dict:
    """Greedy tokens per (engine, adapter, prompt) with A and B loaded through the stock API."""
    out: dict = {}
    for e in engines:
        for name in ("A", "B"):
            load_adapter(e.url, f"fx-{name}", fixtures.adapter_dir(name))
        for p_i, prompt in enumerate(PROMPTS):
            for name in (None, "A", "B"):
                lora = None if name is None else f"fx-{name}"
                out[(e.name, name, p_i)] = generate(e.url, prompt, lora)
    yield out
    for e in engines:
        for name in ("A", "B"):
            unload_adapter(e.url, f"fx-{name}")


def test_base_a_b_give_different_tokens(served):
    for engine in ("E0", "E1"):
        for p_i in range(len(PROMPTS)):
            outs = {name: tuple(served[(engine, name, p_i)]) for name in (None, "A", "B")}
            assert len(set(outs.values())) == 3, outs


def test_outputs_repeatable_across_calls_and_engines(served, engines):
    e0 = engines[0]
    for p_i, prompt in enumerate(PROMPTS):
        for name in (None, "A", "B"):
            lora = None if name is None else f"fx-{name}"
            assert served[("E0", name, p_i)] == served[("E1", name, p_i)]
            assert generate(e0.url, prompt, lora) == served[("E0", name, p_i)]


def test_mixed_batch_matches_single_requests(served, engines):
    e0, _ = engines
    body = {
        "input_ids": [PROMPTS[0]] * 3,
        "lora_path": [None, "fx-A", "fx-B"],
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
    }
    r = httpx.post(f"{e0.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = [item["output_ids"] for item in r.json()]
    assert got == [served[("E0", n, 0)] for n in (None, "A", "B")]


@pytest.mark.parametrize("name", [None, "A", "B"])
def test_outputs_equal_hf_peft_reference(served, fixtures, name):
    adapter = None if name is None else fixtures.adapter_dir(name)
    for p_i, prompt in enumerate(PROMPTS):
        expected = reference.greedy_tokens(fixtures.model_dir, adapter, prompt, MAX_NEW)
        assert served[("E0", name, p_i)] == expected


def test_reference_negative_control(served, fixtures):
    """The comparison can fail: A's engine tokens differ from B's reference."""
    expected_b = reference.greedy_tokens(fixtures.model_dir, fixtures.adapter_dir("B"), PROMPTS[0], MAX_NEW)
    assert served[("E0", "A", 0)] != expected_b


def test_status_route_lists_no_live_versions_and_an_incarnation(engines):
    incarnations = set()
    for e in engines:
        assert httpx.get(f"{e.url}/lora_versions", timeout=10).status_code == 401  # admin key required
        r = httpx.get(f"{e.url}/lora_versions", headers=ADMIN, timeout=10)
        assert r.status_code == 200
        body = r.json()
        # Other modules share these engines: only tombstones of their versions may remain.
        assert all(v["state"] in ("UNLOADED", "CLEANED") for v in body["versions"]), body["versions"]
        assert len(body["incarnation"]) == 32
        incarnations.add(body["incarnation"])
        missing = httpx.get(
            f"{e.url}/lora_versions/relax_policy_lora@1-1-abcdefabcdef", headers=ADMIN, timeout=10
        )
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "UNKNOWN_VERSION"
    assert len(incarnations) == 2, "each engine has its own incarnation"


def test_plugin_logs_one_line_per_process(engines):
    for e in engines:
        lines = [ln for ln in e.log_path.read_text().splitlines() if "plugin active in" in ln]
        roles = sorted(ln.split("plugin active in ")[1].split(" ")[0] for ln in lines)
        assert roles == ["detokenizer", "main", "scheduler"], lines


def test_switch_off_is_stock(stock_engine, fixtures):
    url = stock_engine.url
    assert httpx.get(f"{url}/lora_versions", timeout=10).status_code == 404
    assert "plugin active" not in stock_engine.log_path.read_text()
    load_adapter(url, "stock-A", fixtures.adapter_dir("A"))
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert any(m["id"] == "stock-A" for m in models["data"])
    tokens = generate(url, PROMPTS[0], "stock-A")
    assert tokens == reference.greedy_tokens(
        fixtures.model_dir, fixtures.adapter_dir("A"), PROMPTS[0], MAX_NEW
    )
    r = unload_adapter(url, "stock-A")
    assert r.status_code == 200 and r.json()["success"], r.text
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert not any(m["id"] == "stock-A" for m in models["data"])
    # Stock 0.5.23 implicitly reloads an unloaded adapter from its cached path (internals doc,
    # hazard 3). With the switch off we must not change that.
    assert generate(url, PROMPTS[0], "stock-A") == tokens
    unload_adapter(url, "stock-A")


def _flags_with(flag: str, value: str) -> list[str]:
    flags = list(LORA_FLAGS)
    flags[flags.index(flag) + 1] = value
    return flags


REFUSED = {
    "sglang-version": (
        {
            "command_prefix": [
                sys.executable,
                str(Path(__file__).parents[1] / "engine_wrappers" / "fake_sglang_version.py"),
            ]
        },
        "sglang==0.5.22 is installed but the lora-versions plugin is pinned to sglang==0.5.23",
    ),
    "missing-internal": (
        {
            "command_prefix": [
                sys.executable,
                str(Path(__file__).parents[1] / "engine_wrappers" / "sglang_without_internal.py"),
            ]
        },
        "sglang.srt.managers.tokenizer_control_mixin._merge_lora_update_results",
    ),
    "tokenizer-workers": ({"extra_args": ["--tokenizer-worker-num", "2"]}, "tokenizer_worker_num=2 > 1"),
    "dp-size": ({"extra_args": ["--dp-size", "2"]}, "dp_size=2 > 1"),
    "max-loras-per-batch": (
        {"lora_flags": _flags_with("--max-loras-per-batch", "2")},
        "max_loras_per_batch=2 < 3",
    ),
    "max-loaded-loras": (
        {"lora_flags": _flags_with("--max-loaded-loras", "2")},
        "max_loaded_loras=2 < 3",
    ),
    "nnodes": ({"extra_args": ["--nnodes", "2", "--node-rank", "0"]}, "nnodes=2 > 1"),
    "speculative": ({"extra_args": ["--speculative-algorithm", "NGRAM"]}, "speculative decoding (NGRAM)"),
    "pd-disaggregation": (
        {"extra_args": ["--disaggregation-mode", "prefill"]},
        "PD disaggregation (disaggregation_mode=prefill)",
    ),
    "overlap-schedule": ({"overlap_schedule": True}, "the overlap scheduler is enabled"),
    "lora-overlap-loading": (
        {"extra_args": ["--enable-lora-overlap-loading"]},
        "--enable-lora-overlap-loading is on",
    ),
    "pp-size": ({"extra_args": ["--pp-size", "2"]}, "pp_size=2 > 1"),
    "pdmux": ({"extra_args": ["--enable-pdmux"]}, "--enable-pdmux is on"),
    "radix-cache-off": (
        {"extra_args": ["--disable-radix-cache"]},
        "the radix cache is off (--disable-radix-cache",
    ),
    "lora-disabled": ({"lora_flags": []}, "--enable-lora is off"),
}


# Refused in the scheduler process, not at plugin load (test_a_scheduler_lacking_what_...).
SCHEDULER_ATTRIBUTE = "scheduler-attribute"


@pytest.fixture(scope="module")
def refused_starts(fixtures, run_dir, prestarts) -> dict:
    """Every refused setup: (the exit code, the spec), launched ahead of their first use, in the
    background (lora_versions_dev.prestart)."""
    return prestart.take(prestarts, "refused_starts", fixtures, run_dir)


@prestart.prestartable("refused_starts")
def _launch_refused_setups(fixtures, run_dir) -> dict:
    """Every refused setup: (the exit code, the spec). The setups that differ only in their flags,
    and the scheduler without its attribute, are launched by one process that imports SGLang once
    and forks each launch (``launcher.refused_launches``: the child runs ``sglang.launch_server``,
    or the wrapper that runs it, as ``__main__``, as the command line does); a setup whose wrapper
    changes what that process already imported (the version, an internal) is a process of its own."""

    def spec(case: str) -> EngineSpec:
        if case == SCHEDULER_ATTRIBUTE:
            overrides = {
                "command_prefix": [sys.executable, str(WRAPPERS / "sglang_without_scheduler_attribute.py")]
            }
        else:
            overrides, _ = REFUSED[case]
        return EngineSpec(
            name=f"refused-{case}",
            model_path=fixtures.model_dir,
            log_path=run_dir / f"refused-{case}.log",
            startup_timeout_s=180,
            **overrides,
        )

    def own_process(case: str) -> tuple[str, int | None]:
        try:
            engine = start_engine(spec(case))
        except EngineStartError as exc:
            engine = None
            code = exc.exit_code
        if engine is not None:
            engine.stop()
            return case, None
        return case, code

    wrapped = [c for c in REFUSED if "command_prefix" in REFUSED[c][0]]
    flags_only = [c for c in REFUSED if c not in wrapped]
    with ThreadPoolExecutor(max_workers=1) as pool:
        own = pool.map(own_process, wrapped)  # beside the forked launches: two at a time
        forked_cases = [*flags_only, SCHEDULER_ATTRIBUTE]
        forked = refused_launches([spec(c) for c in forked_cases])
        codes = dict(own) | {c: forked[f"refused-{c}"] for c in forked_cases}
    return {case: (codes[case], spec(case)) for case in [*REFUSED, SCHEDULER_ATTRIBUTE]}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_setup_exits_nonzero_with_clear_message(refused_starts, case):
    code, spec = refused_starts[case]
    assert code is not None, f"{case}: the engine started but must be refused"
    assert code == REFUSED_EXIT_CODE, f"{case}: exited with {code}"
    log = spec.log_path.read_text()
    assert "[lora-versions] REFUSED TO START" in log
    assert REFUSED[case][1] in log


def test_a_scheduler_lacking_what_the_step_fence_reads_refuses_to_start(refused_starts):
    """Issue 24: Scheduler.result_queue taken away inside the real scheduler process (what a
    rename in a pin bump looks like). The scheduler serves without it when the overlap scheduler
    is off, and a fence that read it as an empty queue would pass every unload: the plugin must
    refuse instead, in the scheduler before it reports ready, so the engine never becomes healthy."""
    from scheduler_without_result_queue import REMOVED

    code, spec = refused_starts[SCHEDULER_ATTRIBUTE]
    assert code is not None, "the engine started and served with Scheduler.result_queue missing"
    log = spec.log_path.read_text()
    refused = [ln for ln in log.splitlines() if "[lora-versions] REFUSED TO START" in ln]
    assert len(refused) == 1 and f"Scheduler.{REMOVED} is missing" in refused[0], refused
    # SGLang's own report of the scheduler process's end: the plugin's exit code, not a crash.
    assert f"scheduler died during initialization (exit code: {REFUSED_EXIT_CODE})" in log
