"""A seeded fuzzer for the plugin's control endpoints, run against a real engine.

It interleaves valid publications (begin, ordered buckets, end, replays, a foreign attempt's
begin and cleanup of a READY version, cleanup, reclaim) of real and crafted-but-valid adapters
with malformed, out-of-order, cross-version, adversarial and concurrent requests, and checks
after every request:

- the answer is typed: a 2xx with its reply model, or a 4xx whose body is ``{"error": {code}}``
  with the one status of that code (never a 5xx, never a dropped connection);
- a refusal changed nothing: the engine's status equals the one read before the request;
- the engine is alive (its status answers; a 1-token generation every ``health_every`` requests);
- no version that was not validly published holds a slot, and at most ``capacity`` do.

At the end every READY version must generate exactly its adapter's reference tokens (HF + PEFT),
the versions holding slots must be exactly the fuzzer's live publications, and the engine log
written during the run must hold no traceback. Used by the test suite (a short seeded run) and by
``bench/control_fuzz.py`` (a long one). Violations are collected, not raised, so a run reports
all of them.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import string
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from lora_contract.errors import HTTP_STATUS, ErrorCode, LoraVersionError
from lora_contract.protocol import (
    ATTEMPT_TOKEN_HEADER,
    BUCKET_CONTENT_TYPE,
    BUCKET_INDEX_HEADER,
    BUCKET_SHA256_HEADER,
    LORA_NAME_HEADER,
    BucketAck,
    CleanupReceipt,
    Manifest,
    ReadyReceipt,
    Routes,
    bucket_checksum,
    encode_bucket,
    make_lora_name,
    manifest_digest,
    manifest_from_tensors,
    parse_begin_reply,
    parse_reclaim_reply,
    plan_buckets,
    read_peft_dir,
)
from lora_versions_dev.farm import PROMPT

MAX_NEW = 6
EPOCH = "fz"
PREFIX = "fuzz"
CONTROL_POSTS = (Routes.BEGIN, Routes.RECEIVE_BUCKET, Routes.END, Routes.CLEANUP, Routes.RECLAIM)
HOLDING = ("PREPARED", "LOADING", "READY_LOCAL", "FAILED", "RECLAIMING")


# ------------------------------------------------------------------------------------ adapters


@dataclass
class Adapter:
    """An adapter the fuzzer publishes. ``refused_at`` is None for one an engine must serve
    (then ``tokens`` is its reference), else the step that must refuse it."""

    label: str
    config: dict[str, Any]
    tensors: dict[str, Any]
    refused_at: str | None = None  # "begin" | "bucket"
    tokens: list[int] | None = None
    manifest: Manifest = field(init=False)
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        self.manifest = manifest_from_tensors(self.config, self.tensors)
        self.digest = manifest_digest(self.manifest)


def _edited(config: dict, tensors: dict, **changes: Any) -> tuple[dict, dict]:
    return {**config, **changes}, dict(tensors)


def crafted_adapters(adapter_dirs: dict[str, Path]) -> list[Adapter]:
    """The fixture adapters plus crafted variants of the first: some an engine must serve as
    PEFT does, the rest it must refuse (each for one reason SGLang 0.5.23 would mis-serve or
    crash on). Reference tokens are filled in by :func:`attach_reference_tokens`."""
    import torch

    out = []
    for label, path in adapter_dirs.items():
        config, tensors = read_peft_dir(path)
        out.append(Adapter(label, config, tensors))
    base_config, base = read_peft_dir(next(iter(adapter_dirs.values())))
    names = sorted(base)
    q_a = next(n for n in names if "q_proj.lora_A" in n)
    q_b = q_a.replace("lora_A", "lora_B")
    nan = dict(base)
    nan[q_a] = base[q_a].clone()
    nan[q_a][0, 0] = float("nan")
    valid = {
        "rslora": _edited(base_config, base, use_rslora=True),
        "q_v_only": (
            {**base_config, "target_modules": ["q_proj", "v_proj"]},
            {n: t for n, t in base.items() if ".q_proj." in n or ".v_proj." in n},
        ),
        "layer1_only": (
            {**base_config, "layers_to_transform": [1]},
            {n: t for n, t in base.items() if ".layers.1." in n},
        ),
    }
    refused_at_begin = {
        "rank_lie": _edited(base_config, base, r=2),
        "rank_pattern": _edited(base_config, base, rank_pattern={"q_proj": 2}),
        "alpha_pattern": _edited(base_config, base, alpha_pattern={"v_proj": 3}),
        "dora": _edited(base_config, base, use_dora=True),
        "bias": _edited(base_config, base, bias="lora_only"),
        "fan_in_fan_out": _edited(base_config, base, fan_in_fan_out=True),
        "modules_to_save": _edited(base_config, base, modules_to_save=["lm_head"]),
        "unknown_tensor": (
            base_config,
            {**base, "model.layers.0.self_attn.q_norm.lora_A.weight": torch.zeros(4, 8)},
        ),
        "embedding": (
            base_config,
            {**base, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)},
        ),
        "transposed": (base_config, {**base, q_b: base[q_b].t().contiguous()}),
        "int_dtype": (base_config, {**base, q_a: base[q_a].to(torch.int32)}),
        "no_v": (base_config, {n: t for n, t in base.items() if ".v_proj." not in n}),
        "untargeted": ({**base_config, "target_modules": ["q_proj", "v_proj"]}, base),
    }
    out += [Adapter(f"crafted_{k}", c, t) for k, (c, t) in valid.items()]
    out += [Adapter(f"crafted_{k}", c, t, refused_at="begin") for k, (c, t) in refused_at_begin.items()]
    out.append(Adapter("crafted_nan", base_config, nan, refused_at="bucket"))
    return out


def attach_reference_tokens(adapters: list[Adapter], model_dir: Path, workdir: Path) -> None:
    """Reference greedy tokens (HF + PEFT, fp32) for every adapter an engine must serve."""
    from safetensors.torch import save_file

    from lora_versions_dev import reference

    for a in adapters:
        if a.refused_at is not None:
            continue
        d = workdir / a.label
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(json.dumps({**a.config, "peft_type": "LORA"}))
        save_file({n: t.contiguous() for n, t in a.tensors.items()}, str(d / "adapter_model.safetensors"))
        a.tokens = reference.greedy_tokens(model_dir, d, PROMPT, MAX_NEW)


# ------------------------------------------------------------------------------- publications


@dataclass
class Bucket:
    index: int
    payload: bytes
    sha256: str


@dataclass
class Publication:
    adapter: Adapter
    version_id: str
    attempt: str
    name: str
    begin_body: dict[str, Any]
    buckets: list[Bucket]
    phase: str = "new"  # new, begun, ready, cleaned, reclaimed, refused
    sent: int = 0  # buckets accepted

    @property
    def holds_slot(self) -> bool:
        return self.phase in ("begun", "ready")


def _checksum_or_zeros(payload: bytes) -> str:
    """The checksum of a payload the fuzzer corrupted; when the corruption broke its header
    there is none, and a wrong one is sent (the engine must refuse the body either way)."""
    try:
        return bucket_checksum(payload)
    except LoraVersionError:
        return "0" * 64


def new_publication(adapter: Adapter, rng: random.Random, bucket_cap: int) -> Publication:
    version_id = f"v{rng.randrange(10**9)}"
    attempt = uuid.UUID(int=rng.getrandbits(128)).hex
    plan = plan_buckets(adapter.manifest, bucket_cap)
    buckets = []
    for spec in plan:
        payload = encode_bucket(adapter.tensors, spec)
        buckets.append(Bucket(spec.index, payload, bucket_checksum(payload)))
    name = make_lora_name(PREFIX, EPOCH, version_id, adapter.digest)
    body = {
        "lora_name": name,
        "version_key": {"epoch": EPOCH, "version_id": version_id},
        "digest": adapter.digest,
        "attempt_token": attempt,
        "manifest": adapter.manifest.model_dump(mode="json"),
        "bucket_plan": [s.model_dump(mode="json") for s in plan],
    }
    return Publication(adapter, version_id, attempt, name, body, buckets)


def bucket_headers(p: Publication, b: Bucket) -> dict[str, str]:
    return {
        LORA_NAME_HEADER: p.name,
        ATTEMPT_TOKEN_HEADER: p.attempt,
        BUCKET_INDEX_HEADER: str(b.index),
        BUCKET_SHA256_HEADER: b.sha256,
        "Content-Type": BUCKET_CONTENT_TYPE,
    }


def fuzz_engine_spec(model_dir: Path, log_path: Path, admin_key: str) -> Any:
    """An engine of the fuzzer's own, run like a guarded deployment (control behind a key)."""
    from lora_versions_dev.launcher import EngineSpec

    return EngineSpec(
        name="fuzz", model_path=model_dir, log_path=log_path, extra_args=["--admin-api-key", admin_key]
    )


# ------------------------------------------------------------------------------------ the run


@dataclass
class FuzzReport:
    seed: int
    requests: int = 0
    by_op: Counter = field(default_factory=Counter)
    by_status: Counter = field(default_factory=Counter)
    publications_ready: int = 0
    violations: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "requests": self.requests,
            "violations": len(self.violations),
            "publications_ready": self.publications_ready,
            "by_status": {str(k): v for k, v in sorted(self.by_status.items(), key=lambda kv: str(kv[0]))},
            "by_op": dict(sorted(self.by_op.items())),
            "violations_list": self.violations[:1000],
        }


class Reply:
    """What came back: a status and a body, or nothing (None status: connection dropped)."""

    def __init__(self, status: int | None, body: Any, text: str) -> None:
        self.status, self.body, self.text = status, body, text

    @property
    def code(self) -> str | None:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err.get("code") if isinstance(err, dict) else None


def _visible(status: dict) -> dict:
    return {
        v["lora_name"]: {k: x for k, x in v.items() if k not in ("updated_at", "in_flight")}
        for v in status.get("versions", [])
    }


class ControlFuzzer:
    def __init__(
        self,
        url: str,
        adapters: list[Adapter],
        *,
        seed: int,
        admin_key: str | None = None,
        log_path: Path | None = None,
        alive: Callable[[], bool] | None = None,
        capacity: int | None = None,
        bucket_cap: int = 16 * 1024,
        health_every: int = 10,
    ) -> None:
        self.url = url
        self.adapters = adapters
        self.serve = [a for a in adapters if a.refused_at is None]
        self.refuse = [a for a in adapters if a.refused_at is not None]
        self.rng = random.Random(seed)
        self.auth = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.log_path = log_path
        self.alive = alive or (lambda: True)
        self.client = httpx.Client(timeout=120)
        # the engine's own bound on managed versions (its LoRA slots but one), unless given
        self.capacity = capacity if capacity is not None else self._engine_capacity()
        self.bucket_cap = bucket_cap
        self.health_every = health_every
        self.report = FuzzReport(seed)
        self.pubs: list[Publication] = []
        self._log_start = log_path.stat().st_size if log_path else 0
        self._state: dict = {}
        self._count = threading.Lock()  # concurrent ops send from several threads
        self.ops: list[tuple[str, int, Callable[[], None]]] = [
            ("advance", 30, self.op_advance),
            ("replay", 6, self.op_replay),
            ("finish", 6, self.op_finish),
            ("foreign_begin", 2, self.op_foreign_begin),
            ("generate", 5, self.op_generate),
            ("crafted", 6, self.op_crafted),
            ("cross_version", 6, self.op_cross_version),
            ("mutated_begin", 8, self.op_mutated_begin),
            ("bad_bucket", 10, self.op_bad_bucket),
            ("garbage", 8, self.op_garbage),
            ("out_of_turn", 6, self.op_out_of_turn),
            ("oversize", 2, self.op_oversize),
            ("cut_body", 2, self.op_cut_body),
            ("concurrent", 3, self.op_concurrent),
        ]

    # -------------------------------------------------------------------------- plumbing

    def violation(self, message: str) -> None:
        self.report.violations.append(f"[req {self.report.requests}] {message}")

    def count(self, status: int | str) -> None:
        with self._count:
            self.report.requests += 1
            self.report.by_status[status] += 1

    def _send(
        self, method: str, path: str, *, json_body: Any = None, content: Any = None, headers=None
    ) -> Reply:
        hdrs = {**self.auth, **(headers or {})}
        try:
            if json_body is not None:
                r = self.client.request(method, self.url + path, json=json_body, headers=hdrs)
            else:
                r = self.client.request(method, self.url + path, content=content, headers=hdrs)
        except httpx.HTTPError as exc:
            self.count("dropped")
            return Reply(None, None, repr(exc))
        self.count(r.status_code)
        try:
            body = r.json()
        except ValueError:
            body = None
        return Reply(r.status_code, body, r.text[:300])

    def _engine_capacity(self) -> int:
        capacity = self.status().get("managed_capacity")
        if not isinstance(capacity, int):
            raise RuntimeError(f"the engine at {self.url} reports no managed_capacity")
        return capacity

    def status(self) -> dict:
        r = self.client.get(self.url + Routes.STATUS, headers=self.auth)
        r.raise_for_status()
        return r.json()

    def check_typed(self, what: str, reply: Reply, *, allow_codes: tuple[str, ...] | None = None) -> bool:
        """A 4xx of ours with its one status; returns True when it is a typed refusal."""
        if reply.status is None or reply.status >= 500:
            self.violation(f"{what}: untyped answer {reply.status} {reply.text}")
            return False
        if reply.status < 400:
            return False
        code = reply.code
        if code is None or code not in ErrorCode.__members__:
            self.violation(f"{what}: {reply.status} without a typed error body: {reply.text}")
            return False
        if HTTP_STATUS[ErrorCode(code)] != reply.status:
            self.violation(f"{what}: {code} answered with {reply.status}, not {HTTP_STATUS[ErrorCode(code)]}")
        if allow_codes is not None and code not in allow_codes:
            self.violation(f"{what}: {code}, expected one of {allow_codes}: {reply.text}")
        return True

    def after(
        self, what: str, reply: Reply, *, refusal_expected: bool, must_not_change: bool = False
    ) -> None:
        """The per-request checks: typed answer, no change on a refusal (or at all, for a
        request that cannot legitimately create anything), engine alive."""
        refused = self.check_typed(what, reply) or must_not_change
        if refusal_expected and reply.status is not None and reply.status < 400:
            self.violation(f"{what}: accepted ({reply.status}) but must be refused: {reply.text}")
        if not self.alive():
            self.violation(f"{what}: the engine process died")
            raise EngineDied(what)
        try:
            now = self.status()
        except httpx.HTTPError as exc:
            self.violation(f"{what}: status unreadable after the request: {exc!r}")
            raise EngineDied(what) from exc
        if refused and _visible(now) != _visible(self._state):
            self.violation(f"{what}: answered {reply.status} {reply.code} but the engine state changed")
        self._state = now
        self.check_slots(what, now)
        if self.report.requests % self.health_every == 0:
            self.check_health(what)

    def check_slots(self, what: str, status: dict) -> None:
        holding = [v for v in status["versions"] if v["state"] in HOLDING]
        if len(holding) > self.capacity:
            self.violation(f"{what}: {len(holding)} versions hold slots (capacity {self.capacity})")
        ours = {p.name: p for p in self.pubs}
        for v in holding:
            p = ours.get(v["lora_name"])
            if p is None or p.adapter.refused_at == "begin":
                self.violation(f"{what}: {v['lora_name']} holds a slot but was never validly begun")

    def check_health(self, what: str) -> None:
        """A 1-token greedy generation of the base model, what SGLang's ``/health_generate``
        sends, asked directly: that endpoint answers no sooner than its 1 s poll (0.5.23,
        ``http_server.health_generate``), which was 25 s of a 28 s run of 300 requests here."""
        body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
        r = self.client.post(self.url + "/generate", json=body)
        if r.status_code != 200 or len(r.json().get("output_ids", ())) != 1:
            self.violation(f"{what}: a 1-token base generation answered {r.status_code}: {r.text[:200]}")

    def pick(self, *phases: str, servable: bool = False) -> Publication | None:
        candidates = [
            p for p in self.pubs if p.phase in phases and (not servable or p.adapter.refused_at is None)
        ]
        return self.rng.choice(candidates) if candidates else None

    def live(self) -> list[Publication]:
        return [p for p in self.pubs if p.holds_slot]

    def begin_reply_ok(self, p: Publication, reply: Reply, what: str) -> None:
        if reply.status != 200:
            self.violation(f"{what}: valid begin of {p.adapter.label} answered {reply.status}: {reply.text}")
            return
        receipt = parse_begin_reply(reply.body)
        if receipt.lora_name != p.name or receipt.attempt_token != p.attempt:
            self.violation(f"{what}: begin receipt names another version or attempt: {reply.text}")

    # -------------------------------------------------------------------------- valid flows

    def send_begin(self, p: Publication, body: dict | None = None) -> Reply:
        return self._send("POST", Routes.BEGIN, json_body=body or p.begin_body)

    def send_bucket(self, p: Publication, b: Bucket, **overrides: Any) -> Reply:
        payload = overrides.pop("payload", b.payload)
        headers = {**bucket_headers(p, b), **overrides}
        return self._send("POST", Routes.RECEIVE_BUCKET, content=payload, headers=headers)

    def send_end(self, p: Publication) -> Reply:
        return self._send("POST", Routes.END, json_body={"lora_name": p.name, "attempt_token": p.attempt})

    def send_cleanup(self, p: Publication) -> Reply:
        return self._send("POST", Routes.CLEANUP, json_body={"lora_name": p.name, "attempt_token": p.attempt})

    def send_reclaim(self, p: Publication, reclaim_id: str) -> Reply:
        body = {"lora_name": p.name, "reclaim_id": reclaim_id, "timeout_s": 5.0}
        return self._send("POST", Routes.RECLAIM, json_body=body)

    def op_advance(self) -> None:
        """The next legitimate call of a publication in flight, or a new one."""
        p = self.pick("begun", servable=True)
        if p is None or (len(self.live()) < self.capacity and self.rng.random() < 0.3):
            if len(self.live()) >= self.capacity:
                return self.op_finish()
            p = new_publication(self.rng.choice(self.serve), self.rng, self.bucket_cap)
            self.pubs.append(p)
            reply = self.send_begin(p)
            self.after("advance/begin", reply, refusal_expected=False)
            self.begin_reply_ok(p, reply, "advance/begin")
            if reply.status == 200:
                p.phase = "begun"
            return None
        if p.sent < len(p.buckets):
            reply = self.send_bucket(p, p.buckets[p.sent])
            self.after("advance/bucket", reply, refusal_expected=False)
            if reply.status == 200:
                BucketAck.model_validate(reply.body)
                p.sent += 1
            else:
                self.violation(f"advance/bucket of {p.adapter.label}: {reply.status} {reply.text}")
            return None
        reply = self.send_end(p)
        self.after("advance/end", reply, refusal_expected=False)
        if reply.status == 200:
            ReadyReceipt.model_validate(reply.body)
            p.phase = "ready"
            self.report.publications_ready += 1
        else:
            self.violation(f"advance/end of {p.adapter.label}: {reply.status} {reply.text}")
        return None

    def op_replay(self) -> None:
        """A repeated valid call: the same answer, no second effect."""
        p = self.pick("begun", "ready", "cleaned")
        if p is None:
            return
        if p.phase == "cleaned":
            first = self.send_cleanup(p)
            self.after("replay/cleanup", first, refusal_expected=False)
            if first.status != 200 or CleanupReceipt.model_validate(first.body).lora_name != p.name:
                self.violation(f"replay/cleanup: {first.status} {first.text}")
            return
        kind = self.rng.choice(["begin", "bucket", "end"] if p.phase == "ready" else ["begin", "bucket"])
        if kind == "begin":
            reply = self.send_begin(p)
            self.after("replay/begin", reply, refusal_expected=False)
            self.begin_reply_ok(p, reply, "replay/begin")
        elif kind == "bucket" and p.sent:
            reply = self.send_bucket(p, p.buckets[self.rng.randrange(p.sent)])
            self.after("replay/bucket", reply, refusal_expected=False)
            if reply.status != 200 or not reply.body.get("duplicate"):
                self.violation(f"replay/bucket: not a duplicate ack: {reply.status} {reply.text}")
        elif kind == "end":
            reply = self.send_end(p)
            self.after("replay/end", reply, refusal_expected=False)
            if reply.status != 200:
                self.violation(f"replay/end of a READY version: {reply.status} {reply.text}")

    def op_finish(self) -> None:
        """Cleanup (any live publication) or reclaim (a READY one); frees its slot."""
        p = self.pick("begun", "ready")
        if p is None:
            return
        if p.phase == "ready" and self.rng.random() < 0.4:
            reply = self.send_reclaim(p, uuid.UUID(int=self.rng.getrandbits(128)).hex)
            self.after("finish/reclaim", reply, refusal_expected=False)
            if reply.status == 200 and parse_reclaim_reply(reply.body).state == "UNLOADED":
                p.phase = "reclaimed"
            else:
                self.violation(f"finish/reclaim: {reply.status} {reply.text}")
            return
        reply = self.send_cleanup(p)
        self.after("finish/cleanup", reply, refusal_expected=False)
        if reply.status == 200 and CleanupReceipt.model_validate(reply.body).lora_name == p.name:
            p.phase = "cleaned"
        else:
            self.violation(f"finish/cleanup: {reply.status} {reply.text}")

    def op_foreign_begin(self) -> None:
        """A new attempt for a READY version: refused (NOT_ATTEMPT_OWNER) and nothing changes;
        its cleanup is refused the same way. The version keeps the token that loaded it, so no
        other attempt can ever unload it."""
        p = self.pick("ready")
        if p is None:
            return
        token = uuid.UUID(int=self.rng.getrandbits(128)).hex
        reply = self.send_begin(p, {**p.begin_body, "attempt_token": token})
        self.after("foreign_begin", reply, refusal_expected=True)
        if reply.code != ErrorCode.NOT_ATTEMPT_OWNER.value:
            self.violation(f"foreign_begin: {reply.status} {reply.text}")
        reply = self._send("POST", Routes.CLEANUP, json_body={"lora_name": p.name, "attempt_token": token})
        self.after("foreign_begin/cleanup", reply, refusal_expected=True)
        if reply.code != ErrorCode.NOT_ATTEMPT_OWNER.value:
            self.violation(f"foreign_begin/cleanup: {reply.status} {reply.text}")

    def op_generate(self) -> None:
        """Generation naming a version: READY serves exactly its adapter's tokens; any other
        state is a version error, never a fallback."""
        p = self.pick("begun", "ready", "cleaned", "reclaimed", "refused")
        if p is None:
            return
        body = {
            "input_ids": PROMPT,
            "lora_path": p.name,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
        }
        r = self.client.post(self.url + "/generate", json=body)
        self.count(r.status_code)
        if p.phase == "ready":
            if r.status_code != 200 or r.json()["output_ids"] != p.adapter.tokens:
                self.violation(f"generate on READY {p.adapter.label}: {r.status_code} {r.text[:200]}")
        else:
            expected = {"begun": "VERSION_NOT_READY", "reclaimed": "VERSION_RECLAIMED"}.get(
                p.phase, "UNKNOWN_VERSION"
            )
            got = Reply(r.status_code, _json_or_none(r), r.text).code
            if got != expected:
                self.violation(f"generate on {p.phase} {p.adapter.label}: {r.status_code} {r.text[:200]}")

    # -------------------------------------------------------------------------- adversarial

    def op_crafted(self) -> None:
        """Begin an adapter the engine must refuse (or whose bucket it must refuse)."""
        adapter = self.rng.choice(self.refuse)
        p = new_publication(adapter, self.rng, self.bucket_cap)
        self.pubs.append(p)
        if adapter.refused_at == "begin" or len(self.live()) >= self.capacity:
            reply = self.send_begin(p)
            self.after(f"crafted/{adapter.label}", reply, refusal_expected=True)
            if reply.status is not None and reply.status < 500:
                want = ("INCOMPATIBLE_ADAPTER",) if adapter.refused_at == "begin" else ("CAPACITY_ERROR",)
                self.check_typed(f"crafted/{adapter.label}", reply, allow_codes=want)
            p.phase = "refused"
            return
        reply = self.send_begin(p)  # a NaN adapter's manifest is fine; its bucket is not
        self.after(f"crafted/{adapter.label}/begin", reply, refusal_expected=False)
        p.phase = "begun"
        for b in p.buckets:
            reply = self.send_bucket(p, b)
            if reply.status != 200:
                self.after(f"crafted/{adapter.label}/bucket", reply, refusal_expected=True)
                self.check_typed(f"crafted/{adapter.label}", reply, allow_codes=("INCOMPATIBLE_ADAPTER",))
                break
            self.after(f"crafted/{adapter.label}/bucket", reply, refusal_expected=False)
            p.sent += 1
        else:
            self.violation(f"crafted/{adapter.label}: every bucket was accepted")
        reply = self.send_cleanup(p)
        self.after(f"crafted/{adapter.label}/cleanup", reply, refusal_expected=False)
        p.phase = "cleaned"

    def op_cross_version(self) -> None:
        """One version's attempt token used with another version's name (begin, bucket, end,
        cleanup). Once the engine has accepted a token, any use of it with another name is a
        typed refusal that changes nothing (ATTEMPT_MISMATCH)."""
        if len(self.pubs) < 2:
            return self.op_advance()
        p, q = self.rng.sample(self.pubs, 2)
        kind = self.rng.choice(["begin", "bucket", "end", "cleanup"])
        if kind == "begin":
            reply = self.send_begin(q, {**q.begin_body, "attempt_token": p.attempt})
        elif kind == "bucket":
            b = q.buckets[min(q.sent, len(q.buckets) - 1)]
            reply = self.send_bucket(q, b, **{ATTEMPT_TOKEN_HEADER: p.attempt})
        else:
            route = Routes.END if kind == "end" else Routes.CLEANUP
            reply = self._send("POST", route, json_body={"lora_name": q.name, "attempt_token": p.attempt})
        bound = p.phase in ("begun", "ready", "cleaned", "reclaimed") and p.name != q.name
        # q is held by its own attempt: a token that is not q's can neither take it over nor
        # clean it (NOT_ATTEMPT_OWNER), whether or not that token is bound elsewhere
        held = q.phase in ("begun", "ready") and kind in ("begin", "cleanup") and p.attempt != q.attempt
        self.after(f"cross/{kind}", reply, refusal_expected=bound or held)
        if not bound and not held and kind == "begin" and reply.status == 200:
            # p's token was never accepted and q holds nothing: it starts an attempt of q
            q.attempt = p.attempt
            q.begin_body = {**q.begin_body, "attempt_token": p.attempt}
            q.phase, q.sent = "begun", 0
        return None

    def op_mutated_begin(self) -> None:
        """A begin body broken in one place: typed refusal, nothing created."""
        p = new_publication(self.rng.choice(self.adapters), self.rng, self.bucket_cap)
        body = json.loads(json.dumps(p.begin_body))
        mutation = self.rng.choice(_BEGIN_MUTATIONS)
        mutation(body, self.rng)
        reply = self.send_begin(p, body)
        self.after(f"mutated_begin/{mutation.__name__}", reply, refusal_expected=True)

    def op_bad_bucket(self) -> None:
        """A bucket call that must be refused: out of order, another sha, corrupted or foreign
        payload, wrong content type, missing or malformed headers."""
        # Only a bucket not yet accepted: an accepted index sent again under its own sha256 is a
        # duplicate the engine acknowledges from its state without reading the body (it changes
        # nothing, whatever the bytes), so it is no refusal to check.
        candidates = [q for q in self.pubs if q.phase == "begun" and q.sent < len(q.buckets)]
        if not candidates:
            return self.op_advance()
        p = self.rng.choice(candidates)
        i = p.sent
        cur = p.buckets[i]
        kind = self.rng.choice(
            [
                "ahead",
                "wrong_sha",
                "corrupt",
                "foreign",
                "content_type",
                "no_header",
                "bad_index",
                "truncated",
            ]
        )
        if kind == "ahead" and i + 1 < len(p.buckets):
            reply = self.send_bucket(p, p.buckets[i + 1])
        elif kind == "wrong_sha":
            reply = self.send_bucket(p, cur, **{BUCKET_SHA256_HEADER: "0" * 64})
        elif kind == "corrupt":
            data = bytearray(cur.payload)
            data[self.rng.randrange(len(data))] ^= 0xFF
            reply = self.send_bucket(
                p, cur, payload=bytes(data), **{BUCKET_SHA256_HEADER: _checksum_or_zeros(bytes(data))}
            )
        elif kind == "foreign":
            other = self.rng.choice([b for b in p.buckets if b.index != cur.index] or [None])
            if other is None:
                return None
            reply = self.send_bucket(p, cur, payload=other.payload, **{BUCKET_SHA256_HEADER: other.sha256})
        elif kind == "content_type":
            reply = self.send_bucket(
                p, cur, **{"Content-Type": self.rng.choice(["application/json", "text/plain"])}
            )
        elif kind == "no_header":
            reply = self._send(
                "POST",
                Routes.RECEIVE_BUCKET,
                content=cur.payload,
                headers={"Content-Type": BUCKET_CONTENT_TYPE},
            )
        elif kind == "bad_index":
            reply = self.send_bucket(
                p, cur, **{BUCKET_INDEX_HEADER: self.rng.choice(["-1", "x", "99999999999999999999", ""])}
            )
        elif kind == "truncated":
            reply = self.send_bucket(p, cur, payload=cur.payload[: len(cur.payload) // 2])
        else:
            return None
        self.after(f"bad_bucket/{kind}", reply, refusal_expected=True)
        return None

    def op_garbage(self) -> None:
        """Random bytes, random JSON, or valid JSON of another route's shape, to a random route."""
        path = self.rng.choice(CONTROL_POSTS)
        kind = self.rng.choice(["bytes", "json", "empty", "wrong_model", "deep"])
        if kind == "bytes":
            content = self.rng.randbytes(self.rng.randrange(1, 2048))
        elif kind == "json":
            content = json.dumps(_random_json(self.rng, 3)).encode()
        elif kind == "empty":
            content = b""
        elif kind == "deep":
            depth = self.rng.randrange(100, 5000)
            content = ("[" * depth + "]" * depth).encode()
        else:
            content = json.dumps(
                {"lora_name": _random_text(self.rng), "attempt_token": _random_text(self.rng)}
            ).encode()
        headers = {
            "Content-Type": BUCKET_CONTENT_TYPE if path == Routes.RECEIVE_BUCKET else "application/json"
        }
        reply = self._send("POST", path, content=content, headers=headers)
        # random JSON can be a valid cleanup or reclaim of a name never seen (a tombstone, a
        # NOT_LOADED receipt), but nothing random can create or change a version
        self.after(f"garbage/{kind}", reply, refusal_expected=False, must_not_change=True)

    def op_out_of_turn(self) -> None:
        """A call in the wrong phase: end before every bucket, bucket after end, reclaim of a
        candidate, begin of a reclaimed name, unknown names."""
        kind = self.rng.choice(
            ["early_end", "late_bucket", "reclaim_candidate", "begin_reclaimed", "unknown_status"]
        )
        if kind == "early_end":
            p = self.pick("begun")
            if p is None or p.sent == len(p.buckets):
                return None
            reply = self.send_end(p)
        elif kind == "late_bucket":
            p = self.pick("cleaned")
            if p is None:
                return None
            reply = self.send_bucket(p, p.buckets[0])
        elif kind == "reclaim_candidate":
            p = self.pick("begun")
            if p is None:
                return None
            reply = self.send_reclaim(p, uuid.uuid4().hex)
        elif kind == "begin_reclaimed":
            p = self.pick("reclaimed")
            if p is None:
                return None
            reply = self.send_begin(p, {**p.begin_body, "attempt_token": uuid.uuid4().hex})
        else:
            reply = self._send("GET", f"/lora_versions/{make_lora_name(PREFIX, EPOCH, 'nope', '0' * 64)}")
        self.after(f"out_of_turn/{kind}", reply, refusal_expected=True)
        return None

    def op_oversize(self) -> None:
        """A body larger than the engine accepts, announced or streamed: refused before it is kept."""
        path = self.rng.choice([Routes.BEGIN, Routes.END, Routes.CLEANUP])
        if self.rng.random() < 0.5:
            content: Any = b"{" + b" " * (9 * 1024**2) + b"}"
        else:

            def chunks():
                for _ in range(9):
                    yield b" " * 1024**2

            content = chunks()
        reply = self._send("POST", path, content=content, headers={"Content-Type": "application/json"})
        self.after("oversize", reply, refusal_expected=True)

    def op_cut_body(self) -> None:
        """A body cut short by the client: no answer to check, but no change either."""
        p = self.pick("begun") or new_publication(self.rng.choice(self.serve), self.rng, self.bucket_cap)
        if self.rng.random() < 0.5 and p.phase == "begun" and p.sent < len(p.buckets):
            b = p.buckets[p.sent]
            headers, body, path = bucket_headers(p, b), b.payload, Routes.RECEIVE_BUCKET
        else:
            headers = {"Content-Type": "application/json"}
            body, path = json.dumps(p.begin_body).encode(), Routes.BEGIN
        self.count("cut")
        u = urlparse(self.url)
        with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
            head = [f"POST {path} HTTP/1.1", f"Host: {u.hostname}", f"Content-Length: {len(body)}"]
            head += [f"{k}: {v}" for k, v in {**self.auth, **headers}.items()]
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body[: self.rng.randrange(len(body))])
        self.after("cut_body", Reply(400, {"error": {"code": "INCOMPLETE_BODY"}}, ""), refusal_expected=True)

    def op_concurrent(self) -> None:
        """Racing calls on one publication; each answer typed, the model then re-read from the
        engine (which of them won is the engine's call)."""
        p = self.pick("begun", "ready")
        if p is None:
            return self.op_advance()
        calls: list[Callable[[], Reply]]
        if p.phase == "begun" and p.sent < len(p.buckets):
            b = p.buckets[p.sent]
            calls = [lambda: self.send_bucket(p, b)] * 3 + [lambda: self.send_begin(p)]
        elif p.phase == "begun":
            calls = [lambda: self.send_end(p), lambda: self.send_end(p), lambda: self.send_cleanup(p)]
        else:
            calls = [lambda: self.send_begin(p), lambda: self.send_end(p), lambda: self.send_cleanup(p)]
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            replies = list(pool.map(lambda c: c(), calls))
        for reply in replies:
            self.check_typed("concurrent", reply)
        now = self.status()
        mine = next((v for v in now["versions"] if v["lora_name"] == p.name), None)
        if mine is not None:
            phase = {"READY_LOCAL": "ready", "CLEANED": "cleaned", "PREPARED": "begun"}.get(mine["state"])
            if phase is None:
                self.violation(f"concurrent: {p.name} left in {mine['state']} after every call answered")
            elif phase == "ready" and p.phase == "begun":
                self.report.publications_ready += 1
            p.phase = phase or p.phase
            p.sent = mine["buckets_received"]
        self._state = now
        self.check_slots("concurrent", now)

    # -------------------------------------------------------------------------- run and finish

    def run(self, n_requests: int) -> FuzzReport:
        self._state = self.status()
        names, weights = zip(*[(n, w) for n, w, _ in self.ops], strict=True)
        table = {n: f for n, _, f in self.ops}
        try:
            while self.report.requests < n_requests:
                op = self.rng.choices(names, weights)[0]
                self.report.by_op[op] += 1
                table[op]()
            self.finish()
        except EngineDied:
            pass
        finally:
            self.client.close()
        return self.report

    def finish(self) -> None:
        """Every READY version serves exactly its adapter; exactly the live publications hold
        slots; then everything is cleaned up and the slots are free; no traceback in the log."""
        status = self.status()
        holding = {v["lora_name"]: v["state"] for v in status["versions"] if v["state"] in HOLDING}
        live = {p.name for p in self.live()}
        if set(holding) != live:
            self.violation(f"finish: engine holds {sorted(holding)}, the fuzzer published {sorted(live)}")
        for p in self.pubs:
            if p.phase == "ready":
                self.op_generate_exact(p)
        for p in self.live():
            reply = self.send_cleanup(p)
            self.after("finish/cleanup", reply, refusal_expected=False)
            p.phase = "cleaned"
        left = [v["lora_name"] for v in self.status()["versions"] if v["state"] in HOLDING]
        if left:
            self.violation(f"finish: slots still held after cleanup: {left}")
        self.check_health("finish")
        if self.log_path is not None:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                text = f.read().decode(errors="replace")
            for marker in ("Traceback", "Exception in ASGI application"):
                if marker in text:
                    at = text.index(marker)
                    self.violation(f"finish: engine log has {marker!r}: {text[at : at + 600]!r}")

    def op_generate_exact(self, p: Publication) -> None:
        body = {
            "input_ids": PROMPT,
            "lora_path": p.name,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
        }
        r = self.client.post(self.url + "/generate", json=body)
        if r.status_code != 200 or r.json()["output_ids"] != p.adapter.tokens:
            self.violation(
                f"finish: {p.adapter.label} as {p.name} served {r.text[:200]}, reference {p.adapter.tokens}"
            )


class EngineDied(Exception):
    pass


def _json_or_none(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


# ------------------------------------------------------------------------------ random inputs


def _random_text(rng: random.Random) -> str:
    alphabet = string.printable + "@-:/\u00e9\u4e2d\U0001f600\x00"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 80)))


def _random_json(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(7 if depth > 0 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 2**63, -(2**70), rng.randrange(-1000, 1000)])
    if kind == 2:
        return rng.choice([0.5, -1e308, 1e-320, 3.14])
    if kind == 3:
        return _random_text(rng)
    if kind == 4:
        return make_lora_name(PREFIX, EPOCH, str(rng.randrange(99)), f"{rng.getrandbits(256):064x}")
    if kind == 5:
        return [_random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    keys = ["lora_name", "attempt_token", "manifest", "digest", "bucket_plan", "reclaim_id", "timeout_s", "x"]
    return {rng.choice(keys): _random_json(rng, depth - 1) for _ in range(rng.randrange(5))}


def _drop_key(body: dict, rng: random.Random) -> None:
    body.pop(rng.choice(sorted(body)))


def _extra_key(body: dict, rng: random.Random) -> None:
    body[rng.choice(["extra", "lora_id", "pinned"])] = _random_json(rng, 1)


def _wrong_type(body: dict, rng: random.Random) -> None:
    body[rng.choice(sorted(body))] = rng.choice([None, 7, [], "x", {"a": 1}])


def _digest_flip(body: dict, rng: random.Random) -> None:
    d = body["digest"]
    i = rng.randrange(12, 64)
    body["digest"] = d[:i] + ("0" if d[i] != "0" else "1") + d[i + 1 :]


def _name_mismatch(body: dict, rng: random.Random) -> None:
    body["version_key"] = {"epoch": EPOCH, "version_id": f"other{rng.randrange(1000)}"}


def _config_edit(body: dict, rng: random.Random) -> None:
    # the digest no longer matches the manifest
    body["manifest"]["config"]["lora_alpha"] = body["manifest"]["config"]["lora_alpha"] + 1


def _tensor_edit(body: dict, rng: random.Random) -> None:
    entry = rng.choice(body["manifest"]["tensors"])
    entry[rng.choice(["shape", "nbytes", "sha256", "dtype"])] = rng.choice([[1], 3, "0" * 64, "complex64"])


def _plan_edit(body: dict, rng: random.Random) -> None:
    plan = body["bucket_plan"]
    kind = rng.randrange(3)
    if kind == 0 and len(plan) > 1:
        plan.reverse()
    elif kind == 1:
        plan[0]["total_bytes"] += 1
    else:
        plan[0]["tensor_names"] = plan[0]["tensor_names"][1:] or ["nope"]


def _bad_name(body: dict, rng: random.Random) -> None:
    body["lora_name"] = rng.choice(["base:adapter", "x" * 300, "", "a@b-c-d", body["lora_name"] + "\n"])


def _bad_token(body: dict, rng: random.Random) -> None:
    body["attempt_token"] = rng.choice(["", "a b", "x" * 200, "tok\n", "é"])


_BEGIN_MUTATIONS: list[Callable[[dict, random.Random], None]] = [
    _drop_key,
    _extra_key,
    _wrong_type,
    _digest_flip,
    _name_mismatch,
    _config_edit,
    _tensor_edit,
    _plan_edit,
    _bad_name,
    _bad_token,
]
