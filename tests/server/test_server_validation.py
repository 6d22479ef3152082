"""Bad requests get OpenAI error objects: 400 naming the field, 404 model, 401 key, 429 queue."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from bad_requests import CASES, OK_CHAT, OK_COMPLETION, RAW_CASES
from hypothesis import given, settings
from hypothesis import strategies as st
from server_harness import (
    RunningServer,
    engine_core,
    serve_in_thread,
    tiny_app,
)

from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.server.errors import validation_message


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


@pytest.mark.parametrize(("route", "raw", "status", "param"), RAW_CASES,
                         ids=[repr(raw[:24]) for _, raw, _, _ in RAW_CASES])
def test_raw_body_is_refused_naming_what_is_wrong(server: RunningServer, route: str, raw: bytes,
                                                  status: int, param: str | None) -> None:
    resp = httpx.post(f"{server.base_url}{route}", content=raw, timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error",
                                                              None)


@pytest.mark.parametrize(("raw", "words"), [
    # the offset of bad JSON was the param ("36"): now the message says where and why
    (b'{"model": "tiny-llama",', "not valid JSON: Expecting property name"),
    (b'{"model": "tiny-llama", "prompt": "x", "temperature": NaN}', "finite number"),
    (b'{"model": "tiny-llama", "prompt": [-5]}', "greater than or equal to 0"),
    (b"[1]", "must be a JSON object"),
])
def test_messages_say_what_is_wrong(server: RunningServer, raw: bytes, words: str) -> None:
    resp = httpx.post(f"{server.base_url}/v1/completions", content=raw, timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert words in resp.json()["error"]["message"], resp.text


def test_logit_bias_steers_the_tokens(server: RunningServer) -> None:
    """OpenAI's logit_bias was refused (issue 49); +100 on one id makes greedy pick it."""
    body = {**OK_COMPLETION, "max_tokens": 4, "temperature": 0, "return_token_ids": True,
            "logit_bias": {"77": 100}, "ignore_eos": True}
    resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == [77] * 4
