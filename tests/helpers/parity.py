"""What the parallel-engine parity tests share: the prompts, the greedy run, and the
comparison of prompt logprobs (a parallel engine gives token for token the single rank's
output, and its logprobs within float32 reduction order)."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.entrypoints.llm import LLM

NEW_TOKENS = 12
BUDGET = 64  # tokens per step: the longer prompts are prefilled in chunks
# 14 blocks of 16 tokens cannot hold the batch: sequences are preempted and recomputed
FLAGS = dict(enable_prefix_caching=True, max_num_batched_tokens=BUDGET, num_kv_blocks=14)
# tiny-llama fp32 on one rank: 2 KV heads x 32 dims x 16 slots x 4 B x 2 (K, V) x 2 layers
TINY_BLOCK_BYTES = 2 * 32 * 16 * 4 * 2 * 2


def parity_prompts() -> list[list[int]]:
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
