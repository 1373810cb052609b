"""Child process of test_store_crash's group-commit case: THREADS threads run session lifecycles
(bind_first, begin_close, close_and_release, each on its own session keys) concurrently through
one durable store, so calls are decided in order and committed in groups.

After each call returns, the thread appends ``<thread> <session> <op>`` to the ack file (one
``write`` of a whole line, flushed): a line there is an acknowledged answer. Every few hundred
calls the process writes ``commits <n> calls <m>`` (groups really formed: n < m).
Usage: _group_crash_child.py DB ACKFILE THREADS
"""

from __future__ import annotations

import os
import sys
import threading

from _rg_helpers import ENGINES, EPOCH, Publisher, sk

from relax_glue.store import DurableRegistry

OPS = ("bind_first", "begin_close", "close_and_release")


def main() -> None:
    db, ack_path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = DurableRegistry.open(db, EPOCH, ENGINES, 2, synchronous="FULL")
    Publisher(store).publish("A")
    fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, b"open\n")
    calls = [0]

    def run(t: int) -> None:
        i = 0
        while True:
            for op in OPS:
                getattr(store, op)(sk(f"t{t}.{i}"))
                os.write(fd, f"{t} {i} {op}\n".encode())  # O_APPEND: one whole line per write
                calls[0] += 1
                if calls[0] % 200 == 0:
                    os.write(fd, f"commits {store.commits} calls {calls[0]}\n".encode())
            i += 1

    for t in range(threads):
        threading.Thread(target=run, args=(t,), daemon=True).start()
    threading.Event().wait()


if __name__ == "__main__":
    main()
