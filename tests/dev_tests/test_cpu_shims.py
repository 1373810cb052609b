"""The CPU development mode: explicit switch, loud, refuses on a GPU, placeholders fail loudly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lora_versions_dev import cpu


def run_py(code: str, *, switch: bool) -> subprocess.CompletedProcess[str]:
    env = cpu.engine_env()
    if not switch:
        env.pop(cpu.SWITCH_ENV)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_stand_in_refuses_to_import_without_the_switch():
    res = run_py("import sgl_kernel", switch=False)
    assert res.returncode != 0
    assert "only importable with SGLANG_EXT_CPU_DEV=1" in res.stderr
    assert "CPU DEVELOPMENT MODE ACTIVE" not in res.stderr


def test_stand_in_placeholders_import_but_raise_when_called():
    code = (
        "from sgl_kernel import assign_req_to_token_pool_cpu as f\n"
        "from sgl_kernel.scalar_type import scalar_types\n"
        "x = scalar_types.uint4b8\n"
        "try:\n    f(1)\nexcept RuntimeError as e:\n    print('RAISED', e)\n"
        "try:\n    x()\nexcept RuntimeError as e:\n    print('RAISED', e)\n"
    )
    res = run_py(code, switch=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("RAISED sgl_kernel stand-in:") == 2
    assert "assign_req_to_token_pool_cpu was called" in res.stdout
    assert "CPU DEVELOPMENT MODE ACTIVE" in res.stderr


def test_pin_memory_is_neutralised_only_with_the_switch():
    code = (
        "import torch\n"
        "t = torch.empty(4, pin_memory=True)\n"
        "print(t.pin_memory() is t, t.is_pinned(), torch.zeros(2, pin_memory=True).sum().item())\n"
    )
    res = run_py(code, switch=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "False", "0.0"]
    off = run_py(code, switch=False)
    assert off.returncode != 0  # stock torch on a GPU-less machine cannot pin memory


def test_activate_refuses_when_a_gpu_is_visible(monkeypatch):
    monkeypatch.setenv(cpu.SWITCH_ENV, "1")
    monkeypatch.setattr(cpu, "gpu_visible", lambda: True)
    monkeypatch.setattr(cpu, "neutralise_pin_memory", lambda: pytest.fail("must not patch torch"))
    with pytest.raises(cpu.CpuDevModeRefused, match="a GPU is visible"):
        cpu.activate()


def test_activate_is_inert_without_the_switch(monkeypatch):
    monkeypatch.delenv(cpu.SWITCH_ENV, raising=False)
    monkeypatch.setattr(cpu, "neutralise_pin_memory", lambda: pytest.fail("must not patch torch"))
    cpu.activate()


def test_dev_engines_wait_passively_at_openmp_barriers_unless_told_otherwise():
    """Spinning OpenMP teams of two engines on the same cores starve each other (the comment in
    engine_env has the figures); an operator's own setting wins."""
    assert cpu.engine_env({})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert cpu.engine_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"


def test_tensor_parallel_groups_default_to_no_pynccl_in_every_dev_process():
    """Workaround 5: upstream's init_model_parallel_group defaults use_pynccl=True on CPU, and
    PyNcclCommunicator then asks for a CUDA device. In dev mode the default is False (a caller
    that asks for it explicitly still gets what it asked)."""
    code = (
        "import sglang.srt.distributed.parallel_state as ps\n"
        "ps.GroupCoordinator = lambda **kw: kw\n"
        "print(ps.init_model_parallel_group([[0, 1]], 0, 'gloo')['use_pynccl'],"
        " ps.init_model_parallel_group([[0, 1]], 0, 'gloo', use_pynccl=True)['use_pynccl'])\n"
    )
    res = run_py(code, switch=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-2:] == ["False", "True"]


@pytest.mark.parametrize(
    ("tp", "cores", "expected"),
    [
        (1, 2, {}),
        (2, 2, {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}),
        (2, 4, {"SGLANG_CPU_OMP_THREADS_BIND": "0,1|2,3"}),
    ],
)
def test_each_tensor_parallel_rank_gets_its_own_cores(tp, cores, expected):
    assert cpu.tp_env(tp, cores) == expected


def test_more_ranks_than_cores_is_refused():
    with pytest.raises(ValueError, match="needs at least 3 cores"):
        cpu.tp_env(3, 2)


def test_cuda_only_kernel_packages_are_hidden_from_dev_processes_and_sglang_imports_without_them():
    """Saving 6: flashinfer (and the CUTLASS DSL) are installed but hidden in a dev process, as on
    a host without them: SGLang's optional imports of them fall back, and nothing imports them."""
    code = (
        "import importlib.util, sys\n"
        "import sglang.srt.layers.quantization.fp4_utils\n"  # SGLang's optional flashinfer import
        "try:\n"
        "    import flashinfer\n"
        "except ModuleNotFoundError:\n"
        "    hidden = True\n"
        "else:\n"
        "    hidden = False\n"
        "print(hidden, importlib.util.find_spec('flashinfer') is None, sys.modules['cutlass'] is None)\n"
    )
    res = run_py(code, switch=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-3:] == ["True", "True", "True"]


def test_a_cpu_engine_starts_whatever_a_neighbour_takes_of_half_the_memory_while_it_loads():
    """SGLang measures a CPU engine's memory on the whole machine: it refuses to start when, after
    its weights load, less than pre x (1 - mem_fraction_static) is available (pre: what was
    available at its baseline), so a neighbour booting in that second counts as its own. At 0.1
    a neighbour taking a tenth was enough (seen in CI beside the showcase's engines; reproduced
    by bench/cpu_engine_memory_race.py). The rule is read from the pinned SGLang, the fraction
    from the flags every CPU engine gets; the pool stays capped by --max-total-tokens, so the
    fraction costs no memory."""
    import inspect

    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    rule = inspect.getsource(KVCacheConfigurator._profile_available_bytes)
    assert "pre_model_load_memory * (1 - get_schedule().mem_fraction_static)" in rule
    assert "rest_memory = available_gpu_memory - slack_gb" in rule
    flags = list(cpu.ENGINE_FLAGS)
    fraction = float(flags[flags.index("--mem-fraction-static") + 1])
    neighbour_may_take = fraction  # of what was available at the baseline
    assert neighbour_may_take >= 0.5, fraction
    assert int(flags[flags.index("--max-total-tokens") + 1]) == cpu.CPU_MAX_TOTAL_TOKENS == 4096
