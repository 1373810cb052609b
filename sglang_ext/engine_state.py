"""This engine's plugin state, held in the engine's main process.

One instance per process (:func:`engine_state`). The incarnation is a fresh id at each plugin
start: every receipt carries it, so a READY from before a restart can be told apart. The version
table and the publication service are attached once the HTTP server is being set up (only then
do the tokenizer manager and the resolved server arguments exist).
"""

from __future__ import annotations

import atexit
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_contract import base_identity
from lora_contract.names import MANAGED_CAPACITY
from lora_contract.protocol import COLLECTIVE_TRANSPORT, BaseIdentity, EngineStatus
from sglang_ext import lora_registry_patch as upstream
from sglang_ext import settings
from sglang_ext.adapter_compat import EngineLoraShape, ModelGeometry
from sglang_ext.bucket_sources import OutOfBandReceive, ReceiveSetup, build_receives, register_receive
from sglang_ext.metrics import NO_METRICS, Metrics, VersionMetrics
from sglang_ext.native_lora import NativeLora
from sglang_ext.plugin_log import log_line
from sglang_ext.publication import PublicationService
from sglang_ext.reclaim import ReclaimService
from sglang_ext.removal import NameLocks
from sglang_ext.setup_checks import managed_slots
from sglang_ext.staging import StagingArea, local_source_dir
from sglang_ext.version_table import StagingLimits, VersionTable

if TYPE_CHECKING:
    from sglang_ext.native_lora import NativeEdge

ENGINE_VERSION_CAP_BYTES = int(settings.MAX_VERSION_BYTES.default)
ENGINE_BUCKET_CAP_BYTES = int(settings.MAX_BUCKET_BYTES.default)


@dataclass(frozen=True)
class BodyLimits:
    """How a control request's body is read: every read has a deadline and a byte cap, so a
    client that stalls, trickles or sends too much costs a bounded time and memory."""

    # the defaults and their reasons: sglang_ext.settings
    idle_timeout_s: float = settings.BODY_IDLE_TIMEOUT_S.default
    total_timeout_s: float = settings.BODY_TIMEOUT_S.default
    max_json_bytes: int = int(settings.MAX_JSON_BYTES.default)

    @classmethod
    def from_env(cls) -> BodyLimits:
        return cls(
            idle_timeout_s=settings.number(settings.BODY_IDLE_TIMEOUT_S),
            total_timeout_s=settings.number(settings.BODY_TIMEOUT_S),
            max_json_bytes=int(settings.number(settings.MAX_JSON_BYTES)),
        )


@dataclass
class EngineState:
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)
    table: VersionTable | None = None
    native: NativeEdge | None = None
    publication: PublicationService | None = None
    reclaim: ReclaimService | None = None
    metrics: Metrics = NO_METRICS
    base: BaseIdentity | None = None  # the base model adapters apply to (computed at attach)
    body_limits: BodyLimits = field(default_factory=BodyLimits.from_env)
    # where a trainer on this host may hand buckets over as files (None: bodies only)
    local_source_dir: Path | None = field(default_factory=local_source_dir)

    def attach(self, server_args: Any, tokenizer_manager: Any) -> None:
        if upstream.metrics_enabled():
            self.metrics = VersionMetrics(self)  # its per-version series read status() per scrape
        self.native = NativeLora(tokenizer_manager)
        self.base = engine_base(server_args, tokenizer_manager)
        log_line(f"base model fingerprint {self.base.fingerprint}")
        self.table = VersionTable(
            self.incarnation,
            staging_limits(server_args, upstream.base_hf_config(tokenizer_manager)),
            normalize_targets=upstream.normalized_target_modules,
            base_fingerprint=self.base.fingerprint,
        )
        staging = StagingArea()
        atexit.register(staging.close)  # SIGKILL skips it: the next engine sweeps what is left
        # every transport registered on this engine (bucket_sources: the collective, and any a
        # launch wrapper registered before the server started)
        setup = ReceiveSetup(staging, self.table.limits.max_bucket_bytes, self.incarnation, log_line)
        receives = build_receives(setup)
        assemble_engine(self, self.table, self.native, staging, log=log_line, out_of_band=receives)

    def holds_slot(self, lora_name: str) -> bool:
        """Whether ``lora_name`` is a managed version holding an engine slot (a live version)."""

        v = self.table.get(lora_name) if self.table is not None else None
        return v is not None and v.state.holds_slot

    def status(self) -> EngineStatus:
        versions = ()
        if self.table is not None and self.native is not None:
            versions = tuple(
                self.table.status_of(v, self.native.in_flight(v.lora_id))
                for _, v in sorted(self.table.versions.items())
            )
        return EngineStatus(
            incarnation=self.incarnation,
            base=self.base,
            versions=versions,
            managed_capacity=self.table.limits.managed_capacity if self.table else MANAGED_CAPACITY,
            server_time=time.time(),
        )


def assemble_engine(
    state: EngineState,
    table: VersionTable,
    native: NativeEdge,
    staging: StagingArea,
    *,
    log: Callable[[str], None] | None = None,
    out_of_band: Sequence[OutOfBandReceive] = (),
) -> EngineState:
    """The one place the engine's services are wired, used by the engine (:meth:`EngineState.attach`),
    the trainer side's fake engine and the shell tests alike: publication and reclaim over one
    table, one native edge and ONE lock set (a reclaim and a cleanup of one name must serialise on
    the very same lock; two sets would let them run at once, with no error). ``out_of_band``: the
    receives of the transports other than HTTP this engine serves (none: HTTP only)."""
    locks = NameLocks()
    state.table, state.native = table, native
    state.publication = PublicationService(table, native, staging, locks, log=log, out_of_band=out_of_band)
    state.reclaim = ReclaimService(table, native, locks, metrics=state.metrics)
    return state


def _collective_receive(setup: ReceiveSetup) -> OutOfBandReceive:
    # imported on use: the link's process machinery is needed only once an engine starts
    from sglang_ext.collective_receive import CollectiveReceive

    return CollectiveReceive.build(setup)


# the built-in transport besides HTTP (a launch wrapper may register more before the server starts)
register_receive(COLLECTIVE_TRANSPORT, _collective_receive)


def engine_base(server_args: Any, tokenizer_manager: Any) -> BaseIdentity:
    """This engine's base model identity (:mod:`lora_contract.base_identity`): files read once, at
    start, from the model's local directory (a few hundred KiB per weight file)."""
    model_path = str(server_args.model_path)
    # both ServerArgs fields are pinned and checked at start (DECLARED_FIELDS): read as they are
    revision = server_args.revision
    model_dir = base_identity.local_model_dir(model_path, revision)
    tokenizer_path = server_args.tokenizer_path or model_path
    tokenizer_dir = base_identity.local_model_dir(str(tokenizer_path), revision)
    dtype, quantization = upstream.base_serving(tokenizer_manager)
    return base_identity.base_identity(
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir,
        config=base_identity.config_of(model_dir, upstream.base_hf_config(tokenizer_manager).to_dict()),
        dtype=dtype,
        quantization=quantization,
        model_name=f"{model_path}@{revision}",
    )


def staging_limits(server_args: Any, hf_config: Any) -> StagingLimits:
    targets = server_args.lora_target_modules
    normalized = upstream.normalized_target_modules(targets) if targets else {"all"}
    return StagingLimits(
        managed_capacity=managed_slots(server_args),
        lora=EngineLoraShape(
            geometry=ModelGeometry.from_hf_config(hf_config),
            max_lora_rank=int(server_args.max_lora_rank),
            served_modules=None if "all" in normalized else frozenset(normalized),
        ),
        max_version_bytes=int(settings.number(settings.MAX_VERSION_BYTES)),
        max_bucket_bytes=int(settings.number(settings.MAX_BUCKET_BYTES)),
    )


_STATE: EngineState | None = None


def engine_state() -> EngineState:
    global _STATE
    if _STATE is None:
        _STATE = EngineState()
    return _STATE
