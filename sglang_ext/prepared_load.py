"""A managed load prepared off the scheduler thread, so the scheduler's step only installs it
(issue 29, "take off the loop what need not be on it").

SGLang 0.5.23's load of an adapter from disk runs on the scheduler thread, between two steps:
reading the safetensors files and building the ``LoRAAdapter`` with its weights re-shaped into
SGLang's stacked layout (``normalize_qkv_proj``, ``normalize_gate_up_proj``): most of the load
(docs/benchmarks.md, "Where the scheduler spends a load"), and every session on the engine waits
for it. None of that reads or writes what a step uses: it builds a new object from files. So the
plugin's managed load (``native_lora.NativeLora.load_pinned``) is split in the scheduler process:

1. ``prepare``: the scheduler thread only queues the build on one worker thread of its process
   (started by the first prepare) and answers at once;
2. ``poll``: the main process asks, between the scheduler's steps, until every rank has it
   prepared (or one failed: the load fails, typed, with nothing loaded or kept);
3. ``install``: SGLang's own load request, whose ``LoRAManager.load_lora_adapter`` (replaced by
   :func:`load_installing_what_was_prepared`) validates the prepared adapter against the live
   pool and installs it, as upstream's ``_load_lora_adapter`` would have after building it;
4. ``discard``: whatever was prepared and not installed is dropped (the end of every load but
   one that every rank installed, which took its preparation: a failure, a refusal, a
   cancellation, an install some rank did not answer with success).

A preparation is keyed by the exact load: the lora_id (a fresh uuid4 per load), the name and the
staged path. Only that key installs it, exactly once; nothing is shared across versions, and a
stock load (never prepared) takes upstream's path unchanged.

The four requests are SGLang's own ``LoadLoRAAdapterReqInput`` (the scheduler dispatches nothing
else to its load handler), told apart by their ``rid``; the scheduler treats one as the plugin's
only when it also names a managed version, which SGLang's own /load_lora_adapter refuses
(``hooks.refuse_managed_names_on_stock_lora_api``), so a client cannot send one.

The unload: what may leave the loop is the release of the adapter's host memory (the unloaded
``LoRAAdapter``'s tensors are freed on the worker, see :func:`unload_releasing_off_the_loop`).
Zeroing the slot (``LoRAMemoryPool._clear_buffer_slot_for_base``) stays on the scheduler thread:
the slot is marked empty in the same call, the next step may place another adapter in it (or, on
a GPU, replay a captured base-model graph that reads it), so it must be zero before that step;
on a GPU the zeroing is kernels queued on the step's own stream, ordered with the steps, which
another thread could only keep by its own stream and events, and a worker zeroing it while steps
run would need a "being zeroed" slot state that upstream's pool (its eviction policy and
``buffer_id_to_uid``) does not have. What it zeroes is only the ranks written into the slot since
its last clear (:mod:`sglang_ext.slot_zeroing`), not the pool's max rank.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from lora_contract.protocol import is_managed_name
from sglang_ext import lora_registry_patch as upstream
from sglang_ext import rank_agreement as ranks

# The rid of the plugin's load requests: RID_PREFIX + the op.
RID_PREFIX = "lora-versions-managed-load:"


class Op(StrEnum):
    PREPARE = "prepare"
    POLL = "poll"
    INSTALL = "install"
    DISCARD = "discard"


def rid_for(op: Op) -> str:
    return f"{RID_PREFIX}{op.value}"


def op_of(rid: Any, lora_name: Any) -> Op | None:
    """The plugin's op a load request carries; None for any other load (SGLang's own path)."""
    if not isinstance(rid, str) or not rid.startswith(RID_PREFIX):
        return None
    if not isinstance(lora_name, str) or not is_managed_name(lora_name):
        return None
    try:
        return Op(rid[len(RID_PREFIX) :])
    except ValueError:
        return None


@dataclass(frozen=True)
class LoadKey:
    """Exactly one load: the id SGLang will know it by, its name, the directory it reads."""

    lora_id: str
    lora_name: str
    lora_path: str


class State(StrEnum):
    PENDING = "pending"
    PREPARED = "prepared"
    FAILED = "failed"
    UNKNOWN = "unknown"  # nothing prepared under this exact key


# What a poll answers while the build runs (a LoRAUpdateOutput with success False and this text).
PENDING_MESSAGE = "lora-versions: still preparing off the scheduler thread"


class OffLoopWorker:
    """One daemon thread of the scheduler process running submitted jobs in order. Started by
    the first job; a job's outcome is its Future's."""

    def __init__(self, name: str = "lora-versions-prepare") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        done: Future[Any] = Future()
        self._jobs.put((done, job))
        return done

    def _run(self) -> None:
        while True:
            done, job = self._jobs.get()
            if done.set_running_or_notify_cancel():  # False: discarded before it started
                try:
                    done.set_result(job())
                except BaseException as exc:  # the job's failure is its outcome
                    done.set_exception(exc)
            del done, job  # nothing of a finished job stays referenced by this thread


class Preparations:
    """The preparations of one scheduler process, by exact load. Used from the scheduler thread
    only (the worker only completes Futures, which are thread-safe)."""

    def __init__(self, worker: OffLoopWorker) -> None:
        self.worker = worker
        self._by_id: dict[str, tuple[LoadKey, Future[Any]]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def start(self, key: LoadKey, build: Callable[[], Any]) -> str | None:
        """Queue ``build`` for ``key``; an error message instead when this id is already
        prepared or being prepared (a load is prepared exactly once)."""
        if key.lora_id in self._by_id:
            return f"lora_id {key.lora_id} is already being prepared"
        self._by_id[key.lora_id] = (key, self.worker.submit(build))
        return None

    def _entry(self, key: LoadKey) -> Future[Any] | None:
        entry = self._by_id.get(key.lora_id)
        return entry[1] if entry is not None and entry[0] == key else None

    def state(self, key: LoadKey) -> tuple[State, str]:
        """(state, failure message). A failure is reported once and forgotten with it: nothing
        of a failed preparation stays."""
        done = self._entry(key)
        if done is None:
            return State.UNKNOWN, f"nothing is prepared for lora_id {key.lora_id} at {key.lora_path}"
        if not done.done():
            return State.PENDING, ""
        exc = done.exception()
        if exc is None:
            return State.PREPARED, ""
        del self._by_id[key.lora_id]
        return State.FAILED, str(exc) or type(exc).__name__

    def take(self, key: LoadKey) -> Any | None:
        """The prepared value of exactly ``key``, handed over once (None: nothing prepared)."""
        if self.state(key)[0] is not State.PREPARED:
            return None
        _, done = self._by_id.pop(key.lora_id)
        return done.result()

    def discard(self, key: LoadKey) -> bool:
        """Drop ``key``'s preparation (a running build finishes, and its result is dropped)."""
        done = self._entry(key)
        if done is None:
            return False
        del self._by_id[key.lora_id]
        done.cancel()
        return True


# The scheduler process's own (one scheduler per process).
WORKER = OffLoopWorker()
PREPARATIONS = Preparations(WORKER)


def _key(lora_id: Any, lora_name: Any, lora_path: Any) -> LoadKey:
    return LoadKey(str(lora_id), str(lora_name), str(lora_path))


def prepare_off_the_loop(build: Callable[[], Any]) -> Callable[[], Any]:
    """The job the worker runs (named so that a profile of the scheduler process shows it)."""

    def prepare_off_the_loop_job() -> Any:
        return build()

    return prepare_off_the_loop_job


def prepare_then_install(original: Any, self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Scheduler.load_lora_adapter (0.5.23; the scheduler thread, between steps). A stock
    load goes through unchanged. The plugin's: ``prepare`` queues the build and answers;
    ``poll`` answers the state; ``discard`` drops the preparation; ``install`` runs SGLang's own
    load (whose LoRAManager step installs the prepared adapter), refused when nothing is prepared
    under its exact key: a managed load is never read and re-shaped on the scheduler thread.
    With several TP ranks, every answer but a discard's is all ranks' (:mod:`sglang_ext.rank_agreement`)."""

    rid, lora_name, lora_path, lora_id = upstream.load_request_fields(recv_req)
    op = op_of(rid, lora_name)
    if op is None:
        return original(self, recv_req, *args, **kwargs)
    key = _key(lora_id, lora_name, lora_path)
    if op is Op.PREPARE:
        build = upstream.adapter_builder(upstream.lora_manager_of(self), key.lora_id, key.lora_path)
        refused = PREPARATIONS.start(key, prepare_off_the_loop(build))
        return ranks.agree(self, upstream.lora_update_output(refused is None, refused))
    if op is Op.POLL:
        state, message = PREPARATIONS.state(key)
        if state is State.PREPARED:
            return ranks.agree(self, upstream.lora_update_output(True), PENDING_MESSAGE)
        local = upstream.lora_update_output(False, PENDING_MESSAGE if state is State.PENDING else message)
        return ranks.agree(self, local, PENDING_MESSAGE)
    if op is Op.DISCARD:
        PREPARATIONS.discard(key)  # a discard changes nothing a rank could disagree about
        return upstream.lora_update_output(True)
    return install_on_every_rank_or_none(original, self, recv_req, key, *args, **kwargs)


def install_on_every_rank_or_none(
    original: Any, self: Any, recv_req: Any, key: LoadKey, *args: Any, **kwargs: Any
) -> Any:
    """The install: only when every rank has its preparation (checked before any rank installs),
    and taken back out of the ranks that installed it when another rank's install failed, so a
    load is on every rank or on none when rank 0 replies. The take-back is SGLang's own unload on
    this rank (``TpModelWorker.unload_lora_adapter``), not the scheduler's, whose step fence
    waits for every rank to agree: the adapter was never registered, so no step has read it."""
    state, message = PREPARATIONS.state(key)
    ready = upstream.lora_update_output(
        state is State.PREPARED,
        None if state is State.PREPARED else f"nothing prepared to install: {message or state.value}",
    )
    ready = ranks.agree(self, ready)
    if not ready.success:
        return ready
    result = original(self, recv_req, *args, **kwargs)
    agreed = ranks.agree(self, result)
    if agreed.success or upstream.tp_peers(self) is None:
        return agreed
    if result.success:  # every rank agrees below, whichever way its own install went
        upstream.take_back_a_load(self, key.lora_name, key.lora_id)
    held = upstream.lora_manager_of(self).create_lora_update_result(success=False)
    return ranks.refusal_with_what_ranks_hold(self, held, agreed.error_message)


def load_installing_what_was_prepared(manager: Any, lora_ref: Any) -> Any:
    """REPLACE LoRAManager.load_lora_adapter (0.5.23; the scheduler thread): the adapter prepared
    for exactly this load is installed; any other load is upstream's own (both without a cache
    flush, ``lora_registry_patch.load_without_a_cache_flush``)."""
    lora_id, lora_name, lora_path = upstream.ref_fields(lora_ref)
    prepared = PREPARATIONS.take(_key(lora_id, lora_name, lora_path)) if lora_id is not None else None
    return upstream.load_without_a_cache_flush(manager, lora_ref, prepared)


def release_off_the_loop(held: list[Any]) -> None:
    """The worker's job for an unloaded adapter: the last reference goes here, so the host
    memory of its tensors is freed on this thread."""
    held.clear()


def unload_releasing_off_the_loop(manager: Any, lora_ref: Any) -> Any:
    """REPLACE LoRAManager.unload_lora_adapter (0.5.23; the scheduler thread): upstream's unload
    (``lora_registry_patch.unload_without_a_cache_flush``: the slot zeroed, the adapter dropped
    from the manager, here), then the adapter object, no longer reachable from anything SGLang
    reads, is released on the worker instead of here."""
    held = [upstream.loaded_adapter(manager, lora_ref)]
    result = upstream.unload_without_a_cache_flush(manager, lora_ref)
    if held[0] is not None:
        WORKER.submit(lambda: release_off_the_loop(held))
    else:
        held.clear()
    return result
