"""Structured outputs: every output of a random-weight model matches its constraint.

The tiny model's weights are random, so only the grammar's token mask can make
its outputs parse: a table of JSON schemas (required fields, enums, arrays,
nesting, numbers, patterns) validated with `jsonschema`, plus regex and choice
outputs, sampled with several seeds in one batch beside unconstrained requests,
with async scheduling on and under preemption.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.entrypoints.llm import LLM
from kvpilot.engine.structured.bitmask import apply_token_bitmask

# strings are bounded (maxLength, pattern, enum) and objects closed (additionalProperties):
# a random model picks `"` about once in a thousand tokens, so an unbounded string would
# outrun max_tokens
NAME = {"type": "string", "maxLength": 6}
SCHEMAS: dict[str, dict[str, Any]] = {
    "required_fields": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}},
                        "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
             "required": ["colour"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string", "enum": ["a", "bc"]},
        "minItems": 1, "maxItems": 4}}, "required": ["tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0},
                                         "email": {"type": "string",
                                                   "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}},
        "required": ["id", "email"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "price": {"type": "number", "minimum": 0, "maximum": 100},
        "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["price", "count"], "additionalProperties": False},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "top_level_array": {"type": "array", "items": {"type": "boolean"}, "maxItems": 5},
}
SEEDS = range(3)


@pytest.fixture(scope="module", params=["auto", "guidance"])
def llm(request: pytest.FixtureRequest) -> LLM:
    """The engine under each structured-outputs backend (auto: JSON schemas by xgrammar)."""
    return LLM("tiny-llama", device="cpu", max_num_seqs=32,
               structured_outputs_backend=request.param)


def _json_params(schema: dict[str, Any], seed: int, max_tokens: int = 400) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))


def test_every_schema_output_parses_and_validates(llm: LLM) -> None:
    cases = [(name, seed) for name in SCHEMAS for seed in SEEDS]
    outs = llm.generate(["Reply in JSON:"] * len(cases),
                        [_json_params(SCHEMAS[name], seed) for name, seed in cases])
    for (name, seed), out in zip(cases, outs, strict=True):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (name, seed, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_regex_and_choice_outputs_match() -> None:
    llm = LLM("tiny-qwen3", device="cpu")
    regex = r"[a-z]{3}-[0-9]{2,4}"
    choices = ["yes", "no way", 'say "hi"']
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120,
                             structured_outputs=StructuredOutputsParams(**kind))
              for s in SEEDS for kind in ({"json_object": True}, {"regex": regex},
                                          {"choice": choices})]
    outs = llm.generate(["x"] * len(params), params)
    for p, out in zip(params, outs, strict=True):
        text, so = out.outputs[0].text, p.structured_outputs
        assert so is not None
        if so.json_object:  # any object: its strings are unbounded, so max_tokens may cut it
            assert text.startswith("{")
            if out.outputs[0].finish_reason == "stop":
                assert isinstance(json.loads(text), dict)
        elif so.regex:
            assert re.fullmatch(regex, text, re.ASCII), text
        else:
            assert text in choices


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(llm: LLM) -> None:
    plain = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True)
             for s in SEEDS]
    alone = llm.generate(["The sky is"] * len(plain), plain)
    mixed = llm.generate(["The sky is"] * len(plain) + ["{"] * 2,
                         plain + [_json_params(SCHEMAS["enum"], s) for s in range(2)])
    assert [o.outputs[0].token_ids for o in mixed[:len(plain)]] == \
        [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize("flags", [{"async_scheduling": "on"},
                                   # 24 blocks of 4 for 12 requests: preemption (recompute)
                                   {"num_kv_blocks": 24, "block_size": 4,
                                    "max_num_batched_tokens": 32}])
def test_outputs_validate_under_async_scheduling_and_preemption(flags: dict[str, Any]) -> None:
    llm = LLM("tiny-llama", device="cpu", max_num_seqs=12, **flags)
    schema = SCHEMAS["array"]
    # max_tokens within the 24 blocks, else a request never fits and fails at once
    params = [_json_params(schema, seed, max_tokens=60) for seed in range(6)] + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=20, ignore_eos=True)
        for s in range(6)]
    outs = llm.generate(["a b c d e f"] * len(params), params)
    for out in outs[:6]:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs[6:])
    if "num_kv_blocks" in flags:
        assert llm.engine.scheduler.num_preemptions > 0


def test_bitmask_keeps_exactly_the_set_bits() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=gen)
    allowed = torch.rand(3, 70, generator=gen) < 0.3
    allowed[2] = True  # an unconstrained row: every bit set
    padded = torch.zeros(3, 96, dtype=torch.bool)
    padded[:, :70] = allowed
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    words = (padded.view(3, 3, 32).long() * weights).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    out = apply_token_bitmask(logits, bitmask)
    assert torch.equal(out, torch.where(allowed, logits, float("-inf")))


@pytest.mark.parametrize(("params", "field"), [
    ({"n": 2}, "structured_outputs"), ({"beam_width": 2}, "structured_outputs"),
    ({"min_tokens": 3}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos")])
def test_structured_outputs_refuse_branches(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), **params)


def test_an_invalid_grammar_is_refused_offline(llm: LLM) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(("))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        llm.generate(["x"], bad)


def test_a_grammar_that_fails_in_the_core_ends_its_request_with_the_error(llm: LLM) -> None:
    engine = llm.engine  # add_request directly: past the check the API server and LLM make
    bad = SamplingParams(max_tokens=50, structured_outputs=StructuredOutputsParams(regex="(("))
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("bad", [5, 6, 7], bad)
    engine.add_request("good", [5, 6, 7], good)
    finished = {}
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if len(finished) == 2:
            break
    assert "structured_outputs grammar does not compile" in (finished["bad"].error or "")
    assert not finished["bad"].completions[0].token_ids[:-1]  # EOS at once, nothing else
    assert finished["good"].error is None
