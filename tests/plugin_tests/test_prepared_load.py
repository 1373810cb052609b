"""The prepared load's pure parts (sglang_ext.prepared_load): which requests are the plugin's,
the preparations by exact load on the real worker thread, the scheduler hook's answers, and the
unloaded adapter released on the worker. The engine test (test_prepared_load_engines.py) runs
the same on a real scheduler process."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from _eventually import eventually_sync

from sglang_ext import lora_registry_patch as upstream
from sglang_ext import prepared_load as pl
from sglang_ext.prepared_load import LoadKey, OffLoopWorker, Op, Preparations, State

NAME = "relax_policy_lora@1-1-abcdefabcdef"
KEY = LoadKey("id-1", NAME, "/staged/attempt-0")


# ---------------------------------------------------------------------- which requests are ours


@pytest.mark.parametrize("op", list(Op))
def test_an_op_is_ours_only_with_its_rid_and_a_managed_name(op: Op) -> None:
    assert pl.op_of(pl.rid_for(op), NAME) is op
    assert pl.op_of(pl.rid_for(op), "my-adapter") is None, "a stock name (the stock API's) is never ours"
    assert pl.op_of(None, NAME) is None
    assert pl.op_of(pl.RID_PREFIX + "evict", NAME) is None
    assert pl.op_of(f"x{pl.rid_for(op)}", NAME) is None


# ------------------------------------------------------------------------------ preparations


def test_a_preparation_runs_on_the_worker_thread_and_is_taken_once_by_its_exact_key() -> None:
    gate = threading.Event()
    ran_on: list[str] = []

    def build() -> str:
        ran_on.append(threading.current_thread().name)
        gate.wait(5)
        return "adapter"

    preps = Preparations(OffLoopWorker("test-prepare"))
    assert preps.start(KEY, build) is None
    assert preps.state(KEY) == (State.PENDING, "")
    assert preps.take(KEY) is None, "nothing to install while it runs"
    assert preps.start(KEY, build) is not None, "a load is prepared exactly once"
    gate.set()
    eventually_sync(lambda: preps.state(KEY)[0] is State.PREPARED)
    assert ran_on == ["test-prepare"]
    for other in (
        LoadKey("id-1", NAME, "/staged/attempt-1"),  # the same id, another directory
        LoadKey("id-1", "relax_policy_lora@1-2-abcdefabcdef", KEY.lora_path),
        LoadKey("id-2", NAME, KEY.lora_path),
    ):
        assert preps.state(other)[0] is State.UNKNOWN and preps.take(other) is None
        assert preps.discard(other) is False
    assert preps.take(KEY) == "adapter"
    assert preps.take(KEY) is None and preps.state(KEY)[0] is State.UNKNOWN and len(preps) == 0


def test_a_failed_preparation_is_reported_once_and_nothing_of_it_stays() -> None:
    def build() -> Any:
        raise OSError("cannot read bucket-00001.safetensors")

    preps = Preparations(OffLoopWorker("test-prepare"))
    preps.start(KEY, build)
    done = preps._by_id[KEY.lora_id][1]
    eventually_sync(done.done)
    assert preps.state(KEY) == (State.FAILED, "cannot read bucket-00001.safetensors")
    assert len(preps) == 0 and preps.state(KEY)[0] is State.UNKNOWN
    assert preps.start(KEY, lambda: "retried") is None, "the same key may be prepared again"


def test_a_discarded_preparation_drops_its_result_whether_it_ran_or_not() -> None:
    started, gate = threading.Event(), threading.Event()
    results: list[Any] = []

    def slow() -> str:
        started.set()
        gate.wait(5)
        return "slow"

    def never() -> str:
        results.append("ran")
        return "never"

    worker = OffLoopWorker("test-prepare")
    preps = Preparations(worker)
    preps.start(KEY, slow)
    queued = LoadKey("id-2", NAME, "/staged/attempt-1")
    preps.start(queued, never)
    started.wait(5)
    assert preps.discard(KEY) and preps.discard(queued)
    assert len(preps) == 0
    gate.set()
    done = worker.submit(lambda: "after")
    eventually_sync(done.done)
    assert results == [], "a job discarded before it started never runs"
    assert preps.state(KEY)[0] is State.UNKNOWN and preps.take(KEY) is None


# ------------------------------------------------------------------------------ the scheduler hook


class FakeUpstream:
    """What prepare_then_install reads from lora_registry_patch, on plain objects."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, build: Any) -> None:
        self.built: list[tuple[str, str]] = []
        monkeypatch.setattr(upstream, "lora_manager_of", lambda scheduler: scheduler.manager)
        monkeypatch.setattr(upstream, "tp_peers", lambda scheduler: None)  # one TP rank

        def adapter_builder(manager: Any, lora_id: str, lora_path: str) -> Any:
            self.built.append((lora_id, lora_path))
            return build

        monkeypatch.setattr(upstream, "adapter_builder", adapter_builder)

        def reply(ok: bool, msg: str | None = None) -> SimpleNamespace:
            return SimpleNamespace(success=ok, error_message=msg)

        monkeypatch.setattr(upstream, "lora_update_output", reply)
        monkeypatch.setattr(
            upstream, "load_request_fields", lambda r: (r.rid, r.lora_name, r.lora_path, r.lora_id)
        )


def request(op: Op | None, key: LoadKey = KEY) -> SimpleNamespace:
    rid = None if op is None else pl.rid_for(op)
    return SimpleNamespace(rid=rid, lora_name=key.lora_name, lora_path=key.lora_path, lora_id=key.lora_id)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Preparations:
    preps = Preparations(OffLoopWorker("test-prepare"))
    monkeypatch.setattr(pl, "PREPARATIONS", preps)
    return preps


def test_the_scheduler_hook_prepares_polls_installs_and_passes_stock_loads(monkeypatch, fresh) -> None:
    gate = threading.Event()
    FakeUpstream(monkeypatch, lambda: (gate.wait(5), "prepared adapter")[1])
    calls: list[Any] = []

    def original(scheduler: Any, recv_req: Any) -> Any:
        calls.append(recv_req.rid)
        return SimpleNamespace(success=True, error_message=None)

    scheduler = SimpleNamespace(manager="manager")
    hook = pl.prepare_then_install
    stock = request(None, LoadKey("id-9", "my-adapter", "/adapters/a"))
    assert hook(original, scheduler, stock).success and calls == [None], "a stock load is upstream's"

    assert hook(original, scheduler, request(Op.PREPARE)).success
    poll = hook(original, scheduler, request(Op.POLL))
    assert not poll.success and poll.error_message == pl.PENDING_MESSAGE
    early = hook(original, scheduler, request(Op.INSTALL))
    assert not early.success and "nothing prepared" in early.error_message
    gate.set()
    eventually_sync(lambda: fresh.state(KEY)[0] is State.PREPARED)
    assert hook(original, scheduler, request(Op.POLL)).success
    assert calls == [None], "no op but the install reaches SGLang's load"
    assert hook(original, scheduler, request(Op.INSTALL)).success
    assert calls == [None, pl.rid_for(Op.INSTALL)]
    # SGLang's load then reaches LoRAManager.load_lora_adapter, which takes it by the exact ref
    got: list[Any] = []
    monkeypatch.setattr(upstream, "load_without_a_cache_flush", lambda m, ref, prepared: got.append(prepared))
    ref = SimpleNamespace(lora_id=KEY.lora_id, lora_name=KEY.lora_name, lora_path=KEY.lora_path)
    monkeypatch.setattr(upstream, "ref_fields", lambda r: (r.lora_id, r.lora_name, r.lora_path))
    pl.load_installing_what_was_prepared("manager", ref)
    pl.load_installing_what_was_prepared("manager", ref)  # a second load of the id finds nothing
    assert got == ["prepared adapter", None]
    assert hook(original, scheduler, request(Op.DISCARD)).success and len(fresh) == 0


def test_a_failed_preparation_is_answered_at_the_poll_and_never_installed(monkeypatch, fresh) -> None:
    def build() -> Any:
        raise OSError("no such file: bucket-00000.safetensors")

    FakeUpstream(monkeypatch, build)
    calls: list[Any] = []
    scheduler = SimpleNamespace(manager="manager")
    hook = pl.prepare_then_install
    assert hook(lambda *a: calls.append(a), scheduler, request(Op.PREPARE)).success
    eventually_sync(lambda: fresh._by_id[KEY.lora_id][1].done())
    poll = hook(lambda *a: calls.append(a), scheduler, request(Op.POLL))
    assert not poll.success and poll.error_message == "no such file: bucket-00000.safetensors"
    assert len(fresh) == 0, "forgotten where it was reported"
    refused = hook(lambda *a: calls.append(a), scheduler, request(Op.INSTALL))
    assert not refused.success and calls == []
    assert hook(lambda *a: calls.append(a), scheduler, request(Op.DISCARD)).success  # idempotent


def test_a_second_prepare_of_the_same_load_is_refused(monkeypatch, fresh) -> None:
    FakeUpstream(monkeypatch, lambda: "adapter")
    scheduler = SimpleNamespace(manager="manager")
    assert pl.prepare_then_install(None, scheduler, request(Op.PREPARE)).success
    again = pl.prepare_then_install(None, scheduler, request(Op.PREPARE))
    assert not again.success and "already" in again.error_message


# ------------------------------------------------------------------------------ the unload


def test_an_unloaded_adapter_is_released_on_the_worker(monkeypatch) -> None:
    freed_on: list[str] = []
    freed = threading.Event()

    class Adapter:
        uid = "id-1"

        def __del__(self) -> None:
            freed_on.append(threading.current_thread().name)
            freed.set()

    manager = SimpleNamespace(loras={"id-1": Adapter()})
    monkeypatch.setattr(pl, "WORKER", OffLoopWorker("test-release"))

    def unload(m: Any, ref: Any) -> str:
        m.loras.pop(ref.lora_id, None)  # upstream's _unload_lora_adapter drops it from the manager
        return "unloaded"

    monkeypatch.setattr(upstream, "unload_without_a_cache_flush", unload)
    assert pl.unload_releasing_off_the_loop(manager, SimpleNamespace(lora_id="id-1")) == "unloaded"
    assert freed.wait(5) and freed_on == ["test-release"]
    # an id that is not loaded: upstream's answer, nothing queued
    assert pl.unload_releasing_off_the_loop(manager, SimpleNamespace(lora_id="id-1")) is not None


# ------------------------------------------------------------------------------ the install


class Manager:
    """LoRAManager's state and the two methods install_prepared calls (0.5.23 semantics)."""

    speculative_algorithm = None

    def __init__(self, refuse: str | None = None) -> None:
        self.loras: dict[str, Any] = {}
        self.configs: dict[str, Any] = {}
        self.lora_refs: dict[str, Any] = {}
        self.num_pinned_loras = 0
        self.refuse = refuse

    def validate_new_adapter(self, config: Any, ref: Any) -> None:
        if self.refuse:
            raise ValueError(self.refuse)

    def create_lora_update_result(self, success: bool, error_message: str = "") -> Any:
        return SimpleNamespace(success=success, error_message=error_message)


def prepared() -> upstream.PreparedAdapter:
    return upstream.PreparedAdapter(config="config", adapter=SimpleNamespace(embedding_layers={}))


def ref(pinned: bool = True) -> SimpleNamespace:
    return SimpleNamespace(lora_id="id-1", lora_name=NAME, lora_path="/staged/attempt-0", pinned=pinned)


def test_install_sets_what_upstreams_load_sets() -> None:
    m, p, r = Manager(), prepared(), ref()
    assert upstream.install_prepared(m, r, p).success
    assert m.loras == {"id-1": p.adapter} and m.configs == {"id-1": "config"}
    assert m.lora_refs == {"id-1": r} and m.num_pinned_loras == 1


def test_an_install_the_pool_refuses_leaves_nothing() -> None:
    text = "LoRA adapter x with rank 16 is incompatible with the current LoRA memory pool configuration."
    m = Manager(refuse=text)
    out = upstream.install_prepared(m, ref(), prepared())
    assert not out.success and out.error_message == text and upstream.is_incompatible_message(text)
    assert (m.loras, m.configs, m.lora_refs, m.num_pinned_loras) == ({}, {}, {}, 0)
