"""Random mixes of every request kind on tight pools: all finish, nothing leaks, limits hold.

Each seed draws engine flags (block size, pool, budget, caching, chunking, policy,
max_num_seqs) and 12 requests mixing n > 1, beam search, logprobs, prompt
logprobs, stop strings, min_tokens, seeds, shared prefixes and one abort. Seeds 7
and 14 once livelocked beam search on a pool too small for all beams at once.
"""

from __future__ import annotations

import random

import pytest
from core_helpers import Outputs

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine

MAX_STEPS = 2000


def draw_params(rng: random.Random, i: int) -> SamplingParams:
    p: dict = dict(max_tokens=rng.randint(1, 20), temperature=rng.choice([0, 0.7]),
                   ignore_eos=rng.random() < 0.5)
    kind = rng.random()
    if kind < 0.2:
        p["n"] = rng.randint(2, 3)
    elif kind < 0.35:
        p.update(beam_width=rng.randint(2, 3), temperature=0)
    if rng.random() < 0.3:
        p["logprobs"] = 2
    if rng.random() < 0.2:
        p["prompt_logprobs"] = 1
    if rng.random() < 0.3:
        p["stop"] = ["a", "e"]
    if rng.random() < 0.2:
        p["min_tokens"] = 3
    if rng.random() < 0.3:
        p["seed"] = i
    return SamplingParams(**p)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("seed", [7, 14, 15, 18])
def test_mixed_requests_on_tight_pools_all_finish(seed, async_scheduling):
    rng = random.Random(seed)
    engine = LLMEngine.from_engine_args(EngineArgs(async_scheduling=async_scheduling,
        model="tiny-llama", num_kv_blocks=rng.choice([12, 20, 64]),
        block_size=rng.choice([4, 16]), max_num_batched_tokens=rng.choice([8, 32, 512]),
        enable_prefix_caching=rng.random() < 0.5, enable_chunked_prefill=rng.random() < 0.8,
        scheduling_policy=rng.choice(["fcfs", "priority"]), max_model_len=256,
        max_num_seqs=rng.choice([2, 8, 64])))
    params: dict[str, SamplingParams] = {}
    for i in range(12):
        sp = draw_params(rng, i)
        prompt = [rng.randrange(5, 1000) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.3:
            prompt = list(range(10, 40)) + prompt[:5]
        engine.add_request(str(i), prompt, sp, priority=rng.randint(0, 3))
        params[str(i)] = sp
    outputs, done = Outputs(), {}
    for step in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        if step == 5:
            engine.abort_request(["0"])
        for delta in engine.step():
            out = outputs.add(delta)
            if out.finished:
                done[out.request_id] = out
    assert set(done) == set(params)
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    for rid, out in done.items():
        sp = params[rid]
        reasons = {c.finish_reason for c in out.outputs}
        if reasons & {"error", "abort"}:
            continue
        assert len(out.outputs) == max(sp.n, sp.beam_width)
        for c in out.outputs:
            assert len(c.token_ids) <= sp.max_tokens
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length" and sp.beam_width == 1:
                assert len(c.token_ids) == sp.max_tokens
