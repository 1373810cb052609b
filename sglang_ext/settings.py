"""The plugin's environment switches, read with one parser.

A switch is on for ``1``, ``true``, ``yes`` or ``on`` and off for ``0``, ``false``, ``no``,
``off`` or empty (any case, surrounding blanks ignored); unset, it takes its default. Any other
value is refused at engine start (:func:`switch_problems`, checked by ``plugin.register``), so a
typo such as ``SGLANG_LORA_VERSIONS_HOOK_TIMING=of`` never silently means "on" somewhere and "off"
elsewhere, as four parsers of their own once did.

A leaf module: it imports nothing of the plugin.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

PLUGIN_SWITCH_ENV = "SGLANG_LORA_VERSIONS"
HOOK_TIMING_ENV = "SGLANG_LORA_VERSIONS_HOOK_TIMING"
HASH_WHILE_RECEIVING_ENV = "SGLANG_LORA_VERSIONS_HASH_WHILE_RECEIVING"
# Lets exactly one test start a managed engine with the overlap scheduler: the GPU proof that
# reclaim never frees a slot a launched step still reads (gpu_tests/test_overlap_scheduler.py).
# Honoured only on CUDA (SGLang has no overlap on CPU); never a serving setting.
OVERLAP_PROOF_ENV = "SGLANG_LORA_VERSIONS_OVERLAP_PROOF"
SWITCHES = (PLUGIN_SWITCH_ENV, HOOK_TIMING_ENV, HASH_WHILE_RECEIVING_ENV, OVERLAP_PROOF_ENV)

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})


def parse_switch(text: str) -> bool | None:
    """True, False, or None for a value that is neither."""
    value = text.strip().lower()
    return True if value in _ON else False if value in _OFF else None


def switch(name: str, default: bool = False, env: Mapping[str, str] | None = None) -> bool:
    """The switch's value; a malformed one counts as its default here (start refused it)."""
    raw = (os.environ if env is None else env).get(name)
    if raw is None:
        return default
    parsed = parse_switch(raw)
    return default if parsed is None else parsed


def switch_problems(env: Mapping[str, str] | None = None, names: Sequence[str] = SWITCHES) -> list[str]:
    """Every switch of ``names`` set to a value that is neither on nor off."""
    env = os.environ if env is None else env
    return [
        f"{name}={env[name]!r} is neither on (1, true, yes, on) nor off (0, false, no, off)"
        for name in names
        if name in env and parse_switch(env[name]) is None
    ]
