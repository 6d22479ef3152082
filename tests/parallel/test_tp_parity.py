"""Tensor parallelism on CPU (gloo, 2 ranks, fp32, greedy) gives token for token what one
rank gives, on the built-in tiny models and on checkpoints written by `transformers`, with
prefix caching, chunked prefill and preemption all happening (the counters say so)."""

from __future__ import annotations

import random

import pytest
from helpers.checkpoints import write_checkpoint

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.llm import LLM

NEW_TOKENS = 12
BUDGET = 64  # tokens per step: the longer prompts are prefilled in chunks
# 14 blocks of 16 tokens cannot hold the batch: sequences are preempted and recomputed
FLAGS = dict(enable_prefix_caching=True, max_num_batched_tokens=BUDGET, num_kv_blocks=14)
# tiny-llama fp32 on one rank: 2 KV heads x 32 dims x 16 slots x 4 B x 2 (K, V) x 2 layers
TINY_BLOCK_BYTES = 2 * 32 * 16 * 4 * 2 * 2
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
    """Gives 8 prompts of 3 to 120 tokens, every third one behind a shared 40-token prefix."""
    rng = random.Random(5)
    shared = [rng.randrange(5, 1000) for _ in range(40)]
    out = []
    for i in range(8):
        tail = [rng.randrange(5, 1000) for _ in range(rng.randrange(3, 80))]
        out.append(shared + tail if i % 3 == 0 else tail)
    return out


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list]:
    """Gives (greedy continuations, prompt logprobs of the first two prompts)."""
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, greedy)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    scored = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2,
                                                      prompt_logprobs=3, logprobs=3))
    return [o.outputs[0].token_ids for o in outputs], [o.prompt_logprobs for o in scored]


def assert_close_logprobs(got: list, want: list) -> None:
    for got_prompt, want_prompt in zip(got, want, strict=True):
        for g, w in zip(got_prompt, want_prompt, strict=True):
            if w is None:
                assert g is None
                continue
            assert list(g) == list(w)  # the same top tokens, in the same order
            for token in w:
                assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)


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
