"""Pure tests of the CLI's parsing and rendering (the CLI against real engines is in
test_cli_engines.py)."""

from __future__ import annotations

import pytest

from lora_contract.errors import ErrorCode
from lora_versions_dev import cli as dev_cli
from lora_versions_dev.launcher import gpu_launch_command
from relax_glue.cli import HINTS, build_parser, render_publish, render_status, table
from relax_glue.operations import parse_engines
from sglang_ext.settings import PLUGIN_SWITCH_ENV


def test_every_hint_names_a_real_error_code() -> None:
    assert set(HINTS) <= {c.value for c in ErrorCode}


def test_engines_parse_in_cohort_order_and_refuse_bad_specs() -> None:
    assert parse_engines(["E1=http://b:2/", "E0=http://a:1"]) == {"E1": "http://b:2", "E0": "http://a:1"}
    for bad in (["E0"], ["=http://a"], ["E0=a:1"], ["E0=http://a", "E0=http://b"]):
        with pytest.raises(ValueError):
            parse_engines(bad)


def test_every_command_takes_json() -> None:
    parser = build_parser()
    for argv in (
        ["status", "--json"],
        ["sessions", "--registry", "sqlite:x", "--json"],
        ["publish", "d", "--version-id", "v", "--registry", "sqlite:x", "--json"],
        ["reclaim", "--registry", "sqlite:x", "--json"],
        ["resolve", "--registry", "sqlite:x", "--json"],
    ):
        assert parser.parse_args(argv).json is True
    for argv in (["engine", "--gpu", "--json"], ["demo", "--json"]):
        assert dev_cli.build_parser().parse_args(argv).json is True


def test_the_operator_cli_has_only_operator_commands() -> None:
    """The demo and the dev engine are development commands (``lora-versions-dev``)."""
    for dev_command in ("demo", "engine"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([dev_command])


def test_the_gpu_line_has_what_the_plugin_requires(capsys) -> None:
    argv = gpu_launch_command("/models/qwen", port=31000, max_lora_rank=64)
    for flag in ("--enable-lora", "--disable-overlap-schedule", "--enable-metrics"):
        assert flag in argv
    assert argv[argv.index("--max-loras-per-batch") + 1] == "3"
    assert argv[argv.index("--max-lora-rank") + 1] == "64"
    assert "--tp-size" not in argv
    assert dev_cli.main(["engine", "--gpu", "--model", "/models/qwen"]) == 0
    assert capsys.readouterr().out.startswith(f"{PLUGIN_SWITCH_ENV}=1 python -m sglang.launch_server")
    assert dev_cli.main(["engine", "--gpu", "--model", "/models/qwen", "--tp", "4"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("--tp-size 4")


def test_renderings_show_what_an_operator_needs() -> None:
    status = {
        "engines": {
            "E0": {"reachable": False, "error": "connection refused"},
            "E1": {
                "reachable": True,
                "incarnation": "new",
                "registry_incarnation": "old",
                "consistent": False,
                "versions": [],
            },
        }
    }
    text = render_status(status)
    assert "E0: UNREACHABLE" in text and "restarted" in text
    pub = {
        "outcome": "OUTCOME_UNKNOWN",
        "version": "e/v",
        "lora_name": "n",
        "total_ms": 5.0,
        "phase_ms": {"begin": 1.0},
        "error": None,
        "unknown_engines": ["E1"],
    }
    assert "lora-versions resolve" in render_publish(pub)
    assert render_publish(None).startswith("nothing to resolve")
    assert table(["a", "b"], [[1, None]]).splitlines()[2].split() == ["1", "-"]
