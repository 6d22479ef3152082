"""In-flight migration against fake engines whose tokens are a function of the prompt: a
stream that breaks mid-way (the connection drops, a 5xx event such as a drain's handover)
goes on on another engine after the tokens the client has, under one id; what cannot move
ends with an error naming why. The record and the continuation's body as tables."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import sse
from router_fake_engine import FakeEngine, token_at

from kvpilot.engine.contracts.router_args import REQUEST_ID_HEADER
from kvpilot.engine.router.migration import StreamRecord, not_resumable

PROMPT = "migrate me"
MAX_TOKENS = 12


def events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in sse.lines(text) if line.startswith("data: {")]


def body(**extra) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, **extra}


async def stream(router: str, request: dict) -> str:
    async with httpx.AsyncClient(base_url=router, timeout=30) as client:
        response = await client.post("/v1/completions", json=request)
        assert response.status_code == 200, response.text
        return response.text


def migrations(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("kvpilot_router_migrations_total{"):
            labels, value = line.split("} ")
            reason = labels.split('reason="')[1].split('"')[0]
            outcome = labels.split('outcome="')[1].split('"')[0]
            out[reason, outcome] = float(value)
    return out


@pytest.mark.parametrize("mode", ["die", "error503"])
async def test_a_broken_stream_goes_on_elsewhere_token_for_token(fleet, mode):
    first = FakeEngine("first", tokens=True, break_after=5, break_mode=mode)
    second = FakeEngine("second", tokens=True)
    router, _ = await fleet([first, second], policy="round-robin")
    text = await stream(router, body())
    got = events(text)
    tokens = [c["choices"][0]["text"] for c in got if c["choices"]]
    assert tokens == [f"<{token_at(PROMPT, i)}>" for i in range(MAX_TOKENS)]
    assert {c["id"] for c in got} == {"cmpl-first"} and {c["created"] for c in got} == {100}
    assert text.count("data: [DONE]") == 1 and "error" not in text and ": token_ids" not in text
    assert got[-1]["usage"] == {"completion_tokens": MAX_TOKENS}  # once, from the continuation
    resumed = second.bodies[-1]
    assert resumed["resume"] == {"token_ids": [token_at(PROMPT, i) for i in range(5)],
                                 "created": 100}
    assert first.resumable_headers == ["1"]
    async with httpx.AsyncClient(base_url=router) as client:
        counted = migrations((await client.get("/metrics")).text)
    reason = "upstream_failed" if mode == "die" else "drained"
    assert counted == {(reason, "resumed"): 1.0}


async def test_a_stream_that_keeps_breaking_stops_after_max_migrations(fleet):
    engines = [FakeEngine(f"e{i}", tokens=True, break_after=2) for i in range(3)]
    router, _ = await fleet(engines, policy="round-robin", max_migrations=2)
    text = await stream(router, body())
    tokens = [c["choices"][0]["text"] for c in events(text) if c.get("choices")]
    assert tokens == [f"<{token_at(PROMPT, i)}>" for i in range(6)]  # 2 + 2 + 2, no repeat
    error = events(text)[-1]["error"]
    assert "not resumed: it moved --max-migrations=2 times already" in error["message"]
    assert text.rstrip().endswith("data: [DONE]")


async def test_a_stream_of_several_completions_does_not_move_and_says_why(fleet):
    first = FakeEngine("first", mode="die_after_first")
    second = FakeEngine("second")
    router, _ = await fleet([first, second], policy="round-robin")
    text = await stream(router, {"model": "tiny", "prompt": "x", "stream": True, "n": 2})
    error = events(text)[-1]["error"]
    assert "failed mid-stream" in error["message"]
    assert "not resumed: n=2: several completions' states do not move together" in \
        error["message"]
    assert first.resumable_headers == [""] and second.bodies == []


RECORD_CASES = [
    # (what the engine sent, what reaches the client, token ids noted, done, broken by)
    (b'data: {"id":"a","created":3,"choices":[]}\n\n',
     b'data: {"id":"a","created":3,"choices":[]}\n\n', [], False, None),
    (b': token_ids 4 5\ndata: {"id":"a","created":3}\n\n: token_ids 6\ndata: {"x":1}\n\n',
     b'data: {"id":"a","created":3}\n\ndata: {"x":1}\n\n', [4, 5, 6], False, None),
    (b'data: {"id":"a","created":3}\n\ndata: [DONE]\n\n',
     b'data: {"id":"a","created":3}\n\ndata: [DONE]\n\n', [], True, None),
    (b': token_ids 9\ndata: {"id":"a","created":3}\n\n'
     b'data: {"error": {"message": "engine failed", "code": 503}}\n\ndata: [DONE]\n\n',
     b'data: {"id":"a","created":3}\n\n', [9], False, "engine_error"),
    (b'data: {"error": {"message": "max_tokens is invalid", "code": 400}}\n\n',
     b'data: {"error": {"message": "max_tokens is invalid", "code": 400}}\n\n', [], False, None),
    (b'data: {"error": {"message": "the server is draining and handed this stream over", '
     b'"code": 503}}\n\n', b"", [], False, "drained"),
]


@pytest.mark.parametrize(("sent", "relayed", "ids", "done", "broken"), RECORD_CASES)
def test_the_record_notes_tokens_and_withholds_a_break(sent, relayed, ids, done, broken):
    record = StreamRecord()
    out, interruption = record.take(sent)
    assert (out, record.token_ids, record.done) == (relayed, ids, done)
    assert (interruption.reason if interruption else None) == broken
    if b'"id":"a"' in sent:
        assert (record.response_id, record.created) == ("a", 3)


def test_the_continuation_is_the_request_plus_the_tokens_sent():
    record = StreamRecord([1, 2], "cmpl-a", 7)
    request = {"model": "m", "prompt": "p", "stream": True, "first_token_id": 1, "seed": 3}
    resumed, headers = record.continuation(request, {"x-request-id": "r"})
    assert resumed == {"model": "m", "prompt": "p", "stream": True, "seed": 3,
                       "resume": {"token_ids": [1, 2], "created": 7}}
    assert headers == {"x-request-id": "r", REQUEST_ID_HEADER: "cmpl-a"}
    # a decode leg that broke before its first event: the prefill's token went out already
    lone, _ = StreamRecord().continuation(request, {})
    assert lone["resume"]["token_ids"] == [1]


@pytest.mark.parametrize(("path", "request_body", "reason"), [
    ("/v1/completions", {"prompt": "p"}, None),
    ("/v1/chat/completions", {"messages": [], "n": 1}, None),
    ("/v1/completions", {"prompt": "p", "n": 3}, "n=3"),
    ("/v1/completions", {"prompt": "p", "best_of": 2}, "best_of=2"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt holds 2 prompts"),
    ("/v1/completions", {"prompt": [1, 2, 3]}, None),
    ("/v1/completions", {"prompt": "p", "resume": {"token_ids": []}}, "itself a continuation"),
])
def test_what_can_move(path, request_body, reason):
    got = not_resumable(path, request_body, max_migrations=3)
    assert (got is None) if reason is None else (reason in (got or "")), got
    assert "--max-migrations=0" in (not_resumable(path, request_body, 0) or "")
