"""The base model's fingerprint: what an engine applies every adapter to, in one digest.

A LoRA version is a delta on one base model. Two engines of one cohort that run different bases
of the same shape (another checkpoint, a fine-tune, another tokenizer) would both pass ``begin``
and serve the adapter on different weights, and nothing would say so. So every engine computes,
once at start, a fingerprint of its base from four parts, each hashed separately so a mismatch
can name which part differs:

* ``config``: the model's ``config.json`` as canonical JSON (bookkeeping keys dropped:
  ``_name_or_path``, ``transformers_version``, ``_commit_hash``);
* ``tokenizer``: the bytes of every tokenizer file present (``tokenizer.json``, vocab, merges,
  template, ...);
* ``weights``: for every weight file, its name and size, the safetensors header (every tensor's
  name, dtype, shape and offsets) and :data:`SAMPLES_PER_FILE` samples of its bytes spread
  evenly over the data. Cheap at any size (a few hundred KiB read per file), and two bases of one
  shape that differ in their weights differ in practically every sample; it identifies a base,
  it does not authenticate one (a change confined to a few bytes between samples is not seen);
* ``serving``: what the engine computes with (dtype, quantization).

The registry records the epoch's fingerprint at its first publication; the publisher refuses an
engine whose fingerprint differs (``BASE_MISMATCH``) before any bucket moves, and ``begin``
carries the expected fingerprint so the engine refuses too. No SGLang import here: the main
process passes what it read from SGLang.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lora_contract.messages import BaseIdentity

SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 4096
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Keys of config.json that say where or by what a file was written, not what the model computes.
BOOKKEEPING_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})


def _sha(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(len(chunk).to_bytes(8, "little"))
        h.update(chunk)
    return h.hexdigest()


def config_identity(config: Mapping[str, Any]) -> str:
    canonical = {k: v for k, v in config.items() if k not in BOOKKEEPING_CONFIG_KEYS}
    return _sha(json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=str).encode())


def tokenizer_identity(tokenizer_dir: Path | None) -> str:
    if tokenizer_dir is None or not tokenizer_dir.is_dir():
        return _sha(b"no tokenizer files")
    parts = [b"tokenizer"]
    for name in TOKENIZER_FILES:
        path = tokenizer_dir / name
        if path.is_file():
            parts += [name.encode(), path.read_bytes()]
    return _sha(*parts)


def _safetensors_data_start(f: Any, size: int) -> tuple[bytes, int]:
    """The header bytes of a safetensors file and where its data starts."""
    head = f.read(8)
    if len(head) < 8:
        return b"", 0
    n = int.from_bytes(head, "little")
    if n <= 0 or 8 + n > size:
        return b"", 0
    return f.read(n), 8 + n


def file_identity(path: Path) -> str:
    """One weight file: its size, its safetensors header (if it is one) and evenly spread
    samples of its data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header, start = _safetensors_data_start(f, size) if path.suffix == ".safetensors" else (b"", 0)
        span = max(size - start, 0)
        parts = [str(size).encode(), header]
        for i in range(SAMPLES_PER_FILE):
            f.seek(start + (span * i) // SAMPLES_PER_FILE)
            parts.append(f.read(SAMPLE_BYTES))
    return _sha(*parts)


def weights_identity(model_dir: Path | None, unresolved: str) -> str:
    """Every weight file in ``model_dir`` (sorted by name). ``unresolved`` names the model when
    its files cannot be found locally (then only that name is identity)."""
    files = (
        sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
        if model_dir is not None and model_dir.is_dir()
        else []
    )
    if not files:
        return _sha(b"unresolved", unresolved.encode())
    return _sha(*(part for p in files for part in (p.name.encode(), file_identity(p).encode())))


def serving_identity(dtype: str, quantization: str | None) -> str:
    return _sha(b"serving", dtype.encode(), str(quantization).encode())


def base_identity(
    *,
    model_dir: Path | None,
    tokenizer_dir: Path | None,
    config: Mapping[str, Any],
    dtype: str,
    quantization: str | None,
    model_name: str,
) -> BaseIdentity:
    parts = {
        "config": config_identity(config),
        "tokenizer": tokenizer_identity(tokenizer_dir),
        "weights": weights_identity(model_dir, model_name),
        "serving": serving_identity(dtype, quantization),
    }
    fingerprint = _sha(*(f"{k}={v}".encode() for k, v in sorted(parts.items())))
    return BaseIdentity(fingerprint=fingerprint, **parts)


def local_model_dir(model_path: str, revision: str | None) -> Path | None:
    """The directory holding the model's files: the path itself, or the local hub cache's copy
    of a hub id (never a download: the engine already loaded it)."""
    path = Path(model_path)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download  # lazy: only a hub id, not a local dir, needs it

        return Path(snapshot_download(model_path, revision=revision, local_files_only=True))
    except Exception:
        return None


def config_of(model_dir: Path | None, fallback: Mapping[str, Any]) -> Mapping[str, Any]:
    """``config.json`` as written (the same bytes give the same identity on every engine), else
    the config SGLang loaded."""
    if model_dir is not None and (model_dir / "config.json").is_file():
        return json.loads((model_dir / "config.json").read_text())
    return fallback


def base_differences(a: BaseIdentity, b: BaseIdentity) -> list[str]:
    """Which parts two fingerprints differ in (for messages)."""
    return [p for p in ("config", "tokenizer", "weights", "serving") if getattr(a, p) != getattr(b, p)]
