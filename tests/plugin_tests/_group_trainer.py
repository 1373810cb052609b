"""The test process as the trainer of the collective transport: rank 0 of one engine's group.

Plain httpx and the group functions (no relax_glue client), so faults can be crafted: a frame
that lies, data that differs, a broadcast that never comes. Run as a script it is a trainer that
connects, begins, broadcasts the first ``sent`` buckets, prints ``SENT``, and waits to be
SIGKILLed (the trainer-death tests).
"""

from __future__ import annotations

import json
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import torch

import lora_versions_dev.engine_log  # noqa: F401

# The installed packages first: once tests/ is on sys.path, its sglang_ext/ and relax_glue/
# folders (test folders, no __init__) would be taken for namespace packages and shadow the real
# ones for any submodule not yet imported (e.g. lora_versions_dev.*).
import relax_glue.snapshot  # noqa: F401  (run as a script: this file is the trainer process)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _engine_helpers import Staged, snapshot_of

from lora_contract.collective_group import Frame, broadcast, host_store, open_group, token_tag
from lora_contract.protocol import ReceiveBucketMeta, Routes
from lora_contract.transport import HEADER_PREFIX_BYTES, header_length
from lora_versions_dev.farm import ADMIN_KEY

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def tensor_bytes(payload: bytes) -> bytes:
    n = header_length(payload[:HEADER_PREFIX_BYTES])
    assert n is not None
    return payload[HEADER_PREFIX_BYTES + n :]


def as_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class GroupTrainer:
    def __init__(self, url: str, timeout_s: float = 20.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.group: Any = None
        self.group_id: str | None = None
        self.connect_reply: httpx.Response | None = None

    def connect(self) -> httpx.Response:
        store = host_store("127.0.0.1", 0, self.timeout_s)
        self.group_id = uuid.uuid4().hex
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["group"] = open_group("", 0, self.group_id, self.timeout_s, "gloo", store)
            except Exception as exc:  # the engine refused: the test looks at its reply
                box["error"] = exc

        joiner = threading.Thread(target=join, daemon=True)
        joiner.start()
        body = {"group_id": self.group_id, "init_method": f"tcp://127.0.0.1:{store.port}"}
        r = httpx.post(f"{self.url}{Routes.COLLECTIVE_CONNECT}", json=body, headers=ADMIN, timeout=120)
        joiner.join(self.timeout_s + 5)
        self.store, self.group = store, box.get("group")
        self.connect_reply = r
        return r

    def staged(self, snap: Any, version_id: str | None = None) -> Staged:
        s = Staged(self.url, snap, version_id)
        # the begin names this trainer's group, as CollectiveTransport's does
        s.begin_req = s.begin_req.model_copy(update={"transport": "collective", "channel": self.group_id})
        return s

    def send(
        self,
        s: Staged,
        bucket: Any,
        *,
        data: bytes | None = None,
        announce: int | None = None,
        index: int | None = None,
    ) -> None:
        """Broadcast one bucket: its frame (``announce``: another byte count; ``index``: another
        bucket), then its tensor bytes (``data``: other bytes)."""
        body = tensor_bytes(bucket.payload) if data is None else data
        frame = Frame(
            index=bucket.spec.index if index is None else index,
            nbytes=len(body) if announce is None else announce,
            tag=token_tag(s.attempt),
        )
        broadcast(self.group, as_tensor(frame.encode()))
        if body:
            broadcast(self.group, as_tensor(body))

    def ack(self, s: Staged, bucket: Any, index: int | None = None) -> httpx.Response:
        meta = ReceiveBucketMeta(
            lora_name=s.name,
            attempt_token=s.attempt,
            index=bucket.spec.index if index is None else index,
            sha256=bucket.sha256,
            transport="collective",
        )
        return httpx.post(
            f"{self.url}{Routes.RECEIVE_BUCKET}",
            content=b"",
            headers={**meta.to_headers(), **ADMIN},
            timeout=120,
        )

    def publish(self, s: Staged) -> dict:
        r = s.begin()
        assert r.status_code == 200 and r.json()["state"] == "PREPARED", r.text
        for b in s.buckets():
            self.send(s, b)
            r = self.ack(s, b)
            assert r.status_code == 200 and r.json() == {
                "index": b.spec.index,
                "accepted": True,
                "duplicate": False,
            }
        r = s.end()
        assert r.status_code == 200, r.text
        return r.json()


def main() -> None:
    """A trainer that stops after ``sent`` buckets and waits for its SIGKILL."""
    args = json.loads(sys.argv[1])
    trainer = GroupTrainer(args["url"])
    r = trainer.connect()
    assert r.status_code == 200, r.text
    s = trainer.staged(snapshot_of(Path(args["adapter_dir"])), args["version_id"])
    s.attempt = args["attempt"]
    s.begin_req = s.begin_req.model_copy(update={"attempt_token": args["attempt"]})
    r = s.begin()
    assert r.status_code == 200, r.text
    for b in s.buckets()[: args["sent"]]:
        trainer.send(s, b)
    print("SENT", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
