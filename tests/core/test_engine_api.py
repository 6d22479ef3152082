"""The LLMEngine / LLM contract on tiny-llama: errors, abort, stops, seeds, n, logprobs, prefix hits."""

from __future__ import annotations

import re

import pytest
from core_helpers import run_engine

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.entrypoints.llm import LLM

PROMPT = list(range(100, 130))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-llama", num_kv_blocks=64, max_model_len=256)


@pytest.fixture
def engine() -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model="tiny-llama", num_kv_blocks=8,
                                                 max_model_len=256))


@pytest.mark.parametrize(("prompt", "params", "message"), [
    (PROMPT, SamplingParams(max_tokens=300), "max_model_len=256"),
    ([], SamplingParams(), "prompt is empty"),
    ([5, 99999], SamplingParams(), "prompt token ids must be in [0, 1024)"),
])
def test_add_request_rejects_bad_input(engine, prompt, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("r", prompt, params)
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("r", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="request_id='r' is already running"):
        engine.add_request("r", PROMPT, GREEDY)


def test_request_larger_than_the_pool_finishes_with_an_error(engine):
    # 8 blocks x 16 slots = 128 tokens; 30 + 120 needs 10 blocks
    engine.add_request("big", PROMPT, SamplingParams(max_tokens=120))
    engine.add_request("ok", PROMPT, GREEDY)
    done = run_engine(engine)
    assert done["big"].outputs[0].finish_reason == "error"
    assert "needs 10 KV blocks" in done["big"].error
    assert done["ok"].outputs[0].finish_reason == "length"


def test_abort_frees_blocks_and_reports_abort(engine):
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.get_stats().num_free_blocks < 8
    engine.abort_request(["a", "unknown"])
    (out,) = engine.step()
    assert out.finished and out.completions[0].finish_reason == "abort"
    assert engine.get_stats().num_free_blocks == 8
    assert not engine.has_unfinished_requests()


def test_second_request_computes_only_past_a_three_block_prefix(llm):
    shared = list(range(200, 248))  # three 16-token blocks
    before = llm.get_stats()
    llm.generate([[*shared, 1, 2, 3]], GREEDY)
    (second,) = llm.generate([[*shared, 4, 5]], GREEDY)
    after = llm.get_stats()
    assert second.num_cached_tokens == 48
    assert after.prefix_cache_hits - before.prefix_cache_hits == 48
    assert after.prefix_cache_queries - before.prefix_cache_queries == 51 + 50
    assert after.prompt_tokens - before.prompt_tokens == 51 + 2


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batched = llm.generate([PROMPT, [7, 8, 9], PROMPT], [other, other, params])
    assert batched[2].outputs[0].token_ids == alone
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=12, ignore_eos=True)
    assert llm.generate([PROMPT], reseeded)[0].outputs[0].token_ids != alone


def test_parallel_sampling_gives_n_completions(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert llm.get_stats().num_free_blocks == 64


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == greedy[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    held = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                 stop_token_ids=[stop_at], min_tokens=8))
    assert stop_at not in held[0].outputs[0].token_ids  # banned until min_tokens
    assert held[0].outputs[0].finish_reason == "length"


def test_stop_string_spanning_two_tokens(llm):
    greedy = llm.generate([PROMPT], GREEDY)[0].outputs[0]
    text = greedy.text
    # a stop string made of the last character of one token's text and the first of the next
    cuts = [len(llm.tokenizer.decode(greedy.token_ids[:i])) for i in range(1, 8)]
    cut = next(c for c in cuts if 0 < c < len(text) and text[c - 1:c + 1] not in text[:c])
    stop = text[cut - 1:cut + 1]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                stop=[stop]))[0].outputs[0]
    assert out.text == text[:cut - 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    (out,) = llm.generate([PROMPT], params)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert position[token].rank == 1  # greedy picks the most likely token
        assert 3 <= len(position) <= 4
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs, strict=True)))
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(PROMPT)
    assert all(PROMPT[i] in out.prompt_logprobs[i] for i in range(1, len(PROMPT)))


@pytest.mark.parametrize("mixed", [False, True])
def test_logprobs_zero_gives_only_the_sampled_token(llm, mixed):
    """logprobs=0 asks for the chosen token's logprob and no alternatives (OpenAI's meaning),
    alone in the batch or beside a request that wants alternatives."""
    zero = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    three = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3)
    outs = llm.generate([PROMPT, PROMPT] if mixed else [PROMPT], [zero, three] if mixed else zero)
    completion = outs[0].outputs[0]
    assert [list(p) for p in completion.logprobs] == [[t] for t in completion.token_ids]
    assert all(p[t].rank == 1 for t, p in zip(completion.token_ids, completion.logprobs,
                                              strict=True))


def test_text_prompts_and_outputs_in_order(llm):
    outs = llm.generate(["Hello there", "The quick brown fox"], GREEDY)
    assert [o.prompt for o in outs] == ["Hello there", "The quick brown fox"]
    assert all(o.finished and len(o.outputs[0].token_ids) == 8 for o in outs)
    assert outs[0].metrics.first_token_time >= outs[0].metrics.arrival_time


def test_preemption_keeps_seeded_parallel_samples_identical():
    """A pool too small for all requests preempts and recomputes, yet changes no sample."""
    prompts = [list(range(10 + i, 50 + i)) for i in range(6)]
    params = [SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(6)]
    roomy = LLM("tiny-llama", num_kv_blocks=64).generate(prompts, params)
    tight_llm = LLM("tiny-llama", num_kv_blocks=8, enable_prefix_caching=False)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.get_stats().num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in tight] == \
        [[c.token_ids for c in o.outputs] for o in roomy]
    assert tight_llm.get_stats().num_free_blocks == 8


def test_stats_report_queue_and_cache_state(engine):
    # 8 blocks of 16: two 30-token prompts (2 blocks each, 3 with output) fit, a third waits
    for rid in ("a", "b", "c"):
        engine.add_request(rid, PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 3)
    assert stats.num_waiting_prompt_tokens == 90
    engine.step()
    stats = engine.get_stats()
    assert stats.num_running + stats.num_waiting == 3 and stats.num_running >= 1
    assert stats.kv_cache_usage == 1 - stats.num_free_blocks / stats.num_total_blocks > 0
    assert stats.prompt_tokens >= 30
    run_engine(engine)
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.generation_tokens == 90
