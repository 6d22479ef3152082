"""A disaggregated stream's first token from the prefill (`router.disagg.FirstToken`): which
requests take that path, the events the router writes, and stripping the token's text from
the decode instance's stream."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import sse
from router_fake_engine import FakeEngine

from kvpilot.engine.router.disagg import FirstToken, SkipSent, early_first_token

STREAM = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}


@pytest.mark.parametrize(("change", "early"), [
    ({}, True),
    ({"temperature": 0.7, "seed": 3, "stream_options": {"include_usage": True}}, True),
    ({"stream": False}, False),
    ({"n": 2}, False),
    ({"max_tokens": 1}, False),  # the prefill's token is the whole answer
    ({"stop": ["\n"]}, False),  # a stop string may hold the token's text back
    ({"logprobs": 0}, False),
    ({"min_tokens": 3}, False),  # the prefill runs without it: its token may be EOS
    ({"response_format": {"type": "json_object"}}, False),
    ({"stop": []}, True),
])
def test_which_requests_take_the_first_token_from_the_prefill(change, early):
    assert early_first_token({**STREAM, **change}) is early


def reply(text: str = "Hi", finish: str = "length", ids: list[int] | None = None,
          chat: bool = False) -> dict:
    choice = {"index": 0, "finish_reason": finish, "token_ids": [5] if ids is None else ids}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return {"id": "cmpl-1", "created": 9, "model": "m", "choices": [choice]}


@pytest.mark.parametrize(("answer", "usable"), [
    (reply(), True),
    (reply(finish="stop"), False),  # the answer ended at its first token
    (reply(text=""), False),
    (reply(text="\ufffd"), False),  # half a character: the decode holds it back
    (reply(ids=[]), False),  # an engine that does not know return_token_ids
    ({"error": {"message": "x"}}, False),
])
def test_a_prefill_reply_gives_a_first_token_only_when_it_can_go_first(answer, usable):
    assert (FirstToken.of(answer, chat=False) is not None) is usable


def events(data: bytes) -> list[dict]:
    return [json.loads(e.removeprefix(b"data: ")) for e in data.split(b"\n\n")
            if e.startswith(b"data: {")]


def test_the_decode_streams_rest_follows_the_token_with_its_text_stripped():
    first = FirstToken.of(reply("Hel"), chat=False)
    assert first is not None
    assert [c["choices"][0]["text"] for c in events(first.events())] == ["Hel"]
    skip = SkipSent(first)
    decode = [b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"He","finish_reason":null}]}'
              b'\n\n', b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"llo","finish_'
              b'reason":null}]}\n\ndata: {"id":"cmpl-1","choices":[{"index":0,"text":"!",'
              b'"finish_reason":"length"}]}\n\n', b"data: [DONE]\n\n"]
    out = b"".join(skip.feed(d) for d in decode)
    # "He" went whole, "l" of "llo": the rest goes out, and what follows passes as it came
    assert [c["choices"][0]["text"] for c in events(out)] == ["lo", "!"]
    assert out.endswith(b"data: [DONE]\n\n")


def test_a_chat_stream_opens_once():
    first = FirstToken.of(reply("Hi", chat=True), chat=True)
    assert first is not None
    opening = events(first.events())
    assert [c["choices"][0]["delta"] for c in opening] == [
        {"role": "assistant", "content": ""}, {"role": None, "content": "Hi", "tool_calls": None}]
    skip = SkipSent(first)
    decode = (b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
              b'"finish_reason":null}]}\n\ndata: {"id":"c","choices":[{"index":0,"delta":{"role"'
              b':null,"content":"Hi there"},"finish_reason":null}]}\n\n')
    assert [c["choices"][0]["delta"]["content"] for c in events(skip.feed(decode))] == [" there"]


async def test_a_decode_failing_after_the_first_token_ends_in_an_error_event(fleet):
    prefill = FakeEngine("p", role="prefill")
    decode = FakeEngine("d", role="decode", mode="fail500")
    router, _ = await fleet([prefill, decode], max_retries=0, transfer_timeout=1.0)
    async with (httpx.AsyncClient(base_url=router, timeout=30) as client,
                client.stream("POST", "/v1/completions", json=STREAM) as response):
        assert response.status_code == 200
        lines = [line async for line in sse.aiter_lines(response) if line]
    assert prefill.bodies[-1]["return_token_ids"] is True
    assert decode.bodies[-1]["first_token_id"] == 7  # the fake prefill's token
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == "p"
    assert "error" in json.loads(lines[1].removeprefix("data: "))
    assert lines[-1] == "data: [DONE]"
