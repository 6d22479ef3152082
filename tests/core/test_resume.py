"""`resume_token_ids`: a request resumed after k of its output tokens (a stream the router
migrated) continues with exactly the tokens an undisturbed run gives after them, for greedy
and seeded sampling, penalties, stop strings and tokens, min_tokens and a JSON grammar,
with async scheduling off and on; the finish the resumed tokens reach is not sent twice."""

from __future__ import annotations

import json
import re

import pytest
from core_helpers import Outputs, run_engine

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.worker.seeding import position_seed

PROMPT = list(range(100, 124))
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "tags": {"type": "array", "maxItems": 3,
                                                    "items": {"enum": ["a", "bc"]}}},
          "required": ["name", "tags"], "additionalProperties": False}
CASES = {
    "greedy": dict(temperature=0, max_tokens=14, ignore_eos=True),
    "seeded": dict(temperature=1.0, seed=11, max_tokens=14, ignore_eos=True),
    "seeded_filtered_penalised": dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01,
                                      seed=3, presence_penalty=0.5, frequency_penalty=0.3,
                                      repetition_penalty=1.2, logit_bias={7: 5.0},
                                      max_tokens=14, ignore_eos=True),
    "min_tokens_eos": dict(temperature=1.0, seed=5, min_tokens=6, max_tokens=40),
    "grammar": dict(temperature=1.0, seed=2, max_tokens=60,
                    structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA))),
}


@pytest.fixture(scope="module", params=["off", "on"])
def engine(request: pytest.FixtureRequest) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(
        model="tiny-llama", device="cpu", num_kv_blocks=64, block_size=4, max_model_len=128,
        async_scheduling=request.param))


def run(engine: LLMEngine, params: SamplingParams, rid: str = "r") -> tuple[list[int], str | None,
                                                                             int | str | None]:
    engine.add_request(rid, PROMPT, params)
    out = run_engine(engine, outputs=Outputs())[rid]
    if not out.outputs:
        return [], None, None
    c = out.outputs[0]
    return list(c.token_ids), c.finish_reason, c.stop_reason


def resumed(params: dict, tokens: list[int]) -> SamplingParams:
    return SamplingParams(**params, resume_token_ids=list(tokens))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_request_continues_as_the_undisturbed_run(engine, case):
    params = CASES[case]
    whole, finish, stop = run(engine, SamplingParams(**params))
    assert len(whole) >= 4, whole
    for k in (0, 1, len(whole) // 2, len(whole) - 1):
        rest, rest_finish, rest_stop = run(engine, resumed(params, whole[:k]))
        assert (rest, rest_finish, rest_stop) == (whole[k:], finish, stop), (case, k)


def test_a_stop_string_spanning_the_resume_point_is_found(engine):
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    whole, _, _ = run(engine, SamplingParams(**greedy))
    text = engine.tokenizer.decode(whole)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    until, finish, reason = run(engine, SamplingParams(**greedy, stop=[stop]))
    assert finish == "stop" and reason == stop, (text, stop)
    for k in range(len(until)):
        rest, rest_finish, rest_reason = run(engine, resumed({**greedy, "stop": [stop]},
                                                              until[:k]))
        assert (until[:k] + rest, rest_finish, rest_reason) == (until, "stop", stop), k


def test_resumed_tokens_that_reach_the_end_finish_with_nothing_more(engine):
    greedy = dict(temperature=0, max_tokens=5, ignore_eos=True)
    whole, _, _ = run(engine, SamplingParams(**greedy))
    engine.add_request("done", PROMPT, resumed(greedy, whole))
    out = run_engine(engine, outputs=Outputs())["done"]
    assert out.finished and out.outputs == []  # the finish went out with the last token


def test_tokens_past_the_end_are_refused(engine):
    greedy = dict(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match=re.escape("resume_token_ids has 4 tokens, but the "
                                                   "output ended after 3 (length)")):
        engine.add_request("long", PROMPT, resumed(greedy, [5, 6, 7, 8]))


@pytest.mark.parametrize(("params", "message"), [
    (dict(n=2, resume_token_ids=[1]), "works with n=1"),
    (dict(first_token_id=4, resume_token_ids=[1]), "no first_token_id"),
    (dict(resume_token_ids=[1, -2]), "resume_token_ids=[-2] is invalid"),
])
def test_bad_resumes_are_refused(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**params)


def test_position_seeds_differ_by_seed_index_and_position():
    seeds = {position_seed(s, i, p) for s in (0, 1, -1, 2**63 - 1) for i in (0, 1)
             for p in range(50)}
    assert len(seeds) == 4 * 2 * 50
    assert all(0 <= s < 2**63 for s in seeds)
