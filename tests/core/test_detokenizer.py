"""Incremental detokenisation equals a full decode and never shows half a character."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.core.detokenizer import append_text, decode_new_text, init_offsets, visible_text
from kvpilot.engine.core.request import Request

TOKENIZER = load_tokenizer("tiny-llama")


def stream(prompt: str, completion: str, **params) -> tuple[object, list[str]]:
    """Gives the sequence after feeding `completion`'s tokens one by one, and each shown text."""
    prompt_ids = TOKENIZER.encode(prompt, add_special_tokens=False) or [5]
    request = Request("r", prompt, prompt_ids, SamplingParams(**params), 0.0)
    seq = request.seqs[0]
    init_offsets(seq)
    shown = []
    for token in TOKENIZER.encode(completion, add_special_tokens=False):
        seq.token_ids.append(token)
        append_text(seq, decode_new_text(TOKENIZER, seq, True), request.params)
        shown.append(visible_text(seq, request.params))
        if seq.finish_reason:
            break
    return seq, shown


@pytest.mark.parametrize("completion", [
    "héllo wörld 日本語 😀 naïve", "The quick brown fox", "  spaces  and\nnewlines\t",
    "😀😀😀", "a",
])
def test_incremental_text_equals_full_decode(completion):
    seq, shown = stream("Say:", completion)
    assert seq.output_text == completion
    assert all("\ufffd" not in text for text in shown)
    assert all(b.startswith(a) for a, b in itertools.pairwise(shown))


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
               min_size=1, max_size=24))
def test_any_text_round_trips(text):
    seq, _shown = stream("x", text)
    assert seq.output_text == TOKENIZER.decode(TOKENIZER.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(("completion", "stop", "include", "text", "reason"), [
    ("The quick brown fox", ["brown"], False, "The quick ", "brown"),
    ("The quick brown fox", ["brown"], True, "The quick brown", "brown"),
    ("The quick brown fox", ["k b"], False, "The quic", "k b"),  # spans "ck" and " b"
    ("The quick brown fox", ["fox", "qu"], False, "The ", "qu"),  # earliest match wins
    ("The quick brown fox", ["zebra"], False, "The quick brown fox", None),
])
def test_stop_strings(completion, stop, include, text, reason):
    seq, shown = stream("Say:", completion, stop=stop, include_stop_str_in_output=include)
    assert seq.output_text == text
    assert seq.stop_reason == reason
    # text shown before the stop matched never contains the stop string's start
    assert all(s == text[:len(s)] for s in shown)
