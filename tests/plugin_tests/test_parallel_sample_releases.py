"""The LoRA counts of a parallel request (n > 1) whose samples end differently, on SGLang's own
objects: the real ``LoRARegistry`` (its per-adapter counter), the real
``TokenizerManager._release_lora_once`` wrapped by the plugin's ``release_only_what_was_acquired``
as the engine runs it, ``ReqState`` entries shaped as 0.5.23's ``_handle_batch_request`` makes
them (the prompt's state handed over, the prefix request borrowing the samples' references, one
state per sample holding one count each). Whatever mix of finished and aborted samples, and however
many times a state's release is asked for (an abort, then the finish), every count taken is
released exactly once and nothing is released for what was never acquired: the version's counter
returns to 0, so its unload can happen, and never goes below it."""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
from typing import Any

import pytest
from sglang.srt.lora.lora_registry import LoRARef, LoRARegistry

from sglang_ext import lora_registry_patch as upstream
from sglang_ext.tokenizer_hooks import release_only_what_was_acquired

NAME = "relax_policy_lora@t1-7-abcdefabcdef"
N = 3


class Engine:
    def __init__(self) -> None:
        cls = upstream.symbol("TokenizerManager")
        self.tm = tm = cls.__new__(cls)
        tm.enable_lora = True
        tm.lora_registry = LoRARegistry()
        tm._lora_release_tasks = set()
        self.tasks: list[asyncio.Task] = []
        wrapped = functools.partial(release_only_what_was_acquired, cls._release_lora_once, tm)

        def release(state: Any) -> None:
            task = wrapped(state)
            if task is not None:
                self.tasks.append(task)

        self.release = release

    async def start(self) -> str:
        ref = LoRARef(lora_name=NAME, lora_path="/adapters/x")
        await self.tm.lora_registry.register(ref)
        return ref.lora_id

    def count(self, lora_id: str) -> int:
        return self.tm.lora_registry._counters[lora_id].value()

    async def settled(self) -> None:
        """Every release task done, none failed (a failed one is a count never given back)."""
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        assert [r for r in results if isinstance(r, BaseException)] == []


def state(obj: Any, *, released: bool = False) -> Any:
    return upstream.symbol("ReqState")([], False, asyncio.Event(), obj, None, lora_released=released)


async def parallel_request(e: Engine) -> tuple[Any, Any, list[Any]]:
    """The states of one prompt with N samples after the samples were sent: the prompt's
    (handed over to the samples, released), the prefix request's (borrowing, no lora_id) and
    one per sample, each with the id of one of the N counts the acquire took."""
    obj = upstream.symbol("GenerateReqInput")(input_ids=[3, 1, 4], lora_path=NAME, sampling_params={"n": N})
    obj.normalize_batch_and_arguments()
    assert obj.lora_path == [NAME] * N  # normalisation: one entry per sample, one count each
    obj.lora_id = await e.tm.lora_registry.acquire(obj.lora_path)
    prompt = state(obj[0], released=True)
    prefix_obj = copy.copy(obj[0])
    prefix_obj.lora_path, prefix_obj.lora_id = None, None
    samples = [state(copy.copy(obj[0])) for _ in range(N)]
    return prompt, state(prefix_obj), samples


@pytest.mark.parametrize("aborted", [set(), {0}, {1}, {2}, {0, 2}, {0, 1, 2}])
async def test_every_samples_count_is_released_once_whichever_samples_were_aborted(aborted: set[int]) -> None:
    e = Engine()
    lora_id = await e.start()
    prompt, prefix, samples = await parallel_request(e)
    assert e.count(lora_id) == N and all(s.obj.lora_id == lora_id for s in samples)
    e.release(prefix)  # the prefix request's end: it borrowed, it gives nothing back
    e.release(prompt)  # the prompt state was handed over before the samples were sent
    await e.settled()
    assert e.count(lora_id) == N
    for i in sorted(aborted):  # an abort releases its sample's count at once ...
        e.release(samples[i])
    await e.settled()
    assert e.count(lora_id) == N - len(aborted)
    for s in samples:  # ... and every sample's end asks again (the aborted ones included)
        e.release(s)
        e.release(s)
    await e.settled()
    assert e.count(lora_id) == 0  # the version may be unloaded now, and the count never went below


async def test_a_request_refused_before_its_acquire_releases_nothing_among_live_samples() -> None:
    e = Engine()
    lora_id = await e.start()
    _, _, samples = await parallel_request(e)
    refused = upstream.symbol("GenerateReqInput")(input_ids=[3], lora_path=NAME)
    refused.normalize_batch_and_arguments()  # names the version, never acquired it (lora_id None)
    for order in itertools.permutations([state(refused), samples[0]]):
        for s in order:
            e.release(s)
    await e.settled()
    assert e.count(lora_id) == N - 1  # only the sample's own count came back
