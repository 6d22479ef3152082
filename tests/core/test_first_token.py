"""`first_token_id`: a request whose first token was sampled elsewhere (a disaggregated
prefill engine) emits that token and continues from it, sync and async alike."""

from __future__ import annotations

import re

import pytest
from core_helpers import run_engine

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine

PROMPT = list(range(100, 124))


def make_engine(mode: str) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(
        model="tiny-llama", device="cpu", num_kv_blocks=32, block_size=4, max_model_len=128,
        async_scheduling=mode))


def tokens(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("r", prompt, params)
    return list(run_engine(engine)["r"].outputs[0].token_ids)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_the_given_first_token_is_emitted_and_the_rest_continues_from_it(mode):
    engine = make_engine(mode)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = tokens(engine, PROMPT, greedy)
    other = (plain[0] + 7) % 1000 + 5  # not what greedy picks
    forced = tokens(engine, PROMPT, SamplingParams(temperature=0, max_tokens=6,
                                                   ignore_eos=True, first_token_id=other))
    assert forced[0] == other
    # what follows is greedy on prompt + the given token
    assert forced[1:] == tokens(engine, [*PROMPT, other], SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True))
    # the sampled token given back gives the same output as sampling it here
    assert tokens(engine, PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 first_token_id=plain[0])) == plain


def test_a_random_request_keeps_the_given_first_token():
    engine = make_engine("on")
    for seed in range(4):
        out = tokens(engine, PROMPT, SamplingParams(temperature=1.0, seed=seed, max_tokens=3,
                                                    ignore_eos=True, first_token_id=42))
        assert out[0] == 42 and len(out) == 3


@pytest.mark.parametrize(("params", "message"), [
    (dict(first_token_id=-1), "first_token_id=-1 is invalid"),
    (dict(first_token_id=3, n=2), "works with n=1"),
])
def test_bad_first_token_ids_are_refused(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**params)


def test_a_first_token_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=re.escape("first_token_id must be in [0, 1024)")):
        make_engine("off").add_request("r", PROMPT, SamplingParams(first_token_id=5000))
