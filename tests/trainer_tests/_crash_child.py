"""Child process of test_store_crash: applies a seeded op stream to a durable registry forever.

After every call returns (accepted or refused) it appends ``<index> <ok|CODE>`` to the ack file
and flushes it to the OS before the next call: a line in that file is an acknowledged answer.
The parent SIGKILLs this process at a random point.
Usage: _crash_child.py DB SEED ACKFILE [COMPACT_EVERY SESSION_WINDOW]
"""

from __future__ import annotations

import random
import sys

from _rg_helpers import ENGINES, EPOCH, random_ops

from lora_contract.errors import LoraVersionError
from relax_glue.store import DurableRegistry


def main() -> None:
    db, seed, ack_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    compaction = {}
    if len(sys.argv) > 4:
        compaction = {"compact_every": int(sys.argv[4]), "session_window": int(sys.argv[5])}
    store = DurableRegistry.open(db, EPOCH, ENGINES, 2, synchronous="FULL", **compaction)
    with open(ack_path, "w", buffering=1) as ack:
        ack.write("open\n")
        ack.flush()
        for index, (op, kwargs) in enumerate(random_ops(store, random.Random(seed))):
            try:
                getattr(store, op)(**kwargs)
                outcome = "ok"
            except LoraVersionError as exc:
                outcome = exc.code.value
            ack.write(f"{index} {outcome}\n")
            ack.flush()


if __name__ == "__main__":
    main()
