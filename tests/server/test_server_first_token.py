"""What a disaggregated fleet's router asks of engines (issue 22): the prefill's token ids
(`return_token_ids`), the decode leg's given first token (`first_token_id`) and its id
(`x-kvpilot-request-id`)."""

from __future__ import annotations

import httpx
from server_harness import MODEL, RunningServer

from kvpilot.engine.contracts.router_args import REQUEST_ID_HEADER

PROMPT = [100 + i for i in range(20)]
GREEDY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
          "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4,
        "temperature": 0, "ignore_eos": True}


def post(server: RunningServer, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def test_token_ids_come_back_only_when_asked(server: RunningServer) -> None:
    for path, body in (("/v1/completions", GREEDY), ("/v1/chat/completions", CHAT)):
        plain = post(server, path, body).json()["choices"][0]
        assert "token_ids" not in plain
        asked = post(server, path, {**body, "return_token_ids": True}).json()["choices"][0]
        assert len(asked["token_ids"]) == body["max_tokens"]
        # the ids are the answer's: the first one given back yields the same answer
        again = post(server, path, {**body, "first_token_id": asked["token_ids"][0],
                                    "return_token_ids": True}).json()["choices"][0]
        assert again["token_ids"] == asked["token_ids"]


def test_a_given_first_token_leads_the_answer(server: RunningServer) -> None:
    ids = post(server, "/v1/completions", {**GREEDY, "return_token_ids": True}
               ).json()["choices"][0]["token_ids"]
    other = (ids[0] + 11) % 900 + 20
    forced = post(server, "/v1/completions", {**GREEDY, "first_token_id": other,
                                              "return_token_ids": True}).json()
    assert forced["choices"][0]["token_ids"][0] == other
    # the rest is greedy after prompt + that token
    after = post(server, "/v1/completions", {**GREEDY, "prompt": [*PROMPT, other],
                                             "max_tokens": 5, "return_token_ids": True}).json()
    assert forced["choices"][0]["token_ids"][1:] == after["choices"][0]["token_ids"]


def test_the_routers_request_id_names_the_response(server: RunningServer) -> None:
    reply = post(server, "/v1/completions", GREEDY, **{REQUEST_ID_HEADER: "cmpl-router-7"})
    assert reply.json()["id"] == "cmpl-router-7"
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions",
                      json={**CHAT, "stream": True}, headers={REQUEST_ID_HEADER: "chat-9"},
                      timeout=60) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert lines and all('"id":"chat-9"' in line for line in lines)
    bad = post(server, "/v1/completions", GREEDY, **{REQUEST_ID_HEADER: "no spaces"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == REQUEST_ID_HEADER


def test_a_running_request_id_is_refused(server: RunningServer) -> None:
    body = {**GREEDY, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      headers={REQUEST_ID_HEADER: "busy-1"}, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        again = post(server, "/v1/completions", GREEDY, **{REQUEST_ID_HEADER: "busy-1"})
        assert again.status_code == 400, again.text
        assert "already running" in again.json()["error"]["message"]
