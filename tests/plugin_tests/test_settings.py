"""The plugin's environment settings: one parser for all switches and one for all numbers, and a
malformed value refused at start instead of meaning "on" to one reader and "off" to another, or
failing the first request that reads it."""

from __future__ import annotations

import pytest

from sglang_ext import plugin
from sglang_ext.settings import (
    BODY_IDLE_TIMEOUT_S,
    BODY_TIMEOUT_S,
    COLLECTIVE_TIMEOUT_S,
    HASH_WHILE_RECEIVING_ENV,
    HOOK_TIMING_ENV,
    MAX_JSON_BYTES,
    NUMBERS,
    OVERLAP_PROOF_ENV,
    PLUGIN_SWITCH_ENV,
    SWITCHES,
    Number,
    number,
    number_problems,
    parse_switch,
    switch,
    switch_problems,
)

ON = ["1", "true", "TRUE", " yes ", "on", "On"]
OFF = ["", "0", "false", "no", "off", " OFF "]
NEITHER = ["2", "of", "enabled", "y", "-1"]


@pytest.mark.parametrize("text", ON)
def test_on(text: str) -> None:
    assert parse_switch(text) is True


@pytest.mark.parametrize("text", OFF)
def test_off(text: str) -> None:
    assert parse_switch(text) is False


@pytest.mark.parametrize("text", NEITHER)
def test_neither_is_refused_for_every_switch(text: str) -> None:
    assert parse_switch(text) is None
    env = dict.fromkeys(SWITCHES, text)
    assert len(switch_problems(env)) == len(SWITCHES)


@pytest.mark.parametrize("name", SWITCHES)
def test_every_switch_reads_off_the_same_way(name: str) -> None:
    """Before the one parser, ``off`` turned hook timing and hash-while-receiving ON (they only
    knew "", 0, false, no), and the overlap proof knew nothing but "1"."""
    assert switch(name, env={name: "off"}) is False
    assert switch(name, env={name: "on"}) is True
    assert switch(name, default=True, env={}) is True and switch(name, env={}) is False


def test_the_readers_use_the_one_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from sglang_ext import bucket_receiver, hook_timing, setup_checks

    for value, expected in (("off", False), ("on", True)):
        monkeypatch.setenv(HOOK_TIMING_ENV, value)
        monkeypatch.setenv(HASH_WHILE_RECEIVING_ENV, value)
        monkeypatch.setenv(PLUGIN_SWITCH_ENV, value)
        assert hook_timing.enabled() is expected
        assert bucket_receiver.hash_while_receiving() is expected
        assert plugin.is_enabled() is expected
        cuda = SimpleNamespace(device="cuda", disable_overlap_schedule=False)
        assert setup_checks.overlap_proof_active(cuda, {OVERLAP_PROOF_ENV: value}) is expected


class Refused(Exception):
    pass


def _refuse(message: str) -> None:
    raise Refused(message)


def test_a_malformed_plugin_switch_refuses_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "refuse_to_start", _refuse)
    monkeypatch.setenv(PLUGIN_SWITCH_ENV, "of")
    with pytest.raises(Refused, match=PLUGIN_SWITCH_ENV):
        plugin.register()


def test_another_malformed_switch_refuses_only_when_the_plugin_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "refuse_to_start", _refuse)
    monkeypatch.setenv(HOOK_TIMING_ENV, "sometimes")
    monkeypatch.setenv(PLUGIN_SWITCH_ENV, "0")
    plugin.register()  # off: SGLang runs stock, whatever the plugin's other switches say
    monkeypatch.setenv(PLUGIN_SWITCH_ENV, "1")
    with pytest.raises(Refused, match=HOOK_TIMING_ENV):
        plugin.register()


# ---------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("setting", NUMBERS, ids=lambda s: s.env)
def test_every_number_reads_its_value_or_its_default(setting: Number) -> None:
    assert number(setting, env={}) == setting.default
    assert number(setting, env={setting.env: " 7 "}) == 7
    assert type(number(setting, env={setting.env: "7"})) is (int if setting.integer else float)


@pytest.mark.parametrize("text", ["", "abc", "0", "-5", "nan", "inf", "30s"])
def test_a_number_that_is_not_positive_is_refused_for_every_setting(text: str) -> None:
    env = {s.env: text for s in NUMBERS}
    assert len(number_problems(env)) == len(NUMBERS)


def test_an_integer_setting_refuses_a_fraction() -> None:
    assert number_problems({MAX_JSON_BYTES.env: "1.5"}) == [
        f"{MAX_JSON_BYTES.env}='1.5' is not a positive integer"
    ]
    assert number_problems({BODY_IDLE_TIMEOUT_S.env: "1.5"}) == []


def test_the_readers_read_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_ext.collective_link import collective_timeout_s
    from sglang_ext.engine_state import BodyLimits

    monkeypatch.setenv(BODY_IDLE_TIMEOUT_S.env, "5")
    monkeypatch.setenv(MAX_JSON_BYTES.env, "1024")
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_S.env, "12.5")
    limits = BodyLimits.from_env()
    assert limits.idle_timeout_s == 5.0 and limits.max_json_bytes == 1024
    assert limits.total_timeout_s == BODY_TIMEOUT_S.default
    assert collective_timeout_s() == 12.5


def test_a_malformed_number_refuses_the_start_when_the_plugin_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``BodyLimits.from_env`` raised ValueError inside the first EngineState built, and a
    malformed collective timeout failed the first group's connect (a 500), not the start."""
    monkeypatch.setattr(plugin, "refuse_to_start", _refuse)
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_S.env, "30s")
    monkeypatch.setenv(PLUGIN_SWITCH_ENV, "0")
    plugin.register()  # off: nothing of the plugin reads it
    monkeypatch.setenv(PLUGIN_SWITCH_ENV, "1")
    with pytest.raises(Refused, match=COLLECTIVE_TIMEOUT_S.env):
        plugin.register()
