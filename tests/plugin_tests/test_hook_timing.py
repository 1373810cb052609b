"""The hook timer counts a hook's own time, not the time of the upstream function it wraps, and
changes nothing else: results, exceptions and the calling convention pass through."""

from __future__ import annotations

import asyncio
import time

import pytest

from sglang_ext import hook_timing


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


@pytest.fixture(autouse=True)
def fresh() -> None:
    hook_timing.reset()


def own_ms(name: str) -> float:
    return hook_timing.snapshot()[name]["own_ns"] / 1e6


async def test_an_around_coroutine_hook_is_charged_its_own_time_only() -> None:
    async def original(x: int) -> int:
        await asyncio.sleep(0.05)  # upstream waiting: not the hook's
        busy(60)  # upstream working: not the hook's either
        return x + 1

    async def hook(orig, x: int) -> int:
        busy(5)
        return await orig(x) * 10

    timed = hook_timing.timed(hook, "AROUND", "h")
    assert await timed(original, 1) == 20
    # bounds wide enough for a loaded machine; counting upstream would give >= 60
    assert 4 <= own_ms("h") < 45, own_ms("h")


async def test_an_around_async_generator_hook_is_charged_per_item_and_at_close() -> None:
    async def original(n: int):
        for i in range(n):
            await asyncio.sleep(0.01)
            busy(15)
            yield i

    async def hook(orig, n: int):
        busy(3)
        agen = orig(n)
        try:
            async for x in agen:
                yield x * 2
        finally:
            await agen.aclose()

    timed = hook_timing.timed(hook, "AROUND", "g")
    assert [x async for x in timed(original, 4)] == [0, 2, 4, 6]
    assert 2.5 <= own_ms("g") < 40, own_ms("g")  # upstream alone is >= 60


def test_before_and_sync_around_hooks_pass_results_and_errors_through() -> None:
    def before(x: int) -> None:
        busy(2)
        if x < 0:
            raise ValueError("refused")

    timed = hook_timing.timed(before, "BEFORE", "b")
    assert timed(1) is None
    with pytest.raises(ValueError, match="refused"):
        timed(-1)
    assert hook_timing.snapshot()["b"]["calls"] == 2

    def original(x: int) -> int:
        busy(30)
        return x

    def around(orig, x: int) -> int:
        return orig(x) + 1

    assert hook_timing.timed(around, "AROUND", "s")(original, 1) == 2
    assert own_ms("s") < 20


async def test_a_replace_coroutine_hook_is_charged_whole() -> None:
    async def replace(x: int) -> int:
        busy(3)
        return x

    assert await hook_timing.timed(replace, "REPLACE", "r")(7) == 7
    assert own_ms("r") >= 2.5


async def test_a_consumer_that_stops_early_closes_the_hook_and_its_upstream() -> None:
    closed = []

    async def original():
        try:
            for i in range(100):
                yield i
        finally:
            closed.append("original")

    async def hook(orig):
        agen = orig()
        try:
            async for x in agen:
                yield x
        finally:
            await agen.aclose()
            closed.append("hook")

    gen = hook_timing.timed(hook, "AROUND", "early")(original)
    assert await gen.__anext__() == 0
    await gen.aclose()
    assert closed == ["original", "hook"] and hook_timing.snapshot()["early"]["calls"] == 1
