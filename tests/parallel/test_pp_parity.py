"""Pipeline parallelism on CPU (gloo, fp32, greedy) gives token for token what one rank
gives, on the built-in tiny models and on checkpoints written by `transformers`, with
prefix caching, chunked prefill and preemption all happening (the counters say so), and
with two batches in the pipeline at once (the stages overlap)."""

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

from kvpilot.engine.llm import LLM

# name -> (model: a built-in name or an HF family with overrides, parallel flags)
CASES = {
    "tiny-llama": ("tiny-llama", {"pipeline_parallel_size": 2}),
    "tiny-qwen3": ("tiny-qwen3", {"pipeline_parallel_size": 2}),  # q/k norms
    "tiny-mixtral": ("tiny-mixtral", {"pipeline_parallel_size": 2}),
    # 3 layers over 2 stages (2 + 1); the last stage reads its tied head from the embedding
    "hf-llama-tied-3-layers": ("llama-tied:num_hidden_layers=3", {"pipeline_parallel_size": 2}),
    # 4 ranks: each stage's two TP ranks receive from their peers in the stage before
    "tiny-llama-tp2-pp2": ("tiny-llama", {"pipeline_parallel_size": 2,
                                          "tensor_parallel_size": 2}),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return parity_prompts()


@pytest.mark.parametrize("case", list(CASES))
def test_pp2_matches_one_rank(case, prompts, tiny_checkpoints, tmp_path):
    model, parallel = CASES[case]
    if ":" in model:  # a family with config overrides, written for this case
        family, override = model.split(":")
        key, value = override.split("=")
        model = str(write_checkpoint(tmp_path, family, **{key: int(value)}))
    elif not model.startswith("tiny-"):
        model = str(tiny_checkpoints(model))
    flags = dict(FLAGS)
    if case == "tiny-llama":  # a memory budget instead: each stage holds half the layers
        flags = {**flags, "num_kv_blocks": None, "kv_cache_memory": str(14 * TINY_BLOCK_BYTES)}
    assert max(len(p) for p in prompts) > BUDGET  # so prefill is chunked
    single = LLM(model, **flags)
    want, want_logprobs = run(single, prompts)
    want_stats = single.get_stats()
    llm = LLM(model, **flags, **parallel)
    try:
        got, got_logprobs = run(llm, prompts)
        stats = llm.get_stats()
        in_flight = llm.engine.runner.max_in_flight  # type: ignore[attr-defined]
    finally:
        llm.engine.shutdown()
    assert got == want
    assert_close_logprobs(got_logprobs, want_logprobs)
    for s in (stats, want_stats):
        assert s.num_preemptions > 0 and s.prefix_cache_hits > 0
        assert s.num_free_blocks == s.num_total_blocks  # nothing leaked
    assert in_flight == 2  # a second batch entered the pipe before the first came back
    if case == "tiny-llama":
        assert want_stats.num_total_blocks == 14
        assert stats.num_total_blocks == 28  # each stage caches its own layers only
