"""The late-sample abort hook (``parallel_sampling.abort_samples_sent_after_their_request_was_aborted``)
without an engine: SGLang 0.5.23's ``_handle_batch_request`` sends a parallel request's samples
only after its prefix request has finished, so an abort of the request that came before (or
between two sample sends) reached only the states alive then. Each sample of an aborted prompt
sent later must be aborted right after its send (the scheduler gets both in order); every other
send is left alone, and the record of aborted prompts is dropped once none of their states lives.

Real SGLang objects where the hooks read them: a ``TokenizerManager`` (its stock
``abort_request``, whose only exit here is ``_dispatch_to_scheduler``), ``ReqState`` entries in
its ``rid_to_state``, ``GenerateReqInput`` normalised by SGLang and its own ``regenerate_rid``
(through the plugin's sample-rid hook, as the engine runs it). The send the hook wraps stands in
for ``_send_one_request``: it records the dispatch, as the stock one would."""

from __future__ import annotations

import asyncio
import copy
import functools
import types
from typing import Any

from sglang.srt.managers.io_struct import AbortReq

from sglang_ext import lora_registry_patch as upstream
from sglang_ext.parallel_sampling import (
    abort_every_sample_of_a_parallel_request,
    abort_samples_sent_after_their_request_was_aborted,
    sample_rids_under_the_request_rid,
)


class Engine:
    """A TokenizerManager with the two abort hooks wrapped around it as the plugin wraps them,
    and one log of what reaches the scheduler: ("send", rid) and ("abort", rid)."""

    def __init__(self) -> None:
        cls = upstream.symbol("TokenizerManager")
        self.tm = tm = cls.__new__(cls)
        tm.rid_to_state = {}
        tm.enable_metrics = False
        self.log: list[tuple[str, str]] = []
        tm._dispatch_to_scheduler = self._dispatch
        # AROUND abort_request, as installed: the late-sample hook calls self.abort_request
        tm.abort_request = functools.partial(abort_every_sample_of_a_parallel_request, cls.abort_request, tm)

    def _dispatch(self, req: Any) -> None:
        assert isinstance(req, AbortReq) and not req.abort_all, "only aborts by rid reach here"
        self.log.append(("abort", req.rid))

    async def _stock_send(self, tm: Any, tokenized_obj: Any) -> str:
        self.log.append(("send", tokenized_obj.rid))
        return f"sent {tokenized_obj.rid}"

    def start(self, rid: str) -> None:
        """_init_req_state: a live state under ``rid``."""
        obj = upstream.symbol("GenerateReqInput")(input_ids=[3, 1, 4], rid=rid)
        self.tm.rid_to_state[rid] = upstream.symbol("ReqState")([], False, asyncio.Event(), obj, None)

    def end(self, rid: str) -> None:
        del self.tm.rid_to_state[rid]

    async def send(self, rid: str) -> Any:
        """_send_one_request through the hook (its state made first, as SGLang does)."""
        tokenized = types.SimpleNamespace(rid=rid)  # the hook reads only the rid
        return await abort_samples_sent_after_their_request_was_aborted(self._stock_send, self.tm, tokenized)

    def abort(self, rid: str) -> None:
        self.tm.abort_request(rid=rid)

    @property
    def remembered(self) -> dict[str, None]:
        return getattr(self.tm, "_lora_versions_aborted_parallel_prompts", None) or {}


def sample_rids(rid: str, n: int) -> tuple[str, str, list[str]]:
    """The rids SGLang gives a single prompt with ``n`` samples: the prompt's, the prefix
    request's, each sample's (normalisation, then regenerate_rid under the plugin's hook)."""
    obj = upstream.symbol("GenerateReqInput")(input_ids=[3, 1, 4], rid=rid, sampling_params={"n": n})
    obj.normalize_batch_and_arguments()
    prompt = obj[0]

    def regenerated() -> str:
        tmp = copy.copy(prompt)
        return sample_rids_under_the_request_rid(type(tmp).regenerate_rid, tmp)

    return prompt.rid, regenerated(), [regenerated() for _ in range(n)]


async def test_samples_sent_after_their_request_was_aborted_are_aborted_right_after_their_send() -> None:
    e = Engine()
    prompt, prefix, samples = sample_rids("turn-3", 3)
    e.start(prompt)
    e.start(prefix)
    await e.send(prefix)
    e.abort("turn-3")  # while the prefix request runs: the samples have no state yet
    assert e.log == [("send", prefix), ("abort", prompt), ("abort", prefix)]
    e.end(prefix)
    e.end(prompt)  # _handle_batch_request drops the prompt's state and makes the first sample's
    e.log.clear()
    for s in samples:
        e.start(s)
        assert await e.send(s) == f"sent {s}"  # the stock send's result is passed on
    # each sample is aborted after its own send, never before it (an abort that overtakes its
    # request is ignored by the scheduler, and the sample would decode to its end)
    assert e.log == [(op, s) for s in samples for op in ("send", "abort")]


async def test_an_abort_between_two_sample_sends_reaches_the_ones_sent_later() -> None:
    e = Engine()
    _, _, samples = sample_rids("t", 3)
    e.start(samples[0])
    await e.send(samples[0])
    e.abort("t")  # one sample alive: aborted now; the two still to come after their sends
    for s in samples[1:]:
        e.start(s)
        await e.send(s)
    assert e.log == [("send", samples[0]), ("abort", samples[0])] + [
        (op, s) for s in samples[1:] for op in ("send", "abort")
    ]


async def test_other_requests_sent_meanwhile_are_left_alone() -> None:
    e = Engine()
    prompt, _, samples = sample_rids("r", 2)
    _, _, others = sample_rids("q", 2)  # another parallel request
    _, _, similar = sample_rids("r_1", 2)  # a request whose rid starts like r's second prompt
    e.start(samples[0])
    e.abort("r")
    e.log.clear()
    for rid in [others[0], similar[0], "r_1", "plain", prompt]:
        e.start(rid)
        await e.send(rid)
    # a request whose own rid is the aborted prompt's is not a sample of it (n = 1, its own rid)
    assert e.log == [("send", r) for r in [others[0], similar[0], "r_1", "plain", prompt]]


async def test_nothing_is_aborted_and_nothing_is_remembered_without_an_aborted_parallel_request() -> None:
    e = Engine()
    _, _, samples = sample_rids("r", 2)
    for s in samples:
        e.start(s)
        await e.send(s)
    e.abort(samples[0])  # one sample's own rid: that sample alone, through the stock path
    assert e.log == [("send", samples[0]), ("send", samples[1]), ("abort", samples[0])]
    assert e.remembered == {}


async def test_an_aborted_prompt_is_forgotten_once_none_of_its_states_lives() -> None:
    e = Engine()
    prompt, _, samples = sample_rids("r", 2)
    e.start(samples[0])
    e.abort("r")
    e.start(samples[1])
    await e.send(samples[1])
    assert e.remembered == {prompt: None}  # a state of r still lives: a later sample may come
    for s in samples:
        e.end(s)
    e.start("next")
    await e.send("next")  # the next send of any request drops what ended
    assert e.remembered == {}
    # a new request that reuses the rid later is not aborted for the old one's sake
    _, _, again = sample_rids("r", 2)
    e.log.clear()
    e.start(again[0])
    await e.send(again[0])
    assert e.log == [("send", again[0])]
