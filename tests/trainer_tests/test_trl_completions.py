"""A multi-turn completion as TRL gets it (relax_glue/trl/completions.py): the tool tokens masked
and their log-probabilities zeroed, the engine's log-probabilities checked against the sampled
tokens, one session group per prompt, sampling from TRL's config, and one rollout_func entry per
completion with a failed one masked."""

from __future__ import annotations

import pytest

from relax_glue.trl.completions import (
    CompletionRecord,
    Segment,
    assemble_completion,
    group_names,
    rollout_output,
    sampling_params,
    turn_logprobs,
)


def test_a_multi_turn_completion_masks_the_tool_tokens_and_zeroes_their_logprobs() -> None:
    segs = [Segment((5, 6), (-0.1, -0.2)), Segment((7, 8, 9)), Segment((10,), (-0.3,))]
    ids, lps, mask = assemble_completion(segs)
    assert ids == [5, 6, 7, 8, 9, 10]
    assert lps == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert mask == [1, 1, 0, 0, 0, 1]
    with pytest.raises(ValueError):
        assemble_completion([Segment((1, 2), (-0.1,))])


def test_engine_logprobs_must_name_the_sampled_tokens() -> None:
    reply = {"output_ids": [4, 9], "meta_info": {"output_token_logprobs": [[-0.5, 4, "a"], [-1.5, 9, "b"]]}}
    assert turn_logprobs(reply) == [-0.5, -1.5]
    with pytest.raises(ValueError):
        turn_logprobs({**reply, "output_ids": [4, 8]})


def test_one_group_per_prompt_run_shared_by_equal_prompts_of_one_step() -> None:
    chat = [{"role": "user", "content": "6 x 7?"}]
    other = [{"role": "user", "content": "days in a week?"}]
    names = group_names([chat, chat, other, other], step=3)
    assert names[0] == names[1] != names[2] == names[3]
    assert group_names([chat], step=4)[0] != names[0]  # another step, another group
    assert group_names(["plain text"], 3)[0].startswith("s3-")


def test_sampling_follows_trls_config() -> None:
    class Args:
        temperature, top_p, top_k, min_p, repetition_penalty = 0.9, 0.95, 0, None, 1.0

    p = sampling_params(Args(), 8, ignore_eos=True)
    assert p == {"temperature": 0.9, "top_p": 0.95, "top_k": -1, "max_new_tokens": 8, "ignore_eos": True}
    Args.top_k, Args.min_p = 20, 0.05
    p = sampling_params(Args(), 8)
    assert (p["top_k"], p["min_p"]) == (20, 0.05)


def test_rollout_output_gives_trl_one_entry_per_completion_and_masks_a_failed_one() -> None:
    ok = CompletionRecord(2, 0, 0, "g", "s0", [1, 2], bound_version="lora@e-step2-x", version_id="step2")
    ok.segments = [Segment((5,), (-0.1,)), Segment((7,)), Segment((6,), (-0.2,))]
    bad = CompletionRecord(2, 0, 1, "g", "s1", [1, 2], error="TurnOutcomeUnknown: lost")
    out = rollout_output([ok, bad], fallback_id=3)
    assert out["prompt_ids"] == [[1, 2], [1, 2]]
    assert out["completion_ids"] == [[5, 7, 6], [3]]
    assert out["env_mask"] == [[1, 0, 1], [0]]
    assert out["logprobs"] == [[-0.1, 0.0, -0.2], [0.0]]
    assert out["bound_version"] == ["lora@e-step2-x", None]
    assert out["version_id"] == ["step2", None]
    assert out["assistant_ids"] == [[5, 6], []]
    assert out["rollout_error"] == [None, "TurnOutcomeUnknown: lost"]
