"""What the plugin's request hooks cost, measured inside the engine (off unless asked for).

With ``SGLANG_LORA_VERSIONS_HOOK_TIMING=1`` every hook is registered wrapped in a timer that
counts the hook's own time: the time spent in the hook minus the time spent in the upstream
function it wraps (for AROUND hooks, including the upstream's waits and anything the event loop
ran meanwhile, which cancel out because both windows contain them). ``GET /lora_versions/hook_timing``
returns the totals. Off, nothing is wrapped and the hooks cost exactly what they cost.

The wrapping itself adds a little (an extra generator level for the streaming hook); it is
counted as the hook's, so the figure errs high.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from sglang_ext.settings import HOOK_TIMING_ENV, switch


def enabled() -> bool:
    return switch(HOOK_TIMING_ENV)


@dataclass
class HookCost:
    calls: int = 0
    own_ns: int = 0


_COSTS: dict[str, HookCost] = {}
_LOCK = threading.Lock()


def record(name: str, own_ns: int) -> None:
    with _LOCK:
        cost = _COSTS.setdefault(name, HookCost())
        cost.calls += 1
        cost.own_ns += max(own_ns, 0)


def snapshot() -> dict[str, dict[str, float]]:
    with _LOCK:
        return {
            name: {
                "calls": c.calls,
                "own_ns": c.own_ns,
                "mean_us": c.own_ns / c.calls / 1e3 if c.calls else 0.0,
            }
            for name, c in sorted(_COSTS.items())
        }


def reset() -> None:
    with _LOCK:
        _COSTS.clear()


# ------------------------------------------------------------------------------------- wrapping


def timed(hook: Callable[..., Any], kind: str, name: str) -> Callable[..., Any]:
    """``hook`` wrapped to record its own time under ``name`` (same calling convention)."""
    if kind == "AROUND":
        return _timed_around(hook, name)
    if inspect.iscoroutinefunction(hook):

        @functools.wraps(hook)
        async def timed_coroutine(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return await hook(*args, **kwargs)
            finally:
                record(name, time.perf_counter_ns() - t0)

        return timed_coroutine

    @functools.wraps(hook)
    def timed_call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return hook(*args, **kwargs)
        finally:
            record(name, time.perf_counter_ns() - t0)

    return timed_call


def _timed_original(original: Callable[..., Any], inner: list[int]) -> Callable[..., Any]:
    """``original`` with the time spent in it (or in awaiting / iterating what it returns) added
    to ``inner[0]``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            result = original(*args, **kwargs)
        finally:
            inner[0] += time.perf_counter_ns() - t0
        if inspect.isawaitable(result):
            return _timed_await(result, inner)
        if inspect.isasyncgen(result):
            return _timed_agen(result, inner)
        return result

    return call


async def _timed_await(awaitable: Any, inner: list[int]) -> Any:
    t0 = time.perf_counter_ns()
    try:
        return await awaitable
    finally:
        inner[0] += time.perf_counter_ns() - t0


async def _timed_agen(agen: Any, inner: list[int]) -> AsyncIterator[Any]:
    """Iterate ``agen``, adding the time spent inside it (each step and the close) to ``inner[0]``."""
    try:
        while True:
            t0 = time.perf_counter_ns()
            try:
                item = await agen.__anext__()
            except StopAsyncIteration:
                return
            finally:
                inner[0] += time.perf_counter_ns() - t0
            yield item
    finally:
        t0 = time.perf_counter_ns()
        try:
            await agen.aclose()
        finally:
            inner[0] += time.perf_counter_ns() - t0


def _timed_around(hook: Callable[..., Any], name: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(hook):

        @functools.wraps(hook)
        async def timed_agen_hook(original: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            inner, own = [0], [0]
            timed_hook = _timed_agen(hook(_timed_original(original, inner), *args, **kwargs), own)
            try:
                async for item in timed_hook:
                    yield item
            finally:
                await timed_hook.aclose()  # a consumer that stops early: close the hook (it closes upstream)
                record(name, own[0] - inner[0])

        return timed_agen_hook

    if inspect.iscoroutinefunction(hook):

        @functools.wraps(hook)
        async def timed_coroutine_hook(original: Any, *args: Any, **kwargs: Any) -> Any:
            inner = [0]
            t0 = time.perf_counter_ns()
            try:
                return await hook(_timed_original(original, inner), *args, **kwargs)
            finally:
                record(name, time.perf_counter_ns() - t0 - inner[0])

        return timed_coroutine_hook

    @functools.wraps(hook)
    def timed_call_hook(original: Any, *args: Any, **kwargs: Any) -> Any:
        inner = [0]
        t0 = time.perf_counter_ns()
        try:
            return hook(_timed_original(original, inner), *args, **kwargs)
        finally:
            record(name, time.perf_counter_ns() - t0 - inner[0])

    return timed_call_hook
