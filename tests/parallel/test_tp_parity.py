"""Tensor parallelism on CPU (gloo, 2 ranks, fp32, greedy) gives token for token what one
rank gives, on the built-in tiny models and on checkpoints written by `transformers`, with
prefix caching, chunked prefill and preemption all happening (the counters say so)."""

from __future__ import annotations

import pytest
from helpers.checkpoints import write_checkpoint
from helpers.parity import (
    BUDGET,
    FLAGS,
    TINY_BLOCK_BYTES,
    assert_close_logprobs,
    parity_prompts,
    run,
)

from kvpilot.engine.entrypoints.llm import LLM

# name -> (model: a built-in name or an HF family, extra flags for both engines, TP=2 flags)
CASES = {
    "tiny-llama": ("tiny-llama", {}, {}),
    # async scheduling: the in-flight sampled tokens reach the worker for its patches
    "tiny-qwen3-async": ("tiny-qwen3", {"async_scheduling": "on"}, {}),
    "tiny-mixtral-ep1": ("tiny-mixtral", {}, {}),
    "tiny-mixtral-ep2": ("tiny-mixtral", {}, {"expert_parallel_size": 2}),
    "hf-llama-bias": ("llama-bias", {}, {}),  # row-parallel o_proj and down_proj biases
    "hf-qwen2": ("qwen2", {}, {}),
    "hf-mixtral-ep2": ("mixtral", {}, {"expert_parallel_size": 2}),
    # 1021 rows do not split in two: the last rank's vocabulary slice is padded; tied head
    "hf-llama-tied-odd-vocab": ("llama-tied:vocab_size=1021", {}, {}),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return parity_prompts()


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_one_rank(case, prompts, tiny_checkpoints, tmp_path):
    model, flags, tp_flags = CASES[case]
    if ":" in model:  # a family with config overrides, written for this case
        family, override = model.split(":")
        key, value = override.split("=")
        model = str(write_checkpoint(tmp_path, family, **{key: int(value)}))
    elif not model.startswith("tiny-"):
        model = str(tiny_checkpoints(model))
    flags = {**FLAGS, **flags}
    if case == "tiny-llama":  # a memory budget instead: each rank holds half the KV heads
        flags = {**flags, "num_kv_blocks": None, "kv_cache_memory": str(14 * TINY_BLOCK_BYTES)}
    assert max(len(p) for p in prompts) > BUDGET  # so prefill is chunked
    single = LLM(model, **flags)
    want, want_logprobs = run(single, prompts)
    want_stats = single.get_stats()
    llm = LLM(model, tensor_parallel_size=2, **flags, **tp_flags)
    try:
        got, got_logprobs = run(llm, prompts)
        stats = llm.get_stats()
    finally:
        llm.engine.shutdown()
    assert got == want
    assert_close_logprobs(got_logprobs, want_logprobs)
    for s in (stats, want_stats):
        assert s.num_preemptions > 0 and s.prefix_cache_hits > 0
        assert s.num_free_blocks == s.num_total_blocks  # nothing leaked
    if case == "tiny-llama":
        assert want_stats.num_total_blocks == 14
        assert stats.num_total_blocks == 28  # KV capacity grows with TP
