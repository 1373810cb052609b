"""Which thread of the real SGLang 0.5.23 scheduler process runs each part of a load (tests only).

Installed inside E1's scheduler process (``sglang_with_scheduler_probes.py``), before the plugin
loads there. One log line per call, naming the thread that ran it:

- ``LoRAAdapter.initialize_weights`` (upstream: the safetensors reads, then
  ``_normalize_weights``, the q/k/v and gate/up re-shaping) and ``LoRAAdapter._normalize_weights``;
- ``LoRAManager._load_lora_adapter`` (upstream's whole load: config, weights, state);
- the plugin's ``lora_registry_patch.install_prepared`` and ``prepared_load.release_off_the_loop``;
- every plugin load op the scheduler answers (``prepared_load.prepare_then_install``), with the
  number of preparations the process then holds.

One fault, for the call it marks only: when the trigger file (:func:`trigger_path`) exists, the
next ``initialize_weights`` removes it and raises, as a failed read of the adapter's files would.
``trigger_path(..., tp_rank=1)`` marks the next one of that tensor-parallel rank only (issue 38:
a preparation that fails on one rank of a TP engine); ``install_trigger_path(..., tp_rank=1)``
fails that rank's next install of a prepared adapter instead, as ``install_prepared`` answers a
refusal (nothing of it installed). Every line names its TP rank.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from probe_log import log_line

LOG_LINE = "prepared-load probe"
FAULT_TEXT = "injected preparation fault (tests)"
INSTALL_FAULT_TEXT = "injected install fault (tests)"


def trigger_path(local_source_dir: str | os.PathLike[str], tp_rank: int | None = None) -> Path:
    """Beside the engine's local source directory (its path is in E0's and E1's environment);
    ``tp_rank``: the fault of that rank only."""
    source = Path(local_source_dir)
    rank = "" if tp_rank is None else f".tp-rank-{tp_rank}"
    return source.with_name(f"{source.name}.fail-next-preparation{rank}")


def install_trigger_path(local_source_dir: str | os.PathLike[str], tp_rank: int) -> Path:
    source = Path(local_source_dir)
    return source.with_name(f"{source.name}.fail-next-install.tp-rank-{tp_rank}")


def tp_rank() -> int:
    """This scheduler process's TP rank (its global rank: one engine, no DP, no PP)."""
    import torch.distributed

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _note(what: str, **fields: Any) -> None:
    thread = threading.current_thread()
    details = " ".join(f"{k}={v}" for k, v in fields.items())
    main = thread is threading.main_thread()
    log_line(f"{LOG_LINE} {what} thread={thread.name} main={main} tp_rank={tp_rank()} {details}")


def take_the_fault(trigger: Path) -> bool:
    try:
        trigger.unlink()  # only one call takes the fault
    except FileNotFoundError:
        return False
    return True


def install() -> None:
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_manager import LoRAManager

    from sglang_ext import lora_registry_patch, prepared_load
    from sglang_ext.staging import LOCAL_SOURCE_DIR_ENV

    source = os.environ.get(LOCAL_SOURCE_DIR_ENV)

    initialize = LoRAAdapter.initialize_weights

    def initialize_weights(self: Any) -> Any:
        _note("initialize_weights", lora_id=self.uid)
        if source and any(take_the_fault(t) for t in (trigger_path(source), trigger_path(source, tp_rank()))):
            _note("fault injected", lora_id=self.uid)
            raise OSError(FAULT_TEXT)
        return initialize(self)

    normalize = LoRAAdapter._normalize_weights

    def _normalize_weights(self: Any) -> Any:
        _note("normalize_weights", lora_id=self.uid)
        return normalize(self)

    full_load = LoRAManager._load_lora_adapter

    def _load_lora_adapter(self: Any, lora_ref: Any) -> Any:
        _note("upstream_load", lora_id=lora_ref.lora_id)
        return full_load(self, lora_ref)

    LoRAAdapter.initialize_weights = initialize_weights
    LoRAAdapter._normalize_weights = _normalize_weights
    LoRAManager._load_lora_adapter = _load_lora_adapter

    # Module functions the plugin calls by their module's name, and the hook it registers (read
    # from the module when the plugin loads, after this).
    install_prepared = lora_registry_patch.install_prepared

    def install_prepared_noted(manager: Any, lora_ref: Any, prepared: Any) -> Any:
        _note("install", lora_id=lora_ref.lora_id)
        if source and take_the_fault(install_trigger_path(source, tp_rank())):
            _note("install fault injected", lora_id=lora_ref.lora_id)
            return manager.create_lora_update_result(success=False, error_message=INSTALL_FAULT_TEXT)
        return install_prepared(manager, lora_ref, prepared)

    release = prepared_load.release_off_the_loop

    def release_noted(held: list[Any]) -> None:
        _note("release", lora_id=getattr(held[0], "uid", None) if held else None)
        release(held)

    hook = prepared_load.prepare_then_install

    def prepare_then_install(original: Any, self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        out = hook(original, self, recv_req, *args, **kwargs)
        rid, lora_name, _, lora_id = lora_registry_patch.load_request_fields(recv_req)
        op = prepared_load.op_of(rid, lora_name)
        _note(
            "op",
            op=op.value if op else "stock",
            lora_id=lora_id,
            success=out.success,
            held=len(prepared_load.PREPARATIONS),
        )
        return out

    lora_registry_patch.install_prepared = install_prepared_noted
    prepared_load.release_off_the_loop = release_noted
    prepared_load.prepare_then_install = prepare_then_install
