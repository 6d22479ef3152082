"""The xgrammar side of structured outputs (`--structured-outputs-backend auto`): which
constraints it takes, that its bounded strings hold no raw control character (invalid JSON
that xgrammar 0.2.9's grammar allows), and that its matchers mask, advance and roll back as
the engine needs."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.contracts.tokenizer import load_tokenizer
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


def test_the_pooled_fill_writes_each_row_as_its_matcher_alone_would() -> None:
    """`fill` spreads the rows over its threads (three here, the caller's among them), each
    taking the next row left: every row must hold its own matcher's mask in its own row of
    the batch, whichever thread filled it."""
    tokenizer = load_tokenizer("tiny-llama")
    vocab = tokenizer.vocab_size
    pooled = XgrammarMatchers(tokenizer.to_json(), vocab, [2], threads=3)
    prefixes = ['', '{"', '{"name":"', '{"name":"abc', '{"name":"abcdefgh', '{"name":"a"']
    matchers = [pooled.matcher(json.dumps(BOUNDED), tokenizer.encode(p, add_special_tokens=False))
                for p in prefixes * 4]
    words = (vocab + 31) // 32
    rows = [2 * i + 1 for i in range(len(matchers))]  # every other row, as the engine's may be
    mask = torch.zeros(2 * len(matchers) + 1, words, dtype=torch.int32)
    try:
        pooled.fill(matchers, mask, rows)
    finally:
        pooled.shutdown()
    alone = torch.zeros(1, words, dtype=torch.int32)
    for matcher, row in zip(matchers, rows, strict=True):
        matcher.fill_next_token_bitmask(alone, 0)
        assert torch.equal(mask[row], alone[0]), row
    untouched = [r for r in range(mask.shape[0]) if r not in rows]
    assert not mask[untouched].any()
    # the states differ, so a row written from another row's matcher would show
    assert len({tuple(mask[row].tolist()) for row in rows}) == len(prefixes)
