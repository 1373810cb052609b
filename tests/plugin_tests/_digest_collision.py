"""Two real snapshots whose digests share the 12 hex characters a ``lora_name`` carries.

A name fixes the digest only by its 48-bit prefix, so the engine's "exists here with another
digest" (VERSION_CONFLICT) is reachable through valid input exactly when two manifests collide on
that prefix. A birthday search finds such a pair in about 2^25 digests (a minute or two, once):
the two snapshots are fixture A with 6 bytes changed, the lowest mantissa byte of the last 6
elements of its last tensor (a change below 2e-5 of each value, every value stays finite). The
search ran once (``python tests/plugin_tests/_digest_collision.py``) and its two 48-bit values are
stored in ``PAIR``; :func:`colliding_snapshots` rebuilds both through ``Snapshot.from_tensors``
and refuses to hand them out unless they really collide, so a change of the fixture or of the
manifest's canonical form fails loudly (rerun the search) instead of testing nothing.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from lora_contract.identity import canonical_manifest_bytes, manifest_from_tensors
from lora_contract.names import DIGEST_PREFIX_LEN
from relax_glue.snapshot import Snapshot

VALUE_BYTES = 6  # 48 bits = the 12 hex characters of DIGEST_PREFIX_LEN
ITEMSIZE = 4  # float32: byte 0 of each little-endian element is its lowest mantissa byte
PAIR: tuple[int, int] = (32378487, 32988477)  # find_pair() on fixture A, 2^25 values


def _last_name(tensors: Mapping[str, torch.Tensor]) -> str:
    return sorted(tensors)[-1]  # the manifest lists tensors by name: its entry is the last one


def with_value(tensors: Mapping[str, torch.Tensor], value: int) -> dict[str, torch.Tensor]:
    """``tensors`` with ``value`` written into the lowest byte of the last tensor's last elements."""
    name = _last_name(tensors)
    t = tensors[name]
    assert t.dtype == torch.float32 and t.numel() >= VALUE_BYTES, (name, t.dtype)
    changed = t.detach().clone().contiguous()
    raw = changed.view(torch.uint8).reshape(-1)
    raw[-VALUE_BYTES * ITEMSIZE :: ITEMSIZE] = torch.tensor(
        list(value.to_bytes(VALUE_BYTES, "little")), dtype=torch.uint8
    )
    return {**tensors, name: changed}


def colliding_snapshots(
    config: Mapping, tensors: Mapping[str, torch.Tensor], *, max_bucket_bytes: int
) -> tuple[Snapshot, Snapshot]:
    """The two snapshots of ``PAIR``: equal digest prefixes, different digests (checked)."""
    one, two = (
        Snapshot.from_tensors(config, with_value(tensors, v), max_bucket_bytes=max_bucket_bytes) for v in PAIR
    )
    assert one.digest != two.digest and one.digest[:DIGEST_PREFIX_LEN] == two.digest[:DIGEST_PREFIX_LEN], (
        f"PAIR no longer collides ({one.digest} vs {two.digest}): the fixture or the manifest's "
        "canonical form changed; run `python tests/plugin_tests/_digest_collision.py` and store its pair"
    )
    return one, two


def _prefix_function(config: Mapping, tensors: Mapping[str, torch.Tensor]):
    """``value -> the digest's 48-bit prefix``, with both hashes resumed from a saved midstate (the
    value sits in the last bytes of the last tensor, whose sha256 sits at the manifest's end)."""
    name = _last_name(tensors)
    raw = bytes(tensors[name].detach().contiguous().view(torch.uint8).reshape(-1).numpy())
    head, tail = raw[: -VALUE_BYTES * ITEMSIZE], bytearray(raw[-VALUE_BYTES * ITEMSIZE :])
    tensor_mid = hashlib.sha256(head)
    manifest = manifest_from_tensors(config, tensors)
    canonical = canonical_manifest_bytes(manifest)
    old = manifest.entry(name).sha256.encode()
    assert canonical.count(old) == 1
    before, after = canonical.split(old)
    manifest_mid = hashlib.sha256(before)

    def prefix(value: int) -> int:
        tail[0::ITEMSIZE] = value.to_bytes(VALUE_BYTES, "little")
        th = tensor_mid.copy()
        th.update(tail)
        mh = manifest_mid.copy()
        mh.update(th.hexdigest().encode())
        mh.update(after)
        return int.from_bytes(mh.digest()[:VALUE_BYTES], "big")

    return prefix


def find_pair(config: Mapping, tensors: Mapping[str, torch.Tensor], count: int = 1 << 25) -> tuple[int, int]:
    """Birthday search over ``count`` values (2^25: a pair with probability 1 - e^-2, about 86%)."""
    import numpy as np

    prefix = _prefix_function(config, tensors)
    got = np.fromiter((prefix(v) for v in range(count)), dtype=np.uint64, count=count)
    order = np.argsort(got, kind="stable")
    ranked = got[order]
    hits = np.nonzero(ranked[1:] == ranked[:-1])[0]
    if len(hits) == 0:
        raise RuntimeError(f"no collision among {count} values; retry with a larger count")
    i = int(hits[0])
    return int(order[i]), int(order[i + 1])


if __name__ == "__main__":
    from lora_contract.protocol import read_peft_dir
    from lora_versions_dev.fixtures import ensure_fixtures

    cfg, base = read_peft_dir(Path(ensure_fixtures().adapter_dir("A")))
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 25
    a, b = find_pair(cfg, base, n)
    print(f"PAIR = ({a}, {b})")
