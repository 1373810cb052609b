"""Optional extras in tests: skip only when the extra is really not installed."""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

import pytest


def optional_module(module: str, distribution: str, extra: str) -> ModuleType:
    """``module``, or a skip when ``distribution`` is not installed. Installed but failing to
    import is a failure, never a skip: a broken install must not turn tests into skips."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        reason = f"{distribution} is the optional '{extra}' extra: pip install '.[{extra}]'"
        pytest.skip(reason, allow_module_level=True)
    return importlib.import_module(module)
