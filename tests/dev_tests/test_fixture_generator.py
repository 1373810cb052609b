"""Fixtures are deterministic, cached by generator hash, and never used half-written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lora_versions_dev import fixtures as fx


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_generation_is_deterministic(fixtures, tmp_path, monkeypatch):
    monkeypatch.delenv(fx.FIXTURE_ROOT_ENV, raising=False)
    fresh = fx.ensure_fixtures(tmp_path)
    assert fresh.root.name == fixtures.root.name  # same generator key
    assert tree_digest(fresh.root) == tree_digest(fixtures.root)


def test_fixture_set_is_complete(fixtures):
    assert (fixtures.model_dir / "model.safetensors").is_file()
    assert (fixtures.model_dir / "tokenizer.json").is_file()
    for name in ("A", "B", "C", "rank16"):
        assert (fixtures.adapter_dir(name) / "adapter_model.safetensors").is_file()
    import json

    assert (
        json.loads((fixtures.adapter_dir("rank16") / "adapter_config.json").read_text())["r"]
        > fx.MAX_LORA_RANK
    )


def test_interrupted_generation_is_never_used(tmp_path, monkeypatch):
    monkeypatch.delenv(fx.FIXTURE_ROOT_ENV, raising=False)

    def crash_half_way(out: Path) -> None:
        (out / "model").mkdir(parents=True)
        (out / "model" / "config.json").write_text("{}")
        raise KeyboardInterrupt("interrupted")

    monkeypatch.setattr(fx, "_generate", crash_half_way)
    with pytest.raises(KeyboardInterrupt):
        fx.ensure_fixtures(tmp_path)
    assert list(tmp_path.iterdir()) == [], "no final and no partial directory may remain"

    generated: list[Path] = []
    monkeypatch.setattr(fx, "_generate", lambda out: generated.append(out))
    result = fx.ensure_fixtures(tmp_path)
    assert generated, "the next run regenerates"
    assert (result.root / "COMPLETE").is_file()
