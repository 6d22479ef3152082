"""Bad requests get OpenAI error objects: 400 naming the field, 404 model, 401 key, 429 queue."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_harness import (
    MODEL,
    RunningServer,
    engine_core,
    serve_in_thread,
    tiny_app,
)

from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.server.errors import validation_message

OK_COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (route, fields changed from a valid body, expected status, expected param)
CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("/v1/completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 600}, 400, "max_tokens"),
    ("/v1/completions", {"temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"n": 0}, 400, "n"),
    ("/v1/completions", {"n": "two"}, 400, "n"),
    ("/v1/completions", {"logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"stop": [""]}, 400, "stop"),
    ("/v1/completions", {"stop": 5}, 400, "stop"),
    ("/v1/completions", {"seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"stream": "yes please"}, 400, "stream"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": None}, 400, "prompt"),
    # a lone surrogate (JSON "\ud800") reached the tokenizer: TypeError, a 500
    ("/v1/completions", {"prompt": "\ud800"}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "a\udc00b"]}, 400, "prompt.1"),
    ("/v1/completions", {"stop": ["\ud800"]}, 400, "stop.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "x\ud800"}]}]}, 400,
     "messages.0.content.1.text"),
    ("/v1/completions", {"echo": True}, 400, "echo"),
    ("/v1/completions", {"suffix": "tail"}, 400, "suffix"),
    ("/v1/completions", {"logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ("/v1/completions", {"min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"model": None}, 400, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, 400, "tools.0.function"),
    # structured outputs and tool calls (issue 24)
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "wizard"}}}}, 400, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "(("}}, 400, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {}}, 400, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: ???"}}, 400,
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": "{not json"}}, 400,
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"whitespace_pattern": " "}}, 400,
     "structured_outputs.whitespace_pattern"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, 400, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"regex": "a+"}, "min_tokens": 1}, 400,
     "min_tokens"),
    ("/v1/completions", {"structured_outputs": {"regex": "a+"}, "ignore_eos": True}, 400,
     "ignore_eos"),
    ("/v1/completions", {"guided_choice": ["a"]}, 400, "guided_choice"),
    ("/v1/completions", {"structured_outputs": {"choice": ["a"]},
                         "response_format": {"type": "json_object"}}, 400, "structured_outputs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     400, "messages"),
    ("/v1/chat/completions", {"model": "other"}, 404, "model"),
    # what a disaggregated fleet's router sends (issue 22): the prefill's token ids, the
    # decode's given first token
    ("/v1/completions", {"return_token_ids": True, "stream": True}, 400, "return_token_ids"),
    ("/v1/completions", {"first_token_id": 5000}, 400, "first_token_id"),
    ("/v1/completions", {"first_token_id": -1}, 400, "first_token_id"),
    ("/v1/completions", {"first_token_id": 5, "n": 2}, 400, "first_token_id"),
]


@pytest.mark.parametrize(("route", "change", "status", "param"), CASES,
                         ids=[f"{r.rsplit('/', 1)[-1]}-{next(iter(c))}-{s}"
                              for r, c, s, _ in CASES])
def test_bad_request_names_the_field(server: RunningServer, route: str, change: dict[str, Any],
                                     status: int, param: str | None) -> None:
    body = {**(OK_COMPLETION if route == "/v1/completions" else OK_CHAT), **change}
    # json.dumps escapes a lone surrogate as "\ud800" (httpx's json= cannot encode it)
    resp = httpx.post(f"{server.base_url}{route}", content=json.dumps(body), timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]


@pytest.mark.parametrize(("body", "status"), [(b"{not json", 400), (b"[1, 2]", 400),
                                              (b"", 400)])
def test_malformed_body_is_a_400_error_object(server: RunningServer, body: bytes,
                                              status: int) -> None:
    resp = httpx.post(f"{server.base_url}/v1/completions", content=body,
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == status
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_is_a_404_error_object(server: RunningServer) -> None:
    resp = httpx.get(f"{server.base_url}/v1/nope", timeout=10)
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_api_key_queue_limit_and_kv_refusal() -> None:
    # A KV cache of 4 blocks (64 tokens) under a 512-token context.
    with engine_core(num_kv_blocks=4) as core:
        # max_queue_len=0: any request would wait, so every generation gets 429.
        with serve_in_thread(tiny_app(core, max_queue_len=0,
                                      auth=HttpAuth(api_key="sesame"))) as running:
            url = f"{running.base_url}/v1/completions"
            missing = httpx.post(url, json=OK_COMPLETION, timeout=10)
            assert missing.status_code == 401
            assert missing.json()["error"]["code"] == "invalid_api_key"
            wrong = httpx.post(url, json=OK_COMPLETION, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            full = httpx.post(url, json=OK_COMPLETION, headers={"Authorization": "Bearer sesame"})
            assert full.status_code == 429
            assert full.headers["Retry-After"] == "1"
            assert full.json()["error"]["type"] == "rate_limit_error"
            assert httpx.get(f"{running.base_url}/health").status_code == 200  # probes need no key
        # The same core behind a second API server: a request that fits the context but never
        # the KV cache is refused by the engine.
        with serve_in_thread(tiny_app(core)) as running:
            url = f"{running.base_url}/v1/completions"
            fits = httpx.post(url, json={**OK_COMPLETION, "max_tokens": 8}, timeout=30)
            assert fits.status_code == 200
            too_big = httpx.post(url, json={**OK_COMPLETION, "max_tokens": 200}, timeout=30)
            assert too_big.status_code == 400
            assert "KV blocks" in too_big.json()["error"]["message"]


@settings(max_examples=50, deadline=None)
@given(loc=st.lists(st.one_of(st.sampled_from(["max_tokens", "messages", "role"]),
                              st.integers(0, 5)), min_size=1, max_size=4),
       value=st.one_of(st.none(), st.integers(), st.text(max_size=200)))
def test_validation_message_names_the_location(loc: list[Any], value: Any) -> None:
    message, param = validation_message(
        [{"type": "int_parsing", "loc": ("body", *loc), "msg": "bad", "input": value}])
    assert param == ".".join(str(p) for p in loc)
    assert message.startswith(f"{param}=") and len(message) < 200
