"""The xgrammar side of structured outputs (`--structured-outputs-backend auto`): which
constraints it takes, that its bounded strings hold no raw control character (invalid JSON
that xgrammar 0.2.9's grammar allows), and that its matchers mask, advance and roll back as
the engine needs."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.core.request import Request
from kvpilot.engine.structured.matchers import NOTHING_ALLOWED, GrammarMatchers
from kvpilot.engine.structured.xgrammar_backend import (
    XgrammarMatchers,
    unsupported_keyword,
    xgrammar_schema,
)

BOUNDED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
           "required": ["name"], "additionalProperties": False}


@pytest.mark.parametrize(("params", "backend", "goes_to_xgrammar"), [
    ({"json": BOUNDED}, "auto", True),
    ({"json": json.dumps(BOUNDED)}, "auto", True),
    ({"json_object": True}, "auto", True),
    ({"json": BOUNDED}, "guidance", False),
    ({"regex": "[a-z]+"}, "auto", False),
    ({"choice": ["a", "b"]}, "auto", False),
    ({"grammar": 'start: "a"'}, "auto", False),
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "auto",
     False),
    ({"json": {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}},
     "auto", False),
    # a property named like a keyword is a name, not the keyword
    ({"json": {"type": "object", "properties": {"format": {"type": "string"}}}}, "auto", True),
])
def test_auto_sends_json_schemas_xgrammar_enforces_whole_to_xgrammar(
        params: dict[str, Any], backend: str, goes_to_xgrammar: bool) -> None:
    schema = xgrammar_schema(StructuredOutputsParams(**params), backend)
    assert (schema is not None) == goes_to_xgrammar
    if schema is not None and "json" in params:
        expected = params["json"]
        assert json.loads(schema) == (json.loads(expected) if isinstance(expected, str)
                                      else expected)


def test_unsupported_keywords_are_found_at_any_depth() -> None:
    deep = {"$defs": {"item": {"type": "object", "propertyNames": {"pattern": "^a"}}},
            "anyOf": [{"type": "string"}, {"$ref": "#/$defs/item"}]}
    assert unsupported_keyword(deep) == "propertyNames"
    assert unsupported_keyword(BOUNDED) is None


@pytest.fixture(scope="module")
def matchers() -> XgrammarMatchers:
    tokenizer = load_tokenizer("tiny-llama")
    return XgrammarMatchers(tokenizer.to_json(), tokenizer.vocab_size, [2], threads=1)


def _allowed(mask: torch.Tensor, row: int, vocab: int) -> list[int]:
    bits = [(int(mask[row, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    return [t for t, bit in enumerate(bits) if bit]


def test_a_bounded_string_allows_no_raw_control_character(matchers: XgrammarMatchers) -> None:
    tokenizer = load_tokenizer("tiny-llama")
    vocab = tokenizer.vocab_size
    matcher = matchers.matcher(json.dumps(BOUNDED), [])
    assert matcher.accept_string('{"name":"')
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    matcher.fill_next_token_bitmask(mask, 0)
    allowed = _allowed(mask, 0, vocab)
    texts = {t: tokenizer.decode([t]) for t in allowed}
    assert any(text.isalpha() for text in texts.values())  # a string's letters are allowed
    raw = {t: text for t, text in texts.items() if any(ord(c) < 0x20 for c in text)}
    assert not raw, raw


def test_rollback_and_resume_keep_the_matchers_state(matchers: XgrammarMatchers) -> None:
    tokenizer = load_tokenizer("tiny-llama")
    prefix = tokenizer.encode('{"name":"ab', add_special_tokens=False)
    resumed = matchers.matcher(json.dumps(BOUNDED), prefix)
    fresh = matchers.matcher(json.dumps(BOUNDED), [])
    words = (tokenizer.vocab_size + 31) // 32
    a, b = torch.zeros(1, words, dtype=torch.int32), torch.zeros(1, words, dtype=torch.int32)
    for token in prefix:
        assert fresh.accept_token(token)
    resumed.fill_next_token_bitmask(a, 0)
    fresh.fill_next_token_bitmask(b, 0)
    assert torch.equal(a, b)
    closing = tokenizer.encode('"}', add_special_tokens=False)
    for token in closing:
        assert fresh.accept_token(token)
    fresh.rollback(len(closing))
    fresh.fill_next_token_bitmask(b, 0)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"refuses resume_token_ids\[0\]"):
        matchers.matcher(json.dumps(BOUNDED), tokenizer.encode("x", add_special_tokens=False))



def test_accept_advances_each_matcher_by_its_own_token(matchers: XgrammarMatchers) -> None:
    tokenizer = load_tokenizer("tiny-llama")
    brace = tokenizer.encode("{", add_special_tokens=False)
    letter = tokenizer.encode("x", add_special_tokens=False)
    rows = [matchers.matcher(json.dumps(BOUNDED), []) for _ in range(3)]
    # the second row is offered a token its grammar refuses ('x' cannot open an object)
    took = matchers.accept(rows, [brace[0], letter[0], brace[0]])
    assert took == [True, False, True]
    words = (tokenizer.vocab_size + 31) // 32
    masks = torch.zeros(3, words, dtype=torch.int32)
    for row, matcher in enumerate(rows):
        matcher.fill_next_token_bitmask(masks, row)
    fresh = torch.zeros(1, words, dtype=torch.int32)
    matchers.matcher(json.dumps(BOUNDED), []).fill_next_token_bitmask(fresh, 0)
    assert torch.equal(masks[0], masks[2]) and not torch.equal(masks[0], fresh[0])
    assert torch.equal(masks[1], fresh[0])  # the refused token left its row where it was


def _words_tokenizer_json(words: int) -> str:
    """A word-level tokenizer of t0..t{words-1} and an end token: no token spells `{`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(words)} | {"</s>": words}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # pyright: ignore[reportAttributeAccessIssue]
    return tokenizer.to_str()


def test_a_grammar_the_vocabulary_cannot_spell_fails_its_request_saying_so() -> None:
    """A JSON schema over a vocabulary without `{`: the mask allows nothing, the sampler's
    token is refused, and the request's error says why rather than naming the token."""
    words = 40
    grammars = GrammarMatchers(_words_tokenizer_json(words), words + 1, [words],
                               torch.device("cpu"))
    schema = StructuredOutputsParams(json=json.dumps(BOUNDED))
    request = Request("r", None, [5], SamplingParams(max_tokens=4, structured_outputs=schema),
                      0.0)
    grammars.add(request)
    seq = request.seqs[0]
    fill = grammars.start_bitmask([seq])
    assert fill is not None and not fill.wait()[0].any()  # nothing allowed
    grammars.accept(seq, 0)
    grammars.shutdown()
    assert request.error is not None and NOTHING_ALLOWED in request.error
    spelled = load_tokenizer("tiny-llama")
    xg = XgrammarMatchers(spelled.to_json(), spelled.vocab_size, [2], threads=1)
    matcher = xg.matcher(json.dumps(BOUNDED), [])
    assert not xg.allows_nothing(matcher)
    assert matcher.accept_string('{"name":"a"}') and matcher.accept_token(2)  # then EOS
    assert matcher.is_terminated() and not xg.allows_nothing(matcher)  # done, not stuck
