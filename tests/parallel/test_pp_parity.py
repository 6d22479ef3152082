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

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.entrypoints.llm import LLM

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


# what the driver's sampler does with the logits rows that come back from the last stage
SAMPLING = {
    "n2-greedy": SamplingParams(temperature=0, max_tokens=6, n=2, ignore_eos=True),
    "n3-seeded": SamplingParams(temperature=0.8, seed=3, max_tokens=6, n=3, ignore_eos=True),
    "beam3": SamplingParams(max_tokens=6, beam_width=3, ignore_eos=True),
    "penalties-logprobs": SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3,
                                         presence_penalty=0.5, logprobs=2, ignore_eos=True),
}


def test_pp2_sampling_options_match_one_rank(prompts):
    flags = dict(max_num_batched_tokens=32, num_kv_blocks=40)
    single = LLM("tiny-llama", **flags)
    llm = LLM("tiny-llama", pipeline_parallel_size=2, **flags)
    try:
        for name, params in SAMPLING.items():
            want = single.generate(prompts[:5], params)
            got = llm.generate(prompts[:5], params)
            assert [[c.token_ids for c in o.outputs] for o in got] == \
                [[c.token_ids for c in o.outputs] for o in want], name
            if params.logprobs:
                assert [o.outputs[0].logprobs is not None for o in got] == [True] * 5
    finally:
        llm.engine.shutdown()
