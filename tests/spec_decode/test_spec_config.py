"""--speculative-config parsing (vLLM's JSON shape) and the n-gram proposer, as tables."""

from __future__ import annotations

import pytest

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.speculative import SpeculativeConfig, parse_speculative_config
from kvpilot.engine.spec_decode.ngram_proposer import propose_ngram


@pytest.mark.parametrize("text, expected", [
    (None, None),
    ('{"method": "ngram", "num_speculative_tokens": 4}',
     SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2)),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 5, '
     '"prompt_lookup_min": 3}', SpeculativeConfig("ngram", 2, prompt_lookup_max=5,
                                                  prompt_lookup_min=3)),
    ('{"model": "tiny-llama", "num_speculative_tokens": 3}',
     SpeculativeConfig("draft_model", 3, model="tiny-llama")),
    ('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 1}',
     SpeculativeConfig("draft_model", 1, model="/m")),
])
def test_valid_configs_resolve(text, expected):
    config = parse_speculative_config(text)
    assert config == expected
    if config is not None:  # what the operator renders parses back to the same config
        assert parse_speculative_config(config.to_json()) == config


@pytest.mark.parametrize("text, message", [
    ("{nope", "is not JSON"),
    ("[1]", "is not a JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}',
     "key 'draft_tensor_parallel_size' is not supported"),
    ('{"method": "eagle", "num_speculative_tokens": 4}', "method='eagle' is not supported"),
    ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0 is invalid"),
    ('{"method": "ngram", "num_speculative_tokens": true}',
     "num_speculative_tokens=True is invalid"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
     '"prompt_lookup_max": 3}', "prompt_lookup_min=5 exceeds prompt_lookup_max=3"),
    ('{"method": "ngram", "model": "x", "num_speculative_tokens": 2}', "does not go with"),
    ('{"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
     "'prompt_lookup_max' is for method 'ngram' only"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "model=None is invalid"),
])
def test_invalid_configs_are_refused_naming_the_key(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_speculative_config(text)


NGRAM = '{"method": "ngram", "num_speculative_tokens": 2}'


@pytest.mark.parametrize("flags, message", [
    (dict(async_scheduling="on"), "async_scheduling='on' does not work with speculative"),
    (dict(tensor_parallel_size=2), "needs one rank"),
    (dict(role="decode"), "role='decode'"),
])
def test_engine_args_refuse_what_speculation_does_not_support(flags, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="tiny-llama", speculative_config=NGRAM, **flags)
    EngineArgs(model="tiny-llama", **flags)  # fine without speculation


@pytest.mark.parametrize("tokens, k, low, high, expected", [
    ([1, 2, 3, 4, 1, 2], 3, 1, 3, [3, 4, 1]),       # suffix [1, 2] seen at 0
    ([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, 1, 2, [7, 2]),  # the most recent match wins
    ([1, 2, 3, 1, 2, 3, 1, 2], 4, 2, 3, [3, 1, 2]),  # fewer than k left after the match
    ([5, 6, 7], 2, 1, 2, []),                        # nothing repeats
    ([4, 4], 3, 1, 1, [4]),
    ([1, 2, 1], 0, 1, 2, []),                        # no room for drafts
    ([8, 1, 2, 9, 1, 2], 2, 3, 3, []),               # only a 2-gram repeats, min is 3
])
def test_ngram_proposals(tokens, k, low, high, expected):
    assert propose_ngram(tokens, k, low, high) == expected
