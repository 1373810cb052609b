"""CPU development mode for SGLang 0.5.23: run real engines on machines without a GPU.

Five workarounds and one saving, none of which edits SGLang's files:

1. ``SGLANG_USE_CPU_ENGINE=1`` (set by :func:`engine_env`).
2. An import-only stand-in for ``sgl_kernel`` (``shim/sgl_kernel``) placed first on the engine's
   ``PYTHONPATH``; every placeholder raises if it is ever called.
3. ``pin_memory`` neutralised (``shim/sitecustomize.py`` -> :func:`activate`), because SGLang's
   LoRA code hard-codes ``pin_memory=True``.
4. ``--lora-backend torch_native --attention-backend torch_native`` (see :data:`ENGINE_FLAGS`).
5. Tensor parallelism: ``sglang.srt.distributed.parallel_state.init_model_parallel_group``
   defaults ``use_pynccl=False`` (:func:`no_pynccl_by_default`; upstream defaults it to True on
   CPU, and ``PyNcclCommunicator`` then asks for a CUDA device), and each rank gets its own
   cores through ``SGLANG_CPU_OMP_THREADS_BIND`` (:func:`tp_env`; without it
   ``srt/utils/numa_utils.py`` ``init_threads_binding`` asserts one NUMA node per rank).

6. Not a workaround, a saving: the CUDA-only kernel packages (:data:`CUDA_ONLY_PACKAGES`) are
   hidden from the engine's processes (:func:`hide_cuda_only_packages`). SGLang imports them
   only under ``try``/``except ImportError`` or behind ``is_cuda()``, nothing on CPU calls them,
   and importing them was about a quarter of each engine process's import time here (every
   engine imports SGLang in three processes; the tests start dozens).

It is a development and test mode only: it activates only when ``SGLANG_EXT_CPU_DEV=1`` is set
explicitly, logs loudly, and refuses to activate when a GPU is visible.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

SWITCH_ENV = "SGLANG_EXT_CPU_DEV"
SHIM_DIR = Path(__file__).resolve().parent / "shim"

# The static memory fraction of a CPU engine. SGLang (0.5.23, KVCacheConfigurator.
# _profile_available_bytes) refuses to start when the memory available after the weights load is
# under pre x (1 - fraction), pre being what was available at its baseline: on CPU that is the
# whole machine's MemAvailable, so whatever a NEIGHBOUR takes in that second counts as this
# engine's own. At 0.1, an engine booting beside another one on a machine with 4.5 GiB available
# failed ("Loaded weights leave no GPU memory for the KV cache", seen in CI; bench/
# cpu_engine_memory_race.py reproduces it). At 0.5 a neighbour may take half of it. The fraction
# costs no memory here: --max-total-tokens caps the KV pool (4096 tokens whatever the fraction).
CPU_MEM_FRACTION_STATIC = 0.5
CPU_MAX_TOTAL_TOKENS = 4096

# Flags every CPU engine needs (workaround 4 plus the settings cpu-engine.md found necessary).
ENGINE_FLAGS: tuple[str, ...] = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--lora-backend",
    "torch_native",
    "--mem-fraction-static",
    str(CPU_MEM_FRACTION_STATIC),
    "--max-total-tokens",
    str(CPU_MAX_TOTAL_TOKENS),
)


class CpuDevModeRefused(RuntimeError):
    pass


def is_requested(env: Mapping[str, str] | None = None) -> bool:
    return (env if env is not None else os.environ).get(SWITCH_ENV, "") == "1"


def engine_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for an engine process in CPU development mode."""
    env = dict(base if base is not None else os.environ)
    env[SWITCH_ENV] = "1"
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # SGLang's crash handler sleeps 5 s "to let GPU activity settle" before its py-spy and CUDA
    # core dumps whenever a child process ends first, which is what every stop of a test engine
    # looks like (its process group gets SIGTERM): 5 s per stop, and then nothing to dump (the
    # scheduler is gone; a CPU engine has no GPU). Upstream switches (0.5.23, srt/environ.py).
    env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
    env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
    # torch's OpenMP threads (one per core) spin at every barrier by default. Two CPU engines on
    # the same cores (every test cohort here) then starve each other: measured on 2 cores, 2
    # engines x 2 streams decoded at 16 to 214 tokens/s, bimodal from run to run; waiting
    # passively, 384 to 413, and one engine alone is no slower (4.5 ms per token either way).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parts = [str(SHIM_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def gpu_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def activate() -> None:
    """Install the process-local workarounds. Called from the shim's ``sitecustomize``."""
    if not is_requested():
        return
    if gpu_visible():
        raise CpuDevModeRefused(
            f"{SWITCH_ENV}=1 but a GPU is visible: the CPU development shims (sgl_kernel stand-in, "
            "pin_memory neutraliser) must never run on a GPU deployment. Unset "
            f"{SWITCH_ENV} and remove {SHIM_DIR} from PYTHONPATH."
        )
    neutralise_pin_memory()
    no_pynccl_by_default()
    hide_cuda_only_packages()
    print(
        f"[lora-versions] WARNING: CPU DEVELOPMENT MODE ACTIVE in pid {os.getpid()} "
        "(sgl_kernel stand-in, pin_memory neutralised, no pynccl). Not for production.",
        file=sys.stderr,
        flush=True,
    )


_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_strided",
    "arange",
    "randn",
    "rand",
    "frombuffer",
)


def neutralise_pin_memory() -> None:
    """Make pinned-memory requests no-ops: there is no CUDA host allocator on these machines."""
    import functools

    import torch

    if getattr(torch, "_lora_versions_pin_memory_neutralised", False):
        return

    def pin_memory(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self

    def is_pinned(self: torch.Tensor, *args: object, **kwargs: object) -> bool:
        return False

    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
    torch.Tensor.is_pinned = is_pinned  # type: ignore[method-assign]

    for name in _FACTORIES:
        original = getattr(torch, name, None)
        if original is None:
            continue

        def make(orig):  # bind per factory
            @functools.wraps(orig)
            def factory(*args, **kwargs):
                kwargs.pop("pin_memory", None)
                return orig(*args, **kwargs)

            return factory

        setattr(torch, name, make(original))
    torch._lora_versions_pin_memory_neutralised = True  # type: ignore[attr-defined]


# flashinfer and the CUTLASS DSL it imports: GPU kernels (and their JIT), installed with SGLang.
CUDA_ONLY_PACKAGES = ("flashinfer", "cutlass")


def hide_cuda_only_packages() -> None:
    """Saving 6: ``import flashinfer`` raises ModuleNotFoundError and
    ``importlib.util.find_spec("flashinfer")`` is None in this process (Python's own way to hide
    a module: None in ``sys.modules``), as on a host without them. A package some earlier import
    already loaded is left as it is."""
    for name in CUDA_ONLY_PACKAGES:
        sys.modules.setdefault(name, None)  # type: ignore[assignment]


PARALLEL_STATE = "sglang.srt.distributed.parallel_state"


def tp_env(tp_size: int, cores: int | None = None) -> dict[str, str]:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for a ``--tp-size`` CPU engine: the cores split among the
    ranks (``0|1`` for 2 ranks on 2 cores). SGLang asserts ranks <= NUMA nodes without it."""
    n = cores or os.cpu_count() or 1
    if tp_size <= 1:
        return {}
    if tp_size > n:
        raise ValueError(f"--tp-size {tp_size} needs at least {tp_size} cores, this machine has {n}")
    share = n // tp_size
    ranks = [range(r * share, (r + 1) * share) for r in range(tp_size)]
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cores_)) for cores_ in ranks)}


def _without_pynccl(init_model_parallel_group):  # type: ignore[no-untyped-def]
    import functools

    @functools.wraps(init_model_parallel_group)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("use_pynccl") is None:
            kwargs["use_pynccl"] = False  # no NCCL without CUDA: the gloo group carries the ranks
        return init_model_parallel_group(*args, **kwargs)

    wrapper._lora_versions_no_pynccl = True  # type: ignore[attr-defined]
    return wrapper


def no_pynccl_by_default() -> None:
    """Workaround 5: wrap ``init_model_parallel_group`` once its module is imported (an import
    hook: SGLang's scheduler processes are spawned, so the wrap is installed in each of them by
    the shim's ``sitecustomize``). Its callers look it up in the module at call time."""
    import importlib.abc
    import importlib.machinery

    module = sys.modules.get(PARALLEL_STATE)
    if module is not None:
        if not getattr(module.init_model_parallel_group, "_lora_versions_no_pynccl", False):
            module.init_model_parallel_group = _without_pynccl(module.init_model_parallel_group)
        return

    class WrapOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != PARALLEL_STATE:
                return None
            sys.meta_path.remove(self)  # once: the module is imported once per process
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_then_wrap(mod):  # type: ignore[no-untyped-def]
                exec_module(mod)
                mod.init_model_parallel_group = _without_pynccl(mod.init_model_parallel_group)

            spec.loader.exec_module = exec_then_wrap  # type: ignore[method-assign]
            return spec

    if not any(type(f).__name__ == "WrapOnImport" for f in sys.meta_path):
        sys.meta_path.insert(0, WrapOnImport())
