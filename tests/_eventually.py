"""Waiting in tests for a condition that another task or thread makes true: poll it, fail the test
with a message when it does not hold in time. One copy for every test (three modules each had their
own ``eventually``, two more the same loop under other names)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(
    pred: Callable[[], object], timeout: float = 3.0, poll_s: float = 0.002, what: str = "condition"
) -> None:
    """Yield to the event loop until ``pred()`` is true; the tasks under test run meanwhile.
    Times on the loop's clock (the one the code under test sleeps on)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, f"{what} not reached in time"
        await asyncio.sleep(poll_s)


def eventually_sync(
    pred: Callable[[], object], timeout: float = 5.0, poll_s: float = 0.001, what: str = "condition"
) -> None:
    """Sleep until ``pred()`` is true, for a condition another thread makes true."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached in time"
        time.sleep(poll_s)
