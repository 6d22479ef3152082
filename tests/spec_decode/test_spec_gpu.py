"""Speculative decoding on CUDA (Triton attention, CUDA graphs for plain and draft decodes):
greedy fp32 output identical to plain decoding for n-gram and a draft model."""

from __future__ import annotations

import pytest

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 6, 7, 8] * 6, list(range(100, 140)), [9, 10, 11] * 9 + [12]]


def greedy(spec: str | None) -> tuple[list[list[int]], int]:
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="tiny-llama", device="cuda", dtype="float32", num_kv_blocks=256,
        speculative_config=spec))
    engine.stream_outputs = False
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=40, temperature=0,
                                                          ignore_eos=True))
    out = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.completions[0].token_ids)
    return [out[str(i)] for i in range(len(PROMPTS))], engine.get_stats().spec_decode_num_drafts


@pytest.mark.parametrize("spec", [
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}',
    '{"model": "tiny-llama", "num_speculative_tokens": 4}',
    '{"model": "tiny-qwen3", "num_speculative_tokens": 3}',
])
def test_greedy_output_is_unchanged_on_cuda(spec):
    plain, _ = greedy(None)
    fast, drafts = greedy(spec)
    assert fast == plain
    assert drafts > 0
