"""A row's grammar mask filled by the vocabulary's parts (`structured.vocab_split`) equals the
mask its whole-vocabulary matcher fills: along random walks through a schema with bounded
strings (each step's rows compared bit for bit), and as the tokens of a whole engine run under
async scheduling. The parts take each token when the full matcher does (spelled in their own
tokens): a part that missed one would fill a stale mask, and these tests would see it."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import jsonschema
import llguidance
import pytest
import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.core.request import Request, Sequence
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.structured import matchers
from kvpilot.engine.structured.grammar import grammar_of
from kvpilot.engine.structured.matchers import GrammarMatchers
from kvpilot.engine.structured.vocab_split import split_parts

# bounded strings (where llguidance walks the whole trie), an enum, numbers, a pattern
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "kind", "scores", "zip"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "kind": {"enum": ["person", "place"]},
                         "scores": {"type": "array", "items": {"type": "number"},
                                    "maxItems": 3},
                         "zip": {"type": "string", "pattern": "^[0-9]{3}$"}}}
VOCAB, EOS = 1024, [0, 3]  # tiny-llama's
REPO = Path(__file__).resolve().parents[2]


def _synthetic_tokenizer(vocab: int) -> tuple[str, list[int]]:
    """Gives the structured bench's byte-level BPE of `vocab` tokens (real token lengths: its
    keys and punctuation merge, so forced bytes have canonical tokens of several bytes) and
    its EOS."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from structured_gpu import synthetic_tokenizer
    finally:
        sys.path.remove(str(REPO / "bench"))
    body = synthetic_tokenizer(vocab)
    return json.dumps(body), [body["added_tokens"][2]["id"]]


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs=
                          StructuredOutputsParams(json=json.dumps(SCHEMA)))


@pytest.mark.parametrize(("env", "parts"), [("", 1), ("1", 1), ("4", 4), ("16", 16)])
def test_the_split_is_off_unless_set(monkeypatch: pytest.MonkeyPatch, env: str, parts: int
                                     ) -> None:
    monkeypatch.setenv("KVPILOT_MASK_SPLIT", env)
    assert split_parts() == parts


@pytest.mark.parametrize("env", ["0", "17", "four"])
def test_a_bad_split_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    monkeypatch.setenv("KVPILOT_MASK_SPLIT", env)
    with pytest.raises(ValueError, match="KVPILOT_MASK_SPLIT"):
        split_parts()


def _whole_mask(matcher: llguidance.LLMatcher, vocab: int) -> torch.Tensor:
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    return words[:(vocab + 31) // 32]


@pytest.mark.parametrize(("vocab", "parts"), [(VOCAB, 5), (151_936, 4)])
def test_split_masks_equal_whole_masks_along_random_walks(monkeypatch: pytest.MonkeyPatch,
                                                          vocab: int, parts: int) -> None:
    monkeypatch.setenv("KVPILOT_MASK_SPLIT", str(parts))
    tokenizer_json, eos = (load_tokenizer("tiny-llama").to_json(), EOS) if vocab == VOCAB \
        else _synthetic_tokenizer(vocab)
    grammars = GrammarMatchers(tokenizer_json, vocab, eos, torch.device("cpu"), "guidance")
    reference = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    grammar = grammar_of(_params(0).structured_outputs)  # pyright: ignore[reportArgumentType]
    rng = random.Random(parts)
    seqs: list[Sequence] = []
    whole: list[llguidance.LLMatcher] = []

    def start(row: int) -> None:
        request = Request(f"r{row}-{rng.random()}", None, [5], _params(row), 0.0)
        grammars.add(request)
        request.grammar_parts.result()  # pyright: ignore[reportAttributeAccessIssue]
        seq = request.seqs[0]
        if row < len(seqs):
            seqs[row], whole[row] = seq, matchers.new_matcher(reference, grammar)
        else:
            seqs.append(seq)
            whole.append(matchers.new_matcher(reference, grammar))

    for row in range(6):
        start(row)
    split_rows = 0
    for _ in range(120):
        fill = grammars.start_bitmask(seqs)
        assert fill is not None
        mask = fill.wait()
        for row, seq in enumerate(seqs):
            assert torch.equal(mask[row], _whole_mask(whole[row], vocab)), f"row {row} differs"
            split_rows += bool(seq.request.grammar_parts)
            bits = (mask[row].view(torch.uint8)[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
            allowed = bits.flatten()[:vocab].nonzero().flatten().tolist()
            token = rng.choice(allowed)
            grammars.accept(seq, token)
            assert whole[row].consume_token(token)
            if whole[row].is_stopped():
                start(row)
    grammars.shutdown()
    assert split_rows > 300  # most rows were filled by their parts


def _run(monkeypatch: pytest.MonkeyPatch, parts: int) -> tuple[dict[str, list[int]], int]:
    """Gives each request's tokens from an async engine with the vocabulary in `parts`, and
    how many rows its parts filled."""
    monkeypatch.setenv("KVPILOT_MASK_SPLIT", str(parts))
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="tiny-llama", device="cpu", max_num_seqs=6, async_scheduling="on",
        structured_outputs_backend="guidance"))  # the split is llguidance's
    for i in range(8):
        engine.add_request(str(i), [5 + i, 6, 7], _params(i))
    done: dict[str, list[int]] = {}
    for _ in range(600):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            for delta in out.completions:
                done.setdefault(out.request_id, []).extend(delta.token_ids)
    assert not engine.has_unfinished_requests()
    for request_id, tokens in done.items():
        assert request_id and jsonschema.validate(json.loads(engine.tokenizer.decode(tokens)),
                                                  SCHEMA) is None
    split_rows = engine.grammars().split_rows
    engine.shutdown()
    return done, split_rows


def test_an_async_engine_gives_the_same_tokens_with_the_split_on_and_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    whole, none_split = _run(monkeypatch, 1)
    split, split_rows = _run(monkeypatch, 3)
    assert none_split == 0 and split_rows > 100
    assert split == whole
