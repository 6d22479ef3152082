"""The core's deltas turned into text (`RequestState`) and their wire form (msgspec).

Tokens are bytes (`ByteTokenizer`), so each case's text is plain to read; the deltas are
what the core sends: new token ids, and the finish in the delta that ends a completion.
"""

from __future__ import annotations

import msgspec
import pytest
from server_fake_engine import ByteTokenizer

from kvpilot.engine.contracts.outputs import EngineStats, Logprob, RequestMetrics
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.core.outputs import CompletionDelta, EngineCoreOutput
from kvpilot.engine.core_process.messages import (
    AddRequest,
    StepOutputs,
    from_core_decoder,
    to_core_decoder,
)
from kvpilot.engine.engine_loop.request_state import RequestState, merge_deltas

PROMPT = list(b"Say:")
EOS = ByteTokenizer.eos_token_id


def deltas(chunks: list[bytes | list[int]], finish: str = "length",
           stop_reason: int | str | None = None) -> list[EngineCoreOutput]:
    """Gives one delta per chunk of tokens; the last one ends the request with `finish`."""
    out = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        out.append(EngineCoreOutput("r", [CompletionDelta(
            0, list(chunk), finish if last else None, stop_reason if last else None)],
            finished=last))
    return out


def texts(params: SamplingParams, steps: list[EngineCoreOutput]) -> tuple[list[str], str]:
    """Gives (each streamed delta's text, the non-streamed final text) of the same deltas."""
    stream = RequestState("r", None, PROMPT, params, ByteTokenizer(), stream=True)
    whole = RequestState("r", None, PROMPT, params, ByteTokenizer(), stream=False)
    streamed, final = [], None
    for step in steps:
        streamed.append(stream.apply(step).outputs[0].text)
        final = whole.apply(step)
    assert final is not None and final.finished
    return streamed, final.outputs[0].text


@pytest.mark.parametrize(("params", "chunks", "finish", "reason", "streamed", "final"), [
    # plain text arrives as it is decoded
    (SamplingParams(), [b"he", b"ll", b"o!"], "length", None, ["he", "ll", "o!"], "hello!"),
    # an eos token ends the output without its text (the ByteTokenizer drops it anyway)
    (SamplingParams(), [b"ok", [EOS]], "stop", None, ["ok", ""], "ok"),
    # a stop token's text is not output: "!" (33) stops the request
    (SamplingParams(stop_token_ids=[33]), [b"hi", b"!"], "stop", 33, ["hi", ""], "hi"),
    # text that may start a stop string is held back until it cannot; the stop is cut off
    (SamplingParams(stop=["lo"]), [b"he", b"l", b"lo"], "stop", "lo",
     ["h", "e", "l"], "hel"),
    (SamplingParams(stop=["lo"], include_stop_str_in_output=True), [b"he", b"l", b"lo"],
     "stop", "lo", ["h", "e", "llo"], "hello"),
    # a character's bytes split across deltas come out once whole
    (SamplingParams(), [b"caf", "é".encode()[:1], "é".encode()[1:]], "length", None,
     ["caf", "", "é"], "café"),
])
def test_deltas_give_the_text_streamed_and_whole(params, chunks, finish, reason, streamed,
                                                 final):
    got_streamed, got_final = texts(params, deltas(chunks, finish, reason))
    assert got_streamed == streamed
    assert got_final == final == "".join(streamed)


def test_offline_decodes_once_and_gives_only_the_final_output():
    state = RequestState("r", "Say:", PROMPT, SamplingParams(), ByteTokenizer(), stream=False,
                         decode_each_token=False)
    (last,) = deltas([b"he" b"llo"])
    out = state.apply(last)
    assert out is not None and out.prompt == "Say:" and out.outputs[0].text == "hello"
    assert out.outputs[0].token_ids == list(b"hello")


def test_beams_are_decoded_whole_and_logprobs_get_their_text():
    params = SamplingParams(beam_width=2, logprobs=1)
    state = RequestState("r", None, PROMPT, params, ByteTokenizer(), stream=False)
    out = state.apply(EngineCoreOutput("r", [
        CompletionDelta(0, list(b"ab"), "length", None, -0.5,
                        [{97: Logprob(-0.2, 1)}, {98: Logprob(-0.3, 1)}]),
        CompletionDelta(1, list(b"ba"), "length", None, -0.9)], finished=True))
    assert out is not None
    assert [(c.index, c.text, c.cumulative_logprob) for c in out.outputs] == [
        (0, "ab", -0.5), (1, "ba", -0.9)]
    assert out.outputs[0].logprobs[1][98].decoded_token == "b"


def test_merged_deltas_equal_the_deltas_in_sequence():
    state = RequestState("r", None, PROMPT, SamplingParams(n=2), ByteTokenizer(), stream=True)
    first = state.apply(EngineCoreOutput("r", [CompletionDelta(0, list(b"a")),
                                               CompletionDelta(1, list(b"x"))]))
    second = state.apply(EngineCoreOutput("r", [CompletionDelta(0, list(b"b"), "length")]))
    merged = merge_deltas(first, second)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in merged.outputs] == [
        (0, "ab", list(b"ab"), "length"), (1, "x", list(b"x"), None)]
    assert not merged.finished


def test_messages_survive_the_wire():
    params = SamplingParams(n=2, stop=["\n"], logprobs=2, seed=3)
    add = AddRequest("r", [1, 2, 3], params, 12.5, priority=1)
    assert to_core_decoder().decode(msgspec.msgpack.encode(add)) == add
    step = StepOutputs([EngineCoreOutput(
        "r", [CompletionDelta(1, [7, 8], "stop", "\n", -1.5, [{7: Logprob(-0.5, 1)}, {}])],
        True, 3, RequestMetrics(1.0, 2.0, 3.0), [None, {4: Logprob(-2.0, 5)}])],
        EngineStats(num_running=1, kv_cache_usage=0.5))
    assert from_core_decoder().decode(msgspec.msgpack.encode(step)) == step
