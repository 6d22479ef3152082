"""The Responses API through two router replicas over one real tiny engine, driven by the
official `openai` client: streamed and not, `previous_response_id` across the replicas (one
asks the other), a JSON-schema `text.format`, a named function tool, bad input in the API's
error shape; vLLM's /tokenize and /detokenize through the router; the translation tables."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import uvicorn
from router_real_engines import start_engine, stop_all, wait_ready

from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.router.app import build_app
from kvpilot.engine.router.response_store import ResponseStore
from kvpilot.engine.router.responses_api import ResponsesError, parse_request

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1,
                                                    "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 6}},
                          "required": ["city"], "additionalProperties": False}}


@contextlib.asynccontextmanager
async def routers(engine_url: str) -> AsyncIterator[list[str]]:
    """Runs two router replicas over `engine_url`, each the other's response-store peer."""
    socks = []
    for _ in range(2):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    servers, tasks = [], []
    for i, sock in enumerate(socks):
        args = RouterArgs(instances=engine_url, refresh_interval=0.2,
                          response_store_peers=urls[1 - i])
        server = uvicorn.Server(uvicorn.Config(build_app(args), log_level="warning"))
        servers.append(server)
        tasks.append(asyncio.create_task(server.serve(sockets=[sock])))
    try:
        async with httpx.AsyncClient() as client:
            for url in urls:
                for _ in range(300):
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(url + "/ready")).status_code == 200:
                            break
                    await asyncio.sleep(0.05)
        yield urls
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        for sock in socks:
            sock.close()


@pytest.mark.slow
async def test_the_openai_client_speaks_responses_through_two_routers(tmp_path):
    engines = [start_engine(tmp_path / "engine.log")]
    try:
        await asyncio.to_thread(wait_ready, engines)
        async with routers(engines[0][1]) as (a, b):
            first = openai.AsyncOpenAI(base_url=a + "/v1", api_key="none")
            second = openai.AsyncOpenAI(base_url=b + "/v1", api_key="none")

            turn1 = await first.responses.create(
                model="tiny-llama", input="Name a city.", instructions="Be brief.",
                max_output_tokens=12, temperature=0)
            assert turn1.id.startswith("resp_") and turn1.object == "response"
            assert turn1.status == "incomplete"  # random weights run to max_output_tokens
            assert turn1.incomplete_details and \
                turn1.incomplete_details.reason == "max_output_tokens"
            assert turn1.usage and turn1.usage.output_tokens == 12 and turn1.output_text

            # the next turn reaches the other replica, which asks the first for the history
            turn2 = await second.responses.create(
                model="tiny-llama", input="And another?", previous_response_id=turn1.id,
                max_output_tokens=8, temperature=0)
            assert turn2.previous_response_id == turn1.id
            assert turn2.usage and turn2.usage.input_tokens > turn1.usage.input_tokens + 12

            # streamed, continuing turn 2 on the first replica (turn 2 is held by the second)
            kinds, deltas, done = [], [], None
            stream = await first.responses.create(
                model="tiny-llama", input=[{"role": "user", "content": [
                    {"type": "input_text", "text": "Once more."}]}],
                previous_response_id=turn2.id, max_output_tokens=10, temperature=0,
                stream=True)
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                if event.type in ("response.completed", "response.incomplete"):
                    done = event.response
            assert kinds[:2] == ["response.created", "response.in_progress"]
            assert kinds[-1] == "response.incomplete" and done is not None
            assert {"response.output_item.added", "response.content_part.added",
                    "response.output_text.done", "response.output_item.done"} <= set(kinds)
            assert "".join(deltas) == done.output_text and done.usage
            assert done.usage.output_tokens == 10

            # structured output through text.format
            shaped = await second.responses.create(
                model="tiny-llama", input="Plan a trip.", max_output_tokens=120, temperature=1,
                text={"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA,
                                 "strict": True}})
            jsonschema.validate(json.loads(shaped.output_text), SCHEMA)

            # a named function tool: the reply is a function_call item
            called = await first.responses.create(
                model="tiny-llama", input="Weather in Oslo?", tools=[WEATHER],
                tool_choice={"type": "function", "name": "weather"}, max_output_tokens=60)
            call = next(item for item in called.output if item.type == "function_call")
            assert call.name == "weather" and "city" in json.loads(call.arguments)

            # bad input: the Responses API's error object, naming the field
            with pytest.raises(openai.BadRequestError) as bad:
                await first.responses.create(model="tiny-llama", input=[
                    {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
            assert bad.value.body["param"] == "input[0].content[0].type"  # type: ignore[index]
            with pytest.raises(openai.NotFoundError) as missing:
                await second.responses.create(model="tiny-llama", input="hi",
                                              previous_response_id="resp_nothing")
            assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
            # another API key cannot read the conversation
            stranger = openai.AsyncOpenAI(base_url=a + "/v1", api_key="someone-else")
            with pytest.raises(openai.NotFoundError):
                await stranger.responses.create(model="tiny-llama", input="hi",
                                                previous_response_id=turn1.id)

            async with httpx.AsyncClient(base_url=b, timeout=30) as client:
                tokens = (await client.post("/tokenize", json={
                    "model": "tiny-llama", "prompt": "hello world"})).json()
                assert tokens["count"] == len(tokens["tokens"]) > 0
                text = (await client.post("/detokenize", json={
                    "model": "tiny-llama", "tokens": tokens["tokens"]})).json()["prompt"]
                assert text.endswith("hello world")
                chat = (await client.post("/tokenize", json={
                    "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
                    "return_token_strs": True})).json()
                assert chat["count"] > 2 and len(chat["token_strs"]) == chat["count"]
                bad_ids = await client.post("/detokenize", json={"tokens": [10**6]})
                assert bad_ids.status_code == 400 and bad_ids.json()["error"]["param"] == "tokens"
    finally:
        stop_all(engines)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": "x", "frobnicate": 1}, "frobnicate"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"model": "m", "input": [{"type": "input_file"}]}, "input[0].type"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema"}}},
     "text.format.schema"),
])
def test_bad_requests_name_the_field(body: dict[str, Any], param: str):
    with pytest.raises(ResponsesError) as refused:
        parse_request(body)
    assert refused.value.param == param and refused.value.status == 400


def test_a_request_becomes_a_chat():
    request = parse_request({
        "model": "m", "instructions": "be kind", "max_output_tokens": 5, "temperature": 0.5,
        "stream": True, "input": [
            {"role": "developer", "content": "rules"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                         {"type": "input_text", "text": "b"}]}],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "weather"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}}})
    chat = request.chat_body([{"role": "user", "content": "before"}])
    assert chat["messages"] == [
        {"role": "system", "content": "be kind"}, {"role": "user", "content": "before"},
        {"role": "system", "content": "rules"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "user", "content": "ab"}]
    assert (chat["max_tokens"], chat["temperature"], chat["stream_options"]) == \
        (5, 0.5, {"include_usage": True})
    assert chat["tools"][0]["function"]["name"] == "weather"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "s", "schema": SCHEMA}}


def test_the_store_is_bounded_per_tenant_and_expires(monkeypatch):
    store = ResponseStore(max_entries=2, ttl=10)
    now = [100.0]
    monkeypatch.setattr("kvpilot.engine.router.response_store.time.monotonic",
                        lambda: now[0])
    store.put("r1", "alice", [{"role": "user", "content": "1"}])
    store.put("r2", "alice", [])
    assert store.local("r1", "bob") is None  # another key
    assert store.local("r1", "alice") == [{"role": "user", "content": "1"}]
    store.put("r3", "alice", [])  # r2 is now the least recently used
    assert store.local("r2", "alice") is None and len(store) == 2
    now[0] += 11
    assert store.local("r1", "alice") is None  # expired
