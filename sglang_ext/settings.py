"""The plugin's environment settings: its switches and its numbers, each read with one parser.

A switch is on for ``1``, ``true``, ``yes`` or ``on`` and off for ``0``, ``false``, ``no``,
``off`` or empty (any case, surrounding blanks ignored); unset, it takes its default. Any other
value is refused at engine start (:func:`switch_problems`, checked by ``plugin.register``), so a
typo such as ``SGLANG_LORA_VERSIONS_HOOK_TIMING=of`` never silently means "on" somewhere and "off"
elsewhere, as four parsers of their own once did.

The numeric settings (limits and deadlines) are declared once in :data:`NUMBERS`, each with its
default and kind, and read by :func:`number`; a value that is not a positive number of its kind
is refused at engine start too (:func:`number_problems`), never met as a ``ValueError`` in the
middle of a request.

A leaf module: it imports nothing of the plugin.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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


# ------------------------------------------------------------------------------ numbers


@dataclass(frozen=True)
class Number:
    """One numeric setting: its variable, its default, and whether it counts (an int)."""

    env: str
    default: float
    integer: bool = False


MAX_VERSION_BYTES = Number("SGLANG_LORA_VERSIONS_MAX_VERSION_BYTES", 2 * 1024**3, integer=True)
MAX_BUCKET_BYTES = Number("SGLANG_LORA_VERSIONS_MAX_BUCKET_BYTES", 256 * 1024**2, integer=True)
# longest wait for a control body's next chunk
BODY_IDLE_TIMEOUT_S = Number("SGLANG_LORA_VERSIONS_BODY_IDLE_TIMEOUT_S", 30.0)
# longest whole read of a control body (a 256 MiB bucket at >= 0.5 MiB/s)
BODY_TIMEOUT_S = Number("SGLANG_LORA_VERSIONS_BODY_TIMEOUT_S", 600.0)
# a manifest of ~20k tensors with its bucket plan
MAX_JSON_BYTES = Number("SGLANG_LORA_VERSIONS_MAX_JSON_BYTES", 8 * 1024**2, integer=True)
# the collective link's bound on a rendezvous and on one bucket's receive
COLLECTIVE_TIMEOUT_S = Number("SGLANG_LORA_VERSIONS_COLLECTIVE_TIMEOUT_S", 30.0)
NUMBERS = (
    MAX_VERSION_BYTES,
    MAX_BUCKET_BYTES,
    BODY_IDLE_TIMEOUT_S,
    BODY_TIMEOUT_S,
    MAX_JSON_BYTES,
    COLLECTIVE_TIMEOUT_S,
)


def parse_number(setting: Number, text: str) -> float | int | None:
    """The value, or None for one that is not a positive number of the setting's kind."""
    try:
        value: float | int = int(text.strip()) if setting.integer else float(text.strip())
    except ValueError:
        return None
    return value if value > 0 and value == value and value != float("inf") else None


def number(setting: Number, env: Mapping[str, str] | None = None) -> float | int:
    """The setting's value; unset or malformed, its default (start refused a malformed one)."""
    raw = (os.environ if env is None else env).get(setting.env)
    parsed = None if raw is None else parse_number(setting, raw)
    if parsed is None:
        return int(setting.default) if setting.integer else float(setting.default)
    return parsed


def number_problems(env: Mapping[str, str] | None = None, settings: Sequence[Number] = NUMBERS) -> list[str]:
    """Every numeric setting of ``settings`` set to something that is not a positive number."""
    env = os.environ if env is None else env
    kind = {True: "a positive integer", False: "a positive number"}
    return [
        f"{s.env}={env[s.env]!r} is not {kind[s.integer]}"
        for s in settings
        if s.env in env and parse_number(s, env[s.env]) is None
    ]
