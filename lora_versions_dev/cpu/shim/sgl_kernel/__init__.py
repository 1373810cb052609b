"""Import-only stand-in for ``sgl_kernel`` in CPU development mode.

The real package needs ``libcuda.so.1``. SGLang's CPU engine imports some ``*_cpu`` helpers at
module load but, for a dense Qwen3 model with ``torch_native`` backends, takes the
``forward_native`` path and never calls them. Every name resolves to a placeholder that raises
a clear error if it is ever called, so a wrong assumption fails loudly instead of silently.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

if os.environ.get("SGLANG_EXT_CPU_DEV") != "1":
    raise ImportError(
        "this is the sglang_ext CPU development stand-in for sgl_kernel; it is only importable "
        "with SGLANG_EXT_CPU_DEV=1 (remove lora_versions_dev/cpu/shim from PYTHONPATH)"
    )

__version__ = "0.0.0+lora-versions-cpu-standin"


class StandInCalled(RuntimeError):
    pass


class _StandInMeta(type):
    """Placeholders are classes, so they also work as annotations, bases and attribute roots
    (``scalar_types.uint4b8``); calling one, or anything reached through it, raises."""

    def __call__(cls, *args, **kwargs):
        raise StandInCalled(
            f"sgl_kernel stand-in: {cls.__qualname__} was called. CPU development mode only supports "
            "code paths that never call sgl_kernel (dense models, torch_native backends)."
        )

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, item):
        return cls


def _placeholder(qualname: str) -> type:
    return _StandInMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})


def _module_getattr(modname: str):
    def __getattr__(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{modname}.{name}")
        setattr(sys.modules[modname], name, value)
        return value

    return __getattr__


__getattr__ = _module_getattr(__name__)


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``sgl_kernel.*`` submodule as another stand-in module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package, so deeper submodules resolve too
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _SubmoduleFinder())
