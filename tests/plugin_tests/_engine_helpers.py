"""Helpers for tests that drive real engines over HTTP (plain httpx; no project client code,
so the engine side is tested independently of the trainer side)."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import uuid
from pathlib import Path

import httpx
from _snapshots import snapshot_of as snapshot_of  # re-exported: the engine tests import it here

from lora_contract.protocol import BeginRequest, ReceiveBucketMeta, Routes
from lora_versions_dev.engine_log import await_unload_lines, unload_lines
from lora_versions_dev.farm import ADMIN_KEY
from relax_glue.snapshot import Snapshot

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
EPOCH = "t1"
PREFIX = "relax_policy_lora"
_ids = itertools.count(1)


def new_version_id() -> str:
    return f"v{next(_ids)}x{uuid.uuid4().hex[:6]}"


class Staged:
    """One publication attempt of one snapshot against one engine."""

    def __init__(self, url: str, snap: Snapshot, version_id: str | None = None) -> None:
        self.url = url
        self.snap = snap
        self.version_id = version_id or new_version_id()
        self.attempt = uuid.uuid4().hex
        self.begin_req: BeginRequest = snap.begin_request(PREFIX, EPOCH, self.version_id, self.attempt)
        self.name = self.begin_req.lora_name

    def begin(self) -> httpx.Response:
        return post(self.url, Routes.BEGIN, self.begin_req.model_dump(mode="json"))

    def buckets(self) -> list:
        return list(self.snap.iter_buckets())

    def bucket_headers(self, bucket, *, sha: str | None = None, index: int | None = None) -> dict[str, str]:
        meta = ReceiveBucketMeta(
            lora_name=self.name,
            attempt_token=self.attempt,
            index=bucket.spec.index if index is None else index,
            sha256=sha or bucket.sha256,
        )
        return {**meta.to_headers(), **ADMIN}

    def send_bucket(
        self, bucket, *, payload: bytes | None = None, sha: str | None = None, index: int | None = None
    ) -> httpx.Response:
        return httpx.post(
            f"{self.url}{Routes.RECEIVE_BUCKET}",
            content=payload if payload is not None else bucket.payload,
            headers=self.bucket_headers(bucket, sha=sha, index=index),
            timeout=60,
        )

    def end(self) -> httpx.Response:
        return post(self.url, Routes.END, {"lora_name": self.name, "attempt_token": self.attempt})

    def cleanup(self) -> httpx.Response:
        return post(self.url, Routes.CLEANUP, {"lora_name": self.name, "attempt_token": self.attempt})

    def publish(self) -> dict:
        r = self.begin()
        assert r.status_code == 200, r.text
        for b in self.buckets():
            r = self.send_bucket(b)
            assert r.status_code == 200, r.text
        r = self.end()
        assert r.status_code == 200, r.text
        return r.json()


def post(url: str, route: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, headers=ADMIN if headers is None else headers, timeout=120)


def status(url: str) -> dict:
    r = httpx.get(f"{url}{Routes.STATUS}", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def versions(url: str) -> dict[str, dict]:
    return {v["lora_name"]: v for v in status(url)["versions"]}


def visible_state(url: str) -> dict:
    """The engine state a refused call must not change (timestamps excluded)."""
    return {
        name: {k: v for k, v in ver.items() if k not in ("updated_at", "in_flight")}
        for name, ver in versions(url).items()
    }


def error_code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["code"]
    except Exception:
        return None


def generate(
    url: str, input_ids: list[int], lora: str | None = None, max_new_tokens: int = 12, **extra
) -> httpx.Response:
    body: dict = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    if lora is not None:
        body["lora_path"] = lora
    body.update(extra)
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def stock_output_ids(stock_url: str, adapter_dir: Path, ref_name: str, input_ids: list[int]) -> list[int]:
    """The greedy output of ``adapter_dir`` as SGLang's own ``/load_lora_adapter`` serves it on
    the stock engine (under ``ref_name``, unloaded again): what a publication must equal."""
    ref = httpx.post(
        f"{stock_url}/load_lora_adapter",
        json={"lora_name": ref_name, "lora_path": str(adapter_dir)},
        timeout=120,
    )
    assert ref.status_code == 200, ref.text
    expected = generate(stock_url, input_ids, ref_name).json()["output_ids"]
    httpx.post(f"{stock_url}/unload_lora_adapter", json={"lora_name": ref_name}, timeout=120)
    return expected


def in_flight(url: str, name: str) -> int | None:
    r = httpx.get(f"{url}/lora_versions/{name}", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["in_flight"]


def wait_in_flight(url: str, name: str, want: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if in_flight(url, name) == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"in_flight of {name} never became {want} (now {in_flight(url, name)})")


def reclaim(url: str, name: str, reclaim_id: str, timeout_s: float = 30.0) -> httpx.Response:
    return post(url, Routes.RECLAIM, {"lora_name": name, "reclaim_id": reclaim_id, "timeout_s": timeout_s})


def unload_log_count(engine, lora_id: str) -> int:
    return unload_lines(engine.log_path, lora_id)


def unload_log_count_after(engine, lora_id: str, expect: int = 1, timeout_s: float = 10.0) -> int:
    """:func:`unload_log_count` once the log shows ``expect`` unloads or ``timeout_s`` passed (the
    scheduler writes the line, and it may trail the reply that said the unload is done)."""
    return asyncio.run(await_unload_lines(engine.log_path, lora_id, expect, timeout_s))


# SGLang 0.5.23's LoRAManager.load_lora_adapter logs this once per physical load, with the new
# LoRARef: ``LoRA adapter loading starts: LoRARef(lora_id=<id>, lora_name=<name>, ...)``.
_LOAD_LINE = re.compile(r"LoRA adapter loading starts: LoRARef\(lora_id=(\w+), lora_name=([^,)]+)")


def loaded_lora_ids(engine, lora_name: str) -> list[str]:
    """The engine-local lora_ids SGLang physically loaded under ``lora_name``, in log order (the
    table forgets a candidate's lora_id at cleanup; the log keeps every load)."""
    text = Path(engine.log_path).read_text(errors="replace")
    return [m[1] for m in _LOAD_LINE.finditer(text) if m[2] == lora_name]


def first_state_other_than(url: str, name: str, state: str, timeout_s: float = 60.0) -> str:
    """Poll ``GET /lora_versions/<name>`` as fast as it answers until the state is not ``state``;
    that first other state (a short-lived one, LOADING, is seen this way)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(headers=ADMIN, timeout=10) as client:
        while time.monotonic() < deadline:
            r = client.get(f"{url}/lora_versions/{name}")
            assert r.status_code == 200, r.text
            if r.json()["state"] != state:
                return r.json()["state"]
    raise AssertionError(f"{name} stayed {state} for {timeout_s} s")


class Published:
    """A version published on one engine, reclaimed (and checked) at the end of the test."""

    def __init__(self, engine, snap) -> None:
        self.engine = engine
        self.staged = Staged(engine.url, snap)
        self.staged.publish()
        self.name = self.staged.name
        self.lora_id = versions(engine.url)[self.name]["lora_id"]

    def finish(self) -> None:
        """Counts back to 0 and a reclaim that completes with exactly one physical unload."""
        url = self.engine.url
        if versions(url)[self.name]["state"] == "READY_LOCAL":
            wait_in_flight(url, self.name, 0)
            r = reclaim(url, self.name, uuid.uuid4().hex)
            assert r.status_code == 200 and r.json()["state"] == "UNLOADED", r.text
        assert versions(url)[self.name]["state"] == "UNLOADED"
        deadline = time.monotonic() + 10
        while unload_log_count(self.engine, self.lora_id) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert unload_log_count(self.engine, self.lora_id) == 1
