"""Greedy token ids equal HF transformers `generate` in every scheduling configuration."""

from __future__ import annotations

import pytest
from core_helpers import FAMILIES, NEW_TOKENS

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.entrypoints.llm import LLM

# name -> engine flags; 16 prompts of up to ~120 tokens plus 16 new tokens each
CONFIGS = {
    "cache-on-chunk16": dict(enable_prefix_caching=True, max_num_batched_tokens=16),
    "cache-on-chunk64": dict(enable_prefix_caching=True, max_num_batched_tokens=64),
    "cache-on-unlimited": dict(enable_prefix_caching=True, max_num_batched_tokens=8192),
    "cache-off-chunk16": dict(enable_prefix_caching=False, max_num_batched_tokens=16),
    "cache-off-unlimited": dict(enable_prefix_caching=False, max_num_batched_tokens=8192),
    # 14 blocks x 16 slots cannot hold 16 requests at once: preemption must happen
    "small-pool-cache-on": dict(enable_prefix_caching=True, max_num_batched_tokens=64,
                                num_kv_blocks=14),
    "small-pool-cache-off": dict(enable_prefix_caching=False, max_num_batched_tokens=8192,
                                 num_kv_blocks=14),
    # async scheduling (the CUDA default) forced on: placeholders patched on the device
    "small-pool-cache-on-async": dict(enable_prefix_caching=True, max_num_batched_tokens=64,
                                      num_kv_blocks=14, async_scheduling="on"),
    "cache-on-chunk16-async": dict(enable_prefix_caching=True, max_num_batched_tokens=16,
                                   async_scheduling="on"),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf(family, config, checkpoints, parity_prompts, hf_greedy):
    flags = {"num_kv_blocks": 256, **CONFIGS[config]}
    llm = LLM(str(checkpoints[family]), **flags)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(parity_prompts, params)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == hf_greedy[family]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # nothing leaked
    assert stats.generation_tokens == NEW_TOKENS * len(parity_prompts)
    if "small-pool" in config:
        assert stats.num_preemptions > 0
    if config.startswith("cache-on") and "unlimited" not in config:
        # the shared 40-token prefix was cached by an earlier step and reused
        # (with an unlimited budget every prompt is admitted in the first step)
        assert stats.prefix_cache_hits > 0
    if config.startswith("cache-off"):
        assert stats.prefix_cache_hits == 0
